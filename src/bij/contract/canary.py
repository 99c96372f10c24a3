"""The canary (spec.canary): a few shards of round 0, spread over the input, run alone, and their figures decide
whether the rest runs.

Pure functions over plain data, shared by the plan step (how many shards the canary takes), the workers and the
canary step (which shards those are, and their figures, from the shards' completion records) and `decide()`
(its verdict, the job's estimate):

- `canary_rows`: the rows the canary asks for (spec.canary.rows, else 0.5% of the input's, at most 2,000);
- `canary_shards`: which `count` shards of a round: spread over its plan (which is in input order), so that
  a template, a schema or a length limit that only some stretch of the input breaks is met in the canary;
- `spread_count`: how many such shards hold that many rows (estimated);
- `CanaryFigures.of`: the shares and the tokens per second per lane, from completion records;
- `broken`: the thresholds the figures break (empty: it passed);
- `estimate`: the whole job's lane-time, wall time and cost at the canary's pace.

The canary's shards are ordinary shards of round 0: their durable results are the ones the full run keeps.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bij.contract.efficiency import fmt_money
from bij.contract.manifest import CanaryCheck
from bij.contract.spec import CANARY_MAX_ROWS, CANARY_SHARE, CanarySpec

# Failing rows the verdict quotes (ids and error messages): enough to see the pattern, the status stays small.
MOST_EXAMPLES = 3


def canary_rows(spec: CanarySpec, input_rows: float) -> int:
    """Rows the canary runs at least: spec.canary.rows, else CANARY_SHARE of the (estimated) input, at most
    CANARY_MAX_ROWS; one at least."""
    if spec.rows is not None:
        return spec.rows
    return max(1, min(CANARY_MAX_ROWS, math.ceil(input_rows * CANARY_SHARE)))


def canary_shards(total: int, count: int) -> list[int]:
    """The canary's `count` shards of a round of `total` shards, in order: the j-th at the middle of the j-th
    of `count` equal stretches of the plan, which is in input order. All the round's shards when `count` is
    the round's. Whichever lanes own them, the canary Job's lanes take them (`worker.lanes`, `only`)."""
    count = max(0, min(count, total))
    # Stretches are at least a shard long (count <= total), so their middles fall on distinct shards.
    return [(2 * j + 1) * total // (2 * count) for j in range(count)]


def spread_count(shard_rows: Sequence[float], wanted: int) -> int:
    """How many shards `canary_shards` must take to hold `wanted` rows (each shard's rows estimated): one at
    least, all at most. Grown from the mean shard's rows until they do (more rows than asked where the
    shards taken are longer than the mean, never fewer unless the round holds fewer)."""
    total = len(shard_rows)
    if not total:
        return 0
    mean = max(sum(shard_rows) / total, 1e-9)
    count = max(1, min(total, math.ceil(wanted / mean)))
    while count < total:
        got = sum(shard_rows[s] for s in canary_shards(total, count))
        if got >= wanted:
            break
        count = min(total, count + max(1, math.ceil((wanted - got) / mean)))
    return count


@dataclass(frozen=True)
class CanaryFigures:
    """What the canary's shards did: rows in, error rows, answers cut at their token cap, schema violations,
    output tokens, and the seconds their lanes worked (`seconds` of each completion record, summed)."""

    shards: int
    rows: int  # result rows
    errors: int
    length_cuts: int
    schema_violations: int
    tokens_out: int
    lane_seconds: float
    bytes: int  # input bytes (Parquet: rows) behind them, to scale to the whole round

    @classmethod
    def of(cls, records: Iterable[Mapping[str, Any]]) -> CanaryFigures:
        """Summed from completion records (`ShardRecord`) in one pass, holding none of them; counts a record
        lacks (an older worker's) are 0."""
        keys = ("rows", "errors", "lengthCuts", "structuredViolations", "tokensOut", "bytes")
        sums = dict.fromkeys(keys, 0)
        shards, seconds = 0, 0.0
        for r in records:
            shards += 1
            seconds += float(r.get("seconds") or 0.0)
            for k in keys:
                sums[k] += int(r.get(k) or 0)
        return cls(shards=shards, rows=sums["rows"], errors=sums["errors"], length_cuts=sums["lengthCuts"],
                   schema_violations=sums["structuredViolations"], tokens_out=sums["tokensOut"],
                   lane_seconds=round(seconds, 3), bytes=sums["bytes"])

    @property
    def rows_in(self) -> int:
        return self.rows + self.errors

    def share(self, n: int) -> float:
        return n / self.rows_in if self.rows_in else 0.0

    @property
    def tokens_per_second_per_lane(self) -> float:
        return self.tokens_out / self.lane_seconds if self.lane_seconds > 0 else 0.0

    def as_status(self) -> dict[str, Any]:
        return {"shards": self.shards, "rows": self.rows_in, "errors": self.errors, "lengthCuts": self.length_cuts,
                "schemaViolations": self.schema_violations, "tokensOut": self.tokens_out,
                "laneSeconds": self.lane_seconds, "bytes": self.bytes,
                "tokensPerSecondPerLane": round(self.tokens_per_second_per_lane, 3)}

    @classmethod
    def from_status(cls, doc: Mapping[str, Any]) -> CanaryFigures:
        """The inverse of `as_status` (a canary step's result)."""
        errors = int(doc.get("errors") or 0)
        return cls(shards=int(doc.get("shards") or 0), rows=int(doc.get("rows") or 0) - errors, errors=errors,
                   length_cuts=int(doc.get("lengthCuts") or 0), schema_violations=int(doc.get("schemaViolations") or 0),
                   tokens_out=int(doc.get("tokensOut") or 0), lane_seconds=float(doc.get("laneSeconds") or 0.0),
                   bytes=int(doc.get("bytes") or 0))


def broken(spec: CanarySpec, f: CanaryFigures) -> list[str]:
    """Each threshold of spec.canary the figures break, said with the figure and the limit; empty: passed."""
    out = []
    checks = ((spec.max_error_share, f.errors, "error rows", "maxErrorShare"),
              (spec.max_length_cut_share, f.length_cuts, "answers cut at maxTokens", "maxLengthCutShare"),
              (spec.max_schema_violation_share, f.schema_violations, "rows broke the schema",
               "maxSchemaViolationShare"))
    for limit, n, what, field in checks:
        if limit is not None and f.rows_in and f.share(n) > limit:
            out.append(f"{n} of {f.rows_in} {what} ({f.share(n):.1%}), above spec.canary.{field} {limit:.1%}")
    floor = spec.min_tokens_per_second_per_lane
    if floor is not None and f.tokens_per_second_per_lane < floor:
        out.append(f"{f.tokens_per_second_per_lane:,.1f} output tokens/s per lane, below "
                   f"spec.canary.minTokensPerSecondPerLane {floor:g}")
    return out


def estimate(f: CanaryFigures, round_bytes: int, lanes: int, price_per_hour: float | None,
             nodes_per_lane: int = 1) -> dict[str, Any]:
    """The whole of round 0 at the canary's pace: rows, lane-seconds, wall seconds on `lanes` lanes and, with a
    price per worker pod hour, the cost. Scaled by input bytes (Parquet: rows), so rows of unequal length
    scale as the canary's did."""
    scale = round_bytes / f.bytes if f.bytes else 0.0
    lane_seconds = f.lane_seconds * scale
    out: dict[str, Any] = {"rows": round(f.rows_in * scale), "laneSeconds": round(lane_seconds, 1),
                           "seconds": round(lane_seconds / max(1, lanes), 1)}
    if price_per_hour is not None:
        out["cost"] = round(lane_seconds / 3600 * price_per_hour * nodes_per_lane, 4)
    return out


def accuracy(est: Mapping[str, Any], actual: CanaryFigures, shards: int, price_per_hour: float | None,
             nodes_per_lane: int = 1) -> CanaryCheck:
    """The canary's estimate of round 0 (made from its `shards` shards) against round 0 as it ran: rows,
    lane-seconds and cost each, and the estimate's error (estimate / actual - 1: +0.1 means 10% too high).
    Wall time is left out: only the status knows when the round began and ended."""
    done: dict[str, Any] = {"rows": actual.rows_in, "laneSeconds": round(actual.lane_seconds, 1)}
    if price_per_hour is not None:
        done["cost"] = round(actual.lane_seconds / 3600 * price_per_hour * nodes_per_lane, 4)
    error = {k: round(float(est[k]) / float(v) - 1, 4) for k, v in done.items() if k in est and v}
    return CanaryCheck(shards=shards, estimate={k: est[k] for k in done if k in est}, actual=done, error=error)


def describe_estimate(est: Mapping[str, Any]) -> str:
    """One line for the status message and the console."""
    secs = float(est.get("seconds") or 0.0)
    text = f"about {int(est.get('rows') or 0):,} rows in {_duration(secs)}"
    if est.get("cost") is not None:
        text += f", costing about {fmt_money(float(est['cost']))}"
    return text


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"
