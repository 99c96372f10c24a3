"""The durable log of one shard: what survives a kill -9, read back on resume.

One record is one JSON line: ``{"at": [object, offset, end], "kind": ..., "row": {...}}``
where ``at`` is the input row's place (object index in the round plan, byte
offset of its line, offset just past it) and ``row`` the result or error row
as it will be published.

Each write (a chunk, or the chunks one group commit takes together) is one zstd
frame holding whole JSON lines: the frame is the unit of durability. A frame
carries its content size and a checksum, so a log is a plain zstd stream
(``zstdcat`` reads it) whose damage is detected rather than parsed.

- file:// — one append-only ``log-<writer>.jsonl.zst`` per writer (a worker process);
  each frame is appended with one write and fsynced before the next one starts, so
  only the last frame of a log can be torn by a crash (or still being written).
- s3:// — each frame is one immutable segment object ``seg-<n>-<writer>.jsonl.zst``
  written with a single PUT, so a segment exists whole or not at all.

Reading a log walks its frames by their headers (magic, frame header, block
headers, checksum: the frame's length is known before it is decoded). A frame that runs
past the end of the object or does not decode (its checksum fails) is a torn
tail when no complete frame that decodes follows it: a prefix of the last write
cut by a crash or still being written, or bytes a crash left unwritten (zeros).
A torn tail is skipped, never cut, since the log may belong to a writer that is
still running; its rows are recomputed. A frame that does not decode with a good
frame after it, and every damaged segment, is an error that names the object
and the byte offset (`DamagedLog`): rows past it were made durable and cannot be
read, so the shard is not resumed over it.

Logs written before compression (``log.jsonl``, ``log-<writer>.jsonl``,
``seg-<n>-<writer>.jsonl``: plain JSON lines, a last line without its newline
torn) are still read, so an older shard resumes and publishes as before.

Every name carries the writer's id, so two processes working the same index (a
replacement pod racing a slow termination, `bij run` started twice) never write
into each other's file, and nothing one of them reads can change the other's;
the reader keeps the first record for each place.

Both are read by the same code: list the shard's objects in name order, read
their records, skip a torn tail, de-duplicate by place (and attempt).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import repeat
from operator import attrgetter, itemgetter
from typing import Any

import orjson
import zstandard

from bij.contract.columns import RESULT_FIELDS
from bij.storage import NotFound, ObjectInfo, Storage, StorageError, exact_json, split_lines

# file://: a log per writer; logs of older versions were all named "log.jsonl".
LOG_PREFIX = "log"
SEGMENT_PREFIX = "seg-"
SUFFIX = ".jsonl.zst"  # a log or segment of zstd frames
PLAIN_SUFFIX = ".jsonl"  # written before compression: plain JSON lines
# Fast: the commit thread compresses every write. On the echo benchmark's records level 1 does
# about 360 MB per CPU-second for a ratio of 4.1, level 3 about 220 MB for 4.3.
LEVEL = 1
_MAGIC = b"\x28\xb5\x2f\xfd"
_READ_BLOCK = 1 << 20
_BLOCK_MAX = 128 << 10  # the most content one zstd block holds


class DamagedLog(StorageError):
    """A log or segment holds bytes that are not a torn tail and do not decode."""

    def __init__(self, uri: str, offset: int, why: str):
        prefix = uri.rsplit("/", 1)[0]
        super().__init__(
            f"durable log {uri} is damaged at byte {offset}: {why}; this is not a torn tail, so the rows "
            f"after it cannot be trusted: remove the shard's logs under {prefix}/ to compute the shard again",
            permanent=True)
        self.uri, self.offset = uri, offset


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
_CHOICES = attrgetter("choices")

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
                 b'"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}%b}}')


def _columns_json(columns: dict[str, Any]) -> bytes:
    """A row's pass-through columns as the JSON members that follow its usage: what orjson writes for them."""
    return b"," + orjson.dumps(columns)[1:-1] if columns else b""


