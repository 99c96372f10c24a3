"""The storage interface every scheme implements (`Storage`), its shared constants, and the line
splitting that readers of any scheme use."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, BinaryIO, Protocol, cast

from bij.storage.objects import (
    ObjectInfo,
    ObjectPage,
)

MULTIPART_BYTES = 8 << 20  # the S3 part size of `write_stream` (S3 needs at least 5 MiB but for the last)
# Objects in one page of `list_pages` and one request of `delete_many` (S3's ListObjectsV2 and
# DeleteObjects take at most 1,000).
PAGE = 1000


class Storage(Protocol):
    # file:// can append to an object in place (with fsync); s3:// cannot, so
    # durable logs there are written as immutable segment objects instead.
    supports_append: bool

    def list(self, uri: str) -> list[ObjectInfo]:
        """Objects at `uri` (one object) or under it (a prefix), sorted by URI."""
        ...

    def list_pages(self, uri: str) -> Iterator[ObjectPage]:
        """Objects under `uri` as `list` finds them, a page of at most `PAGE` at a time, in no set order:
        memory holds one page however many there are (for what walks millions of objects)."""
        ...

    def delete_many(self, uris: Iterable[str]) -> dict[str, str]:
        """Delete objects, `PAGE` to a request where the store takes batches; one missing is no error.
        Returns what could not be deleted: URI -> why (a request that fails whole raises `StorageError`)."""
        ...

    def open_read(self, uri: str, start: int = 0, version: str | None = None) -> BinaryIO:
        """A stream of the object's bytes from `start` to its end; with `version`, only of that
        version of the object (`ObjectChanged` otherwise)."""
        ...

    def read_bytes(self, uri: str) -> bytes: ...

    def read_range(self, uri: str, start: int, length: int) -> bytes:
        """`length` bytes of the object from `start` (fewer where it ends sooner), in one request: a
        slice of a large object read without the rest (S3 and GCS: a GET with a Range header)."""
        ...

    def write_bytes(self, uri: str, data: bytes) -> None:
        """Write a whole object atomically: readers see the old object, or the new one, never a part."""
        ...

    def create(self, uri: str, data: bytes) -> bool:
        """Write a whole object only if none exists there; False (and nothing written) if one does."""
        ...

    def write_stream(self, uri: str, parts: Iterable[bytes]) -> int:
        """Write a whole object from `parts` as they come, holding one part (or one S3 part of
        `MULTIPART_BYTES`) at a time, atomically as `write_bytes`. Returns its size."""
        ...

    def exists(self, uri: str) -> bool: ...

    def delete(self, uri: str) -> None: ...

    def append_durable(self, uri: str, data: bytes) -> None:
        """Append and fsync (file:// only)."""
        ...

    def remove_stale_temp(self, uri: str, older_than_s: float) -> int:
        """Delete temp files of atomic writes killed midway under `uri` (file:// only); returns how many."""
        ...


def split_lines(stream: Any, base_offset: int, block: int = 1 << 20,
                max_line: int | None = None) -> Iterator[tuple[int, bytes | None, int]]:
    """Yield (offset of the line's first byte, line without its newline, its length) from a byte stream.

    Linear in the bytes read, however long a line: each block is searched once, and a line
    that spans blocks is joined once. A line longer than `max_line` bytes is not kept: it
    comes as (offset, None, length), with its bytes dropped as they are read. A last line
    without a trailing newline is yielded too.
    """
    for pos, lines, lengths in split_blocks(stream, base_offset, block, max_line):
        for line, n in zip(lines, lengths, strict=True):
            yield pos, line, n
            pos += n + 1


def split_blocks(stream: Any, base_offset: int, block: int = 1 << 20,
                 max_line: int | None = None) -> Iterator[tuple[int, list[bytes | None], list[int]]]:
    """`split_lines` a block at a time: (offset of the first line, lines, their lengths).

    The lines of one item follow each other in the stream, each followed by its newline
    (but perhaps the stream's last line). A line over `max_line` bytes is None, its
    length still given. One split and one length pass per block, in C: no Python work
    per line here.
    """
    limit = -1 if max_line is None else max_line
    parts: list[bytes] = []  # pieces of the line not ended yet (none once it is over the limit)
    size = 0  # its length so far
    pos = base_offset  # offset of its first byte
    while True:
        data: bytes = stream.read(block)
        if not data:
            break
        lines = data.split(b"\n")
        tail = lines.pop()
        if size and lines:  # the line left open by the last block ends in this one
            head = lines[0]
            n = size + len(head)
            if limit < 0 or n <= limit:
                parts.append(head)
                yield pos, [b"".join(parts)], [n]
            else:
                yield pos, [None], [n]
            parts, size = [], 0
            pos += n + 1
            lines = lines[1:]
        if lines:
            lengths = list(map(len, lines))
            if 0 <= limit < len(data):  # a line inside this block may be over the limit
                yield pos, [line if n <= limit else None for line, n in zip(lines, lengths, strict=True)], lengths
            else:
                yield pos, cast("list[bytes | None]", lines), lengths
            pos += sum(lengths) + len(lengths)
        if tail:
            size += len(tail)
            if limit < 0 or size <= limit:
                parts.append(tail)
            else:
                parts = []
    if size:
        yield pos, [b"".join(parts) if limit < 0 or size <= limit else None], [size]


