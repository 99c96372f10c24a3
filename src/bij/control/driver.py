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

- `handlers.KubeBackend`: the Kubernetes API (status subresource, batch/v1 Jobs owned by the
  bij, Events), driven by one kopf daemon per bij.
- `local.LocalBackend`: `bij run` on one machine; status kept in memory, Jobs run as local
  processes with `JOB_COMPLETION_INDEX` by a small Indexed Job controller, Events printed.

Every step is idempotent (deterministic Job names, "exists" means an earlier attempt did it,
planning and publishing rewrite nothing), so a driver stopped anywhere continues where it
stopped when asked again.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Protocol

from bij.contract import layout
from bij.contract.codes import GENERATION_LABEL
from bij.contract.efficiency import eta_seconds, fmt_duration
from bij.contract.fingerprint import field_digests
from bij.contract.lane_report import LaneTally
from bij.contract.notify import body as notify_body
from bij.contract.notify import delivery_id
from bij.contract.notify import headers as notify_headers
from bij.contract.round_record import round_records
from bij.contract.rounds import RoundStats
from bij.contract.spec import BatchInferenceJob, SpecError
from bij.contract.spec_base import SecretKeyRef
from bij.contract.status import JobStatus, Phase
from bij.contract.step_report import REMOVAL_CONDITION
from bij.contract.step_results import FinishResult, ManifestSummary
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
    name_conflict,
)
from bij.control.file_volume import FileVolume
from bij.control.jobs import render_canary_job, render_job, render_lane_service
from bij.control.observe import format_ranges
from bij.control.permissions import CONDITION as PERMISSIONS_CONDITION
from bij.control.permissions import STATUS_KEY as PERMISSIONS_KEY
from bij.control.permissions import GrantCheck, condition, record
from bij.control.reconcile import decide
from bij.control.status import (
    decision_status,
    fmt_time,
    now_utc,
    parse_time,
    phase_conditions,
    set_condition,
    status_differs,
)
from bij.control.step_jobs import render_publish_job, render_step_job
from bij.control.stopping import seconds_left

log = logging.getLogger("bij.driver")

# Progress-only status writes (shard counts, rows) at most this often; phase changes and actions
# are written at once.
STATUS_INTERVAL = 5.0
# While a round runs, its rows are refreshed from the lanes' reports this often.
PROGRESS_INTERVAL = 30.0
# Steps applied per reconcile before yielding; a whole run takes about ten.
MAX_STEPS = 16
# The condition that names status entries bij cannot read (Driver.say_damage).
DAMAGED_CONDITION = "StatusDamaged"
# A Job of our name that belongs to someone else is looked at again this often.
CONFLICT_RECHECK = 15.0
# A step Job deleted to run anew, or one that succeeded before its report shows in the status read:
# look again this soon.
REPORT_RECHECK = 1.0

Created = Literal["created", "exists", "foreign"]


@dataclasses.dataclass(frozen=True)
class Observed:
    """What a backend sees of the bij: its spec (parsed, or why it cannot be), status and Jobs."""

    job: BatchInferenceJob | None
    spec_error: SpecError | None
    status: Mapping[str, Any]
    generation: int | None
    output_uri: str
    jobs: Sequence[Mapping[str, Any]]
    # The pods of its step Jobs that failed (`observe.failed_pods` reads them): what a retry or a
    # failure says about the cause.
    pods: Sequence[Mapping[str, Any]] = ()
    # The current round's lane reports, summed by the backend from the lanes' own Leases (or files): the
    # one thing the driver sees of them, the same size for any number of lanes.
    lanes: LaneTally | None = None

    @functools.cached_property
    def state(self) -> JobStatus:
        """The status, typed (what does not parse is left out and named: `say_damage`)."""
        return JobStatus.read(self.status)


