"""The round plan (`shards.json`): what the operator writes once per round and every worker reads.

On disk it is camelCase JSON:

    {"version": 1, "round": 0, "createdAt": ..., "roundPrefix": <output>/_bij/<job_id>/round-<r>,
     "inputUri": ..., "judgeMode": {"mode", "final"}, "job": <the BatchInferenceJob>,
     "objects": [{"uri", "size", "name", "rowGroups"?, "version"?}], "fingerprint": {"spec", "input"},
     "shards": [[[object, start, end], ...], ...], "lanes": N}

A round of more than `PART_SHARDS` shards is written in parts, so that a lane reads the shards it works
and not the whole round: the plan (the head) then lists no shards but says `"shardCount": S,
"partShards": N`, and each part `plan/<lane>-<chunk>.json` under the round prefix (`layout.plan_part_uri`)
holds `{"shards": [...]}`, the pieces of N of one lane's own shards (lane, lane + lanes, ...: chunk c
holds its shards c*N .. c*N+N-1), in order. The parts are written before the head, whose presence means
planned. `Plan.pieces` reads a shard's part on demand (a few kept, `PARTS_KEPT`); `Plan.iter_pieces`
streams every shard, one part at a time.

The job is parsed with the spec model (`contract.spec`), so the worker has the same defaults as
the operator. Plans written before lanes existed have no `lanes` (one shard per index, no
sharing); plans from before judge modes have no `judgeMode`.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, PrivateAttr, ValidationError
from pydantic.alias_generators import to_camel

from bij.contract import layout
from bij.contract.errors import BijError, json_object, validation_problems
from bij.contract.spec import BatchInferenceJob, JobSpec, SpecError, parse_job

PLAN_VERSION = 1

Piece = tuple[int, int, int]  # (object index, start, end): bytes, or row groups of a Parquet object
# A round of more shards than this is written in parts of this many shards each (read where a test sets it).
PART_SHARDS = 1000
# Parts a reader keeps in memory: a lane works its own shards part after part, and steals from the ends
# of a few others.
PARTS_KEPT = 4


class BadPlan(BijError):
    """A round plan that cannot be read: no retry fixes it."""

    permanent = True


class _Doc(BaseModel):
    # Unknown keys are ignored: a plan written by a newer operator still loads.
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True)


class PlanObject(_Doc):
    """One input object of the round, as listed when the round was planned."""

    uri: str
    size: int
    name: str | None = None  # relative to the input folder: error rows name it
    row_groups: list[int] | None = None  # rows per row group (Parquet objects)
    version: str | None = None  # ETag (s3://) or mtime in ns (file://): another version is refused
    # Set when the object replaced one that was damaged after `bytes` good uncompressed bytes, which
    # are durable as rows: the replacement must begin with the same bytes (sha256), or it is refused.
    prefix: tuple[int, str] | None = None

    @property
    def display_name(self) -> str:
        return self.name or self.uri


class JudgeMode(_Doc):
    mode: Literal["none", "rounds", "inPlace"] = "none"
    final: bool = True  # rows rejected in this round are capped, not re-dispatched


class Fingerprint(_Doc):
    spec: str  # digest of the row-deciding spec fields
    input: str  # digest of the input objects (uri, size, version)


class Plan(_Doc):
    """A round plan; `Plan.load` / `Plan.from_json` read one, `to_json` writes one."""

    version: int = PLAN_VERSION
    round: int = 0
    created_at: str | None = None
    round_prefix: str
    input_uri: str | None = None
    judge_mode: JudgeMode | None = None
    job: BatchInferenceJob
    objects: list[PlanObject]
    fingerprint: Fingerprint | None = None
    shards: list[list[Piece]] = []  # empty in a plan written in parts
    lanes: int | None = None  # None: a plan from before lanes, one shard per Job index
    shard_count: int | None = None  # written in parts: the round's shards
    part_shards: int | None = None  # written in parts: shards per part
    # Reads a part's bytes by URI (`with_reader`); parts read lately, by part key.
    _read: Callable[[str], bytes] | None = PrivateAttr(None)
    _parts: OrderedDict[tuple[int, int], list[list[Piece]]] = PrivateAttr(default_factory=OrderedDict)

    @property
    def spec(self) -> JobSpec:
        return self.job.spec

    @property
    def shard_total(self) -> int:
        """The round's shards, whether listed here or in parts."""
        return self.shard_count if self.shard_count is not None else len(self.shards)

    @property
    def in_parts(self) -> bool:
        return self.part_shards is not None

    @property
    def lane_count(self) -> int:
        """The round's lanes; a plan written before lanes existed has one per shard."""
        return self.lanes or self.shard_total

    def part_of(self, index: int) -> tuple[int, int, int]:
        """(lane, chunk, place in the part) of a shard of a plan written in parts."""
        assert self.part_shards is not None
        lanes = self.lane_count
        own = index // lanes
        return index % lanes, own // self.part_shards, own % self.part_shards

    def part_keys(self) -> list[tuple[int, int]]:
        """Every part's (lane, chunk), lane by lane."""
        assert self.part_shards is not None
        lanes, total = self.lane_count, self.shard_total
        return [(lane, chunk) for lane in range(min(lanes, total))
                for chunk in range(-(-len(range(lane, total, lanes)) // self.part_shards))]

    def split(self, part_shards: int | None = None) -> tuple[Plan, dict[str, bytes]]:
        """This plan as a head and its parts (URI -> JSON), when it has more than `part_shards` shards
        (default `PART_SHARDS`); else itself and no parts."""
        size = part_shards or PART_SHARDS
        if self.in_parts or len(self.shards) <= size:
            return self, {}
        lanes = self.lane_count
        head = self.model_copy(update={"shards": [], "shard_count": len(self.shards), "part_shards": size,
                                       "lanes": lanes})
        parts = {}
        for lane, chunk in head.part_keys():
            first = lane + chunk * size * lanes
            stop = min(len(self.shards), first + size * lanes)
            body = {"shards": self.shards[first:stop:lanes]}
            uri = layout.plan_part_uri(self.round_prefix, lane, chunk)
            parts[uri] = json.dumps(body, separators=(",", ":")).encode()
        return head, parts

    def with_reader(self, read: Callable[[str], bytes]) -> Plan:
        """This plan, reading its parts (if written in parts) with `read` (a URI's bytes)."""
        self._read = read
        return self

    def _part(self, lane: int, chunk: int) -> list[list[Piece]]:
        key = (lane, chunk)
        got = self._parts.get(key)
        if got is not None:
            self._parts.move_to_end(key)
            return got
        if self._read is None:
            raise BadPlan("a round plan written in parts was read without its parts")
        uri = layout.plan_part_uri(self.round_prefix, lane, chunk)
        doc = json_object(self._read(uri), f"round plan part {uri}", BadPlan)
        try:
            got = _Part.model_validate(doc).shards
        except ValidationError as e:
            raise BadPlan(f"round plan part {uri} is not one: {validation_problems(e)}") from None
        self._parts[key] = got
        while len(self._parts) > PARTS_KEPT:
            self._parts.popitem(last=False)
        return got

    def pieces(self, index: int) -> list[Piece]:
        """A shard's pieces, read from its part when the plan is written in parts."""
        if not self.in_parts:
            return self.shards[index]
        lane, chunk, at = self.part_of(index)
        part = self._part(lane, chunk)
        if at >= len(part):
            raise BadPlan(f"round plan part {layout.plan_part_uri(self.round_prefix, lane, chunk)} lacks shard {index}")
        return part[at]

    def iter_pieces(self) -> Iterator[tuple[int, list[Piece]]]:
        """Every shard's (index, pieces): in index order from one document, lane by lane from parts (one
        part in memory at a time)."""
        if not self.in_parts:
            yield from enumerate(self.shards)
            return
        assert self.part_shards is not None
        lanes = self.lane_count
        for lane, chunk in self.part_keys():
            for at, pieces in enumerate(self._part(lane, chunk)):
                yield lane + (chunk * self.part_shards + at) * lanes, pieces

    @property
    def shares_shards(self) -> bool:
        """Whether lanes take over each other's shards: plans written before lanes existed ran one
        shard per index and nothing else."""
        return self.lanes is not None

    @property
    def mode(self) -> JudgeMode:
        return self.judge_mode or JudgeMode()

    def to_doc(self) -> dict[str, Any]:
        """The JSON document (camelCase; fields without a value left out, as the job's own dict)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)

    def to_json(self) -> bytes:
        return json.dumps(self.to_doc(), separators=(",", ":")).encode()

    @classmethod
    def from_doc(cls, doc: Any, source: str = "round plan") -> Plan:
        if not isinstance(doc, dict):
            raise BadPlan(f"{source} is not a JSON object")
        try:
            job = parse_job(doc.get("job"), source)  # the spec's own messages name the bad field
            plan = cls.model_validate({**doc, "job": job})
        except SpecError as e:
            raise BadPlan(str(e)) from None
        except ValidationError as e:
            raise BadPlan(f"{source} is not a round plan: {validation_problems(e)}") from None
        # One document lists its shards; a head says how many there are and how its parts hold them.
        if (plan.shard_count is None) != (plan.part_shards is None) or (
                not plan.in_parts and "shards" not in plan.model_fields_set):
            raise BadPlan(f"{source} is not a round plan: it needs shards, or shardCount and partShards")
        return plan

    @classmethod
    def from_json(cls, data: bytes, source: str = "round plan") -> Plan:
        return cls.from_doc(json_object(data, source, BadPlan), source)


class _Part(_Doc):
    shards: list[list[Piece]]
