"""spec.cancel and spec.deadlineSeconds: drain, publish the finished part as a partial manifest, never again.

The decisions are pure (`decide()` with a clock: tests/control/rules/test_stop.py); `bij run` and `bij cancel`
take them here on real worker processes, so the rows published, failed and not run are checked against the input.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from bij.contract import layout

# --- bij run / bij cancel, with real worker processes -----------------------------------------------------


def rows(n: int) -> list[dict[str, Any]]:
    return [{"id": i if i % 3 else f"doc-{i}", "text": f"document {i} " + "k" * (i * 7 % 90)} for i in range(n)]


def check_partial(out: Any, inputs: list[Any], phase: str, bad: int = 0) -> dict[str, Any]:
    """Every published row once, each the echo of its input; completed + failed + notRun = the input."""
    partial = out.manifest["partial"]
    assert partial["phase"] == phase
    counts = partial["counts"]
    texts = {json.dumps(r["id"]): r["text"] for r in inputs if isinstance(r, dict)}
    ids = [json.dumps(r["id"]) for r in out.results]
    assert len(ids) == len(set(ids)) == counts["completed"] == out.manifest["counts"]["rows"]
    assert all(texts[json.dumps(r["id"])] == r["output"] for r in out.results)
    assert len(out.errors) == counts["failed"] == bad
    assert counts["completed"] + counts["failed"] + counts["notRun"] == len(inputs)
    assert out.manifest["counts"]["notRun"] == counts["notRun"]
    assert out.manifest["counts"]["inputRows"] == len(inputs)
    return counts


def test_ctrl_c_pauses_and_bij_cancel_publishes_what_was_finished(file_place, make_job, read_output, log_lines,
                                                                  worker_env, bij_bin, tmp_path):
    inputs: list[Any] = [*rows(400)]
    inputs.insert(7, "not json")  # an error row early in the first shard: durable before Ctrl-C
    spec, job = make_job(file_place, file_place.write_jsonl("in.jsonl", inputs),
                         sharding={"targetShardBytes": 6000, "chunkRows": 10},
                         batching={"maxBatchSize": 5}, workers={"parallelism": 2})
    p = subprocess.Popen([bij_bin("bij"), "run", str(spec)], env=worker_env(echo_delay=0.05),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 60
    while sum(1 for r in log_lines(file_place, job).values() if r) < 2:
        assert p.poll() is None and time.monotonic() < deadline, "bij run made no progress"
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGINT)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 130, err  # Ctrl-C stays a pause
    durable = sum(len(r) for r in log_lines(file_place, job).values())

    c = subprocess.run([bij_bin("bij"), "cancel", str(spec)], env=worker_env(), capture_output=True, text=True,
                       timeout=120)
    assert c.returncode == 0, c.stderr
    assert c.stdout.strip().splitlines()[-1] == layout.manifest_uri(job)
    counts = check_partial(read_output(job), inputs, "Cancelled", bad=1)
    assert counts["completed"] + counts["failed"] == durable and counts["notRun"] > 0
    assert f"cancelled: {counts['completed']:,} rows completed, 1 failed, {counts['notRun']:,} not run" in c.stderr
    status = subprocess.run([bij_bin("bij"), "status", str(spec)], env=worker_env(), capture_output=True, text=True,
                            timeout=60)
    assert f"partial   cancelled (spec.cancel): {counts['completed']:,} completed, 1 failed, " \
        f"{counts['notRun']:,} not run" in status.stdout

    # Never again: neither a rerun nor another cancel runs or publishes anything.
    before = read_output(job).raw, read_output(job).manifest
    computed = tmp_path / "computed.txt"
    again = subprocess.run([bij_bin("bij"), "run", str(spec)], env=worker_env(echo_log=computed),
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 3 and "never runs or publishes again" in again.stderr
    assert not computed.exists()
    republish = subprocess.run([bij_bin("bij"), "publish", str(spec)], env=worker_env(), capture_output=True,
                               text=True, timeout=120)
    assert republish.returncode == 42 and "never published again" in republish.stderr
    assert (read_output(job).raw, read_output(job).manifest) == before


def test_a_deadline_expires_bij_run_with_the_finished_rows_published(file_place, make_job, read_output, worker_env,
                                                                     bij_bin, tmp_path):
    inputs = rows(300)
    spec, job = make_job(file_place, file_place.write_jsonl("in.jsonl", inputs), deadlineSeconds=3,
                         sharding={"targetShardBytes": 6000, "chunkRows": 10}, batching={"maxBatchSize": 5},
                         workers={"parallelism": 2})
    # 0.2 s a batch of 5: 300 rows take 12 s in two lanes, so 3 s stop the job part way.
    p = subprocess.run([bij_bin("bij"), "run", str(spec)], env=worker_env(echo_delay=0.2), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 3, p.stderr
    assert "expired" in p.stderr
    counts = check_partial(read_output(job), inputs, "Expired")
    assert counts["notRun"] > 0


def test_a_rerun_counts_the_deadline_from_the_start_its_kept_status_says(file_place, make_job, read_output,
                                                                          worker_env, monkeypatch, capsys):
    """Ctrl-C stays a pause: a rerun keeps counting spec.deadlineSeconds from the first run's start, as the
    operator does from the bij's, in the status it kept."""
    from bij.local.run import LocalRunner
    from bij.steps.planner import plan_round

    inputs = rows(40)
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", inputs), deadlineSeconds=60)
    plan_round(job, 0)  # an earlier run planned it and stopped
    kept = Path(layout.local_status_uri(job)[len("file://"):])
    kept.write_text(json.dumps({"phase": "Running", "round": 0, "startTime": "2024-01-01T00:00:00Z"}))
    for k, v in worker_env(file_place).items():
        monkeypatch.setenv(k, v)
    # Restored with the status, the first run's start is where the deadline counts from: long passed.
    runner = LocalRunner(job, show_progress=False)
    assert runner.run() == 3
    assert "bij: expired (spec.deadlineSeconds): published 0 rows" in capsys.readouterr().err
    assert runner.backend.status["startTime"] == "2024-01-01T00:00:00Z"
    assert check_partial(read_output(job), inputs, "Expired")["notRun"] == len(inputs)


