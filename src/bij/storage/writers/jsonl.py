"""`output.format: jsonl`: JSON lines, one row each (orjson, as the durable logs hold them), zstd-compressed
(`.jsonl.zst`) unless output.compression is none (`.jsonl`). OpenAI batch input publishes its output
lines this way too: the row shape is the worker's, the file is JSON lines either way. Every format's
error and capped files are these."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import IO, Any

import zstandard

from bij.storage import exact_json
from bij.storage.segments import encode_records
from bij.storage.writers.base import ResultShape

LEVEL = 3  # zstd level of published files


class _Part:
    """Rows kept encoded (bytes are smaller than dicts), compressed in one go at the end."""

    def __init__(self, shape: ResultShape):
        self.compression = shape.compression
        self.lines: list[bytes] = []

    def add(self, row: dict[str, Any]) -> None:
        self.lines.append(encode_records([row]))

    def __len__(self) -> int:
        return len(self.lines)

    def finish(self) -> bytes:
        data = b"".join(self.lines)
        return zstandard.ZstdCompressor(level=LEVEL).compress(data) if self.compression == "zstd" else data


class _Stream:
    """Rows written to the spool as they come, compressed as they go."""

    def __init__(self, shape: ResultShape, spool: Callable[[], IO[bytes]]):
        self.spool = spool()
        self.cctx = zstandard.ZstdCompressor(level=LEVEL).compressobj() if shape.compression == "zstd" else None

    def add(self, row: dict[str, Any]) -> None:
        line = encode_records([row])
        self.spool.write(self.cctx.compress(line) if self.cctx is not None else line)

    def finish(self) -> IO[bytes]:
        if self.cctx is not None:
            self.spool.write(self.cctx.flush())
        self.spool.seek(0)
        return self.spool

    def discard(self) -> None:
        self.spool.close()


class JsonlWriter:
    name = "jsonl"
    suffixes: tuple[str, ...] = (".jsonl.zst", ".jsonl")
    error_format = "jsonl"
    typed_ids = False

    def suffix(self, compression: str) -> str:
        return ".jsonl.zst" if compression == "zstd" else ".jsonl"

    def part(self, shape: ResultShape) -> _Part:
        return _Part(shape)

    def stream(self, shape: ResultShape, spool: Callable[[], IO[bytes]], batch_rows: int) -> _Stream:
        return _Stream(shape, spool)

    def lines(self, data: bytes, path: str) -> Iterator[bytes]:
        """The lines as stored (ids come back exactly as given)."""
        if path.endswith(".zst"):
            data = zstandard.ZstdDecompressor().decompress(data, max_output_size=1 << 34)
        for line in data.splitlines():
            if line.strip():
                yield line

    def rows(self, data: bytes, path: str) -> Iterator[dict[str, Any]]:
        for line in self.lines(data, path):
            yield exact_json.loads(line)  # integers beyond 64 bits too


JSONL = JsonlWriter()
