"""Stopping a bij for good: ``spec.cancel: true``, or ``spec.deadlineSeconds`` passed.

Either way the bij goes through the same steps, decided here from (spec, status, observed Jobs):

1. plan round 0 if it never was, so that every input row is counted;
2. suspend the current round's Job: its pods are deleted with their grace period, so each worker
   drains as on preemption (stops taking rows, makes its in-flight chunk durable, exits);
3. wait until no pod of it is active or terminating;
4. publish rounds ``0..round`` as a partial manifest: every durable row exactly once (results and
   error rows), and ``counts.notRun`` for the rows no worker finished (the publish passes count
   them, in pods: `bij_worker.publish_rows`);
5. phase Cancelled or Expired. Neither is left again: a stopped bij never publishes again.

A bij whose publishing has already begun finishes it (phase Succeeded): its rows are all done.
The deadline counts from ``metadata.creationTimestamp`` (for `bij run`, from when round 0 was
planned), or from ``status.startTime`` when there is none.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from bij_worker.contract.spec import BatchInferenceJob

from .reconcile import (
    CreatePublishJob,
    Decision,
    PatchJob,
    PlanRound,
    PreparePublish,
    Publish,
    Wait,
    current_round,
    is_ours,
    publishing,
    round_job,
    round_records,
)
from .status import parse_time


@dataclass(frozen=True)
class Stop:
    """Why a bij stops: the phase it ends in, the reason shown while it stops, and a message."""

    phase: Literal["Cancelled", "Expired"]
    reason: str
    message: str


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
    publish = status.get("publish") or {}
    if publish and not publish.get("partial"):
        return None
    if job.spec.cancel:
        return Stop("Cancelled", "Cancelling", "spec.cancel is true")
    at = deadline(job, status)
    if at is not None and now >= at:
        return Stop("Expired", "DeadlineExceeded",
                    f"spec.deadlineSeconds ({job.spec.deadline_seconds}) passed at {at:%Y-%m-%dT%H:%M:%SZ}")
    return None


def stop_decision(job: BatchInferenceJob, status: Mapping[str, Any], observed_jobs: Sequence[Mapping[str, Any]],
                  stop: Stop) -> Decision:
    """The next step of a stopping bij (see the module's docstring)."""
    r = current_round(status)
    rec = round_records(status).get(r)
    if rec is None and r == 0:
        return PlanRound(round=0, phase="Cancelling", reason=stop.reason,
                         message=f"{stop.message}: planning round 0 to count the rows not run")
    view = round_job(job, r, observed_jobs)
    if view is not None and is_ours(job, view) and not (view.succeeded or view.failed_for_good):
        if not view.suspend:
            return PatchJob(round=r, phase="Cancelling", reason=stop.reason, lanes=view.lanes, job_name=view.name,
                            suspend=True,
                            message=f"{stop.message}: stopping Job {view.name} (its workers drain, as on preemption)")
        pods = view.active + view.terminating
        if pods or not view.has("Suspended"):
            return Wait(round=r, phase="Cancelling", reason=stop.reason, lanes=view.lanes,
                        message=f"{stop.message}: waiting for {pods} worker pod(s) of Job {view.name} to drain")
    # Rounds 0..r: round r as far as it got (its unfinished shards count their rows not run).
    d = publishing(job, status, r, observed_jobs)
    if isinstance(d, PreparePublish | Publish):
        d = dataclasses.replace(d, partial=stop.phase)
    if isinstance(d, PreparePublish | Publish | CreatePublishJob | Wait):
        return dataclasses.replace(d, phase="Cancelling", reason=stop.reason,
                                   message=f"{stop.message}: {d.message} (partial)")
    return d
