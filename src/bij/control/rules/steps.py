"""The step life cycle: one-pod Jobs that do the storage work, decided like rounds.

`step()` decides from a step's Job, its pods and its report: run it, wait, say a retry, retry a
passing failure (`expected_failure`), fail the bij naming the step, or record its ``result``, read
here into its kind's model (`contract.step_results`) and nowhere else.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Mapping
from typing import Any

from bij.contract.codes import GENERATION_LABEL
from bij.contract.spec import BatchInferenceJob
from bij.contract.step_report import StepError, StepErrorCode
from bij.contract.step_results import UnreadableResult, parse_result
from bij.control.decisions import (
    Decision,
    MarkFailed,
    PlanRound,
    PreparePublish,
    Publish,
    RerunStep,
    Retry,
    StepDecision,
    Wait,
)
from bij.control.observe import (
    JobView,
    Observation,
    PodEnd,
    failed_pods,
    is_ours,
    step_job_name,
    step_key,
    step_report,
    stuck_pods,
)

# An expected failure that time may fix (input still uploading, an outage) is tried again this long after it
# was reported; the operator retries it for as long as it lasts, `bij run` stops there (its exit code says).
STEP_RETRY_SECONDS = 30.0

# A running step is looked at again this often, though its Job does not change.
STEP_RECHECK = 30.0


# The retries a step Job was made with (its backoffLimitPerIndex), for the messages.
STEP_TRIES_ANNOTATION = "batchinference.io/step-retries"


# How long a failed step's Job waits for its failed pods to be seen before failing the bij without them.
POD_GRACE_SECONDS = 30.0


def step(job: BatchInferenceJob, seen: Observation, want: StepDecision) -> Decision:
    """`want` with its step's ``result`` once reported; until then what its step Job calls for: run it
    (`want` itself), wait, say a retry, retry a passing failure, or fail the bij saying why."""
    args = want.step_args()
    kind, round_no = args["kind"], args["round_no"]
    key = step_key(kind, round_no)
    name = step_job_name(job, kind, round_no)
    raw = next((j for j in seen.jobs if (j.get("metadata") or {}).get("name") == name), None)
    if raw is None:
        return want
    view = JobView.of(raw)
    if not is_ours(job, view):
        return Wait(round=want.round, phase=want.phase, reason="WaitingForOldJob", shards=want.shards,
                    message=f"step {key}: Job {name} belongs to an earlier object of this name, or is being "
                            "deleted; waiting for it to go")
    meta = raw.get("metadata") or {}
    report = step_report(seen.status, name, meta.get("uid"))
    if report is not None and report.result is not None:
        try:
            return dataclasses.replace(want, result=parse_result(kind, report.result))
        except UnreadableResult as e:
            # A result this operator cannot read (a pod of another bij version): said, never raised.
            return MarkFailed(round=want.round, phase="Failed", reason="StepFailed", event="StepFailed",
                              shards=want.shards,
                              message=f"step {kind} of round {round_no}: its result cannot be read ({e}); are "
                                      "the steps' image and the operator of one version?")
    error = report.error if report is not None else None
    if error is not None and error.code is not StepErrorCode.INTERNAL:
        made_for = (meta.get("labels") or {}).get(GENERATION_LABEL)
        if made_for is not None and made_for != str(seen.generation or 0):
            # Refused for a spec edited since: run the step again for this one.
            return RerunStep(round=want.round, phase=want.phase, reason=want.reason, shards=want.shards,
                             message=f"{want.message}: step {key} again, for the edited spec", job_name=name)
        return expected_failure(want, key, name, error.code, error.message, error.permanent,
                                reported_at=_finished_at(raw), now=seen.now)
    failed = failed_pods(name, seen.pods)
    job_status = raw.get("status") or {}
    # The Job controller counts a failed pod in two steps (uncountedTerminatedPods, then failed).
    counted = max(int(job_status.get("failed") or 0),
                  len((job_status.get("uncountedTerminatedPods") or {}).get("failed") or []))
    if view.failed_for_good:
        return _gave_up(job, seen, want, key=key, name=name, raw=raw, view=view, failed=failed, counted=counted,
                        error=error)
    if view.succeeded:
        # Reported before its pod exited 0, so the report is in a status read later than this Job.
        return Wait(round=want.round, phase=want.phase, reason=want.reason, shards=want.shards,
                    message=f"{want.message}: step {key} done, reading its report")
    return _not_ended(job, seen, want, key=key, name=name, raw=raw, failed=failed, counted=counted, error=error)


def _gave_up(job: BatchInferenceJob, seen: Observation, want: StepDecision, *, key: str, name: str,
             raw: Mapping[str, Any], view: JobView, failed: list[PodEnd], counted: int,
             error: StepError | None) -> Decision:
    """The step's Job failed for good: fail the bij naming the step, its last failed pod and the cause (once its
    pods were seen, or `POD_GRACE_SECONDS` passed)."""
    gave_up = _condition_time(raw, ("Failed", "FailureTarget"))
    if not failed and gave_up is not None and (seen.now - gave_up).total_seconds() < POD_GRACE_SECONDS:
        # Its pods say why; they may not have been seen yet.
        return Wait(round=want.round, phase=want.phase, reason="StepFailing", shards=want.shards,
                    recheck=2.0, message=f"{want.message}: step {key} failed; reading why from its pods")
    cause = failed[-1].describe() if failed else (f"{view.failure.reason}: {view.failure.message}"
                                                  if view.failure else "its Job failed")
    if error is not None:
        cause += f"; it reported {error.message}"
    pods = max(len(failed), counted, 1)
    return MarkFailed(round=want.round, phase="Failed", reason="StepFailed", event="StepFailed",
                      shards=want.shards,
                      message=f"step {key} failed {pods} time(s), giving up (spec.workers.backoffLimitPerIndex "
                              f"{job.spec.workers.backoff_limit_per_index}); Job {name}, last {cause}")


def _not_ended(job: BatchInferenceJob, seen: Observation, want: StepDecision, *, key: str, name: str,
               raw: Mapping[str, Any], failed: list[PodEnd], counted: int, error: StepError | None) -> Wait:
    """The step's Job has not ended: its pod cannot start, failed and runs again, or is working."""
    meta = raw.get("metadata") or {}
    tries = int((meta.get("annotations") or {}).get(STEP_TRIES_ANNOTATION) or 0) or None
    stuck = stuck_pods(name, seen.pods)
    if stuck:
        p = stuck[-1]
        return Wait(round=want.round, phase=want.phase, reason="StepCannotStart", shards=want.shards,
                    warning="StepCannotStart",
                    message=f"{want.message}: step {key} cannot start; Job {name}, pod {p.pod}: {p.reason}"
                            + (f": {p.message}" if p.message else "")
                            + " (the chart value stepsImage names the steps' image)", recheck=STEP_RECHECK)
    pods_failed = max(len(failed), counted)
    if pods_failed:
        limit = tries or job.spec.workers.backoff_limit_per_index
        cause = failed[-1].describe() if failed else "its pod failed"
        if error is not None:
            cause += f"; it reported {error.message}"
        return Wait(round=want.round, phase=want.phase, reason="StepRetrying", shards=want.shards,
                    warning="StepRetrying",
                    message=f"{want.message}: step {key} failed (attempt {pods_failed} of {limit + 1}), running "
                            f"it again; Job {name}, {cause}")
    # Looked at again now and then: a pod that cannot start (an image not pulled) changes no Job.
    return Wait(round=want.round, phase=want.phase, reason=want.reason, shards=want.shards, recheck=STEP_RECHECK,
                message=f"{want.message} (step Job {name})")


