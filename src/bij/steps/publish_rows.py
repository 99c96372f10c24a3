"""The row-level work of publishing, in passes whose memory does not grow with the job.

The operator (or `bij run`) writes a publish plan and runs three passes, each
indexed like a round's shards, as worker processes or in its own process; it then
writes `manifest.json` from the small per-shard summaries the last pass leaves.

1. ``ids`` (one per shard): stream the shard's durable log and write every row's
   id with its place into ONE ids file, grouped by bucket (a hash of the id), behind
   an index of each bucket's byte offsets (`IdsHeader`).
2. ``dedupe`` (one per bucket): read the bucket's slice of every shard's ids file,
   two ranged reads a shard (its index entry, then the slice; none for an empty
   slice); for each id the first occurrence in input order (round, shard, object,
   offset) wins, whatever its kind; every later *result* with that id is a loser.
   A bucket with losers leaves one losers file; one without leaves none.
3. ``write`` (one per shard): stream the log again and write its result, error
   and capped files, losers turned into ``duplicate_id`` error rows, in input
   order; leave a summary record with counts, files and checksums.

Objects written grow with shards, buckets with duplicates and output parts, never
shards x buckets: a 15,000-shard job writes 15,000 ids files, not one per shard and bucket.

A pass holds one bucket (``bucketRows`` ids, spec.output.publishBucketRows), or one file part (``fileRows``
rows), never the job. Every pass is deterministic and rewrites its outputs
whole, so publishing again gives the same files.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import struct
import tempfile
import zlib
from collections.abc import Iterator, Mapping
from typing import IO, Any

import orjson
import zstandard

from bij.contract import layout
from bij.contract.codes import EXIT_BAD_CONFIG, EXIT_FAILED, EXIT_OK
from bij.contract.columns import result_fields
from bij.contract.publish_plan import PASSES, PublishPlan, PublishPlanError, Unit
from bij.contract.result_rows import id_key, row_id, row_usage
from bij.steps.publish_not_run import count_not_run
from bij.storage import NotFound, Storage, StorageError, open_storage
from bij.storage.segments import LEVEL, ShardLog
from bij.storage.writers import ResultShape, ResultWriter, writer_for

log = logging.getLogger("bij.worker")
FILE_ROWS = 100_000  # rows in one published file part (a shard's files are cut into parts of this many)
SPOOL_BYTES = 64 << 20  # a partitioned file is held in memory up to this size, on local disk beyond


class IdsHeader:
    """The head of a shard's ids file (pass 1): what a reader needs to find one bucket's slice.

    Bytes 0-23: ``bij-ids\\x02``, flags (1: the shard's log was in input order), the bucket count
    (little-endian u64 each); then buckets + 1 u64 offsets: bucket b is bytes [offset b, offset b+1),
    one zstd frame of JSON lines ``[key, object, offset, is_result]``, or nothing when empty.
    """

    MAGIC = b"bij-ids\x02"
    HEAD = struct.Struct("<8sQQ")
    OFFSETS = struct.Struct("<QQ")  # one bucket's start and end

    @classmethod
    def pack(cls, ordered: bool, slices: list[bytes]) -> bytes:
        """The header for `slices` (one per bucket, in order), which follow it in the file."""
        at = cls.HEAD.size + 8 * (len(slices) + 1)
        offsets = [at]
        for part in slices:
            at += len(part)
            offsets.append(at)
        return cls.HEAD.pack(cls.MAGIC, int(ordered), len(slices)) + struct.pack(f"<{len(offsets)}Q", *offsets)

    @classmethod
    def slice_at(cls, bucket: int) -> int:
        """Where bucket `bucket`'s start and end offsets lie in the file."""
        return cls.HEAD.size + 8 * bucket


def _older_ids(store: Storage, prefix: str, unit: int, bucket: int) -> bytes:
    """A bucket file a pass 1 of an older version wrote (one zstd frame, or plain before that): a publish
    begun by an older bij goes on without its ids pass again."""
    uri = layout.publish_bucket_ids_uri(prefix, unit, bucket)
    try:
        data = store.read_bytes(uri)
    except NotFound:
        try:
            return store.read_bytes(uri.removesuffix(".zst"))
        except NotFound:
            raise StorageError(f"{layout.publish_ids_uri(prefix, unit)} does not exist: publish pass ids has not "
                               f"run for shard unit {unit}; publish again", permanent=True) from None
    return _decompress(data, uri)


def _decompress(data: bytes, uri: str) -> bytes:
    try:
        return zstandard.ZstdDecompressor().decompress(data)
    except zstandard.ZstdError as e:
        raise StorageError(f"id bucket {uri} does not decode ({e}); publish again to rewrite it",
                           permanent=True) from None


def _read_ids(store: Storage, prefix: str, unit: int, bucket: int) -> bytes:
    """Bucket `bucket`'s ids of shard unit `unit`: two ranged reads of its ids file (its offsets, then
    its slice), one when the slice is empty."""
    uri = layout.publish_ids_uri(prefix, unit)
    try:
        head = store.read_range(uri, IdsHeader.slice_at(bucket), IdsHeader.OFFSETS.size)
    except NotFound:
        return _older_ids(store, prefix, unit, bucket)
    if len(head) != IdsHeader.OFFSETS.size:
        raise StorageError(f"ids file {uri} has no bucket {bucket}: it was written for another publish plan; "
                           "publish again to rewrite it", permanent=True)
    start, end = IdsHeader.OFFSETS.unpack(head)
    if start == end:
        return b""
    data = store.read_range(uri, start, end - start)
    if len(data) != end - start:
        raise StorageError(f"ids file {uri} ends inside bucket {bucket}; publish again to rewrite it",
                           permanent=True)
    return _decompress(data, f"{uri} (bucket {bucket})")


def _ordered(store: Storage, prefix: str, unit: int, buckets: int) -> bool:
    """Whether shard unit `unit`'s log was in input order, as its ids file says (and checks that file
    was written for `buckets` buckets, the plan's)."""
    uri = layout.publish_ids_uri(prefix, unit)
    try:
        magic, flags, written = IdsHeader.HEAD.unpack_from(store.read_range(uri, 0, IdsHeader.HEAD.size).ljust(
            IdsHeader.HEAD.size, b"\0"))
    except NotFound:  # an older pass 1's
        return bool(json.loads(store.read_bytes(layout.publish_order_uri(prefix, unit)))["ordered"])
    if magic != IdsHeader.MAGIC or written != buckets:
        raise StorageError(f"ids file {uri} was not written for this publish plan ({buckets} buckets); "
                           "publish again to rewrite it", permanent=True)
    return bool(flags & 1)


def bucket_of(key: str, buckets: int) -> int:
    """A stable bucket for an id key (crc32: the same in every process and Python version)."""
    return zlib.crc32(key.encode("utf-8", "surrogatepass")) % buckets


def load(uri: str, s3: Any) -> PublishPlan:
    """The publish plan at `uri`, read with the job's S3 settings (see `open_storage`); PublishPlanError
    when it is missing or unreadable."""
    try:
        data = open_storage(uri, s3).read_bytes(uri)
    except NotFound:
        raise PublishPlanError(f"publish plan {uri} does not exist") from None
    return PublishPlan.from_json(data, f"publish plan {uri}")


def count(plan: PublishPlan, pass_name: str) -> int:
    """How many indexes a pass has: one per shard, or one per bucket."""
    return plan.count(pass_name)


def _records(store: Storage, unit: Unit, ordered: bool) -> Iterator[dict[str, Any]]:
    """A shard's final records (no judge steps), in input order.

    A log whose records are already in input order (one writer, the usual case) is
    streamed; when several writers interleave (a resumed or duplicate pod) the
    shard is sorted in memory, bounded by the shard's size rather than the job's.
    """
    records = (rec for rec in ShardLog(store, unit[2]).scan()
               if rec["kind"] not in ("attempt", "rejected"))
    if ordered:
        yield from records
        return
    yield from sorted(records, key=lambda rec: (rec["at"][0], rec["at"][1]))


def run_ids(plan: PublishPlan, index: int, store: Storage) -> None:
    """Pass 1: every id of shard `index` with its place, into the bucket files."""
    buckets = plan.buckets
    # bytearrays, not lists of orjson's bytes: each of those keeps a 4 KiB buffer.
    parts = [bytearray() for _ in range(buckets)]
    unit = plan.unit(index)
    last: tuple[int, int] = (-1, -1)
    ordered = True
    for rec in _records(store, unit, ordered=True):  # the log's own order: pass 1 needs no other
        at = (rec["at"][0], rec["at"][1])
        ordered = ordered and at > last
        last = max(last, at)
        rid = row_id(rec["row"])
        if rid is None:
            continue
        key = id_key(rid)
        entry = [key, rec["at"][0], rec["at"][1], rec["kind"] == "result"]
        part = parts[bucket_of(key, buckets)]
        part += orjson.dumps(entry)
        part += b"\n"
    # Compressed: ids are a good part of the work files beside the logs. One file, one write, whatever
    # the buckets: an empty bucket is an empty slice.
    cctx = zstandard.ZstdCompressor(level=LEVEL, write_checksum=True)
    slices = []
    for b in range(buckets):
        slices.append(cctx.compress(bytes(parts[b])) if parts[b] else b"")
        parts[b] = bytearray()
    store.write_stream(layout.publish_ids_uri(plan.prefix, index), [IdsHeader.pack(ordered, slices), *slices])


def run_dedupe(plan: PublishPlan, bucket: int, store: Storage) -> None:
    """Pass 2: the first occurrence of each id in bucket `bucket` wins; the results after it lose."""
    first: dict[str, tuple[int, int, int]] = {}
    results: list[tuple[str, tuple[int, int, int]]] = []
    for unit in range(plan.unit_count):
        data = _read_ids(store, plan.prefix, unit, bucket)
        for line in data.splitlines():
            key, obj, off, is_result = orjson.loads(line)
            if bucket_of(key, plan.buckets) != bucket:  # a file of another plan, found before it counts
                raise StorageError(f"ids of shard unit {unit} do not fall in bucket {bucket} of this publish plan; "
                                   "publish again to rewrite them", permanent=True)
            place = (unit, obj, off)
            if key not in first or place < first[key]:
                first[key] = place
            if is_result:
                results.append((key, place))
        del data
    losers: dict[str, list[list[int]]] = {}
    for key, place in results:
        if first[key] != place:
            losers.setdefault(str(place[0]), []).append([place[1], place[2]])
    uri = layout.publish_losers_uri(plan.prefix, bucket)
    if losers:
        store.write_bytes(uri, json.dumps(losers, sort_keys=True).encode())
    else:  # no object for a bucket without duplicates; one an earlier publish left must not count
        store.delete(uri)


_LOSERS_NAME = re.compile(r"(\d{5,})\.json")


def _losers_of(plan: PublishPlan, index: int, store: Storage) -> set[tuple[int, int]]:
    """The places of shard unit `index` whose results lost to an earlier id: from the buckets that have
    losers files (one listing), of this plan's buckets (a file beyond them is an earlier plan's)."""
    losers: set[tuple[int, int]] = set()
    for page in store.list_pages(layout.publish_losers_folder(plan.prefix)):
        for info in page:
            m = _LOSERS_NAME.fullmatch(info.uri.rsplit("/", 1)[-1])
            if m is None or int(m.group(1)) >= plan.buckets:
                continue
            for obj, off in json.loads(store.read_bytes(info.uri)).get(str(index), []):
                losers.add((obj, off))
    return losers


class _FileParts:
    """One kind of published file for a shard (results, errors or capped), cut into parts of `FILE_ROWS`."""

    def __init__(self, plan: PublishPlan, store: Storage, folder: str, name: str, writer: ResultWriter):
        self.plan, self.store, self.folder, self.name, self.writer = plan, store, folder, name, writer
        self.shape = _shape(plan)
        self.part = writer.part(self.shape)
        self.files: list[dict[str, Any]] = []
        self.limit = FILE_ROWS if plan.file_rows is None else plan.file_rows

    def add(self, row: dict[str, Any]) -> None:
        self.part.add(row)
        if len(self.part) >= self.limit:
            self.flush()

    def flush(self) -> None:
        n = len(self.part)
        if not n:
            return
        index = len(self.files)
        name = self.name if index == 0 else f"{self.name}-{index:03d}"
        path = f"{self.folder}/{name}{self.writer.suffix(self.plan.compression)}"
        data = self.part.finish()
        self.part = self.writer.part(self.shape)
        self.store.write_bytes(f"{self.plan.output_uri.rstrip('/')}/{path}", data)
        self.files.append({"path": path, "rows": n, "bytes": len(data),
                           "sha256": hashlib.sha256(data).hexdigest()})

    def close(self, always: bool = False) -> None:
        """Write the last part (a shard without rows of this kind has no file, `always` or not)."""
        self.flush()


class _PartitionFile:
    """One kind of published file for one input object (output.partitionBy input): one file, whatever
    its rows, built in spooled temporary files (in memory up to SPOOL_BYTES, on local disk beyond) and
    streamed to storage."""

    def __init__(self, plan: PublishPlan, store: Storage, folder: str, stem: str, writer: ResultWriter):
        self.plan, self.store = plan, store
        self.path = f"{folder}/{stem}{writer.suffix(plan.compression)}"
        limit = FILE_ROWS if plan.file_rows is None else plan.file_rows
        self.stream = writer.stream(_shape(plan), _spool, limit)
        self.n = 0
        self.files: list[dict[str, Any]] = []

    def add(self, row: dict[str, Any]) -> None:
        self.n += 1
        self.stream.add(row)

    def close(self, always: bool = False) -> None:
        """Write the file (with `always`, even without rows: a results file for every input object)."""
        if self.n == 0 and not always:
            self.stream.discard()
            return
        spool = self.stream.finish()
        digest = hashlib.sha256()

        def parts() -> Iterator[bytes]:
            while part := spool.read(1 << 20):
                digest.update(part)
                yield part

        try:
            size = self.store.write_stream(f"{self.plan.output_uri.rstrip('/')}/{self.path}", parts())
        finally:
            spool.close()
        self.files.append({"path": self.path, "rows": self.n, "bytes": size, "sha256": digest.hexdigest()})


def _spool() -> IO[bytes]:
    return tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES)  # noqa: SIM115 - the file's user closes it


