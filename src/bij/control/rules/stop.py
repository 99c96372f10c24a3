"""A bij that stops for good (spec.cancel, spec.deadlineSeconds): its round's Jobs drain, then what
finished is published as a partial manifest (`stopping_step`)."""

from __future__ import annotations

import dataclasses

from bij.contract.spec import BatchInferenceJob
from bij.control.decisions import (
    CreatePublishJob,
    Decision,
    PatchJob,
    PlanRound,
    PreparePublish,
    Publish,
    RerunStep,
    StopHeld,
    Wait,
)
from bij.control.observe import (
    JobView,
    Observation,
    canary_job,
    is_ours,
    pool_jobs,
    round_job,
    step_job_name,
)
from bij.control.rules.publish import publishing
from bij.control.rules.steps import step
from bij.control.stopping import Stop


def stopping_step(job: BatchInferenceJob, seen: Observation, stop: Stop) -> Decision:
    """The next step of a bij that stops for good (`stopping`): plan round 0 if it never was, suspend the
    round's Job so its workers drain as on preemption, wait until no pod of it is active or terminating,
    then publish rounds 0..round as a partial manifest (phase Cancelling until it ends Cancelled or Expired)."""
    r = seen.state.current_round
    rec = seen.state.round_records().get(r)
    if rec is None and r == 0:
        d = step(job, seen, PlanRound(round=0, phase="Cancelling", reason=stop.reason,
                                      message=f"{stop.message}: planning round 0 to count the rows not run"))
        if isinstance(d, Wait) and d.reason == "StepCannotStart":
            # A plan step that cannot start would hold the stop for good; nothing ran, so nothing is lost.
            return StopHeld(round=0, phase=stop.phase, reason=stop.phase, job_name=step_job_name(job, "plan", 0),
                            message=f"{stop.message} while round 0 could not be planned ({d.message}): nothing ran "
                                    "and nothing was published")
        return d
    # With spec.workers.pools the round runs in several Jobs: each drains.
    views = ([JobView.of(raw) for _, _, raw in pool_jobs(job, r, seen.jobs)] if job.spec.workers.pools
             else [v for v in (round_job(job, r, seen.jobs),) if v is not None])
    canary = canary_job(job, seen.jobs) if r == 0 else None
    if not views and canary is not None:
        views = [canary]  # stopped during the canary: its lanes drain the same way
    for view in views:
        if not is_ours(job, view) or view.succeeded or view.failed_for_good:
            continue
        if not view.suspend:
            return PatchJob(round=r, phase="Cancelling", reason=stop.reason, lanes=view.lanes, job_name=view.name,
                            suspend=True,
                            message=f"{stop.message}: stopping Job {view.name} (its workers drain, as on preemption)")
        pods = view.active + view.terminating
        if pods or not view.has("Suspended"):
            return Wait(round=r, phase="Cancelling", reason=stop.reason, lanes=view.lanes,
                        message=f"{stop.message}: waiting for {pods} worker pod(s) of Job {view.name} to drain")
    # Rounds 0..r: round r as far as it got (its unfinished shards count their rows not run).
    d = publishing(job, seen, r, partial=stop.phase)
    if isinstance(d, (PreparePublish, Publish, CreatePublishJob, Wait, RerunStep)):
        return dataclasses.replace(d, phase="Cancelling", reason=stop.reason,
                                   message=f"{stop.message}: {d.message} (partial)")
    return d
