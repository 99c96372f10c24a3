"""Pass-through columns: an input row's other columns come back on its result, error and capped rows."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
import zstandard

from bij.contract.columns import RESULT_FIELDS
from bij.contract.spec import SpecError, load_job, parse_job
from bij.local.publish import publish_manifest
from bij.steps.plan_input import PlanError
from bij.steps.planner import plan_round
from bij.worker.input_row import InputOptions, parquet_columns
from bij.worker.inputs import parse_line
from bij.worker.shard import StopFlag

sys.path.insert(0, str(Path(__file__).parent.parent))
import coin_engine  # noqa: E402

from bij.local.run import LocalRunner  # noqa: E402


def rows(n: int) -> list[dict[str, Any]]:
    return [{"id": i, "text": f"row {i}", "lang": ["de", "en", "fr"][i % 3], "meta": {"n": i, "tags": ["a"] * (i % 3)}}
            for i in range(n)]


def parquet_bytes(table: pa.Table, row_group_size: int = 50) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf, row_group_size=row_group_size)
    return buf.getvalue()


# --- JSONL input ------------------------------------------------------------------------------------


def test_results_carry_every_column_the_request_does_not_consume(place, make_job, run_shards, read_output) -> None:
    inputs = rows(120)
    _, job = make_job(place, place.write_jsonl("in/a.jsonl", inputs), sharding={"targetShardBytes": 2048})
    run_shards(job)
    publish_manifest(job)
    out = read_output(job)
    assert [r["id"] for r in out.results] == list(range(120))
    for r, want in zip(out.results, inputs, strict=True):
        # The result's own fields first, then the carried columns; the text is in `output`, not carried.
        assert list(r) == ["id", "output", "usage", "lang", "meta"]
        assert (r["output"], r["lang"], r["meta"]) == (want["text"], want["lang"], want["meta"])


def test_a_listed_column_is_carried_and_no_other(file_place, make_job, run_shards, read_output) -> None:
    inputs = rows(40)
    _, job = make_job(file_place, file_place.write_jsonl("in/a.jsonl", inputs),
                      input={"passThrough": ["text", "lang", "absent"]})
    run_shards(job)
    publish_manifest(job)
    out = read_output(job)
    assert [(r["text"], r["lang"]) for r in out.results] == [(r["text"], r["lang"]) for r in inputs]
    assert not any("meta" in r or "absent" in r for r in out.results)  # a column a row lacks is left out


def test_an_empty_list_carries_nothing(file_place, make_job, run_shards, read_output) -> None:
    _, job = make_job(file_place, file_place.write_jsonl("in/a.jsonl", [*rows(30), {"id": "bad", "text": "",
                                                                                   "lang": "de"}]),
                      input={"passThrough": []})
    run_shards(job)
    publish_manifest(job)
    out = read_output(job)
    assert {tuple(r) for r in out.results} == {("id", "output", "usage")}
    assert set(out.errors[0]) == {"id", "error", "object", "offset"}


def test_error_rows_and_duplicate_ids_carry_the_columns_too(file_place, make_job, run_shards, read_output) -> None:
    inputs = [*rows(20), {"id": "empty", "text": "", "lang": "xx"}, {"id": 3, "text": "again", "lang": "dup"}]
    _, job = make_job(file_place, file_place.write_jsonl("in/a.jsonl", inputs))
    run_shards(job)
    publish_manifest(job)
    out = read_output(job)
    errors = {e["error"]["code"]: e for e in out.errors}
    assert errors["empty_text"]["lang"] == "xx" and errors["empty_text"]["id"] == "empty"
    assert errors["duplicate_id"]["lang"] == "dup" and errors["duplicate_id"]["id"] == 3
    assert [r["lang"] for r in out.results] == [r["lang"] for r in inputs[:20]]


def test_the_planner_refuses_a_column_named_like_a_result_field_naming_it_and_the_file(file_place,
                                                                                        make_job) -> None:
    file_place.write_jsonl("in/a.jsonl", rows(5))
    # Compressed: the planner reads the object's first line through the decompressor.
    bad = file_place.write_jsonl("in/b.jsonl.zst", [{"id": 1, "text": "x", "usage": "internal"}, *rows(3)], zst=True)
    _, job = make_job(file_place, file_place.uri("in/"))
    with pytest.raises(PlanError) as e:
        plan_round(job, 0)
    assert str(e.value).startswith("spec.input.passThrough: input column 'usage' (line 1 of " + bad + ")")
    # The same rows with the columns to carry named: nothing clashes.
    _, job = make_job(file_place, file_place.uri("in/"), name="narrowed", out_dir="out2/",
                      input={"passThrough": ["lang"]})
    assert plan_round(job, 0).shard_count >= 1


def test_a_later_row_with_a_clashing_column_is_an_error_row_naming_it(file_place, make_job, run_shards,
                                                                     read_output) -> None:
    inputs: list[dict[str, Any]] = rows(30)
    inputs[17] = {"id": 17, "text": "row 17", "output": "not the answer", "lang": "de"}
    _, job = make_job(file_place, file_place.write_jsonl("in/a.jsonl", inputs))
    run_shards(job)
    publish_manifest(job)
    out = read_output(job)
    (err,) = out.errors
    assert (err["id"], err["error"]["code"]) == (17, "invalid_row")
    assert err["error"]["message"].startswith("input column 'output' (in this row) clashes with the result field")
    assert [r["id"] for r in out.results] == [i for i in range(30) if i != 17]
    assert all(r["output"] == f"row {r['id']}" for r in out.results)  # never written over


def test_a_row_parsed_alone_carries_its_columns_and_an_openai_line_none() -> None:
    row = parse_line(b'{"id": 1, "text": "t", "sampling": {"seed": 3}, "adapter": null, "k": [1]}', (0, 0, 1),
                     "a.jsonl", InputOptions(task="generate"))
    assert row.carried == {"k": [1]}  # the sampling and adapter columns belong to the request
    line = b'{"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "p"}, "k": 1}'
    assert parse_line(line, (0, 0, 1), "a.jsonl", InputOptions(format="openai", task="generate")).carried is None


def test_the_spec_refuses_a_listed_result_field_and_openai_input() -> None:
    def spec(**inp: Any) -> dict[str, Any]:
        return {"apiVersion": "batchinference.io/v1alpha1", "kind": "BatchInferenceJob", "metadata": {"name": "j"},
                "spec": {"input": {"uri": "s3://b/in/", **inp}, "output": {"uri": "s3://b/out/"}}}

    with pytest.raises(SpecError, match="column 'embedding' clashes with the result field"):
        parse_job(spec(passThrough=["lang", "embedding"]))
    with pytest.raises(SpecError, match="input.passThrough needs input.format jsonl or parquet"):
        parse_job(spec(format="openai", passThrough=["lang"]))
    with pytest.raises(SpecError, match="column 'lang' is named twice"):
        parse_job(spec(passThrough=["lang", "lang"]))
    assert parse_job(spec(passThrough=[])).spec.input.pass_through == []
    assert "_bij" in RESULT_FIELDS and "text" not in RESULT_FIELDS


# --- integers beyond 64 bits, the reserved _bij field ------------------------------------------------


def exactly(value: Any) -> str:
    """`value` as JSON text: 2**70 and the float 2**70 compare equal in Python, never as text."""
    return json.dumps(value, sort_keys=True)


def big_rows(n: int) -> list[dict[str, Any]]:
    return [{"id": i, "text": f"row {i}", "big": 2**70 + i, "nested": {"x": [2**80, -(2**63) - 1 - i]}}
            for i in range(n)]


def test_integers_beyond_64_bits_in_carried_columns_come_back_exactly(file_place, make_job, run_shards,
                                                                      read_output) -> None:
    from bij.steps.results import ResultsError, iter_rows, write_parquet

    inputs = [*big_rows(40), {"id": "empty", "text": "", "big": 2**70}, {"id": 2**70, "text": "x", "n": 2**64}]
    _, job = make_job(file_place, file_place.write_jsonl("in/a.jsonl", inputs))
    run_shards(job)
    publish_manifest(job)
    out = read_output(job)
    assert exactly([{k: r[k] for k in ("id", "big", "nested")} for r in out.results[:40]]) == \
        exactly([{k: r[k] for k in ("id", "big", "nested")} for r in inputs[:40]])
    assert exactly(out.results[40]) == exactly({"id": 2**70, "output": "x", "usage": out.results[40]["usage"],
                                                "n": 2**64})
    (err,) = out.errors
    assert (err["error"]["code"], exactly(err["big"])) == ("empty_text", exactly(2**70))  # error rows too
    # `bij results` reads them back exactly; as one Parquet stream, it refuses them by name.
    assert exactly([r["big"] for r in list(iter_rows(job.spec.output.uri, "results", None))[:40]]) == \
        exactly([r["big"] for r in inputs[:40]])
    with pytest.raises(ResultsError, match=r"column 'big' of the result row with id 0 holds an integer beyond 64 bits "
                                           r"\(at big\), which Parquet cannot hold"):
        write_parquet(job.spec.output.uri, io.BytesIO(), None)


def test_a_parquet_result_refuses_a_carried_integer_beyond_64_bits_naming_the_column(file_place, make_job,
                                                                                     run_shards) -> None:
    inputs: list[dict[str, Any]] = [{"id": i, "text": f"row {i}", "n": i - 2**62} for i in range(40)]
    inputs[3]["n"] = 2**70
    inputs[25]["nested"] = {"x": [2**80]}
    _, job = make_job(file_place, file_place.write_jsonl("in/a.jsonl", inputs), output={"format": "parquet"})
    run_shards(job)
    manifest = publish_manifest(job)
    got = pa.concat_tables([pq.read_table(pa.BufferReader(file_place.storage.read_bytes(
        file_place.uri("out/" + f.path)))) for f in manifest.files or []])
    assert got.column("id").to_pylist() == [i for i in range(40) if i not in (3, 25)]
    assert got.schema.field("n").type == pa.int64()  # never a float
    assert got.column("n").to_pylist() == [r["n"] for r in inputs if r["id"] not in (3, 25)]
    errors = [json.loads(line) for f in manifest.error_files or []
              for line in file_place.storage.read_bytes(file_place.uri("out/" + f.path)).splitlines()]
    assert [(e["id"], e["error"]["code"]) for e in errors] == [(3, "invalid_row"), (25, "invalid_row")]
    assert errors[0]["error"]["message"].startswith("column 'n' holds an integer beyond 64 bits (at n), which a "
                                                    "Parquet result (output.format: parquet) cannot hold")
    assert "column 'nested' holds an integer beyond 64 bits (at nested.x[0])" in errors[1]["error"]["message"]
    assert exactly(errors[0]["n"]) == exactly(2**70)  # the JSON lines error file keeps it exactly


def test_a_users_bij_field_is_an_error_row_and_takes_no_id_from_it(file_place, make_job, run_shards,
                                                                   read_output) -> None:
    inputs: list[dict[str, Any]] = [{"id": f"g-{i}", "text": f"row {i}", "lang": "de"} for i in range(40)]
    inputs.insert(10, {"text": "claims g-30", "_bij": {"id": "g-30"}, "lang": "xx"})
    inputs.insert(20, {"id": "many", "text": "bad history", "_bij": {"attempts": "many"}})
    _, job = make_job(file_place, file_place.write_jsonl("in/a.jsonl", inputs))
    assert {o.status for o in run_shards(job).values()} == {"done"}
    publish_manifest(job)
    out = read_output(job)
    assert [(r["id"], r["output"], r["lang"]) for r in out.results] == [(f"g-{i}", f"row {i}", "de") for i in range(40)]
    offset = sum(len(json.dumps(r)) + 1 for r in inputs[:10])
    assert [(e["id"], e["error"]["code"]) for e in out.errors] == [(f"a.jsonl:{offset}", "invalid_row"),
                                                                   ("many", "invalid_row")]
    assert all(e["error"]["message"].startswith("field '_bij' is reserved for bij's own bookkeeping")
               for e in out.errors)
    assert out.errors[0]["lang"] == "xx" and out.manifest["counts"]["errors"] == 2


# --- judge rounds -----------------------------------------------------------------------------------


def test_carried_columns_survive_judge_rounds_to_results_and_capped_rows(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    inputs = [{"id": i, "text": f"row {i}", "lang": f"l{i}"} for i in range(120)]
    (tmp_path / "in" / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in inputs))
    doc = {"apiVersion": "batchinference.io/v1alpha1", "kind": "BatchInferenceJob", "metadata": {"name": "judged"},
           "spec": {"input": {"uri": f"file://{tmp_path}/in/"}, "output": {"uri": f"file://{tmp_path}/out/"},
                    "model": {"engine": "echo", "task": "generate"},
                    "sharding": {"targetShardBytes": 2048, "chunkRows": 20}, "workers": {"parallelism": 2},
                    "judge": {"type": "regex", "pattern": coin_engine.approve_pattern(30), "strategy": "rounds",
                              "maxRounds": 3}}}
    spec_path = tmp_path / "job.yaml"
    spec_path.write_text(yaml.safe_dump(doc))
    assert LocalRunner(load_job(spec_path), show_progress=False, worker_cmd=coin_engine.worker_cmd()).run() == 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())

    def read(files: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [json.loads(line) for f in files for line in zstandard.ZstdDecompressor().decompress(
            (tmp_path / "out" / f["path"]).read_bytes(), max_output_size=1 << 30).splitlines()]

    results, capped = read(manifest["files"]), read(manifest["cappedFiles"])
    assert capped and any(r["round"] > 0 for r in results)  # rows went through later rounds
    assert sorted(r["id"] for r in results + capped) == list(range(120))
    assert all(r["lang"] == f"l{r['id']}" and "_bij" not in r for r in results + capped)


# --- Parquet ----------------------------------------------------------------------------------------


def input_table(n: int) -> pa.Table:
    return pa.table({"doc_id": pa.array(range(n), type=pa.int64()), "body": [f"row {i}" for i in range(n)],
                     "lang": [["de", "en"][i % 2] for i in range(n)], "score": [i / 4 for i in range(n)],
                     "blob": [bytes([i % 256]) for i in range(n)]})


def test_parquet_input_carries_its_columns_to_parquet_results(place, make_job, run_shards) -> None:
    table = input_table(200)
    place.storage.write_bytes(place.uri("in/part-0.parquet"), parquet_bytes(table))
    _, job = make_job(place, place.uri("in/"), input={"format": "parquet", "idField": "doc_id", "textField": "body"},
                      output={"format": "parquet"}, sharding={"targetShardBytes": 2048})
    run_shards(job)
    manifest = publish_manifest(job)
    got = pa.concat_tables([pq.read_table(pa.BufferReader(place.storage.read_bytes(
        place.uri("out/" + f.path)))) for f in manifest.files or []])
    assert got.column_names[-3:] == ["lang", "score", "blob"]
    assert got.column("id").to_pylist() == list(range(200))
    assert got.column("lang").to_pylist() == table.column("lang").to_pylist()
    assert got.schema.field("score").type == pa.float64()
    assert got.column("score").to_pylist() == table.column("score").to_pylist()
    assert got.column("blob").to_pylist()[:2] == ["AA==", "AQ=="]  # binary comes back as base64 text


def test_a_narrowed_list_reads_only_those_parquet_columns(file_place, make_job, run_shards, read_output) -> None:
    file_place.storage.write_bytes(file_place.uri("in/a.parquet"), parquet_bytes(input_table(60)))
    _, job = make_job(file_place, file_place.uri("in/"),
                      input={"format": "parquet", "idField": "doc_id", "textField": "body", "passThrough": ["lang"]})
    assert parquet_columns(InputOptions.from_spec(job.spec)) == ["doc_id", "body", "sampling", "adapter", "lang"]
    assert parquet_columns(InputOptions()) is None  # every column
    run_shards(job)
    publish_manifest(job)
    assert {tuple(r) for r in read_output(job).results} == {("id", "output", "usage", "lang")}


def test_a_parquet_column_named_like_a_result_field_is_refused_at_plan_time(file_place, make_job) -> None:
    table = input_table(10).append_column("embedding", pa.array([[0.5]] * 10))
    file_place.storage.write_bytes(file_place.uri("in/a.parquet"), parquet_bytes(table))
    _, job = make_job(file_place, file_place.uri("in/"),
                      input={"format": "parquet", "idField": "doc_id", "textField": "body"})
    with pytest.raises(PlanError, match=r"^spec.input.passThrough: input column 'embedding' \(in file://.*/a\.parquet"):
        plan_round(job, 0)


def test_carried_columns_survive_a_stop_and_resume(file_place, make_job, run_shards, recording_echo,
                                                   read_output) -> None:
    inputs = rows(200)
    _, job = make_job(file_place, file_place.write_jsonl("in/a.jsonl", inputs),
                      sharding={"chunkRows": 10, "targetShardBytes": 1 << 20},
                      batching={"inFlightRows": 10, "commitQueueChunks": 2})
    stop = StopFlag()
    chunks: list[dict[str, Any]] = []

    def progress(ev: dict[str, Any]) -> None:
        chunks.extend([ev] if ev["event"] == "chunk" else [])
        if len(chunks) == 4:
            stop.request()

    first = run_shards(job, stop=stop, progress=progress)
    assert first[0].status == "stopped" and 40 <= first[0].rows < 200
    engine = recording_echo()
    assert run_shards(job, engine=engine)[0].rows == 200
    assert len(engine.seen) == 200 - first[0].rows  # the durable rows did not run again
    publish_manifest(job)
    out = read_output(job)
    assert [(r["id"], r["lang"], r["meta"]) for r in out.results] == [(r["id"], r["lang"], r["meta"]) for r in inputs]


def test_one_parquet_stream_of_files_with_other_columns_is_refused_naming_the_file(file_place, make_job,
                                                                                   run_shards) -> None:
    from bij.steps.results import ResultsError, write_parquet

    file_place.write_jsonl("in/a.jsonl", [{"id": 1, "text": "a", "lang": "de"}])
    file_place.write_jsonl("in/b.jsonl", [{"id": 2, "text": "b", "score": 0.5}])
    _, job = make_job(file_place, file_place.uri("in/"), output={"partitionBy": "input"})
    run_shards(job)
    publish_manifest(job)
    with pytest.raises(ResultsError, match=r"^results/b.jsonl has other columns than the files before it"):
        write_parquet(job.spec.output.uri, io.BytesIO(), None)
