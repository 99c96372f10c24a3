"""LoRA adapters: a row names one (OpenAI body.model or an adapter field) and that adapter answers it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing here may reach a model hub
pytest.importorskip("peft")

from byte_model import build_byte_model, build_lora  # noqa: E402

from bij.engines.base import EngineConfig, Request  # noqa: E402
from bij.engines.transformers import TransformersEngine  # noqa: E402
from bij.worker.adapters import AdapterError, cache_root, fetch_adapter  # noqa: E402

PROMPTS = ["the quick", "brown fox", "jumps the", "fox the quick brown"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    base = build_byte_model(tmp_path_factory.mktemp("base"))
    return (base, build_lora(base, tmp_path_factory.mktemp("fr"), seed=1),
            build_lora(base, tmp_path_factory.mktemp("de"), seed=2))


def outputs(engine: Any, adapter: str | None) -> list[str | None]:
    return [r.output for r in engine.run([Request(text=t, max_tokens=12, adapter=adapter) for t in PROMPTS])]


def test_each_adapter_answers_its_rows_and_the_base_model_the_rest(models: tuple[Path, Path, Path]) -> None:
    base, fr, de = models
    plain = TransformersEngine(EngineConfig(task="generate", name=str(base), device="cpu"))
    plain.load()
    assert "adapters" not in plain.honours
    engine = TransformersEngine(EngineConfig(task="generate", name=str(base), device="cpu",
                                             adapters={"fr": str(fr), "de": str(de)}))
    engine.load()
    assert "adapters" in engine.honours
    by_base, by_fr, by_de = outputs(engine, None), outputs(engine, "fr"), outputs(engine, "de")
    assert by_base == outputs(plain, None)  # the adapters are off for base rows
    assert by_fr != by_base and by_de != by_base and by_fr != by_de
    # One batch of mixed rows answers each row as its adapter alone does.
    mixed = engine.run([Request(text=t, max_tokens=12, adapter=a) for t in PROMPTS for a in (None, "fr", "de")])
    assert [r.output for r in mixed] == [o for trio in zip(by_base, by_fr, by_de, strict=True) for o in trio]


def test_an_s3_adapter_is_fetched_once_into_the_model_cache(models: tuple[Path, Path, Path], s3_place: Any,
                                                            tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, fr, _ = models
    for f in fr.iterdir():
        s3_place.storage.write_bytes(s3_place.uri("adapters/fr/", f.name), f.read_bytes())
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    uri = s3_place.uri("adapters/fr/")
    s3 = {"endpointUrl": s3_place.endpoint}
    local = Path(fetch_adapter("fr", uri, s3))
    assert local.parent == cache_root() and sorted(p.name for p in local.iterdir()) == sorted(
        p.name for p in fr.iterdir())
    assert (local / "adapter_model.safetensors").read_bytes() == (fr / "adapter_model.safetensors").read_bytes()
    stamp = (local / "adapter_config.json").stat().st_mtime_ns
    assert fetch_adapter("fr", uri, s3) == str(local)
    assert (local / "adapter_config.json").stat().st_mtime_ns == stamp  # reused, not fetched again
    with pytest.raises(AdapterError, match="nothing at"):
        fetch_adapter("gone", s3_place.uri("adapters/gone/"), s3)
    with pytest.raises(AdapterError, match="not a LoRA adapter folder"):
        fetch_adapter("base", f"file://{models[0]}", None)


def test_a_job_routes_rows_by_openai_model_and_refuses_unknown_names(models: tuple[Path, Path, Path], file_place: Any,
                                                                      make_job: Any, bij_bin: Any,
                                                                      read_output: Any) -> None:
    base, fr, de = models

    def line(cid: str, model: str) -> dict[str, Any]:
        return {"custom_id": cid, "url": "/v1/completions",
                "body": {"model": model, "prompt": "the quick", "max_tokens": 12}}

    lines = [line("b", str(base)), line("f", "fr"), line("d", "de"), line("x", "gpt-4o-mini"), line("f2", "fr")]
    path, job = make_job(
        file_place, file_place.write_jsonl("batch.jsonl", lines), input={"format": "openai"},
        model={"engine": "transformers", "name": str(base), "task": "generate",
               "adapters": [{"name": "fr", "uri": f"file://{fr}"}, {"name": "de", "uri": f"file://{de}"}]},
        workers={"parallelism": 1, "backoffLimitPerIndex": 0})
    proc = subprocess.run([bij_bin("bij"), "run", str(path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = read_output(job)
    bodies = {r["custom_id"]: r["response"]["body"] for r in out.results}
    assert sorted(bodies) == ["b", "d", "f", "f2"]
    assert {k: b["model"] for k, b in bodies.items()} == {"b": str(base), "d": "de", "f": "fr", "f2": "fr"}
    text = {k: b["choices"][0]["text"] for k, b in bodies.items()}
    assert text["f"] == text["f2"] and len({text["b"], text["f"], text["d"]}) == 3
    (err,) = out.errors
    assert err["custom_id"] == "x" and err["error"]["code"] == "invalid_request"
    assert "unknown model \"gpt-4o-mini\"" in err["error"]["message"] and "adapters de, fr" in err["error"]["message"]


def test_an_adapter_row_on_an_engine_without_adapters_is_unsupported() -> None:
    from bij.worker.input_row import InputOptions
    from bij.worker.inputs import parse_line

    opts = InputOptions(task="generate", engine="echo", honours=frozenset({"maxTokens"}), adapters=frozenset({"fr"}))
    line = json.dumps({"id": 1, "text": "x", "adapter": "fr"}).encode()
    row = parse_line(line, (0, 0, len(line)), "in", opts)
    assert row.error_code == "unsupported" and row.error == "engine echo cannot honour field 'adapter' (a LoRA adapter)"
    line = json.dumps({"id": 1, "text": "x", "adapter": "es"}).encode()
    row = parse_line(line, (0, 0, len(line)), "in", opts)
    assert row.error_code == "invalid_request" and "unknown adapter \"es\" (model.adapters: fr)" in str(row.error)


def test_adapters_are_fetched_with_a_shard_to_work_just_before_the_model_loads(
        models: tuple[Path, Path, Path], file_place: Any, make_job: Any, worker_env: Any, bij_bin: Any) -> None:
    from bij.contract import layout
    from bij.contract.records import encode, shard_record
    from bij.steps.planner import plan_round
    from bij.worker.shard import load_plan

    base, _, _ = models
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", [{"id": 1, "text": "the quick"}]),
                      model={"engine": "transformers", "name": str(base), "task": "generate",
                             "adapters": [{"name": "fr", "uri": f"file://{file_place.base[7:]}no-adapter-here"}]},
                      workers={"parallelism": 1, "backoffLimitPerIndex": 0})
    plan_round(job, 0)
    manifest = layout.round_manifest_uri(job, 0)

    def worker() -> subprocess.CompletedProcess[str]:
        env = {**worker_env(file_place), "JOB_COMPLETION_INDEX": "0"}
        return subprocess.run([bij_bin("bij-worker"), "--manifest", manifest, "--progress"], env=env,
                              capture_output=True, text=True, timeout=300)

    failed = worker()
    assert failed.returncode == 42 and "spec.model.adapters fr:" in failed.stderr
    assert '"loaded"' not in failed.stdout
    plan = load_plan(manifest, job.spec.storage.s3)
    counts = {"rows": 1, "errors": 0}
    for i in range(len(plan.shards)):  # the round finished elsewhere meanwhile
        file_place.storage.write_bytes(layout.done_uri(plan.round_prefix, i),
                                       encode(shard_record(i, 0, 0, counts, 1.0, finished=True)))  # type: ignore[arg-type]
    idle = worker()  # nothing left to claim: nothing to fetch, nothing to load
    assert idle.returncode == 0, idle.stderr[-2000:]
