"""One entry of ``status.rounds``: what the operator recorded about a round (camelCase JSON)::

    {"round": 0, "shards": 8, "lanes": 2, "bytes": 1048576, "startTime": "...", "specDigests": {...},
     "completionTime": "...", "rowsIn": 980, "approved": 970, "rejected": 0, "capped": 0, "errors": 10,
     "approvalRate": 0.9898, "engineCalls": 31, "groupsReplaced": 1}

Planning a round writes the first line (`specDigests` on round 0 only); finishing it adds the
statistics (`RoundStats.as_status`) and its completion time. `decide()`, the driver's progress,
`bij run` and `bij status` read it through `round_records`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from bij.contract.rounds import RoundStats
from bij.contract.schema import FREE_FORM, INT64


class RoundRecord(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True,
                              json_schema_extra=FREE_FORM)

    round: int
    shards: int = 0
    lanes: int = 0  # 0: a round planned before lanes existed, one lane per shard
    bytes: int = 0
    start_time: str | None = None
    completion_time: str | None = None  # set once the round's statistics are recorded
    spec_digests: dict[str, str] | None = None  # round 0: the row-deciding spec fields (fingerprint)
    rows_in: int = Field(0, json_schema_extra=INT64)
    approved: int = Field(0, json_schema_extra=INT64)
    rejected: int = Field(0, json_schema_extra=INT64)
    capped: int = 0
    approval_rate: float | None = None
    errors: int = 0
    engine_calls: int = 0
    groups_replaced: int = 0
    canary_shards: int = 0  # round 0 with spec.canary: how many of its shards (`canary_shards`) run alone first

    @property
    def finished(self) -> bool:
        return bool(self.completion_time)

    def stats(self) -> RoundStats:
        """The round's statistics as recorded (zeros before it finished)."""
        return RoundStats(**{f.name: getattr(self, f.name) for f in dataclasses.fields(RoundStats)})


def round_records(status: Mapping[str, Any]) -> dict[int, RoundRecord]:
    """``status.rounds`` keyed by round number; an entry that is no record (no round number, a field of
    the wrong type) is left out (`JobStatus.read` names it, and the driver says so in the StatusDamaged
    condition)."""
    out: dict[int, RoundRecord] = {}
    rounds = status.get("rounds") or []
    for raw in rounds if isinstance(rounds, list) else ():
        if isinstance(raw, Mapping) and isinstance(raw.get("round"), int):
            try:
                rec = RoundRecord.model_validate(raw)
            except ValidationError:
                continue
            out[rec.round] = rec
    return out