def _shape(plan: PublishPlan) -> ResultShape:
    return ResultShape(plan.task, plan.id_kind or "mixed", plan.judge, plan.compression)


class _OutOfOrder(Exception):
    """A shard's log is not in input order (several writers interleaved): publish it sorted."""


def run_write(plan: PublishPlan, index: int, store: Storage) -> None:
    """Pass 3: shard `index`'s published files, losers as duplicate_id errors, and its summary."""
    # Without an ids pass (no id repeats) nothing has said whether the log is in input order: that shows
    # as it streams, and a log out of order (rare) is written again from its sorted records, the same names.
    losers = set() if plan.unique_ids else _losers_of(plan, index, store)
    ordered = plan.unique_ids or _ordered(store, plan.prefix, index, plan.buckets)
    try:
        _write(plan, index, store, losers, ordered)
    except _OutOfOrder:
        _write(plan, index, store, losers, ordered=False)


def _write(plan: PublishPlan, index: int, store: Storage, losers: set[tuple[int, int]], ordered: bool) -> None:
    unit = _UnitWriter(plan, store, index, losers)
    if plan.partial is not None:
        unit.add_not_run(index)
    # output.partitionBy input: the unit's objects lie whole in it; each gets its own files, one object at a time.
    partitions = list(plan.unit_objects[index]) if plan.partition_by == "input" else []
    last = (-1, -1)
    for rec in _records(store, plan.unit(index), ordered):
        if ordered:
            at = (rec["at"][0], rec["at"][1])
            if at <= last:
                raise _OutOfOrder
            last = at
        while partitions and rec["at"][0] >= partitions[0]:  # this record's object, and any without rows before it
            unit.next_object(partitions.pop(0))
        unit.add(rec)
    if plan.partition_by == "input":
        while partitions:
            unit.next_object(partitions.pop(0))
        unit.next_object(-1)
    else:
        unit.close()
    store.write_bytes(layout.publish_summary_uri(plan.prefix, index), json.dumps(unit.summary()).encode())


