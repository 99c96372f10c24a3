"""What ``kubectl get bij`` shows: status fields and conditions, built from a decision.

Pure functions that build the status merge patch (plain dicts, as the API takes them; the status is
read typed through `bij.contract.status.JobStatus`). Conditions follow the Kubernetes API conventions:
a list keyed by ``type``, each with ``status`` ("True"/"False"), ``reason``
(CamelCase), ``message``, ``lastTransitionTime`` (changes only when ``status``
flips) and ``observedGeneration``. Beside the phase's own types, ``WorkerPermissions``
(`permissions.condition`) says whether the worker identity holds every grant its pods use.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from typing import Any

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


def set_condition(
    conditions: Iterable[Mapping[str, Any]],
    type_: str,
    status: bool | None,
    reason: str,
    message: str,
    *,
    generation: int | None,
    now: dt.datetime,
) -> list[dict[str, Any]]:
    """`conditions` with `type_` set (`status` None: "Unknown"); ``lastTransitionTime`` moves only when the
    status flips."""
    value = "Unknown" if status is None else "True" if status else "False"
    out: list[dict[str, Any]] = []
    found = False
    for c in conditions:
        c = dict(c)
        if c.get("type") == type_:
            found = True
            if c.get("status") != value or not c.get("lastTransitionTime"):
                c["lastTransitionTime"] = fmt_time(now)
            c.update(status=value, reason=reason, message=message)
            if generation is not None:
                c["observedGeneration"] = generation
        out.append(c)
    if not found:
        c = {"type": type_, "status": value, "reason": reason, "message": message,
             "lastTransitionTime": fmt_time(now)}
        if generation is not None:
            c["observedGeneration"] = generation
        out.append(c)
    return out


def phase_conditions(
    conditions: Iterable[Mapping[str, Any]],
    phase: str,
    reason: str,
    message: str,
    *,
    generation: int | None,
    now: dt.datetime,
    ready: bool | None = None,
) -> list[dict[str, Any]]:
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
    out: list[dict[str, Any]] = [dict(c) for c in conditions]
    for type_ in CONDITION_TYPES:
        if truth[type_] or type_ == "Ready":
            # Ready always explains itself: why the results are (not yet) readable.
            r, m = reason, message
        else:
            r, m = f"Not{type_}", f"phase is {phase}"
        out = set_condition(out, type_, truth[type_], r, m, generation=generation, now=now)
    return out


def rows_progress(
    records: Iterable[Mapping[str, Any]],
    started: str | None,
    now: dt.datetime,
) -> dict[str, Any]:
    """``rows`` and ``rowsPerSecond`` from the finished shards' completion records.

    Throughput is over wall time since ``startTime``: what a user waiting for the job sees,
    including scheduling and preemption, not the per-pod engine speed.
    """
    done = failed = 0
    for rec in records:
        done += int(rec.get("rows") or 0)
        failed += int(rec.get("errors") or 0)
    out: dict[str, Any] = {"rows": {"done": done, "failed": failed}}
    start = parse_time(started)
    if start is not None:
        elapsed = (now - start).total_seconds()
        out["rowsPerSecond"] = round(done / elapsed, 2) if elapsed > 0 else 0.0
    return out


def decision_status(
    old: Mapping[str, Any],
    decision: Decision,
    *,
    generation: int | None,
    now: dt.datetime,
    output_uri: str,
) -> dict[str, Any]:
    """The status merge-patch that shows `decision` (phase, round, shards, lanes, conditions)."""
    patch: dict[str, Any] = {
        "phase": decision.phase,
        "round": decision.round,
        "outputUri": output_uri,
        "observedGeneration": generation,
        "conditions": phase_conditions(old.get("conditions") or [], decision.phase, decision.reason,
                                       decision.message, generation=generation, now=now),
    }
    if decision.shards is not None:
        s = decision.shards
        patch["shards"] = {"done": s.done, "total": s.total}
        patch["shardsSummary"] = s.summary
    if decision.lanes is not None:
        lanes = decision.lanes
        patch["lanes"] = {"done": lanes.done, "failed": lanes.failed, "active": lanes.active, "total": lanes.total,
                          "replaced": lanes.replaced}
        patch["lanesSummary"] = lanes.summary
    if decision.pools is not None:
        patch["pools"] = [p.as_status() for p in decision.pools]
        patch["poolsSummary"] = ", ".join(f"{p.name} {p.active}/{p.lanes}" + (" (gave up)" if p.gave_up_round ==
                                                                                decision.round else "")
                                          for p in decision.pools)
    if not old.get("startTime"):
        patch["startTime"] = fmt_time(now)
    if decision.phase in ("Succeeded", "Failed", "Cancelled", "Expired", "CanaryFailed") \
            and not old.get("completionTime"):
        patch["completionTime"] = fmt_time(now)
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
