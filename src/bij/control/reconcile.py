"""The round state machine: what to do next, from (spec, status, observed Jobs) alone.

`decide()` is a pure function. The kopf handlers read the three inputs, apply the
one decision it returns, and ask again until it says `Wait` or `Nothing`. Every
fact the next decision needs is written back to ``status`` (or is visible on the
Job), so an operator killed at any line and restarted asks the same question,
gets the same answer, and re-applies an idempotent step: no duplicate Job, no
lost round.

The state that survives restarts lives in ``status.rounds``, one record per
planned round::

    {"round": 0, "shards": 8, "lanes": 2, "startTime": "...", "completionTime": "...", "approved": 980, ...}

A record exists once the round is planned; ``completionTime`` and the round's statistics
(`rounds.RoundStats.as_status`: approved, rejected, capped, errors, ...) are added once its
Job completed. Judge rounds hang off `after_round()`: a finished round either
publishes or plans the next round.

What touches storage (planning a round, counting a finished round, the publish plan, the manifest)
runs as a one-pod step Job whose pod reports a `StepReport` into ``status.reports.steps``; such a
decision (`PlanRound`, `FinishRound`, `PreparePublish`, `Publish`) is decided by `step()` from the
step's Job, its pods and its report like a round is from its Job: run it (``result`` None), wait,
retry, fail, or record its ``result``. A pod that dies is run again by its Job
(spec.workers.backoffLimitPerIndex, one retry policy for steps and rounds), each retry said; a Job
that gave up fails the bij naming the step, its pod and the cause.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bij.contract.canary import CanaryFigures, broken, describe_estimate, estimate
from bij.contract.codes import (
    CANARY_LABEL,
    GENERATION_LABEL,
    JOB_LABEL,
    LANE_OFFSET_ANNOTATION,
    NODES_PER_LANE_ANNOTATION,
    POOL_LABEL,
    PUBLISH_LABEL,
    ROUND_LABEL,
)
from bij.contract.fingerprint import field_digests
from bij.contract.lane_report import LaneTally
from bij.contract.publish_plan import PASSES as PUBLISH_PASSES
from bij.contract.round_record import RoundRecord
from bij.contract.rounds import RoundStats, needs_another_round
from bij.contract.spec import BatchInferenceJob
from bij.contract.status import JobStatus, Phase, PoolLanes
from bij.contract.step_report import StepErrorCode, StepReport
from bij.control import pools
from bij.control.permissions import DEFAULT_SERVICE_ACCOUNT, STATUS_KEY, recheck_due, service_account_user
from bij.control.stopping import Stop, stop_requested

# Cancelled and Expired: stopped for good by spec.cancel or spec.deadlineSeconds, the finished part published.
STOPPED_PHASES: frozenset[str] = frozenset({"Cancelled", "Expired"})
# CanaryFailed: spec.canary's rows broke a threshold; nothing more runs and nothing is published.
TERMINAL_PHASES: frozenset[str] = frozenset({"Succeeded", "Failed", "CanaryFailed"}) | STOPPED_PHASES
# Reasons under which a Failed phase is not final: a spec edit may clear it.
RECOVERABLE_FAILURES: frozenset[str] = frozenset({"InvalidSpec", "SpecChanged", "PlanRefused", "StorageRefused"})


# --- Job observation ---------------------------------------------------------------------------


def parse_ranges(text: str | None) -> frozenset[int]:
    """Indexes from a Job's ``completedIndexes``/``failedIndexes`` string, e.g. ``"1,3-5,7"``."""
    out: set[int] = set()
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        if sep:
            out.update(range(int(lo), int(hi) + 1))
        else:
            out.add(int(lo))
    return frozenset(out)


def format_ranges(indexes: Iterable[int]) -> str:
    """The inverse of `parse_ranges`: sorted, with consecutive runs folded (``"1,3-5,7"``)."""
    items = sorted(set(indexes))
    parts: list[str] = []
    i = 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1] == items[j] + 1:
            j += 1
        parts.append(str(items[i]) if i == j else f"{items[i]}-{items[j]}")
        i = j + 1
    return ",".join(parts)


@dataclass(frozen=True, kw_only=True)
class Shards:
    """Shard progress of one round (from the workers' completion records): the `SHARDS` column."""

    done: int
    total: int

    @property
    def summary(self) -> str:
        return f"{self.done}/{self.total}"


@dataclass(frozen=True, kw_only=True)
class Lanes:
    """The round Job's indexes: lanes done, failed for good, running, and in all."""

    done: int
    failed: int
    active: int
    total: int
    replaced: int = 0  # lane groups (spec.workers.nodesPerLane > 1) replaced whole this round

    @property
    def summary(self) -> str:
        return f"{self.done}/{self.total}" + (f" ({self.replaced} replaced)" if self.replaced else "")


@dataclass(frozen=True, kw_only=True)
class Condition:
    status: bool
    reason: str
    message: str


