"""spec.cancel and spec.deadlineSeconds: drain, publish the finished part as a partial manifest, never again.

The decisions are pure (`decide()` with a clock); `bij run` and `bij cancel` take them on real
worker processes, so the rows published, failed and not run are checked against the input.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from test_reconcile import UID, k8s_job, planned

from bij.contract import layout
from bij.contract.spec import parse_job
from bij.control.decisions import Nothing, PatchJob, PlanRound, PreparePublish, Publish, Wait
from bij.control.reconcile import decide
from bij.control.stopping import seconds_left, stop_requested

NOW = dt.datetime(2024, 1, 1, 0, 10, tzinfo=dt.timezone.utc)


def stoppable(*, cancel: bool = False, deadline: int | None = None, created: str | None = "2024-01-01T00:00:00Z"):
    spec: dict[str, Any] = {"input": {"uri": "file:///data/in"}, "output": {"uri": "file:///data/out"},
                            "model": {"engine": "echo", "task": "embed"}, "workers": {"parallelism": 4},
                            "cancel": cancel}
    if deadline is not None:
        spec["deadlineSeconds"] = deadline
    meta: dict[str, Any] = {"name": "emb", "namespace": "ml", "uid": UID}
    if created:
        meta["creationTimestamp"] = created
    return parse_job({"apiVersion": "batchinference.io/v1alpha1", "kind": "BatchInferenceJob",
                      "metadata": meta, "spec": spec})


def suspended_job(active: int = 0, terminating: int = 0, acted: bool = True) -> dict[str, Any]:
    job = k8s_job(0, suspend=True, active=active,
                  conditions=[("Suspended", "True", "JobSuspended", "Job suspended")] if acted else ())
    job["status"]["terminating"] = terminating
    return job


# --- decisions ---------------------------------------------------------------------------------------------


def test_cancel_suspends_the_running_round_job_so_its_workers_drain():
    d = decide(stoppable(cancel=True), planned(0), [k8s_job(0, active=4)], shards_done=3, now=NOW)
    assert isinstance(d, PatchJob) and d.suspend is True and d.job_name == "emb-r0"
    assert (d.phase, d.reason) == ("Cancelling", "Cancelling")


@pytest.mark.parametrize("pods", [dict(active=2), dict(terminating=3), dict(acted=False)],
                         ids=["active", "terminating", "controller-not-acted-yet"])
def test_nothing_is_published_while_a_worker_may_still_commit(pods):
    d = decide(stoppable(cancel=True), planned(0), [suspended_job(**pods)], shards_done=3, now=NOW)
    assert isinstance(d, Wait) and d.phase == "Cancelling"


def test_once_drained_the_rounds_so_far_publish_as_a_partial_manifest():
    job = stoppable(cancel=True)
    d = decide(job, planned(1), [suspended_job()], shards_done=3, now=NOW)
    assert isinstance(d, PreparePublish) and d.partial == "Cancelled" and d.rounds == 2
    publish = {"rounds": 2, "planUri": "file:///data/out/_bij/x/publish/plan.json", "partial": "Cancelled",
               "passes": {"ids": 0, "dedupe": 0, "write": 0}}
    d = decide(job, {**planned(1), "phase": "Cancelling", "publish": publish}, [suspended_job()], now=NOW)
    assert isinstance(d, Publish) and d.partial == "Cancelled" and d.phase == "Cancelling"


def test_a_round_job_that_already_ended_is_not_waited_for():
    done = k8s_job(0, completed="0-7", conditions=[("Complete", "True", "", "")])
    d = decide(stoppable(cancel=True), planned(0), [done], shards_done=8, now=NOW)
    assert isinstance(d, PreparePublish) and d.partial == "Cancelled"


def test_cancel_before_round_0_was_planned_plans_it_so_every_row_is_counted():
    d = decide(stoppable(cancel=True), {}, [], now=NOW)
    assert isinstance(d, PlanRound) and d.round == 0 and d.phase == "Cancelling"


def test_the_deadline_expires_a_running_job_the_same_way():
    job = stoppable(deadline=600)  # created 00:00, so it ran out at 00:10
    d = decide(job, planned(0), [k8s_job(0, active=4)], shards_done=3, now=NOW - dt.timedelta(seconds=1))
    assert not isinstance(d, PatchJob)  # one second before: it runs on
    assert seconds_left(job, planned(0), NOW - dt.timedelta(seconds=1)) == 1.0
    d = decide(job, planned(0), [k8s_job(0, active=4)], shards_done=3, now=NOW)
    assert isinstance(d, PatchJob) and d.suspend and d.reason == "DeadlineExceeded"
    d = decide(job, planned(0), [suspended_job()], now=NOW)
    assert isinstance(d, PreparePublish) and d.partial == "Expired"


def test_without_a_creation_time_the_deadline_counts_from_the_status_start_time():
    job = stoppable(deadline=60, created=None)
    assert stop_requested(job, {}, NOW) is None
    stop = stop_requested(job, {"startTime": "2024-01-01T00:09:00Z"}, NOW)
    assert stop is not None and stop.phase == "Expired"


def test_a_job_whose_whole_publish_began_finishes_it_despite_cancel():
    publish = {"rounds": 1, "planUri": "file:///data/out/_bij/x/publish/plan.json",
               "passes": {"ids": 0, "dedupe": 0, "write": 0}}
    d = decide(stoppable(cancel=True), {**planned(0, done=True), "phase": "Publishing", "publish": publish}, [],
               now=NOW)
    assert isinstance(d, Publish) and d.partial is None and d.phase == "Publishing"


@pytest.mark.parametrize("phase", ["Cancelled", "Expired"])
def test_a_stopped_job_is_left_alone_even_when_the_spec_changes_back(phase):
    d = decide(stoppable(cancel=False), {**planned(0), "phase": phase}, [k8s_job(0, active=4)], now=NOW)
    assert isinstance(d, Nothing) and d.phase == phase


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