def encode_plain_results(places: list[tuple[int, int, int]], ids: list[Any], results: list[Any],
                         carried: list[dict[str, Any]] | None = None) -> bytes | None:
    """The log lines of a chunk's result records of the common shape, in one pass; None when they are not.

    Byte for byte what encode_records writes for the records
    ``{"at": place, "kind": "result", "row": result_row(...)}`` of plain rows, not cut to
    the token limit, each with an output and both token counts (`results` are engine
    Results), and the rows' pass-through columns (`carried`, after the usage, as result_row puts
    them): the place, id and output go through orjson, a column at a time, with no
    record dict per row. Anything else (an embedding, a count missing, an id orjson cannot
    write) is None: the caller builds the records.
    """
    if not results:
        return b""
    prompt = list(map(_PROMPT_TOKENS, results))
    completion = list(map(_COMPLETION_TOKENS, results))
    if set(map(type, prompt)) != {int} or set(map(type, completion)) != {int} \
            or set(map(_EMBEDDING, results)) != {None} or set(map(_CHOICES, results)) != {None}:
        return None
    try:
        extras = repeat(b"", len(results)) if carried is None else map(_columns_json, carried)
        lines = [_PLAIN_RESULT % (at, rid, out, p, c, p + c, extra) for at, rid, out, p, c, extra in zip(
            map(orjson.dumps, places), map(orjson.dumps, ids), map(orjson.dumps, map(_OUTPUT, results)),
            prompt, completion, extras, strict=True)]
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


# A published row's own fields (an OpenAI batch output line's too): any other is a carried column.
_ROW_FIELDS = RESULT_FIELDS | {"custom_id", "response"}


def loads_record(line: bytes) -> Any:
    """Parse one log record fast, every integer (an id, a carried column's, nested or not) exactly as given.

    orjson reads an integer beyond 64 bits as a float; an id is never a float, so a float id
    means such an integer. Beside the id, only a row's carried columns (its fields that are no
    result field) can hold one: only such a row's line is scanned (exact_json), and the stdlib
    parses it where it may.
    """
    rec = orjson.loads(line)
    row = rec.get("row")
    if isinstance(rec.get("id"), float) or (isinstance(row, dict) and (
            isinstance(row.get("custom_id", row.get("id")), float)
            or (not row.keys() <= _ROW_FIELDS and exact_json.may_hold_big_int(line)))):
        return json.loads(line)
    return rec


def frame_length(buf: bytes | bytearray, start: int) -> int | None:
    """Bytes in the zstd frame that starts at `buf[start]`, from its headers alone (nothing is decoded).

    None when `buf` ends before the frame does; ValueError when no frame starts there.
    """
    walked = _walk_frame(buf, start)
    return walked[0] if walked else None


def _walk_frame(buf: bytes | bytearray, start: int) -> tuple[int, int] | None:
    """(bytes, blocks) of the zstd frame at `buf[start]`; see `frame_length`.

    Layout (RFC 8878): magic, frame header descriptor, window descriptor, dictionary id,
    content size, then blocks of a 3-byte header each (last-block bit, type, size), then a
    4-byte checksum when the descriptor says so.
    """
    head = bytes(buf[start:start + 4])
    if not _MAGIC.startswith(head):
        raise ValueError("no zstd frame starts there")
    end = len(buf)
    if end - start < 5:
        return None
    fhd = buf[start + 4]
    if fhd & 0x08:
        raise ValueError("the frame header has its reserved bit set")
    single = bool(fhd & 0x20)
    pos = start + 5 + (not single) + (0, 1, 2, 4)[fhd & 3] + (int(single), 2, 4, 8)[fhd >> 6]
    blocks = 0
    while True:
        if pos + 3 > end:
            return None
        header = buf[pos] | buf[pos + 1] << 8 | buf[pos + 2] << 16
        kind = header >> 1 & 3
        if kind == 3:
            raise ValueError("a block of the reserved type")
        pos += 3 + (1 if kind == 1 else header >> 3)  # an RLE block holds one byte
        blocks += 1
        if header & 1:
            break
    pos += 4 if fhd & 0x04 else 0
    return (pos - start, blocks) if pos <= end else None


def _decode(dctx: zstandard.ZstdDecompressor, frame: bytes, blocks: int) -> bytes:
    """The content of a whole frame, its checksum checked; ZstdError when it does not decode.

    The content size in the header must fit the frame's blocks (128 KiB each at most): a damaged
    header never makes the decoder allocate more than that.
    """
    size = zstandard.frame_content_size(frame)
    if not 0 <= size <= blocks * _BLOCK_MAX:
        raise zstandard.ZstdError(f"its header gives a content size of {size} bytes for {blocks} blocks")
    return dctx.decompress(frame)


