"""The worker identity's grants, before the first pod: ask, hold a bij that lacks one, or go on."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from bij.contract.spec import BatchInferenceJob
from bij.control.decisions import (
    CheckPermissions,
    Decision,
    StopHeld,
    Wait,
)
from bij.control.permissions import DEFAULT_SERVICE_ACCOUNT, STATUS_KEY, recheck_due, service_account_user
from bij.control.stopping import stop_requested


def permissions_gate(job: BatchInferenceJob, status: Mapping[str, Any], now: dt.datetime) -> Decision | None:
    """Before a bij's first pod: ask whether its worker identity holds every grant its pods use (no answer
    recorded for that service account yet, or a Missing answer whose re-check is due), hold it while one is
    missing, or None: go on (Granted; or Unknown, the operator may not ask, which never holds a bij)."""
    sa = job.spec.workers.service_account_name or DEFAULT_SERVICE_ACCOUNT
    rec = status.get(STATUS_KEY)
    if not isinstance(rec, Mapping) or rec.get("serviceAccount") != sa:
        return CheckPermissions(round=0, phase="Pending", reason="CheckingPermissions", service_account=sa,
                                message="checking the grants of the worker identity "
                                        f"{service_account_user(job.metadata.namespace, sa)}")
    if rec.get("result") != "Missing":
        return None
    message = str(rec.get("message") or "the worker identity lacks a grant its pods use")
    left = recheck_due(rec, now)
    if left <= 0:
        return CheckPermissions(round=0, phase="Pending", reason="MissingPermissions", service_account=sa,
                                message=message)
    return Wait(round=0, phase="Pending", reason="MissingPermissions", message=message, recheck=left)


def held_before_first_pod(job: BatchInferenceJob, status: Mapping[str, Any], now: dt.datetime) -> Decision | None:
    """`permissions_gate`, asked before round 0 is planned and before a stop too: cancelling plans round 0 in a
    pod, which would be refused as well. A held bij that is cancelled or expires ends so at once (`StopHeld`),
    without its grants and without a pod. None: go on."""
    held = permissions_gate(job, status, now)
    if held is not None:
        stop = stop_requested(job, status, now)
        if stop is not None and held.reason == "MissingPermissions":
            return StopHeld(round=0, phase=stop.phase, reason=stop.phase,
                            message=f"{stop.message} while the bij was held before its first pod "
                                    f"({held.message}): nothing ran and nothing was published")
    return held
