"""What planning reads of a round's input: its objects listed and checked (input files only, each with
a version), Parquet footers, each JSONL object's first row, a sample for the canary's estimate; and
`PlanError` when the input cannot be planned."""

from __future__ import annotations

from typing import Any

import orjson
import zstandard

from bij.contract import layout
from bij.contract.columns import clash_message, first_clash
from bij.contract.errors import BijError
from bij.contract.globs import glob_matches, split_glob
from bij.contract.spec import BatchInferenceJob
from bij.storage import ObjectInfo, Storage, StorageError, StorageRefused, open_storage
from bij.storage.parquet import SUFFIX as PARQUET_SUFFIX
from bij.storage.parquet import Footer, read_footer

INPUT_SUFFIXES = (".jsonl", ".ndjson", ".json", ".jsonl.zst", ".ndjson.zst", ".json.zst")


class PlanError(BijError):
    """The input cannot be planned (nothing there, wrong files); names the URI.

    `permanent`: the same on every retry (`bij run` exits 42); otherwise an outage that may pass.
    """

    def __init__(self, message: str, permanent: bool = True):
        super().__init__(message, permanent=permanent)


def is_compressed(uri: str) -> bool:
    return layout.object_path(uri).endswith(".zst")


def input_objects(objects: list[ObjectInfo], input_uri: str = "", parquet: bool = False) -> list[ObjectInfo]:
    """The objects that are input rows: JSONL files, plain or zstd (or Parquet files); empty ones
    skipped, and so is anything whose name or folder (at any depth below `input_uri`) starts with
    "_" or "." (`_temporary/`, `.staging/`, `_bij/`, `_SUCCESS`)."""
    suffixes = (PARQUET_SUFFIX,) if parquet else INPUT_SUFFIXES
    base = input_uri.rstrip("/")
    out = []
    for o in objects:
        if not layout.object_path(o.uri).endswith(suffixes) or o.size <= 0:
            continue
        rel = o.uri[len(base):] if base and o.uri.startswith(base) else o.uri.rsplit("/", 1)[-1]
        if any(part.startswith((".", "_")) for part in rel.split("/") if part):
            continue
        out.append(o)
    return out


def read_footers(job: BatchInferenceJob, objects: list[ObjectInfo]) -> dict[int, Footer]:
    """Each Parquet object's footer (a ranged read at its end, no row read), checked for the
    columns the spec names: a missing text column is a planning error that names the field."""
    inp = job.spec.input
    footers: dict[int, Footer] = {}
    for i, o in enumerate(objects):
        try:
            footer = read_footer(open_storage(o.uri, job.spec.storage.s3), o.uri, o.size)
        except (OSError, ValueError) as e:  # pyarrow: ArrowInvalid is a ValueError, a bad footer
            raise PlanError(f"spec.input.uri: {o.uri} is not a readable Parquet file: {e}") from None
        wanted = [inp.text_field] + ([inp.messages_field] if inp.messages_field else [])
        # With spec.prompt the prompt comes from the template's columns: a row missing one is its error row.
        if job.spec.prompt is None and not any(c in footer.columns for c in wanted):
            field = "spec.input.textField" + (" / spec.input.messagesField" if inp.messages_field else "")
            raise PlanError(f"{field}: {o.uri} has no column {' or '.join(map(repr, wanted))} "
                            f"(its columns: {', '.join(footer.columns)})")
        clash = first_clash(footer.columns, inp.consumed_columns()) if inp.carries_every_column() else None
        if clash is not None:
            raise PlanError(f"spec.input.passThrough: {clash_message(clash, f'in {o.uri}')}")
        footers[i] = footer
    return footers


# How much of an object's start the planner reads for its first row (a longer first row is left
# to the worker, which makes any row with a clashing column an error row naming it).
FIRST_ROW_BYTES = 1 << 20


