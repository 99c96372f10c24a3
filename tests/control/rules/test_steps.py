"""`rules.steps`: a step's one-pod Job decided like a round: run it, wait, say a retry, retry a passing failure,
fail the bij naming the step, or record its result."""

from __future__ import annotations

import datetime as dt

import pytest

from bij.contract.step_report import StepErrorCode
from bij.control.decisions import (
    MarkFailed,
    PlanRound,
    Publish,
    RerunStep,
    Retry,
    StepDecision,
)
from bij.control.rules.steps import STEP_RETRY_SECONDS, expected_failure

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
