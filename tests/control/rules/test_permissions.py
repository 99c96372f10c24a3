"""`rules.permissions`: before a bij's first pod, ask whether its worker identity holds every grant its pods use,
hold it (with backoff) while one is missing, or go on. The API server's answers and the driver:
tests/control/test_permissions.py."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from bij.contract.spec import parse_job
from bij.contract.status import WorkerPermissions
from bij.control.decisions import (
    CheckPermissions,
    Nothing,
    PlanRound,
    StopHeld,
    Wait,
)
from bij.control.permissions import RECHECK_FIRST, RECHECK_MAX, WORKER_GRANTS, GrantCheck, recheck_after, record
from bij.control.reconcile import decide
from bij.control.rules.permissions import held_before_first_pod
from bij.control.status import fmt_time
from rules.builders import (
    PATCH_STATUS,
)

NOW = dt.datetime(2026, 1, 1, 12, 0, tzinfo=dt.timezone.utc)


def a_job(sa: str | None = None) -> Any:
    workers: dict[str, Any] = {"serviceAccountName": sa} if sa else {}
    return parse_job({"apiVersion": "batchinference.io/v1alpha1", "kind": "BatchInferenceJob",
                      "metadata": {"name": "emb", "namespace": "team", "uid": "u"},
                      "spec": {"input": {"uri": "file:///in/"}, "output": {"uri": "file:///out/"},
                               "model": {"engine": "echo", "task": "embed"}, "workers": workers}})


def recorded(check: GrantCheck, at: dt.datetime = NOW,
             previous: WorkerPermissions | None = None) -> dict[str, Any]:
    return {"workerPermissions": record(check, previous, fmt_time(at)).as_status()}


MISSING = GrantCheck("team", "bij-worker", WORKER_GRANTS)


def stopping(job: Any, **spec: Any) -> Any:
    """`job` with spec fields set (cancel, deadlineSeconds) and a creation time: NOW."""
    return job.model_copy(update={"spec": job.spec.model_copy(update=spec),
                                  "metadata": job.metadata.model_copy(update={"creation_timestamp": fmt_time(NOW)})})


@pytest.mark.parametrize("sa", [None, "runner"])
def test_a_new_bij_first_asks_for_its_worker_identitys_grants(sa: str | None) -> None:
    d = decide(a_job(sa), {}, [], now=NOW, check_permissions=True)
    assert isinstance(d, CheckPermissions) and d.service_account == (sa or "bij-worker")
    assert d.phase == "Pending" and "system:serviceaccount:team:" + (sa or "bij-worker") in d.message


@pytest.mark.parametrize("check", [GrantCheck("team", "bij-worker"),
                                   GrantCheck("team", "bij-worker", cannot_ask="create localsubjectaccessreviews: "
                                                                               "403 Forbidden")])
def test_granted_or_not_checkable_goes_on_to_plan(check: GrantCheck) -> None:
    d = decide(a_job(), recorded(check), [], now=NOW + dt.timedelta(days=1), check_permissions=True)
    assert isinstance(d, PlanRound)


def test_a_missing_grant_holds_the_bij_before_any_pod_until_the_recheck_is_due() -> None:
    status = recorded(MISSING)
    d = decide(a_job(), status, [], now=NOW + dt.timedelta(seconds=5), check_permissions=True)
    assert isinstance(d, Wait) and d.phase == "Pending" and d.reason == "MissingPermissions"
    assert d.recheck == pytest.approx(RECHECK_FIRST - 5)
    assert PATCH_STATUS in d.message and "kubectl -n team create role" in d.message
    d = decide(a_job(), status, [], now=NOW + dt.timedelta(seconds=RECHECK_FIRST), check_permissions=True)
    assert isinstance(d, CheckPermissions) and d.reason == "MissingPermissions"


def test_rechecks_back_off_to_a_cap_and_count_only_answers_that_stay_missing() -> None:
    assert [recheck_after(n) for n in (1, 2, 3)] == [RECHECK_FIRST, 2 * RECHECK_FIRST, 4 * RECHECK_FIRST]
    assert recheck_after(50) == RECHECK_MAX
    rec = record(MISSING, None, fmt_time(NOW))
    for n in (2, 3):
        rec = record(MISSING, rec, fmt_time(NOW))
        assert rec.checks == n
    assert record(GrantCheck("team", "bij-worker"), rec, fmt_time(NOW)).checks == 1
    assert record(GrantCheck("team", "other", WORKER_GRANTS), rec, fmt_time(NOW)).checks == 1
    status = {"workerPermissions": rec.as_status()}
    d = decide(a_job(), status, [], now=NOW + dt.timedelta(seconds=1), check_permissions=True)
    assert isinstance(d, Wait) and d.recheck == pytest.approx(4 * RECHECK_FIRST - 1)


@pytest.mark.parametrize("later", [1.0, RECHECK_FIRST])  # held; held with its re-check due
def test_a_held_bij_that_is_cancelled_ends_cancelled_at_once_without_its_grants_or_a_pod(later: float) -> None:
    d = decide(stopping(a_job(), cancel=True), recorded(MISSING), [], now=NOW + dt.timedelta(seconds=later),
               check_permissions=True)
    assert isinstance(d, StopHeld) and (d.phase, d.reason, d.round) == ("Cancelled", "Cancelled", 0)
    assert d.message.startswith("spec.cancel is true while the bij was held before its first pod (")
    assert PATCH_STATUS in d.message and d.message.endswith("nothing ran and nothing was published")


def test_a_held_bij_whose_deadline_passes_ends_expired_at_once() -> None:
    job = stopping(a_job(), deadline_seconds=60)
    d = decide(job, recorded(MISSING, at=NOW + dt.timedelta(seconds=20)), [], now=NOW + dt.timedelta(seconds=30),
               check_permissions=True)
    assert isinstance(d, Wait) and d.reason == "MissingPermissions"  # held, the deadline still ahead
    d = decide(job, recorded(MISSING, at=NOW + dt.timedelta(seconds=59)), [], now=NOW + dt.timedelta(seconds=60),
               check_permissions=True)
    assert isinstance(d, StopHeld) and (d.phase, d.reason) == ("Expired", "Expired")
    assert d.message.startswith("spec.deadlineSeconds (60) passed at 2026-01-01T12:01:00Z while the bij was held")


def test_a_stop_before_the_grants_are_known_asks_first_and_one_granted_stops_as_usual() -> None:
    cancelled = stopping(a_job(), cancel=True)
    assert isinstance(decide(cancelled, {}, [], now=NOW, check_permissions=True), CheckPermissions)
    d = decide(cancelled, recorded(GrantCheck("team", "bij-worker")), [], now=NOW, check_permissions=True)
    assert isinstance(d, PlanRound) and d.phase == "Cancelling"  # its pods may report: the rows are counted
    d = decide(cancelled, {**recorded(MISSING), "phase": "Cancelled", "message": "m"}, [], now=NOW,
               check_permissions=True)
    assert isinstance(d, Nothing) and d.phase == "Cancelled"


def test_another_service_account_in_the_spec_is_asked_about_at_once() -> None:
    d = decide(a_job("runner"), recorded(MISSING), [], now=NOW, check_permissions=True)
    assert isinstance(d, CheckPermissions) and d.service_account == "runner"


def test_a_bij_already_under_way_and_bij_run_are_never_held() -> None:
    planned = {**recorded(MISSING), "round": 0, "rounds": [{"round": 0, "shards": 0, "lanes": 0}]}
    assert not isinstance(decide(a_job(), planned, [], now=NOW, check_permissions=True), (Wait, CheckPermissions))
    # Without RBAC (bij run), a missing-grant record or none: planning goes on.
    for status in ({}, recorded(MISSING)):
        assert isinstance(decide(a_job(), status, [], now=NOW), PlanRound)


# --- held_before_first_pod(): ask, hold, stop held, or go on ------------------------------------------------

GRANTED = GrantCheck("team", "bij-worker")
CANNOT_ASK = GrantCheck("team", "bij-worker", cannot_ask="create localsubjectaccessreviews: 403 Forbidden")
JOBS = {"plain": a_job(), "runner": a_job("runner"), "cancelled": stopping(a_job(), cancel=True),
        "deadline 60s": stopping(a_job(), deadline_seconds=60)}


@pytest.mark.parametrize(("job", "check", "later", "kind", "fields"), [
    ("plain", None, 0.0, CheckPermissions, {"reason": "CheckingPermissions", "service_account": "bij-worker"}),
    # The answer recorded is another service account's: ask about this one.
    ("runner", MISSING, 0.0, CheckPermissions, {"reason": "CheckingPermissions", "service_account": "runner"}),
    ("plain", GRANTED, 0.0, None, {}),
    ("plain", CANNOT_ASK, 0.0, None, {}),  # an operator that may not ask never holds a bij
    ("plain", MISSING, 5.0, Wait, {"reason": "MissingPermissions", "phase": "Pending", "recheck": RECHECK_FIRST - 5}),
    ("plain", MISSING, RECHECK_FIRST, CheckPermissions, {"reason": "MissingPermissions"}),
    ("cancelled", MISSING, 5.0, StopHeld, {"phase": "Cancelled", "reason": "Cancelled", "round": 0}),
    ("cancelled", MISSING, RECHECK_FIRST, StopHeld, {"phase": "Cancelled"}),
    # A stop before the grants are known asks first; one granted goes on (and stops as usual).
    ("cancelled", None, 0.0, CheckPermissions, {"reason": "CheckingPermissions"}),
    ("cancelled", GRANTED, 0.0, None, {}),
    ("deadline 60s", MISSING, 10.0, Wait, {"reason": "MissingPermissions"}),
    ("deadline 60s", MISSING, 60.0, StopHeld, {"phase": "Expired", "reason": "Expired"}),
], ids=["unasked", "another-service-account", "granted", "cannot-ask", "missing", "missing-recheck-due",
        "missing-cancelled", "missing-recheck-due-cancelled", "unasked-cancelled", "granted-cancelled",
        "missing-deadline-ahead", "missing-deadline-passed"])
def test_held_before_first_pod(job: str, check: GrantCheck | None, later: float, kind: type | None,
                               fields: dict[str, Any]) -> None:
    status = recorded(check) if check is not None else {}
    got = held_before_first_pod(JOBS[job], status, NOW + dt.timedelta(seconds=later))
    if kind is None:
        assert got is None
        return
    assert isinstance(got, kind), got
    assert {k: getattr(got, k) for k in fields} == pytest.approx(fields)
    if kind is StopHeld:
        assert PATCH_STATUS in got.message and got.message.endswith("nothing ran and nothing was published")
