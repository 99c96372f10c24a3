"""A lane's report: how far a round's pod got, told to the operator through the bij's status.

``status.reports.lanes.<pod name>`` holds one `LaneReport` (camelCase JSON)::

    {"round": 0, "lane": 1, "shardsDone": 3, "rows": 1200, "errors": 2, "bytes": 524288, "at": "..."}

A pod counts only the shards it finished itself, so the sum over a round's lanes counts each shard
once. A pod whose lane of several pods is replaced says why in ``groupLost`` (a member says it with
its ``rank``). `bij.worker.report` writes them; the driver's progress, `reconcile.group_losses` and
`bij status` read them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic.alias_generators import to_camel


class LaneReport(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True)

    round: int
    lane: int
    rank: int | None = None  # a member of a lane of several pods (0 is the leader)
    shards_done: int = 0
    rows: int = 0
    errors: int = 0
    bytes: int = 0
    group_lost: str | None = None
    at: str = ""  # when it was sent, RFC 3339 UTC

    def as_status(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


def lane_reports(status: Mapping[str, Any], round_no: int) -> list[LaneReport]:
    """The reports of round `round_no`'s lanes in ``status.reports.lanes``. One that is no report (a
    foreign writer, a damaged value) is left out: the round is then judged by its Job and records
    (`JobStatus.read` names it, and the driver says so in the StatusDamaged condition)."""
    reported = (status.get("reports") or {}).get("lanes") or {}
    out = []
    for raw in reported.values() if isinstance(reported, Mapping) else ():
        if not isinstance(raw, Mapping) or raw.get("round") != round_no:
            continue
        try:
            out.append(LaneReport.model_validate(raw))
        except ValidationError:
            continue
    return out