@dataclass(frozen=True, kw_only=True)
class JobView:
    """The parts of an observed ``batch/v1`` Job that decisions depend on."""

    name: str
    round: int | None
    owner_uids: frozenset[str]
    deleting: bool
    completions: int
    parallelism: int | None
    suspend: bool
    active: int
    terminating: int  # pods being deleted that have not ended yet (SIGTERM sent, draining)
    completed: frozenset[int]  # lanes done (their leader's index succeeded)
    failed: frozenset[int]  # lanes with an index failed for good
    conditions: Mapping[str, Condition]
    # Pods per lane (spec.workers.nodesPerLane when the Job was made): index i is rank i % n of lane i // n.
    nodes_per_lane: int = 1
    # Lane groups of the round replaced so far, and why the latest was (the pods' reports, `LaneTally`).
    groups_replaced: int = 0
    last_group_lost: str | None = None

    @classmethod
    def of(cls, job: Mapping[str, Any]) -> JobView:
        meta = job.get("metadata") or {}
        spec = job.get("spec") or {}
        status = job.get("status") or {}
        round_label = (meta.get("labels") or {}).get(ROUND_LABEL)
        raw_nodes = str((meta.get("annotations") or {}).get(NODES_PER_LANE_ANNOTATION) or "1")
        nodes = int(raw_nodes) if raw_nodes.isdigit() and int(raw_nodes) > 0 else 1
        conditions = {
            c["type"]: Condition(
                status=str(c.get("status")) == "True",
                reason=str(c.get("reason") or ""),
                message=str(c.get("message") or ""),
            )
            for c in status.get("conditions") or []
            if c.get("type")
        }
        return cls(
            name=str(meta.get("name", "")),
            round=int(round_label) if round_label is not None and str(round_label).isdigit() else None,
            owner_uids=frozenset(str(o.get("uid")) for o in meta.get("ownerReferences") or []),
            deleting=bool(meta.get("deletionTimestamp")),
            completions=int(spec.get("completions") or 0),
            parallelism=spec.get("parallelism"),
            suspend=bool(spec.get("suspend")),
            active=int(status.get("active") or 0),
            terminating=int(status.get("terminating") or 0),
            # A lane of several pods is done when its leader (rank 0) is: the others follow it. It has
            # failed when any of its pods has: the group cannot run without one of them.
            completed=frozenset(i // nodes for i in parse_ranges(status.get("completedIndexes")) if i % nodes == 0),
            failed=frozenset(i // nodes for i in parse_ranges(status.get("failedIndexes"))),
            conditions=conditions,
            nodes_per_lane=nodes,
        )

    def has(self, condition_type: str) -> bool:
        c = self.conditions.get(condition_type)
        return c is not None and c.status

    @property
    def succeeded(self) -> bool:
        # SuccessCriteriaMet comes first (Kubernetes >= 1.31), Complete once pods are gone; either
        # means every shard's results are durable.
        return self.has("Complete") or self.has("SuccessCriteriaMet")

    @property
    def failed_for_good(self) -> bool:
        # FailureTarget is set as soon as the Job controller has decided; Failed follows once the
        # remaining pods have terminated. Nothing can rescue the round after either.
        return self.has("Failed") or self.has("FailureTarget")

    @property
    def failure(self) -> Condition | None:
        for kind in ("Failed", "FailureTarget"):
            c = self.conditions.get(kind)
            if c is not None and c.status:
                return c
        return None

    @property
    def lanes(self) -> Lanes:
        return Lanes(done=len(self.completed), failed=len(self.failed), active=-(-self.active // self.nodes_per_lane),
                     total=self.completions // self.nodes_per_lane, replaced=self.groups_replaced)


# --- decisions ---------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Decision:
    """What to do next, plus how the bij should look once it is done.

    ``phase``/``reason``/``message`` become ``status.phase`` and the conditions; ``shards``
    is the current round's shard progress when known, ``lanes`` its Job's when one is observed.
    """

    round: int
    phase: Phase
    reason: str
    message: str
    shards: Shards | None = None
    lanes: Lanes | None = None
    pools: tuple[PoolLanes, ...] | None = None  # spec.workers.pools: each pool's lanes, when its Jobs are observed


@dataclass(frozen=True, kw_only=True)
class StepDecision(Decision):
    """A decision whose storage work runs as a step Job (`steps`): ``result`` None means create that
    Job (`step` decided it may run); else the step's result, to be recorded."""

    result: Mapping[str, Any] | None = None

    def step_args(self) -> dict[str, Any]:
        """The step's kind, round and arguments (`jobs.render_step_job`)."""
        raise NotImplementedError


@dataclass(frozen=True, kw_only=True)
class CheckPermissions(Decision):
    """Ask the API server whether the bij's worker identity holds every grant its pods use
    (`access_review.check_grants`), and record the answer in ``status.workerPermissions``."""

    service_account: str


@dataclass(frozen=True, kw_only=True)
class StopHeld(Decision):
    """A bij held before its first pod (its worker identity lacks a grant, `permissions_gate`), or whose round 0
    plan step cannot start (its image cannot be pulled, say), is cancelled or its deadline passed: it ends
    Cancelled or Expired at once. Nothing ran, so there is nothing to drain or to publish, and no other step pod
    is started: no manifest, ``Ready`` stays False. `job_name`: the stuck step Job, deleted with its pod."""

    job_name: str | None = None


@dataclass(frozen=True, kw_only=True)
class PlanRound(StepDecision):
    """Plan round `round` (idempotent) and record it in ``status.rounds``."""

    def step_args(self) -> dict[str, Any]:
        return {"kind": "plan", "round_no": self.round}


@dataclass(frozen=True, kw_only=True)
class CreateJob(Decision):
    """Create the round's Indexed Job, one index per lane (a 409 means an earlier attempt already did)."""

    completions: int
    suspend: bool
    # spec.workers.pools: the pool that runs these lanes (`pools.Placed`), its Job's name suffix and first lane.
    pool: str | None = None
    name_suffix: str = ""
    lane_offset: int = 0


@dataclass(frozen=True, kw_only=True)
class MovePoolLanes(Decision):
    """A pool of spec.workers.pools gives its lanes to the next pool for the rest of the round: record that
    (``pools``, a Warning Event), then delete its Jobs `job_names` (their pods never started, or keep being
    preempted); the same lanes are then created in the next pool, and inherit their shards through the claims."""

    pool: str
    to_pool: str
    job_names: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class CreateCanaryJob(Decision):
    """Create round 0's canary Job (spec.canary): `completions` lanes that work only the `canary_shards` shards
    `contract.canary.canary_shards` spreads over the round (a 409 means an earlier attempt already did)."""

    completions: int
    canary_shards: int


@dataclass(frozen=True, kw_only=True)
class CheckCanary(StepDecision):
    """The canary Job ended: count its shards' figures and read a few failing rows (``result``, the canary step),
    then `canary_verdict` decides."""

    canary_shards: int

    def step_args(self) -> dict[str, Any]:
        # The step's `rounds` argument carries the canary's shard count.
        return {"kind": "canary", "round_no": 0, "rounds": self.canary_shards}


@dataclass(frozen=True, kw_only=True)
class CanaryVerdict(Decision):
    """Record the canary's figures, verdict and estimate in ``status.canary`` (the Canary condition, an Event):
    ``passed`` and round 0's own Job runs next (skipping the canary's shards), or phase CanaryFailed for good."""

    passed: bool
    canary: Mapping[str, Any]


@dataclass(frozen=True, kw_only=True)
class PatchJob(Decision):
    """Bring the running Job in line with the spec: suspend/resume, parallelism."""

    job_name: str
    suspend: bool | None = None
    parallelism: int | None = None


@dataclass(frozen=True, kw_only=True)
class FinishRound(StepDecision):
    """Record the round as finished in ``status.rounds`` (it survives the Job's TTL), with the statistics
    its finish step counted (``result``)."""

    failed_lanes: tuple[int, ...] = ()  # lanes that failed for good while the others finished every shard

    def step_args(self) -> dict[str, Any]:
        return {"kind": "finish", "round_no": self.round}


@dataclass(frozen=True, kw_only=True)
class PreparePublish(StepDecision):
    """Check rounds ``0..rounds-1`` and write the publish plan (O(shards)); record it in ``status.publish``.
    ``partial``: Cancelled or Expired, the shards left unfinished are published as far as they got."""

    rounds: int
    partial: str | None = None

    def step_args(self) -> dict[str, Any]:
        return {"kind": "publish-plan", "round_no": 0, "rounds": self.rounds, "partial": self.partial}


@dataclass(frozen=True, kw_only=True)
class CreatePublishJob(Decision):
    """Create the Indexed Job of one publish pass: the row-level work runs in its pods."""

    rounds: int
    pass_name: str
    completions: int
    plan_uri: str


@dataclass(frozen=True, kw_only=True)
class Publish(StepDecision):
    """Every publish pass is done: write ``<output>/manifest.json`` over rounds ``0..rounds-1`` from the
    per-shard summaries (O(shards)), then phase Succeeded (or ``partial``: Cancelled or Expired)."""

    rounds: int
    partial: str | None = None
    plan_uri: str = ""

    def step_args(self) -> dict[str, Any]:
        return {"kind": "manifest", "round_no": 0, "rounds": self.rounds, "plan_uri": self.plan_uri}


@dataclass(frozen=True, kw_only=True)
class RerunStep(Decision):
    """Delete a step's Job so that the step runs anew: its report was made for a spec since edited, or
    the failure it met may have passed (a retry is due)."""

    job_name: str


@dataclass(frozen=True, kw_only=True)
class MarkFailed(Decision):
    """The bij failed: phase Failed (a round's Job failed for good with shards left undone, naming the
    failed lanes; or a step no retry can fix). ``event`` is the reason of the Warning Event posted."""

    failed_lanes: tuple[int, ...] = ()
    event: str = "Failed"


@dataclass(frozen=True, kw_only=True)
class Retry(Decision):
    """A step failed in a way that may pass (input still uploading, storage outage): say so, and ask
    again after ``delay`` seconds. ``permanent``: the error says no retry will help by itself (a
    missing bucket), though a change outside the job might; `bij run` ends there, the operator retries."""

    delay: float
    permanent: bool = False


@dataclass(frozen=True, kw_only=True)
class Wait(Decision):
    """Nothing to change; a Job is working (or suspended, or an old one is going away). ``warning``:
    the reason of a Warning Event to post once for this message (a step's pod failed and is retried)."""

    warning: str | None = None
    recheck: float | None = None  # look again this soon without a change (None: when something changes)


@dataclass(frozen=True, kw_only=True)
class Nothing(Decision):
    """The bij is finished (Succeeded or Failed); leave it alone."""


# --- a Job name taken -------------------------------------------------------------------------


def name_conflict(d: Decision, job_name: str, what: str, phase: Phase) -> Wait:
    """A Job of the name we need belongs to someone else: it is never adopted or replaced; the bij
    says so and waits (looked at again later)."""
    return Wait(round=d.round, phase=phase, reason="JobNameConflict", shards=d.shards, lanes=d.lanes,
                message=f"{what}: a Job named {job_name} already exists and does not belong to this "
                        "BatchInferenceJob; delete or rename it")


# --- status accessors --------------------------------------------------------------------------


def failure_reason(state: JobStatus) -> str | None:
    """The reason on the ``Failed`` condition, if the bij is marked failed."""
    for c in state.conditions:
        if c.type == "Failed" and c.status == "True":
            return c.reason or ""
    return None


# --- the worker identity's grants, before the first pod ------------------------------------------------


def permissions_gate(job: BatchInferenceJob, status: Mapping[str, Any], now: dt.datetime) -> Decision | None:
    """Before a bij's first pod: ask whether its worker identity holds every grant its pods use (no answer
    recorded for that service account yet, or a Missing answer whose re-check is due), hold it while one is
    missing, or None: go on (Granted; or Unknown, the operator may not ask, which never holds a bij)."""
    sa = job.spec.workers.service_account_name or DEFAULT_SERVICE_ACCOUNT
    rec = status.get(STATUS_KEY)
    if not isinstance(rec, Mapping) or rec.get("serviceAccount") != sa:
        return CheckPermissions(round=0, phase="Pending", reason="CheckingPermissions", service_account=sa,
                                message="checking the grants of the worker identity "
                                        f"{service_account_user(job.metadata.namespace, sa)}")
    if rec.get("result") != "Missing":
        return None
    message = str(rec.get("message") or "the worker identity lacks a grant its pods use")
    left = recheck_due(rec, now)
    if left <= 0:
        return CheckPermissions(round=0, phase="Pending", reason="MissingPermissions", service_account=sa,
                                message=message)
    return Wait(round=0, phase="Pending", reason="MissingPermissions", message=message, recheck=left)


# --- steps: one-pod Jobs that do the storage work, decided like rounds ---------------------------------

# An expected failure that time may fix (input still uploading, an outage) is tried again this long after it
# was reported; the operator retries it for as long as it lasts, `bij run` stops there (its exit code says).
STEP_RETRY_SECONDS = 30.0
# Lines of a failed pod's termination message (its last log lines) a message quotes.
LAST_LINES = 3
# bij's log format in front of a line (`bij.worker.main`): the message alone says what failed.
_LOG_PREFIX = re.compile(r"^\d{4}-\d\d-\d\d [\d:,.]+ [A-Z]+ [\w.]+: ")


def step_key(kind: str, round_no: int) -> str:
    """A step's label value and name suffix: plan-r<r>, finish-r<r>, publish-plan, manifest."""
    return f"{kind}-r{round_no}" if kind in ("plan", "finish") else kind


def step_job_name(job: BatchInferenceJob, kind: str, round_no: int = 0) -> str:
    return f"{job.metadata.name}-{step_key(kind, round_no)}"


@dataclass(frozen=True)
class Observation:
    """What `decide()` sees beside the spec: the status, the bij's Jobs and their pods (essences with
    metadata.name/labels/creationTimestamp and status.containerStatuses), metadata.generation, the time."""

    status: Mapping[str, Any]
    state: JobStatus  # the status, typed
    jobs: Sequence[Mapping[str, Any]]
    pods: Sequence[Mapping[str, Any]]
    generation: int | None
    now: dt.datetime


@dataclass(frozen=True, kw_only=True)
class PodEnd:
    """How one of a Job's pods ended: its name, exit code, the kubelet's reason and message."""

    pod: str
    exit_code: int | None
    reason: str
    message: str

    def describe(self) -> str:
        how = f"exit code {self.exit_code}" if self.exit_code is not None else "no exit code"
        if self.reason and self.reason not in ("Error", "Completed"):
            how += f" ({self.reason})"
        elif self.exit_code == 137:
            how += " (killed: SIGKILL, as an OOM kill or a lost node does)"
        lines: list[str] = []
        for ln in self.message.strip().splitlines():
            ln = _LOG_PREFIX.sub("", ln.strip())
            if ln and (not lines or lines[-1] != ln):
                lines.append(ln)
        lines = lines[-LAST_LINES:]
        return f"pod {self.pod}: {how}" + (": " + " | ".join(lines) if lines else "")


def failed_pods(job_name: str, pods: Sequence[Mapping[str, Any]]) -> list[PodEnd]:
    """The failed pods of Job `job_name`, oldest first."""
    out: list[tuple[str, str, PodEnd]] = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        if labels.get("batch.kubernetes.io/job-name", labels.get("job-name")) != job_name:
            continue
        status = pod.get("status") or {}
        if status.get("phase") != "Failed":
            continue
        ended: Mapping[str, Any] = {}
        for c in status.get("containerStatuses") or []:
            ended = (c.get("state") or {}).get("terminated") or (c.get("lastState") or {}).get("terminated") or {}
            if ended:
                break
        code = ended.get("exitCode")
        out.append((str(meta.get("creationTimestamp") or ""), str(meta.get("name") or ""), PodEnd(
            pod=str(meta.get("name") or "?"), exit_code=int(code) if isinstance(code, int) else None,
            reason=str(ended.get("reason") or status.get("reason") or ""),
            message=str(ended.get("message") or status.get("message") or ""))))
    return [p for _, _, p in sorted(out, key=lambda t: (t[0], t[1]))]


# A running step is looked at again this often, though its Job does not change.
STEP_RECHECK = 30.0
# A step pod waiting for good in one of these cannot start until someone acts (an image, a Secret).
STUCK_REASONS = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull",
                           "CreateContainerConfigError", "CreateContainerError"})


def stuck_pods(job_name: str, pods: Sequence[Mapping[str, Any]]) -> list[PodEnd]:
    """The pods of Job `job_name` that cannot start (`STUCK_REASONS`): the reason and the kubelet's message."""
    out = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        if labels.get("batch.kubernetes.io/job-name", labels.get("job-name")) != job_name:
            continue
        for c in (pod.get("status") or {}).get("containerStatuses") or []:
            waiting = (c.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in STUCK_REASONS:
                out.append(PodEnd(pod=str(meta.get("name") or "?"), exit_code=None, reason=str(waiting["reason"]),
                                  message=str(waiting.get("message") or "")))
    return out


def step_report(status: Mapping[str, Any], name: str, uid: str | None) -> StepReport | None:
    """The report of step Job `name` in the status, if it was made by the Job of that uid."""
    report = StepReport.parse(((status.get("reports") or {}).get("steps") or {}).get(name))
    return report if report is not None and uid and report.job_uid == uid else None


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
        return dataclasses.replace(want, result=report.result)
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
    tries = int((meta.get("annotations") or {}).get(STEP_TRIES_ANNOTATION) or 0) or None
    job_status = raw.get("status") or {}
    # The Job controller counts a failed pod in two steps (uncountedTerminatedPods, then failed).
    counted = max(int(job_status.get("failed") or 0),
                  len((job_status.get("uncountedTerminatedPods") or {}).get("failed") or []))
    if view.failed_for_good:
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
    if view.succeeded:
        # Reported before its pod exited 0, so the report is in a status read later than this Job.
        return Wait(round=want.round, phase=want.phase, reason=want.reason, shards=want.shards,
                    message=f"{want.message}: step {key} done, reading its report")
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


# The retries a step Job was made with (its backoffLimitPerIndex), for the messages.
STEP_TRIES_ANNOTATION = "batchinference.io/step-retries"


# How long a failed step's Job waits for its failed pods to be seen before failing the bij without them.
POD_GRACE_SECONDS = 30.0


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


# --- the decision ------------------------------------------------------------------------------


def round_job(
    job: BatchInferenceJob, round_no: int, observed_jobs: Sequence[Mapping[str, Any]]
) -> JobView | None:
    """The observed Job of `round_no` for this bij (by labels, so no name is computed twice)."""
    for raw in observed_jobs:
        view = JobView.of(raw)
        labels = (raw.get("metadata") or {}).get("labels") or {}
        if labels.get(JOB_LABEL) == job.metadata.name and view.round == round_no and CANARY_LABEL not in labels:
            return view
    return None


def canary_job(job: BatchInferenceJob, observed_jobs: Sequence[Mapping[str, Any]]) -> JobView | None:
    """The observed canary Job of this bij (spec.canary, round 0)."""
    for raw in observed_jobs:
        labels = (raw.get("metadata") or {}).get("labels") or {}
        if labels.get(JOB_LABEL) == job.metadata.name and labels.get(CANARY_LABEL):
            return JobView.of(raw)
    return None


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
    done = int(counted.result.get("done") or 0)
    if done < k or (view.failure is not None and view.failure.reason == "PodFailurePolicy"):
        # Lanes failed with canary shards left, or a worker said the configuration is bad (exit 42).
        return job_failed(0, view, Shards(done=done, total=k))
    return canary_verdict(job, rec, counted.result)


def canary_verdict(job: BatchInferenceJob, rec: RoundRecord, result: Mapping[str, Any]) -> CanaryVerdict:
    """The canary's figures (the canary step's `result`) against spec.canary's thresholds, and the estimate of
    round 0 whole at its pace."""
    spec = job.spec.canary
    assert spec is not None
    figures = CanaryFigures.from_status(result)
    failures = broken(spec, figures)
    w = job.spec.workers
    est = estimate(figures, rec.bytes, min(rec.lanes or 1, w.parallelism), w.price_per_hour, w.nodes_per_lane)
    examples = [dict(e) for e in result.get("examples") or []]
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


def owns(job: BatchInferenceJob, raw_job: Mapping[str, Any]) -> bool:
    """Whether a Job found by name was made for this bij (a 409 on create may be someone else's)."""
    labels = (raw_job.get("metadata") or {}).get("labels") or {}
    return labels.get(JOB_LABEL) == job.metadata.name and is_ours(job, JobView.of(raw_job))


def is_ours(job: BatchInferenceJob, view: JobView) -> bool:
    """A Job left over from a deleted bij of the same name belongs to another uid."""
    if view.deleting:
        return False
    uid = job.metadata.uid
    return uid is None or not view.owner_uids or uid in view.owner_uids


def decide(
    job: BatchInferenceJob,
    status: Mapping[str, Any],
    observed_jobs: Sequence[Mapping[str, Any]],
    shards_done: int | None = None,
    *,
    lanes_reported: LaneTally | None = None,
    now: dt.datetime | None = None,
    pods: Sequence[Mapping[str, Any]] = (),
    generation: int | None = None,
    check_permissions: bool = False,
) -> Decision:
    """The next step for `job`, given its current ``status``, the Jobs labelled with its name,
    how many shards of the current round its lanes reported done (None: not looked at) and the rest of
    their reports summed (`lanes_reported`: replaced lane groups), the failed
    pods of its step Jobs (`pods`), its metadata.generation and `now` (default: the clock), which
    decides whether spec.deadlineSeconds has passed and whether a step's retry is due. Once the round's
    Job ended its finish step counts the shards done and the damaged objects its workers stopped at.
    `check_permissions` (where pods run under RBAC: the operator, not `bij run`): before round 0 is
    planned, the worker identity's grants are checked and a bij whose pods would be refused waits
    (`permissions_gate`).

    The Job has one index per lane and a lane works many shards, so the round is over when every
    shard is done: a lane that failed for good costs nothing if the others finished its shards.
    """
    status = status or {}
    state = JobStatus.read(status)
    phase = state.phase
    r = state.current_round
    now = now or dt.datetime.now(dt.timezone.utc)
    seen = Observation(status=status, state=state, jobs=observed_jobs, pods=pods, generation=generation, now=now)

    if phase == "Succeeded":
        return Nothing(round=r, phase="Succeeded", reason="Published",
                       message=_condition_message(state, "Succeeded") or "manifest published")
    if phase == "Failed" and failure_reason(state) not in RECOVERABLE_FAILURES:
        return Nothing(round=r, phase="Failed", reason=failure_reason(state) or "Failed",
                       message=_condition_message(state, "Failed") or "failed")
    if phase in STOPPED_PHASES:
        return Nothing(round=r, phase=phase, reason=phase, message=state.message or phase.lower())
    if phase == "CanaryFailed":
        return Nothing(round=r, phase="CanaryFailed", reason="CanaryFailed", message=state.message or "canary failed")

    if check_permissions and not state.rounds:
        # Only before anything ran (a bij already under way when this check came in is left alone), and
        # before a stop too: cancelling plans round 0 in a pod, which would be refused as well. A held bij
        # that is cancelled or expires ends so at once, without its grants and without a pod.
        held = permissions_gate(job, status, now)
        if held is not None:
            stop = stop_requested(job, status, now)
            if stop is not None and held.reason == "MissingPermissions":
                return StopHeld(round=0, phase=stop.phase, reason=stop.phase,
                                message=f"{stop.message} while the bij was held before its first pod "
                                        f"({held.message}): nothing ran and nothing was published")
            return held

    stop = stop_requested(job, status, now)
    if stop is not None:
        return stopping_step(job, seen, stop)

    changed = spec_changed_since_planning(job, state)
    if changed:
        return MarkFailed(round=r, phase="Failed", reason="SpecChanged",
                          message=f"{', '.join(changed)} changed after round 0 was planned: rows made before and "
                                  "after would be mixed; undo the change, or delete and re-create the "
                                  "BatchInferenceJob to start over")

    rec = state.round_records().get(r)
    if rec is None:
        return step(job, seen, PlanRound(round=r, phase="Planning", reason="Planning", message=f"planning round {r}"))

    planned = rec.shards
    # A round planned before lanes existed has one lane per shard.
    lanes = rec.lanes or planned
    if rec.finished:
        # The round's results are recorded as complete; the Job may already be gone (TTL).
        return after_round(job, seen, r)
    if r == 0 and rec.canary_shards and job.spec.canary is not None:
        gate = canary_gate(job, seen, rec, shards_done)
        if gate is not None:
            return gate
    shards = Shards(done=min(shards_done, planned), total=planned) if shards_done is not None else None

    if job.spec.workers.pools and planned:
        got = pool_round(job, seen, r, lanes, planned, shards)
        if isinstance(got, Decision):
            return got
        merged, pool_lanes, recheck = got
        d = round_progress(job, seen, r, merged, planned, shards, lanes_reported, patch=False)
        if isinstance(d, Wait) and d.recheck is None and recheck is not None:
            d = dataclasses.replace(d, recheck=recheck)  # an unschedulable pod changes no Job: look again then
        return dataclasses.replace(d, pools=pool_lanes)

    view = round_job(job, r, observed_jobs)
    if view is None:
        if planned == 0:
            # Empty input: nothing to run, the round is trivially finished.
            return FinishRound(round=r, phase="Running", reason="RoundFinished", result={"done": 0},
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


def round_progress(job: BatchInferenceJob, seen: Observation, r: int, view: JobView, planned: int,
                   shards: Shards | None, lanes_reported: LaneTally | None, *, patch: bool = True) -> Decision:
    """The round from its Job (`view`; with pools, their Jobs merged): count and finish it once ended, keep the
    Job in line with the spec (`patch`: suspend, parallelism), or say how far it got."""
    if lanes_reported is not None and lanes_reported.round == r:
        view = dataclasses.replace(view, groups_replaced=lanes_reported.groups_replaced,
                                   last_group_lost=lanes_reported.last_group_lost)

    end: Mapping[str, Any] | None = None
    damaged: list[str] = []
    if view.failed_for_good or view.succeeded:
        # Its finish step counts the shards done (lanes that failed may have left some) and the statistics.
        counting = step(job, seen, FinishRound(
            round=r, phase="Running", reason="RoundFinishing", lanes=view.lanes,
            shards=Shards(done=planned, total=planned) if view.succeeded else shards,
            message=f"round {r}: Job {view.name} ended; counting its shards"))
        if not isinstance(counting, FinishRound) or counting.result is None:
            return counting
        end = counting.result
        shards = Shards(done=min(int(end.get("done") or 0), planned), total=planned)
        damaged = [str(m) for m in end.get("damaged") or []]
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
    if view.succeeded:
        return FinishRound(round=r, phase="Running", reason="RoundFinished",
                           message=f"round {r}: all {planned} shards done", shards=Shards(done=planned, total=planned),
                           lanes=view.lanes, result=end)

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


def publish_job(job: BatchInferenceJob, pass_name: str, observed_jobs: Sequence[Mapping[str, Any]]) -> JobView | None:
    """The observed Job of one publish pass of this bij."""
    for raw in observed_jobs:
        labels = (raw.get("metadata") or {}).get("labels") or {}
        if labels.get(JOB_LABEL) == job.metadata.name and labels.get(PUBLISH_LABEL) == pass_name:
            return JobView.of(raw)
    return None


def publishing(job: BatchInferenceJob, seen: Observation, r: int, partial: str | None = None) -> Decision:
    """The next publishing step: plan it, then one Job per pass in order, then the manifest.

    The passes' row-level work (duplicate ids across shards, result/error files) runs in the pods of
    the pass Jobs, in bounded memory; its plan and the manifest (from per-shard summaries) are storage
    steps in Jobs of their own (`steps`), so the operator's own work grows with shards, never with rows.
    """
    rounds = r + 1
    observed_jobs = seen.jobs
    rec = seen.state.publish or {}
    if rec.get("rounds") != rounds or not rec.get("planUri") or not isinstance(rec.get("passes"), Mapping):
        return step(job, seen, PreparePublish(round=r, phase="Publishing", reason="Publishing", partial=partial,
                                              message=f"publishing {rounds} round(s): planning the publish passes",
                                              rounds=rounds))
    for pass_name in PUBLISH_PASSES:
        count = int(rec["passes"].get(pass_name) or 0)
        if count == 0:
            continue
        view = publish_job(job, pass_name, observed_jobs)
        if view is None:
            pods = min(job.spec.workers.parallelism, count)
            return CreatePublishJob(round=r, phase="Publishing", reason="Publishing",
                                    message=f"publishing: pass {pass_name}, {count} indexes in {pods} pods",
                                    rounds=rounds, pass_name=pass_name, completions=pods,
                                    plan_uri=str(rec["planUri"]))
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
                                   plan_uri=str(rec["planUri"])))


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


def _condition_message(state: JobStatus, type_: str) -> str | None:
    return next((c.message for c in state.conditions if c.type == type_), None)


# --- worker pools (spec.workers.pools): the round's lanes in several Jobs, rules in `pools` -------------------


# A pool's Job with pods and no lane done yet is looked at again this often, in case they find no node.
POOL_RECHECK = 30.0


def pool_jobs(job: BatchInferenceJob, round_no: int,
              observed_jobs: Sequence[Mapping[str, Any]]) -> list[tuple[str, int, Mapping[str, Any]]]:
    """The observed Jobs of round `round_no` that run lanes in a pool: (pool name, lane offset, the Job)."""
    out = []
    for raw in observed_jobs:
        meta = raw.get("metadata") or {}
        labels = meta.get("labels") or {}
        offset = str((meta.get("annotations") or {}).get(LANE_OFFSET_ANNOTATION) or "")
        if labels.get(JOB_LABEL) == job.metadata.name and labels.get(ROUND_LABEL) == str(round_no) \
                and POOL_LABEL in labels and CANARY_LABEL not in labels and offset.isdigit():
            out.append((str(labels[POOL_LABEL]), int(offset), raw))
    return out


def merged_view(name: str, r: int, views: Sequence[tuple[int, JobView]]) -> JobView:
    """One view of the pools' Jobs of a round (each with its first lane): their lanes by lane id, ended (and
    succeeded) once every one has."""
    ended = bool(views) and all(v.succeeded or v.failed_for_good for _, v in views)
    conditions: dict[str, Condition] = {}
    if ended and all(v.succeeded for _, v in views):
        conditions["Complete"] = Condition(status=True, reason="", message="")
    elif ended:
        failure = next(v.failure for _, v in views if v.failure is not None)
        assert failure is not None
        conditions["Failed"] = failure
    return JobView(name=name, round=r, owner_uids=frozenset().union(*(v.owner_uids for _, v in views)),
                   deleting=False, completions=sum(v.completions for _, v in views),
                   parallelism=sum(v.parallelism or 0 for _, v in views),
                   suspend=all(v.suspend for _, v in views), active=sum(v.active for _, v in views),
                   terminating=sum(v.terminating for _, v in views),
                   completed=frozenset(o + i for o, v in views for i in v.completed),
                   failed=frozenset(o + i for o, v in views for i in v.failed), conditions=conditions)


def pool_round(job: BatchInferenceJob, seen: Observation, r: int, lanes: int, planned: int,
               shards: Shards | None) -> Decision | tuple[JobView, tuple[PoolLanes, ...], float | None]:
    """Round `r` over spec.workers.pools (`pools`): create each block's Job in the pool it runs in now, move
    the lanes of a pool that gives up, keep the Jobs suspended as the spec says; else the pools' Jobs merged
    into one view, each pool's lanes for the status, and when to look again for a pool's start timeout."""
    spec_pools = job.spec.workers.pools
    index = {p.name: i for i, p in enumerate(spec_pools)}
    recorded = {p.name: p for p in seen.state.pools}
    gave_up = {index[n] for n, p in recorded.items() if n in index and p.gave_up_round == r}
    placed = pools.placement(lanes, spec_pools, gave_up)
    wanted = {(spec_pools[p.pool].name, p.block.offset): p for p in placed if p.lanes}
    observed = {(name, offset): raw for name, offset, raw in pool_jobs(job, r, seen.jobs)}
    views = {key: JobView.of(raw) for key, raw in observed.items()}

    def status_of(moved: Mapping[str, str] | None = None) -> tuple[PoolLanes, ...]:
        out = []
        for i, p in enumerate(spec_pools):
            mine = [(key, v) for key, v in views.items() if key[0] == p.name and key in wanted]
            old = recorded.get(p.name)
            gave = moved is not None and p.name in moved
            out.append(PoolLanes(
                name=p.name, lanes=sum(w.lanes for w in placed if w.pool == i),
                active=sum(v.lanes.active for _, v in mine), done=sum(v.lanes.done for _, v in mine),
                price_per_hour=p.price_per_hour if p.price_per_hour is not None else job.spec.workers.price_per_hour,
                gave_up_round=r if gave else old.gave_up_round if old is not None else None,
                message=moved[p.name] if moved is not None and gave else old.message if old is not None else None))
        return tuple(out)

    # Jobs of a pool that gave up: deleted (again, if an earlier attempt stopped before it could).
    stale = [(key, v) for key, v in views.items() if key not in wanted and not v.deleting and is_ours(job, v)]
    if stale:
        (name, _), _ = stale[0]
        to = pools.home(index.get(name, 0), len(spec_pools), gave_up)
        return MovePoolLanes(round=r, phase="Pending", reason="PoolGaveUp", shards=shards, pools=status_of(),
                             pool=name, to_pool=spec_pools[to].name if to is not None else name,
                             job_names=tuple(v.name for _, v in stale),
                             message=f"round {r}: pool {name} gave its lanes up; deleting its Jobs")
    for key, p in wanted.items():
        if key not in views:
            suspend = job.spec.suspend
            pool = spec_pools[p.pool]
            moved = f" (taken over from pool {spec_pools[p.block.origin].name})" if p.pool != p.block.origin else ""
            return CreateJob(round=r, phase="Suspended" if suspend else "Pending",
                             reason="Suspended" if suspend else "RoundStarting", shards=shards or Shards(
                                 done=0, total=planned), pools=status_of(),
                             message=f"round {r}: creating the Job of pool {pool.name} for lanes "
                                     f"{p.block.offset}-{p.block.offset + p.lanes - 1}{moved}",
                             completions=p.lanes, suspend=suspend, pool=pool.name, name_suffix=p.suffix,
                             lane_offset=p.block.offset)
        if not is_ours(job, views[key]):
            return Wait(round=r, phase="Pending", reason="WaitingForOldJob",
                        message=f"Job {views[key].name} belongs to an earlier object of this name, or is being "
                                "deleted; waiting for it to go")
    recheck: float | None = None
    for key, p in wanted.items():
        v, pool = views[key], spec_pools[p.pool]
        if v.succeeded or v.failed_for_good:
            continue
        want = job.spec.suspend
        queued = bool(pool.queue_name or job.spec.workers.queue_name)
        patch = True if want and not v.suspend else False if not want and v.suspend and not queued else None
        if patch is not None:
            return PatchJob(round=r, phase="Suspended" if want else "Running",
                            reason="Suspended" if want else "Running", shards=shards, job_name=v.name,
                            suspend=patch, pools=status_of(),
                            message=f"round {r}: {'suspending' if want else 'resuming'} Job {v.name}")
        if v.suspend:
            continue
        why = pools.gives_up(v.name, v.completions, pool, seen.pods, seen.now)
        to = pools.next_pool(p.pool, len(spec_pools), gave_up)
        if why is not None and to is not None:
            return MovePoolLanes(round=r, phase="Pending", reason="PoolGaveUp", shards=shards,
                                 pools=status_of({pool.name: why}), pool=pool.name, to_pool=spec_pools[to].name,
                                 job_names=tuple(views[k].name for k in wanted if k[0] == pool.name),
                                 message=f"round {r}: pool {pool.name} gives its lanes to pool "
                                         f"{spec_pools[to].name}: {why}")
        left = pools.start_timeout_left(v.name, pool, seen.pods, seen.now) if to is not None else None
        if left is None and to is not None and v.active and not v.completed:
            # Its pods are not looked at yet (the operator lists them once they are slow to start): soon.
            left = min(float(pool.start_timeout_seconds), POOL_RECHECK)
        if left is not None:
            recheck = min(recheck, left + 1.0) if recheck is not None else left + 1.0
    name = ", ".join(views[k].name for k in wanted)
    return merged_view(name, r, [(k[1], views[k]) for k in wanted]), status_of(), recheck
