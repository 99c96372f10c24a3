"""A bij that is over (Succeeded, Failed for good, Cancelled, Expired, CanaryFailed): leave it alone."""

from __future__ import annotations

from bij.contract.status import JobStatus
from bij.control.decisions import (
    RECOVERABLE_FAILURES,
    STOPPED_PHASES,
    Nothing,
)
from bij.control.observe import failure_reason


def ended(state: JobStatus) -> Nothing | None:
    """A bij that is over: `Nothing`, saying how it ended; None while it is not (a Failed phase whose reason is
    one of `RECOVERABLE_FAILURES` is not: a spec edit may clear it)."""
    phase = state.phase
    r = state.current_round
    if phase == "Succeeded":
        return Nothing(round=r, phase="Succeeded", reason="Published",
                       message=_condition_message(state, "Succeeded") or "manifest published")
    if phase == "Failed" and failure_reason(state) not in RECOVERABLE_FAILURES:
        return Nothing(round=r, phase="Failed", reason=failure_reason(state) or "Failed",
                       message=_condition_message(state, "Failed") or "failed")
    if phase in STOPPED_PHASES:
        return Nothing(round=r, phase=phase, reason=phase, message=state.message or phase.lower())
    if phase == "CanaryFailed":
        return Nothing(round=r, phase="CanaryFailed", reason="CanaryFailed", message=state.message or "canary failed")
    return None

def _condition_message(state: JobStatus, type_: str) -> str | None:
    return next((c.message for c in state.conditions if c.type == type_), None)
