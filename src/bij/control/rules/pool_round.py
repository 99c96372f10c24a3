"""Worker pools (spec.workers.pools): the round's lanes in several Jobs, the plain rules in `control.pools`.

`pool_round` creates each block's Job in the pool it runs in now, moves the lanes of a pool that gives up,
and merges the pools' Jobs into one view the round's rules read (`pooled_round`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence

from bij.contract.lane_report import LaneTally
from bij.contract.spec import BatchInferenceJob
from bij.contract.status import PoolLanes
from bij.control import pools
from bij.control.decisions import (
    CreateJob,
    Decision,
    MovePoolLanes,
    PatchJob,
    Wait,
)
from bij.control.observe import (
    JobView,
    Observation,
    Shards,
    is_ours,
    merged_view,
    pool_jobs,
)
from bij.control.rules.rounds import round_progress

# A pool's Job with pods and no lane done yet is looked at again this often, in case they find no node.
POOL_RECHECK = 30.0


def pooled_round(job: BatchInferenceJob, seen: Observation, r: int, lanes: int, planned: int,
                 shards: Shards | None, lanes_reported: LaneTally | None) -> Decision:
    """Round `r` over spec.workers.pools: what `pool_round` decides, else the round's rules over the pools' Jobs
    merged (`rounds.round_progress`, patching no Job: `pool_round` keeps each in line), with each pool's lanes."""
    got = pool_round(job, seen, r, lanes, planned, shards)
    if isinstance(got, Decision):
        return got
    merged, pool_lanes, recheck = got
    d = round_progress(job, seen, r, merged, planned, shards, lanes_reported, patch=False)
    if isinstance(d, Wait) and d.recheck is None and recheck is not None:
        d = dataclasses.replace(d, recheck=recheck)  # an unschedulable pod changes no Job: look again then
    return dataclasses.replace(d, pools=pool_lanes)

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
        return _pool_status(job, r, placed, wanted, views, recorded, moved)

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
    return _running_pools(job, seen, r, shards, wanted, views, gave_up, status_of)


def _pool_status(job: BatchInferenceJob, r: int, placed: Sequence[pools.Placed],
                 wanted: Mapping[tuple[str, int], pools.Placed], views: Mapping[tuple[str, int], JobView],
                 recorded: Mapping[str, PoolLanes], moved: Mapping[str, str] | None) -> tuple[PoolLanes, ...]:
    """Each pool's lanes for the status (``pools``): placed, active and done, and the round it gave them up in
    (`moved`: the pools that give up now, and why)."""
    spec_pools = job.spec.workers.pools
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


def _running_pools(job: BatchInferenceJob, seen: Observation, r: int, shards: Shards | None,
                   wanted: Mapping[tuple[str, int], pools.Placed], views: Mapping[tuple[str, int], JobView],
                   gave_up: Collection[int], status_of: Callable[..., tuple[PoolLanes, ...]],
                   ) -> Decision | tuple[JobView, tuple[PoolLanes, ...], float | None]:
    """Every pool's Job exists: suspend or resume each as the spec says, move the lanes of a pool that gives
    up; else the Jobs merged into one view, each pool's lanes, and when to look again for a start timeout."""
    spec_pools = job.spec.workers.pools
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
