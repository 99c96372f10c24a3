"""`bij results` and `bij status`: published rows and a job's summary, on file:// and s3://."""

from __future__ import annotations

import io
import json
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from bij.cli.main import main as bij_main
from bij.contract import layout
from bij.local.publish import publish_manifest

ROWS: list[Any] = [{"id": 1, "text": "one"}, {"id": "1", "text": "string one"}, {"id": "x", "text": "ex"},
                   '{"id": "broken", ', {"id": 2**70, "text": "big"}, {"text": "no id"}]


def run(argv: list[str], capsysbinary: Any) -> tuple[int, bytes, str]:
    rc = bij_main(argv)
    out, err = capsysbinary.readouterr()
    return rc, out, err.decode()


def published(place: Any, make_job: Any, run_shards: Any, **spec: Any) -> Any:
    _, job = make_job(place, place.write_jsonl("in.jsonl", ROWS), **spec)
    run_shards(job)
    publish_manifest(job)
    return job


def test_results_prints_every_published_row_with_ids_exactly_as_given(place, make_job, run_shards, read_output,
                                                                       capsysbinary, monkeypatch) -> None:
    if place.endpoint:  # `bij results` finds S3 as any AWS tool does
        monkeypatch.setenv("AWS_ENDPOINT_URL", place.endpoint)
    job = published(place, make_job, run_shards, output={"compression": "zstd"})
    rc, out, err = run(["results", layout.manifest_uri(job)], capsysbinary)
    assert rc == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert rows == read_output(job).results
    assert [r["id"] for r in rows][:4] == [1, "1", "x", 2**70]
    rc, out, _ = run(["results", job.spec.output.uri, "--errors"], capsysbinary)  # the output URI works too
    assert rc == 0 and [json.loads(line)["error"]["code"] for line in out.splitlines()] == ["invalid_json"]


def test_results_of_a_parquet_job_print_as_json_lines_and_stream_as_one_parquet(file_place, make_job, run_shards,
                                                                                capsysbinary) -> None:
    job = published(file_place, make_job, run_shards, output={"format": "parquet"}, model={"task": "embed"},
                    sharding={"targetShardBytes": 1024, "chunkRows": 2})
    rc, out, _ = run(["results", layout.manifest_uri(job)], capsysbinary)
    rows = [json.loads(line) for line in out.splitlines()]
    # Parquet keeps integer ids in int64: one beyond 64 bits comes back as its text.
    assert rc == 0 and [r["id"] for r in rows][:4] == [1, "1", "x", str(2**70)]
    assert all(len(r["embedding"]) == 8 for r in rows)
    rc, out, _ = run(["results", layout.manifest_uri(job), "--format", "parquet"], capsysbinary)
    table = pq.read_table(pa.BufferReader(out))
    assert rc == 0 and table.num_rows == len(rows) == 5
    assert table.schema.field("embedding").type == pa.list_(pa.float32())


def test_results_of_a_jsonl_job_convert_to_parquet(file_place, make_job, run_shards, capsysbinary) -> None:
    job = published(file_place, make_job, run_shards)
    rc, out, _ = run(["results", layout.manifest_uri(job), "--format", "parquet"], capsysbinary)
    table = pq.read_table(io.BytesIO(out))
    assert rc == 0 and table.column("output").to_pylist() == ["one", "string one", "ex", "big", "no id"]
    assert table.column("id_int").to_pylist()[:4] == [1, None, None, None]  # 2**70 is beyond int64: text only


def test_a_file_changed_after_publishing_is_refused(file_place, make_job, run_shards, capsysbinary) -> None:
    job = published(file_place, make_job, run_shards)
    manifest = json.loads(file_place.storage.read_bytes(layout.manifest_uri(job)))
    path = layout.join(job.spec.output.uri, manifest["files"][0]["path"])
    file_place.storage.write_bytes(path, file_place.storage.read_bytes(path) + b"\n")
    rc, out, err = run(["results", layout.manifest_uri(job)], capsysbinary)
    assert rc == 1 and out == b"" and "does not match the manifest" in err and manifest["files"][0]["path"] in err