class _UnitWriter:
    """Pass 3's output for one unit: its results, errors and capped rows (with output.partitionBy input,
    each input object's own files, one object at a time), the files written, and what they count."""

    def __init__(self, plan: PublishPlan, store: Storage, index: int, losers: set[tuple[int, int]]):
        self.plan, self.store, self.index, self.losers = plan, store, index, losers
        self.round_no, self.shard, _ = plan.unit(index)
        self.names = plan.object_names[self.round_no]
        name = f"r{self.round_no}-{self.shard:05d}"
        self.writer = writer_for(plan.format)
        self.error_writer = writer_for(self.writer.error_format)
        self.results: _FileParts | _PartitionFile = _FileParts(plan, store, "results", name, self.writer)
        self.errors: _FileParts | _PartitionFile = _FileParts(plan, store, "errors", name, self.error_writer)
        self.capped: _FileParts | _PartitionFile = _FileParts(plan, store, "capped", name, self.error_writer)
        self.files: dict[str, list[dict[str, Any]]] = {"files": [], "errorFiles": [], "cappedFiles": []}
        self.current = -1  # the input object whose files are open (partitioned); -1: none
        self.counts = {"rows": 0, "errors": 0, "capped": 0, "duplicates": 0, "truncated": 0, "tokensIn": 0,
                       "tokensOut": 0, "reasoningTokens": 0}
        self.codes: dict[str, int] = {}  # error rows by code
        self.own_fields = result_fields(plan.task)  # a duplicate's error row carries its input columns, not its answer
        self.not_run: list[dict[str, Any]] = []
        self.not_run_of: dict[int, list[dict[str, Any]]] = {}  # by input object, for partitioned files

    def add_not_run(self, index: int) -> None:
        """A partial publish: count the rows no worker finished. OpenAI batch lines a stopped batch never ran
        each get their batch_expired / batch_cancelled line in the error files (their object's, when
        partitioned), as OpenAI writes them; they stay counted as notRun, not as errors."""
        self.counts["notRun"] = count_not_run(self.plan, index, self.store, emit=self.not_run.append)
        index_of = {n: k for k, n in enumerate(self.names)}
        for line in self.not_run:
            self.not_run_of.setdefault(index_of[line["object"]], []).append(line)

    def next_object(self, obj: int) -> None:
        """Close the current object's files and open the next object's (`obj`; -1: none)."""
        plan, store = self.plan, self.store
        if self.current >= 0:
            for line in self.not_run_of.pop(self.current, []):
                self.errors.add(line)
            for key, part in (("files", self.results), ("errorFiles", self.errors), ("cappedFiles", self.capped)):
                part.close(always=key == "files")
                self.files[key] += [{**f, "input": self.names[self.current]} for f in part.files]
        self.current = obj
        if obj >= 0:
            stem = plan.partitions[obj]
            self.results = _PartitionFile(plan, store, "results", stem, self.writer)
            self.errors = _PartitionFile(plan, store, "errors", stem, self.error_writer)
            self.capped = _PartitionFile(plan, store, "capped", stem, self.error_writer)

    def close(self) -> None:
        """Not partitioned: add the not-run lines to the errors and write the last part of each kind."""
        for line in self.not_run:
            self.errors.add(line)
        for key, parts in (("files", self.results), ("errorFiles", self.errors), ("cappedFiles", self.capped)):
            parts.close()
            self.files[key] = parts.files

    def add(self, rec: dict[str, Any]) -> None:
        """One durable record: a result (a duplicate_id error row for an id seen before), a capped or an error row."""
        row = rec["row"]
        if rec["kind"] == "result":
            if (rec["at"][0], rec["at"][1]) in self.losers:
                self.counts["duplicates"] += 1
                self._error(self._duplicate(rec), "duplicate_id")
                return
            self.results.add(row)
            self._count_result(row)
        elif rec["kind"] == "capped":
            self.capped.add(row)
            self.counts["capped"] += 1
        else:
            self._error(row, str((row.get("error") or {}).get("code") or "unknown"))

    def _error(self, row: dict[str, Any], code: str) -> None:
        self.errors.add(row)
        self.counts["errors"] += 1
        self.codes[code] = self.codes.get(code, 0) + 1

    def _duplicate(self, rec: dict[str, Any]) -> dict[str, Any]:
        """The error row of a result whose id was seen before (the first occurrence wins)."""
        row = rec["row"]
        rid = row_id(row)
        lost: dict[str, Any] = {"id": rid, "error": {
            "code": "duplicate_id",
            "message": f"id {json.dumps(rid)} was seen before; the first occurrence wins"},
            "object": self.names[rec["at"][0]], "offset": rec["at"][1]}
        if "custom_id" in row:  # an OpenAI batch line's error, in that shape like every other error row
            lost["custom_id"], lost["response"] = rid, None
        else:  # its pass-through columns, as every error row of a plain input
            lost.update((k, v) for k, v in row.items() if k not in self.own_fields)
        return lost

    def _count_result(self, row: dict[str, Any]) -> None:
        counts = self.counts
        counts["rows"] += 1
        counts["truncated"] += bool(row.get("truncated"))
        u = row_usage(row)
        counts["tokensIn"] += u.get("prompt_tokens", 0)
        counts["tokensOut"] += u.get("completion_tokens", 0)
        details: Any = u.get("completion_tokens_details") or {}  # OpenAI's usage breakdown, when there is one
        counts["reasoningTokens"] += int(details.get("reasoning_tokens") or 0)

    def summary(self) -> dict[str, Any]:
        """The unit's publish summary: its counts, error codes and files, each saying its round and shard."""
        where = {"round": self.round_no, "shard": self.shard}
        return {**where, "counts": {**self.counts, "errorCodes": self.codes},
                "files": [{**f, **where} for f in self.files["files"]],
                "errorFiles": [{**f, **where} for f in self.files["errorFiles"]],
                "cappedFiles": [{**f, **where} for f in self.files["cappedFiles"]]}


