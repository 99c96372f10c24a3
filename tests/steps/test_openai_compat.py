"""OpenAI batch output lines parse with the `openai` SDK's own response models.

Code that already reads OpenAI Batch API results reads ours: every body (chat completion,
completion, embedding) and every error line validates against the SDK, so the format cannot
drift from what clients read.
"""

from __future__ import annotations

from typing import Any

import pytest

from bij.local.publish import publish_manifest

openai_types = pytest.importorskip("openai.types")
chat_types = pytest.importorskip("openai.types.chat")


def request(cid: str, url: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": url, "body": {"model": "m", **body}}


CASES = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello there"}]},
             chat_types.ChatCompletion),
    "generate": ("/v1/completions", {"prompt": "once upon a time"}, openai_types.Completion),
    "embed": ("/v1/embeddings", {"input": "a sentence to embed"}, openai_types.CreateEmbeddingResponse),
}


@pytest.mark.parametrize("task", sorted(CASES))
def test_result_bodies_and_error_lines_validate_against_the_openai_sdk(
        task: str, file_place, make_job, run_shards, read_output) -> None:
    url, body, model = CASES[task]
    lines = [request("ok-1", url, body), request("bad-1", url, {"max_tokens": 0, **body}),
             request("ok-2", url, body), "not json", request("ok-1", url, body)]
    _, job = make_job(file_place, file_place.write_jsonl("batch.jsonl", lines),
                      input={"format": "openai"}, model={"task": task})
    run_shards(job)
    publish_manifest(job)
    out = read_output(job)
    assert [r["custom_id"] for r in out.results] == ["ok-1", "ok-2"]
    for line in out.results:
        assert line["response"]["status_code"] == 200 and line["error"] is None
        parsed = model.model_validate(line["response"]["body"])
        if task == "embed":
            assert len(parsed.data[0].embedding) > 0 and parsed.usage.prompt_tokens > 0
        else:
            assert parsed.created > 0 and parsed.choices[0].finish_reason in ("stop", "length")
            assert parsed.usage is not None and parsed.usage.total_tokens > 0
    # The second ok-1 is a duplicate_id line, in the same shape as every other error line.
    assert [(e["custom_id"], e["error"]["code"]) for e in out.errors] == [
        ("bad-1", "invalid_request"), (None, "invalid_json"), ("ok-1", "duplicate_id")]
    for line in out.errors:
        assert line["response"] is None
        err = openai_types.BatchError.model_validate(line["error"])
        assert err.code and err.message


def test_list_inputs_answer_one_line_with_an_item_per_input_in_the_sdks_shapes(
        file_place, make_job, run_shards, read_output) -> None:
    """An embeddings `input` list is one line with a `data` item per input (`index` set); a completions
    `prompt` list is one line with a choice per prompt; a failing input fails its whole line, naming it."""
    import base64
    import struct

    from bij.engines.echo import echo_embedding

    embed, complete = "/v1/embeddings", "/v1/completions"
    lines = [request("three", embed, {"input": ["alpha", "beta gamma", "delta"]}),
             request("one", embed, {"input": "alpha"}),
             request("packed", embed, {"input": ["alpha", "beta gamma"], "encoding_format": "base64"}),
             request("ids", embed, {"input": [[1, 2], [3]]}),
             request("long", embed, {"input": ["short", "word " * 40]})]
    _, job = make_job(file_place, file_place.write_jsonl("e.jsonl", lines), input={"format": "openai"},
                      model={"task": "embed", "maxInputTokens": 8, "truncate": False},
                      sharding={"targetShardBytes": 4096, "chunkRows": 2})
    run_shards(job)
    publish_manifest(job)
    out = read_output(job)
    bodies = {r["custom_id"]: r["response"]["body"] for r in out.results}
    assert list(bodies) == ["three", "one", "packed"]
    three = openai_types.CreateEmbeddingResponse.model_validate(bodies["three"])
    assert [(d.index, d.embedding) for d in three.data] == [
        (i, echo_embedding(t)) for i, t in enumerate(["alpha", "beta gamma", "delta"])]
    assert three.usage.prompt_tokens == 1 + 2 + 1  # every input counts (echo: 4 bytes a token)
    assert [d["embedding"] for d in bodies["one"]["data"]] == [echo_embedding("alpha")]
    packed = bodies["packed"]["data"]
    assert [d["index"] for d in packed] == [0, 1]
    for d, text in zip(packed, ["alpha", "beta gamma"], strict=True):
        raw = base64.b64decode(d["embedding"])  # little-endian float32, as OpenAI's
        assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(echo_embedding(text), rel=1e-6)
    errors = {e["custom_id"]: e["error"] for e in out.errors}
    assert errors["ids"] == {"code": "unsupported", "message": "engine echo cannot honour body.input as token ids"}
    assert errors["long"]["code"] == "too_many_tokens"
    assert errors["long"]["message"].startswith("body.input[1]: prompt has 50 tokens")
    assert out.manifest["counts"]["rows"] == 3 and out.manifest["counts"]["errors"] == 2  # lines, not inputs

    lines = [request("two", complete, {"prompt": ["once upon", "a time"], "max_tokens": 16}),
             request("solo", complete, {"prompt": "the end"})]
    _, job = make_job(file_place, file_place.write_jsonl("c.jsonl", lines), input={"format": "openai"},
                      model={"task": "generate"}, name="c", out_dir="out-c/")
    run_shards(job)
    publish_manifest(job)
    out = read_output(job)
    two, solo = (openai_types.Completion.model_validate(r["response"]["body"]) for r in out.results)
    assert [(c.index, c.text) for c in two.choices] == [(0, "once upon"), (1, "a time")]
    assert (two.usage.prompt_tokens, two.usage.completion_tokens) == (2 + 1, 2 + 1)
    assert [(c.index, c.text) for c in solo.choices] == [(0, "the end")]