def _condition_time(raw: Mapping[str, Any], types: tuple[str, ...]) -> dt.datetime | None:
    """When the first of `types` that holds on Job `raw` became true."""
    for c in (raw.get("status") or {}).get("conditions") or []:
        if c.get("type") in types and str(c.get("status")) == "True" and c.get("lastTransitionTime"):
            try:
                return dt.datetime.fromisoformat(str(c["lastTransitionTime"]).replace("Z", "+00:00"))
            except ValueError:
                return None
    return None


def _finished_at(raw: Mapping[str, Any]) -> dt.datetime | None:
    text = (raw.get("status") or {}).get("completionTime")
    if not text:
        for c in (raw.get("status") or {}).get("conditions") or []:
            if c.get("type") == "Complete" and c.get("lastTransitionTime"):
                text = c["lastTransitionTime"]
    try:
        return dt.datetime.fromisoformat(str(text).replace("Z", "+00:00")) if text else None
    except ValueError:
        return None


def expected_failure(want: StepDecision, key: str, name: str, code: StepErrorCode, message: str, permanent: bool,
                     *, reported_at: dt.datetime | None, now: dt.datetime) -> Decision:
    """What an expected failure a step reported means: MarkFailed when only a change of the spec (or
    of grants) can help; a Retry after `STEP_RETRY_SECONDS` when time may (the step Job is deleted then,
    and runs anew)."""
    r = want.round
    is_plan, is_publish = isinstance(want, PlanRound), isinstance(want, (PreparePublish, Publish))
    if code is StepErrorCode.PLAN_REFUSED:
        # Another job owns the output, the URIs overlap, or what is there was made from another spec
        # or input: a retry cannot help, a spec edit may (the phase is not final).
        return MarkFailed(round=r, phase="Failed", reason="PlanRefused", message=message, event="PlanRefused")
    if code is StepErrorCode.STORAGE_REFUSED:
        # Denied access, a missing bucket, wrong credentials: the same on every retry until someone changes the
        # grants, the bucket or the credentials; the message names the URI and the access key id.
        what = f"cannot plan round {r}" if is_plan else "publish failed" if is_publish else f"round {r}"
        return MarkFailed(round=r, phase="Failed", reason="StorageRefused", message=f"{what}: {message}",
                          event="StorageRefused")
    if code in (StepErrorCode.TOO_MANY_ERRORS, StepErrorCode.WORK_FILES_REMOVED, StepErrorCode.INVALID_SPEC):
        return MarkFailed(round=r, phase="Failed", reason=code.value, message=f"step {key}: {message}"
                          if code is StepErrorCode.INVALID_SPEC else message, event=code.value)
    if is_plan:
        reason, text = "PlanFailed", f"cannot plan round {r}: {message}"
    elif is_publish:
        reason, text = "PublishFailed", f"publish failed: {message}"
    else:
        reason, text = "StorageFailed", f"round {r}: {message}"
    waited = (now - reported_at).total_seconds() if reported_at is not None else 0.0
    if waited >= STEP_RETRY_SECONDS:
        return RerunStep(round=r, phase=want.phase, reason=reason, message=text, shards=want.shards, job_name=name)
    return Retry(round=r, phase=want.phase, reason=reason, message=text, shards=want.shards,
                 delay=STEP_RETRY_SECONDS - waited, permanent=permanent)
