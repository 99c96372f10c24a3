"""The storage work of the driver's steps, run in a pod of the bij's namespace (`bij-worker step ...`).

The operator speaks only to the Kubernetes API: planning a round (listing, Parquet footers,
fingerprint, owner claim, the round plan), a finished round's statistics (its completion and damage
records), the publish plan and the manifest all read or write the bij's storage, so each runs as a
one-pod Job of its own under the bij's worker service account and `spec.storage` credentials, the
identity the bij's rounds run with. What the driver needs back is small and goes through the bij's
status (`bij.worker.report`): ``status.reports.steps.<Job name>`` is a `StepReport` of the contract,
its result or the error it met under a stable code (`StepErrorCode`), which `reconcile.decide()` turns
into a decision. An expected failure (AccessDenied on the input, a plan refused) is reported and the
pod exits 0; anything else is reported as INTERNAL and the pod exits 1, so that its Job runs it again
(spec.workers.backoffLimitPerIndex times). A pod that cannot deliver its report says why in its
termination message, which the operator shows.

A step is idempotent, like the driver's steps were when they ran in the operator: a plan already
written is read, not rewritten; a manifest already published is read back.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

from bij.contract import layout
from bij.contract.canary import MOST_EXAMPLES, CanaryFigures, canary_shards
from bij.contract.efficiency import cost
from bij.contract.fingerprint import PlanRefused
from bij.contract.manifest import CostFigures, EfficiencyFigures, Manifest
from bij.contract.plan import Plan
from bij.contract.rounds import RoundSums
from bij.contract.spec import BatchInferenceJob, SpecError, parse_job
from bij.contract.step_report import StepError, StepErrorCode, StepReport
from bij.contract.step_results import (
    MOST_DAMAGED,
    CanaryExample,
    CanaryResult,
    FinishResult,
    FinishStats,
    ManifestSummary,
    PlanResult,
    PublishPlanResult,
    StepResult,
)
from bij.steps import publish_rows
from bij.steps.arenas import cap_malloc_arenas
from bij.steps.plan_input import PlanError
from bij.steps.planner import plan_round
from bij.steps.progress import Tally, damage_records, shard_records, stream_records
from bij.steps.publish import (
    ErrorRatioExceeded,
    PublishError,
    WorkFilesRemoved,
    finish_publish,
    prepare_publish,
    read_manifest,
)
from bij.storage import StorageError, StorageRefused, open_storage
from bij.storage.segments import ShardLog
from bij.worker.report import JOB_UID_ENV, POD_NAME_ENV, ReportError, put_with_retries, sink_from_env

log = logging.getLogger("bij.step")

KINDS = ("plan", "finish", "canary", "publish-plan", "manifest")
# Where a container's termination message goes (the kubelet shows it in the pod's status).
TERMINATION_LOG = "/dev/termination-log"

# The expected failures, most specific first: each is reported under its code, never by class name.
_CODES: tuple[tuple[type[BaseException], StepErrorCode], ...] = (
    (PlanRefused, StepErrorCode.PLAN_REFUSED),
    (StorageRefused, StepErrorCode.STORAGE_REFUSED),
    (ErrorRatioExceeded, StepErrorCode.TOO_MANY_ERRORS),
    (WorkFilesRemoved, StepErrorCode.WORK_FILES_REMOVED),
    (PlanError, StepErrorCode.PLAN_FAILED),
    (PublishError, StepErrorCode.PUBLISH_FAILED),
    (publish_rows.PublishPlanError, StepErrorCode.PUBLISH_FAILED),
    (StorageError, StepErrorCode.STORAGE_FAILED),
    (OSError, StepErrorCode.STORAGE_FAILED),
    (SpecError, StepErrorCode.INVALID_SPEC),
)


def run_step(kind: str, job: BatchInferenceJob, round_no: int, *, rounds: int = 0,
             plan_uri: str = "", partial: str | None = None) -> StepResult:
    """Do one step's storage work for `job` and return its small result (`contract.step_results`)."""
    if kind == "plan":
        plan = plan_round(job, round_no)
        return PlanResult(manifest_uri=plan.manifest_uri, shards=plan.shard_count, objects=plan.objects,
                          bytes=plan.total_bytes, unit=plan.unit, lanes=plan.lanes,
                          **({"canary_shards": plan.canary_shards} if plan.canary_shards else {}))
    if kind == "finish":
        return round_figures(job, round_no)
    if kind == "canary":
        return canary_figures(job, rounds)
    if kind == "publish-plan":
        try:
            uri, pplan = prepare_publish(job, rounds, partial=partial)
        except WorkFilesRemoved as e:
            # Published before the status said so (a restart in between): the manifest stands.
            found = read_manifest(job)
            if found is None:
                raise
            if e.removal is not None and e.removal.error is not None:
                found = found.model_copy(update={"work_files_removal": e.removal.as_result()})
            return PublishPlanResult(published=manifest_summary(found))
        return PublishPlanResult(plan_uri=uri, passes={p: pplan.count(p) for p in publish_rows.PASSES})
    if kind == "manifest":
        try:
            pplan = publish_rows.load(plan_uri, job.spec.storage.s3)
            manifest = finish_publish(job, rounds, pplan)
        except WorkFilesRemoved:
            # Published before the status said so (a restart in between): the manifest stands.
            found = read_manifest(job)
            if found is None:
                raise
            manifest = found
        return manifest_summary(manifest)
    raise ValueError(f"unknown step {kind!r}; expected one of {', '.join(KINDS)}")


