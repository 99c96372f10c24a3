"""bij-api's pure parts: the model map, a batch as a bij and a bij as an OpenAI Batch object, what an
upload's lines say. The server itself is tested with the `openai` SDK on the control plane (test_api.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bij.api.batches import (
    ANNOTATION,
    CANCELLING_AT,
    BadRequest,
    batch_object,
    batch_of_file,
    bij_name,
    check_metadata,
    output_file_id,
    status_of,
    window_seconds,
)
from bij.api.files import LineStats
from bij.api.models import ModelMap, ModelMapError, job_doc
from bij.contract.codes import OPENAI_ENDPOINTS
from bij.contract.manifest import Manifest
from bij.contract.spec import SpecError, parse_job

BATCH = "batch_0123456789abcdef01234567"


def bij(phase: str | None = None, *, cancel: bool = False, rows: dict[str, int] | None = None,
        **status: Any) -> dict[str, Any]:
    rec = {"id": BATCH, "endpoint": "/v1/chat/completions", "input_file_id": "file-abc", "completion_window": "2h",
           "metadata": {"team": "a"}, "model": "tiny", "lines": 10}
    st: dict[str, Any] = dict(status)
    if phase:
        st["phase"] = phase
    if rows:
        st["rows"] = rows
    return {"metadata": {"name": "batch-0123456789abcdef01234567", "creationTimestamp": "2024-01-01T00:00:00Z",
                         "annotations": {ANNOTATION: json.dumps(rec)}},
            "spec": {"cancel": cancel}, "status": st}


@pytest.mark.parametrize("doc, status", [
    (bij(), "validating"),
    (bij("Pending"), "validating"),
    (bij("Pending", rounds=[{"round": 0}]), "in_progress"),
    (bij("Planning"), "validating"),
    (bij("Planning", rounds=[{"round": 0}]), "in_progress"),  # planning a judge round
    (bij("Running"), "in_progress"),
    (bij("Suspended"), "in_progress"),
    (bij("Publishing"), "finalizing"),
    (bij("Cancelling"), "finalizing"),  # the deadline passed: the finished part is being published
    (bij("Running", cancel=True), "cancelling"),
    (bij("Cancelling", cancel=True), "cancelling"),
    (bij("Publishing", cancel=True), "finalizing"),  # asked too late: every row was done
    (bij("Succeeded"), "completed"),
    (bij("Failed"), "failed"),
    (bij("CanaryFailed"), "failed"),  # spec.canary stopped it: nothing more runs
    (bij("Cancelled", cancel=True), "cancelled"),
    (bij("Expired"), "expired"),
])
def test_the_batch_status_follows_the_bij_phase(doc: dict[str, Any], status: str) -> None:
    assert status_of(doc) == status


def canary_bij(phase: str, **status: Any) -> dict[str, Any]:
    doc = bij(phase, **status)
    doc["spec"]["canary"] = {"maxErrorShare": 0.05}
    return doc


@pytest.mark.parametrize("doc, status", [
    (canary_bij("Planning"), "validating"),
    (canary_bij("Running", rounds=[{"round": 0, "canaryShards": 2}], canary={"shards": 2}), "validating"),
    (canary_bij("Suspended", rounds=[{"round": 0}], canary={"shards": 2}), "validating"),
    (canary_bij("Running", rounds=[{"round": 0}], canary={"shards": 2, "verdict": "Passed"}), "in_progress"),
    (canary_bij("CanaryFailed", canary={"shards": 2, "verdict": "Failed"}), "failed"),
    (canary_bij("Publishing", canary={"shards": 2, "verdict": "Passed"}), "finalizing"),
])
def test_a_batch_is_validating_while_its_canary_runs_and_in_progress_once_it_passed(
        doc: dict[str, Any], status: str) -> None:
    assert status_of(doc) == status


def test_a_finished_batch_names_its_output_and_error_files_and_counts_from_the_status() -> None:
    running = batch_object(bij("Running", rows={"done": 4, "failed": 1}, startTime="2024-01-01T00:00:05Z"))
    assert running["request_counts"] == {"total": 10, "completed": 4, "failed": 1}
    assert running["output_file_id"] is None and running["in_progress_at"] == 1704067205
    assert running["expires_at"] == running["created_at"] + 7200 and running["metadata"] == {"team": "a"}
    done = batch_object(bij("Succeeded", rows={"done": 9, "failed": 1}, completionTime="2024-01-01T00:01:00Z"))
    assert done["output_file_id"] == output_file_id(BATCH, "output") and done["completed_at"] == 1704067260
    assert batch_of_file(done["output_file_id"]) == (BATCH, "output")
    assert batch_of_file(done["error_file_id"]) == (BATCH, "errors")
    no_errors = batch_object(bij("Succeeded", rows={"done": 10, "failed": 0}))
    assert no_errors["error_file_id"] is None
    cancelled = bij("Cancelled", cancel=True, rows={"done": 3, "failed": 0}, completionTime="2024-01-01T00:02:00Z")
    cancelled["metadata"]["annotations"][CANCELLING_AT] = "2024-01-01T00:01:30Z"
    c = batch_object(cancelled)
    assert (c["cancelling_at"], c["cancelled_at"], c["output_file_id"]) == \
        (1704067290, 1704067320, output_file_id(BATCH, "output"))


MANIFEST = Manifest.parse({"counts": {"rows": 9, "errors": 1, "tokensIn": 120, "tokensOut": 45,
                                      "reasoningTokens": 7}, "engine": {"cachedTokens": 32}})


def test_an_ended_batch_has_the_usage_its_manifest_counts_and_when_it_began_finalizing() -> None:
    from openai.types import Batch

    publish = {"rounds": 1, "planUri": "file:///p", "passes": {"write": 1}, "startedAt": "2024-01-01T00:00:50Z"}
    finalizing = batch_object(bij("Publishing", rows={"done": 9, "failed": 1}, publish=publish))
    assert finalizing["status"] == "finalizing" and finalizing["finalizing_at"] == 1704067250
    assert finalizing["usage"] is None  # no manifest yet: nothing counted
    done = bij("Succeeded", rows={"done": 9, "failed": 1}, publish=publish, completionTime="2024-01-01T00:01:00Z")
    obj = batch_object(done, MANIFEST)
    assert obj["usage"] == {"input_tokens": 120, "input_tokens_details": {"cached_tokens": 32},
                            "output_tokens": 45, "output_tokens_details": {"reasoning_tokens": 7},
                            "total_tokens": 165}
    assert (obj["finalizing_at"], obj["completed_at"]) == (1704067250, 1704067260)
    sdk = Batch.model_validate(obj)
    assert sdk.usage is not None and sdk.usage.input_tokens_details.cached_tokens == 32
    assert sdk.usage.output_tokens_details.reasoning_tokens == 7 and sdk.usage.total_tokens == 165
    assert batch_object(bij("Running", rows={"done": 1, "failed": 0}), MANIFEST)["usage"] is None
    assert batch_object(done)["finalizing_at"] == 1704067250 and batch_object(bij("Running"))["finalizing_at"] is None


def test_a_stopped_batch_counts_its_requests_never_run_as_failed() -> None:
    rows = {"done": 4, "failed": 1, "notRun": 5}
    expired = batch_object(bij("Expired", rows=rows, completionTime="2024-01-01T02:00:30Z"), MANIFEST)
    assert expired["request_counts"] == {"total": 10, "completed": 4, "failed": 6}
    assert expired["error_file_id"] == output_file_id(BATCH, "errors") and expired["usage"]["input_tokens"] == 120
    # Finalizing from the deadline on: the batch stopped there, then published what it had.
    assert expired["expired_at"] == 1704074430 and expired["finalizing_at"] == expired["expires_at"] == 1704074400
    stopping = batch_object(bij("Cancelling", rows={"done": 4, "failed": 0}))
    assert stopping["status"] == "finalizing" and stopping["finalizing_at"] == stopping["expires_at"]
    all_run = batch_object(bij("Cancelled", cancel=True, rows={"done": 3, "failed": 0, "notRun": 7}))
    assert all_run["error_file_id"] == output_file_id(BATCH, "errors")
    assert all_run["request_counts"]["failed"] == 7 and all_run["finalizing_at"] is None


def test_a_failed_batch_says_why_in_errors() -> None:
    failed = bij("Failed", message="round 0: lane 1 failed",
                 conditions=[{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}])
    errors = batch_object(failed)["errors"]
    assert errors["data"][0]["code"] == "BackoffLimitExceeded" and "lane 1" in errors["data"][0]["message"]


def test_the_sdk_parses_every_batch_object() -> None:
    from openai.types import Batch

    for doc in (bij(), bij("Running", rows={"done": 1, "failed": 0}), bij("Failed", message="x"),
                bij("Expired", rows={"done": 1, "failed": 1}, completionTime="2024-01-01T00:02:00Z")):
        Batch.model_validate(batch_object(doc))


@pytest.mark.parametrize("window, seconds", [("24h", 86400), ("30m", 1800), ("90s", 90), ("2d", 172800)])
def test_the_completion_window_is_the_deadline(window: str, seconds: int) -> None:
    assert window_seconds(window) == seconds


def test_the_longest_window_is_the_longest_deadline_the_crd_takes() -> None:
    assert window_seconds("366d") == 366 * 86400


@pytest.mark.parametrize("window", ["soon", "0h", "24", "-1h", 24, None, "9999999d", "367d", "8785h"])
def test_a_window_that_is_no_duration_is_refused_naming_the_field(window: Any) -> None:
    with pytest.raises(BadRequest, match="completion_window") as e:
        window_seconds(window)
    assert e.value.param == "completion_window"


def test_metadata_is_at_most_16_string_pairs() -> None:
    assert check_metadata({"a": "b"}) == {"a": "b"} and check_metadata(None) == {}
    for bad in ({str(i): "v" for i in range(17)}, {"a": 1}, {"k" * 65: "v"}, ["a"]):
        with pytest.raises(BadRequest, match="metadata"):
            check_metadata(bad)


def test_only_our_batch_ids_name_a_bij() -> None:
    assert bij_name(BATCH) == "batch-0123456789abcdef01234567"
    for other in ("batch_../x", "file-abc", "batch_", "batch_a-b"):
        assert bij_name(other) is None


def test_a_models_entry_becomes_the_bij_of_each_endpoints_task() -> None:
    models = ModelMap.parse({"llama": {"model": {"engine": "vllm", "name": "/models/llama"},
                                       "workers": {"gpus": 1, "spot": True, "parallelism": 3}}}, "models.yaml")
    assert models.names == ["llama"] and models.template("gpt-4") is None
    doc = job_doc("batch-1", "team-a", models.template("llama") or {}, input_uri="s3://b/f/team-a/files/x/c.jsonl",
                  output_uri="s3://b/f/team-a/batches/batch_1/", task="chat", deadline_seconds=3600,
                  labels={"l": "true"})
    job = parse_job(doc)
    assert (job.spec.model.engine, job.spec.model.task, job.spec.workers.parallelism) == ("vllm", "chat", 3)
    assert (job.spec.input.format, job.spec.output.compression, job.spec.deadline_seconds) == ("openai", "none", 3600)
    assert job.metadata.namespace == "team-a"


def test_an_embedding_model_serves_only_the_embeddings_endpoint() -> None:
    models = ModelMap.parse({"minilm": {"model": {"engine": "sentence-transformers"}}}, "models.yaml")
    template = models.template("minilm") or {}
    common = dict(input_uri="file:///f/in.jsonl", output_uri="file:///f/out/", deadline_seconds=None)
    assert parse_job(job_doc("b", "ns", template, task="embed", **common)).spec.model.task == "embed"
    with pytest.raises(SpecError, match="supports tasks embed, classify, score and rerank"):
        parse_job(job_doc("b", "ns", template, task="chat", **common))


def test_a_cross_encoder_serves_the_rerank_and_score_endpoints_and_not_chat() -> None:
    from bij.api.bodies import CreateBatch, parse

    models = ModelMap.parse({"ce": {"model": {"engine": "sentence-transformers", "name": "/models/ce"}}}, "models.yaml")
    template = models.template("ce") or {}
    common = dict(input_uri="file:///f/in.jsonl", output_uri="file:///f/out/", deadline_seconds=None)
    for endpoint, task in (("/v1/rerank", "rerank"), ("/v1/score", "score"), ("/classify", "classify")):
        batch = parse(CreateBatch, {"input_file_id": "file-1", "endpoint": endpoint}, "the body")
        doc = job_doc("b", "ns", template, task=OPENAI_ENDPOINTS[batch.endpoint], **common)
        assert parse_job(doc).spec.model.task == task
    with pytest.raises(SpecError, match="supports tasks embed, classify, score and rerank"):
        parse_job(job_doc("b", "ns", template, task="chat", **common))


def test_a_model_entry_may_give_its_batches_a_canary() -> None:
    models = ModelMap.parse({"m": {"model": {"engine": "echo"}, "canary": {"rows": 20, "maxErrorShare": 0.05}}},
                            "models.yaml")
    doc = job_doc("b", "ns", models.template("m") or {}, task="chat", input_uri="file:///f/in.jsonl",
                  output_uri="file:///f/out/", deadline_seconds=None)
    canary = parse_job(doc).spec.canary
    assert canary is not None and (canary.rows, canary.max_error_share) == (20, 0.05)


@pytest.mark.parametrize("doc, message", [
    ({"m": {"model": {"engine": "warp-drive"}}}, "model 'm': no endpoint's task can run it: task chat: spec.model"),
    ({"m": {"input": {"uri": "s3://x/"}}}, "model 'm': input cannot be set here"),
    ({"m": "vllm"}, "model 'm': must be a mapping"),
    (["m"], "must map model names"),
])
def test_a_bad_model_map_is_refused_naming_the_model_and_field(doc: Any, message: str) -> None:
    with pytest.raises(ModelMapError, match=message.replace("(", r"\(")):
        ModelMap.parse(doc, "models.yaml")


def test_upload_line_stats_count_lines_and_models_across_chunk_boundaries() -> None:
    lines = [json.dumps({"custom_id": str(i), "url": "/v1/chat/completions",
                         "body": {"model": "a" if i % 2 else "b"}}).encode() for i in range(50)]
    data = b"\n".join(lines) + b"\nnot json\n\n"
    stats = LineStats()
    for i in range(0, len(data), 7):  # cut anywhere, lines included
        stats.feed(data[i:i + 7])
    stats.close()
    assert (stats.lines, stats.models, stats.urls) == (51, {"a", "b"}, {"/v1/chat/completions"})
    last = LineStats()
    last.feed(lines[0])  # no newline at the end
    last.close()
    assert last.lines == 1


def test_an_upload_streams_to_storage_and_its_download_is_the_same_bytes(place: Any) -> None:
    """On file:// and on the S3 server: parts go out as they come (an S3 multipart upload past 8 MiB),
    the line stats see every line, and the download streams the stored bytes back."""
    import asyncio
    import hashlib

    from bij.api.files import FileStore

    files = FileStore(place.uri("openai/"), {"endpointUrl": place.endpoint} if place.endpoint else None)
    line = json.dumps({"custom_id": "x", "url": "/v1/chat/completions", "body": {"model": "m", "pad": "p" * 200}})
    data = ((line + "\n") * 50_000).encode()  # about 11 MiB
    sent = hashlib.sha256(data).hexdigest()

    async def chunks() -> Any:
        for i in range(0, len(data), 1 << 20):
            yield data[i:i + (1 << 20)]

    async def run() -> tuple[dict[str, Any], bytes]:
        obj = await files.upload("team-a", "in.jsonl", "batch", chunks())
        got = b"".join([c async for c in files.stream([files.content_uri("team-a", obj["id"])])])
        return obj, got

    obj, got = asyncio.run(run())
    assert obj["bytes"] == len(data) and hashlib.sha256(got).hexdigest() == sent
    meta = files.meta("team-a", obj["id"])
    assert meta is not None and (meta["lines"], meta["models"]) == (50_000, ["m"])
    assert [m["id"] for m in files.records("team-a")] == [obj["id"]] and files.records("team-b") == []
    assert files.meta("team-b", obj["id"]) is None  # another namespace's id is nowhere
    files.delete("team-a", obj["id"])
    assert files.meta("team-a", obj["id"]) is None and files.records("team-a") == []


def test_an_upload_cut_off_midway_leaves_no_file(place: Any) -> None:
    import asyncio

    from bij.api.files import FileStore

    files = FileStore(place.uri("openai/"), {"endpointUrl": place.endpoint} if place.endpoint else None)

    async def chunks() -> Any:
        for _ in range(9):
            yield b"x" * (1 << 20)  # past one S3 part: a multipart upload is under way
        raise ConnectionResetError("the client went away")

    with pytest.raises(ConnectionResetError):
        asyncio.run(files.upload("team-a", "in.jsonl", "batch", chunks()))
    assert files.records("team-a") == []
    assert place.storage.list(place.uri("openai/")) == []


def test_a_models_adapters_are_names_lines_may_use_and_its_key_names_its_base() -> None:
    entry = {"model": {"engine": "vllm", "name": "/models/llama",
                       "adapters": [{"name": "llama-fr", "uri": "s3://a/fr/"}, {"name": "llama-de", "uri": "s3://a/de/"}]}}
    models = ModelMap.parse({"llama": entry, "minilm": {"model": {"engine": "sentence-transformers"}}}, "models.yaml")
    assert models.names == ["llama", "llama-de", "llama-fr", "minilm"]
    assert (models.resolve("llama"), models.resolve("llama-fr"), models.resolve("gpt-4")) == \
        (("llama", None), ("llama", "llama-fr"), None)
    job = parse_job(job_doc("b", "ns", models.template("llama") or {}, input_uri="file:///f/in.jsonl",
                            output_uri="file:///f/out/", task="chat", deadline_seconds=None, served_name="llama"))
    assert job.spec.model.served_name == "llama" and job.spec.model.name == "/models/llama"
    assert [a.name for a in job.spec.model.adapters] == ["llama-fr", "llama-de"]


@pytest.mark.parametrize("doc, message", [
    ({"a": {"model": {"engine": "vllm", "adapters": [{"name": "b", "uri": "s3://x/b/"}]}},
      "b": {"model": {"engine": "echo"}}}, "model 'a': adapter 'b' has the name of model 'b'"),
    ({"a": {"model": {"engine": "vllm", "adapters": [{"name": "x", "uri": "s3://x/a/"}]}},
      "b": {"model": {"engine": "vllm", "adapters": [{"name": "x", "uri": "s3://x/b/"}]}}},
     "model 'b': adapter 'x' has the name of model 'a'.s adapter"),
    ({"a": {"model": {"engine": "vllm", "adapters": [{"name": "a", "uri": "s3://x/a/"}]}}},
     "model.adapters: 'a' is the base model's name"),
])
def test_a_name_lines_could_mean_two_models_by_is_refused(doc: Any, message: str) -> None:
    with pytest.raises(ModelMapError, match=message):
        ModelMap.parse(doc, "models.yaml")


def test_upload_line_stats_keep_each_models_first_line_and_say_when_there_are_too_many() -> None:
    from bij.api.files import MAX_MODELS

    stats = LineStats()
    for i in range(MAX_MODELS + 3):
        stats.feed(json.dumps({"custom_id": str(i), "body": {"model": f"m{i // 2}"}}).encode() + b"\n")
    stats.close()
    assert stats.model_lines["m0"] == 1 and stats.model_lines["m1"] == 3 and stats.more_models == 0
    many = LineStats()
    for i in range(MAX_MODELS + 3):
        many.feed(json.dumps({"custom_id": str(i), "body": {"model": f"m{i}"}}).encode() + b"\n")
    assert len(many.models) == MAX_MODELS and many.more_models == MAX_MODELS + 1
