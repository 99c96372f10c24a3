"""What a result writer is: the interface every `spec.output.format` implements (one module each).

A writer turns result rows into the bytes of one published file and reads such a file back. Where
files go, how a shard's rows are cut into them, their checksums and the durable write are the
publish write pass's (bij.steps.publish_rows), the same for every format.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any, Protocol


@dataclass(frozen=True)
class ResultShape:
    """What every result file of a job shares: its task, the `id` column's type for the whole job
    ('int', 'str' or 'mixed'; see `ResultWriter.typed_ids`), whether a judge ran (its `attempts` and
    `round` columns), and the compression, 'zstd' or 'none' (spec.output.compression)."""

    task: str
    id_kind: str
    judged: bool
    compression: str


class FilePart(Protocol):
    """One file part being filled, held in memory: at most the plan's `fileRows` rows."""

    def add(self, row: dict[str, Any]) -> None: ...

    def __len__(self) -> int: ...

    def finish(self) -> bytes:
        """The whole file."""
        ...


class HeldRows:
    """A `FilePart` that holds its rows as they come and encodes them all at once: for a format that sees
    every row before it chooses its columns (Parquet, CSV). `encode` makes the file of a shape's rows."""

    def __init__(self, shape: ResultShape, encode: Callable[[list[dict[str, Any]], ResultShape], bytes]):
        self.shape, self.encode = shape, encode
        self.rows: list[dict[str, Any]] = []

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)

    def __len__(self) -> int:
        return len(self.rows)

    def finish(self) -> bytes:
        return self.encode(self.rows, self.shape)


class FileStream(Protocol):
    """One file of any number of rows (output.partitionBy input), kept in spool files as it fills so
    that memory stays bounded."""

    def add(self, row: dict[str, Any]) -> None: ...

    def finish(self) -> IO[bytes]:
        """The whole file, read from its start; the caller closes it."""
        ...

    def discard(self) -> None:
        """Drop what was added: no file is written."""
        ...


class ResultWriter(Protocol):
    """One output format: how its files are named, encoded and read back."""

    name: str  # spec.output.format
    suffixes: tuple[str, ...]  # every suffix its files can have: `bij results` knows a file's format by it
    error_format: str  # the format of the error and capped files published beside its results
    typed_ids: bool  # its id column has one type for the whole job: publish counts int and str ids first

    def suffix(self, compression: str) -> str:
        """The suffix of its files with this compression."""
        ...

    def part(self, shape: ResultShape) -> FilePart:
        """An empty file part (output.partitionBy shard: a shard's files, cut every `fileRows` rows)."""
        ...

    def stream(self, shape: ResultShape, spool: Callable[[], IO[bytes]], batch_rows: int) -> FileStream:
        """An empty file of any size; `spool()` gives a temporary file to keep it in, `batch_rows` is how
        many rows it may hold in memory at once."""
        ...

    def rows(self, data: bytes, path: str) -> Iterator[dict[str, Any]]:
        """The rows of a published file (`path` says its suffix), in the JSONL result shape."""
        ...

    def lines(self, data: bytes, path: str) -> Iterator[bytes]:
        """The rows of a published file as JSON lines, without their newlines (as stored, where they are)."""
        ...
