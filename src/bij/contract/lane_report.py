"""A lane's report: how far a round's pod got, told to the operator through a small object of its own.

Each pod of a round writes one `LaneReport` (camelCase JSON)::

    {"round": 0, "lane": 1, "shardsDone": 3, "rows": 1200, "errors": 2, "bytes": 524288, "at": "..."}

into a `coordination.k8s.io/v1` Lease named after the pod (annotation `REPORT_ANNOTATION`, labels
`JOB_LABEL` and `ROUND_LABEL`), never into the bij itself: the bij's status holds totals only, so its
size and the writes to it are the same at 10 lanes and 10,000 (as Kubernetes moved node heartbeats out of
``Node.status`` into Leases, KEP-589). Lanes report every `report_interval(lanes)` seconds, which grows
with the lane count so the writes of a whole round stay at `LANE_REPORTS_PER_SECOND`. `bij run` keeps the
same reports as files. The operator folds a round's reports into one `LaneTally` (running sums, a bounded
record of replaced groups), which is all that `decide()` and the status see of them.

A pod counts only the shards it finished itself, so the sum over a round's lanes counts each shard
once. A pod whose lane of several pods is replaced says why in ``groupLost`` (a member says it with
its ``rank``). `bij.worker.report` writes them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic.alias_generators import to_camel

from bij.contract.codes import API_GROUP

# The Lease annotation that holds a pod's report (JSON).
REPORT_ANNOTATION = f"{API_GROUP}/lane-report"
# A lane reports at most every this many seconds; with many lanes, less often (`report_interval`).
REPORT_SECONDS = 5.0
# Reports per second of a whole round, whatever its lane count: the API server's load from a bij's lanes.
LANE_REPORTS_PER_SECOND = 20.0


# The operator sums a running round's Leases at most this often; with many lanes, less often (`tally_interval`).
TALLY_SECONDS = 10.0
# ... about this many times per report interval of a pod, so the Leases it reads a second stay flat in lanes.
TALLIES_PER_REPORT = 5


def tally_interval(lanes: int) -> float:
    """Seconds between two sums of a round's Leases when it runs `lanes` pods: `TALLY_SECONDS`, or a fifth of
    their report interval where that is longer (10,000 pods: every 100 s), since a Lease changes no more often
    than its pod reports; the operator then reads the same number of Leases a second at any lane count."""
    return max(TALLY_SECONDS, report_interval(lanes) / TALLIES_PER_REPORT)


def report_interval(lanes: int) -> float:
    """Seconds between two reports of one pod when a round runs `lanes` pods: `REPORT_SECONDS`, or longer,
    so that all of them together send `LANE_REPORTS_PER_SECOND` (10,000 pods: one report each 500 s)."""
    return max(REPORT_SECONDS, max(lanes, 1) / LANE_REPORTS_PER_SECOND)


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

    @classmethod
    def parse(cls, raw: object) -> LaneReport | None:
        """`raw` as a report; None for what is none (a foreign writer, a damaged value)."""
        if not isinstance(raw, Mapping):
            return None
        try:
            return cls.model_validate(raw)
        except ValidationError:
            return None


class LaneTally(BaseModel):
    """A round's lane reports summed: the same size for 10 lanes and 10,000."""

    model_config = ConfigDict(frozen=True)

    round: int
    pods: int = 0  # pods that reported
    shards_done: int = 0
    rows: int = 0
    errors: int = 0
    bytes: int = 0
    groups_replaced: int = 0  # reports that said their lane's group of pods was replaced
    last_group_lost: str | None = None  # why, the latest one
    last_group_lost_at: str = ""
    last_at: str = ""  # the latest report

    def add(self, r: LaneReport) -> LaneTally:
        """This tally with `r` counted (`r` of this round)."""
        update: dict[str, Any] = {"pods": self.pods + 1, "shards_done": self.shards_done + r.shards_done,
                                  "rows": self.rows + r.rows, "errors": self.errors + r.errors,
                                  "bytes": self.bytes + r.bytes, "last_at": max(self.last_at, r.at)}
        if r.group_lost:
            update["groups_replaced"] = self.groups_replaced + 1
            if r.at >= self.last_group_lost_at:
                update["last_group_lost"], update["last_group_lost_at"] = r.group_lost, r.at
        return self.model_copy(update=update)


def tally(reports: Iterable[object], round_no: int) -> LaneTally:
    """Round `round_no`'s reports among `reports` (raw values or `LaneReport`s), summed; what is no report
    or of another round is left out. Streams: `reports` may be a generator over pages of a list."""
    out = LaneTally(round=round_no)
    for raw in reports:
        r = raw if isinstance(raw, LaneReport) else LaneReport.parse(raw)
        if r is not None and r.round == round_no:
            out = out.add(r)
    return out
