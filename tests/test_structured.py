"""Structured output: constrained decoding gives valid output on a random-weight model, row by row."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing here may reach a model hub
pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from bij_worker.engines.base import EngineConfig, Request  # noqa: E402
from bij_worker.engines.transformers import TransformersEngine  # noqa: E402
from bij_worker.sampling import Sampling, json_schema_text  # noqa: E402
from byte_model import build_byte_model  # noqa: E402

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "ok": {"type": "boolean"},
                                      "name": {"type": "string", "pattern": "^[a-z]{1,6}$"}},
     "required": ["answer", "ok", "name"], "additionalProperties": False},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"label": {"enum": ["cat", "dog", "bird"]}}, "required": ["label"],
     "additionalProperties": False},
]


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_byte_model(tmp_path_factory.mktemp("bytes"))


@pytest.fixture(scope="module")
def engine(byte_model: Path) -> Any:
    e = TransformersEngine(EngineConfig(task="generate", name=str(byte_model), device="cpu"))
    e.load()
    return e


def test_every_row_follows_its_own_json_schema_on_a_random_model(engine: Any) -> None:
    assert "structuredOutput" in engine.honours
    reqs = [Request(text="the fox", max_tokens=64, temperature=1.0, seed=i,
                    sampling=Sampling(structured_output=("json_schema", json_schema_text("s", SCHEMAS[i % 3]))))
            for i in range(12)]
    free = engine.run([Request(text="the fox", max_tokens=24, temperature=1.0, seed=1)])[0].output
    with pytest.raises(ValueError):
        json.loads(free)  # unconstrained, the random model writes no JSON
    for i, res in enumerate(engine.run(reqs)):
        assert res.error is None and res.extra["finish_reason"] == "stop", res
        jsonschema.validate(json.loads(res.output), SCHEMAS[i % 3])


def test_regex_and_choice_constrain_the_output(engine: Any) -> None:
    asks = [("regex", "[a-c]{3}-[0-9]{2}"), ("choice", '["red", "green", "blue"]')]
    reqs = [Request(text="x", max_tokens=20, temperature=1.0, seed=s, sampling=Sampling(structured_output=a))
            for a in asks for s in range(4)]
    outs = [r.output for r in engine.run(reqs)]
    assert all(re.fullmatch(r"[a-c]{3}-[0-9]{2}", o) for o in outs[:4])
    assert all(o in ("red", "green", "blue") for o in outs[4:])


def test_any_json_object_is_an_object_whenever_it_finishes(engine: Any) -> None:
    """An open object has no bound a random model keeps to (it writes keys of any length); whatever
    finishes is a JSON object, and what the token cap cut says so (finish_reason length)."""
    reqs = [Request(text="x", max_tokens=300, temperature=1.0, seed=s,
                    sampling=Sampling(structured_output=("json_object", ""))) for s in range(8)]
    results = engine.run(reqs)
    finished = [r for r in results if r.extra["finish_reason"] == "stop"]
    assert finished
    for r in finished:
        assert isinstance(json.loads(r.output), dict)
    for r in results:
        assert r.output.startswith("{") and (r.extra["finish_reason"] == "stop" or r.completion_tokens == 300)


def test_a_grammar_that_cannot_compile_fails_its_row_alone(engine: Any) -> None:
    bad, good = engine.run([
        Request(text="x", max_tokens=8, sampling=Sampling(structured_output=("grammar", "root ::= undefined_rule"))),
        Request(text="x", max_tokens=8, sampling=Sampling(structured_output=("choice", '["only"]'))),
    ])
    assert bad.error is not None and "structured output (grammar) cannot be compiled" in bad.error
    assert good.output == "only"


def test_with_the_judges_schema_as_structured_output_every_row_passes_at_round_zero(
        byte_model: Path, file_place: Any, make_job: Any, bij_bin: Any) -> None:
    import subprocess

    schema = SCHEMAS[0]
    rows = [{"id": i, "text": f"row {i} says"} for i in range(20)]
    path, job = make_job(
        file_place, file_place.write_jsonl("in.jsonl", rows),
        model={"engine": "transformers", "name": str(byte_model), "task": "generate", "maxTokens": 64,
               "temperature": 1.0, "structuredOutput": {"jsonSchema": schema}},
        judge={"type": "jsonSchema", "schema": schema, "maxRounds": 3},
        workers={"parallelism": 1, "backoffLimitPerIndex": 0})
    proc = subprocess.run([bij_bin("bij"), "run", str(path)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads((Path(job.spec.output.uri.removeprefix("file://")) / "manifest.json").read_text())
    assert manifest["counts"]["rows"] == 20 and manifest["counts"]["errors"] == 0
    assert manifest["counts"].get("capped", 0) == 0
    (only,) = manifest["rounds"]  # no second judge round was needed
    assert (only["approved"], only["rejected"], only["approvalRate"]) == (20, 0, 1.0)


def test_openai_response_format_reaches_the_engine_as_structured_output() -> None:
    from bij_worker.inputs import InputOptions, parse_line

    opts = InputOptions(format="openai", task="chat", engine="transformers",
                        honours=frozenset({"structuredOutput", "maxTokens", "temperature", "seed"}))
    body = {"messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "strict": True,
                                                                       "schema": SCHEMAS[2]}}}
    line = json.dumps({"custom_id": "a", "url": "/v1/chat/completions", "body": body}).encode()
    row = parse_line(line, (0, 0, len(line)), "in", opts)
    assert row.request.sampling.structured_output == ("json_schema", json_schema_text("s", SCHEMAS[2]))
    body["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": 7}}}
    line = json.dumps({"custom_id": "a", "url": "/v1/chat/completions", "body": body}).encode()
    row = parse_line(line, (0, 0, len(line)), "in", opts)
    assert row.error_code == "invalid_request" and "is not a valid JSON Schema" in str(row.error)
    echo = InputOptions(format="openai", task="chat", engine="echo", honours=frozenset({"maxTokens"}))
    body["response_format"] = {"type": "json_object"}
    line = json.dumps({"custom_id": "a", "url": "/v1/chat/completions", "body": body}).encode()
    row = parse_line(line, (0, 0, len(line)), "in", echo)
    assert row.error == "engine echo cannot honour body.response_format"
