"""The worker identity's grants, checked before a bij's first pod: the API server's answers as a
`GrantCheck`, what the driver records and says, and that `bij run` (no RBAC) never asks. What `decide()` makes
of the recorded answer (ask, hold with backoff, go on): tests/control/rules/test_permissions.py. (On the real
control plane: tests/system/test_cluster.py.)"""

from __future__ import annotations

import datetime as dt
from types import SimpleNamespace
from typing import Any

import pytest
from kubernetes.client import ApiException
from rules.builders import PATCH_STATUS
from test_driver import FakeBackend

from bij.control.access_review import check_grants
from bij.control.decisions import StopHeld, Wait
from bij.control.driver import Driver
from bij.control.permissions import RECHECK_FIRST, WORKER_GRANTS
from bij.control.status import fmt_time

EVERY_GRANT = (f"{PATCH_STATUS}, create leases.coordination.k8s.io, patch leases.coordination.k8s.io")


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
