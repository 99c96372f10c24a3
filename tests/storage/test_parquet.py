"""Parquet out (`output.format: parquet`) and in (`input.format: parquet`, cut by row groups)."""

from __future__ import annotations

import hashlib
import io
import json
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bij.contract import layout
from bij.engines.echo import echo_embedding
from bij.local.publish import publish_manifest
from bij.steps.plan_input import PlanError
from bij.steps.planner import plan_round
from bij.storage import parquet
from bij.worker.shard import load_plan
from bij.worker.stopflag import StopFlag


def parquet_bytes(table: pa.Table, row_group_size: int) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf, row_group_size=row_group_size)
    return buf.getvalue()


def read_results(place: Any, job: Any) -> tuple[dict[str, Any], list[pa.Table]]:
    """The manifest and each result file as an Arrow table, checked against its sha256."""
    out = job.spec.output.uri.rstrip("/") + "/"
    manifest = json.loads(place.storage.read_bytes(out + "manifest.json"))
    tables = []
    for f in manifest["files"]:
        data = place.storage.read_bytes(out + f["path"])
        assert hashlib.sha256(data).hexdigest() == f["sha256"] and f["path"].endswith(".parquet")
        table = pq.read_table(pa.BufferReader(data))
        assert table.num_rows == f["rows"]
        tables.append(table)
    return manifest, tables


# --- output --------------------------------------------------------------------------------------


def test_embeddings_publish_as_parquet_with_a_float32_list_column(place, make_job, run_shards) -> None:
    rows = [{"id": i, "text": f"paragraph {i} " + "x" * (i % 7 * 3)} for i in range(40)] + ['{"id": 99']
    _, job = make_job(place, place.write_jsonl("in.jsonl", rows), output={"format": "parquet"},
                      model={"task": "embed", "maxInputTokens": 4})
    run_shards(job)
    publish_manifest(job)
    manifest, tables = read_results(place, job)
    assert manifest["format"] == "parquet"
    table = pa.concat_tables(tables)
    assert table.schema.field("embedding").type == pa.list_(pa.float32())
    assert table.schema.field("id").type == pa.int64()
    assert table.column("id").to_pylist() == list(range(40))
    for row, vec in zip(rows[:40], table.column("embedding").to_pylist(), strict=True):
        text = row["text"][:16] if len(row["text"]) // 4 > 4 else row["text"]  # cut to 4 tokens of 4 bytes
        assert vec == pytest.approx(echo_embedding(text), rel=1e-6)
    assert sum(table.column("truncated").to_pylist()) == manifest["counts"]["truncated"] > 0
    # Error rows stay JSON lines.
    assert [f["path"].endswith(".jsonl.zst") or f["path"].endswith(".jsonl") for f in manifest["errorFiles"]] == [True]


def test_mixed_ids_keep_their_integers_in_a_second_column(file_place, make_job, run_shards) -> None:
    ids: list[Any] = [1, "1", "a", 2, 10**15]
    rows = [{"id": i, "text": f"t{n}"} for n, i in enumerate(ids)] + [{"text": "no id"}]
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", rows), output={"format": "parquet"})
    run_shards(job)
    publish_manifest(job)
    _, tables = read_results(file_place, job)
    table = pa.concat_tables(tables)
    assert table.column("id").type == pa.string()
    assert table.column(parquet.ID_INT).to_pylist() == [1, None, None, 2, 10**15, None]
    back = [r["id"] for t in tables for r in parquet.table_rows(t)]
    assert back[:5] == ids and isinstance(back[5], str)  # the generated id of the row without one
    outputs = [r["output"] for t in tables for r in parquet.table_rows(t)]
    assert outputs == [r["text"] for r in rows]


def test_string_ids_only_make_a_string_column_and_judge_columns_come_along(file_place, make_job,
                                                                          run_shards) -> None:
    rows = [{"id": f"r{i}", "text": "ok" if i % 2 else "no"} for i in range(10)]
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", rows), output={"format": "parquet"},
                      judge={"type": "regex", "pattern": "^ok$", "strategy": "inPlace", "maxAttempts": 1})
    run_shards(job)
    publish_manifest(job)
    _, tables = read_results(file_place, job)
    table = pa.concat_tables(tables)
    assert table.column("id").type == pa.string() and parquet.ID_INT not in table.column_names
    assert table.column("id").to_pylist() == [f"r{i}" for i in range(1, 10, 2)]
    assert set(table.column("attempts").to_pylist()) == {1} and set(table.column("round").to_pylist()) == {0}
    assert table.column("completion_tokens").to_pylist() == [1] * 5


def test_parquet_output_refuses_openai_input() -> None:
    from bij.contract.spec import SpecError, parse_spec

    with pytest.raises(SpecError, match="output.format other than jsonl needs input.format jsonl or parquet"):
        parse_spec({"input": {"uri": "file:///in", "format": "openai"},
                    "output": {"uri": "file:///out", "format": "parquet"}})