class Backend(Protocol):
    """Where the driver's steps take effect."""

    worker_image: str
    steps_image: str  # the image of step Jobs (bij without an engine)
    # The volume file:// URIs lie on, mounted into every pod (the chart's fileStorage); None: no volume.
    file_volume: FileVolume | None

    def observe(self) -> Observed | None:
        """The bij now; None when it is gone (deleted, or being deleted)."""

    def create_job(self, body: dict[str, Any]) -> Created:
        """Create a batch/v1 Job owned by the bij: "exists" when an earlier attempt of ours did,
        "foreign" when a Job of that name belongs to someone else (never adopted or replaced)."""

    def create_service(self, body: dict[str, Any]) -> None:
        """Create a v1 Service owned by the bij (the headless Service of lanes of several pods); one that
        exists already is fine."""

    def patch_job(self, name: str, spec: dict[str, Any]) -> None:
        """Merge `spec` into the Job's spec (suspend, parallelism)."""

    def delete_job(self, name: str) -> None:
        """Delete a step Job (and its pods) so that the step runs again; gone already is fine."""

    def write_status(self, patch: dict[str, Any]) -> None:
        """Merge-patch the bij's status."""

    def event(self, type_: str, reason: str, message: str) -> None:
        """Post an Event about the bij (Normal or Warning)."""

    def notify_key(self, ref: SecretKeyRef) -> bytes:
        """The key that signs spec.notify's POSTs: a Secret's key in the bij's namespace (the operator), an
        environment variable (`bij run`: `notify.secret_env`); LookupError, naming it, when there is none."""


@dataclasses.dataclass(frozen=True)
class Idle:
    """Where a reconcile stopped: the last decision, and when to ask again without a change.

    ``recheck`` None: only when something changes (a Job, the spec). ``gone``: the bij was deleted.
    """

    decision: Decision | None
    recheck: float | None = None
    gone: bool = False


