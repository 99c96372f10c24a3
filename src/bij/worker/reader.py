"""Stream a shard's input lines, aligned to line starts, through a bounded prefetch queue.

A piece ``[start, end)`` of a plain object owns the lines whose first byte lies
in it: reading starts one byte early and drops the partial line, and stops at
the first line that starts at or after `end`. Compressed objects are read from
their beginning. Resuming starts at the cursor (always a line start) instead.
Parquet pieces are row groups; their rows come as JSON lines (see parquet.py).

What cannot be a row is never dropped quietly: a line longer than
`input.maxLineBytes` comes out as an `InputProblem` at its place, which the worker
records as an error row; so does a `.zst` object that is cut or damaged with
`input.onDamagedObject: errorRow`, while with `fail` reading stops there with
`DamagedObject`, after every line before the break.
"""

from __future__ import annotations

import hashlib
import queue
import threading
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, repeat
from typing import Any, cast

import zstandard

from bij.contract import layout
from bij.contract.errors import BijError
from bij.contract.plan import Piece, PlanObject
from bij.contract.spec_io import DEFAULT_MAX_LINE_BYTES
from bij.storage import Storage, split_blocks
from bij.storage.parquet import iter_parquet_piece


@dataclass(frozen=True)
class InputProblem:
    """A place in the input that is no line to parse; the worker makes it an error row."""

    code: str
    message: str


Line = tuple[tuple[int, int, int], bytes | InputProblem]  # ((object, offset, end), line)


class CorruptInput(BijError):
    """A compressed object that ends inside a frame or whose data is damaged."""


class DamagedObject(BijError):
    """Input object `obj` breaks after `offset` good uncompressed bytes (input.onDamagedObject: fail).
    No retry reads past it: the object must be replaced (or the spec say errorRow)."""

    permanent = True

    def __init__(self, obj: int, uri: str, offset: int, reason: str):
        super().__init__(f"input object {uri} is damaged after uncompressed byte {offset}: {reason}")
        self.obj, self.uri, self.offset, self.reason = obj, uri, offset, reason


class ReplacementDiffers(BijError):
    """A replaced damaged object does not begin with the bytes already made into rows."""

    permanent = True


