"""Publishing: the publish plan, one Job per pass in order, then the manifest (`publishing`)."""

from __future__ import annotations

from bij.contract.publish_plan import PASSES as PUBLISH_PASSES
from bij.contract.spec import BatchInferenceJob
from bij.control.decisions import (
    CreatePublishJob,
    Decision,
    MarkFailed,
    PreparePublish,
    Publish,
    Wait,
)
from bij.control.observe import (
    Observation,
    is_ours,
    publish_job,
)
from bij.control.rules.steps import step


def publishing(job: BatchInferenceJob, seen: Observation, r: int, partial: str | None = None) -> Decision:
    """The next publishing step: plan it, then one Job per pass in order, then the manifest.

    The passes' row-level work (duplicate ids across shards, result/error files) runs in the pods of
    the pass Jobs, in bounded memory; its plan and the manifest (from per-shard summaries) are storage
    steps in Jobs of their own (`steps`), so the operator's own work grows with shards, never with rows.
    """
    rounds = r + 1
    observed_jobs = seen.jobs
    rec = seen.state.publish
    if rec is None or rec.rounds != rounds or not rec.plan_uri or rec.passes is None:
        return step(job, seen, PreparePublish(round=r, phase="Publishing", reason="Publishing", partial=partial,
                                              message=f"publishing {rounds} round(s): planning the publish passes",
                                              rounds=rounds))
    for pass_name in PUBLISH_PASSES:
        count = rec.passes.get(pass_name) or 0
        if count == 0:
            continue
        view = publish_job(job, pass_name, observed_jobs)
        if view is None:
            pods = min(job.spec.workers.parallelism, count)
            return CreatePublishJob(round=r, phase="Publishing", reason="Publishing",
                                    message=f"publishing: pass {pass_name}, {count} indexes in {pods} pods",
                                    rounds=rounds, pass_name=pass_name, completions=pods,
                                    plan_uri=rec.plan_uri)
        if not is_ours(job, view):
            return Wait(round=r, phase="Publishing", reason="WaitingForOldJob",
                        message=f"Job {view.name} belongs to an earlier object of this name; "
                                "waiting for it to be deleted")
        if view.failed_for_good:
            cond = view.failure
            detail = f": {cond.reason}" + (f" ({cond.message})" if cond.message else "") if cond else ""
            return MarkFailed(round=r, phase="Failed", reason="PublishFailed",
                              message=f"publish pass {pass_name} failed; Job {view.name}{detail}")
        if not view.succeeded:
            lanes = view.lanes
            return Wait(round=r, phase="Publishing", reason="Publishing",
                        message=f"publishing: pass {pass_name}, {lanes.done}/{lanes.total} pods done")
    return step(job, seen, Publish(round=r, phase="Publishing", reason="Publishing", partial=partial,
                                   message=f"publishing the manifest of {rounds} round(s)", rounds=rounds,
                                   plan_uri=rec.plan_uri))