class Driver:
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
                self.write_status(seen, {**self.base(seen, d, now), "message": d.message})
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
        status = seen.status
        got = d.result
        assert got is not None
        shards, lanes, size = got.shards, got.lanes, got.bytes
        rounds = [r for r in status.get("rounds") or [] if r.get("round") != d.round]
        rec: dict[str, Any] = {"round": d.round, "shards": shards, "lanes": lanes,
                               "bytes": size, "startTime": fmt_time(now)}
        if d.round == 0:
            rec["specDigests"] = field_digests(job)  # decide() refuses a later edit of these fields
        canary = got.canary_shards
        if canary:
            rec["canaryShards"] = canary
        rounds.append(rec)
        msg = (f"round {d.round}: planned {shards} shards in {lanes} lanes from {got.objects} "
               f"input objects ({size:,} {got.unit or 'bytes'})"
               + (f"; the canary runs {canary} of them, spread over the input, alone first" if canary else ""))
        patch = {**self.base(seen, d, now), "rounds": rounds, "message": msg,
                 "shards": {"done": 0, "total": shards}, "shardsSummary": f"0/{shards}"}
        if "rows" not in status:
            patch["rows"] = {"done": 0, "failed": 0}  # so the ROWS column reads 0, not <none>
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
        self.write_status(seen, {**self.base(seen, d, now), "message": msg},
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
        self.write_status(seen, {**self.base(seen, d, now), "message": msg, "canary": {"shards": d.canary_shards}},
                          event=("Normal", "CanaryStarted", msg) if created == "created" else None)
        return None

    def _canary_verdict(self, seen: Observed, d: CanaryVerdict, now: dt.datetime) -> Idle | None:
        """The canary's figures, verdict and estimate in ``status.canary``, the Canary condition and an Event;
        CanaryFailed is final (`decide()` says Nothing from then on)."""
        patch = {**self.base(seen, d, now), "message": d.message, "canary": dict(d.canary)}
        patch["conditions"] = set_condition(patch["conditions"], "Canary", d.passed, d.reason, d.message,
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
        self.write_status(seen, {**self.base(seen, d, now), "message": msg}, event=("Normal", reason, msg))
        return None

    def _move_pool_lanes(self, seen: Observed, d: MovePoolLanes, now: dt.datetime) -> Idle | None:
        """A pool gave its lanes up: said in the status first (so a restart never brings them back), then its
        Jobs deleted; `decide()` creates the lanes in the next pool."""
        first = not any(p.name == d.pool and p.gave_up_round == d.round for p in seen.state.pools)
        self.write_status(seen, {**self.base(seen, d, now), "message": d.message},
                          event=("Warning", "PoolGaveUp", d.message) if first else None)
        for name in d.job_names:
            self.backend.delete_job(name)
        return None

    def _finish_round(self, seen: Observed, job: BatchInferenceJob, d: FinishRound, now: dt.datetime) -> Idle | None:
        """The round-statistics step's result: the round's record completed (its lanes' reports, in their
        Leases, are no longer read: they go with the round's Job)."""
        status = seen.status
        end = d.result or FinishResult()
        this = round_records(status).get(d.round)
        planned = this.shards if this is not None else 0
        stats = end.stats.stats(d.round, planned)
        rounds = []
        for rec in status.get("rounds") or []:
            if rec.get("round") == d.round:
                rec = {**rec, **stats.as_status(), "completionTime": fmt_time(now)}
                if d.lanes is not None and d.lanes.replaced:
                    rec["groupsReplaced"] = d.lanes.replaced  # its lanes' reports are read no more
            rounds.append(rec)
        msg = f"round {d.round} finished: {d.shards.summary if d.shards else '0/0'} shards, " \
              f"{stats.approved} rows, {stats.errors} error rows"
        if job.spec.judge is not None:
            msg += f", {stats.rejected} rejected, {stats.capped} capped (approval {stats.approval_rate:.1%})"
        if d.failed_lanes:
            noun = "lane" if len(d.failed_lanes) == 1 else "lanes"
            msg += f"; {noun} {format_ranges(d.failed_lanes)} failed, the other lanes finished their shards"
        if d.lanes is not None and d.lanes.replaced:
            msg += f"; lane groups replaced: {d.lanes.replaced}"
        patch = {**self.base(seen, d, now), "rounds": rounds, "message": msg,
                 **self.progress(seen, d.round, now, ended=stats),
                 **{k: v for k, v in end.as_result().items() if k in ("efficiency", "cost")}}
        self.write_status(seen, patch, event=("Normal", "RoundFinished", msg))
        return None

    def _prepare_publish(self, seen: Observed, job: BatchInferenceJob, d: PreparePublish,
                         now: dt.datetime) -> Idle | None:
        """The publish plan step's result: the publish record the passes follow (or the manifest, when one stands)."""
        got = d.result
        assert got is not None
        if got.published is not None:
            # Published before the status said so (a restart in between): the manifest stands.
            return self.published(seen, job, d, got.published)
        plan_uri, passes = got.plan_uri, dict(got.passes)
        msg = f"publishing {d.rounds} round(s): passes " + ", ".join(f"{p} {n}" for p, n in passes.items()) \
            + " indexes" + (" (partial)" if d.partial else "")
        # startedAt: when publishing began (bij-api's finalizing_at).
        record: dict[str, Any] = {"rounds": d.rounds, "planUri": plan_uri, "passes": passes,
                                  "startedAt": fmt_time(now)}
        if d.partial:
            record["partial"] = d.partial
        self.write_status(seen, {**self.base(seen, d, now), "message": msg, "publish": record})
        return None

    def _create_publish_job(self, seen: Observed, job: BatchInferenceJob, d: CreatePublishJob,
                            now: dt.datetime) -> Idle | None:
        """The Job of one publish pass."""
        body = render_publish_job(job, d.pass_name, d.completions, d.plan_uri, image=self.backend.worker_image,
                                  owner_uid=job.metadata.uid, file_volume=self.backend.file_volume)
        created = self.create_job(seen, d, body, "publishing", "Publishing")
        if created == "foreign":
            return Idle(d, recheck=CONFLICT_RECHECK)
        pods = f"{d.completions} pod" + ("s" if d.completions != 1 else "")
        msg = f"publishing: created Job {body['metadata']['name']} for pass {d.pass_name} ({pods})"
        self.write_status(seen, {**self.base(seen, d, now), "message": msg},
                          event=("Normal", "PublishPassStarted", msg) if created == "created" else None)
        return None

    def _stop_held(self, seen: Observed, job: BatchInferenceJob, d: StopHeld, now: dt.datetime) -> Idle | None:
        """Cancelled or expired before anything ran: said once, and not Ready (there is no manifest)."""
        if d.job_name:
            self.backend.delete_job(d.job_name)
        patch = {**self.base(seen, d, now), "message": d.message}
        patch["conditions"] = set_condition(patch["conditions"], "Ready", False, d.reason, d.message,
                                            generation=seen.generation, now=now)
        self.write_status(seen, patch, event=("Normal", d.phase, d.message))
        return Idle(d)

    def _nothing(self, seen: Observed, job: BatchInferenceJob, d: Nothing, now: dt.datetime) -> Idle | None:
        """Finished: only observedGeneration and the conditions kept current after spec edits (a bij stopped
        before anything ran published nothing: it stays not Ready)."""
        unpublished = d.phase in STOPPED_PHASES and not seen.state.manifest_uri
        patch = {"observedGeneration": seen.generation,
                 "conditions": phase_conditions(seen.status.get("conditions") or [], d.phase, d.reason, d.message,
                                                generation=seen.generation, now=now,
                                                ready=False if unpublished else None)}
        self.write_status(seen, patch)
        return Idle(d)

    def _wait(self, seen: Observed, d: Wait, now: dt.datetime) -> Idle:
        """Nothing to do but wait: progress written at most once a status interval, a warning at once."""
        status, state = seen.status, seen.state
        patch = {**self.base(seen, d, now), "message": d.message}
        phase_changed = state.phase != d.phase or state.round != d.round
        if d.warning and state.message != d.message:
            # A step's pod failed and its Job runs it again: said at once, once.
            self.write_status(seen, patch, event=("Warning", d.warning, d.message))
            return Idle(d, recheck=d.recheck)
        recheck = d.recheck or (self.progress_interval if d.phase == "Running" else None)
        # The rows the lanes reported count as a change too: a lane can commit many chunks of one shard
        # while the decision (shards, lanes, message) stays the same.
        progress = self.progress(seen, d.round, now)
        if not status_differs(status, {**patch, "rows": progress["rows"]}) and not phase_changed:
            return Idle(d, recheck=recheck)
        wait = self.last_progress + self.status_interval - time.monotonic()
        if not phase_changed and wait > 0:
            # Progress only: write it at the end of the interval, once, whatever happens meanwhile.
            return Idle(d, recheck=wait)
        patch.update(progress)
        self.last_progress = time.monotonic()
        self.write_status(seen, patch)
        return Idle(d, recheck=recheck)

    # --- steps shared by several decisions ----------------------------------------------------------

    def apply_failure(self, seen: Observed, d: Decision, job: BatchInferenceJob | None = None) -> Idle:
        """A failed bij (MarkFailed) or a step to try again later (Retry): status, one Event per message."""
        now = now_utc()
        patch = {**self.base(seen, d, now), "message": d.message}
        if isinstance(d, MarkFailed) and job is not None:
            patch.update(self.progress(seen, d.round, now))
        # Once per message: a recoverable failure (SpecChanged) is decided again on every change.
        first = seen.state.message != d.message
        reason = d.reason if isinstance(d, Retry) else d.event if isinstance(d, MarkFailed) else "Failed"
        self.write_status(seen, patch, event=("Warning", reason, d.message) if first else None)
        return Idle(d, recheck=d.delay if isinstance(d, Retry) else None)

    def check_permissions(self, seen: Observed, d: CheckPermissions, now: Any) -> None:
        """Ask whether the worker identity holds its grants; record the answer (``status.workerPermissions``,
        the WorkerPermissions Condition) and say it in an Event when it changed. `decide()` takes it from there."""
        assert self.worker_grants is not None  # decided only where grants are checked
        check = self.worker_grants(d.service_account)
        previous = seen.status.get(PERMISSIONS_KEY)
        previous = previous if isinstance(previous, Mapping) else {}
        rec = record(check, previous, fmt_time(now))
        truth, reason, message = condition(check)
        patch = {**self.base(seen, d, now), "message": d.message, PERMISSIONS_KEY: rec}
        patch["conditions"] = set_condition(patch["conditions"], PERMISSIONS_CONDITION, truth, reason, message,
                                            generation=seen.generation, now=now)
        was = (previous.get("serviceAccount"), previous.get("result"), previous.get("missing"))
        event: tuple[str, str, str] | None = None
        if was != (rec["serviceAccount"], rec["result"], rec["missing"]):
            if check.result == "Missing":
                event = ("Warning", "MissingPermissions", message)
            elif check.result == "Unknown":
                event = ("Warning", "PermissionsNotChecked", message)
            elif previous.get("result") == "Missing":
                event = ("Normal", "PermissionsGranted", f"{message}: the bij goes on")
        log.info("worker grants of %s: %s", check.user, check.result)
        self.write_status(seen, patch, event=event)

    def notify_ended(self, job: BatchInferenceJob, idle: Idle) -> Idle:
        """spec.notify's webhooks told that the bij ended: the POSTs due now (`notify.due`), each attempt recorded
        in ``status.notified``, an Event when one is delivered or given up, and the Notified condition; asked again
        when the next retry falls due. The phase stays what it is, whatever the webhooks answer."""
        seen = self.backend.observe()
        if seen is None or seen.job is None:
            return idle
        state, now = seen.state, now_utc()
        todo, wake = notify.due(job, state, now)
        if not todo:
            return wake_at(idle, wake)  # a retry not yet due (woken a little early): ask again then
        changed = [notify.attempted(item.record, self.notify_one(job, state, item, now), now, self.notify_backoff)
                   for item in todo]
        patch: dict[str, Any] = {notify.STATUS_KEY: notify.merged(state, changed)}
        after = JobStatus.read({**seen.status, **patch})
        given_up = [r for r in after.notified if r.gave_up]
        conditions = [c.as_status() for c in state.conditions]
        if given_up:
            told = "; ".join(f"{r.event} to {r.url} after {r.attempts} attempts: {r.last_error}" for r in given_up)
            patch["conditions"] = set_condition(conditions, notify.CONDITION, False, "NotifyFailed",
                                                f"not delivered: {told}", generation=seen.generation, now=now)
        elif notify.settled(job, after):
            patch["conditions"] = set_condition(conditions, notify.CONDITION, True, "Delivered",
                                                "every webhook of spec.notify was told", generation=seen.generation,
                                                now=now)
        self.backend.write_status(patch)
        for r in changed:
            if r.delivered_at:
                self.backend.event("Normal", "Notified", f"{r.event}: told {r.url} (attempt {r.attempts})")
            elif r.gave_up:
                self.backend.event("Warning", "NotifyFailed",
                                   f"{r.event}: {r.url} was not told after {r.attempts} attempts ({r.last_error}); "
                                   f"the bij stays {state.phase}")
            else:
                log.warning("%s/%s: notify %s to %s failed (attempt %d): %s; next at %s", job.metadata.namespace,
                            job.metadata.name, r.event, r.url, r.attempts, r.last_error, r.next_attempt_at)
        return wake_at(idle, notify.due(job, after, now)[1])

    def notify_one(self, job: BatchInferenceJob, state: JobStatus, item: notify.Due, now: dt.datetime) -> str | None:
        """One signed POST of the bij's end; None when delivered, else why not."""
        try:
            key = self.backend.notify_key(item.target.secret_ref)
        except LookupError as e:
            return f"no signing key: {e.args[0] if e.args else e}"
        payload = notify_body(job, state, item.event, now)
        sent = notify_headers(key, payload, item.event, delivery_id(job, item.event), int(time.time()))
        return self.send(item.target.url, payload, sent, self.notify_backoff.timeout)

    def create_job(self, seen: Observed, d: Decision, body: dict[str, Any], what: str,
                   phase: Phase) -> Created:
        created = self.backend.create_job(body)
        if created == "foreign":
            conflict = name_conflict(d, body["metadata"]["name"], what, phase)
            self.write_status(seen, {**self.base(seen, conflict, now_utc()), "message": conflict.message},
                              event=("Warning", "JobNameConflict", conflict.message)
                              if seen.status.get("message") != conflict.message else None)
        return created

    def published(self, seen: Observed, job: BatchInferenceJob, d: Decision, manifest: ManifestSummary) -> Idle:
        """Phase Succeeded with what the manifest says (Cancelled or Expired for a partial manifest)."""
        now = now_utc()
        counts = manifest.counts
        uri = layout.manifest_uri(job)
        partial = manifest.partial.phase if manifest.partial is not None else None
        codes = counts.error_codes
        by_code = (": " + ", ".join(f"{n} {code}" for code, n in sorted(codes.items(), key=lambda e: -e[1]))
                   if codes else "")
        msg = (f"published {counts.rows} rows in {manifest.files} files "
               f"({counts.errors} error rows{by_code}) to {uri}")
        if partial and manifest.partial is not None:
            msg = (f"{partial.lower()} ({manifest.partial.reason}): " + msg
                   + f"; {counts.not_run or 0} rows not run")
        structured = counts.structured
        if structured.validated or structured.violations:
            # Structured answers checked after decoding (bij.engines.structured).
            msg += (f"; structured answers: {structured.validated} validated "
                    f"({structured.repaired} repaired on a second grammar backend), "
                    f"{structured.violations} schema_violation error rows")
        for note in manifest.notes:
            msg += f"; {note}"  # what the engine could not serve at all, once each (not per row)
        damaged = [o.message for o in manifest.damaged_objects]
        if damaged:
            # input.onDamagedObject errorRow: published without what lay behind the break; never silent.
            msg += "; damaged input (one corrupt_input error row each, the rest unread): " + "; ".join(damaged)
        if counts.capped:
            # Never silent: rows the judge still rejected at the cap are published apart and said so.
            capped = (f"RetryCapReached: {counts.capped} rows were still rejected by the judge at the cap; "
                      "they are in the manifest's cappedFiles")
            msg += f"; {capped}"
            self.backend.event("Warning", "RetryCapReached", capped)
        removal = manifest.work_files_removal
        if removal is not None:
            # The manifest stands: work files left behind are a warning, never a failed bij.
            left = (f"RemovalFailed: removing work files failed after {removal.removed} objects: "
                    f"{removal.error}; the rest are left under {removal.left} (a rerun resumes "
                    "the removal, or a bucket lifecycle rule on the _bij/ prefix removes them)")
            msg += f"; {left}"
            self.backend.event("Warning", "RemovalFailed", left)
        done = dataclasses.replace(d, phase=partial or "Succeeded", reason=partial or "Published", message=msg)
        rows = {"done": counts.rows, "failed": counts.errors}
        if partial:
            rows["notRun"] = counts.not_run or 0
        patch = {**self.base(seen, done, now), "manifestUri": uri, "message": msg, "rows": rows}
        if removal is not None:
            patch["conditions"] = set_condition(patch["conditions"], REMOVAL_CONDITION, False, "RemovalFailed",
                                                left, generation=seen.generation, now=now)
        patch.update({k: v for k, v in self.progress(seen, d.round, now).items() if k != "rows"})
        self.write_status(seen, patch, event=("Normal", partial or "Published", msg))
        return Idle(done)

    def mark_invalid(self, seen: Observed, err: SpecError) -> None:
        """Phase Failed with the validation problems; posted once per distinct message."""
        msg = "invalid spec: " + "; ".join(err.problems)
        now = now_utc()
        patch = {"phase": "Failed", "message": msg, "observedGeneration": seen.generation,
                 "conditions": phase_conditions(seen.status.get("conditions") or [], "Failed", "InvalidSpec", msg,
                                                generation=seen.generation, now=now)}
        if seen.status.get("message") != msg:
            self.write_status(seen, patch, event=("Warning", "InvalidSpec", msg))

    def say_damage(self, seen: Observed, state: JobStatus) -> bool:
        """Status entries bij cannot read (written by something else, or damaged) are left out where they are
        read; here they are named in the StatusDamaged condition and a Warning Event, once, and the condition
        turns False when they are gone. A damaged condition is dropped (conditions are rewritten whole),
        said in the Event. True when the status was written."""
        said = next((c for c in state.conditions if c.type == DAMAGED_CONDITION), None)
        dropped = [p for p in state.problems if p.startswith("status.conditions")]
        lasting = [p for p in state.problems if p not in dropped]
        message = unreadable(lasting)
        new = bool(lasting) and (said is None or said.status != "True" or said.message != message)
        conditions = [c.as_status() for c in state.conditions]
        now = now_utc()
        if new:
            conditions = set_condition(conditions, DAMAGED_CONDITION, True, "UnreadableEntries", message,
                                       generation=seen.generation, now=now)
        elif not lasting and said is not None and said.status == "True":
            conditions = set_condition(conditions, DAMAGED_CONDITION, False, "Readable",
                                       "every status entry is readable", generation=seen.generation, now=now)
        elif not dropped:
            return False
        self.backend.write_status({"conditions": conditions})
        if new or dropped:
            log.warning("%s: %s", seen.output_uri, unreadable(state.problems))
            self.backend.event("Warning", DAMAGED_CONDITION, unreadable(state.problems))
        return True

    def base(self, seen: Observed, d: Decision, now: Any) -> dict[str, Any]:
        """The status fields every decision sets (phase, round, shards, conditions, ...)."""
        return decision_status(seen.status, d, generation=seen.generation, now=now, output_uri=seen.output_uri)

    def write_status(self, seen: Observed, patch: dict[str, Any], event: tuple[str, str, str] | None = None) -> None:
        """Merge-patch the status (only if it changes) and post the Event."""
        if status_differs(seen.status, patch):
            self.backend.write_status(patch)
        if event is not None:
            self.backend.event(*event)

    # --- storage steps, run as Jobs in the bij's namespace (bij.steps.main) ---------------------

    def run_step(self, seen: Observed, job: BatchInferenceJob, d: StepDecision) -> Idle | None:
        """Create the one-pod Job of step `d` (`decide()` saw none): its pod reports into the bij's status,
        and `decide()` takes it from there. None: look again (something changed)."""
        args = d.step_args()
        body = render_step_job(job, **args, image=self.backend.steps_image, owner_uid=job.metadata.uid,
                               file_volume=self.backend.file_volume)
        body["metadata"]["labels"][GENERATION_LABEL] = str(seen.generation or 0)
        name = body["metadata"]["name"]
        created = self.create_job(seen, d, body, f"{d.message}: step {args['kind']}", d.phase)
        if created == "foreign":
            return Idle(d, recheck=CONFLICT_RECHECK)
        if created == "created":
            log.info("%s/%s: step %s runs in Job %s", job.metadata.namespace, job.metadata.name, args["kind"], name)
            # The phase from the start (Planning, Publishing, ...), not only once the step reports.
            self.write_status(seen, {**self.base(seen, d, now_utc()), "message": f"{d.message} (step Job {name})"})
        return None

    # --- progress from the pods' reports (the operator reads no storage) ------------------------------

    def shards_done(self, seen: Observed) -> int | None:
        """How many shards of the current round its lanes reported finished; None when no round runs.
        A lane counts only shards it finished itself, so the sum counts each shard once."""
        state = seen.state
        rec = state.round_records().get(state.current_round)
        if rec is None or rec.finished or state.phase in TERMINAL_PHASES:
            return None
        return self.reported(seen, state.current_round).shards_done

    @staticmethod
    def reported(seen: Observed, round_no: int) -> LaneTally:
        """Round `round_no`'s lane reports as the backend summed them (none, for another round)."""
        return seen.lanes if seen.lanes is not None and seen.lanes.round == round_no else LaneTally(round=round_no)

    def progress(self, seen: Observed, round_no: int, now: Any,
                 ended: RoundStats | None = None) -> dict[str, Any]:
        """``rows`` and ``rowsPerSecond``: the finished rounds' counts in ``status.rounds``, and the
        current round's (its statistics once `ended`, else what its lanes reported); ``eta`` of the
        running round from the input its lanes reported done."""
        state = seen.state
        done = failed = 0
        records = state.round_records()
        for r, rec in records.items():
            # A finished round counts from its record (the current one too: while publishing, say),
            # unless its statistics are being recorded right now (`ended`).
            if rec.finished and not (r == round_no and ended is not None):
                done += rec.approved
                failed += rec.errors
        this_round = records.get(round_no)
        finished = this_round is not None and this_round.finished
        current = LaneTally(round=round_no) if finished else self.reported(seen, round_no)
        if ended is not None:
            done += ended.approved
            failed += ended.errors
        else:
            done += current.rows
            failed += current.errors
        started = state.start_time or min((r.start_time for r in records.values() if r.start_time),
                                                 default=None)
        out: dict[str, Any] = {"rows": {"done": done, "failed": failed}}
        start = parse_time(started)
        if start is not None:
            elapsed = (now - start).total_seconds()
            out["rowsPerSecond"] = round(done / elapsed, 2) if elapsed > 0 else 0.0
        round_start = parse_time(this_round.start_time if this_round is not None else None)
        size = this_round.bytes if this_round is not None else 0
        if ended is None and size and round_start is not None and current.pods:
            out["eta"] = fmt_duration(eta_seconds(current.bytes, size, (now - round_start).total_seconds()))
        return out


def unreadable(problems: Sequence[str]) -> str:
    """What the StatusDamaged condition and Event say of `problems` (at most five named)."""
    if not problems:
        return ""
    more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
    return "status entries left out as unreadable: " + "; ".join(problems[:5]) + more


def wake_at(idle: Idle, wake: float | None) -> Idle:
    """`idle`, asked again no later than `wake` seconds from now (None: as it was)."""
    if wake is None:
        return idle
    return dataclasses.replace(idle, recheck=wake if idle.recheck is None else min(idle.recheck, wake))


def until_deadline(idle: Idle, job: BatchInferenceJob, status: Mapping[str, Any], now: Any) -> Idle:
    """`idle`, asked again no later than spec.deadlineSeconds runs out (so an idle bij still expires)."""
    if idle.gone or status.get("phase") in TERMINAL_PHASES:
        return idle
    left = seconds_left(job, status, now)
    # Once it has passed the bij is stopping, and its Jobs' changes wake the driver.
    if not left or (idle.recheck is not None and idle.recheck <= left):
        return idle
    return dataclasses.replace(idle, recheck=left + 0.1)
