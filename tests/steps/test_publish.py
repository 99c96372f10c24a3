"""Publish: result and error files first, then one manifest that lists them with counts and checksums."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import zstandard
from recording import RecordingStorage

from bij import storage
from bij.contract import layout
from bij.contract.publish_plan import PublishPlan
from bij.engines.base import estimate_tokens
from bij.engines.echo import echo_embedding
from bij.local.publish import publish_manifest
from bij.steps import publish as publish_module
from bij.steps import publish_rows
from bij.steps.planner import plan_round
from bij.steps.publish import PublishError, WorkFilesRemoved, read_manifest
from bij.steps.publish_rows import PublishPlanError
from bij.storage import StorageError, open_storage
from bij.storage.segments import ShardLog
from bij.worker.shard import load_plan


def rows(n: int, prefix: str = "r") -> list[dict[str, Any]]:
    return [{"id": f"{prefix}{i}", "text": f"text {i} " + "y" * (i % 50)} for i in range(n)]


def test_the_manifest_is_written_last_and_once(place, make_job, run_shards, read_output, monkeypatch):
    inputs = rows(200) + ["bad line"]
    _, job = make_job(place, place.write_jsonl("in.jsonl", inputs))
    run_shards(job)
    writes: list[str] = []
    for module in (publish_module, publish_rows):
        monkeypatch.setattr(module, "open_storage",
                            lambda uri, s3: RecordingStorage(open_storage(uri, s3), writes))
    manifest = publish_manifest(job)
    out = read_output(job)
    published = [w for w in writes if not w.startswith(layout.state_prefix(job))]  # not the passes' work files
    assert published[-1] == layout.manifest_uri(job)
    assert writes.count(layout.manifest_uri(job)) == 1
    files, error_files = manifest.files or [], manifest.error_files or []
    listed = [layout.join(job.spec.output.uri, f.path) for f in files + error_files]
    assert set(listed) == set(published[:-1]) and len(files) >= 2
    # Only the record of the removed work files comes after the manifest (output.keepIntermediate false):
    # written before the first delete, and once more when the removal finished.
    assert writes[writes.index(layout.manifest_uri(job)) + 1:] == [layout.removed_uri(job)] * 2
    assert out.manifest == manifest.as_json()  # the manifest returned is the one written


def test_counts_and_checksums_describe_the_files(file_place, make_job, run_shards, read_output, publish_doc):
    good = rows(120)
    inputs: list[Any] = good[:60] + ["{oops", {"id": "e", "text": ""}] + good[60:]
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", inputs), sharding={"targetShardBytes": 2048})
    run_shards(job)
    manifest = publish_doc(job)
    out = read_output(job)  # checks rows, bytes and sha256 of every listed file
    tokens = sum(estimate_tokens(r["text"]) for r in good)
    assert manifest["counts"] == {"rows": 120, "errors": 2, "capped": 0, "duplicates": 0, "truncated": 0,
                                  "inputRows": 122, "tokensIn": tokens, "tokensOut": tokens, "reasoningTokens": 0,
                                  "errorCodes": {"empty_text": 1, "invalid_json": 1},
                                  "structured": {"validated": 0, "repaired": 0, "violations": 0}}
    assert sum(f["rows"] for f in manifest["files"]) == 120
    assert [f["shard"] for f in manifest["files"]] == sorted(f["shard"] for f in manifest["files"])
    assert out.result_ids == [r["id"] for r in good]
    assert manifest["outputUri"] == job.spec.output.uri and manifest["format"] == "jsonl"


def test_ids_repeated_across_shards_are_published_once_and_1_differs_from_1_as_a_string(
        file_place, make_job, run_shards, read_output):
    first = [{"id": 1, "text": "int one"}, {"id": "1", "text": "string one"}] + rows(40, "a")
    second = rows(40, "b") + [{"id": 1, "text": "int one again"}, {"id": "a3", "text": "a3 again"}]
    file_place.write_jsonl("in/1.jsonl", first)
    file_place.write_jsonl("in/2.jsonl", second)
    _, job = make_job(file_place, file_place.uri("in/"), sharding={"targetShardBytes": 1024})
    run_shards(job)
    manifest = publish_manifest(job)
    out = read_output(job)
    assert out.result_ids == [r["id"] for r in first + second[:-2]]
    assert [(e["id"], e["error"]["code"], e["object"]) for e in out.errors] == [
        (1, "duplicate_id", "2.jsonl"), ("a3", "duplicate_id", "2.jsonl")]
    assert manifest.counts.duplicates == 2


def test_a_duplicate_pods_records_are_published_once(s3_place, make_job, run_shards, read_output):
    inputs = rows(50)
    _, job = make_job(s3_place, s3_place.write_jsonl("in.jsonl", inputs), sharding={"targetShardBytes": 1 << 20})
    run_shards(job)
    plan = load_plan(layout.round_manifest_uri(job, 0), job.spec.storage.s3)
    log = ShardLog(s3_place.storage, layout.shard_prefix(plan.round_prefix, 0), writer_id="speculative-pod")
    records = log.read().records
    log.append(records[::-1])  # the same rows again, from another writer
    publish_manifest(job)
    out = read_output(job)
    assert out.result_ids == [r["id"] for r in inputs] and out.errors == []


@pytest.mark.parametrize("limit,ok", [(0.2, True), (0.19, False)])
def test_an_error_ratio_above_max_error_ratio_fails_and_writes_no_manifest(limit, ok, file_place, make_job,
                                                                           run_shards):
    inputs: list[Any] = rows(8) + ["x", "y"]  # 2 errors in 10 rows: 20%
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", inputs), maxErrorRatio=limit)
    run_shards(job)
    if ok:
        assert publish_manifest(job).counts.errors == 2
        assert read_manifest(job) is not None
        return
    with pytest.raises(PublishError, match=r"2 of 10 rows failed \(20.0%\), above spec.maxErrorRatio 19.0%"):
        publish_manifest(job)
    assert read_manifest(job) is None


def test_publishing_before_every_shard_finished_fails_and_writes_no_manifest(file_place, make_job, run_shards):
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", rows(300)), sharding={"targetShardBytes": 2048})
    run_shards(job)
    plan = load_plan(layout.round_manifest_uri(job, 0), job.spec.storage.s3)
    file_place.storage.delete(layout.done_uri(plan.round_prefix, 1))
    with pytest.raises(PublishError, match="shard 1 has not finished"):
        publish_manifest(job)
    assert read_manifest(job) is None


@pytest.mark.parametrize("compression,suffix", [("zstd", ".jsonl.zst"), ("none", ".jsonl")])
def test_result_files_are_zstd_or_plain_jsonl(compression, suffix, place, make_job, run_shards, read_output):
    inputs = rows(30)
    _, job = make_job(place, place.write_jsonl("in.jsonl", inputs), output={"compression": compression})
    run_shards(job)
    manifest = publish_manifest(job)
    out = read_output(job)
    assert manifest.compression == compression
    [f] = manifest.files or []
    assert f.path == f"results/r0-00000{suffix}"
    data = out.raw[f.path]
    if compression == "zstd":
        assert data.startswith(b"\x28\xb5\x2f\xfd")  # the zstd frame magic
        data = zstandard.ZstdDecompressor().decompress(data)
    assert [json.loads(line)["output"] for line in data.splitlines()] == [r["text"] for r in inputs]


def openai_line(cid: str, url: str, text: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m"}
    if url == "/v1/chat/completions":
        body["messages"] = [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]
    elif url == "/v1/embeddings":
        body["input"] = text
    else:
        body["prompt"] = text
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


@pytest.mark.parametrize("task,url", [("chat", "/v1/chat/completions"), ("generate", "/v1/completions"),
                                      ("embed", "/v1/embeddings")])
def test_openai_batch_input_gets_openai_batch_output(task, url, file_place, make_job, run_shards, read_output):
    texts = [f"question {i}" for i in range(5)]
    lines = [openai_line(f"req-{i}", url, t) for i, t in enumerate(texts)]
    _, job = make_job(file_place, file_place.write_jsonl("batch.jsonl", lines),
                      input={"format": "openai"}, model={"task": task, "name": "my-model"})
    run_shards(job)
    manifest = publish_manifest(job)
    out = read_output(job)
    assert manifest.format == "openai"
    for i, (row, text) in enumerate(zip(out.results, texts, strict=True)):
        assert row["custom_id"] == f"req-{i}" and row["error"] is None and row["id"].startswith("batch_req_")
        assert row["response"]["status_code"] == 200
        body = row["response"]["body"]
        assert body["model"] == "my-model"
        if task == "chat":
            assert body["object"] == "chat.completion"
            assert body["choices"][0]["message"] == {"role": "assistant", "content": "be brief\n" + text}
        elif task == "generate":
            assert body["object"] == "text_completion" and body["choices"][0]["text"] == text
        else:
            assert body["object"] == "list" and body["data"][0]["embedding"] == echo_embedding(text)
        assert body["usage"]["prompt_tokens"] >= 1


def test_publishing_again_gives_the_same_files(file_place, make_job, run_shards, read_output, publish_doc):
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", rows(100) + ["bad"]),
                      sharding={"targetShardBytes": 2048}, output={"compression": "zstd", "keepIntermediate": True})
    run_shards(job)
    first = publish_doc(job)
    raw = read_output(job).raw
    second = publish_doc(job)
    assert {k: v for k, v in first.items() if k != "publishedAt"} == \
        {k: v for k, v in second.items() if k != "publishedAt"}
    assert read_output(job).raw == raw
    assert plan_round(job, 0).shard_count == len(first["files"])


def test_publishing_with_a_spec_that_decides_rows_differently_is_refused(file_place, make_job, run_shards):
    from bij.contract.fingerprint import PlanRefused

    uri = file_place.write_jsonl("in.jsonl", [{"id": i, "text": f"row {i}"} for i in range(10)])
    _, job = make_job(file_place, uri)
    run_shards(job)
    _, renamed = make_job(file_place, uri, model={"name": "a-model-that-made-nothing"})
    with pytest.raises(PlanRefused, match='spec.model.name changed from null to "a-model-that-made-nothing"'):
        publish_manifest(renamed)  # the manifest would name a model that made none of the rows
    assert publish_manifest(job).model.name is None


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return {k: v for k, v in a.items() if k != "publishedAt"} == {k: v for k, v in b.items() if k != "publishedAt"}


def test_worker_processes_and_many_small_buckets_publish_what_one_process_does(file_place, make_job, run_shards,
                                                                               read_output, publish_doc):
    first = [{"id": 7, "text": "seven"}] + rows(60, "a") + ["bad line"]
    second = rows(30, "b") + [{"id": 7, "text": "seven again"}, {"id": "a5", "text": "a5 again"}] + rows(30, "c")
    file_place.write_jsonl("in/1.jsonl", first)
    file_place.write_jsonl("in/2.jsonl", second)
    _, job = make_job(file_place, file_place.uri("in/"), sharding={"targetShardBytes": 1024},
                      output={"keepIntermediate": True})
    run_shards(job)
    inline = publish_doc(job)
    raw = read_output(job).raw
    stats: list[dict[str, Any]] = []
    publish_manifest(job, processes=2, bucket_rows=10, stats=stats)
    spread = read_output(job)
    assert _same(inline, spread.manifest) and spread.raw == raw
    assert inline["counts"]["duplicates"] == 2
    plan = publish_rows.load(layout.publish_plan_uri(layout.publish_prefix(job)), job.spec.storage.s3)
    assert plan.buckets == 13  # 124 rows, 10 ids a bucket
    shards = plan.unit_count
    # Two processes a pass, each working every other index of it.
    assert sorted((s["pass"], s["index"], s["indexes"]) for s in stats) == sorted(
        [(p, k, len(range(k, n, 2))) for p, n in (("ids", shards), ("dedupe", 13), ("write", shards))
         for k in range(min(2, n))])
    assert all(s["rc"] == 0 and s["maxRssKiB"] > 0 for s in stats)


def test_published_files_and_the_manifest_are_readable_by_group_and_others(file_place, make_job, run_shards,
                                                                            tmp_path):
    inputs = [{"id": i, "text": "keep" if i % 3 else "drop"} for i in range(30)] + ["bad line"]
    # A judge that rejects "drop" rows, capped at one attempt: result, error and capped files all appear.
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", inputs), model={"task": "generate"},
                      judge={"type": "regex", "pattern": "keep", "strategy": "inPlace", "maxAttempts": 1})
    run_shards(job)
    old = os.umask(0o022)  # what a pod or a login shell has
    try:
        manifest = publish_manifest(job)
    finally:
        os.umask(old)
    out = Path(job.spec.output.uri[len("file://"):])
    paths = [f.path for files in (manifest.files, manifest.error_files, manifest.capped_files) for f in files or []]
    assert {p.split("/")[0] for p in paths} == {"results", "errors", "capped"}
    for path in [*paths, "manifest.json"]:
        assert (out / path).stat().st_mode & 0o777 == 0o644, path


def test_the_spec_sizes_the_publish_buckets_and_bij_publish_bucket_rows_overrides_it(file_place, make_job,
                                                                                     run_shards, read_output):
    inputs = rows(2500)
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", inputs),
                      output={"publishBucketRows": 1000, "keepIntermediate": True})
    run_shards(job)
    # What the operator does before it creates the pass Jobs: the plan says how many dedupe indexes.
    _, plan = publish_module.prepare_publish(job)
    assert (plan.bucket_rows, plan.buckets) == (1000, 3)
    assert publish_rows.count(plan, "dedupe") == 3
    manifest = publish_manifest(job)
    assert manifest.counts.rows == 2500 and read_output(job).result_ids == [r["id"] for r in inputs]
    # `bij publish --bucket-rows` (and `publish_manifest(bucket_rows=)`) wins over the spec.
    publish_manifest(job, bucket_rows=2000)
    assert publish_rows.load(layout.publish_plan_uri(layout.publish_prefix(job)), job.spec.storage.s3).buckets == 2
    _, default = make_job(file_place, file_place.uri("in.jsonl"), out_dir="out2/")
    assert default.spec.output.publish_bucket_rows == 250_000


def test_publishing_writes_objects_by_shards_and_output_parts_never_shards_times_buckets(file_place, make_job,
                                                                                      run_shards, monkeypatch):
    # Five ids twice, in other shards: losers to find, in a few of many buckets.
    inputs = rows(200) + rows(5)
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", inputs), sharding={"targetShardBytes": 1024},
                      output={"keepIntermediate": True})
    run_shards(job)
    written: list[str] = []
    for name in ("write_bytes", "write_stream", "create"):
        real = getattr(storage.FileStorage, name)

        def record(self: Any, uri: str, data: Any, _real: Any = real) -> Any:
            written.append(uri)
            return _real(self, uri, data)

        monkeypatch.setattr(storage.FileStorage, name, record)
    manifest = publish_manifest(job, bucket_rows=1000 // 100)  # 21 buckets of 10 ids
    prefix = layout.publish_prefix(job)
    plan = publish_rows.load(layout.publish_plan_uri(prefix), job.spec.storage.s3)
    shards, buckets = plan.unit_count, plan.buckets
    assert shards >= 8 and buckets == 21 and manifest.counts.duplicates == 5
    parts = sum(manifest.file_count(k) for k in ("files", "errorFiles", "cappedFiles"))
    losers = [u for u in written if "/losers/" in u]
    assert 1 <= len(losers) <= 5  # only buckets with duplicates
    # ids files and summaries (2 a shard), output parts, the buckets with losers, the plan and the manifest.
    assert len(written) == 2 * shards + parts + len(losers) + 2, written
    assert sorted(u for u in written if "/ids/" in u) == [layout.publish_ids_uri(prefix, u) for u in range(shards)]


def test_a_publish_whose_ids_pass_ran_on_an_older_version_goes_on_from_its_bucket_files(file_place, make_job,
                                                                                      run_shards, read_output):
    inputs = rows(50) + rows(5)
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", inputs), sharding={"targetShardBytes": 1024},
                      output={"keepIntermediate": True})
    run_shards(job)
    publish_manifest(job, bucket_rows=10)
    raw = read_output(job).raw
    prefix = layout.publish_prefix(job)
    plan = publish_rows.load(layout.publish_plan_uri(prefix), job.spec.storage.s3)
    store = file_place.storage
    losers = {o.uri: store.read_bytes(o.uri) for o in store.list(layout.publish_losers_folder(prefix))}
    assert sum(len(places) for v in losers.values() for places in json.loads(v).values()) == 5
    # What a pass 1 of an older version left: a file per shard and bucket (zstd, or plain before that), and
    # order.json.
    for unit in range(plan.unit_count):
        for b in range(plan.buckets):
            data = publish_rows._read_ids(store, prefix, unit, b)
            uri = layout.publish_bucket_ids_uri(prefix, unit, b)
            store.write_bytes(uri if b % 2 else uri.removesuffix(".zst"),
                              zstandard.ZstdCompressor().compress(data) if b % 2 else data)
        store.write_bytes(layout.publish_order_uri(prefix, unit), b'{"ordered": true}')
        store.delete(layout.publish_ids_uri(prefix, unit))
    for uri in losers:
        store.delete(uri)
    for pass_name in ("dedupe", "write"):
        for i in range(plan.count(pass_name)):
            publish_rows.run_pass(plan, pass_name, i)
    assert {o.uri: store.read_bytes(o.uri) for o in store.list(layout.publish_losers_folder(prefix))} == losers
    publish_module.finish_publish(job, 1, plan)
    assert read_output(job).raw == raw


def test_a_losers_file_an_earlier_publish_left_does_not_count_once_its_bucket_has_none(file_place, make_job,
                                                                                        run_shards, read_output):
    inputs = rows(50)
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", inputs), sharding={"targetShardBytes": 1024},
                      output={"keepIntermediate": True})
    run_shards(job)
    publish_manifest(job, bucket_rows=10)
    prefix = layout.publish_prefix(job)
    assert file_place.storage.list(layout.publish_losers_folder(prefix)) == []
    # As a publish of other rows (or other buckets) would have left them: in a bucket, and beyond the buckets.
    for b in (0, 99):
        file_place.storage.write_bytes(layout.publish_losers_uri(prefix, b), b'{"0": [[0, 0]], "1": [[0, 0]]}')
    manifest = publish_manifest(job, bucket_rows=10)
    assert manifest.counts.duplicates == 0 and read_output(job).result_ids == [r["id"] for r in inputs]


def test_an_ids_file_of_another_publish_plan_is_refused_naming_it(file_place, make_job, run_shards):
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", rows(50)), sharding={"targetShardBytes": 1024},
                      output={"keepIntermediate": True})
    run_shards(job)
    publish_manifest(job, bucket_rows=10)
    prefix = layout.publish_prefix(job)
    plan = publish_rows.load(layout.publish_plan_uri(prefix), job.spec.storage.s3)
    other = plan.model_copy(update={"buckets": plan.buckets + 1})
    with pytest.raises(StorageError, match=r"ids (file .*00000\.ids|of shard unit 0)"):
        for b in range(other.buckets):
            publish_rows.run_dedupe(other, b, file_place.storage)
        publish_rows.run_write(other, 0, file_place.storage)


@pytest.mark.parametrize("with_ids", [True, False])
def test_a_log_written_out_of_input_order_is_published_in_input_order(with_ids, file_place, make_job, run_shards,
                                                                     read_output):
    inputs = rows(60) if with_ids else [{"text": r["text"]} for r in rows(60)]
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", inputs), sharding={"targetShardBytes": 1 << 20},
                      output={"keepIntermediate": True})
    run_shards(job)
    plan = load_plan(layout.round_manifest_uri(job, 0), job.spec.storage.s3)
    records = ShardLog(file_place.storage, layout.shard_prefix(plan.round_prefix, 0)).read().records
    for obj in file_place.storage.list(layout.shard_prefix(plan.round_prefix, 0) + "/"):
        file_place.storage.delete(obj.uri)
    log = ShardLog(file_place.storage, layout.shard_prefix(plan.round_prefix, 0))
    log.append(records[40:])  # a later writer's rows first, as a resumed writer's log can list first
    log.append(records[:40])
    manifest = publish_manifest(job)
    out = read_output(job)
    assert [r["output"] for r in out.results] == [r["text"] for r in inputs] and manifest.counts.rows == 60
    # Without ids no ids pass ran to say the log was out of order: the write pass found it out.
    pplan = publish_rows.load(layout.publish_plan_uri(layout.publish_prefix(job)), job.spec.storage.s3)
    assert pplan.unique_ids is not with_ids


def test_a_job_whose_ids_are_all_generated_publishes_without_the_ids_and_dedupe_passes(file_place, make_job,
                                                                                      run_shards, read_output,
                                                                                      monkeypatch):
    inputs = [{"text": f"text {i} " + "y" * 20} for i in range(60)] + ["bad line"]  # no id field; an error row w/o id
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", inputs), sharding={"targetShardBytes": 1024},
                      output={"keepIntermediate": True})
    run_shards(job)
    scans: list[str] = []
    real_scan = ShardLog.scan

    def scan(self: ShardLog) -> Any:
        scans.append(self.prefix)
        return real_scan(self)

    monkeypatch.setattr(ShardLog, "scan", scan)
    stats: list[dict[str, Any]] = []
    manifest = publish_manifest(job, processes=2, stats=stats)
    prefix = layout.publish_prefix(job)
    plan = publish_rows.load(layout.publish_plan_uri(prefix), job.spec.storage.s3)
    assert plan.unique_ids and (plan.count("ids"), plan.count("dedupe")) == (0, 0)
    assert {s["pass"] for s in stats} == {"write"} and plan.unit_count >= 3
    assert file_place.storage.list(f"{prefix}/ids/") == []
    out = read_output(job)
    assert [r["output"] for r in out.results] == [r["text"] for r in inputs[:-1]]
    assert len(set(out.result_ids)) == 60 and manifest.counts.errors == 1
    # In this process (the passes' processes are their own): each shard's log is read once, by the write pass.
    scans.clear()
    publish_manifest(job)
    assert sorted(scans) == sorted(plan.unit(i)[2] for i in range(plan.unit_count))


def test_an_id_given_as_another_rows_generated_id_still_loses_to_it(file_place, make_job, run_shards, read_output):
    inputs = [{"text": f"text {i} " + "y" * 20} for i in range(60)]
    file_place.write_jsonl("in.jsonl", inputs)
    _, job = make_job(file_place, file_place.uri("in.jsonl"), sharding={"targetShardBytes": 1024})
    run_shards(job)
    first = publish_manifest(job)
    generated = read_output(job).result_ids[0]  # "<object>:<offset>" of the first row
    assert first.counts.duplicates == 0 and _publish_plan(job).unique_ids
    # The same id given by a row of another shard: no longer provably unique, so the passes look.
    file_place.write_jsonl("in.jsonl", [*inputs, {"id": generated, "text": "given"}])
    _, job = make_job(file_place, file_place.uri("in.jsonl"), sharding={"targetShardBytes": 1024}, out_dir="out2/")
    run_shards(job)
    manifest = publish_manifest(job)
    assert [(e["id"], e["error"]["code"]) for e in read_output(job).errors] == [(generated, "duplicate_id")]
    assert manifest.counts.duplicates == 1
    assert not _publish_plan(job).unique_ids


def _publish_plan(job: Any) -> PublishPlan:
    return publish_rows.load(layout.publish_plan_uri(layout.publish_prefix(job)), job.spec.storage.s3)


def test_a_shard_with_more_rows_than_a_file_holds_is_published_in_parts(file_place, make_job, run_shards,
                                                                        read_output, monkeypatch):
    inputs = rows(25)
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", inputs), output={"compression": "zstd"})
    run_shards(job)
    monkeypatch.setattr(publish_rows, "FILE_ROWS", 10)
    manifest = publish_manifest(job)
    assert [(f.path, f.rows) for f in manifest.files or []] == [
        ("results/r0-00000.jsonl.zst", 10), ("results/r0-00000-001.jsonl.zst", 10),
        ("results/r0-00000-002.jsonl.zst", 5)]
    assert read_output(job).result_ids == [r["id"] for r in inputs]


# A publish plan as the operator wrote it before the plan was a typed model (json.dumps(plan, indent=1)).
OLD_PUBLISH_PLAN = """{
 "prefix": "file:///data/out/_bij/job-1/publish",
 "outputUri": "file:///data/out/",
 "units": [
  [
   0,
   0,
   "file:///data/out/_bij/job-1/round-0/shards/00000"
  ],
  [
   0,
   1,
   "file:///data/out/_bij/job-1/round-0/shards/00001"
  ],
  [
   1,
   0,
   "file:///data/out/_bij/job-1/round-1/shards/00000"
  ]
 ],
 "objectNames": [
  [
   "a.jsonl",
   "b.jsonl"
  ],
  [
   "rejected-0.jsonl"
  ]
 ],
 "bucketRows": 250000,
 "buckets": 1,
 "compression": "zstd",
 "format": "parquet",
 "task": "generate",
 "judge": true,
 "idKind": "mixed"
}"""


def test_a_publish_plan_written_before_the_typed_model_loads_and_is_written_byte_for_byte_the_same(tmp_path):
    uri = (tmp_path / "plan.json").as_uri()
    open_storage(uri, None).write_bytes(uri, OLD_PUBLISH_PLAN.encode())
    plan = publish_rows.load(uri, None)
    assert plan.units == [(0, 0, "file:///data/out/_bij/job-1/round-0/shards/00000"),
                          (0, 1, "file:///data/out/_bij/job-1/round-0/shards/00001"),
                          (1, 0, "file:///data/out/_bij/job-1/round-1/shards/00000")]
    assert plan.object_names[1] == ["rejected-0.jsonl"] and plan.output_uri == "file:///data/out/"
    assert (plan.bucket_rows, plan.buckets, plan.format, plan.judge, plan.id_kind) == (250000, 1, "parquet", True,
                                                                                        "mixed")
    assert (plan.count("ids"), plan.count("dedupe"), plan.count("write")) == (3, 1, 3)
    assert plan.file_rows is None
    assert plan.to_json().decode() == OLD_PUBLISH_PLAN
    # A JSON lines plan has no id kind; a plan may set the rows of a file part.
    doc = {**json.loads(OLD_PUBLISH_PLAN), "format": "jsonl", "idKind": None, "fileRows": 10}
    plan = PublishPlan.from_json(json.dumps(doc).encode())
    assert (plan.id_kind, plan.file_rows) == (None, 10) and json.loads(plan.to_json()) == doc


def test_the_publish_plan_names_each_rounds_shard_count_not_each_shard(tmp_path):
    # Its size, and the memory of every pass that reads it, stays the same whatever the shards.
    doc = {**json.loads(OLD_PUBLISH_PLAN), "roundShards": [[2, "file:///data/out/_bij/job-1/round-0"],
                                                           [1, "file:///data/out/_bij/job-1/round-1"]]}
    del doc["units"]
    plan = PublishPlan.from_json(json.dumps(doc).encode())
    old = PublishPlan.from_json(OLD_PUBLISH_PLAN.encode())
    assert [plan.unit(i) for i in range(plan.unit_count)] == old.units
    assert (plan.count("ids"), plan.count("write")) == (3, 3) and "units" not in json.loads(plan.to_json())
    with pytest.raises(IndexError, match="unit 3"):
        plan.unit(3)


@pytest.mark.parametrize("data, says", [
    (b"{not json", "is not valid JSON"),
    (b"[1, 2]", "is not a JSON object"),
    (OLD_PUBLISH_PLAN.replace('"buckets": 1,', "").encode(), "buckets: Field required"),
    (OLD_PUBLISH_PLAN.replace('"buckets": 1,', '"buckets": "many",').encode(), "buckets:"),
    (OLD_PUBLISH_PLAN.replace('"format": "parquet"', '"format": "xlsx"').encode(), "format:"),
])
def test_an_unreadable_publish_plan_is_a_publish_plan_error_naming_it(tmp_path, data, says):
    from bij.cli.worker import main

    uri = (tmp_path / "plan.json").as_uri()
    open_storage(uri, None).write_bytes(uri, data)
    with pytest.raises(PublishPlanError, match=f"publish plan {uri} .*{says}") as e:
        publish_rows.load(uri, None)
    assert e.value.permanent
    assert main(["publish", "--plan", uri, "--pass", "ids", "--index", "0"]) == 42


def test_a_publish_pass_with_an_index_out_of_range_is_a_bad_configuration(file_place, make_job, run_shards):
    from bij.cli.worker import main

    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", rows(5)), output={"keepIntermediate": True})
    run_shards(job)
    publish_manifest(job)
    uri = layout.publish_plan_uri(layout.publish_prefix(job))
    assert main(["publish", "--plan", uri, "--pass", "dedupe", "--index", "1"]) == 42
    assert main(["publish", "--plan", uri + ".missing", "--pass", "ids", "--index", "0"]) == 42
    assert main(["publish", "--plan", uri, "--pass", "write", "--index", "0"]) == 0


def test_a_publish_pass_process_loads_no_engine_and_no_spec_model(file_place, make_job, run_shards):
    """Three pass processes start per publish: `bij-worker publish` imports only what a pass needs."""
    import subprocess
    import sys

    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", rows(5)), output={"keepIntermediate": True})
    run_shards(job)
    publish_manifest(job)
    uri = layout.publish_plan_uri(layout.publish_prefix(job))
    probe = ("import sys; from bij.cli.worker import main; "
             f"rc = main(['publish', '--plan', {uri!r}, '--pass', 'write', '--index', '0']); "
             "print(rc, sorted(m for m in sys.modules if m in ('torch', 'transformers', 'bij.engines.echo', "
             "'bij.contract.spec', 'bij.contract.spec_base', 'bij.contract.spec_io', 'bij.contract.spec_model', "
             "'bij.contract.spec_workers', 'bij.worker.main', 'bij.worker.shard', 'bij.worker.lanes', "
             "'bij.worker.engine_share')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.split(None, 1) == ["0", "[]\n"], out


def test_after_publishing_the_work_files_go_and_publishing_again_is_refused(file_place, make_job, run_shards,
                                                                           read_output):
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", rows(100) + ["bad"]),
                      sharding={"targetShardBytes": 2048})
    run_shards(job)
    plan = load_plan(layout.round_manifest_uri(job, 0), job.spec.storage.s3)
    logs = file_place.storage.list(layout.shard_prefix(plan.round_prefix, 0) + "/")
    manifest = publish_manifest(job)
    state = {o.uri for o in file_place.storage.list(layout.state_prefix(job) + "/")}
    assert logs and not state & {o.uri for o in logs}  # the durable logs are gone
    # Plans and records stay.
    assert layout.round_manifest_uri(job, 0) in state and layout.done_uri(plan.round_prefix, 0) in state
    removed = json.loads(file_place.storage.read_bytes(layout.removed_uri(job)))
    assert removed["objects"] >= len(logs) and removed["bytes"] > 0
    assert manifest.work_files_removal is None
    assert read_output(job).manifest == manifest.as_json()  # what was published is untouched
    refused = r"work files removed at .*\(output.keepIntermediate: false\).* new output URI"
    with pytest.raises(PublishError, match=refused):
        publish_manifest(job)
    assert read_manifest(job) == manifest


class FailingDeletes:
    """The real storage, whose batched deletes fail after `pages` of them (an outage midway)."""

    def __init__(self, inner: Any, pages: int):
        self.inner, self.pages, self.deletes = inner, pages, 0

    def delete_many(self, uris: Any) -> dict[str, str]:
        self.deletes += 1
        if self.deletes > self.pages:
            raise StorageError("delete s3://b/k: still failing after 8 attempts: SlowDown")
        return self.inner.delete_many(uris)  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_removal_failing_midway_leaves_the_job_published_and_a_rerun_removes_the_rest(
        file_place, make_job, run_shards, read_output, monkeypatch):
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", rows(300)), sharding={"targetShardBytes": 1024})
    run_shards(job)
    plan = load_plan(layout.round_manifest_uri(job, 0), job.spec.storage.s3)
    logs = [o.uri for i in range(len(plan.shards))
            for o in file_place.storage.list(layout.shard_prefix(plan.round_prefix, i) + "/")]
    assert len(logs) >= 3
    monkeypatch.setattr(storage.base, "PAGE", 2)  # pages of 2: the second delete request fails
    failing = FailingDeletes(open_storage(job.spec.output.uri, job.spec.storage.s3), pages=1)
    monkeypatch.setattr(publish_module, "open_storage", lambda uri, s3: failing)
    manifest = publish_manifest(job)
    # Published: the manifest is written and returned, and the failure rides beside it as a warning.
    warning = manifest.work_files_removal
    assert warning is not None and warning.error is not None
    assert warning.error.endswith("SlowDown") and warning.left == layout.state_prefix(job) + "/"
    assert warning.removed == 2
    assert read_output(job).manifest == manifest.as_json()  # the warning is never written into it
    assert sum(file_place.storage.exists(uri) for uri in logs) == len(logs) - 2  # one page went
    record = json.loads(file_place.storage.read_bytes(layout.removed_uri(job)))
    assert "finishedAt" not in record and record["failed"].endswith("SlowDown") and record["objects"] == 2
    # A second publish finds the job published, and resumes the removal on the way.
    monkeypatch.setattr(publish_module, "open_storage", open_storage)
    with pytest.raises(WorkFilesRemoved) as refused:
        publish_manifest(job)
    assert refused.value.removal is not None and refused.value.removal.error is None
    assert not any(file_place.storage.exists(uri) for uri in logs)
    record = json.loads(file_place.storage.read_bytes(layout.removed_uri(job)))
    assert record["finishedAt"] and record["objects"] >= len(logs) and "failed" not in record
    assert read_manifest(job) == manifest.model_copy(update={"work_files_removal": None})


def test_the_reasoning_tokens_result_rows_report_are_counted(file_place, make_job, run_shards):
    """A result row's usage may break its completion tokens down as OpenAI's does
    (``completion_tokens_details.reasoning_tokens``): the manifest counts them (bij-api's Batch usage)."""
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", rows(30)),
                      sharding={"targetShardBytes": 1 << 20})
    run_shards(job)
    plan = load_plan(layout.round_manifest_uri(job, 0), job.spec.storage.s3)
    prefix = layout.shard_prefix(plan.round_prefix, 0)
    records = ShardLog(file_place.storage, prefix).read().records
    for obj in file_place.storage.list(prefix + "/"):
        file_place.storage.delete(obj.uri)
    for i, rec in enumerate(records):
        rec["row"]["usage"]["completion_tokens_details"] = {"reasoning_tokens": i}
    ShardLog(file_place.storage, prefix).append(records)
    counts = publish_manifest(job).counts
    assert counts.rows == 30 and counts.reasoning_tokens == sum(range(30))
