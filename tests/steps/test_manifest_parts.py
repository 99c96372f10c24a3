"""A manifest that would list more files than a part holds lists them in parts written before it; readers
(`bij results`, the tests' own reader) see the same lists as in one document."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
from recording import RecordingStorage

from bij.contract import layout
from bij.contract import manifest as manifest_lists
from bij.contract.manifest import Manifest
from bij.local.publish import publish_manifest
from bij.steps import publish as publish_module
from bij.steps import publish_rows
from bij.steps.results import ResultsError, manifest_summary, write_jsonl, write_parquet
from bij.storage import open_storage


def published_job(place: Any, make_job: Any, run_shards: Any) -> Any:
    inputs: list[Any] = [{"id": f"r{i}", "text": f"text {i} " + "y" * (i % 50)} for i in range(400)]
    inputs[7] = "{not json"
    _, job = make_job(place, place.write_jsonl("in.jsonl", inputs), sharding={"targetShardBytes": 2048},
                      output={"keepIntermediate": True})
    run_shards(job)
    return job


def rows_out(job: Any, which: str = "results") -> bytes:
    out = io.BytesIO()
    write_jsonl(job.spec.output.uri, which, out, None)
    return out.getvalue()


def test_a_manifest_in_parts_is_read_as_the_one_document_it_stands_for(file_place, make_job, run_shards,
                                                                        read_output, publish_doc, monkeypatch):
    job = published_job(file_place, make_job, run_shards)
    one = publish_doc(job)
    assert "parts" not in one and len(one["files"]) > 5
    results, errors, summary = rows_out(job), rows_out(job, "errors"), manifest_summary(Manifest.parse(one))
    monkeypatch.setenv("BIJ_MANIFEST_PART_FILES", "3")
    parted = publish_doc(job)
    assert "files" not in parted and "errorFiles" not in parted
    assert [p["files"] + p["errorFiles"] + p["cappedFiles"] for p in parted["parts"]][:-1] == \
        [3] * (len(parted["parts"]) - 1)
    assert parted["fileCounts"] == {key: len(one[key]) for key in manifest_lists.LISTS}
    store = open_storage(job.spec.output.uri, None)

    def read(path: str) -> bytes:
        return store.read_bytes(layout.join(job.spec.output.uri, path))

    def drop_time(m: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in m.items() if k != "publishedAt"}

    assert drop_time(manifest_lists.whole(parted, read).as_json()) == drop_time(one)
    # `bij results` and `bij status` read the same rows and counts through the parts.
    assert rows_out(job) == results and rows_out(job, "errors") == errors
    assert manifest_summary(Manifest.parse(parted))[1:] == summary[1:]
    out = io.BytesIO()
    assert write_parquet(job.spec.output.uri, out, None) == one["counts"]["rows"]
    assert read_output(job).results == [json.loads(line) for line in results.splitlines()]
    # Published again in one document, the parts of the manifest it replaced go.
    monkeypatch.delenv("BIJ_MANIFEST_PART_FILES")
    again = publish_doc(job)
    assert drop_time(again) == drop_time(one)
    assert not store.list(layout.join(job.spec.output.uri, manifest_lists.PARTS_FOLDER) + "/")


def test_manifest_parts_are_written_before_the_manifest(file_place, make_job, run_shards, monkeypatch):
    job = published_job(file_place, make_job, run_shards)
    writes: list[str] = []
    for module in (publish_module, publish_rows):
        monkeypatch.setattr(module, "open_storage", lambda uri, s3: RecordingStorage(open_storage(uri, s3), writes))
    monkeypatch.setenv("BIJ_MANIFEST_PART_FILES", "2")
    manifest = publish_manifest(job)
    parts = [layout.join(job.spec.output.uri, p) for p in manifest.part_paths()]
    assert len(parts) > 2 and set(parts) <= set(writes)
    assert writes.index(layout.manifest_uri(job)) > max(writes.index(p) for p in parts)


def test_a_manifest_part_changed_after_publishing_is_refused_naming_it(file_place, make_job, run_shards,
                                                                       monkeypatch):
    job = published_job(file_place, make_job, run_shards)
    monkeypatch.setenv("BIJ_MANIFEST_PART_FILES", "2")
    manifest = publish_manifest(job)
    path = manifest.part_paths()[1]
    file_place.storage.write_bytes(layout.join(job.spec.output.uri, path), b'{"files": []}')
    with pytest.raises(ResultsError, match=path):
        rows_out(job)


def test_a_manifest_with_as_many_files_as_a_part_holds_stays_one_document():
    written: list[str] = []
    w = manifest_lists.PartWriter(lambda path, body: written.append(path), "p", size=3)
    w.add("files", [{"path": "a"}, {"path": "b"}])
    w.add("errorFiles", [{"path": "e"}])
    assert w.finish() == {"files": [{"path": "a"}, {"path": "b"}], "errorFiles": [{"path": "e"}], "cappedFiles": []}
    assert written == []


def test_starting_over_deletes_the_manifest_and_then_its_parts(file_place, make_job, run_shards, monkeypatch):
    from bij.steps.output_claim import reset_output

    job = published_job(file_place, make_job, run_shards)
    monkeypatch.setenv("BIJ_MANIFEST_PART_FILES", "2")
    manifest = publish_manifest(job)
    assert manifest.part_paths()
    reset_output(job)
    assert not file_place.storage.exists(layout.manifest_uri(job))
    assert not file_place.storage.list(layout.join(job.spec.output.uri, manifest_lists.PARTS_FOLDER) + "/")
