"""The one driver of a BatchInferenceJob, for the operator and for `bij run` alike.

`Driver.reconcile()` observes the bij through a `Backend`, asks `reconcile.decide()` for the
next step, applies it, and asks again until the answer is to wait. What a step does to the
world goes through the backend; everything else — planning, the status fields and messages,
Events, what a failed step means — is written once, here and in the pure core, so the operator
and `bij run` take the same decisions in the same order.

The driver reads and writes no storage. What touches the bij's data (planning a round, a finished
round's statistics, the publish plan, the manifest) is a step (`steps`) run as a one-pod Job in the
bij's namespace under its identity, like the round and publish Jobs; each step pod reports its small
result into the bij's status (`bij.worker.report`), where the driver reads it with the bij itself, and
each lane its progress into a Lease of its own, which the backend sums (`Observed.lanes`). Whether a
step runs, waits, is retried or failed is decided by `reconcile.decide()` from its Job, its pods and
its report, as a round is: the driver only creates and deletes step Jobs and records their results.

Backends:

- `backend.KubeBackend`: the Kubernetes API (status subresource, batch/v1 Jobs owned by the
  bij, Events), driven by one kopf daemon per bij.
- `local.LocalBackend`: `bij run` on one machine; status kept in memory, Jobs run as local
  processes with `JOB_COMPLETION_INDEX` by a small Indexed Job controller, Events printed.

Every step is idempotent (deterministic Job names, "exists" means an earlier attempt did it,
planning and publishing rewrite nothing), so a driver stopped anywhere continues where it
stopped when asked again.

`Driver` is the one class; its parts, by what they do, are mixins beside this module: what it works with
(`driver_types`: `Observed`, `Backend`, `Idle`), the status it writes (`driver_status`), its Jobs and
storage steps (`driver_steps`), publishing (`driver_publish`), failures (`driver_failures`) and
spec.notify (`driver_notify`). Here: the loop, and the decisions of rounds, the canary and waiting.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from bij.contract import layout
from bij.contract.fingerprint import field_digests
from bij.contract.round_record import RoundRecord
from bij.contract.spec import BatchInferenceJob
from bij.contract.status import Canary, Rows, Shards, StatusPatch
from bij.contract.step_results import FinishResult
from bij.control import notify
from bij.control.decisions import (
    STOPPED_PHASES,
    TERMINAL_PHASES,
    CanaryVerdict,
    CheckPermissions,
    CreateCanaryJob,
    CreateJob,
    CreatePublishJob,
    Decision,
    FinishRound,
    MarkFailed,
    MovePoolLanes,
    Nothing,
    PatchJob,
    PlanRound,
    PreparePublish,
    Publish,
    RerunStep,
    Retry,
    StepDecision,
    StopHeld,
    Wait,
)
from bij.control.driver_failures import FailureMixin
from bij.control.driver_notify import NotifyMixin
from bij.control.driver_publish import PublishMixin
from bij.control.driver_steps import CONFLICT_RECHECK
from bij.control.driver_types import Backend, Idle, Observed
from bij.control.jobs import render_canary_job, render_job, render_lane_service
from bij.control.observe import format_ranges
from bij.control.permissions import CONDITION as PERMISSIONS_CONDITION
from bij.control.permissions import GrantCheck, condition, record
from bij.control.reconcile import decide
from bij.control.status import (
    fmt_time,
    now_utc,
    status_differs,
    with_condition,
    with_phase_conditions,
)
from bij.control.stopping import seconds_left

log = logging.getLogger("bij.driver")

# Progress-only status writes (shard counts, rows) at most this often; phase changes and actions
# are written at once.
STATUS_INTERVAL = 5.0
# While a round runs, its rows are refreshed from the lanes' reports this often.
PROGRESS_INTERVAL = 30.0
# Steps applied per reconcile before yielding; a whole run takes about ten.
MAX_STEPS = 16
# A step Job deleted to run anew, or one that succeeded before its report shows in the status read:
# look again this soon.
REPORT_RECHECK = 1.0


class Driver(PublishMixin, NotifyMixin, FailureMixin):
    """Steps one bij forward through a backend. One driver per bij; not shared between threads.

    ``worker_grants``: where the bij's pods run under RBAC (the operator), asks the API server whether its
    worker service account holds every grant its pods use (`access_review.check_grants`); `decide()` then
    checks before the first pod. None (`bij run`: local processes, no RBAC): never checked."""

    def __init__(self, backend: Backend, *, status_interval: float = STATUS_INTERVAL,
                 progress_interval: float = PROGRESS_INTERVAL,
                 on_decision: Callable[[Decision], None] | None = None,
                 worker_grants: Callable[[str], GrantCheck] | None = None,
                 notify_backoff: notify.Backoff = notify.BACKOFF,
                 send: Callable[[str, bytes, Mapping[str, str], float], str | None] = notify.post):
        self.backend = backend
        # spec.notify: how often its webhooks are tried, and how a POST is made (`notify.post`).
        self.notify_backoff = notify_backoff
        self.send = send
        self.status_interval = status_interval
        self.progress_interval = progress_interval
        self.on_decision = on_decision
        self.worker_grants = worker_grants
        self.last_progress = 0.0

    # --- the loop -------------------------------------------------------------------------------

    def reconcile(self) -> Idle:
        """Bring the bij forward as far as it can go now. Safe to call any time, any number of times."""
        last: Decision | None = None
        for _ in range(MAX_STEPS):
            seen = self.backend.observe()
            if seen is None:
                return Idle(None, gone=True)
            if seen.job is None:
                assert seen.spec_error is not None
                self.mark_invalid(seen, seen.spec_error)
                return Idle(None)
            job = seen.job
            if self.say_damage(seen, seen.state):
                continue  # the damaged entries are named (and a damaged condition dropped): look again
            now = now_utc()
            last = decide(job, seen.status, seen.jobs, self.shards_done(seen), lanes_reported=seen.lanes, now=now,
                          pods=seen.pods, generation=seen.generation,
                          check_permissions=self.worker_grants is not None)
            log.debug("%s/%s: %s", job.metadata.namespace, job.metadata.name, last)
            if self.on_decision is not None:
                self.on_decision(last)
            idle = self.apply(seen, job, last)
            if idle is not None:
                if job.spec.notify and idle.decision is not None and idle.decision.phase in TERMINAL_PHASES:
                    idle = self.notify_ended(job, idle)
                return until_deadline(idle, job, seen.status, now)
        log.warning("%s: still changing after %d steps; continuing shortly", last, MAX_STEPS)
        return Idle(last, recheck=1.0)

    def apply(self, seen: Observed, job: BatchInferenceJob, d: Decision) -> Idle | None:
        """Apply one decision: None when the loop should ask again (something changed), else where
        to stop."""
        try:
            return self._apply(seen, job, d)
        except ValueError as e:
            if not isinstance(d, (CreateJob, CreatePublishJob)):
                raise
            # The Job cannot be made from this spec (more lanes than an Indexed Job may have): only a spec
            # change helps.
            failed = MarkFailed(round=d.round, phase="Failed", reason="CannotCreateJob",
                                message=f"round {d.round}: {e}", shards=d.shards, event="CannotCreateJob")
            return self.apply_failure(seen, failed, job)

    def _apply(self, seen: Observed, job: BatchInferenceJob, d: Decision) -> Idle | None:
        """What one decision does to the world and the status: a step without its result runs its pod
        first; every other decision has its method below."""
        now = now_utc()
        if isinstance(d, StepDecision) and d.result is None:
            return self.run_step(seen, job, d)
        match d:
            case CheckPermissions():
                self.check_permissions(seen, d, now)
                return None
            case RerunStep():
                self.backend.delete_job(d.job_name)
                self.write_status(seen, self.base(seen, d, now, d.message))
                return Idle(d, recheck=REPORT_RECHECK)  # once its Job is gone, the step is made anew
            case PlanRound():
                return self._plan_round(seen, job, d, now)
            case CreateJob():
                return self._create_round_job(seen, job, d, now)
            case CreateCanaryJob():
                return self._create_canary_job(seen, job, d, now)
            case CanaryVerdict():
                return self._canary_verdict(seen, d, now)
            case PatchJob():
                return self._patch_round_job(seen, job, d, now)
            case MovePoolLanes():
                return self._move_pool_lanes(seen, d, now)
            case FinishRound():
                return self._finish_round(seen, job, d, now)
            case PreparePublish():
                return self._prepare_publish(seen, job, d, now)
            case CreatePublishJob():
                return self._create_publish_job(seen, job, d, now)
            case Publish():
                assert d.result is not None
                return self.published(seen, job, d, d.result)
            case MarkFailed() | Retry():
                return self.apply_failure(seen, d, job)
            case StopHeld():
                return self._stop_held(seen, job, d, now)
            case Nothing():
                return self._nothing(seen, job, d, now)
            case Wait():
                return self._wait(seen, d, now)
        raise AssertionError(f"a decision the driver cannot apply: {d!r}")

    def _plan_round(self, seen: Observed, job: BatchInferenceJob, d: PlanRound, now: dt.datetime) -> Idle | None:
        """The plan step's result: the round's record in status.rounds, its shard count, a RoundPlanned Event."""
        got = d.result
        assert got is not None
        shards, lanes, size = got.shards, got.lanes, got.bytes
        canary = got.canary_shards
        rec = RoundRecord(round=d.round, shards=shards, lanes=lanes, bytes=size, start_time=fmt_time(now))
        if d.round == 0:
            rec = rec.model_copy(update={"spec_digests": field_digests(job)})  # decide() refuses a later edit
        if canary:
            rec = rec.model_copy(update={"canary_shards": canary})
        rounds = [r for r in seen.state.rounds if r.round != d.round] + [rec]
        msg = (f"round {d.round}: planned {shards} shards in {lanes} lanes from {got.objects} "
               f"input objects ({size:,} {got.unit or 'bytes'})"
               + (f"; the canary runs {canary} of them, spread over the input, alone first" if canary else ""))
        patch = self.base(seen, d, now, msg)
        patch.rounds, patch.shards, patch.shards_summary = rounds, Shards(done=0, total=shards), f"0/{shards}"
        if "rows" not in seen.status:
            patch.rows = Rows(done=0, failed=0)  # so the ROWS column reads 0, not <none>
        self.write_status(seen, patch, event=("Normal", "RoundPlanned", msg))
        return None

    def _create_round_job(self, seen: Observed, job: BatchInferenceJob, d: CreateJob, now: dt.datetime) -> Idle | None:
        """The round's Indexed Job (after the headless Service of its lanes of several pods)."""
        if job.spec.workers.nodes_per_lane > 1:
            # Before the Job: a lane's members find its leader by the name this Service gives it.
            self.backend.create_service(render_lane_service(job, owner_uid=job.metadata.uid))
        pool = next((p for p in job.spec.workers.pools if p.name == d.pool), None)
        body = render_job(job, d.round, d.completions, layout.round_manifest_uri(job, d.round),
                          image=self.backend.worker_image, owner_uid=job.metadata.uid,
                          file_volume=self.backend.file_volume, pool=pool, name_suffix=d.name_suffix,
                          lane_offset=d.lane_offset)
        created = self.create_job(seen, d, body, f"round {d.round}", "Pending")
        if created == "foreign":
            return Idle(d, recheck=CONFLICT_RECHECK)
        spec = body["spec"]
        msg = (f"round {d.round}: created Job {body['metadata']['name']} with {d.completions} lanes for "
               f"{d.shards.total if d.shards else '?'} shards, parallelism {spec['parallelism']}"
               + (f", in pool {pool.name} (lanes from {d.lane_offset})" if pool is not None else "")
               + (", suspended" if spec.get("suspend") else ""))
        self.write_status(seen, self.base(seen, d, now, msg),
                          event=("Normal", "RoundStarted", msg) if created == "created" else None)
        return None

    def _create_canary_job(self, seen: Observed, job: BatchInferenceJob, d: CreateCanaryJob,
                           now: dt.datetime) -> Idle | None:
        """Round 0's canary Job (spec.canary): its lanes work the canary's shards only (`canary_shards`)."""
        body = render_canary_job(job, d.completions, d.canary_shards, layout.round_manifest_uri(job, 0),
                                 image=self.backend.worker_image, owner_uid=job.metadata.uid,
                                 file_volume=self.backend.file_volume)
        created = self.create_job(seen, d, body, "canary", "Running")
        if created == "foreign":
            return Idle(d, recheck=CONFLICT_RECHECK)
        msg = f"canary: created Job {body['metadata']['name']} with {d.completions} lanes for " \
              f"{d.canary_shards} shards of round 0, spread over the input"
        patch = self.base(seen, d, now, msg)
        patch.canary = Canary(shards=d.canary_shards)
        self.write_status(seen, patch, event=("Normal", "CanaryStarted", msg) if created == "created" else None)
        return None

    def _canary_verdict(self, seen: Observed, d: CanaryVerdict, now: dt.datetime) -> Idle | None:
        """The canary's figures, verdict and estimate in ``status.canary``, the Canary condition and an Event;
        CanaryFailed is final (`decide()` says Nothing from then on)."""
        patch = self.base(seen, d, now, d.message)
        patch.canary = Canary.model_validate(d.canary)
        patch.conditions = with_condition(patch.conditions or [], "Canary", d.passed, d.reason, d.message,
                                          generation=seen.generation, now=now)
        self.write_status(seen, patch, event=("Normal" if d.passed else "Warning", d.reason, d.message))
        # Passed: stop here and ask again at once, so that `bij run --canary-only` sees the verdict before the
        # round's own Job is made.
        return Idle(d, recheck=0.01) if d.passed else Idle(d)

    def _patch_round_job(self, seen: Observed, job: BatchInferenceJob, d: PatchJob, now: dt.datetime) -> Idle | None:
        """Suspend, resume or scale the round's Job; cancelling suspends it so its lanes drain."""
        job_spec: dict[str, Any] = {}
        if d.suspend is not None:
            job_spec["suspend"] = d.suspend
        if d.parallelism is not None:
            job_spec["parallelism"] = d.parallelism
        self.backend.patch_job(d.job_name, job_spec)
        reason = {True: "Suspended", False: "Resumed", None: "Scaled"}[d.suspend]
        if d.phase == "Cancelling":
            reason = d.reason
        what = {True: "suspended (durable work is kept)", False: "resumed",
                None: f"parallelism set to {d.parallelism}"}[d.suspend]
        msg = d.message if d.phase == "Cancelling" else f"round {d.round}: Job {d.job_name} {what}"
        self.write_status(seen, self.base(seen, d, now, msg), event=("Normal", reason, msg))
        return None

    def _move_pool_lanes(self, seen: Observed, d: MovePoolLanes, now: dt.datetime) -> Idle | None:
        """A pool gave its lanes up: said in the status first (so a restart never brings them back), then its
        Jobs deleted; `decide()` creates the lanes in the next pool."""
        first = not any(p.name == d.pool and p.gave_up_round == d.round for p in seen.state.pools)
        self.write_status(seen, self.base(seen, d, now, d.message),
                          event=("Warning", "PoolGaveUp", d.message) if first else None)
        for name in d.job_names:
            self.backend.delete_job(name)
        return None

    def _finish_round(self, seen: Observed, job: BatchInferenceJob, d: FinishRound, now: dt.datetime) -> Idle | None:
        """The round-statistics step's result: the round's record completed (its lanes' reports, in their
        Leases, are no longer read: they go with the round's Job)."""
        end = d.result or FinishResult()
        this = seen.state.round_records().get(d.round)
        planned = this.shards if this is not None else 0
        stats = end.stats.stats(d.round, planned)
        done = {**stats.as_fields(), "completion_time": fmt_time(now)}
        if d.lanes is not None and d.lanes.replaced:
            done["groups_replaced"] = d.lanes.replaced  # its lanes' reports are read no more
        rounds = [r.model_copy(update=done) if r.round == d.round else r for r in seen.state.rounds]
        msg = f"round {d.round} finished: {d.shards.summary if d.shards else '0/0'} shards, " \
              f"{stats.approved} rows, {stats.errors} error rows"
        if job.spec.judge is not None:
            msg += f", {stats.rejected} rejected, {stats.capped} capped (approval {stats.approval_rate:.1%})"
        if d.failed_lanes:
            noun = "lane" if len(d.failed_lanes) == 1 else "lanes"
            msg += f"; {noun} {format_ranges(d.failed_lanes)} failed, the other lanes finished their shards"
        if d.lanes is not None and d.lanes.replaced:
            msg += f"; lane groups replaced: {d.lanes.replaced}"
        patch = self.base(seen, d, now, msg).updated(self.progress(seen, d.round, now, ended=stats))
        patch.rounds = rounds
        if "efficiency" in end.model_fields_set:
            patch.efficiency = end.efficiency
        if "cost" in end.model_fields_set:
            patch.cost = end.cost
        self.write_status(seen, patch, event=("Normal", "RoundFinished", msg))
        return None

    def _stop_held(self, seen: Observed, job: BatchInferenceJob, d: StopHeld, now: dt.datetime) -> Idle | None:
        """Cancelled or expired before anything ran: said once, and not Ready (there is no manifest)."""
        if d.job_name:
            self.backend.delete_job(d.job_name)
        patch = self.base(seen, d, now, d.message)
        patch.conditions = with_condition(patch.conditions or [], "Ready", False, d.reason, d.message,
                                          generation=seen.generation, now=now)
        self.write_status(seen, patch, event=("Normal", d.phase, d.message))
        return Idle(d)

    def _nothing(self, seen: Observed, job: BatchInferenceJob, d: Nothing, now: dt.datetime) -> Idle | None:
        """Finished: only observedGeneration and the conditions kept current after spec edits (a bij stopped
        before anything ran published nothing: it stays not Ready)."""
        unpublished = d.phase in STOPPED_PHASES and not seen.state.manifest_uri
        patch = StatusPatch(observed_generation=seen.generation,
                            conditions=with_phase_conditions(seen.state.conditions, d.phase, d.reason, d.message,
                                                             generation=seen.generation, now=now,
                                                             ready=False if unpublished else None))
        self.write_status(seen, patch)
        return Idle(d)

    def _wait(self, seen: Observed, d: Wait, now: dt.datetime) -> Idle:
        """Nothing to do but wait: progress written at most once a status interval, a warning at once."""
        status, state = seen.status, seen.state
        patch = self.base(seen, d, now, d.message)
        phase_changed = state.phase != d.phase or state.round != d.round
        if d.warning and state.message != d.message:
            # A step's pod failed and its Job runs it again: said at once, once.
            self.write_status(seen, patch, event=("Warning", d.warning, d.message))
            return Idle(d, recheck=d.recheck)
        recheck = d.recheck or (self.progress_interval if d.phase == "Running" else None)
        # The rows the lanes reported count as a change too: a lane can commit many chunks of one shard
        # while the decision (shards, lanes, message) stays the same.
        progress = self.progress(seen, d.round, now)
        if not status_differs(status, patch.updated(progress, leave=("rows_per_second", "eta")).as_patch()) \
                and not phase_changed:
            return Idle(d, recheck=recheck)
        wait = self.last_progress + self.status_interval - time.monotonic()
        if not phase_changed and wait > 0:
            # Progress only: write it at the end of the interval, once, whatever happens meanwhile.
            return Idle(d, recheck=wait)
        patch = patch.updated(progress)
        self.last_progress = time.monotonic()
        self.write_status(seen, patch)
        return Idle(d, recheck=recheck)

    # --- the worker identity's grants (where pods run under RBAC) ---------------------------------

    def check_permissions(self, seen: Observed, d: CheckPermissions, now: Any) -> None:
        """Ask whether the worker identity holds its grants; record the answer (``status.workerPermissions``,
        the WorkerPermissions Condition) and say it in an Event when it changed. `decide()` takes it from there."""
        assert self.worker_grants is not None  # decided only where grants are checked
        check = self.worker_grants(d.service_account)
        previous = seen.state.worker_permissions
        rec = record(check, previous, fmt_time(now))
        truth, reason, message = condition(check)
        patch = self.base(seen, d, now, d.message)
        patch.worker_permissions = rec
        patch.conditions = with_condition(patch.conditions or [], PERMISSIONS_CONDITION, truth, reason, message,
                                          generation=seen.generation, now=now)
        was = (previous.service_account, previous.result, previous.missing) if previous is not None else None
        event: tuple[str, str, str] | None = None
        if was != (rec.service_account, rec.result, rec.missing):
            if check.result == "Missing":
                event = ("Warning", "MissingPermissions", message)
            elif check.result == "Unknown":
                event = ("Warning", "PermissionsNotChecked", message)
            elif previous is not None and previous.result == "Missing":
                event = ("Normal", "PermissionsGranted", f"{message}: the bij goes on")
        log.info("worker grants of %s: %s", check.user, check.result)
        self.write_status(seen, patch, event=event)


def until_deadline(idle: Idle, job: BatchInferenceJob, status: Mapping[str, Any], now: Any) -> Idle:
    """`idle`, asked again no later than spec.deadlineSeconds runs out (so an idle bij still expires)."""
    if idle.gone or status.get("phase") in TERMINAL_PHASES:
        return idle
    left = seconds_left(job, status, now)
    # Once it has passed the bij is stopping, and its Jobs' changes wake the driver.
    if not left or (idle.recheck is not None and idle.recheck <= left):
        return idle
    return dataclasses.replace(idle, recheck=left + 0.1)