def round_figures(job: BatchInferenceJob, round_no: int) -> FinishResult:
    """A round whose Job ended: how many shards are done, its statistics (what the judge and
    spec.maxErrorRatio decide on), the damaged objects its workers stopped at, and the efficiency and
    cost of rounds 0..round_no, all from the workers' records: time O(shards), memory flat."""
    # Streamed, READS_IN_FLIGHT reads at a time: memory holds running sums, never a round's records.
    every = Tally()  # rounds 0..round_no: efficiency, rows and tokens
    for r in range(round_no):
        every.add_all(stream_records(job, r))
    current = RoundSums()
    done = 0
    for index, rec in stream_records(job, round_no):
        every.add(index, rec)
        current.add(rec)
        done += 1
    eff = every.efficiency.result()
    rows, tokens = every.rows, every.tokens
    damaged = [rec.describe() for rec in damage_records(job, round_no) if rec.mode == "fail"]
    out: dict[str, Any] = {"done": done, "stats": FinishStats.of(current.stats(round_no, 0)),
                           "efficiency": EfficiencyFigures.model_validate(eff), "damaged": damaged[:MOST_DAMAGED],
                           "damaged_more": max(0, len(damaged) - MOST_DAMAGED)}
    spent = cost(job.spec.workers.price_per_hour, eff["workerSeconds"], rows, tokens, job.spec.workers.nodes_per_lane,
                 pool_prices=job.spec.workers.pool_prices, by_pool=eff.get("workerSecondsByPool"))
    if spent is not None:
        out["cost"] = CostFigures.model_validate(spent)
    return FinishResult(**out)


def canary_figures(job: BatchInferenceJob, shards: int) -> CanaryResult:
    """The canary's figures (its `shards` shards of round 0, `canary_shards`, from their completion records) and
    a few of its failing rows (id, code, message) read from their durable logs, for the verdict's message."""
    uri = layout.round_manifest_uri(job, 0)
    plan = Plan.from_json(open_storage(uri, job.spec.storage.s3).read_bytes(uri), f"round plan {uri}")
    ours = set(canary_shards(plan.shard_total, shards))
    records = {i: r for i, r in shard_records(job, 0).items() if i in ours}
    figures = CanaryFigures.of(records.values()).as_status()
    store = open_storage(layout.round_prefix(job, 0), job.spec.storage.s3)
    examples: list[CanaryExample] = []
    for i in sorted(records):
        if not records[i].get("errors"):
            continue
        for rec in ShardLog(store, layout.shard_prefix(layout.round_prefix(job, 0), i)).scan():
            if rec.get("kind") != "error":
                continue
            row = rec.get("row") or {}
            err = row.get("error") or {}
            rid = row.get("id", row.get("custom_id"))
            examples.append(CanaryExample(id=None if rid is None else str(rid), code=str(err.get("code") or ""),
                                          message=str(err.get("message") or "")[:300]))
            if len(examples) >= MOST_EXAMPLES:
                break
        if len(examples) >= MOST_EXAMPLES:
            break
    # Kept beside round 0, so that the manifest can say how far the estimate made from it was off.
    store.write_bytes(layout.canary_uri(job), json.dumps({**figures, "done": len(records)}).encode())
    return CanaryResult.model_validate({**figures, "done": len(records), "examples": examples})


