"""`bij run SPEC.yaml`: exit 0 only when published; again is a no-op; Ctrl-C stops, a rerun resumes."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from bij_operator import layout
from bij_operator.planner import plan_round
from bij_operator.publish import read_manifest


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


@pytest.mark.parametrize("keep", [True, False])
def test_a_second_run_is_a_no_op_that_republishes_the_same_files(keep, file_place, make_job, read_output, log_lines,
                                                                 worker_env, bij_bin, tmp_path):
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
    if keep:
        assert {k: v for k, v in second.manifest.items() if k != "publishedAt"} == \
            {k: v for k, v in first.manifest.items() if k != "publishedAt"}
    else:  # nothing left to publish from: the manifest stands as it was
        assert second.manifest == first.manifest and "nothing to do" in p.stderr
    check_published(second, inputs)


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
    while sum(len(r) for r in log_lines(file_place, job).values()) < 2 * chunk_rows:
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
    t = time.monotonic()
    p = bij_run(bij_bin, spec, worker_env(), timeout=60)
    assert time.monotonic() - t < 30
    assert p.returncode == 1
    assert "bad configuration (exit 42)" in p.stderr
    assert p.stderr.count("ERROR bij.worker: bad configuration") == 1  # one worker, no retry, no other shard
    assert "retry" not in p.stderr
    assert read_manifest(job) is None