@pytest.mark.parametrize("how", ["deadline", "cancel", "deadline-partitioned"])
def test_each_openai_line_a_stopped_batch_never_ran_gets_openais_error_line(file_place, make_job, read_output,
                                                                              log_lines, worker_env, bij_bin, how):
    lines = [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "m", "messages": [{"role": "user", "content": f"row {i} " + "k" * (i * 7 % 90)}]}}
             for i in range(240)]
    partitioned = how == "deadline-partitioned"
    if partitioned:  # two input objects, each published (and its not-run lines written) under its own name
        file_place.write_jsonl("batches/a.jsonl", lines[:120])
        where = file_place.write_jsonl("batches/b.jsonl", lines[120:]).rsplit("/", 1)[0] + "/"
    else:
        where = file_place.write_jsonl("batch.jsonl", lines)
    spec, job = make_job(file_place, where, input={"format": "openai"},
                         model={"engine": "echo", "task": "chat"},
                         sharding={"targetShardBytes": 6000, "chunkRows": 10}, batching={"maxBatchSize": 5},
                         workers={"parallelism": 2}, **({"deadlineSeconds": 3} if how != "cancel" else {}),
                         **({"output": {"partitionBy": "input"}} if partitioned else {}))
    if how != "cancel":
        # 0.2 s a batch of 5: 240 rows take 10 s in two lanes, so 3 s stop the job part way.
        p = subprocess.run([bij_bin("bij"), "run", str(spec)], env=worker_env(echo_delay=0.2), capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 3, p.stderr
    else:
        run = subprocess.Popen([bij_bin("bij"), "run", str(spec)], env=worker_env(echo_delay=0.05),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        deadline = time.monotonic() + 60
        while sum(1 for r in log_lines(file_place, job).values() if r) < 2:
            assert run.poll() is None and time.monotonic() < deadline, "bij run made no progress"
            time.sleep(0.05)
        os.killpg(run.pid, signal.SIGINT)
        run.communicate(timeout=30)
        c = subprocess.run([bij_bin("bij"), "cancel", str(spec)], env=worker_env(), capture_output=True, text=True,
                           timeout=120)
        assert c.returncode == 0, c.stderr
    out = read_output(job)
    counts = out.manifest["partial"]["counts"]
    assert counts["notRun"] > 0 and counts["completed"] + counts["failed"] + counts["notRun"] == len(lines)
    code, message = (("batch_expired", "This request could not be executed before the completion window expired.")
                     if how != "cancel" else
                     ("batch_cancelled", "The batch was cancelled before this request executed."))
    not_run = [e for e in out.errors if e["error"]["code"] == code]
    assert len(not_run) == counts["notRun"] == len(out.errors)  # echo fails no row: every error line is one
    for e in not_run:
        assert e["response"] is None and e["error"] == {"code": code, "message": message}
        assert e["id"] == e["custom_id"]
        assert e["object"] == (("a.jsonl" if int(e["custom_id"][4:]) < 120 else "b.jsonl") if partitioned
                               else "batch.jsonl")
    # Every line exactly once, as a result or as the error line of a request never run.
    done = [r["custom_id"] for r in out.results] + [e["custom_id"] for e in not_run]
    assert sorted(done) == sorted(line["custom_id"] for line in lines)
    if partitioned:  # each object's error file holds its own lines only
        for f in out.manifest["errorFiles"]:
            assert f["path"] == f"errors/{f['input']}"
            got = [json.loads(x) for x in file_place.storage.read_bytes(
                job.spec.output.uri.rstrip("/") + "/" + f["path"]).splitlines()]
            assert got and {e["object"] for e in got} == {f["input"]}
