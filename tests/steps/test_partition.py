"""output.partitionBy input: one published file per input object, named as the input is."""

from __future__ import annotations

import io
import json
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from bij.contract import layout
from bij.contract.fingerprint import PlanRefused
from bij.contract.spec import SpecError, parse_job
from bij.steps.planner import plan_round
from bij.steps.sharding import plan_shards
from bij.worker.shard import load_plan


def rows(prefix: str, n: int) -> list[dict[str, Any]]:
    return [{"id": f"{prefix}-{i}", "text": f"{prefix} row {i} " + "x" * (i % 40), "n": i} for i in range(n)]


def published(place: Any, job: Any, entry: dict[str, Any]) -> list[dict[str, Any]]:
    data = place.storage.read_bytes(job.spec.output.uri.rstrip("/") + "/" + entry["path"])
    if entry["path"].endswith(".parquet"):
        return pq.read_table(pa.BufferReader(data)).to_pylist()  # type: ignore[no-any-return]
    if entry["path"].endswith(".zst"):
        data = zstandard.ZstdDecompressor().decompress(data, max_output_size=1 << 30)
    return [json.loads(line) for line in data.splitlines()]


def test_whole_objects_are_never_cut_across_shards() -> None:
    sizes = [(10_000, False), (300, False), (200, True), (9_000, False)]
    assert plan_shards(sizes, 1000, whole=True) == [[(0, 0, 10_000)], [(1, 0, 300), (2, 0, 200)], [(3, 0, 9_000)]]
    # Parquet: an object's one piece spans all its row groups.
    assert plan_shards([(50, False), (70, False)], 60, {0: [20, 30], 1: [70]}, whole=True) == [
        [(0, 0, 2)], [(1, 0, 1)]]


def test_partition_stems_drop_the_input_suffix() -> None:
    assert layout.partition_stem("s3://b/data/a/x.jsonl", "a/x.jsonl") == "a/x"
    assert layout.partition_stem("file:///in/x.ndjson.zst", "x.ndjson.zst") == "x"
    assert layout.partition_stem("s3://b/part-0.parquet", "part-0.parquet") == "part-0"
    assert layout.partition_stem("https://host/data/x.jsonl?X-Amz-Signature=a/b", "x.jsonl?X-Amz-Signature=a/b") == "x"
    assert layout.partition_problem("a/../b") and layout.partition_problem("a//b")
    assert layout.partition_problem("a/b") is None


def test_each_input_file_is_published_as_one_file_of_the_same_relative_name(place, make_job, run_shards,
                                                                            publish_doc) -> None:
    a, b = rows("a", 300), rows("b", 40)
    place.write_jsonl("in/2026-01/x.jsonl", a)
    place.write_jsonl("in/2026-02/y.jsonl", [*b[:20], {"id": "b-bad", "text": ""}, *b[20:], b[3]])
    place.write_jsonl("in/2026-02/skip.txt", [{"id": "no", "text": "not matched by the glob"}])
    _, job = make_job(place, place.uri("in/2026-*/*.jsonl"), output={"partitionBy": "input", "compression": "zstd",
                                                                     "keepIntermediate": True},
                      sharding={"targetShardBytes": 2048, "chunkRows": 16})
    plan = load_plan(plan_round(job, 0).manifest_uri, job.spec.storage.s3)
    assert [len(s) for s in plan.shards] == [1, 1]  # each object whole, however small the shard target
    run_shards(job)
    manifest = publish_doc(job)
    assert [(f["path"], f["input"], f["rows"]) for f in manifest["files"]] == [
        ("results/2026-01/x.jsonl.zst", "2026-01/x.jsonl", 300), ("results/2026-02/y.jsonl.zst", "2026-02/y.jsonl", 40)]
    assert [(f["path"], f["rows"]) for f in manifest["errorFiles"]] == [("errors/2026-02/y.jsonl.zst", 2)]
    x, y = (published(place, job, f) for f in manifest["files"])
    assert [(r["id"], r["output"], r["n"]) for r in x] == [(r["id"], r["text"], r["n"]) for r in a]
    assert [(r["id"], r["n"]) for r in y] == [(r["id"], r["n"]) for r in b]  # in input order, each once
    errors = published(place, job, manifest["errorFiles"][0])
    assert sorted(e["error"]["code"] for e in errors) == ["duplicate_id", "empty_text"]
    assert manifest["counts"]["rows"] == 340 and manifest["counts"]["errors"] == 2
    # Publishing again gives the same files.
    assert publish_doc(job)["files"] == manifest["files"]