def check_first_rows(job: BatchInferenceJob, objects: list[ObjectInfo]) -> None:
    """Refuse a JSONL job whose rows would carry a column named like a result field (input.passThrough
    unset: every column is carried), from the first row of each object: one short read per object."""
    inp = job.spec.input
    if not inp.carries_every_column():
        return
    skip = inp.consumed_columns()
    for o in objects:
        line = first_line(open_storage(o.uri, job.spec.storage.s3), o.uri, is_compressed(o.uri))
        try:
            row = orjson.loads(line) if line else None
        except ValueError:
            continue  # a bad first row is the worker's to report, as an error row
        clash = first_clash(row, skip) if isinstance(row, dict) else None
        if clash is not None:
            raise PlanError(f"spec.input.passThrough: {clash_message(clash, f'line 1 of {o.uri}')}")


def read_head(storage: Storage, uri: str, compressed: bool, limit: int, stop_at_line: bool = False) -> bytes | None:
    """An object's first `limit` bytes or more (decompressed for .zst; all of it when shorter), read in 64 KiB
    blocks; with `stop_at_line` only until its first newline. None when it cannot be read here."""
    try:
        with storage.open_read(uri) as raw:
            stream: Any = zstandard.ZstdDecompressor().stream_reader(raw) if compressed else raw
            head = b""
            while len(head) < limit:
                part = stream.read(64 << 10)
                if not part:
                    break
                head += part
                if stop_at_line and b"\n" in part:
                    break
            return head
    except (StorageError, zstandard.ZstdError, OSError):
        return None


def first_line(storage: Storage, uri: str, compressed: bool) -> bytes | None:
    """An object's first line (decompressed for .zst), or None when it is longer than FIRST_ROW_BYTES
    or cannot be read here (the worker reads it and says what is wrong)."""
    head = read_head(storage, uri, compressed, FIRST_ROW_BYTES, stop_at_line=True)
    if head is None:
        return None
    if b"\n" in head:
        return head.split(b"\n", 1)[0]
    return head if len(head) < FIRST_ROW_BYTES else None


# What the canary's estimate of rows per byte reads of the input's first object.
SAMPLE_BYTES = 256 << 10


def mean_row_bytes(storage: Storage, uri: str, compressed: bool) -> float:
    """The mean length of the lines in an object's first SAMPLE_BYTES (decompressed for .zst; a .zst shard's
    bytes are compressed, so there it counts fewer rows than there are); 1 KiB when none can be read."""
    head = read_head(storage, uri, compressed, SAMPLE_BYTES)
    if head is None:
        return 1024.0
    lines = head.count(b"\n")
    if not lines:
        return float(max(len(head), 1024))
    return (head.rindex(b"\n") + 1) / lines


def list_input(job: BatchInferenceJob, input_uri: str, parquet: bool = False) -> list[ObjectInfo]:
    base, pattern = split_glob(input_uri)
    try:
        listed = open_storage(base, job.spec.storage.s3).list(base)
        if pattern is not None:
            listed = [o for o in listed if glob_matches(pattern, o.uri[len(base):])]
        objects = input_objects(listed, base, parquet)
    except StorageRefused as e:  # stays a refusal: the bij fails rather than waiting for input to appear
        raise StorageRefused(f"spec.input.uri: cannot list {input_uri}: {e}") from None
    except StorageError as e:
        raise PlanError(f"spec.input.uri: cannot list {input_uri}: {e}", permanent=e.permanent) from None
    check_versions(objects)
    return objects


def check_versions(objects: list[ObjectInfo]) -> None:
    """Refuse an input object without a version (an https:// server that sends neither a strong ETag nor
    Last-Modified): shards read it at different times, and nothing could tell when it changed between
    them, so rows of two versions could be published as one input."""
    for o in objects:
        if o.version is None:
            raise PlanError(f"spec.input.uri: {o.uri} has no version to plan against: the server sends neither a "
                            "strong ETag nor a Last-Modified date, so a change between two shards' reads could not "
                            "be told. Serve it with an ETag (S3, GCS and common web servers do), or copy it to "
                            "s3:// or file://")
