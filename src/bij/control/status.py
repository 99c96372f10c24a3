"""What ``kubectl get bij`` shows: status fields and conditions, built from a decision.

Pure functions that build the status merge patch as a `bij.contract.status.StatusPatch` (turned into the
JSON the API takes where it is written: `StatusPatch.as_patch`); the status is read typed through
`bij.contract.status.JobStatus`. Conditions follow the Kubernetes API conventions: a list keyed by ``type``, each with
``status`` ("True"/"False"), ``reason`` (CamelCase), ``message``, ``lastTransitionTime`` (changes only
when ``status`` flips) and ``observedGeneration``. Beside the phase's own types, ``WorkerPermissions``
(`permissions.condition`) says whether the worker identity holds every grant its pods use.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from typing import Any

from bij.contract.status import Condition, ConditionStatus, JobStatus, Lanes, Rows, Shards, StatusPatch
from bij.control.decisions import Decision

CONDITION_TYPES = ("Ready", "Running", "Suspended", "Succeeded", "Failed")


def now_utc() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def fmt_time(t: dt.datetime) -> str:
    """RFC 3339 in UTC with second precision, as Kubernetes writes times."""
    return t.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str | None) -> dt.datetime | None:
    if not text:
        return None
    try:
        return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


def with_condition(
    conditions: Iterable[Condition],
    type_: str,
    status: bool | None,
    reason: str,
    message: str,
    *,
    generation: int | None,
    now: dt.datetime,
) -> list[Condition]:
    """`conditions` with `type_` set (`status` None: "Unknown"); ``lastTransitionTime`` moves only when the
    status flips."""
    value: ConditionStatus = "Unknown" if status is None else "True" if status else "False"
    out: list[Condition] = []
    found = False
    for c in conditions:
        if c.type == type_:
            found = True
            update: dict[str, Any] = {"status": value, "reason": reason, "message": message}
            if c.status != value or not c.last_transition_time:
                update["last_transition_time"] = fmt_time(now)
            if generation is not None:
                update["observed_generation"] = generation
            c = c.model_copy(update=update)
        out.append(c)
    if not found:
        out.append(Condition(type=type_, status=value, reason=reason, message=message,
                             last_transition_time=fmt_time(now), observed_generation=generation))
    return out


def with_phase_conditions(
    conditions: Iterable[Condition],
    phase: str,
    reason: str,
    message: str,
    *,
    generation: int | None,
    now: dt.datetime,
    ready: bool | None = None,
) -> list[Condition]:
    """All condition types, derived from one phase. The true ones carry `reason`/`message`. `ready`: Ready
    as given rather than from the phase (False for a bij stopped before anything ran: nothing is published)."""
    truth = {
        # Cancelled and Expired: the finished part is published and readable.
        "Ready": phase in ("Succeeded", "Cancelled", "Expired") if ready is None else ready,
        "Running": phase in ("Planning", "Running", "Publishing", "Cancelling"),
        "Suspended": phase == "Suspended",
        "Succeeded": phase == "Succeeded",
        "Failed": phase in ("Failed", "CanaryFailed"),
    }
    out = list(conditions)
    for type_ in CONDITION_TYPES:
        if truth[type_] or type_ == "Ready":
            # Ready always explains itself: why the results are (not yet) readable.
            r, m = reason, message
        else:
            r, m = f"Not{type_}", f"phase is {phase}"
        out = with_condition(out, type_, truth[type_], r, m, generation=generation, now=now)
    return out


def rows_patch(done: int, failed: int, started: str | None, now: dt.datetime) -> StatusPatch:
    """``rows``, and ``rowsPerSecond`` over wall time since `started` (when it is known)."""
    patch = StatusPatch(rows=Rows(done=done, failed=failed))
    start = parse_time(started)
    if start is not None:
        elapsed = (now - start).total_seconds()
        patch.rows_per_second = round(done / elapsed, 2) if elapsed > 0 else 0.0
    return patch


def decision_patch(
    old: JobStatus,
    decision: Decision,
    *,
    generation: int | None,
    now: dt.datetime,
    output_uri: str,
) -> StatusPatch:
    """The status merge-patch that shows `decision` (phase, round, shards, lanes, conditions)."""
    patch = StatusPatch(phase=decision.phase, round=decision.round, output_uri=output_uri,
                        observed_generation=generation,
                        conditions=with_phase_conditions(old.conditions, decision.phase, decision.reason,
                                                         decision.message, generation=generation, now=now))
    if decision.shards is not None:
        s = decision.shards
        patch.shards = Shards(done=s.done, total=s.total)
        patch.shards_summary = s.summary
    if decision.lanes is not None:
        lanes = decision.lanes
        patch.lanes = Lanes(done=lanes.done, failed=lanes.failed, active=lanes.active, total=lanes.total,
                            replaced=lanes.replaced)
        patch.lanes_summary = lanes.summary
    if decision.pools is not None:
        patch.pools = list(decision.pools)
        patch.pools_summary = ", ".join(f"{p.name} {p.active}/{p.lanes}" + (" (gave up)" if p.gave_up_round ==
                                                                              decision.round else "")
                                        for p in decision.pools)
    if not old.start_time:
        patch.start_time = fmt_time(now)
    if decision.phase in ("Succeeded", "Failed", "Cancelled", "Expired", "CanaryFailed") and not old.completion_time:
        patch.completion_time = fmt_time(now)
    return patch


def status_differs(old: Mapping[str, Any], patch: Mapping[str, Any]) -> bool:
    """Whether applying `patch` would change anything a user sees (ignores condition timestamps)."""
    for key, value in patch.items():
        if key == "conditions":
            def strip(cs: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
                return [{k: v for k, v in c.items() if k != "lastTransitionTime"} for c in cs]
            if strip(old.get("conditions") or []) != strip(value):
                return True
        elif old.get(key) != value:
            return True
    return False
