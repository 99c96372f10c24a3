"""spec.model.truncate: a prompt over the model's limit is cut and marked, or refused, per task."""

from __future__ import annotations

from typing import Any

import pytest

from bij.contract.spec import parse_spec
from bij.engines.echo import echo_embedding
from bij.local.publish import publish_manifest

LONG = "0123456789" * 10  # 100 bytes: 25 estimated tokens for the echo engine


def rows() -> list[dict[str, Any]]:
    return [{"id": 1, "text": "short"}, {"id": 2, "text": LONG}, {"id": "3", "text": "also short"}]


def spec_for(task: str, truncate: bool | None) -> dict[str, Any]:
    model: dict[str, Any] = {"engine": "echo", "task": task, "maxInputTokens": 5}
    if truncate is not None:
        model["truncate"] = truncate
    return model


@pytest.mark.parametrize(("task", "expected"), [("embed", True), ("generate", False), ("chat", False)])
def test_truncate_defaults_to_true_for_embed_only(task: str, expected: bool) -> None:
    spec = {"input": {"uri": "file:///in"}, "output": {"uri": "file:///out"}, "model": {"task": task}}
    assert parse_spec(spec).model.truncates is expected
    spec["model"]["truncate"] = not expected
    assert parse_spec(spec).model.truncates is (not expected)


def test_embed_cuts_a_long_row_marks_it_and_counts_it(file_place, make_job, run_shards, read_output) -> None:
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", rows()), model=spec_for("embed", None))
    run_shards(job)
    publish_manifest(job)
    out = read_output(job)
    assert out.errors == []
    by_id = {r["id"]: r for r in out.results}
    assert by_id[2]["truncated"] is True
    assert by_id[2]["embedding"] == echo_embedding(LONG[:20])  # the first 5 tokens' worth
    assert by_id[2]["usage"]["prompt_tokens"] == 5
    assert "truncated" not in by_id[1] and by_id[1]["embedding"] == echo_embedding("short")
    assert out.manifest["counts"]["truncated"] == 1 and out.manifest["counts"]["rows"] == 3


def test_truncate_false_keeps_a_long_embed_row_an_error(file_place, make_job, run_shards, read_output) -> None:
    from bij.worker.metrics import Metrics

    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", rows()), model=spec_for("embed", False))
    metrics = Metrics()
    run_shards(job, metrics=metrics)
    assert metrics.registry.get_sample_value("bij_row_errors_total", {"code": "too_many_tokens"}) == 1
    publish_manifest(job)
    out = read_output(job)
    assert [(e["id"], e["error"]["code"]) for e in out.errors] == [(2, "too_many_tokens")]
    assert out.manifest["counts"]["truncated"] == 0


def test_generate_refuses_long_prompts_unless_asked_to_truncate(file_place, make_job, run_shards,
                                                               read_output) -> None:
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", rows()), model=spec_for("generate", None))
    run_shards(job)
    publish_manifest(job)
    assert [e["error"]["code"] for e in read_output(job).errors] == ["too_many_tokens"]

    _, job = make_job(file_place, file_place.write_jsonl("in2.jsonl", rows()), out_dir="out2/",
                      model=spec_for("generate", True))
    run_shards(job)
    publish_manifest(job)
    out = read_output(job)
    long = next(r for r in out.results if r["id"] == 2)
    assert long["output"] == LONG[-20:] and long["truncated"] is True  # generation keeps the tail
    assert out.manifest["counts"]["truncated"] == 1


def test_truncated_openai_lines_carry_the_mark(file_place, make_job, run_shards, read_output) -> None:
    lines = [{"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"input": LONG}}]
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", lines), model=spec_for("embed", None),
                      input={"format": "openai"})
    run_shards(job)
    publish_manifest(job)
    (line,) = read_output(job).results
    assert line["truncated"] is True and line["response"]["body"]["usage"]["prompt_tokens"] == 5


def test_a_resumed_shard_counts_truncated_rows_already_durable(file_place, make_job, run_shards) -> None:
    from bij.contract import layout
    from bij.steps.progress import shard_records

    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", rows()), model=spec_for("embed", None))
    run_shards(job)
    assert [r["truncated"] for r in shard_records(job, 0).values()] == [1]
    # Without its completion record the shard is worked again: every row is durable, none is rerun.
    file_place.storage.delete(layout.join(layout.round_prefix(job, 0), "done/00000.json"))
    run_shards(job)
    assert run_shards.engine.seen == []
    assert [r["truncated"] for r in shard_records(job, 0).values()] == [1]