def run_pass(plan: PublishPlan, pass_name: str, index: int) -> None:
    """Run one index of one pass, with the storage settings the plan carries."""
    if pass_name not in PASSES:
        raise PublishPlanError(f"unknown publish pass {pass_name!r}; one of {', '.join(PASSES)}")
    if not 0 <= index < count(plan, pass_name):
        raise PublishPlanError(f"publish pass {pass_name} has {count(plan, pass_name)} indexes, not {index}")
    store = open_storage(plan.output_uri, plan.s3)
    {"ids": run_ids, "dedupe": run_dedupe, "write": run_write}[pass_name](plan, index, store)


def main(argv: list[str], env: Mapping[str, str] | None = None) -> int:
    """`bij-worker publish --plan URI --pass ids|dedupe|write [--index I] [--stride S]`: one index of a
    publish pass, or with --stride every S-th index from I. Loads no engine and no spec model."""
    p = argparse.ArgumentParser(prog="bij-worker publish", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", required=True, help="URI of the publish plan (plan.json)")
    p.add_argument("--pass", dest="pass_name", required=True, choices=PASSES)
    p.add_argument("--index", type=int, default=None,
                   help="shard or bucket index (default: env JOB_COMPLETION_INDEX, as set by an Indexed Job)")
    p.add_argument("--stride", type=int, default=0,
                   help="also work indexes index + stride, index + 2 x stride, ... of the pass, one after the other")
    args = p.parse_args(argv)
    index = args.index
    if index is None:
        raw = (os.environ if env is None else env).get("JOB_COMPLETION_INDEX", "")
        if not raw.isdigit():
            log.error("no index: pass --index or set JOB_COMPLETION_INDEX (got %r)", raw)
            return EXIT_BAD_CONFIG
        index = int(raw)
    if args.stride < 0:
        log.error("--stride must be >= 0, got %d", args.stride)
        return EXIT_BAD_CONFIG
    try:
        # The pass's Job sets AWS_ENDPOINT_URL and AWS_REGION from the spec; the plan carries the
        # same settings for everything after it.
        plan = load(args.plan, None)
        indexes = range(index, count(plan, args.pass_name), args.stride) if args.stride else [index]
        for i in indexes:
            run_pass(plan, args.pass_name, i)
    except PublishPlanError as e:
        log.error("bad configuration: %s", e)
        return EXIT_BAD_CONFIG
    except StorageError as e:
        if e.permanent:  # a missing bucket, denied access: the same on every retry
            log.error("bad configuration: storage: %s", e)
            return EXIT_BAD_CONFIG
        log.error("storage: %s", e)
        return EXIT_FAILED
    return EXIT_OK
