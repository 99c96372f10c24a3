"""The worker identity's grants, checked before a bij's first pod: the API server's answers as a
`GrantCheck`, what `decide()` makes of the recorded answer (ask, hold with backoff, go on), what the
driver records and says, and that `bij run` (no RBAC) never asks. (On the real control plane:
tests/system/test_cluster.py.)"""

from __future__ import annotations

import datetime as dt
from types import SimpleNamespace
from typing import Any

import pytest
from kubernetes.client import ApiException
from test_driver import FakeBackend

from bij.contract.spec import parse_job
from bij.contract.status import WorkerPermissions
from bij.control.access_review import check_grants
from bij.control.decisions import CheckPermissions, Nothing, PlanRound, StopHeld, Wait
from bij.control.driver import Driver
from bij.control.permissions import RECHECK_FIRST, RECHECK_MAX, WORKER_GRANTS, GrantCheck, recheck_after, record
from bij.control.reconcile import decide
from bij.control.status import fmt_time

NOW = dt.datetime(2026, 1, 1, 12, 0, tzinfo=dt.timezone.utc)
PATCH_STATUS = "patch batchinferencejobs/status.batchinference.io"
EVERY_GRANT = (f"{PATCH_STATUS}, create leases.coordination.k8s.io, patch leases.coordination.k8s.io")


def a_job(sa: str | None = None) -> Any:
    workers: dict[str, Any] = {"serviceAccountName": sa} if sa else {}
    return parse_job({"apiVersion": "batchinference.io/v1alpha1", "kind": "BatchInferenceJob",
                      "metadata": {"name": "emb", "namespace": "team", "uid": "u"},
                      "spec": {"input": {"uri": "file:///in/"}, "output": {"uri": "file:///out/"},
                               "model": {"engine": "echo", "task": "embed"}, "workers": workers}})


class FakeAuthz:
    """AuthorizationV1Api's LocalSubjectAccessReview: allows what `allowed` holds, or refuses to answer."""

    def __init__(self, allowed: set[str] | None = None, refuse: int | None = None):
        self.allowed = allowed if allowed is not None else {g.what for g in WORKER_GRANTS}
        self.refuse = refuse
        self.asked: list[Any] = []

    def create_namespaced_local_subject_access_review(self, namespace: str, body: Any) -> Any:
        self.asked.append((namespace, body))
        if self.refuse:
            raise ApiException(status=self.refuse, reason="Forbidden")
        ra = body.spec.resource_attributes
        what = f"{ra.verb} {ra.resource}{'/' + ra.subresource if ra.subresource else ''}.{ra.group}"
        return SimpleNamespace(status=SimpleNamespace(allowed=what in self.allowed))


# --- the API server's answer ----------------------------------------------------------------------------


def test_each_worker_grant_is_asked_for_the_service_account_in_its_namespace() -> None:
    authz = FakeAuthz()
    check = check_grants(authz, "team", "runner")
    assert check.result == "Granted" and check.missing == () and check.fix == ""
    assert len(authz.asked) == len(WORKER_GRANTS)
    namespace, body = authz.asked[0]
    assert namespace == body.metadata.namespace == body.spec.resource_attributes.namespace == "team"
    assert body.spec.user == "system:serviceaccount:team:runner"
    assert "system:serviceaccounts:team" in body.spec.groups
    assert check.describe() == f"system:serviceaccount:team:runner may {EVERY_GRANT}"


def test_a_missing_grant_is_named_with_the_commands_that_grant_it() -> None:
    check = check_grants(FakeAuthz(allowed=set()), "team", "bij-worker")
    assert check.result == "Missing" and ", ".join(g.what for g in check.missing) == EVERY_GRANT
    assert f"may not {EVERY_GRANT}" in check.describe()
    assert ("kubectl -n team create role bij-worker --verb=create,patch "
            "--resource=batchinferencejobs.batchinference.io/status --resource=leases.coordination.k8s.io &&") \
        in check.fix
    assert "--serviceaccount=team:bij-worker" in check.fix


def test_an_operator_that_may_not_ask_gets_unknown_not_missing() -> None:
    check = check_grants(FakeAuthz(refuse=403), "team", "bij-worker")
    assert check.result == "Unknown" and check.missing == ()
    assert "create localsubjectaccessreviews: 403 Forbidden" in check.describe()


# --- decide(): ask, hold, go on ------------------------------------------------------------------------


def recorded(check: GrantCheck, at: dt.datetime = NOW,
             previous: WorkerPermissions | None = None) -> dict[str, Any]:
    return {"workerPermissions": record(check, previous, fmt_time(at)).as_status()}


MISSING = GrantCheck("team", "bij-worker", WORKER_GRANTS)


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


def stopping(job: Any, **spec: Any) -> Any:
    """`job` with spec fields set (cancel, deadlineSeconds) and a creation time: NOW."""
    return job.model_copy(update={"spec": job.spec.model_copy(update=spec),
                                  "metadata": job.metadata.model_copy(update={"creation_timestamp": fmt_time(NOW)})})


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


# --- the driver records the answer, says it, and starts no pod while a grant is missing ------------------


def conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status.get("conditions") or []}


