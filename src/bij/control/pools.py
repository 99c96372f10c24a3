"""Worker pools (spec.workers.pools): which lanes of a round run in which pool, and when a pool gives up.

A round's lanes (ids 0..lanes-1, as planned) are cut into blocks, one per pool in order of preference, each
up to the pool's maxLanes; lanes beyond every pool's room are not run (the running lanes take their shards,
as they take a failed lane's). A block runs as one Indexed Job whose index i is lane offset + i, so every
lane of every pool claims from the same round and each row is done once whichever pool runs it.

A pool gives up for the rest of the round when its pods stay unschedulable past its startTimeoutSeconds, or
are preempted again and again: its blocks move, lane ids and all, to the next pool that has not given up
(in order of preference, wrapping around), their shards inherited through the claims. The last pool left
never gives up: its lanes have nowhere to go. The next round starts from the preferred pool again, so
capacity that came back to a cheaper pool is used.

Plain functions over the spec, the observed Jobs and pods; `rules.pool_round.pool_round` turns them into decisions.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bij.contract.spec_workers import WorkerPool

# A pool whose pods were preempted this many times per lane it runs in one round gives up its lanes.
PREEMPTIONS_PER_LANE = 3


@dataclass(frozen=True)
class Block:
    """Lanes ``offset .. offset+lanes-1`` of a round, first given to pool number `origin`."""

    origin: int
    offset: int
    lanes: int


@dataclass(frozen=True)
class Placed:
    """Where a block runs now: pool number `pool`, with `lanes` of its lanes (the pool's room left)."""

    block: Block
    pool: int
    lanes: int

    @property
    def suffix(self) -> str:
        """The Job name's suffix after ``-r<round>``: ``-p<pool>``, or ``-p<pool>f<origin>`` for a moved block
        (pools by number: a bij's name leaves no room for a pool's)."""
        return f"-p{self.pool}" if self.pool == self.block.origin else f"-p{self.pool}f{self.block.origin}"


def blocks(lanes: int, pools: Sequence[WorkerPool]) -> list[Block]:
    """The round's `lanes` cut in order of preference: each pool up to its maxLanes (no limit: all the rest)."""
    out: list[Block] = []
    offset = 0
    for i, pool in enumerate(pools):
        left = lanes - offset
        if left <= 0:
            break
        n = left if pool.max_lanes is None else min(left, pool.max_lanes)
        out.append(Block(origin=i, offset=offset, lanes=n))
        offset += n
    return out


def home(origin: int, count: int, gave_up: Collection[int]) -> int | None:
    """The pool a block of pool `origin` runs in: `origin` unless it gave up, else the next pool that has not
    (wrapping around); None when every pool gave up."""
    for step in range(count):
        i = (origin + step) % count
        if i not in gave_up:
            return i
    return None


def placement(lanes: int, pools: Sequence[WorkerPool], gave_up: Collection[int]) -> list[Placed]:
    """Every block of the round where it runs now, with the lanes its pool has room for: a pool's own block first
    (its Job may be running), then the blocks it took over in order of origin; a block with no room runs no
    lanes (the others take its shards)."""
    homes = [(b, home(b.origin, len(pools), gave_up)) for b in blocks(lanes, pools)]
    used = [0] * len(pools)
    runs: dict[int, int] = {}
    for own in (True, False):
        for b, at in homes:
            if at is None or (at == b.origin) != own:
                continue
            cap = pools[at].max_lanes
            runs[b.origin] = n = b.lanes if cap is None else max(0, min(b.lanes, cap - used[at]))
            used[at] += n
    return [Placed(block=b, pool=at, lanes=runs[b.origin]) for b, at in homes if at is not None]


def next_pool(pool: int, count: int, gave_up: Collection[int]) -> int | None:
    """Where pool `pool`'s lanes go if it gives up now; None when no other pool is left to take them."""
    at = home(pool, count, {*gave_up, pool})
    return at


def _pods_of(job_name: str, pods: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    out = []
    for pod in pods:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        if labels.get("batch.kubernetes.io/job-name", labels.get("job-name")) == job_name:
            out.append(pod)
    return out


def _time(text: Any) -> dt.datetime | None:
    try:
        return dt.datetime.fromisoformat(str(text).replace("Z", "+00:00")) if text else None
    except ValueError:
        return None


def _condition(pod: Mapping[str, Any], type_: str) -> Mapping[str, Any] | None:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return c
    return None


def unschedulable(pod: Mapping[str, Any]) -> bool:
    """Whether the scheduler found no node for `pod` (PodScheduled False, reason Unschedulable)."""
    c = _condition(pod, "PodScheduled")
    return (pod.get("status") or {}).get("phase") == "Pending" and c is not None \
        and str(c.get("status")) == "False" and c.get("reason") == "Unschedulable"


def preempted(pod: Mapping[str, Any]) -> bool:
    """Whether `pod` ended by a disruption (spot reclaim, preemption, drain): condition DisruptionTarget."""
    c = _condition(pod, "DisruptionTarget")
    return (pod.get("status") or {}).get("phase") == "Failed" and c is not None and str(c.get("status")) == "True"


def scheduled(pod: Mapping[str, Any]) -> bool:
    c = _condition(pod, "PodScheduled")
    return c is not None and str(c.get("status")) == "True"


def gives_up(job_name: str, lanes: int, pool: WorkerPool, pods: Sequence[Mapping[str, Any]],
             now: dt.datetime) -> str | None:
    """Why the pool's Job `job_name` (running `lanes` lanes) should give its lanes to the next pool, or None:
    none of its pods found a node in startTimeoutSeconds, or its pods were preempted PREEMPTIONS_PER_LANE
    times per lane. A pool where some pods run keeps its lanes: those running take the others' shards."""
    mine = _pods_of(job_name, pods)
    lost = sum(1 for p in mine if preempted(p))
    if lanes and lost >= PREEMPTIONS_PER_LANE * lanes:
        return f"its pods were preempted {lost} times ({PREEMPTIONS_PER_LANE} per lane)"
    live = [p for p in mine if (p.get("status") or {}).get("phase") in ("Pending", "Running")]
    if not live or any(scheduled(p) for p in live):
        return None
    waiting = [p for p in live if unschedulable(p)]
    if len(waiting) != len(live):
        return None
    created = [t for p in waiting if (t := _time((p.get("metadata") or {}).get("creationTimestamp"))) is not None]
    if not created:
        return None
    waited = (now - min(created)).total_seconds()
    if waited < pool.start_timeout_seconds:
        return None
    c = _condition(waiting[0], "PodScheduled") or {}
    why = str(c.get("message") or "").strip()
    return (f"no node took its pods in {int(waited)}s (startTimeoutSeconds {pool.start_timeout_seconds})"
            + (f": {why}" if why else ""))


def start_timeout_left(job_name: str, pool: WorkerPool, pods: Sequence[Mapping[str, Any]],
                       now: dt.datetime) -> float | None:
    """Seconds until the pool's unschedulable pods reach startTimeoutSeconds (when to look again), or None."""
    waiting = [p for p in _pods_of(job_name, pods) if unschedulable(p)]
    created = [t for p in waiting if (t := _time((p.get("metadata") or {}).get("creationTimestamp"))) is not None]
    if not created:
        return None
    return max(0.0, pool.start_timeout_seconds - (now - min(created)).total_seconds())
