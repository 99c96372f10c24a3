"""spec.canary: round 0's canary shards run alone first, are counted, and pass or fail the bij
(`canary_gate`, `canary_verdict`) before round 0's own Job runs."""

from __future__ import annotations

from bij.contract.canary import broken, describe_estimate, estimate
from bij.contract.round_record import RoundRecord
from bij.contract.spec import BatchInferenceJob
from bij.contract.step_results import CanaryResult
from bij.control.decisions import (
    CanaryVerdict,
    CheckCanary,
    CreateCanaryJob,
    Decision,
    PatchJob,
    Wait,
)
from bij.control.observe import (
    Observation,
    Shards,
    canary_job,
    is_ours,
)
from bij.control.rules.rounds import job_failed
from bij.control.rules.steps import step


def canary_gate(job: BatchInferenceJob, seen: Observation, rec: RoundRecord,
                shards_done: int | None) -> Decision | None:
    """Round 0 with spec.canary, before its own Job: run the canary's shards alone, count them, and decide
    (`canary_verdict`). None once it passed: the round goes on, its Job skipping the shards already done."""
    canary = seen.state.canary
    if canary is not None and canary.verdict == "Passed":
        return None
    k = rec.canary_shards
    shards = Shards(done=min(shards_done, k), total=k) if shards_done is not None else None
    view = canary_job(job, seen.jobs)
    if view is None:
        lanes = min(rec.lanes or k, k)
        return CreateCanaryJob(round=0, phase="Running", reason="CanaryStarting", completions=lanes,
                               canary_shards=k, shards=shards or Shards(done=0, total=k),
                               message=f"canary: creating its Job for {k} of the {rec.shards} shards of "
                                       f"round 0 in {lanes} lanes")
    if not is_ours(job, view):
        return Wait(round=0, phase="Pending", reason="WaitingForOldJob",
                    message=f"Job {view.name} belongs to an earlier object of this name; waiting for it to be deleted")
    if not (view.succeeded or view.failed_for_good):
        # spec.suspend holds the canary as it holds a round; a Job Kueue queues is never unsuspended here.
        want = job.spec.suspend
        patch = True if want and not view.suspend else \
            False if not want and view.suspend and not job.spec.workers.queue_name else None
        if patch is not None:
            return PatchJob(round=0, phase="Suspended" if want else "Running", reason="Suspended" if want else "Canary",
                            shards=shards, lanes=view.lanes, job_name=view.name, suspend=patch,
                            message=f"canary: {'suspending' if want else 'resuming'} Job {view.name}")
        if view.suspend:
            return Wait(round=0, phase="Suspended" if want else "Pending", reason="Suspended" if want else "Queued",
                        shards=shards, lanes=view.lanes, message=f"canary: Job {view.name} is suspended")
        return Wait(round=0, phase="Running", reason="Canary", shards=shards, lanes=view.lanes,
                    message=f"canary: {shards.summary + ' shards done, ' if shards else ''}"
                            f"{view.lanes.done}/{view.lanes.total} lanes done, {view.active} active")
    counted = step(job, seen, CheckCanary(round=0, phase="Running", reason="CanaryChecking", canary_shards=k,
                                          lanes=view.lanes, message=f"canary: Job {view.name} ended; counting its "
                                                                    f"{k} shards"))
    if not isinstance(counted, CheckCanary) or counted.result is None:
        return counted
    done = counted.result.done
    if done < k or (view.failure is not None and view.failure.reason == "PodFailurePolicy"):
        # Lanes failed with canary shards left, or a worker said the configuration is bad (exit 42).
        return job_failed(0, view, Shards(done=done, total=k))
    return canary_verdict(job, rec, counted.result)


def canary_verdict(job: BatchInferenceJob, rec: RoundRecord, result: CanaryResult) -> CanaryVerdict:
    """The canary's figures (the canary step's `result`) against spec.canary's thresholds, and the estimate of
    round 0 whole at its pace."""
    spec = job.spec.canary
    assert spec is not None
    figures = result.figures()
    failures = broken(spec, figures)
    w = job.spec.workers
    est = estimate(figures, rec.bytes, min(rec.lanes or 1, w.parallelism), w.price_per_hour, w.nodes_per_lane)
    examples = [e.as_result() for e in result.examples]
    canary = {**figures.as_status(), "verdict": "Failed" if failures else "Passed", "broken": failures,
              "examples": examples, "estimate": est}
    canary.pop("bytes", None)
    said = (f"canary ({figures.rows_in} rows in {figures.shards} shards: {figures.errors} errors, "
            f"{figures.length_cuts} cut at maxTokens, {figures.schema_violations} schema violations, "
            f"{figures.tokens_per_second_per_lane:,.1f} output tokens/s per lane)")
    if failures:
        shown = "; ".join(f"id {e.get('id')}: {e.get('code')}: {e.get('message')}" for e in examples)
        return CanaryVerdict(round=0, phase="CanaryFailed", reason="CanaryFailed", passed=False, canary=canary,
                             shards=Shards(done=figures.shards, total=rec.shards),
                             message=f"{said} failed: {'; '.join(failures)}"
                                     + (f". Failing rows: {shown}" if shown else "")
                                     + ". Nothing more ran and nothing was published; the canary's rows stay "
                                       "under the output (bij run --restart, or a new spec.output.uri, to start "
                                       "over with a changed spec)")
    return CanaryVerdict(round=0, phase="Running", reason="CanaryPassed", passed=True, canary=canary,
                         shards=Shards(done=figures.shards, total=rec.shards),
                         message=f"{said} passed; round 0 whole: {describe_estimate(est)}")
