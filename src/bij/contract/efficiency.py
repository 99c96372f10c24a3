"""How well a job used its workers and what it cost, from the shards' completion records.

Pure functions over the records the workers write (one per shard: finished shards'
done records, running shards' progress records), so the operator's work grows with
shards, never with rows. Worker seconds are the time every run of a shard took, model
load included: a run carries on from the progress record the run before it left (written
every BIJ_PROGRESS_SECONDS and at a clean stop), so a pod killed outright loses at most
that interval from the count, and cost is then a slight underestimate.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


class EfficiencySums:
    """The running sums `efficiency` reports, added one record at a time: a step streams a round's
    records through one of these and holds no record after it is added."""

    def __init__(self) -> None:
        self.worker = self.load = self.busy = 0.0
        self.rows = self.tokens = self.loads = self.weights_bytes = 0
        self.slowest_load = 0.0
        self.pools: dict[str, float] = {}  # worker seconds per pool (spec.workers.pools), from the records' pool

    def add(self, rec: Mapping[str, Any]) -> None:
        self.load += float(rec.get("modelLoadSeconds") or 0)
        self.slowest_load = max(self.slowest_load, float(rec.get("modelLoadSeconds") or 0))
        self.weights_bytes += int(rec.get("weightsBytes") or 0)
        # Records from before lanes count a load wherever one took time (one process per shard then).
        self.loads += (int(rec["modelLoads"]) if "modelLoads" in rec
                       else int(float(rec.get("modelLoadSeconds") or 0) > 0))
        seconds = float(rec.get("seconds") or 0) + float(rec.get("modelLoadSeconds") or 0)
        self.worker += seconds
        pool = rec.get("pool")
        if isinstance(pool, str) and pool:
            self.pools[pool] = self.pools.get(pool, 0.0) + seconds
        self.busy += float(rec.get("engineBusySeconds") or 0)
        self.rows += int(rec.get("rows") or 0)
        self.tokens += int(rec.get("tokensIn") or 0) + int(rec.get("tokensOut") or 0)

    def result(self) -> dict[str, Any]:
        """What `efficiency` returns for the records added so far."""
        worker, busy = self.worker, self.busy
        return {
            "workerSeconds": round(worker, 3),
            "modelLoads": self.loads,
            "modelLoadSeconds": round(self.load, 3),
            # The slowest lane's load (weights copied included), and the weights copied from object storage.
            "slowestModelLoadSeconds": round(self.slowest_load, 3),
            "weightsBytes": self.weights_bytes,
            "engineBusySeconds": round(busy, 3),
            "engineBusyFraction": round(busy / worker, 4) if worker else 0.0,
            "rowsPerSecondPerWorker": round(self.rows / worker, 3) if worker else 0.0,
            "tokensPerSecondPerWorker": round(self.tokens / worker, 3) if worker else 0.0,
            **({"workerSecondsByPool": {k: round(v, 3) for k, v in sorted(self.pools.items())}} if self.pools else {}),
        }


def efficiency(records: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Worker seconds, model loads and their seconds, engine busy seconds and fraction, rows/s and tokens/s
    per worker."""
    sums = EfficiencySums()
    for rec in records:
        sums.add(rec)
    return sums.result()


def cost(price_per_hour: float | None, worker_seconds: float, rows: int, tokens: int,
         pods_per_lane: int = 1, *, pool_prices: Mapping[str, float | None] | None = None,
         by_pool: Mapping[str, float] | None = None) -> dict[str, Any] | None:
    """What the worker pods cost at `price_per_hour` (one pod, any currency); None without a price.
    `worker_seconds` are the lanes' (their leaders'); a lane of several pods (spec.workers.nodesPerLane)
    costs that many pods meanwhile. With spec.workers.pools, the seconds of each pool (`by_pool`, from
    `efficiency`'s workerSecondsByPool) cost that pool's price (`pool_prices`), the rest `price_per_hour`;
    ``pools`` then says what each pool cost.

    perMillionRows = total / rows x 1e6 (result rows), perMillionTokens likewise over tokens in + out.
    """
    prices = {k: v for k, v in (pool_prices or {}).items() if v is not None}
    if price_per_hour is None and not prices:
        return None
    per_pool = {name: (prices.get(name) or price_per_hour or 0.0) * s * pods_per_lane / 3600
                for name, s in (by_pool or {}).items() if pool_prices is not None}
    rest = worker_seconds - sum(s for name, s in (by_pool or {}).items() if name in per_pool)
    total = sum(per_pool.values()) + (price_per_hour or 0.0) * max(0.0, rest) * pods_per_lane / 3600
    return {
        **({"podsPerLane": pods_per_lane} if pods_per_lane > 1 else {}),
        **({"pools": {k: round(v, 6) for k, v in per_pool.items()}} if per_pool else {}),
        "pricePerHour": price_per_hour if price_per_hour is not None else 0.0,
        "total": round(total, 6),
        "perMillionRows": round(total / rows * 1e6, 6) if rows else None,
        "perMillionTokens": round(total / tokens * 1e6, 6) if tokens else None,
    }


def eta_seconds(done: float, total: float, elapsed: float) -> float | None:
    """Seconds left at the rate so far (`done` of `total` in `elapsed` seconds); None before any progress."""
    if total <= 0 or done <= 0 or elapsed <= 0:
        return None
    if done >= total:
        return 0.0
    return elapsed * (total - done) / done


def fmt_duration(seconds: float | None) -> str:
    """`1h02m`, `12m30s`, `45s`; `?` when unknown."""
    if seconds is None:
        return "?"
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def fmt_money(value: float | None) -> str:
    """An amount with four significant digits, never in exponent form (no currency: the price's own)."""
    if value is None:
        return "-"
    if value == 0:
        return "0"
    decimals = max(0, 3 - math.floor(math.log10(abs(value))))
    return f"{value:,.{decimals}f}"


def status_fields(records: Sequence[Mapping[str, Any]], current: Sequence[Mapping[str, Any]], round_bytes: int | None,
                  round_seconds: float | None, price_per_hour: float | None,
                  pods_per_lane: int = 1, pool_prices: Mapping[str, float | None] | None = None) -> dict[str, Any]:
    """`efficiency`, `cost` (so far) and `eta` for the bij's status.

    `records` are every shard record so far (all rounds), `current` the current round's;
    the ETA is the current round's: its input bytes done against `round_bytes` over the
    `round_seconds` it has run.
    """
    eff = efficiency(records)
    out: dict[str, Any] = {"efficiency": eff}
    rows = sum(int(r.get("rows") or 0) for r in records)
    tokens = sum(int(r.get("tokensIn") or 0) + int(r.get("tokensOut") or 0) for r in records)
    spent = cost(price_per_hour, eff["workerSeconds"], rows, tokens, pods_per_lane, pool_prices=pool_prices,
                 by_pool=eff.get("workerSecondsByPool"))
    if spent is not None:
        out["cost"] = spent
    if round_bytes and round_seconds is not None:
        done = sum(int(r.get("bytes") or 0) for r in current)
        out["eta"] = fmt_duration(eta_seconds(done, round_bytes, round_seconds))
    return out