def test_the_driver_holds_a_bij_missing_a_grant_and_goes_on_once_it_is_granted(file_place, make_job) -> None:
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", [{"id": i, "text": f"t{i}"} for i in range(9)]))
    backend = FakeBackend(job)
    authz = FakeAuthz(allowed=set())
    driver = Driver(backend, worker_grants=lambda sa: check_grants(authz, job.metadata.namespace, sa))
    idle = driver.reconcile()
    assert isinstance(idle.decision, Wait) and idle.decision.reason == "MissingPermissions"
    assert backend.creates == []  # no step, no round Job: their pods could not report
    st = backend.status
    cond = conditions(st)["WorkerPermissions"]
    assert (cond["status"], cond["reason"]) == ("False", "MissingPermissions")
    assert PATCH_STATUS in cond["message"] and "kubectl -n" in cond["message"]
    assert st["phase"] == "Pending" and st["message"] == cond["message"]
    assert conditions(st)["Ready"]["reason"] == "MissingPermissions"
    assert [e[:2] for e in backend.events] == [("Warning", "MissingPermissions")]
    assert ", ".join(st["workerPermissions"]["missing"]) == EVERY_GRANT and idle.recheck is not None
    assert 0 < idle.recheck <= RECHECK_FIRST
    # Asked again before the re-check is due: no review, no Event.
    asked = len(authz.asked)
    driver.reconcile()
    assert len(authz.asked) == asked and len(backend.events) == 1 and backend.creates == []
    # The admin grants it; the re-check falls due: the Condition turns True and the bij plans and runs.
    authz.allowed = {g.what for g in WORKER_GRANTS}
    backend.status["workerPermissions"]["checkTime"] = fmt_time(dt.datetime.now(dt.timezone.utc)
                                                                - dt.timedelta(seconds=RECHECK_FIRST))
    driver.reconcile()
    cond = conditions(backend.status)["WorkerPermissions"]
    assert (cond["status"], cond["reason"]) == ("True", "Granted")
    assert ("Normal", "PermissionsGranted") in [e[:2] for e in backend.events]
    assert backend.creates == [f"{job.metadata.name}-plan-r0", f"{job.metadata.name}-r0"]


def test_an_operator_that_may_not_ask_says_unknown_once_and_runs_the_bij(file_place, make_job) -> None:
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", [{"id": 1, "text": "t"}]))
    backend = FakeBackend(job)
    authz = FakeAuthz(refuse=403)
    driver = Driver(backend, worker_grants=lambda sa: check_grants(authz, job.metadata.namespace, sa))
    driver.reconcile()
    cond = conditions(backend.status)["WorkerPermissions"]
    assert (cond["status"], cond["reason"]) == ("Unknown", "CannotCheck")
    assert "403 Forbidden" in cond["message"] and "not checked" in cond["message"]
    assert backend.creates == [f"{job.metadata.name}-plan-r0", f"{job.metadata.name}-r0"]
    assert [e[1] for e in backend.events].count("PermissionsNotChecked") == 1
    driver.reconcile()
    assert len(authz.asked) == 1  # recorded: not asked on every reconcile


def test_the_local_runner_never_asks_and_records_nothing(file_place, make_job) -> None:
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", [{"id": 1, "text": "t"}]))
    backend = FakeBackend(job)
    Driver(backend, worker_grants=None).reconcile()  # as local.LocalRun builds it
    assert "workerPermissions" not in backend.status and "WorkerPermissions" not in conditions(backend.status)
    assert backend.creates == [f"{job.metadata.name}-plan-r0", f"{job.metadata.name}-r0"]


@pytest.mark.parametrize("spec, phase", [({"cancel": True}, "Cancelled"), ({"deadlineSeconds": 1}, "Expired")])
def test_the_driver_ends_a_held_bij_that_is_cancelled_or_expires_without_starting_a_pod(
        file_place, make_job, spec: dict[str, Any], phase: str) -> None:
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", [{"id": 1, "text": "t"}]))
    backend = FakeBackend(job)
    authz = FakeAuthz(allowed=set())
    driver = Driver(backend, worker_grants=lambda sa: check_grants(authz, job.metadata.namespace, sa))
    idle = driver.reconcile()
    assert isinstance(idle.decision, Wait) and idle.decision.reason == "MissingPermissions"
    asked = len(authz.asked)
    created = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=5)
    backend.job = job.model_copy(update={
        "spec": job.spec.model_copy(update={"cancel": bool(spec.get("cancel")),
                                            "deadline_seconds": spec.get("deadlineSeconds")}),
        "metadata": job.metadata.model_copy(update={"creation_timestamp": fmt_time(created)})})
    idle = driver.reconcile()
    assert isinstance(idle.decision, StopHeld) and idle.recheck is None
    st = backend.status
    assert st["phase"] == phase and "nothing ran and nothing was published" in st["message"]
    assert st.get("completionTime") and not st.get("manifestUri")
    assert backend.creates == [] and len(authz.asked) == asked  # no pod, no further review
    ready = conditions(st)["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", phase)
    assert conditions(st)["WorkerPermissions"]["status"] == "False"
    assert [e[:2] for e in backend.events] == [("Warning", "MissingPermissions"), ("Normal", phase)]
    driver.reconcile()  # stopped for good: nothing more is said or done, and it stays not Ready
    assert len(backend.events) == 2 and backend.creates == []
    assert conditions(backend.status)["Ready"]["status"] == "False"
