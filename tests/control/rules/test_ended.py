"""`rules.ended`: a bij that is over (Succeeded, Failed for good, Cancelled, Expired, CanaryFailed) is left alone; a
failure a spec edit may clear is not over."""

from __future__ import annotations

import pytest

from bij.contract.status import JobStatus
from bij.control.decisions import (
    Nothing,
    PlanRound,
)
from bij.control.reconcile import decide
from bij.control.rules.ended import ended
from rules.builders import k8s_job, make_job, planned


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


# --- through decide() ----------------------------------------------------------------------------------


def test_a_succeeded_bij_is_left_alone() -> None:
    status = planned(done=True)
    status["phase"] = "Succeeded"
    assert isinstance(decide(make_job(), status, [k8s_job(completed="0-7")]), Nothing)


def test_a_failed_bij_stays_failed() -> None:
    status = planned()
    status["phase"] = "Failed"
    status["conditions"] = [{"type": "Failed", "status": "True", "reason": "FailedIndexes", "message": "x"}]
    failed = k8s_job(failed="1", conditions=[("Failed", "True", "FailedIndexes", "")])
    d = decide(make_job(), status, [failed])
    assert isinstance(d, Nothing)
    assert d.phase == "Failed"


def test_a_bij_failed_for_an_invalid_spec_starts_once_the_spec_is_valid() -> None:
    status = {"phase": "Failed", "conditions": [
        {"type": "Failed", "status": "True", "reason": "InvalidSpec", "message": "spec.model.engine: bad"}]}
    assert isinstance(decide(make_job(), status, []), PlanRound)