def test_parquet_input_publishes_one_parquet_file_per_input_file(file_place, make_job, run_shards, publish_doc) -> None:
    for name, n in (("p/part-0.parquet", 120), ("p/part-1.parquet", 30)):
        table = pa.table({"id": [f"{name}:{i}" for i in range(n)], "text": [f"t{i}" for i in range(n)],
                          "lang": ["de"] * n})
        buf = io.BytesIO()
        pq.write_table(table, buf, row_group_size=25)
        file_place.storage.write_bytes(file_place.uri(f"in/{name}"), buf.getvalue())
    _, job = make_job(file_place, file_place.uri("in/"), input={"format": "parquet"},
                      output={"format": "parquet", "partitionBy": "input"}, sharding={"targetShardBytes": 1024})
    run_shards(job)
    manifest = publish_doc(job)
    assert [f["path"] for f in manifest["files"]] == ["results/p/part-0.parquet", "results/p/part-1.parquet"]
    part0 = published(file_place, job, manifest["files"][0])
    assert [r["id"] for r in part0] == [f"p/part-0.parquet:{i}" for i in range(120)]
    assert {r["lang"] for r in part0} == {"de"}


def test_an_input_file_with_no_result_rows_still_has_its_result_file(file_place, make_job, run_shards,
                                                                      publish_doc) -> None:
    file_place.write_jsonl("in/a.jsonl", rows("a", 5))
    file_place.write_jsonl("in/b.jsonl", [{"id": "b", "text": ""}])
    _, job = make_job(file_place, file_place.uri("in/"), output={"partitionBy": "input"})
    run_shards(job)
    manifest = publish_doc(job)
    assert [(f["path"], f["rows"]) for f in manifest["files"]] == [("results/a.jsonl", 5), ("results/b.jsonl", 0)]
    assert [f["path"] for f in manifest["errorFiles"]] == ["errors/b.jsonl"]


@pytest.mark.parametrize("paths, clash", [
    (["r/a.jsonl", "r/b.jsonl", "r/a/b.jsonl"], None),
    (["r/a.jsonl", "r/b.jsonl", "r/a.jsonl"], layout.PathClash(0, 2, "r/a.jsonl", None)),
    (["r/a.jsonl", "r/a.jsonl/b/c.jsonl"], layout.PathClash(0, 1, "r/a.jsonl", "r/a.jsonl/b/c.jsonl")),
    (["r/a.jsonl/b/c.jsonl", "r/x.jsonl", "r/a.jsonl/b"], layout.PathClash(0, 2, "r/a.jsonl/b", "r/a.jsonl/b/c.jsonl")),
    (["r/ab.jsonl", "r/a/b.jsonl", "r/a.jsonl.d/x.jsonl"], None),  # a name that only begins like another's
], ids=["apart", "same-path", "file-then-folder", "folder-then-file", "prefix-of-a-name"])
def test_path_clash_finds_two_paths_that_cannot_both_be_files(paths, clash) -> None:
    assert layout.path_clash(paths) == clash


def write_input(place: Any, name: str) -> None:
    if name.endswith(".parquet"):
        buf = io.BytesIO()
        pq.write_table(pa.table({"id": [name], "text": ["t"]}), buf)
        place.storage.write_bytes(place.uri(f"in/{name}"), buf.getvalue())
    else:
        place.write_jsonl(f"in/{name}", rows(name, 3), zst=name.endswith(".zst"))


@pytest.mark.parametrize("first, second, output, clash", [  # first, second: in input (listing) order
    # the same published file
    ("x.jsonl", "x.ndjson", {}, "would both publish results/x.jsonl"),
    ("x.json.zst", "x.jsonl", {"compression": "zstd"}, "would both publish results/x.jsonl.zst"),
    # one's file is a folder of the other's: the second cannot be written once the first is
    ("c.jsonl", "c.jsonl.zst/d.jsonl", {"compression": "zstd"},
     "results/c.jsonl.zst would be both a file and the folder of results/c.jsonl.zst/d.jsonl.zst"),
    ("c.jsonl/d/e.ndjson", "c.ndjson", {},
     "results/c.jsonl would be both a file and the folder of results/c.jsonl/d/e.jsonl"),
    ("p.jsonl", "p.parquet/q.jsonl", {"format": "parquet"},
     "results/p.parquet would be both a file and the folder of results/p.parquet/q.parquet"),
    # results apart, error files not: Parquet results, JSON lines errors
    ("c.jsonl/d.parquet", "c.parquet", {"format": "parquet", "compression": "none"},
     "errors/c.jsonl would be both a file and the folder of errors/c.jsonl/d.jsonl"),
], ids=["same-stem", "same-stem-zst", "file-and-folder-zst", "file-and-folder-deep", "parquet-results",
        "errors-only"])