def test_results_without_a_manifest_says_so(file_place, capsysbinary) -> None:
    rc, _, err = run(["results", file_place.uri("nothing/")], capsysbinary)
    assert rc == 1 and "no manifest at" in err


def test_status_summarizes_a_published_job_and_a_running_one(place, make_job, run_shards, capsysbinary,
                                                             monkeypatch) -> None:
    if place.endpoint:
        monkeypatch.setenv("AWS_ENDPOINT_URL", place.endpoint)
    path, job = make_job(place, place.write_jsonl("in.jsonl", ROWS * 20),
                         model={"maxInputTokens": 1, "truncate": True}, workers={"pricePerHour": 1.5})
    run_shards(job, indexes=[0])
    rc, out, err = run(["status", str(path)], capsysbinary)
    text = out.decode()
    assert rc == 0, err
    assert "not published yet" in text and "round 0   1/" in text and "truncated" in text and "so far" in text
    run_shards(job)
    manifest = publish_manifest(job)
    rc, out, _ = run(["status", layout.manifest_uri(job)], capsysbinary)
    text = out.decode()
    c = manifest.counts
    assert rc == 0 and f"{c.rows:,} results" in text and f"{c.errors:,} errors" in text
    assert f"{c.truncated:,} truncated" in text and c.truncated > 0
    assert "cost" in text and "per million rows" in text
    rc, out2, _ = run(["status", str(path)], capsysbinary)
    assert out2 == out  # a published job's spec gives the manifest's summary


def test_results_of_a_jsonl_job_convert_to_csv_that_reads_back_as_its_rows(file_place, make_job, run_shards,
                                                                        capsysbinary) -> None:
    from bij.storage.writers import CSV

    last = {"id": "last", "text": "late", "lang": "fr"}  # a pass-through column first seen in the last file
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", ROWS * 40 + [last]),
                      sharding={"targetShardBytes": 1024, "chunkRows": 2}, input={"passThrough": ["lang"]})
    run_shards(job)
    publish_manifest(job)
    manifest = json.loads(file_place.storage.read_bytes(layout.manifest_uri(job)))
    assert len(manifest["files"]) > 1  # one stream, one header, of several files
    rc, out, err = run(["results", layout.manifest_uri(job), "--format", "csv"], capsysbinary)
    assert rc == 0, err
    header = out.split(b"\r\n", 1)[0].decode()
    assert header == "id,id_int,output,prompt_tokens,completion_tokens,truncated,lang"  # mixed ids: id is text
    rc, lines, _ = run(["results", layout.manifest_uri(job)], capsysbinary)
    rows = [json.loads(line) for line in lines.splitlines()]
    # CSV keeps integer ids in int64 as Parquet does: one beyond 64 bits comes back as its text; a column a row
    # lacks is null.
    expected = [{"lang": None, **r} | ({"id": str(r["id"])} if r["id"] == 2**70 else {}) for r in rows]
    assert rows[-1]["lang"] == "fr" and list(CSV.rows(out, "all.csv")) == expected
    rc, _, err = run(["results", layout.manifest_uri(job), "--errors", "--format", "csv"], capsysbinary)
    assert rc == 1 and "--format csv reads results only" in err


def test_results_of_a_csv_job_stream_as_its_one_file(file_place, make_job, run_shards, capsysbinary) -> None:
    job = published(file_place, make_job, run_shards, output={"format": "csv", "compression": "none"})
    manifest = json.loads(file_place.storage.read_bytes(layout.manifest_uri(job)))
    assert [f["path"].endswith(".csv") for f in manifest["files"]] == [True]
    rc, out, err = run(["results", layout.manifest_uri(job), "--format", "csv"], capsysbinary)
    assert rc == 0, err
    assert out == file_place.storage.read_bytes(layout.join(job.spec.output.uri, manifest["files"][0]["path"]))