def _frames(stream: Any, uri: str, tail_may_tear: bool, state: DurableState) -> Iterator[tuple[int, bytes]]:
    """(byte offset, decoded content) of each complete frame of a log or segment, in order.

    A torn tail (`tail_may_tear`: an appended log) is counted in `state.torn_bytes` and ends the
    frames; anything else that does not decode is `DamagedLog`. See the module docstring.
    """
    dctx = zstandard.ZstdDecompressor()
    buf = bytearray()
    base = pos = 0  # offset of buf[0] in the object; where the next frame starts in buf
    eof = False
    while True:
        why = ""
        try:
            walked = _walk_frame(buf, pos) if pos < len(buf) else None
        except ValueError as e:
            walked, why = None, str(e)
        if walked is None and not why and not eof:
            del buf[:pos]
            base, pos = base + pos, 0
            data = stream.read(_READ_BLOCK)
            if data:
                buf += data
            else:
                eof = True
            continue
        offset = base + pos
        if walked is not None:
            n, blocks = walked
            try:
                content = _decode(dctx, bytes(buf[pos:pos + n]), blocks)
            except zstandard.ZstdError as e:
                why = f"the frame does not decode ({e})"
            else:
                yield offset, content
                pos += n
                continue
        elif not why:  # the object ended
            if pos == len(buf):
                return
            why = f"the frame is cut short after {len(buf) - pos} bytes"
        if tail_may_tear and not _frame_after(buf, pos, stream, dctx):
            # What the last write left, torn by a crash or still being written: skipped, not cut.
            state.torn_bytes += base + len(buf) - offset
            return
        raise DamagedLog(uri, offset, why)


def _frame_after(buf: bytearray, start: int, stream: Any, dctx: zstandard.ZstdDecompressor) -> bool:
    """Whether a complete frame that decodes starts after `buf[start]`, in `buf` or the rest of the stream.

    A torn tail holds none: it is a prefix of the last write, or bytes a crash left unwritten
    (zeros). Damage before a later frame is not a torn tail. Reads the stream into `buf` as far
    as that frame, or to its end.
    """
    at = start + 1
    eof = False
    while True:
        hit = buf.find(_MAGIC, at)
        if hit >= 0:
            try:
                walked = _walk_frame(buf, hit)
            except ValueError:
                walked = (0, 0)
            if walked and walked[0]:
                try:
                    _decode(dctx, bytes(buf[hit:hit + walked[0]]), walked[1])
                    return True
                except zstandard.ZstdError:
                    pass
            if walked is not None or eof:  # no frame there, or one that runs past the end
                at = hit + 1
                continue
        elif eof:
            return False
        else:
            at = max(at, len(buf) - len(_MAGIC) + 1)
        data = stream.read(_READ_BLOCK)
        if data:
            buf += data
        else:
            eof = True


def _plain_records(stream: Any, size: int, state: DurableState) -> Iterator[dict[str, Any]]:
    """The records of a log of plain JSON lines (written before compression)."""
    for off, line, n in split_lines(stream, 0):
        if off + n + 1 > size or line is None:
            # No newline yet: a write torn by a crash, or one still under way.
            state.torn_bytes += size - off
            break
        if not line.strip():
            continue
        try:
            yield loads_record(line)
        except ValueError:
            # A damaged line; the row is simply recomputed.
            continue


def _frame_records(stream: Any, uri: str, tail_may_tear: bool, state: DurableState) -> Iterator[dict[str, Any]]:
    for offset, content in _frames(stream, uri, tail_may_tear, state):
        lines = content.split(b"\n")
        if lines.pop():
            raise DamagedLog(uri, offset, "the frame's last record has no newline")
        for line in lines:
            try:
                yield loads_record(line)
            except ValueError as e:
                raise DamagedLog(uri, offset, f"a record in the frame is not JSON ({e})") from None


