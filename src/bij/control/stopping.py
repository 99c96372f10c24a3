"""Stopping a bij for good: ``spec.cancel: true``, or ``spec.deadlineSeconds`` passed.

This module says whether and why a bij stops (`stop_requested`), and when its deadline comes;
`rules.stop.stopping_step` decides its steps, the same either way:

1. plan round 0 if it never was, so that every input row is counted;
2. suspend the current round's Job: its pods are deleted with their grace period, so each worker
   drains as on preemption (stops taking rows, makes its in-flight chunk durable, exits);
3. wait until no pod of it is active or terminating;
4. publish rounds ``0..round`` as a partial manifest: every durable row exactly once (results and
   error rows), and ``counts.notRun`` for the rows no worker finished (the publish passes count
   them, in pods: `bij.steps.publish_rows`);
5. phase Cancelled or Expired. Neither is left again: a stopped bij never publishes again.

A bij whose publishing has already begun finishes it (phase Succeeded): its rows are all done.
The deadline counts from ``metadata.creationTimestamp``, or from ``status.startTime`` when there is none
(`bij run`: its first run's, which a rerun restores with the status it kept).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from bij.contract.spec import BatchInferenceJob
from bij.contract.status import JobStatus


@dataclass(frozen=True)
class Stop:
    """Why a bij stops: the phase it ends in, the reason shown while it stops, and a message."""

    phase: Literal["Cancelled", "Expired"]
    reason: str
    message: str


def parse_time(text: Any) -> dt.datetime | None:
    """An RFC 3339 time as Kubernetes writes it, or None."""
    try:
        return dt.datetime.fromisoformat(str(text).replace("Z", "+00:00")) if text else None
    except ValueError:
        return None


def deadline(job: BatchInferenceJob, status: Mapping[str, Any]) -> dt.datetime | None:
    """When spec.deadlineSeconds runs out, or None without one (or without a start time yet)."""
    seconds = job.spec.deadline_seconds
    if seconds is None:
        return None
    start = parse_time(job.metadata.creation_timestamp) or parse_time(status.get("startTime"))
    return start + dt.timedelta(seconds=seconds) if start is not None else None


def seconds_left(job: BatchInferenceJob, status: Mapping[str, Any], now: dt.datetime) -> float | None:
    """Seconds until the deadline (0 once it passed), or None without one."""
    at = deadline(job, status)
    return None if at is None else max(0.0, (at - now).total_seconds())


def stop_requested(job: BatchInferenceJob, status: Mapping[str, Any], now: dt.datetime) -> Stop | None:
    """Whether the bij must stop now: cancel asked for, or the deadline passed. None once publishing
    of the whole job has begun (it finishes) or when neither applies."""
    publish = JobStatus.read(status).publish
    if publish is not None and not publish.partial:
        return None
    if job.spec.cancel:
        return Stop("Cancelled", "Cancelling", "spec.cancel is true")
    at = deadline(job, status)
    if at is not None and now >= at:
        return Stop("Expired", "DeadlineExceeded",
                    f"spec.deadlineSeconds ({job.spec.deadline_seconds}) passed at {at:%Y-%m-%dT%H:%M:%SZ}")
    return None
