"""Does a bij's worker identity hold every grant its pods use? The grants, the answer, and what the
operator records of it: plain data, for `bij doctor` and for the operator before a bij's first pod.

`WORKER_GRANTS` is the one list (the chart's worker Role is held equal to it by a test).
`access_review.check_grants` asks the API server, one LocalSubjectAccessReview per grant. The operator
records the answer in the bij's status (`record`, `condition`); `reconcile.decide()` reads that record
to hold a bij whose pods would fail (`rules.permissions.permissions_gate`). The local runner (`bij run`) has no
RBAC and never asks.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from bij.contract.codes import API_GROUP, PLURAL
from bij.contract.status import WorkerPermissions

# The worker identity's service account when spec.workers.serviceAccountName names none (the chart's).
DEFAULT_SERVICE_ACCOUNT = "bij-worker"

Result = Literal["Granted", "Missing", "Unknown"]
# Where the operator keeps its answer (status.workerPermissions) and the Condition that shows it.
STATUS_KEY = "workerPermissions"
CONDITION = "WorkerPermissions"
# A missing grant is asked about again after RECHECK_FIRST seconds, twice as long each time after, at most
# RECHECK_MAX: an admin's fix lets the bij go on within that, without re-creating it.
RECHECK_FIRST = 15.0
RECHECK_MAX = 120.0


@dataclasses.dataclass(frozen=True)
class Grant:
    """One permission of the worker identity: `verb` on `resource[/subresource]` of `group`."""

    group: str
    resource: str
    verb: str
    subresource: str = ""

    @property
    def what(self) -> str:
        sub = f"/{self.subresource}" if self.subresource else ""
        return f"{self.verb} {self.resource}{sub}.{self.group}"


# Every grant a bij's pods use (the chart's `bij-operator.rules.worker`; a test holds the two equal):
# a step pod merge-patches its own report into the bij's status, a lane's pod writes its progress into a
# Lease of its own (bij.worker.report).
WORKER_GRANTS: tuple[Grant, ...] = (Grant(API_GROUP, PLURAL, "patch", "status"),
                                    Grant("coordination.k8s.io", "leases", "create"),
                                    Grant("coordination.k8s.io", "leases", "patch"))


def worker_role_rules() -> list[dict[str, Any]]:
    """`WORKER_GRANTS` as Role rules, one per grant."""
    return [{"apiGroups": [g.group], "resources": [f"{g.resource}/{g.subresource}" if g.subresource else g.resource],
             "verbs": [g.verb]} for g in WORKER_GRANTS]


def grant_fix(namespace: str, sa: str, missing: Sequence[Grant]) -> str:
    """The commands that grant `missing` to the worker identity."""
    verbs = ",".join(sorted({g.verb for g in missing}))
    resources = " ".join(dict.fromkeys(f"--resource={g.resource}.{g.group}" +
                                       (f"/{g.subresource}" if g.subresource else "") for g in missing))
    return (f"kubectl -n {namespace} create role bij-worker --verb={verbs} {resources} && "
            f"kubectl -n {namespace} create rolebinding bij-worker --role=bij-worker "
            f"--serviceaccount={namespace}:{sa}  (or list {namespace} in the chart's workerServiceAccount.namespaces)")


def service_account_user(namespace: str, sa: str) -> str:
    return f"system:serviceaccount:{namespace}:{sa}"


@dataclasses.dataclass(frozen=True)
class GrantCheck:
    """The API server's answer for one worker identity: the grants it lacks, or why it could not be asked."""

    namespace: str
    service_account: str
    missing: tuple[Grant, ...] = ()
    cannot_ask: str | None = None  # e.g. "create localsubjectaccessreviews: 403 Forbidden"

    @property
    def user(self) -> str:
        return service_account_user(self.namespace, self.service_account)

    @property
    def result(self) -> Result:
        return "Unknown" if self.cannot_ask is not None else "Missing" if self.missing else "Granted"

    @property
    def fix(self) -> str:
        return grant_fix(self.namespace, self.service_account, self.missing) if self.missing else ""

    def describe(self) -> str:
        """One sentence: what the identity may (not) do, or that it could not be asked."""
        if self.cannot_ask is not None:
            return f"cannot ask the API server what {self.user} may do ({self.cannot_ask})"
        if self.missing:
            return (f"{self.user} may not {', '.join(g.what for g in self.missing)}: its pods cannot report into "
                    "the bij's status, so the bij would never get past its first step")
        return f"{self.user} may {', '.join(g.what for g in WORKER_GRANTS)}"


# --- the operator's record of the answer, in the bij's status ------------------------------------------


def recheck_after(checks: int) -> float:
    """Seconds until a missing grant is asked about again, after `checks` answers that it is missing."""
    return min(RECHECK_FIRST * 2 ** max(checks - 1, 0), RECHECK_MAX)


def condition(check: GrantCheck) -> tuple[bool | None, str, str]:
    """The WorkerPermissions Condition's status (None: Unknown), reason and message for `check`."""
    if check.result == "Unknown":
        return None, "CannotCheck", (f"{check.describe()}: not checked; the bij goes on (the chart grants the "
                                     "operator create on localsubjectaccessreviews)")
    if check.result == "Missing":
        return False, "MissingPermissions", (f"{check.describe()}; no pod is started until it may (checked again "
                                             f"every {RECHECK_MAX:.0f} s at most). Fix: {check.fix}")
    return True, "Granted", check.describe()


def record(check: GrantCheck, previous: WorkerPermissions | None, now: str) -> WorkerPermissions:
    """``status.workerPermissions``: whose grants were asked about, the answer, when, and how many answers
    in a row said the same identity lacks a grant (the re-check's backoff)."""
    again = previous is not None and previous.service_account == check.service_account \
        and previous.result == "Missing"
    _, _, message = condition(check)
    checks = (previous.checks + 1 if again and previous is not None else 1) if check.result == "Missing" else 1
    return WorkerPermissions(service_account=check.service_account, result=check.result,
                             missing=[g.what for g in check.missing], message=message, check_time=now, checks=checks)


def recheck_due(rec: Mapping[str, Any], now: dt.datetime) -> float:
    """Seconds until a recorded Missing answer is due to be asked again (0 or less: now)."""
    try:
        at = dt.datetime.fromisoformat(str(rec.get("checkTime")).replace("Z", "+00:00"))
    except ValueError:
        return 0.0
    return recheck_after(int(rec.get("checks") or 1)) - (now - at).total_seconds()