def test_several_prompts_with_n_answers_are_numbered_prompt_major_as_openai_does() -> None:
    from bij.engines.base import Choice, Result
    from bij.worker.input_row import InputOptions, Row
    from bij.worker.result_rows import merged_result, result_row

    def answers(prompt: str) -> Result:
        return Result(output=f"{prompt}0", prompt_tokens=2, completion_tokens=2,
                      choices=[Choice(f"{prompt}{j}", 1, "stop") for j in range(2)])

    row = Row(at=(0, 0, 1), id="r", url="/v1/completions", parts=[])
    res = merged_result(row, [answers("p"), answers("q"), answers("r")])
    body = result_row(row, res, InputOptions(format="openai", task="generate"))["response"]["body"]
    parsed = openai_types.Completion.model_validate(body)
    assert [(c.index, c.text) for c in parsed.choices] == [(0, "p0"), (1, "p1"), (2, "q0"), (3, "q1"), (4, "r0"),
                                                           (5, "r1")]
    assert (parsed.usage.prompt_tokens, parsed.usage.completion_tokens, parsed.usage.total_tokens) == (6, 6, 12)
    failed = merged_result(row, [answers("p"), Result(error="boom", extra={"code": "engine_rejected"})])
    assert (failed.error, failed.extra["code"]) == ("body.prompt[1]: boom", "engine_rejected")


def test_a_continuous_engine_answers_every_prompt_of_a_line_in_that_line(
        file_place, make_job, run_shards, read_output) -> None:
    """The simulated engine runs prompts as vLLM does, each on its own in the running batch: a line's
    prompts come back in any order and are answered together, in their order, once."""
    prompts = [" ".join(["w"] * k) for k in (7, 1, 4)]
    lines = [request(f"r{i}", "/v1/completions", {"prompt": prompts[i:] + prompts[:i], "max_tokens": 16})
             for i in range(3)]
    _, job = make_job(file_place, file_place.write_jsonl("c.jsonl", lines), input={"format": "openai"},
                      model={"engine": "simulated", "task": "generate"})
    from bij.engines.base import EngineConfig
    from bij.engines.simulated import SimulatedEngine

    run_shards(job, SimulatedEngine(EngineConfig(task="generate", simulated={"stepSeconds": 0, "maxNumSeqs": 4})))
    publish_manifest(job)
    out = read_output(job)
    assert [r["custom_id"] for r in out.results] == ["r0", "r1", "r2"] and out.errors == []
    for i, line in enumerate(out.results):
        parsed = openai_types.Completion.model_validate(line["response"]["body"])
        assert [(c.index, c.text) for c in parsed.choices] == list(enumerate(prompts[i:] + prompts[:i]))
        assert parsed.usage.prompt_tokens == 12  # the words of all three prompts


def test_a_judge_job_refuses_a_line_with_several_prompts_naming_why() -> None:
    """A judge approves one answer per row: a line with several prompts is an error row there."""
    import json

    from bij.engines.base import EngineConfig
    from bij.engines.echo import EchoEngine
    from bij.worker.input_row import InputOptions
    from bij.worker.prepare import Preparer

    opts = InputOptions(format="openai", task="generate", engine="echo", honours=frozenset({"maxTokens"}))
    prep = Preparer(opts, EchoEngine(EngineConfig(task="generate")), ["in.jsonl"], max_input_tokens=None,
                    storage_for=lambda uri: None, corrupt=lambda *a: None)  # type: ignore[arg-type,return-value]
    lines = [json.dumps(request(cid, "/v1/completions", {"prompt": prompt})).encode()
             for cid, prompt in (("two", ["a", "b"]), ("one", ["a"]))]
    rows, records = prep.rows([((0, i, i + 1), line) for i, line in enumerate(lines)])
    assert [r.id for r, _ in rows] == ["one"]
    (record,) = records
    assert record["row"]["error"] == {"code": "unsupported",
                                      "message": "a judge job answers one prompt per row; this row holds 2"}


