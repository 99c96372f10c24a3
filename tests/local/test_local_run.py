"""`bij run SPEC.yaml`: exit 0 only when published; again is a no-op; Ctrl-C stops, a rerun resumes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from bij.contract import layout
from bij.steps.planner import plan_round
from bij.steps.publish import read_manifest


def rows(n: int) -> list[dict[str, Any]]:
    return [{"id": f"doc-{i}", "text": f"document {i} " + "k" * (i * 7 % 90)} for i in range(n)]


def bij_run(bij_bin: Any, spec: Path, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([bij_bin("bij"), "run", str(spec)], env=env, capture_output=True, text=True,
                          timeout=timeout)


def processes_running(arg: str) -> list[int]:
    """Pids of live processes with `arg` on their command line."""
    pids = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and arg.encode() in (d / "cmdline").read_bytes().split(b"\0"):
                pids.append(int(d.name))
        except OSError:
            continue
    return pids


def check_published(out: Any, inputs: list[dict[str, Any]], errors: int = 0) -> None:
    assert [(r["id"], r["output"]) for r in out.results] == [(r["id"], r["text"]) for r in inputs]
    assert len(out.errors) == errors


def test_bij_run_publishes_and_prints_the_manifest_path(place, make_job, read_output, worker_env, bij_bin):
    inputs = rows(400)
    spec, job = make_job(place, place.write_jsonl("in.jsonl", [*inputs, "not json"]),
                         sharding={"targetShardBytes": 8192})
    p = bij_run(bij_bin, spec, worker_env(place))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == layout.manifest_uri(job)
    out = read_output(job)
    assert len(out.manifest["files"]) == plan_round(job, 0).shard_count >= 3
    check_published(out, inputs, errors=1)


def test_bij_run_reads_and_publishes_on_azure_blob_storage(az_place, make_job, read_output, worker_env, bij_bin):
    """az:// is one module (storage/azure.py) and one row of contract.schemes: a whole job on it, input to
    manifest, against Azurite's Blob service, every lane a process signing with the account's key."""
    inputs = rows(300)
    spec, job = make_job(az_place, az_place.write_jsonl("in.jsonl", [*inputs, "not json"]),
                         sharding={"targetShardBytes": 8192}, output={"keepIntermediate": True})
    p = bij_run(bij_bin, spec, worker_env(az_place))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == layout.manifest_uri(job) and job.spec.output.uri.startswith("az://")
    out = read_output(job)
    assert len(out.manifest["files"]) == plan_round(job, 0).shard_count >= 3
    check_published(out, inputs, errors=1)
    # Segments, never appends: the lanes' durable logs on az:// are immutable blobs.
    assert any("/seg-" in o.uri for o in az_place.storage.list(az_place.base))
    # `bij results` on the bare az:// URI signs with the account the environment names, as its help says.
    got = subprocess.run([bij_bin("bij"), "results", layout.manifest_uri(job)], env=worker_env(az_place),
                         capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, got.stderr
    assert [json.loads(line) for line in got.stdout.splitlines()] == out.results


@pytest.mark.parametrize("keep", [True, False])
def test_a_second_run_is_a_no_op_that_leaves_the_published_files_as_they_were(keep, file_place, make_job,
                                                                              read_output, log_lines, worker_env,
                                                                              bij_bin, tmp_path):
    inputs = rows(300)
    spec, job = make_job(file_place, file_place.write_jsonl("in.jsonl", inputs),
                         sharding={"targetShardBytes": 8192}, output={"compression": "zstd", "keepIntermediate": keep})
    assert bij_run(bij_bin, spec, worker_env()).returncode == 0
    first, logs = read_output(job), log_lines(file_place, job)
    assert bool(logs) == keep  # without keepIntermediate the durable logs went once published
    computed = tmp_path / "computed.txt"
    p = bij_run(bij_bin, spec, worker_env(echo_log=computed))
    assert p.returncode == 0, p.stderr
    second = read_output(job)
    assert not computed.exists()  # no row was computed again
    assert log_lines(file_place, job) == logs
    assert second.raw == first.raw
    # Succeeded: decide() leaves it alone, as the operator does a Succeeded bij; the manifest stands as it was.
    assert second.manifest == first.manifest and "nothing to do" in p.stderr
    check_published(second, inputs)


def test_a_rerun_of_a_published_job_takes_its_kept_status_up_and_decide_leaves_it_alone(
        file_place, make_job, worker_env, monkeypatch, capsys):
    from bij.local.run import LocalRunner

    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", rows(40)), output={"keepIntermediate": True})
    for k, v in worker_env(file_place).items():
        monkeypatch.setenv(k, v)
    first = LocalRunner(job, show_progress=False)
    assert first.run() == 0
    published = read_manifest(job)
    again = LocalRunner(job, show_progress=False)
    assert again.run() == 0
    # The Succeeded status came back, as the operator finds it after a restart: no step, no round, no publish.
    assert again.backend.jobs == {} and read_manifest(job) == published
    assert again.backend.status["startTime"] == first.backend.status["startTime"]
    assert "nothing to do" in capsys.readouterr().err
    assert LocalRunner(job, show_progress=False, cancel=True).run() == 0
    assert "was published whole at" in capsys.readouterr().err and read_manifest(job) == published
    # Published by a bij that kept no status once published: the manifest says how it ended.
    Path(layout.local_status_uri(job)[len("file://"):]).unlink()
    third = LocalRunner(job, show_progress=False)
    assert third.run() == 0 and third.backend.jobs == {} and third.backend.status["phase"] == "Succeeded"
    assert read_manifest(job) == published


def test_ctrl_c_stops_the_workers_and_a_rerun_resumes(file_place, make_job, read_output, log_lines, worker_env,
                                                      bij_bin, tmp_path):
    inputs = rows(400)
    chunk_rows = 10
    spec, job = make_job(file_place, file_place.write_jsonl("in.jsonl", inputs),
                         sharding={"targetShardBytes": 6000, "chunkRows": chunk_rows},
                         batching={"maxBatchSize": 5}, workers={"parallelism": 2})
    computed = tmp_path / "computed.txt"
    # 0.05 s a batch: a shard takes seconds, so Ctrl-C lands with shards running and shards queued.
    p = subprocess.Popen([bij_bin("bij"), "run", str(spec)], env=worker_env(echo_log=computed, echo_delay=0.05),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 60
    # Both lanes are working (each has committed a chunk of its first shard) before Ctrl-C: on a
    # loaded machine a lane still starting up has nothing to drain and says nothing.
    while sum(1 for r in log_lines(file_place, job).values() if r) < 2:
        assert p.poll() is None and time.monotonic() < deadline, "bij run made no progress"
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
    _, err = p.communicate(timeout=30)
    assert p.returncode not in (0, None), err
    assert "run the same command again to resume" in err
    assert err.count("stopped with") == 2  # each running worker drained and said so
    assert processes_running(layout.round_manifest_uri(job, 0)) == []  # no worker outlived bij
    assert read_manifest(job) is None
    shards = plan_round(job, 0).shard_count
    durable = sum(len(r) for r in log_lines(file_place, job).values())
    assert shards >= 4 and 0 < durable < len(inputs)

    p2 = bij_run(bij_bin, spec, worker_env(echo_log=computed))
    assert p2.returncode == 0, p2.stderr
    check_published(read_output(job), inputs)
    # The running workers drained: their chunks in flight were committed, no row was computed twice.
    assert sorted(computed.read_text().splitlines()) == sorted(r["text"] for r in inputs)


@pytest.mark.parametrize("model", [
    {"engine": "sentence-transformers", "task": "embed", "name": "/no/such/model"},
    {"engine": "transformers", "task": "generate"},  # no model.name: the engine cannot be built
], ids=["missing-model-path", "engine-cannot-be-built"])
def test_a_bad_configuration_fails_fast_without_retries(model, file_place, make_job, worker_env, bij_bin):
    spec, job = make_job(file_place, file_place.write_jsonl("in.jsonl", rows(300)), model=model,
                         sharding={"targetShardBytes": 4096}, workers={"parallelism": 1, "backoffLimitPerIndex": 3})
    p = bij_run(bij_bin, spec, worker_env(), timeout=60)
    assert p.returncode == 42  # as the worker said: no retry can help
    assert "bad configuration (exit 42)" in p.stderr
    assert p.stderr.count("ERROR bij.worker: bad configuration") == 1  # one worker, no retry, no other shard
    assert "retry" not in p.stderr
    assert read_manifest(job) is None


def test_too_many_error_rows_fail_bij_run_before_anything_is_published(file_place, make_job, worker_env, bij_bin):
    # bij run takes the operator's decisions, the pre-publish error ratio check among them.
    spec, job = make_job(file_place, file_place.write_jsonl("in.jsonl", [*rows(20), *["not json"] * 5]),
                         maxErrorRatio=0.1)
    p = bij_run(bij_bin, spec, worker_env())
    assert p.returncode == 42, p.stderr
    assert "5 of 25 rows failed (20.0%), above spec.maxErrorRatio 10.0%; nothing was published" in p.stderr
    assert read_manifest(job) is None


# --- hostile specs and environments: one line that names the field or URI, never a traceback or a hang ---


def write_spec(tmp_path: Path, spec: dict[str, Any], name: str = "hostile") -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "batchinference.io/v1alpha1", "kind": "BatchInferenceJob",
                                    "metadata": {"name": name}, "spec": spec}))
    return path


def test_a_rerun_of_a_published_job_whose_work_files_went_still_refuses_a_changed_spec(
        file_place, make_job, read_output, worker_env, bij_bin):
    inputs = rows(50)
    uri = file_place.write_jsonl("in.jsonl", inputs)
    spec, job = make_job(file_place, uri)  # output.keepIntermediate false: the logs go once published
    assert bij_run(bij_bin, spec, worker_env()).returncode == 0
    first = read_output(job)
    changed, _ = make_job(file_place, uri, model={"maxTokens": 7})
    p = bij_run(bij_bin, changed, worker_env())
    assert p.returncode == 42 and "spec.model.maxTokens changed from 256 to 7" in p.stderr, p.stderr
    assert "nothing to do" not in p.stderr
    assert read_output(job).manifest == first.manifest  # the manifest still names what made its rows
    p = bij_run(bij_bin, spec, worker_env())
    assert p.returncode == 0 and "nothing to do" in p.stderr, p.stderr


def test_bij_run_takes_maxtokens_temperature_and_seed_from_model_sampling_alone(file_place, make_job, read_output,
                                                                                 worker_env, bij_bin):
    # The round plan carries the spec as a dict: a default written into it must not read back as set.
    words = [f"w{i}" for i in range(20)]
    inputs = [{"id": i, "text": " ".join(words)} for i in range(3)]
    spec, job = make_job(file_place, file_place.write_jsonl("in.jsonl", inputs),
                         model={"engine": "simulated", "simulated": {"stepSeconds": 0},
                                "sampling": {"temperature": 0.7, "maxTokens": 10, "seed": 3}})
    p = bij_run(bij_bin, spec, worker_env())
    assert p.returncode == 0, p.stderr
    # The simulated engine answers a row's first min(words, maxTokens) words.
    assert [r["output"] for r in read_output(job).results] == [" ".join(words[:10])] * 3


def one_line(p: subprocess.CompletedProcess[str]) -> str:
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    return lines[0]


@pytest.mark.parametrize("spec, args, says", [
    ({}, ["--parallelism", "-1"], "--parallelism must be at least 1, got -1"),
    ({"input": {"uri": "s3:///"}}, [], "spec.input.uri: s3:// needs a bucket (s3://bucket/prefix)"),
    ({"input": {"uri": "gs:///in/"}}, [], "spec.input.uri: gs:// needs a bucket (gs://bucket/prefix)"),
    ({"output": {"uri": "gcs://b/out/"}}, [], "spec.output.uri: must start with file://, s3://, gs:// or az://"),
    ({"output": {"uri": "file://"}}, [], "spec.output.uri: file:// needs a path (file:///absolute/path"),
    ({"storage": {"s3": {"endpointUrl": "not a url::"}}}, [],
     "spec.storage.s3.endpointUrl: must be an http(s) URL such as https://s3.example.com:9000"),
    ({"workers": {"parallelism": 10 ** 30}}, [], "spec.workers.parallelism: Input should be less than or equal"),
    ({"output": {"uri": "IN/out/"}}, [], "spec.output.uri must not be spec.input.uri, lie inside it or contain it"),
    ({"suspend": True}, [], "is suspended (spec.suspend: true): nothing was run; set spec.suspend to false"),
], ids=["negative-parallelism", "s3-without-bucket", "gs-without-bucket", "gcs-output", "file-without-path",
        "bad-endpoint", "huge-parallelism", "output-inside-input", "suspended"])
def test_a_spec_that_cannot_run_ends_in_one_line_and_exit_42(file_place, worker_env, bij_bin, tmp_path, spec, args,
                                                             says):
    from conftest import _merge

    in_uri = file_place.write_jsonl("in/a.jsonl", rows(10))
    base = {"input": {"uri": file_place.uri("in/")}, "output": {"uri": file_place.uri("out/")},
            "model": {"engine": "echo", "task": "generate"}}
    if spec.get("output", {}).get("uri") == "IN/out/":
        spec = {"output": {"uri": file_place.uri("in/out/")}}
    path = write_spec(tmp_path, _merge(base, spec))
    p = subprocess.run([bij_bin("bij"), "run", str(path), *args], env=worker_env(), capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 42
    assert says in one_line(p)
    assert in_uri and not (tmp_path / "data" / "out" / "manifest.json").exists()


def listing(root: Path) -> list[tuple[str, bytes | None]]:
    """Every path under `root` (links not followed) with a file's bytes: what a refused job must leave as it was."""
    found = []
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            found.append((str(path.relative_to(root)), path.read_bytes() if path.is_file() else None))
    return sorted(found)


