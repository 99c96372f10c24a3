"""The durable log of one shard: what survives a kill -9, read back on resume.

One record is one JSON line: ``{"at": [object, offset, end], "kind": ..., "row": {...}}``
where ``at`` is the input row's place (object index in the round plan, byte
offset of its line, offset just past it) and ``row`` the result or error row
as it will be published.

- file:// — one append-only ``log.jsonl`` per shard; each chunk is one write,
  flushed and fsynced. A torn last line (a crash mid-write) is cut on resume.
- s3:// — each chunk is one immutable segment object written with a single PUT,
  so a segment exists whole or not at all. Segment names carry the writer's id,
  so two pods working the same index (a retried or duplicate pod) never
  overwrite each other; the reader keeps the first record for each place.

Both are read by the same code: list the shard's objects in name order, parse
lines, drop a torn tail, de-duplicate by place (and attempt).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .storage import NotFound, Storage

LOG_NAME = "log.jsonl"


@dataclass
class DurableState:
    """What the log holds for a shard."""

    records: list[dict[str, Any]] = field(default_factory=list)
    # (object index, end offset) of the furthest input line committed: chunks are
    # committed in input order, so everything before it is durable.
    cursor: tuple[int, int] = (-1, -1)
    torn_bytes: int = 0  # bytes cut from a torn tail (file://)


# One encoder for every record: json.dumps with options builds a new one per call, a
# per-row cost that showed in the echo benchmark. Records are plain trees (no cycles).
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), check_circular=False)


def encode_records(records: Iterable[dict[str, Any]]) -> bytes:
    """JSON lines, one per record, each ending in a newline; empty for no records."""
    lines = "\n".join(map(_ENCODER.encode, records))
    return (lines + "\n").encode("utf-8") if lines else b""


class ShardLog:
    """Append-only durable log of one shard under `prefix` (a folder URI)."""

    def __init__(self, storage: Storage, prefix: str, writer_id: str | None = None):
        self.storage = storage
        self.prefix = prefix.rstrip("/")
        self.writer_id = writer_id or f"{os.getpid():x}-{uuid.uuid4().hex[:8]}"
        self._next_segment = 0

    @property
    def log_uri(self) -> str:
        return f"{self.prefix}/{LOG_NAME}"

    def read(self, repair: bool = True) -> DurableState:
        """All durable records in commit order. With `repair`, a torn file tail is cut off."""
        state = DurableState()
        seen: set[tuple[int, int, int]] = set()
        objects = self.storage.list(self.prefix + "/")
        segments = [o for o in objects if o.uri.rsplit("/", 1)[-1].startswith("seg-")]
        self._next_segment = len(segments)
        sources = [o.uri for o in segments]
        if self.storage.supports_append and any(o.uri == self.log_uri for o in objects):
            sources = [self.log_uri] + sources
        for uri in sources:
            try:
                data = self.storage.read_bytes(uri)
            except NotFound:
                continue
            good_end = data.rfind(b"\n") + 1
            if good_end < len(data):
                # The last line never got its newline: the write was torn mid-line.
                state.torn_bytes += len(data) - good_end
                if repair and uri == self.log_uri:
                    self.storage.truncate(uri, good_end)
            for line in data[:good_end].splitlines():
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except ValueError:
                    # Only possible for a torn line that later got a newline appended
                    # by another writer; the row will simply be recomputed.
                    continue
                # A row has one final record per round, and before it (judge, inPlace) one
                # record per attempt.
                place = (rec["at"][0], rec["at"][1], rec.get("attempt", -1) if rec["kind"] == "attempt" else -1)
                if place in seen:
                    continue
                seen.add(place)
                state.records.append(rec)
                state.cursor = max(state.cursor, (rec["at"][0], rec["at"][2]))
        return state

    def append(self, records: list[dict[str, Any]]) -> None:
        """Make one chunk's records durable, all in one write (file://) or one object (s3://)."""
        if not records:
            return
        # In input order: a torn write then keeps a prefix of the chunk, and the resume cursor (the
        # furthest durable row) never jumps over a row whose record was cut off behind it.
        data = encode_records(sorted(records, key=lambda r: (r["at"][0], r["at"][1])))
        if self.storage.supports_append:
            self.storage.append_durable(self.log_uri, data)
        else:
            name = f"seg-{self._next_segment:08d}-{self.writer_id}.jsonl"
            self.storage.write_bytes(f"{self.prefix}/{name}", data)
            self._next_segment += 1
