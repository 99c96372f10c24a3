"""Judge rounds: what mode a round runs in, and whether another round follows.

Pure functions over round statistics (from the workers' completion records),
shared by `bij run` and the operator.

- ``rounds``: each round is one attempt per row; rejected rows become the next
  round's input, until nothing is rejected or `maxRounds` is reached.
- ``inPlace``: one round; the worker retries a rejected row up to `maxAttempts`.
- ``hybrid``: rounds first, then one last inPlace round once a round approves
  less than `hybridMinApprovalRate` of its rows, after
  `hybridSwitchAfterRounds` rounds, or at the `maxRounds` cap.

In the last round of any strategy, rows still rejected are "capped": published
in their own files and counted, never silently dropped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic.alias_generators import to_camel

from bij.contract.spec import JudgeSpec


@dataclass(frozen=True)
class RoundStats:
    round: int
    shards: int
    approved: int  # result rows (every result is approved when there is no judge)
    rejected: int  # sent on to the next round
    capped: int  # still rejected at the cap
    errors: int
    engine_calls: int = 0

    @property
    def rows_in(self) -> int:
        return self.approved + self.rejected + self.capped + self.errors

    @property
    def approval_rate(self) -> float:
        judged = self.approved + self.rejected + self.capped
        return self.approved / judged if judged else 1.0

    def as_fields(self) -> dict[str, Any]:
        """The statistics' fields of one entry of status.rounds (`RoundRecord`), by field name."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {**fields, "rows_in": self.rows_in, "approval_rate": round(self.approval_rate, 4)}

    def as_status(self) -> dict[str, Any]:
        """`as_fields`, camelCase."""
        return {to_camel(k): v for k, v in self.as_fields().items()}


@dataclass(frozen=True)
class RoundMode:
    mode: str  # "none" | "rounds" | "inPlace"
    final: bool  # rows rejected in this round are capped, not re-dispatched


class RoundSums:
    """The totals of `RoundStats`, added one completion record at a time (a step streams a round's
    records through one and holds none of them)."""

    def __init__(self) -> None:
        self.approved = self.rejected = self.capped = self.errors = self.engine_calls = 0

    def add(self, rec: Mapping[str, Any]) -> None:
        self.approved += int(rec.get("rows", 0))
        self.rejected += int(rec.get("rejected", 0))
        self.capped += int(rec.get("capped", 0))
        self.errors += int(rec.get("errors", 0))
        self.engine_calls += int(rec.get("engineCalls", 0))

    def stats(self, round_no: int, shard_count: int) -> RoundStats:
        return RoundStats(round=round_no, shards=shard_count, approved=self.approved, rejected=self.rejected,
                          capped=self.capped, errors=self.errors, engine_calls=self.engine_calls)


def summarize(round_no: int, shard_count: int,
              records: Mapping[int, Mapping[str, Any]] | Iterable[Mapping[str, Any]]) -> RoundStats:
    """A round's totals from its shards' completion records (`ShardRecord`s): a mapping by index, or
    any iterable of them, read once (a stream of a million records is never held)."""
    sums = RoundSums()
    for rec in records.values() if isinstance(records, Mapping) else records:
        sums.add(rec)
    return sums.stats(round_no, shard_count)


def round_mode(judge: JudgeSpec | None, history: list[RoundStats]) -> RoundMode:
    """The mode of the round after `history` (the finished rounds, in order)."""
    if judge is None:
        return RoundMode("none", True)
    round_no = len(history)
    last_allowed = round_no >= judge.max_rounds - 1
    if judge.strategy == "inPlace":
        return RoundMode("inPlace", True)
    if judge.strategy == "rounds":
        return RoundMode("rounds", last_allowed)
    # hybrid: switch once rounds stop paying off.
    stalled = bool(history) and history[-1].approval_rate < judge.hybrid_min_approval_rate
    if last_allowed or stalled or round_no >= judge.hybrid_switch_after_rounds:
        return RoundMode("inPlace", True)
    return RoundMode("rounds", False)


def needs_another_round(judge: JudgeSpec | None, history: list[RoundStats]) -> bool:
    """After the last round in `history`: is there another round to run (else publish)?"""
    if judge is None or not history:
        return False
    return history[-1].rejected > 0
