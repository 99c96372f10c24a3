"""Stream a shard's input lines, aligned to line starts, through a bounded prefetch queue.

A piece ``[start, end)`` of a plain object owns the lines whose first byte lies
in it: reading starts one byte early and drops the partial line, and stops at
the first line that starts at or after `end`. Compressed objects are read from
their beginning. Resuming starts at the cursor (always a line start) instead.
Parquet pieces are row groups; their rows come as JSON lines (see parquet.py).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import zstandard

from .parquet import iter_parquet_piece
from .storage import Storage, iter_lines

Line = tuple[tuple[int, int, int], bytes]  # ((object, offset, end), line)


def iter_piece(storage: Storage, uri: str, compressed: bool, start: int, end: int,
               resume_at: int = -1) -> Iterator[Line]:
    """Lines of one piece, each with its place; from `resume_at` when that is past `start`."""
    obj_placeholder = 0
    if compressed:
        with storage.open_read(uri) as raw:
            reader = zstandard.ZstdDecompressor().stream_reader(raw, read_size=1 << 20)
            for off, line in iter_lines(reader, 0):  # type: ignore[arg-type]
                if off < resume_at:
                    continue
                yield (obj_placeholder, off, off + len(line) + 1), line
        return
    begin = max(start, resume_at)
    if begin >= end:
        return
    # A resume cursor is a line start; a plain piece start may not be.
    open_at = begin if begin == resume_at or begin == 0 else begin - 1
    with storage.open_read(uri, open_at) as f:
        for off, line in iter_lines(f, open_at):
            if off < begin:
                continue
            if off >= end:
                break
            yield (obj_placeholder, off, off + len(line) + 1), line


def iter_shard(storage_for: Callable[[str], Storage], objects: list[dict[str, Any]], pieces: list[list[int]],
               cursor: tuple[int, int] = (-1, -1), columns: list[str] | None = None) -> Iterator[Line]:
    """All lines of a shard in input order, skipping what lies before the durable cursor.

    A Parquet object (one with `rowGroups` in the plan) yields its rows as JSON lines of
    `columns`, each placed at (object, row number, row number + 1).
    """
    for obj, start, end in pieces:
        if obj < cursor[0]:
            continue
        resume_at = cursor[1] if obj == cursor[0] else -1
        info = objects[obj]
        uri = info["uri"]
        if "rowGroups" in info:
            for row, line in iter_parquet_piece(storage_for(uri), uri, int(info["size"]), info["rowGroups"],
                                                start, end, columns or [], resume_at):
                yield (obj, row, row + 1), line
            continue
        for (_, off, stop), line in iter_piece(storage_for(uri), uri, uri.endswith(".zst"), start, end, resume_at):
            if line and not line.isspace():
                yield (obj, off, stop), (line[:-1] if line.endswith(b"\r") else line)


@dataclass
class Chunk:
    lines: list[Line] = field(default_factory=list)
    bytes: int = 0


_DONE = object()


class Prefetcher:
    """Reads chunks of `chunk_rows` lines in a thread; at most `depth` chunks wait in memory.

    The bound is the backpressure: however large the shard, memory holds the
    chunk being worked plus `depth` read ahead. With `prepare`, the thread also
    turns each chunk into what the consumer works on (parsed rows), so that work
    runs while the consumer waits on an engine that lets go of the interpreter.
    """

    def __init__(self, lines: Iterator[Line], chunk_rows: int, depth: int,
                 prepare: Callable[[Chunk], Any] | None = None):
        self._q: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._prepare = prepare
        self.finished = False
        self._thread = threading.Thread(target=self._run, args=(lines, chunk_rows), daemon=True,
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

    def _run(self, lines: Iterator[Line], chunk_rows: int) -> None:
        try:
            chunk = Chunk()
            for item in lines:
                chunk.lines.append(item)
                chunk.bytes += item[0][2] - item[0][1]
                if len(chunk.lines) >= chunk_rows:
                    if not self._put(self._prepare(chunk) if self._prepare else chunk):
                        return
                    chunk = Chunk()
            if chunk.lines and not self._put(self._prepare(chunk) if self._prepare else chunk):
                return
            self._put(_DONE)
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
        if item is _DONE:
            self.finished = True
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def __iter__(self) -> Iterator[Chunk]:
        while True:
            item = self._q.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        self._stop.set()
