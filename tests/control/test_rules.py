"""Table tests of the rules one by one (`bij.control.rules`), as Kubernetes' Job controller tests its rules:
each row an input and the decision it calls for. `test_reconcile.py` drives them all through `decide()`."""

from __future__ import annotations

import datetime as dt

import pytest
from test_reconcile import make_job

from bij.contract.status import JobStatus
from bij.contract.step_report import StepErrorCode
from bij.control.decisions import MarkFailed, Nothing, PlanRound, Publish, RerunStep, Retry, StepDecision
from bij.control.observe import JobView, Shards
from bij.control.rules.ended import ended
from bij.control.rules.rounds import job_failed, spec_changed
from bij.control.rules.steps import STEP_RETRY_SECONDS, expected_failure

NOW = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


def _failed(reason: str) -> dict:
    return {"phase": "Failed", "conditions": [{"type": "Failed", "status": "True", "reason": reason,
                                               "message": f"failed: {reason}"}]}


@pytest.mark.parametrize(("status", "want"), [
    ({}, None),
    ({"phase": "Running"}, None),
    ({"phase": "Succeeded"}, ("Succeeded", "Published")),
    (_failed("JobFailed"), ("Failed", "JobFailed")),
    (_failed("SpecChanged"), None),  # a spec edit may clear it: not over
    (_failed("PlanRefused"), None),
    ({"phase": "Cancelled", "message": "cancelled"}, ("Cancelled", "Cancelled")),
    ({"phase": "Expired"}, ("Expired", "Expired")),
    ({"phase": "CanaryFailed"}, ("CanaryFailed", "CanaryFailed")),
])
def test_ended(status: dict, want: tuple[str, str] | None) -> None:
    got = ended(JobStatus.read(status))
    if want is None:
        assert got is None
    else:
        assert isinstance(got, Nothing) and (got.phase, got.reason) == want


def test_spec_changed_with_nothing_recorded_is_none() -> None:
    assert spec_changed(make_job(), JobStatus.read({})) is None


PLAN = PlanRound(round=0, phase="Planning", reason="Planning", message="planning round 0")
MANIFEST = Publish(round=0, phase="Publishing", reason="Publishing", message="manifest", rounds=1)


@pytest.mark.parametrize(("want", "code", "waited", "kind", "reason"), [
    (PLAN, StepErrorCode.PLAN_REFUSED, 0.0, MarkFailed, "PlanRefused"),
    (PLAN, StepErrorCode.STORAGE_REFUSED, 0.0, MarkFailed, "StorageRefused"),
    (MANIFEST, StepErrorCode.STORAGE_REFUSED, 0.0, MarkFailed, "StorageRefused"),
    (PLAN, StepErrorCode.INVALID_SPEC, 0.0, MarkFailed, StepErrorCode.INVALID_SPEC.value),
    (PLAN, StepErrorCode.TOO_MANY_ERRORS, 0.0, MarkFailed, StepErrorCode.TOO_MANY_ERRORS.value),
    (PLAN, StepErrorCode.PLAN_FAILED, 0.0, Retry, "PlanFailed"),
    (MANIFEST, StepErrorCode.PUBLISH_FAILED, 0.0, Retry, "PublishFailed"),
    (MANIFEST, StepErrorCode.WORK_FILES_REMOVED, 0.0, MarkFailed, StepErrorCode.WORK_FILES_REMOVED.value),
    (PLAN, StepErrorCode.STORAGE_FAILED, STEP_RETRY_SECONDS, RerunStep, "PlanFailed"),
])
def test_expected_failure(want: StepDecision, code: StepErrorCode, waited: float, kind: type, reason: str) -> None:
    got = expected_failure(want, "plan-r0", "j-plan-r0", code, "it broke", False,
                           reported_at=NOW - dt.timedelta(seconds=waited), now=NOW)
    assert isinstance(got, kind) and got.reason == reason
    if isinstance(got, Retry):
        assert got.delay == STEP_RETRY_SECONDS - waited


def _ended_job(failed: str, reason: str, message: str) -> JobView:
    return JobView.of({"metadata": {"name": "j-r0"}, "spec": {"completions": 4},
                       "status": {"failedIndexes": failed, "conditions": [
                           {"type": "Failed", "status": "True", "reason": reason, "message": message}]}})


@pytest.mark.parametrize(("view", "lanes", "message"), [
    (_ended_job("1,3", "BackoffLimitExceeded", "too many retries"), (1, 3),
     "round 0: lanes 1,3 failed with 2 of 8 shards undone; Job j-r0: BackoffLimitExceeded (too many retries)"),
    # FailJob names no failed index, only the pod: its name says the lane.
    (_ended_job("", "PodFailurePolicy", "Container worker for pod ns/j-r0-2-x7k2q failed with exit code 42"), (2,),
     "round 0: lane 2 failed with 2 of 8 shards undone; Job j-r0: PodFailurePolicy (Container worker for pod "
     "ns/j-r0-2-x7k2q failed with exit code 42)"),
])
def test_job_failed(view: JobView, lanes: tuple[int, ...], message: str) -> None:
    got = job_failed(0, view, Shards(done=6, total=8))
    assert (got.phase, got.failed_lanes, got.message) == ("Failed", lanes, message)