def manifest_summary(manifest: Manifest) -> ManifestSummary:
    """What the operator says about a published manifest (counts, file count, damaged objects)."""
    return ManifestSummary.of(manifest)


def error_of(e: BaseException) -> StepError:
    """The error `e` as the contract names it: its code, message and whether a retry can help."""
    code = next((c for cls, c in _CODES if isinstance(e, cls)), StepErrorCode.INTERNAL)
    message = str(e) or type(e).__name__
    if code is StepErrorCode.INTERNAL:
        message = f"{type(e).__name__}: {message}"  # a bug: its type is part of what to report
    return StepError.of(code, message, permanent=bool(getattr(e, "permanent", False)))


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bij-worker step")
    p.add_argument("kind", choices=KINDS)
    p.add_argument("--job-spec", required=True, help="the BatchInferenceJob as JSON")
    p.add_argument("--key", required=True, help="the step Job's name: the key of its report")
    p.add_argument("--round", type=int, default=0)
    p.add_argument("--rounds", type=int, default=0)
    p.add_argument("--plan", default="", help="the publish plan's URI (manifest)")
    p.add_argument("--partial", choices=("Cancelled", "Expired"), default=None,
                   help="publish-plan of a stopped bij: publish what is durable (bij.control.stopping)")
    return p.parse_args(argv)


def step_report(args: argparse.Namespace, job_uid: str, pod: str = "") -> StepReport:
    """Run the step `args` name and return its report: its result, or the failure it met."""
    try:
        job = parse_job(json.loads(args.job_spec))
        result = run_step(args.kind, job, args.round, rounds=args.rounds, plan_uri=args.plan, partial=args.partial)
    except Exception as e:  # every failure is reported under its code; INTERNAL ones also fail the pod
        error = error_of(e)
        if error.code is StepErrorCode.INTERNAL:
            log.exception("step %s failed", args.kind)
        else:
            log.info("step %s: %s", args.kind, e)  # the driver says it (once) where the bij's messages go
        return StepReport(job_uid=job_uid, pod=pod, error=error)
    return StepReport(job_uid=job_uid, pod=pod, result=result.as_result())


def say_last_words(message: str, path: str = TERMINATION_LOG) -> None:
    """The container's termination message (the kubelet shows it in the pod's status); nowhere when
    there is no such file (a local run: the message is the last line of the log)."""
    log.error("%s", message)
    try:
        with open(path, "w") as f:
            f.write(message[:4000])
    except OSError:
        pass


def main(argv: list[str], env: Mapping[str, str] | None = None) -> int:
    """`bij-worker step KIND --job-spec JSON --key JOB_NAME [--round R] [--rounds N] [--plan URI]`: run one
    step and report its result (or the failure it met) into the bij's status. Exits 0 once the report
    of a result or an expected failure is delivered; 1 when it cannot be delivered, or the failure is
    INTERNAL (the pod is run again by its Job). `env`: the pod's environment (default this process's)."""
    env = os.environ if env is None else env
    args = parse_args(argv)
    cap_malloc_arenas()  # before the record readers start: their arenas would grow with the step's length
    try:
        sink = sink_from_env(env)
    except ReportError as e:
        log.error("%s", e)
        return 1
    if sink is None:
        say_last_words("nowhere to report the result: set BIJ_REPORT_TO (the step Job sets it)")
        return 1
    report = step_report(args, env.get(JOB_UID_ENV, ""), env.get(POD_NAME_ENV, ""))
    try:
        put_with_retries(sink, "steps", args.key, report.as_status())
    except ReportError as e:
        say_last_words(f"cannot report the result of step {args.kind}: {e}")
        return 1
    if report.error is not None and report.error.code is StepErrorCode.INTERNAL:
        say_last_words(report.error.message)
        return 1
    log.info("step %s: %s", args.kind, "failed" if report.error is not None else "done")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
