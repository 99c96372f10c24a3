"""`rules.stop`: spec.cancel and spec.deadlineSeconds: the round's Jobs drain, then what finished is published as
a partial manifest, never again (`stopping_step`). With real worker processes: tests/control/test_stopping.py."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from bij.contract.spec import parse_job
from bij.control.decisions import (
    CreatePublishJob,
    MarkFailed,
    Nothing,
    PatchJob,
    PlanRound,
    PreparePublish,
    Publish,
    StopHeld,
    Wait,
)
from bij.control.reconcile import decide
from bij.control.rules.stop import stopping_step
from bij.control.stopping import Stop, seconds_left, stop_requested
from rules.builders import (
    UID,
    canary_k8s_job,
    k8s_job,
    observation,
    planned,
    publish_pass_job,
    step_job,
    step_pod,
)

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


# --- decisions -----------------------------------------------------------------------------------------


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


# --- stopping_step(): plan round 0, drain the round's Jobs, publish the finished part -----------------------

CANCEL = Stop("Cancelled", "Cancelling", "spec.cancel is true")
EXPIRE = Stop("Expired", "DeadlineExceeded", "spec.deadlineSeconds (600) passed at 2024-01-01T00:10:00Z")
PARTIAL_PLAN = {"publish": {"rounds": 1, "planUri": "file:///p.json", "partial": "Cancelled",
                            "passes": {"ids": 8, "dedupe": 0, "write": 0}}}


@pytest.mark.parametrize(("status", "jobs", "pods", "stop", "kind", "fields"), [
    ({}, [], [], CANCEL, PlanRound, {"round": 0, "phase": "Cancelling", "reason": "Cancelling"}),
    # The plan step's pod cannot start: nothing ran, so the bij ends at once.
    ({}, [step_job("emb-plan-r0")], [step_pod("emb-plan-r0", waiting="ErrImagePull")], CANCEL, StopHeld,
     {"phase": "Cancelled", "reason": "Cancelled", "job_name": "emb-plan-r0"}),
    (planned(), [k8s_job(active=4)], [], CANCEL, PatchJob,
     {"job_name": "emb-r0", "suspend": True, "phase": "Cancelling", "reason": "Cancelling"}),
    (planned(), [suspended_job(active=2)], [], CANCEL, Wait, {"phase": "Cancelling", "reason": "Cancelling"}),
    (planned(), [suspended_job(terminating=3)], [], CANCEL, Wait, {"phase": "Cancelling"}),
    (planned(), [suspended_job(acted=False)], [], CANCEL, Wait, {"phase": "Cancelling"}),
    (planned(), [suspended_job()], [], CANCEL, PreparePublish,
     {"rounds": 1, "partial": "Cancelled", "phase": "Cancelling", "reason": "Cancelling"}),
    (planned(), [suspended_job()], [], EXPIRE, PreparePublish,
     {"partial": "Expired", "phase": "Cancelling", "reason": "DeadlineExceeded"}),
    # A Job that ended, or an earlier object's, has nothing to drain.
    (planned(), [k8s_job(completed="0-7", conditions=[("Complete", "True", "", "")])], [], CANCEL, PreparePublish,
     {"partial": "Cancelled"}),
    (planned(), [k8s_job(failed="1", conditions=[("Failed", "True", "FailedIndexes", "")])], [], CANCEL,
     PreparePublish, {"partial": "Cancelled"}),
    (planned(), [k8s_job(active=4, owner_uid="uid-of-the-old-object")], [], CANCEL, PreparePublish,
     {"partial": "Cancelled"}),
    # Stopped during round 0's canary: its lanes drain the same way; in a later round it is no round's Job.
    (planned(), [canary_k8s_job(active=2)], [], CANCEL, PatchJob, {"job_name": "emb-r0-canary", "suspend": True}),
    (planned(1), [canary_k8s_job(active=2)], [], CANCEL, PreparePublish, {"rounds": 2, "partial": "Cancelled"}),
    ({**planned(), **PARTIAL_PLAN}, [suspended_job()], [], CANCEL, CreatePublishJob,
     {"pass_name": "ids", "phase": "Cancelling", "reason": "Cancelling"}),
    ({**planned(), **PARTIAL_PLAN}, [suspended_job(), publish_pass_job("ids", "failed")], [], CANCEL, MarkFailed,
     {"phase": "Failed", "reason": "PublishFailed"}),
], ids=["unplanned", "plan-cannot-start", "running", "draining-active", "draining-terminating", "suspend-not-seen",
        "drained", "drained-expired", "job-completed", "job-failed", "old-objects-job", "during-canary",
        "canary-after-round-0", "publish-pass", "publish-pass-failed"])
def test_stopping_step(status: dict[str, Any], jobs: list[dict[str, Any]], pods: list[dict[str, Any]], stop: Stop,
                       kind: type, fields: dict[str, Any]) -> None:
    got = stopping_step(stoppable(cancel=True), observation(status, jobs, pods), stop)
    assert isinstance(got, kind), got
    assert {k: getattr(got, k) for k in fields} == fields
    if got.phase == "Cancelling":
        assert got.message.startswith(stop.message)
    if isinstance(got, (PreparePublish, CreatePublishJob)):
        assert got.message.endswith("(partial)")
