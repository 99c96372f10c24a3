"""The small durable records bij keeps under a job's output URI, one type each (camelCase JSON on disk).

- `ShardRecord`: a shard's completion record (`done/<i>.json`, written once when every row is
  durable) and a running shard's progress record (`progress/<i>.json`, rewritten now and then);
  the same counts, with `finishedAt` or `updatedAt`
- `ClaimRecord`: which worker holds a shard (`lanes/<lane>/<i>-<generation>.json`, see bij.worker.lanes)
- `OwnerRecord`: which job owns an output URI (`_bij/owner.json`)
- `DamageRecord`: a `.zst` input object a shard found cut short or damaged (`damaged/<i>.json`)
- `RemovedRecord`: what was removed after publishing (`_bij/<job>/removed.json`)

Paths are in `contract.layout`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, TypedDict, cast, get_type_hints

from bij.contract.errors import StorageError, json_object


def now_stamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class ShardCounts(TypedDict):
    """What a shard did so far (bij.worker.metrics.Stats.as_record)."""

    rows: int
    errors: int
    truncated: int
    tokensIn: int
    tokensOut: int
    rejected: int
    capped: int
    engineCalls: int
    judgeCalls: int
    batches: int
    chunks: int
    engineBusySeconds: float
    modelLoadSeconds: float
    modelLoads: int
    weightsBytes: int
    engineSteps: int
    meanOccupancy: float
    prefixShare: float
    promptChars: int
    cachedTokens: int
    bytes: int
    intIds: int
    strIds: int
    placeIds: int  # final rows whose id is none or their place's generated one (no duplicates possible)
    structuredValidated: int  # structured answers checked after decoding and valid
    structuredRepaired: int  # ... of them valid only on the second grammar backend's try
    structuredViolations: int  # ... and that broke their structured output (schema_violation rows)
    lengthCuts: int  # result rows whose answer stopped at its token cap (finish_reason length)
    notes: list[str]  # what the engine could not serve at all (a grammar its tokenizer cannot write)


class ShardRecord(ShardCounts, total=False):
    """A completion record (with `finishedAt`) or a progress record (with `updatedAt`).

    Records written by older workers may lack counts added since: readers use `.get`.
    """

    index: int
    round: int
    lane: int
    seconds: float  # time spent on the shard, earlier (preempted) runs included
    pool: str  # spec.workers.pools: the pool whose pod wrote the record (its price counts the seconds)
    finishedAt: str
    updatedAt: str


def shard_record(index: int, round_no: int, lane: int, counts: ShardCounts, seconds: float, *,
                 finished: bool, pool: str | None = None) -> ShardRecord:
    """A completion record (`finished`) or a progress record of a shard; `pool`: the pool its pod runs in."""
    rec: ShardRecord = {"index": index, "round": round_no, "lane": lane, **counts,
                        "seconds": round(seconds, 3)}
    if pool:
        rec["pool"] = pool
    rec["finishedAt" if finished else "updatedAt"] = now_stamp()
    return rec


def encode(record: Any) -> bytes:
    return json.dumps(record).encode()


class BadRecord(StorageError, ValueError):
    """A durable record that is not what its path says it is: no retry fixes it.

    A StorageError (a corrupt object, permanent), and a ValueError as `json.loads` raised before."""

    def __init__(self, message: str):
        super().__init__(message, permanent=True)


# Every field of a shard record with its type; a record may lack any count but these.
_SHARD_FIELDS: dict[str, type] = get_type_hints(ShardRecord)
_SHARD_REQUIRED = ("rows", "errors")


def decode_shard_record(data: bytes, source: str = "shard record") -> ShardRecord:
    """A completion or progress record as written, checked against `ShardRecord`: BadRecord, naming
    `source`, when it is no JSON object, lacks `rows` or `errors`, or has a field of the wrong type.
    Fields it does not know (a newer worker's) are kept; a count of None reads as missing."""
    doc = json_object(data, source, BadRecord)
    missing = [key for key in _SHARD_REQUIRED if key not in doc]
    if missing:
        raise BadRecord(f"{source} is not a shard record: no {', '.join(missing)}")
    for key, kind in _SHARD_FIELDS.items():
        value = doc.get(key)
        if value is None and key not in _SHARD_REQUIRED:
            continue
        if kind == list[str]:
            ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
        else:
            ok = isinstance(value, str) if kind is str else (
                isinstance(value, int | float) if kind is float else isinstance(value, int))
        if not ok or isinstance(value, bool):
            raise BadRecord(f"{source} is not a shard record: {key} is {value!r}, not a{'n' if kind is int else ''} "
                            f"{kind.__name__}")
    return cast(ShardRecord, doc)  # every field checked above


@dataclass(frozen=True)
class ClaimRecord:
    """Generation `generation` of the claim on `shard`: held by `writer` (a process of lane `lane`)
    until `expires_at` (epoch seconds), unless renewed."""

    shard: int
    generation: int
    lane: int
    writer: str
    expires_at: float
    renewed_at: str = ""

    def to_json(self) -> bytes:
        return encode({"shard": self.shard, "generation": self.generation, "lane": self.lane, "writer": self.writer,
                       "expiresAt": round(self.expires_at, 3), "renewedAt": self.renewed_at or now_stamp()})

    @classmethod
    def from_json(cls, data: bytes, shard: int, generation: int) -> ClaimRecord:
        """ValueError, KeyError or TypeError when the object is no claim."""
        doc = json.loads(data)
        return cls(shard, generation, int(doc["lane"]), str(doc["writer"]), float(doc["expiresAt"]),
                   str(doc.get("renewedAt") or ""))


@dataclass(frozen=True)
class DamageRecord:
    """Input object `object` of the plan (`name`, at `version`) breaks after `offset` good uncompressed
    bytes (`sha256` is theirs); `mode` is spec.input.onDamagedObject: "fail" (the round failed there,
    the rows before it durable) or "errorRow" (one corrupt_input error row, the rest unread)."""

    shard: int
    object: int
    name: str
    version: str | None
    offset: int
    sha256: str
    reason: str
    mode: str

    def to_json(self) -> bytes:
        return encode({"shard": self.shard, "object": self.object, "name": self.name, "version": self.version,
                       "offset": self.offset, "sha256": self.sha256, "reason": self.reason, "mode": self.mode,
                       "at": now_stamp()})

    @classmethod
    def from_json(cls, data: bytes, source: str = "damage record") -> DamageRecord:
        """BadRecord, naming `source`, when the object is no damage record."""
        doc = json_object(data, source, BadRecord)
        try:
            return cls(int(doc["shard"]), int(doc["object"]), str(doc["name"]),
                       None if doc.get("version") is None else str(doc["version"]), int(doc["offset"]),
                       str(doc["sha256"]), str(doc["reason"]), str(doc["mode"]))
        except (KeyError, TypeError, ValueError) as e:
            raise BadRecord(f"{source} is not a damage record: {type(e).__name__}: {e}") from None

    def describe(self) -> str:
        """One line for status messages and the console."""
        return f"{self.name} is damaged after uncompressed byte {self.offset:,} ({self.reason})"


@dataclass(frozen=True)
class OwnerRecord:
    """The job that owns an output URI: its namespace and name, and the id of its generation."""

    namespace: str | None
    name: str | None
    id: str | None
    claimed_at: str = ""

    def same_job(self, other: OwnerRecord) -> bool:
        return (self.namespace, self.name) == (other.namespace, other.name)

    def to_json(self) -> bytes:
        return encode({"namespace": self.namespace, "name": self.name, "id": self.id,
                       "claimedAt": self.claimed_at or now_stamp()})

    @classmethod
    def from_json(cls, data: bytes) -> OwnerRecord:
        """ValueError when the object is no JSON object."""
        doc = json.loads(data)
        if not isinstance(doc, dict):
            raise ValueError("an owner record is a JSON object")
        return cls(doc.get("namespace"), doc.get("name"), doc.get("id"), str(doc.get("claimedAt") or ""))


class _RemovedCounts(TypedDict):
    removedAt: str
    reason: str
    folders: list[str]
    objects: int
    bytes: int


class RemovedRecord(_RemovedCounts, total=False):
    """The work files removed after a successful publish; its presence refuses a republish. Written
    before the first delete and again as it goes: counts summed while streaming, never a list of objects
    (bounded however many there were). Without `finishedAt` the removal was cut short or failed (`failed`
    says why) and the next publish or run resumes it."""

    finishedAt: str
    failed: str
