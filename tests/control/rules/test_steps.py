"""`rules.steps`: a step's one-pod Job decided like a round: run it, wait, say a retry, retry a passing failure,
fail the bij naming the step, or record its result."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from bij.contract.step_report import StepErrorCode
from bij.control.decisions import (
    FinishRound,
    MarkFailed,
    PlanRound,
    Publish,
    RerunStep,
    Retry,
    StepDecision,
    Wait,
)
from bij.control.rules.steps import STEP_RECHECK, STEP_RETRY_SECONDS, expected_failure, step
from rules.builders import make_job, observation, planned, reported, step_job, step_pod

NOW = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
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


# --- step(): a step's Job, its pods and its report -------------------------------------------------------

FINISH = FinishRound(round=0, phase="Running", reason="RoundFinishing", message="round 0: counting its shards")
STEP = "emb-finish-r0"
ERROR = {"error": {"code": "StorageFailed", "message": "the bucket is slow"}}


@pytest.mark.parametrize(("report", "job", "pods", "kind", "reason", "said"), [
    # No Job yet: run the step (the decision asked for, as it is).
    (None, None, (), FinishRound, "RoundFinishing", "counting its shards"),
    (None, {"owner_uid": "uid-of-the-old-object"}, (), Wait, "WaitingForOldJob", "earlier object"),
    ({"result": {"done": 8, "damaged": []}}, {"conditions": [("Complete", "")]}, (), FinishRound, "RoundFinishing",
     ""),
    # Another Job's report (an earlier run of the step) is not this one's.
    ({"result": {"done": 8}, "uid": "another-uid"}, {"conditions": [("Complete", "")]}, (), Wait, "RoundFinishing",
     "done, reading its report"),
    ({"result": {"done": "many"}}, {"conditions": [("Complete", "")]}, (), MarkFailed, "StepFailed",
     "its result cannot be read"),
    ({"error": {"code": "StorageRefused", "message": "AccessDenied"}}, {"conditions": [("Complete", "")]}, (),
     MarkFailed, "StorageRefused", "round 0: AccessDenied"),
    # Refused for generation 1 of the spec; the bij is at generation 2 now.
    (ERROR, {"conditions": [("Complete", "")], "generation": 1}, (), RerunStep, "RoundFinishing",
     "again, for the edited spec"),
    (ERROR, {"conditions": [("Complete", "")], "generation": 2}, (), RerunStep, "StorageFailed",
     "round 0: the bucket is slow"),
    # An error no code names: its Job runs the pod again.
    ({"error": {"code": "Internal", "message": "bug"}}, {}, (), Wait, "RoundFinishing", "(step Job emb-finish-r0)"),
    (None, {"conditions": [("Failed", "BackoffLimitExceeded")], "failed": 2}, (step_pod(STEP, failed_with=1),),
     MarkFailed, "StepFailed", "failed 2 time(s), giving up"),
    (None, {"conditions": [("Failed", "BackoffLimitExceeded")], "at": "2024-01-01T00:59:50Z"}, (), Wait,
     "StepFailing", "reading why from its pods"),
    (None, {"conditions": [("Failed", "BackoffLimitExceeded")], "at": "2024-01-01T00:59:00Z"}, (), MarkFailed,
     "StepFailed", "last BackoffLimitExceeded"),
    (None, {"conditions": [("Complete", "")]}, (), Wait, "RoundFinishing", "done, reading its report"),
    (None, {}, (step_pod(STEP, waiting="ErrImagePull"),), Wait, "StepCannotStart", "pod emb-finish-r0-0-x: "
     "ErrImagePull"),
    (None, {"failed": 1}, (step_pod(STEP, failed_with=2),), Wait, "StepRetrying", "failed (attempt 1 of"),
    (None, {}, (), Wait, "RoundFinishing", "(step Job emb-finish-r0)"),
], ids=["not-created", "old-object", "reported", "another-jobs-report", "unreadable-result", "refused",
        "edited-spec", "retry-due", "internal-error", "gave-up", "gave-up-pods-unseen", "gave-up-grace-over",
        "succeeded-report-unread", "cannot-start", "retrying", "running"])
def test_step(report: dict[str, Any] | None, job: dict[str, Any] | None, pods: tuple[dict[str, Any], ...],
              kind: type, reason: str, said: str) -> None:
    status: dict[str, Any] = planned()
    if report is not None:
        report = dict(report)
        status = reported(status, STEP, report, uid=report.pop("uid", "step-uid"))
    jobs = [step_job(STEP, **job)] if job is not None else []
    got = step(make_job(), observation(status, jobs, pods, generation=2), FINISH)
    assert isinstance(got, kind) and got.reason == reason and said in got.message, got
    if report is None and job is None:
        assert got is FINISH
    if isinstance(got, FinishRound) and report is not None:
        assert got.result is not None and got.result.done == 8
    if reason == "RoundFinishing" and isinstance(got, Wait) and "reading" not in got.message:
        assert got.recheck == STEP_RECHECK