@pytest.mark.parametrize("matryoshka", [False, True], ids=["plain-config", "matryoshka-config"])
def test_all_minilm_answers_input_lists_in_base64_and_dimensions_only_where_declared(
        matryoshka: bool, file_place, make_job, run_shards, read_output, tmp_path) -> None:
    """The real embedding model (all-MiniLM-L6-v2 on sentence-transformers): a list `input` is one line
    with a `data` item per input, base64 is its float32 vector; `dimensions` is refused by the model as
    shipped, and honoured (head, normalised again) by the same weights with a Matryoshka config."""
    import base64
    import json
    import math
    import shutil
    import struct

    from bij.engines import create_engine
    from bij.engines.base import EngineConfig, Request
    from bij.engines.sentence_transformers import default_model_path

    path = tmp_path / "minilm"
    shutil.copytree(default_model_path(), path)
    if matryoshka:
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, "is_matryoshka": True}))
    engine = create_engine("sentence-transformers", EngineConfig(task="embed", name=str(path), device="cpu"))
    url = "/v1/embeddings"
    texts = ["A cat sits on the mat.", "Stock markets fell sharply today."]
    lines = [request("list", url, {"input": texts}),
             request("packed", url, {"input": texts[0], "encoding_format": "base64"}),
             request("short", url, {"input": texts, "dimensions": 64})]
    _, job = make_job(file_place, file_place.write_jsonl("e.jsonl", lines), input={"format": "openai"},
                      model={"engine": "sentence-transformers", "task": "embed"})
    run_shards(job, engine)
    publish_manifest(job)
    out = read_output(job)
    bodies = {r["custom_id"]: r["response"]["body"] for r in out.results}
    alone = [r.embedding for r in engine.run([Request(text=t) for t in texts])]
    listed = openai_types.CreateEmbeddingResponse.model_validate(bodies["list"])
    assert [d.index for d in listed.data] == [0, 1]
    for d, vec in zip(listed.data, alone, strict=True):
        assert d.embedding == pytest.approx(vec, abs=1e-5)
    raw = base64.b64decode(bodies["packed"]["data"][0]["embedding"])
    assert list(struct.unpack("<384f", raw)) == pytest.approx(alone[0], abs=1e-6)
    if not matryoshka:
        assert [(e["custom_id"], e["error"]) for e in out.errors] == [
            ("short", {"code": "unsupported", "message": "engine sentence-transformers cannot honour body.dimensions"})]
        return
    short = openai_types.CreateEmbeddingResponse.model_validate(bodies["short"])
    for d, vec in zip(short.data, alone, strict=True):
        norm = math.sqrt(sum(v * v for v in vec[:64]))
        assert len(d.embedding) == 64 and d.embedding == pytest.approx([v / norm for v in vec[:64]], abs=1e-5)
    assert out.errors == []


def test_a_line_of_several_prompts_is_durable_whole_or_not_at_all_and_a_rerun_runs_only_the_rest(
        file_place, make_job, run_shards, recording_echo, read_output) -> None:
    """Every prompt of a line is committed with its line, in one chunk: a shard stopped after some
    chunks keeps whole lines only, and the rerun runs exactly the prompts of the lines not yet durable."""
    from bij.worker.shard import StopFlag

    lines = [request(f"r{i}", "/v1/completions", {"prompt": [f"p{i} {k}" for k in range(1 + i % 4)]})
             for i in range(60)]
    _, job = make_job(file_place, file_place.write_jsonl("c.jsonl", lines), input={"format": "openai"},
                      sharding={"chunkRows": 6, "targetShardBytes": 1 << 20},
                      batching={"inFlightRows": 6, "commitQueueChunks": 1})
    stop = StopFlag()
    chunks: list[dict[str, Any]] = []

    def progress(ev: dict[str, Any]) -> None:
        chunks.extend([ev] if ev["event"] == "chunk" else [])
        if len(chunks) == 3:
            stop.request()

    first = run_shards(job, stop=stop, progress=progress)
    durable = first[0].rows
    assert first[0].status == "stopped" and 18 <= durable < 60 and durable % 6 == 0
    engine = recording_echo()
    assert run_shards(job, engine=engine)[0].rows == 60
    assert sorted(engine.seen) == sorted(p for line in lines[durable:] for p in line["body"]["prompt"])
    publish_manifest(job)
    out = read_output(job)
    assert [r["custom_id"] for r in out.results] == [f"r{i}" for i in range(60)] and out.errors == []
    for line, r in zip(lines, out.results, strict=True):
        assert [c["text"] for c in r["response"]["body"]["choices"]] == line["body"]["prompt"]


def test_one_prompt_that_breaks_the_engine_fails_its_line_alone_naming_it(
        file_place, make_job, run_shards, recording_echo, read_output) -> None:
    lines = [request(f"r{i}", "/v1/completions", {"prompt": ["fine", f"also {i}", "poison" if i == 3 else "ok"]})
             for i in range(8)]
    _, job = make_job(file_place, file_place.write_jsonl("c.jsonl", lines), input={"format": "openai"})
    run_shards(job, engine=recording_echo(fail_on="poison"))
    publish_manifest(job)
    out = read_output(job)
    assert [r["custom_id"] for r in out.results] == [f"r{i}" for i in range(8) if i != 3]
    (err,) = out.errors
    assert err["custom_id"] == "r3" and err["error"]["code"] == "engine_rejected"
    assert err["error"]["message"].startswith("body.prompt[2]: the engine failed on this row: RuntimeError")
