"""The decisions `decide()` returns: what to do next, plus how the bij should look once it is done.

Frozen data, one class per kind of step the driver applies (`driver.Driver`), and the phases a
bij ends in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from bij.contract.status import Phase, PoolLanes
from bij.contract.step_results import (
    CanaryResult,
    FinishResult,
    ManifestSummary,
    PlanResult,
    PublishPlanResult,
    StepResult,
)
from bij.control.observe import Lanes, Shards

# Cancelled and Expired: stopped for good by spec.cancel or spec.deadlineSeconds, the finished part published.
STOPPED_PHASES: frozenset[str] = frozenset({"Cancelled", "Expired"})
# CanaryFailed: spec.canary's rows broke a threshold; nothing more runs and nothing is published.
TERMINAL_PHASES: frozenset[str] = frozenset({"Succeeded", "Failed", "CanaryFailed"}) | STOPPED_PHASES
# Reasons under which a Failed phase is not final: a spec edit may clear it.
RECOVERABLE_FAILURES: frozenset[str] = frozenset({"InvalidSpec", "SpecChanged", "PlanRefused", "StorageRefused"})


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
    Job (`step` decided it may run); else the step's result, to be recorded (its kind's model)."""

    result: StepResult | None = None

    def step_args(self) -> dict[str, Any]:
        """The step's kind, round and arguments (`step_jobs.render_step_job`)."""
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

    result: PlanResult | None = None

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
    result: CanaryResult | None = None

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
    result: FinishResult | None = None

    def step_args(self) -> dict[str, Any]:
        return {"kind": "finish", "round_no": self.round}


@dataclass(frozen=True, kw_only=True)
class PreparePublish(StepDecision):
    """Check rounds ``0..rounds-1`` and write the publish plan (O(shards)); record it in ``status.publish``.
    ``partial``: Cancelled or Expired, the shards left unfinished are published as far as they got."""

    rounds: int
    partial: str | None = None
    result: PublishPlanResult | None = None

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
    result: ManifestSummary | None = None

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
