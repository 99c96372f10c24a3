"""The durable log of one shard: what survives a kill -9, read back on resume.

One record is one JSON line: ``{"at": [object, offset, end], "kind": ..., "row": {...}}``
where ``at`` is the input row's place (object index in the round plan, byte
offset of its line, offset just past it) and ``row`` the result or error row
as it will be published.

- file:// — one append-only ``log-<writer>.jsonl`` per writer (a worker process);
  each chunk is one write, flushed and fsynced. A last line without its newline is
  a write torn by a crash, or one still under way: it is skipped, never cut, since
  the file may belong to a writer that is still running.
- s3:// — each chunk is one immutable segment object written with a single PUT,
  so a segment exists whole or not at all.

Every name carries the writer's id, so two processes working the same index (a
replacement pod racing a slow termination, `bij run` started twice) never write
into each other's file, and nothing one of them reads can change the other's;
the reader keeps the first record for each place.

Both are read by the same code: list the shard's objects in name order, parse
lines, skip a torn tail, de-duplicate by place (and attempt).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from operator import attrgetter, itemgetter
from typing import Any

import orjson

from .storage import NotFound, Storage, split_lines

# file://: a log per writer; logs of older versions were all named "log.jsonl".
LOG_PREFIX = "log"


@dataclass
class DurableState:
    """What the log holds for a shard."""

    records: list[dict[str, Any]] = field(default_factory=list)
    # (object index, end offset) of the furthest input line committed: chunks are
    # committed in input order, so everything before it is durable.
    cursor: tuple[int, int] = (-1, -1)
    torn_bytes: int = 0  # bytes in torn tails (file://), skipped


_PROMPT_TOKENS = attrgetter("prompt_tokens")
_COMPLETION_TOKENS = attrgetter("completion_tokens")
_EMBEDDING = attrgetter("embedding")
_OUTPUT = attrgetter("output")

# The stdlib encoder handles what orjson refuses (integers beyond 64 bits).
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), check_circular=False)


def _dump(record: dict[str, Any]) -> bytes:
    try:
        return orjson.dumps(record)
    except TypeError:
        return _ENCODER.encode(record).encode("utf-8")


def encode_records(records: Iterable[dict[str, Any]]) -> bytes:
    """JSON lines, one per record, each ending in a newline; empty for no records."""
    records = records if isinstance(records, list) else list(records)
    try:
        lines = b"\n".join(map(orjson.dumps, records))
    except TypeError:  # an integer beyond 64 bits somewhere: record by record, the stdlib for those
        lines = b"\n".join(map(_dump, records))
    return lines + b"\n" if lines else b""


# One result record of the common shape (result_row of a plain row: an output and full usage),
# with the JSON of its place, id and output put in: what orjson writes for its dict.
_PLAIN_RESULT = (b'{"at":%b,"kind":"result","row":{"id":%b,"output":%b,'
                 b'"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}}}')


def encode_plain_results(places: list[tuple[int, int, int]], ids: list[Any], results: list[Any]) -> bytes | None:
    """The log lines of a chunk's result records of the common shape, in one pass; None when they are not.

    Byte for byte what encode_records writes for the records
    ``{"at": place, "kind": "result", "row": result_row(...)}`` of plain rows, not cut to
    the token limit, each with an output and both token counts (`results` are engine
    Results): the place, id and output go through orjson, a column at a time, with no
    record dict per row. Anything else (an embedding, a count missing, an id orjson cannot
    write) is None: the caller builds the records.
    """
    if not results:
        return b""
    prompt = list(map(_PROMPT_TOKENS, results))
    completion = list(map(_COMPLETION_TOKENS, results))
    if set(map(type, prompt)) != {int} or set(map(type, completion)) != {int} \
            or set(map(_EMBEDDING, results)) != {None}:
        return None
    try:
        lines = [_PLAIN_RESULT % (at, rid, out, p, c, p + c) for at, rid, out, p, c in zip(
            map(orjson.dumps, places), map(orjson.dumps, ids), map(orjson.dumps, map(_OUTPUT, results)),
            prompt, completion, strict=True)]
    except TypeError:  # an integer beyond 64 bits, text orjson refuses: the records' own encoding says
        return None
    return b"\n".join(lines) + b"\n"


class _Limited:
    """The first `size` bytes of a stream."""

    def __init__(self, stream: Any, size: int):
        self.stream, self.left = stream, size

    def read(self, n: int = -1) -> Any:
        if self.left <= 0:
            return b""
        data = self.stream.read(self.left if n < 0 else min(n, self.left))
        self.left -= len(data)
        return data


def loads_record(line: bytes) -> Any:
    """Parse one log record fast, ids exactly as the stdlib would read them.

    orjson reads an integer beyond 64 bits as a float; an id is never a float, so
    a float id means such an integer, and the stdlib parses that line instead.
    """
    rec = orjson.loads(line)
    row = rec.get("row")
    if isinstance(rec.get("id"), float) or (isinstance(row, dict) and isinstance(
            row.get("custom_id", row.get("id")), float)):
        return json.loads(line)
    return rec


class ShardLog:
    """Append-only durable log of one shard under `prefix` (a folder URI)."""

    def __init__(self, storage: Storage, prefix: str, writer_id: str | None = None):
        self.storage = storage
        self.prefix = prefix.rstrip("/")
        self.writer_id = writer_id or f"{os.getpid():x}-{uuid.uuid4().hex[:8]}"
        self._next_segment = 0
        self.state = DurableState()

    @property
    def log_uri(self) -> str:
        """This writer's own log (file://)."""
        return f"{self.prefix}/{LOG_PREFIX}-{self.writer_id}.jsonl"

    def read(self) -> DurableState:
        """All durable records in commit order, in memory (publish: one shard at a time)."""
        records = list(self.scan())
        state = self.state
        state.records = records
        return state

    def scan(self) -> Iterator[dict[str, Any]]:
        """Stream the durable records in commit order; `self.state` has the cursor once done.

        Reading changes nothing: a torn tail is skipped, never cut, so a writer still
        running elsewhere keeps every line it made durable. Memory stays small however
        long the log: one int per record for de-duplication.
        """
        state = self.state = DurableState()
        seen: set[int] = set()
        objects = self.storage.list(self.prefix + "/")
        names = [o.uri.rsplit("/", 1)[-1] for o in objects]
        segments = [o for o, n in zip(objects, names, strict=True) if n.startswith("seg-")]
        self._next_segment = len(segments)
        sources = segments
        if self.storage.supports_append:
            logs = [o for o, n in zip(objects, names, strict=True)
                    if n.startswith(LOG_PREFIX) and n.endswith(".jsonl")]
            sources = logs + segments
        for obj in sources:
            try:
                stream = self.storage.open_read(obj.uri)
            except NotFound:
                continue
            with stream:
                # Only the bytes there when listed: what a running writer appends later is its own.
                for off, line, n in split_lines(_Limited(stream, obj.size), 0):
                    if off + n + 1 > obj.size or line is None:
                        # No newline yet: a write torn by a crash, or one still under way.
                        state.torn_bytes += obj.size - off
                        break
                    if not line.strip():
                        continue
                    try:
                        rec = loads_record(line)
                    except ValueError:
                        # A damaged line; the row is simply recomputed.
                        continue
                    at = rec["at"]
                    # A row has one final record per round, and before it (judge, inPlace) one
                    # record per attempt.
                    attempt = rec.get("attempt", -1) if rec["kind"] == "attempt" else -1
                    key = (((at[0] << 40) | at[1]) << 8) | ((attempt + 1) & 0xFF)
                    if key in seen:
                        continue
                    seen.add(key)
                    state.cursor = max(state.cursor, (at[0], at[2]))
                    yield rec

    def append(self, records: list[dict[str, Any]]) -> None:
        """Make one chunk's records durable, all in one write (file://) or one object (s3://)."""
        self.write(self.encode(records))

    @staticmethod
    def encode(records: list[dict[str, Any]]) -> bytes:
        """Records as the log holds them: in input order, a JSON line each."""
        # In input order: a torn write then keeps a prefix of the chunk, and the resume cursor (the
        # furthest durable row) never jumps over a row whose record was cut off behind it.
        # "at" is [object, offset, end]: lists compare item by item, and (object, offset) is unique.
        return encode_records(sorted(records, key=itemgetter("at")))

    def write(self, data: bytes) -> None:
        """Make encoded records durable (in input order, see `encode`), in one write or one object."""
        if not data:
            return
        if self.storage.supports_append:
            self.storage.append_durable(self.log_uri, data)
        else:
            name = f"seg-{self._next_segment:08d}-{self.writer_id}.jsonl"
            self.storage.write_bytes(f"{self.prefix}/{name}", data)
            self._next_segment += 1