class ZstdFrames:
    """Every frame of a .zst stream, decompressed; `read()` as a file's.

    zstandard's stream reader reads a cut frame as a clean end of the object. This one
    raises `CorruptInput` for a stream that ends inside a frame, or damaged data.
    Raw bytes go in small pieces (smaller while the data expands a lot), so memory stays
    bounded however well a piece compresses.
    """

    def __init__(self, raw: Any):
        self.raw = raw
        self.dctx = zstandard.ZstdDecompressor()
        self.obj = self.dctx.decompressobj()
        self.in_frame = False
        self.piece = 64 << 10
        self.raw_block = b""  # raw bytes read; fed from `self.at` on
        self.at = 0

    def read(self, size: int = -1) -> bytes:
        while True:
            if self.at >= len(self.raw_block):
                self.raw_block, self.at = self.raw.read(1 << 20), 0
                if not self.raw_block:
                    if self.in_frame:
                        raise CorruptInput("the object ends inside a zstd frame (cut short, or still uploading)")
                    return b""
            data = self.raw_block[self.at: self.at + self.piece]
            self.at += len(data)
            out = self._feed(data)
            if len(out) > 8 << 20:
                self.piece = max(1024, self.piece // 8)
            elif len(out) < 1 << 20 and self.piece < 64 << 10:
                self.piece *= 2
            if out:
                return out

    def _feed(self, data: bytes) -> bytes:
        out = []
        while data:
            try:
                out.append(self.obj.decompress(data))
            except zstandard.ZstdError as e:
                raise CorruptInput(f"damaged zstd data ({e})") from None
            if self.obj.eof:  # a frame ended; what follows is the next frame
                data = self.obj.unused_data
                self.obj = self.dctx.decompressobj()
                self.in_frame = False
            else:
                data = b""
                self.in_frame = True
        return b"".join(out)


def prefix_digest(storage: Storage, uri: str, n: int, version: str | None = None) -> str | None:
    """sha256 of the first `n` uncompressed bytes of a .zst object; None when it has fewer good ones."""
    h = hashlib.sha256()
    left = n
    with storage.open_read(uri, 0, version) as raw:
        frames = ZstdFrames(raw)
        try:
            while left > 0:
                data = frames.read()
                if not data:
                    return None
                h.update(data[:left])
                left -= len(data[:left])
        except CorruptInput:
            return None
    return h.hexdigest()


def _too_long(n: int, limit: int | None) -> InputProblem:
    return InputProblem("line_too_long", f"the line has {n} bytes, more than spec.input.maxLineBytes ({limit})")


Place = tuple[int, int, int]  # (object, offset, end)
# Lines of a shard a block at a time, in columns: their places, the lines, and each one's size
# in the input (`end - offset`), so that a chunk's bytes are one sum over a slice.
Block = tuple[list[Place], list[bytes | InputProblem], list[int]]

_PLUS_ONE = (1).__add__


def _place(obj: int, pos: int, lines: list[bytes | None], lengths: list[int], begin: int, end: int | None,
           max_line: int | None) -> Block | None:
    """The lines of a split block whose first byte lies in [begin, end), each at (obj, offset, end):
    blank lines left out, a trailing CR cut, a line over the limit an InputProblem."""
    sizes = list(map(_PLUS_ONE, lengths))
    offs = list(accumulate(sizes, initial=pos))  # offs[k], offs[k + 1]: where line k starts and ends
    n = len(lines)
    lo = bisect_left(offs, begin, 0, n) if begin > pos else 0
    hi = bisect_left(offs, end, lo, n) if end is not None else n
    if lo >= hi:
        return None
    if lo or hi < n:
        lines, sizes, offs = lines[lo:hi], sizes[lo:hi], offs[lo:hi + 1]
    # The common block, checked in C: every line kept as it is.
    if None not in lines and all(lines):
        full = cast("list[bytes]", lines)  # no None: checked just above
        if not any(map(bytes.isspace, full)) and not any(map(bytes.endswith, full, repeat(b"\r"))):
            return list(zip(repeat(obj), offs, offs[1:], strict=False)), cast("list[bytes | InputProblem]", full), sizes
    places: list[Place] = []
    kept: list[bytes | InputProblem] = []
    kept_sizes: list[int] = []
    for k, line in enumerate(lines):
        if line is None:
            kept.append(_too_long(sizes[k] - 1, max_line))
        elif line and not line.isspace():
            kept.append(line[:-1] if line.endswith(b"\r") else line)
        else:
            continue
        places.append((obj, offs[k], offs[k + 1]))
        kept_sizes.append(sizes[k])
    return (places, kept, kept_sizes) if places else None


def iter_piece(storage: Storage, uri: str, compressed: bool, start: int, end: int,
               resume_at: int = -1, *, obj: int = 0, max_line: int | None = DEFAULT_MAX_LINE_BYTES,
               version: str | None = None, on_damaged: str = "errorRow",
               prefix: tuple[int, str] | None = None) -> Iterator[Block]:
    """Blocks of the lines of one piece, each line with its place; from `resume_at` when that is past `start`.

    Blank lines are left out. With `version` (from the plan), another version of the
    object is refused (`ObjectChanged`). A `.zst` object that breaks is one `corrupt_input`
    problem in its place (`on_damaged` "errorRow") or `DamagedObject` after the lines before
    it ("fail"). With `prefix` (n, sha256), the object replaced a damaged one whose first n
    bytes are rows already: it must begin with them (`ReplacementDiffers` otherwise).
    """
    if compressed and prefix is not None and prefix_digest(storage, uri, prefix[0], version) != prefix[1]:
        raise ReplacementDiffers(
            f"input object {uri} replaced a damaged one whose first {prefix[0]} uncompressed bytes are rows "
            "already, but it does not begin with the same bytes: rows of both would be mixed. Put back an object "
            "that does, or start over: bij run --restart")
    if compressed:
        with storage.open_read(uri, 0, version) as raw:
            at = 0  # where the next line starts (uncompressed)
            try:
                for pos, lines, lengths in split_blocks(ZstdFrames(raw), 0, max_line=max_line):
                    at = pos + sum(lengths) + len(lengths)
                    if at > resume_at:
                        block = _place(obj, pos, lines, lengths, resume_at, None, max_line)
                        if block:
                            yield block
            except CorruptInput as e:
                if on_damaged == "fail":
                    raise DamagedObject(obj, uri, at, str(e)) from None
                # The partial line before the break was never yielded: the error row takes its place.
                if at >= resume_at:
                    yield [(obj, at, at + 1)], [InputProblem(
                        "corrupt_input", f"{e} at uncompressed byte {at}; the rest of the object cannot be read")], [1]
        return
    begin = max(start, resume_at)
    if begin >= end:
        return
    # A resume cursor is a line start; a plain piece start may not be.
    open_at = begin if begin == resume_at or begin == 0 else begin - 1
    with storage.open_read(uri, open_at, version) as f:
        for pos, lines, lengths in split_blocks(f, open_at, max_line=max_line):
            if pos >= end:
                break
            block = _place(obj, pos, lines, lengths, begin, end, max_line)
            if block:
                yield block


def iter_shard_blocks(storage_for: Callable[[str], Storage], objects: Sequence[PlanObject], pieces: Sequence[Piece],
                      cursor: tuple[int, int] = (-1, -1), columns: list[str] | None = None,
                      max_line: int | None = DEFAULT_MAX_LINE_BYTES, parquet_rows: int = 1024,
                      on_damaged: str = "errorRow") -> Iterator[Block]:
    """All lines of a shard in input order, in blocks, skipping what lies before the durable cursor.
    `on_damaged`: what a .zst object that breaks becomes (see iter_piece).

    A Parquet object (one with `rowGroups` in the plan) yields its rows as JSON lines of
    `columns` (None: every column), each placed at (object, row number, row number + 1).
    """
    for obj, start, end in pieces:
        if obj < cursor[0]:
            continue
        resume_at = cursor[1] if obj == cursor[0] else -1
        info = objects[obj]
        uri = info.uri
        if info.row_groups is not None:
            places: list[Place] = []
            records: list[bytes | InputProblem] = []
            for row, record in iter_parquet_piece(storage_for(uri), uri, info.size, info.row_groups,
                                                  start, end, columns, resume_at, version=info.version):
                places.append((obj, row, row + 1))
                records.append(record)
                if len(places) >= parquet_rows:
                    yield places, records, [1] * len(places)
                    places, records = [], []
            if places:
                yield places, records, [1] * len(places)
            continue
        zst = layout.object_path(uri).endswith(".zst")
        yield from iter_piece(storage_for(uri), uri, zst, start, end, resume_at, obj=obj,
                              max_line=max_line, version=info.version, on_damaged=on_damaged,
                              prefix=info.prefix)


def iter_shard(storage_for: Callable[[str], Storage], objects: Sequence[PlanObject], pieces: Sequence[Piece],
               cursor: tuple[int, int] = (-1, -1), columns: list[str] | None = None,
               max_line: int | None = DEFAULT_MAX_LINE_BYTES) -> Iterator[Line]:
    """All lines of a shard in input order, one by one (see iter_shard_blocks)."""
    for places, lines, _ in iter_shard_blocks(storage_for, objects, pieces, cursor, columns, max_line):
        yield from zip(places, lines, strict=True)


@dataclass
class Chunk:
    """Consecutive lines of a shard, in columns: their places and the lines."""

    places: list[Place] = field(default_factory=list)
    data: list[bytes | InputProblem] = field(default_factory=list)
    bytes: int = 0

    @property
    def lines(self) -> list[Line]:
        return list(zip(self.places, self.data, strict=True))


_DONE = object()


@dataclass(frozen=True)
class _Damaged:
    error: DamagedObject


def _one_line_block(line: Line) -> Block:
    return [line[0]], [line[1]], [line[0][2] - line[0][1]]


class Prefetcher:
    """Reads chunks of `chunk_rows` lines in a thread; at most `depth` chunks wait in memory.

    The bound is the backpressure: however large the shard, memory holds the
    chunk being worked plus `depth` read ahead. With `prepare`, the thread also
    turns each chunk into what the consumer works on (parsed rows), so that work
    runs while the consumer waits on an engine that lets go of the interpreter.
    With `blocks`, `lines` yields blocks of lines (iter_shard_blocks), sliced into
    chunks a block at a time.
    """

    def __init__(self, lines: Iterable[Line] | Iterable[Block], chunk_rows: int, depth: int,
                 prepare: Callable[[Chunk], Any] | None = None, *, blocks: bool = False):
        self._q: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._prepare = prepare
        self.finished = False
        self.damaged: DamagedObject | None = None  # why the lines ended early (input.onDamagedObject: fail)
        # `blocks` says which of the two `lines` is (iter_shard_blocks' blocks or single lines).
        source = cast("Iterable[Block]", lines) if blocks else map(_one_line_block, cast("Iterable[Line]", lines))
        self._thread = threading.Thread(target=self._run, args=(source, chunk_rows), daemon=True,
                                        name="bij-prefetch")
        self._thread.start()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, blocks: Iterable[Block], chunk_rows: int) -> None:
        chunk = Chunk()
        try:
            for places, lines, sizes in blocks:
                at, n = 0, len(places)
                while at < n:
                    take = min(chunk_rows - len(chunk.places), n - at)
                    if take == n:
                        chunk.places += places
                        chunk.data += lines
                        chunk.bytes += sum(sizes)
                    else:
                        chunk.places += places[at:at + take]
                        chunk.data += lines[at:at + take]
                        chunk.bytes += sum(sizes[at:at + take])
                    at += take
                    if len(chunk.places) >= chunk_rows:
                        if not self._put(self._prepare(chunk) if self._prepare else chunk):
                            return
                        chunk = Chunk()
            if chunk.places and not self._put(self._prepare(chunk) if self._prepare else chunk):
                return
            self._put(_DONE)
        except DamagedObject as e:
            # The lines before the break are worked and committed like any others; then the input ends.
            if chunk.places and not self._put(self._prepare(chunk) if self._prepare else chunk):
                return
            self._put(_Damaged(e))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            self._put(e)

    def depth(self) -> int:
        return self._q.qsize()

    def next_chunk(self, block: bool = True) -> Any:
        """The next chunk; None when none is ready yet (`block=False`) or the lines are over (`finished`)."""
        if self.finished:
            return None
        try:
            item = self._q.get(block=block)
        except queue.Empty:
            return None
        if item is _DONE or isinstance(item, _Damaged):
            self.finished = True
            self.damaged = item.error if isinstance(item, _Damaged) else None
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def __iter__(self) -> Iterator[Chunk]:
        while True:
            item = self._q.get()
            if item is _DONE or isinstance(item, _Damaged):
                self.finished = True
                self.damaged = item.error if isinstance(item, _Damaged) else None
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        self._stop.set()