def object_records(storage: Storage, obj: ObjectInfo, state: DurableState | None = None) -> Iterator[dict[str, Any]]:
    """Every record of one log or segment object as written (no de-duplication), a torn tail skipped.

    Only the object's first `obj.size` bytes are read (what was there when it was listed):
    what a running writer appends later is its own. A log that was gone by then has no records.
    """
    state = state if state is not None else DurableState()
    try:
        stream = storage.open_read(obj.uri)
    except NotFound:
        return
    with stream:
        limited = _Limited(stream, obj.size)
        name = obj.uri.rsplit("/", 1)[-1]
        if name.endswith(SUFFIX):
            # Only an appended log can be torn; a segment was one PUT.
            yield from _frame_records(limited, obj.uri, name.startswith(LOG_PREFIX), state)
        else:
            yield from _plain_records(limited, obj.size, state)


def is_log_object(name: str, appendable: bool) -> bool:
    """Whether an object in a shard's folder is part of its log: segments, and on file:// the writers' logs."""
    if not (name.endswith(SUFFIX) or name.endswith(PLAIN_SUFFIX)):
        return False
    return name.startswith(SEGMENT_PREFIX) or (appendable and name.startswith(LOG_PREFIX))


class ShardLog:
    """Append-only durable log of one shard under `prefix` (a folder URI).

    One thread writes (the commit writer): the log keeps one zstd compression context.
    """

    def __init__(self, storage: Storage, prefix: str, writer_id: str | None = None):
        self.storage = storage
        self.prefix = prefix.rstrip("/")
        self.writer_id = writer_id or f"{os.getpid():x}-{uuid.uuid4().hex[:8]}"
        self._next_segment = 0
        self._cctx = zstandard.ZstdCompressor(level=LEVEL, write_content_size=True, write_checksum=True)
        self.state = DurableState()

    @property
    def log_uri(self) -> str:
        """This writer's own log (file://)."""
        return f"{self.prefix}/{LOG_PREFIX}-{self.writer_id}{SUFFIX}"

    def read(self) -> DurableState:
        """All durable records in commit order, in memory (publish: one shard at a time)."""
        records = list(self.scan())
        state = self.state
        state.records = records
        return state

    def scan(self) -> Iterator[dict[str, Any]]:
        """Stream the durable records in commit order; `self.state` has the cursor once done.

        Reading changes nothing: a torn tail is skipped, never cut, so a writer still
        running elsewhere keeps every frame it made durable. Memory stays small however
        long the log: one int per record for de-duplication, and one frame at a time.
        """
        state = self.state = DurableState()
        seen: set[int] = set()
        objects = self.storage.list(self.prefix + "/")
        names = [o.uri.rsplit("/", 1)[-1] for o in objects]
        self._next_segment = sum(1 for n in names if n.startswith(SEGMENT_PREFIX))
        ours = [(o, n) for o, n in zip(objects, names, strict=True) if is_log_object(n, self.storage.supports_append)]
        # The writers' logs, then the segments, each in name order.
        sources = [o for o, n in ours if not n.startswith(SEGMENT_PREFIX)] + \
                  [o for o, n in ours if n.startswith(SEGMENT_PREFIX)]
        for obj in sources:
            for rec in object_records(self.storage, obj, state):
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
        """Make one chunk's records durable, all in one frame: one write (file://) or one object (s3://)."""
        self.write(self.encode(records))

    @staticmethod
    def encode(records: list[dict[str, Any]]) -> bytes:
        """Records as a frame of the log holds them: in input order, a JSON line each."""
        # In input order: publish streams a log written by one writer without sorting it.
        # "at" is [object, offset, end]: lists compare item by item, and (object, offset) is unique.
        return encode_records(sorted(records, key=itemgetter("at")))

    def write(self, data: bytes) -> None:
        """Make encoded records (JSON lines, see `encode`) durable as one zstd frame, in one write or one object."""
        if not data:
            return
        frame = self._cctx.compress(data)
        if self.storage.supports_append:
            self.storage.append_durable(self.log_uri, frame)
        else:
            name = f"{SEGMENT_PREFIX}{self._next_segment:08d}-{self.writer_id}{SUFFIX}"
            self.storage.write_bytes(f"{self.prefix}/{name}", frame)
            self._next_segment += 1
