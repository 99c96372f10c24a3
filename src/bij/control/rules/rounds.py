"""A round: from its Job, keep it in line with the spec, count and finish it once it ended, fail the bij
with the lanes that failed; then the next judge round or publishing (`after_round`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from bij.contract.fingerprint import field_digests
from bij.contract.lane_report import LaneTally
from bij.contract.rounds import RoundStats, needs_another_round
from bij.contract.spec import BatchInferenceJob
from bij.contract.status import JobStatus
from bij.contract.step_results import FinishResult
from bij.control.decisions import (
    CreateJob,
    Decision,
    FinishRound,
    MarkFailed,
    PatchJob,
    PlanRound,
    Wait,
)
from bij.control.observe import (
    JobView,
    Observation,
    Shards,
    format_ranges,
    is_ours,
    round_job,
)
from bij.control.rules.publish import publishing
from bij.control.rules.steps import step


def spec_changed(job: BatchInferenceJob, state: JobStatus) -> MarkFailed | None:
    """Phase Failed when a row-deciding spec field changed after round 0 was planned
    (`spec_changed_since_planning`); None when none did."""
    changed = spec_changed_since_planning(job, state)
    if not changed:
        return None
    return MarkFailed(round=state.current_round, phase="Failed", reason="SpecChanged",
                      message=f"{', '.join(changed)} changed after round 0 was planned: rows made before and "
                              "after would be mixed; undo the change, or delete and re-create the "
                              "BatchInferenceJob to start over")

def single_job_round(job: BatchInferenceJob, seen: Observation, r: int, lanes: int, planned: int,
                     shards: Shards | None, lanes_reported: LaneTally | None) -> Decision:
    """Round `r` in one Job: create it (an empty round finishes at once), wait while one of an earlier object
    of this name goes, else `round_progress`."""
    view = round_job(job, r, seen.jobs)
    if view is None:
        if planned == 0:
            # Empty input: nothing to run, the round is trivially finished.
            return FinishRound(round=r, phase="Running", reason="RoundFinished", result=FinishResult(done=0),
                               message=f"round {r} has no shards", shards=Shards(done=0, total=0))
        # Not created yet, or deleted before it finished: (re)create it. Workers resume from
        # what is durable, so a recreated Job redoes no finished rows.
        suspend = job.spec.suspend
        return CreateJob(round=r, phase="Suspended" if suspend else "Pending",
                         reason="Suspended" if suspend else "RoundStarting",
                         message=f"round {r}: creating the Job for {planned} shards in {lanes} lanes",
                         shards=shards or Shards(done=0, total=planned),
                         completions=lanes, suspend=suspend)

    if not is_ours(job, view):
        return Wait(round=r, phase="Pending", reason="WaitingForOldJob",
                    message=f"Job {view.name} belongs to an earlier object of this name; "
                            "waiting for it to be deleted")
    return round_progress(job, seen, r, view, planned, shards, lanes_reported)

def round_ended(job: BatchInferenceJob, seen: Observation, r: int, view: JobView, planned: int,
                shards: Shards | None) -> Decision | None:
    """The round whose Job ended: its finish step counts it, then the round is finished (whole, though lanes
    may have failed) or the bij failed; None while the Job runs."""
    if not (view.failed_for_good or view.succeeded):
        return None
    # Its finish step counts the shards done (lanes that failed may have left some) and the statistics.
    counting = step(job, seen, FinishRound(
        round=r, phase="Running", reason="RoundFinishing", lanes=view.lanes,
        shards=Shards(done=planned, total=planned) if view.succeeded else shards,
        message=f"round {r}: Job {view.name} ended; counting its shards"))
    if not isinstance(counting, FinishRound) or counting.result is None:
        return counting
    end = counting.result
    shards = Shards(done=min(end.done, planned), total=planned)
    damaged = list(end.damaged)
    if view.failed_for_good:
        bad_config = view.failure is not None and view.failure.reason == "PodFailurePolicy"
        if bad_config and damaged:
            # input.onDamagedObject fail: a worker stopped at a damaged object (exit 42).
            return MarkFailed(round=r, phase="Failed", reason="DamagedInput", shards=shards, lanes=view.lanes,
                              failed_lanes=tuple(sorted(view.failed)), event="DamagedInput",
                              message=f"round {r}: damaged input: {'; '.join(damaged)}. The rows before it are "
                                      "kept: replace the object and run again (it resumes there), or set "
                                      f"spec.input.onDamagedObject: errorRow; Job {view.name} failed")
        if shards is not None and planned and shards.done >= planned and not bad_config:
            # Lanes failed, but the others took over and finished their shards: the round is whole.
            # Not so after exit 42 (FailJob): a bad configuration fails the job whatever got done.
            failed = format_ranges(view.failed)
            return FinishRound(round=r, phase="Running", reason="RoundFinished",
                               message=f"round {r}: all {planned} shards done"
                                       + (f" (lane {failed} failed; the other lanes finished its shards)"
                                          if failed else ""),
                               shards=shards, lanes=view.lanes, failed_lanes=tuple(sorted(view.failed)), result=end)
        return job_failed(r, view, shards)
    # Its Job succeeded.
    return FinishRound(round=r, phase="Running", reason="RoundFinished",
                       message=f"round {r}: all {planned} shards done", shards=Shards(done=planned, total=planned),
                       lanes=view.lanes, result=end)


def round_progress(job: BatchInferenceJob, seen: Observation, r: int, view: JobView, planned: int,
                   shards: Shards | None, lanes_reported: LaneTally | None, *, patch: bool = True) -> Decision:
    """The round from its Job (`view`; with pools, their Jobs merged): count and finish it once ended, keep the
    Job in line with the spec (`patch`: suspend, parallelism), or say how far it got."""
    if lanes_reported is not None and lanes_reported.round == r:
        view = dataclasses.replace(view, groups_replaced=lanes_reported.groups_replaced,
                                   last_group_lost=lanes_reported.last_group_lost)

    ended = round_ended(job, seen, r, view, planned, shards)
    if ended is not None:
        return ended

    want_suspend = job.spec.suspend
    # Kueue admits a queued Job by unsuspending it: the operator may suspend such a Job but
    # must never unsuspend it, or it would bypass the queue.
    queued = bool(job.spec.workers.queue_name)
    if want_suspend:
        patch_suspend = True if not view.suspend else None
    else:
        patch_suspend = False if view.suspend and not queued else None
    want_parallelism = (desired_parallelism(job, view.completions // view.nodes_per_lane)
                        if view.completions else None)
    patch_parallelism = want_parallelism if want_parallelism and view.parallelism != want_parallelism else None
    if patch and (patch_suspend is not None or patch_parallelism is not None):
        verb = {True: "suspending", False: "resuming", None: "updating"}[patch_suspend]
        return PatchJob(round=r, phase="Suspended" if want_suspend else "Running",
                        reason="Suspended" if want_suspend else "Running",
                        message=f"round {r}: {verb} Job {view.name}", shards=shards, lanes=view.lanes,
                        job_name=view.name, suspend=patch_suspend, parallelism=patch_parallelism)

    progress = _progress(r, view, shards, want_suspend)
    seen_before = seen.state.lanes.replaced if seen.state.lanes is not None else 0
    if view.groups_replaced and progress["phase"] == "Running" and view.groups_replaced > seen_before:
        # A lane's group of pods was replaced since the status last said so: a Warning, once each.
        return Wait(round=r, warning="LaneGroupReplaced", **progress)
    return Wait(round=r, **progress)


def desired_parallelism(job: BatchInferenceJob, lanes: int) -> int:
    """Pods at once: spec.workers.parallelism lanes, but never more than there are, each of
    spec.workers.nodesPerLane pods (a group's pods run together or not at all)."""
    return min(job.spec.workers.parallelism, lanes) * job.spec.workers.nodes_per_lane


def _progress(r: int, view: JobView, shards: Shards | None, want_suspend: bool) -> dict[str, Any]:
    """Phase, reason and message of a round whose Job is neither finished nor in need of a patch."""
    lanes = view.lanes
    failed = f", {lanes.failed} failed ({format_ranges(view.failed)})" if lanes.failed else ""
    counts = (f"{shards.done}/{shards.total} shards done, " if shards is not None else "") + \
        f"{lanes.done}/{lanes.total} lanes done{failed}"
    if view.suspend and not want_suspend:
        return dict(phase="Pending", reason="Queued", shards=shards, lanes=lanes,
                    message=f"round {r}: Job {view.name} is queued (suspended until Kueue admits it); {counts}")
    if view.suspend:
        return dict(phase="Suspended", reason="Suspended", shards=shards, lanes=lanes,
                    message=f"round {r} suspended: {counts}")
    if view.active == 0 and lanes.done == 0 and lanes.failed == 0 and not (shards and shards.done):
        return dict(phase="Pending", reason="WaitingForPods", shards=shards, lanes=lanes,
                    message=f"round {r}: waiting for worker pods to start")
    regrouped = ""
    if view.groups_replaced:
        times = "once" if view.groups_replaced == 1 else f"{view.groups_replaced} times"
        regrouped = f"; a lane's group of pods was replaced {times}, last: {view.last_group_lost}"
    return dict(phase="Running", reason="Running", shards=shards, lanes=lanes,
                message=f"round {r}: {counts}, {view.active} active{regrouped}")


def job_failed(r: int, view: JobView, shards: Shards | None = None) -> MarkFailed:
    """Phase Failed with the Job's reason and which lanes failed."""
    cond = view.failure
    reason = cond.reason if cond and cond.reason else "JobFailed"
    detail = f" ({cond.message})" if cond and cond.message else ""
    failed = set(view.failed)
    if not failed and cond is not None:
        # FailJob names no failed index, only the pod: Indexed Job pods are named
        # <job>-<index>-<random>, so the pod name says which lane it was.
        m = re.search(rf"for pod [^/\s]+/{re.escape(view.name)}-(\d+)-", cond.message)
        if m:
            failed.add(int(m.group(1)))
    if failed:
        noun = "lane" if len(failed) == 1 else "lanes"
        which = f"{noun} {format_ranges(failed)} failed"
    else:
        which = "the Job failed"
    left = f" with {shards.total - shards.done} of {shards.total} shards undone" if shards is not None else ""
    return MarkFailed(round=r, phase="Failed", reason=reason,
                      message=f"round {r}: {which}{left}; Job {view.name}: {reason}{detail}",
                      shards=shards, lanes=view.lanes, failed_lanes=tuple(sorted(failed)))


def spec_changed_since_planning(job: BatchInferenceJob, state: JobStatus) -> list[str]:
    """The row-deciding spec fields (`fingerprint.ROW_FIELDS`) that differ from the digests recorded
    when round 0 was planned; empty when none differ or none were recorded."""
    first = state.round_records().get(0)
    recorded = first.spec_digests if first is not None else None
    if recorded is None:
        return []
    now = field_digests(job)
    return [path for path, d in now.items() if path in recorded and recorded[path] != d]


def round_stats(state: JobStatus) -> list[RoundStats]:
    """The finished rounds' statistics as recorded in ``status.rounds``, in round order."""
    out = []
    for _, rec in sorted(state.round_records().items()):
        if not rec.finished:
            break
        out.append(rec.stats())
    return out


def after_round(job: BatchInferenceJob, seen: Observation, r: int) -> Decision:
    """A round finished: plan the next judge round if rows were rejected, else publish.

    Whether another round follows is `rounds.needs_another_round`, shared with ``bij run``:
    the worker of a judge's last allowed round caps rejected rows instead of rejecting them,
    so the rounds end at ``maxRounds`` without a check here. Error rows beyond
    ``spec.maxErrorRatio`` fail the job instead of publishing.
    """
    history = round_stats(seen.state)
    limit = job.spec.max_error_ratio
    if limit is not None:
        errors = sum(h.errors for h in history)
        total = sum(h.approved + h.errors + h.capped for h in history)
        if total and errors / total > limit:
            return MarkFailed(round=r, phase="Failed", reason="TooManyErrors",
                              message=f"{errors} of {total} rows failed ({errors / total:.1%}), "
                                      f"above spec.maxErrorRatio {limit:.1%}; nothing was published")
    if needs_another_round(job.spec.judge, history):
        rejected = history[-1].rejected
        return step(job, seen, PlanRound(
            round=r + 1, phase="Planning", reason="Planning",
            message=f"round {r}: the judge rejected {rejected} rows; planning round {r + 1}"))
    return publishing(job, seen, r)