@pytest.mark.parametrize("args", [[], ["--restart"]], ids=["run", "restart"])
@pytest.mark.parametrize("overlap", ["symlink", "symlink-inside", "relative-path"])
def test_an_output_that_overlaps_the_input_is_refused_leaving_both_folders_as_they_were(
        overlap, args, file_place, worker_env, bij_bin, tmp_path, monkeypatch):
    # The input is an earlier job's published output, manifest.json and all: the output the spec names
    # resolves into it, which only the plan step sees. Not a status file, owner record or deletion lands there.
    data = tmp_path / "data"
    file_place.write_jsonl("in/results/r0-00000.jsonl", rows(20))
    (data / "in" / "manifest.json").write_text('{"files": []}')
    out = file_place.uri("out/")
    if overlap == "symlink":
        (data / "out").symlink_to(data / "in")
    elif overlap == "symlink-inside":
        (data / "out").symlink_to(data / "in" / "results")
    else:  # written apart, one relative and one absolute: the spec check cannot see the overlap
        monkeypatch.chdir(tmp_path)
        out = "file://data/in/"
    spec = write_spec(tmp_path, {"input": {"uri": file_place.uri("in/")}, "output": {"uri": out},
                                 "model": {"engine": "echo", "task": "generate"}})
    before = listing(data), listing(data / "in")
    computed = tmp_path / "computed.txt"
    p = subprocess.run([bij_bin("bij"), "run", str(spec), *args], env=worker_env(echo_log=computed),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 42, p.stderr
    assert "spec.output.uri must not be spec.input.uri, lie inside it or contain it" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and not computed.exists()
    assert (listing(data), listing(data / "in")) == before


def test_inputs_whose_partitioned_files_would_clash_are_refused_before_any_row_is_computed(
        file_place, make_job, worker_env, bij_bin, tmp_path):
    # results/c.jsonl.zst would be c.jsonl's file and the folder of c.jsonl.zst/d.jsonl's: refused when
    # planned, not found by the write pass after the compute (exit 1 there, as if a rerun could help).
    first = file_place.write_jsonl("in/c.jsonl", rows(30))
    second = file_place.write_jsonl("in/c.jsonl.zst/d.jsonl", rows(30))
    spec, job = make_job(file_place, file_place.uri("in/"), output={"partitionBy": "input", "compression": "zstd"})
    computed = tmp_path / "computed.txt"
    p = bij_run(bij_bin, spec, worker_env(echo_log=computed))
    assert p.returncode == 42, p.stderr  # bad configuration: no rerun helps until the input or spec changes
    assert f"{first} and {second} cannot both be published: results/c.jsonl.zst would be both a file and the " \
           "folder of results/c.jsonl.zst/d.jsonl.zst: rename one, or narrow spec.input.uri" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
    assert not computed.exists()  # no row computed
    assert not (tmp_path / "data" / "out").exists()  # and nothing written


def test_a_partition_clash_fails_the_job_as_plan_refused(file_place, make_job, worker_env, monkeypatch):
    # The operator's decision on the plan step's report, as `kubectl get bij` would show it: Failed, the
    # reason PlanRefused, the message naming both inputs; never a plan retried every few minutes.
    from bij.contract.status import JobStatus
    from bij.control.observe import failure_reason
    from bij.local.run import LocalRunner

    first = file_place.write_jsonl("in/c.jsonl", rows(5))
    second = file_place.write_jsonl("in/c.jsonl.zst/d.jsonl", rows(5))
    _, job = make_job(file_place, file_place.uri("in/"), output={"partitionBy": "input", "compression": "zstd"})
    for k, v in worker_env(file_place).items():
        monkeypatch.setenv(k, v)
    runner = LocalRunner(job, show_progress=False)
    assert runner.run() == 42
    status = JobStatus.read(runner.backend.status)
    assert status.phase == "Failed" and failure_reason(status) == "PlanRefused"
    assert f"{first} and {second} cannot both be published" in (status.message or "")


def test_storage_that_can_never_work_ends_in_one_line_naming_the_uri(s3_place, worker_env, bij_bin, tmp_path):
    s3_place.write_jsonl("in/a.jsonl", rows(10))
    spec = {"input": {"uri": s3_place.uri("in/")}, "output": {"uri": s3_place.uri("out/")},
            "model": {"engine": "echo", "task": "generate"}, "storage": s3_place.spec_storage}
    missing = {**spec, "input": {"uri": "s3://no-such-bucket-here/in/"}}
    p = bij_run(bij_bin, write_spec(tmp_path, missing), worker_env(s3_place), timeout=60)
    assert p.returncode == 42
    line = one_line(p)
    assert "s3://no-such-bucket-here/in/" in line and "NoSuchBucket" in line and "create the bucket" in line

    env = {k: v for k, v in worker_env(s3_place).items() if not k.startswith("AWS_") or k == "AWS_ENDPOINT_URL"}
    env.update(AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"), AWS_CONFIG_FILE=str(tmp_path / "none"),
               AWS_EC2_METADATA_DISABLED="true")
    p = bij_run(bij_bin, write_spec(tmp_path, spec), env, timeout=60)
    assert p.returncode == 42
    line = one_line(p)
    assert s3_place.uri("out/") in line and "no AWS credentials found: set AWS_ACCESS_KEY_ID" in line


def test_an_unreachable_endpoint_ends_in_one_line_after_the_retries(s3_place, worker_env, bij_bin, tmp_path):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = {"input": {"uri": "s3://b/in/"}, "output": {"uri": "s3://b/out/"},
            "model": {"engine": "echo", "task": "generate"}, "storage": {"s3": {"endpointUrl": f"http://127.0.0.1:{port}"}}}
    p = bij_run(bij_bin, write_spec(tmp_path, spec), worker_env(s3_attempts=2), timeout=120)
    assert p.returncode == 1  # an outage may pass: worth running again
    assert "still failing after 2 attempts" in one_line(p) and "check spec.storage.s3.endpointUrl" in one_line(p)


def test_the_endpoint_in_the_spec_reaches_every_storage_call_whatever_the_environment_says(
        s3_place, make_job, read_output, worker_env, bij_bin):
    # The spec names the S3 server; the environment names a port nobody listens on. Every command that
    # is given the job's YAML must reach the server through the spec alone, the publish plan included.
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        poisoned = f"http://127.0.0.1:{s.getsockname()[1]}"
    inputs = rows(120)
    spec, job = make_job(s3_place, s3_place.write_jsonl("in.jsonl", inputs), sharding={"targetShardBytes": 2048},
                         output={"keepIntermediate": True})  # so that `bij publish` may publish again
    assert job.spec.storage.s3.endpoint_url == s3_place.endpoint
    env = worker_env(s3_attempts=2, AWS_ENDPOINT_URL=poisoned)

    p = bij_run(bij_bin, spec, env)
    assert p.returncode == 0, p.stderr
    check_published(read_output(job), inputs)

    run = [bij_bin("bij"), "publish", str(spec), "--parallelism", "2"]
    p = subprocess.run(run, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    check_published(read_output(job), inputs)

    p = subprocess.run([bij_bin("bij"), "status", str(spec)], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "published" in p.stdout and "120 results" in p.stdout

    p = subprocess.run([bij_bin("bij"), "results", str(spec)], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert [json.loads(line)["id"] for line in p.stdout.splitlines()] == [r["id"] for r in inputs]

    # A bare URI has no spec: the standard AWS environment decides, so the poisoned endpoint is what it tries.
    p = subprocess.run([bij_bin("bij"), "results", layout.manifest_uri(job)], env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 1 and poisoned in p.stderr


def test_gs_input_and_output_plan_run_and_publish_through_bij_run(gs_place, make_job, read_output, worker_env,
                                                                   bij_bin):
    # gs:// is GCS's XML API: the session's S3 server stands in for it through BIJ_GCS_ENDPOINT_URL; the S3
    # settings of the environment name a port nobody listens on, and gs:// must never use them.
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        poisoned = f"http://127.0.0.1:{s.getsockname()[1]}"
    inputs = rows(300)
    spec, job = make_job(gs_place, gs_place.write_jsonl("in/a.jsonl", inputs[:150]),
                         input={"uri": gs_place.uri("in/*.jsonl")}, sharding={"targetShardBytes": 2048},
                         output={"keepIntermediate": True})
    gs_place.write_jsonl("in/b.jsonl", inputs[150:])
    env = worker_env(gs_place, s3_attempts=2, AWS_ENDPOINT_URL=poisoned)
    p = bij_run(bij_bin, spec, env)
    assert p.returncode == 0, p.stderr
    manifest_uri = layout.manifest_uri(job)
    assert manifest_uri.startswith("gs://") and p.stdout.strip().splitlines()[-1] == manifest_uri
    out = read_output(job)
    check_published(out, inputs)

    p = subprocess.run([bij_bin("bij"), "publish", str(spec)], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    check_published(read_output(job), inputs)
    p = subprocess.run([bij_bin("bij"), "results", manifest_uri], env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    assert [json.loads(line)["id"] for line in p.stdout.splitlines()] == [r["id"] for r in inputs]


def test_a_store_that_refuses_the_identity_ends_bij_run_and_bij_publish_with_42_naming_the_uri_and_the_key(
        s3_tenant, s3_service, make_job, read_output, worker_env, bij_bin, tmp_path):
    from s3server import Identity

    inputs = rows(60)
    place, owner = s3_tenant.place, s3_tenant.identity
    spec, job = make_job(place, place.write_jsonl("in/a.jsonl", inputs), output={"keepIntermediate": True})
    missing, _ = make_job(place, "s3://bij-no-such-bucket-here/in/", name="missing", out_dir="out-missing/")
    stranger = s3_service.add_user(f"stranger-{os.urandom(4).hex()}")
    wrong_secret = Identity(owner.access_key, "0" * 32)
    for who, path, code, where in [(stranger, spec, "AccessDenied", place.base),
                                   (wrong_secret, spec, "SignatureDoesNotMatch", place.base),
                                   (owner, missing, "NoSuchBucket", "s3://bij-no-such-bucket-here/in/")]:
        p = bij_run(bij_bin, path, worker_env(place, **who.env()), timeout=60)
        assert p.returncode == 42, p.stderr
        assert code in p.stderr and where in p.stderr and f"as access key id {who.access_key}:" in p.stderr, p.stderr
        assert who.secret_key not in p.stderr + p.stdout and "Traceback" not in p.stderr

    p = bij_run(bij_bin, spec, worker_env(place, **owner.env()))
    assert p.returncode == 0, p.stderr
    check_published(read_output(job), inputs)
    # Publishing again with a wrong secret is refused as well, naming the key and never the secret.
    p = subprocess.run([bij_bin("bij"), "publish", str(spec)], env=worker_env(place, **wrong_secret.env()),
                       capture_output=True, text=True, timeout=60)
    # (Its first request is a HEAD, whose refusal carries no body: a bare 403.)
    assert p.returncode == 42 and place.base in p.stderr and ("403" in p.stderr or "SignatureDoesNotMatch" in p.stderr)
    assert f"as access key id {owner.access_key}:" in p.stderr and wrong_secret.secret_key not in p.stderr


def test_a_full_disk_at_publish_ends_in_one_line_and_a_rerun_publishes(file_place, make_job, worker_env, bij_bin,
                                                                      read_output):
    inputs = rows(50)
    spec, job = make_job(file_place, file_place.write_jsonl("in.jsonl", inputs))
    p = bij_run(bij_bin, spec, worker_env(full_disk="/out/results/"))
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    last = p.stderr.strip().splitlines()[-1]
    # The write pass's Job failed: its failed index's last words, without the log prefix, name the file.
    assert last.startswith("bij: publish pass write failed; Job ") and "FailedIndexes" in last, last
    assert "index 0 exited 1: storage: cannot write file://" in last and "/out/results/" in last
    assert "No space left on device: free some space and run again" in last
    assert read_manifest(job) is None
    assert bij_run(bij_bin, spec, worker_env()).returncode == 0
    check_published(read_output(job), inputs)


# --- a rerun with a changed spec or input ----------------------------------------------------------


def test_a_rerun_with_a_changed_spec_is_refused_and_restart_starts_over(file_place, make_job, worker_env, bij_bin,
                                                                       read_output, tmp_path):
    inputs = [{**r, "body": r["text"].upper()} for r in rows(200)]
    in_uri = file_place.write_jsonl("in.jsonl", inputs)
    spec, job = make_job(file_place, in_uri, sharding={"targetShardBytes": 4096, "chunkRows": 10},
                         batching={"maxBatchSize": 5})
    computed = tmp_path / "computed.txt"
    # Killed midway: some shards done, some durable rows, no manifest.
    p = subprocess.Popen([bij_bin("bij"), "run", str(spec)], env=worker_env(echo_log=computed, echo_delay=0.02),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 60
    while not computed.exists() or len(computed.read_text().splitlines()) < 40:
        assert p.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()

    changed, _ = make_job(file_place, in_uri, sharding={"targetShardBytes": 4096, "chunkRows": 10},
                          input={"textField": "body"}, model={"name": "shouting"})
    p2 = bij_run(bij_bin, changed, worker_env())
    assert p2.returncode == 42
    line = one_line(p2)
    assert 'spec.input.textField changed from "text" to "body"' in line
    assert 'spec.model.name changed from null to "shouting"' in line and "bij run --restart" in line
    assert read_manifest(job) is None

    p3 = subprocess.run([bij_bin("bij"), "run", "--restart", str(changed)], env=worker_env(), capture_output=True,
                        text=True, timeout=120)
    assert p3.returncode == 0, p3.stderr
    out = read_output(job)
    assert [(r["id"], r["output"]) for r in out.results] == [(r["id"], r["body"]) for r in inputs]
    assert out.manifest["model"]["name"] == "shouting"


def test_a_rerun_over_replaced_input_is_refused_and_a_worker_never_reads_it(file_place, make_job, worker_env,
                                                                             bij_bin):
    inputs = rows(100)
    in_uri = file_place.write_jsonl("in.jsonl", inputs)
    spec, job = make_job(file_place, in_uri)
    plan_round(job, 0)
    time.sleep(0.05)  # past a tick of the kernel's coarse clock, which stamps mtimes
    file_place.write_jsonl("in.jsonl", [{**r, "text": r["text"].replace("document", "DOCUMENT")} for r in inputs])
    p = bij_run(bij_bin, spec, worker_env())
    assert p.returncode == 42
    assert "1 input object(s) changed: " in one_line(p) and "in.jsonl (rewritten: mtime differs)" in one_line(p)
    # A worker given the old plan (a pod of a Job made before the change) refuses too.
    w = subprocess.run([bij_bin("bij-worker"), "--manifest", layout.round_manifest_uri(job, 0)],
                       env={**worker_env(), "JOB_COMPLETION_INDEX": "0"}, capture_output=True, text=True, timeout=60)
    assert w.returncode == 42
    assert "was modified after the job was planned" in w.stderr


# A worker command that SIGKILLs itself (as an OOM kill or a lost node does) the first N times each step
# runs, then is bij-worker: argv = [python, KILLER, folder, N, bij-worker args...].
KILLER = """
import os, signal, sys
folder, times, args = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
if args[:1] == ["step"]:
    key = args[args.index("--key") + 1]
    tries = len([f for f in os.listdir(folder) if f.startswith(key + ".")])
    open(os.path.join(folder, f"{key}.{tries}"), "w").close()
    if tries < times:
        print(f"step {key}: about to be killed", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
os.execv(os.environ["BIJ_WORKER_BIN"], ["bij-worker", *args])
"""


def run_killing_steps(tmp_path: Path, job: Any, times: int, env: dict[str, str], bij_bin: Any) -> int:
    import sys

    from bij.local.run import LocalRunner

    script, folder = tmp_path / "killer.py", tmp_path / "kills"
    script.write_text(KILLER)
    folder.mkdir()
    saved = dict(os.environ)
    os.environ.update(env, BIJ_WORKER_BIN=bij_bin("bij-worker"))
    try:
        return LocalRunner(job, show_progress=False,
                           worker_cmd=[sys.executable, str(script), str(folder), str(times)]).run()
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_every_step_killed_twice_is_run_again_and_the_job_completes(file_place, make_job, read_output, worker_env,
                                                                     bij_bin, tmp_path, capfd):
    inputs = rows(60)
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", inputs), workers={"backoffLimitPerIndex": 2})
    assert run_killing_steps(tmp_path, job, 2, worker_env(file_place), bij_bin) == 0
    check_published(read_output(job), inputs)
    # Kept once published too, as the API server keeps a bij's status: the next `bij run` restores it.
    kept = json.loads(Path(layout.local_status_uri(job)[len("file://"):]).read_text())
    assert kept["phase"] == "Succeeded" and kept["manifestUri"] == layout.manifest_uri(job)
    said = capfd.readouterr().err
    for key in ("plan-r0", "finish-r0", "publish-plan", "manifest"):
        assert len(list((tmp_path / "kills").glob(f"t-{key}.*"))) == 3, key
        # Each retry is said, naming the step, its pod and the cause.
        assert f"step {key} failed (attempt 2 of 3), running it again; Job t-{key}, pod t-{key}-0-2: exit code 137 " \
               f"(killed: SIGKILL, as an OOM kill or a lost node does): step t-{key}: about to be killed" in said, said


def test_a_plan_step_that_fails_for_good_ends_failed_naming_the_step_pod_and_cause(file_place, make_job, worker_env,
                                                                                  bij_bin, tmp_path, capfd):
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", rows(5)), workers={"backoffLimitPerIndex": 1})
    assert run_killing_steps(tmp_path, job, 99, worker_env(file_place), bij_bin) == 1
    said = capfd.readouterr().err
    assert "bij: step plan-r0 failed 2 time(s), giving up (spec.workers.backoffLimitPerIndex 1); Job t-plan-r0, " \
           "last pod t-plan-r0-0-2: exit code 137 (killed: SIGKILL" in said, said
    assert "Traceback" not in said
    assert len(list((tmp_path / "kills").glob("t-plan-r0.*"))) == 2
    # `bij status` says the same as `kubectl get bij` would.
    from bij.steps.results import job_summary

    lines = job_summary(job)
    assert lines[1].startswith("  phase     Failed (StepFailed): step plan-r0 failed 2 time(s), giving up"), lines


def test_bij_run_publishes_one_file_per_input_file_with_its_columns(place, make_job, worker_env, bij_bin) -> None:
    # Two input files under a glob: the results come back one file each, under the same relative
    # names, every row exactly once and with the input's other columns beside its output.
    a = [{"id": f"a-{i}", "text": f"alpha {i} " + "k" * (i % 50), "source": "a", "rank": i} for i in range(250)]
    b = [{"id": i, "text": f"beta {i}", "source": "b", "tags": ["t"] * (i % 3)} for i in range(60)]
    place.write_jsonl("in/day=1/a.jsonl", a)
    place.write_jsonl("in/day=2/b.jsonl.zst", b, zst=True)
    place.write_jsonl("in/day=2/notes.json", [{"id": "x", "text": "outside the glob"}])
    spec, job = make_job(place, place.uri("in/day=*/*.jsonl*"), output={"partitionBy": "input"},
                         sharding={"targetShardBytes": 4096})
    p = bij_run(bij_bin, spec, worker_env(place))
    assert p.returncode == 0, p.stderr
    manifest = read_manifest(job)
    assert manifest is not None and manifest.files is not None
    assert [(f.path, f.input, f.rows) for f in manifest.files] == [
        ("results/day=1/a.jsonl", "day=1/a.jsonl", 250), ("results/day=2/b.jsonl", "day=2/b.jsonl.zst", 60)]
    assert manifest.error_files == [] and manifest.counts.rows == 310
    out = job.spec.output.uri.rstrip("/") + "/"
    for entry, inputs in zip(manifest.files, (a, b), strict=True):
        got = [json.loads(line) for line in place.storage.read_bytes(out + entry.path).splitlines()]
        assert [r["id"] for r in got] == [r["id"] for r in inputs]  # every row once, in input order
        assert [r["output"] for r in got] == [r["text"] for r in inputs]
        assert [{k: v for k, v in r.items() if k not in ("id", "output", "usage")} for r in got] == [
            {k: v for k, v in r.items() if k not in ("id", "text")} for r in inputs]


@pytest.mark.parametrize("spec_env", [{}, {"SOME_SETTING": "x"}])
def test_steps_run_in_the_bij_process_unless_their_environment_would_differ(spec_env, file_place, make_job,
                                                                            read_output, worker_env, monkeypatch):
    """A step's interpreter start costs more than its work: with the worker command and environment of
    `bij run` itself, steps and one-index publish passes run in its process and only lanes start one.
    A spec that gives pods variables of their own keeps every step in a process with them."""
    import subprocess
    import sys

    from bij.local import jobs as localjobs
    from bij.local.run import LocalRunner

    inputs = rows(30)
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", inputs), workers={"env": spec_env})
    started: list[list[str]] = []

    class Counting(subprocess.Popen):  # type: ignore[type-arg]
        def __init__(self, args: Any, *a: Any, **kw: Any) -> None:
            started.append(list(args))
            super().__init__(args, *a, **kw)

    monkeypatch.setattr(localjobs.subprocess, "Popen", Counting)
    for k, v in worker_env(file_place).items():
        monkeypatch.setenv(k, v)
    assert LocalRunner(job, show_progress=False).run() == 0
    check_published(read_output(job), inputs)
    kinds = sorted(a[a.index("step") + 1] if "step" in a else ("publish" if "publish" in a else "lane")
                   for a in (cmd[1:] if cmd[0] == sys.executable else cmd for cmd in started))
    assert "lane" in kinds
    steps = [k for k in kinds if k != "lane"]
    if spec_env:
        assert steps == ["finish", "manifest", "plan", "publish", "publish", "publish", "publish-plan"], kinds
    else:
        assert steps == [], kinds


def test_bij_run_whose_work_file_removal_fails_succeeds_with_a_warning_and_a_rerun_removes_the_rest(
        file_place, make_job, read_output, log_lines, worker_env, monkeypatch, capsys):
    from bij.contract.status import JobStatus
    from bij.local.run import LocalRunner
    from bij.steps import publish as publish_module
    from bij.storage import StorageError, open_storage

    class DeletesRefused:
        def __init__(self, inner: Any):
            self.inner = inner

        def delete_many(self, uris: Any) -> dict[str, str]:
            raise StorageError("delete: the bucket refused every delete")

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    inputs = rows(200)
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", inputs), sharding={"targetShardBytes": 8192})
    for k, v in worker_env(file_place).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(publish_module, "open_storage", lambda uri, s3: DeletesRefused(open_storage(uri, s3)))
    runner = LocalRunner(job, show_progress=False)
    assert runner.run() == 0
    status = JobStatus.read(runner.backend.status)
    assert status.phase == "Succeeded"
    left = next(c for c in runner.backend.status["conditions"] if c["type"] == "WorkFilesRemoved")
    assert left["status"] == "False" and left["reason"] == "RemovalFailed"
    err = capsys.readouterr().err
    assert err.count("bij: RemovalFailed: removing work files failed") == 1  # the Warning, once
    check_published(read_output(job), inputs)
    assert log_lines(file_place, job)  # the durable logs are still there
    monkeypatch.setattr(publish_module, "open_storage", open_storage)
    assert LocalRunner(job, show_progress=False).run() == 0
    assert "nothing to do" in capsys.readouterr().err
    assert not log_lines(file_place, job)
    check_published(read_output(job), inputs)


def test_pools_run_a_rounds_lanes_in_several_jobs_and_every_row_once(file_place, make_job, read_output, worker_env,
                                                                   bij_bin, tmp_path):
    # Locally every pool's Job runs (no node to wait for): lanes 0 in pool spot, 1-2 in pool od, one round.
    inputs = rows(400)
    spec, job = make_job(file_place, file_place.write_jsonl("in.jsonl", inputs), sharding={"targetShardBytes": 4096},
                         workers={"parallelism": 3, "pools": [{"name": "spot", "maxLanes": 1}, {"name": "od"}]})
    computed = tmp_path / "computed.txt"
    p = bij_run(bij_bin, spec, worker_env(echo_log=computed))
    assert p.returncode == 0, p.stderr
    assert "in pool spot (lanes from 0)" in p.stderr and "in pool od (lanes from 1)" in p.stderr
    check_published(read_output(job), inputs)
    assert len(computed.read_text().splitlines()) == len(inputs)  # each row computed once, whichever pool ran it