# --- input ---------------------------------------------------------------------------------------


def input_table(n: int) -> pa.Table:
    return pa.table({"doc_id": pa.array([i if i % 10 else None for i in range(n)], type=pa.int64()),
                     "body": [f"row {i} " + "w" * (i % 13) for i in range(n)],
                     "extra": [b"\x00" * 10] * n})


def test_parquet_input_is_cut_by_row_groups_and_every_row_comes_back_in_order(place, make_job, run_shards,
                                                                               read_output) -> None:
    table = input_table(500)
    uri = place.uri("in/part-0.parquet")
    place.storage.write_bytes(uri, parquet_bytes(table, row_group_size=50))
    _, job = make_job(place, place.uri("in/"), input={"format": "parquet", "idField": "doc_id",
                                                      "textField": "body"},
                      sharding={"targetShardBytes": 2048, "chunkRows": 32})
    plan = plan_round(job, 0)
    doc = load_plan(plan.manifest_uri, job.spec.storage.s3)
    assert (plan.unit, plan.total_bytes) == ("rows", 500)
    assert doc.objects[0].row_groups == [50] * 10
    pieces = [list(p) for shard in doc.shards for p in shard]
    assert plan.shard_count > 1 and pieces == [[0, a, b] for a, b in zip([p[1] for p in pieces],
                                                                         [p[2] for p in pieces], strict=True)]
    assert [p[1] for p in pieces][0] == 0 and pieces[-1][2] == 10
    assert all(a[2] == b[1] for a, b in zip(pieces, pieces[1:], strict=False))  # contiguous, no group twice
    run_shards(job)
    publish_manifest(job)
    out = read_output(job)
    assert [r["output"] for r in out.results] == table.column("body").to_pylist()
    want_ids = [i if i % 10 else f"part-0.parquet:{i}" for i in range(500)]
    assert out.result_ids == want_ids


def test_planning_reads_only_the_footer(file_place, make_job, monkeypatch) -> None:
    texts = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(20000)]  # incompressible: ~1.3 MB
    data = parquet_bytes(pa.table({"body": texts}), row_group_size=1000)
    file_place.storage.write_bytes(file_place.uri("in/a.parquet"), data)
    read: list[int] = []
    real = parquet.RangeFile.readinto

    def counting(self: Any, b: Any) -> int:
        n = real(self, b)
        read.append(n)
        return n

    monkeypatch.setattr(parquet.RangeFile, "readinto", counting)
    _, job = make_job(file_place, file_place.uri("in/"), input={"format": "parquet", "textField": "body"},
                      sharding={"targetShardBytes": 1 << 20})
    plan_round(job, 0)
    assert 0 < sum(read) < len(data) / 10, (sum(read), len(data))


def test_a_parquet_file_without_the_text_column_is_a_planning_error_naming_the_field(file_place, make_job) -> None:
    file_place.storage.write_bytes(file_place.uri("in/a.parquet"), parquet_bytes(input_table(10), 5))
    _, job = make_job(file_place, file_place.uri("in/"), input={"format": "parquet"})
    with pytest.raises(PlanError) as e:
        plan_round(job, 0)
    assert str(e.value).startswith("spec.input.textField: ") and "'text'" in str(e.value)
    assert "doc_id, body, extra" in str(e.value)


def test_a_stopped_parquet_shard_resumes_where_it_stopped(file_place, make_job, run_shards, recording_echo,
                                                          read_output) -> None:
    table = input_table(200)
    file_place.storage.write_bytes(file_place.uri("in/a.parquet"), parquet_bytes(table, row_group_size=30))
    _, job = make_job(file_place, file_place.uri("in/"),
                      input={"format": "parquet", "idField": "doc_id", "textField": "body"},
                      sharding={"chunkRows": 10, "targetShardBytes": 1 << 20},
                      batching={"inFlightRows": 10, "commitQueueChunks": 2})
    stop = StopFlag()
    events: list[dict[str, Any]] = []

    def progress(ev: dict[str, Any]) -> None:
        events.append(ev)
        if sum(1 for e in events if e["event"] == "chunk") == 4:
            stop.request()

    first = run_shards(job, stop=stop, progress=progress)
    durable = first[0].rows
    assert first[0].status == "stopped" and 40 <= durable < 200
    engine = recording_echo()
    assert run_shards(job, engine=engine)[0].rows == 200
    bodies = table.column("body").to_pylist()
    assert sorted(engine.seen) == sorted(bodies[durable:])  # nothing durable ran again
    publish_manifest(job)
    assert [r["output"] for r in read_output(job).results] == bodies
    assert layout.manifest_uri(job).endswith("manifest.json")