def test_two_inputs_whose_published_files_clash_are_refused_at_plan_time_writing_nothing(
        file_place, make_job, first, second, output, clash) -> None:
    for name in (second, first):
        write_input(file_place, name)
    fmt = {"input": {"format": "parquet"}} if first.endswith(".parquet") else {}
    _, job = make_job(file_place, file_place.uri("in/"), output={"partitionBy": "input", **output}, **fmt)
    with pytest.raises(PlanRefused) as refused:
        plan_round(job, 0)
    # Both inputs named, in input order, with the path they fight over.
    assert f"{file_place.uri('in', first)} and {file_place.uri('in', second)} " in str(refused.value)
    assert clash in str(refused.value) and "rename one, or narrow spec.input.uri" in str(refused.value)
    assert not file_place.storage.list(job.spec.output.uri)  # refused: nothing written, not even the owner record


def test_an_input_beside_a_folder_of_its_own_name_is_not_a_clash(file_place, make_job) -> None:
    # results/a.jsonl and results/a/b.jsonl are a file and a folder of different names.
    for name in ("a.jsonl", "a/b.jsonl", "a.jsonl.d/c.jsonl"):
        file_place.write_jsonl(f"in/{name}", rows(name, 3))
    _, job = make_job(file_place, file_place.uri("in/"), output={"partitionBy": "input"})
    assert plan_round(job, 0).objects == 3


def test_a_plan_written_before_the_clash_check_is_refused_on_the_next_run(file_place, make_job) -> None:
    from bij.steps.plan_input import input_objects
    from bij.steps.planner import build_plan

    file_place.write_jsonl("in/c.jsonl", rows("c", 3))
    file_place.write_jsonl("in/c.jsonl.zst/d.jsonl", rows("d", 3))
    _, job = make_job(file_place, file_place.uri("in/"), output={"partitionBy": "input", "compression": "zstd"})
    # The round plan an earlier version wrote, which let both inputs through: read again, and refused.
    objects = input_objects(file_place.storage.list(file_place.uri("in/")), file_place.uri("in/"))
    plan = build_plan(job, 0, objects, file_place.uri("in/"))
    file_place.storage.write_bytes(layout.round_manifest_uri(job, 0), plan.to_json())
    with pytest.raises(PlanRefused, match="results/c.jsonl.zst would be both a file and the folder"):
        plan_round(job, 0)


def test_partitioning_by_input_refuses_judge_rounds() -> None:
    doc = {"apiVersion": "batchinference.io/v1alpha1", "kind": "BatchInferenceJob", "metadata": {"name": "j"},
           "spec": {"input": {"uri": "s3://b/in/"}, "output": {"uri": "s3://b/out/", "partitionBy": "input"},
                    "model": {"task": "generate"}, "judge": {"type": "regex", "pattern": "x"}}}
    with pytest.raises(SpecError, match="output.partitionBy input needs judge.strategy inPlace"):
        parse_job(doc)
    doc["spec"]["judge"]["strategy"] = "inPlace"  # type: ignore[index]
    assert parse_job(doc).spec.output.partition_by == "input"


def test_a_large_partition_is_built_in_batches_and_spooled(file_place, make_job, run_shards, monkeypatch,
                                                            publish_doc) -> None:
    from bij.steps import publish_rows

    # Batches of 7 rows and a spool that goes to disk after 100 bytes: the file is still one file.
    monkeypatch.setattr(publish_rows, "FILE_ROWS", 7)
    monkeypatch.setattr(publish_rows, "SPOOL_BYTES", 100)
    inputs = [{"id": i, "text": f"t{i}", "v": i if i < 10 else f"s{i}"} for i in range(30)]  # v: ints, then text
    file_place.write_jsonl("in/a.jsonl", inputs)
    for fmt, compression in (("jsonl", "zstd"), ("parquet", "zstd")):
        _, job = make_job(file_place, file_place.uri("in/"), name=fmt, out_dir=f"out-{fmt}/",
                          output={"partitionBy": "input", "format": fmt, "compression": compression})
        run_shards(job)
        (entry,) = publish_doc(job)["files"]
        got = published(file_place, job, entry)
        assert entry["rows"] == 30 and [r["id"] for r in got] == list(range(30))
        if fmt == "jsonl":
            assert [r["v"] for r in got] == [r["v"] for r in inputs]
        else:  # a column whose type changes between batches holds JSON text, in every batch
            assert [r["v"] for r in got] == [json.dumps(r["v"]) for r in inputs]
            assert "text" not in got[0] and got[0]["output"] == "t0"
