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
Job completed. Judge rounds hang off `rules.rounds.after_round()`: a finished round either
publishes or plans the next round.

What touches storage (planning a round, counting a finished round, the publish plan, the manifest)
runs as a one-pod step Job whose pod reports a `StepReport` into ``status.reports.steps``; such a
decision (`PlanRound`, `FinishRound`, `PreparePublish`, `Publish`) is decided by `rules.steps.step()` from the
step's Job, its pods and its report like a round is from its Job: run it (``result`` None), wait,
retry, fail, or record its ``result``. A pod that dies is run again by its Job
(spec.workers.backoffLimitPerIndex, one retry policy for steps and rounds), each retry said; a Job
that gave up fails the bij naming the step, its pod and the cause.

`decide()` is a short dispatcher, as Kubernetes' Job controller keeps its rules apart: what it reads of the
cluster is `observe`, what it returns `decisions`, and each rule is a module of `rules` (`ended`,
`permissions`, `stop`, `steps`, `rounds`, `canary`, `publish`, `pool_round`).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from typing import Any

from bij.contract.lane_report import LaneTally
from bij.contract.spec import BatchInferenceJob
from bij.contract.status import JobStatus
from bij.control.decisions import (
    Decision,
    PlanRound,
)
from bij.control.observe import (
    Observation,
    Shards,
)
from bij.control.rules.canary import canary_gate
from bij.control.rules.ended import ended
from bij.control.rules.permissions import held_before_first_pod
from bij.control.rules.pool_round import pooled_round
from bij.control.rules.rounds import after_round, single_job_round, spec_changed
from bij.control.rules.steps import step
from bij.control.rules.stop import stopping_step
from bij.control.stopping import stop_requested


def decide(job: BatchInferenceJob, status: Mapping[str, Any], observed_jobs: Sequence[Mapping[str, Any]],
           shards_done: int | None = None, *, lanes_reported: LaneTally | None = None, now: dt.datetime | None = None,
           pods: Sequence[Mapping[str, Any]] = (), generation: int | None = None,
           check_permissions: bool = False) -> Decision:
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
    r = state.current_round
    now = now or dt.datetime.now(dt.timezone.utc)
    seen = Observation(status=status, state=state, jobs=observed_jobs, pods=pods, generation=generation, now=now)
    over = ended(state)
    if over is not None:
        return over
    if check_permissions and not state.rounds:
        # Only before anything ran (a bij already under way when this check came in is left alone).
        held = held_before_first_pod(job, status, now)
        if held is not None:
            return held
    stop = stop_requested(job, status, now)
    if stop is not None:
        return stopping_step(job, seen, stop)
    changed = spec_changed(job, state)
    if changed is not None:
        return changed
    rec = state.round_records().get(r)
    if rec is None:
        return step(job, seen, PlanRound(round=r, phase="Planning", reason="Planning", message=f"planning round {r}"))
    if rec.finished:
        # The round's results are recorded as complete; the Job may already be gone (TTL).
        return after_round(job, seen, r)
    if r == 0 and rec.canary_shards and job.spec.canary is not None:
        gate = canary_gate(job, seen, rec, shards_done)
        if gate is not None:
            return gate
    planned = rec.shards
    # A round planned before lanes existed has one lane per shard.
    lanes = rec.lanes or planned
    shards = Shards(done=min(shards_done, planned), total=planned) if shards_done is not None else None
    if job.spec.workers.pools and planned:
        return pooled_round(job, seen, r, lanes, planned, shards, lanes_reported)
    return single_job_round(job, seen, r, lanes, planned, shards, lanes_reported)
