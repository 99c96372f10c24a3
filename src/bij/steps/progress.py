"""What the workers have finished: their per-shard completion records.

A step reads a round's records as a stream (`stream_records`): the listing goes by pages, the next page
asked for while the records of this one are read, a bounded pool of threads reads `READS_IN_FLIGHT`
records at a time, and each record is added to running sums (`Tally`) and dropped. Memory holds two
pages and the records in flight whatever the shard count, and the reads take (records /
READS_IN_FLIGHT) round trips, the listing's hidden behind them. What a caller needs per shard (which are done)
is a bitmap (`DoneIndexes`), an eighth of a byte a shard.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from bij.contract import layout
from bij.contract.efficiency import EfficiencySums
from bij.contract.plan import Plan
from bij.contract.records import DamageRecord, ShardRecord, decode_shard_record
from bij.contract.rounds import RoundStats, RoundSums
from bij.contract.spec import BatchInferenceJob
from bij.storage import NotFound, Storage, open_storage

# Record reads in flight at once: enough to hide an object store's latency, few enough that memory
# stays a handful of records (a record is a few KB).
READS_IN_FLIGHT = 16
T = TypeVar("T")


def listed_ahead(pages: Iterator[T]) -> Iterator[T]:
    """`pages` as they come, the next one asked for (in a thread of its own) while the caller works on this
    one: a listing's round trip per page overlaps the reads of the page before instead of stalling them."""
    with ThreadPoolExecutor(1, thread_name_prefix="bij-list") as lister:
        coming = lister.submit(next, pages, None)
        while (page := coming.result()) is not None:
            coming = lister.submit(next, pages, None)
            yield page


class DoneIndexes:
    """A set of shard indexes as a bitmap: 125 KB for a million shards, where a set of ints is ~60 MB."""

    def __init__(self) -> None:
        self._bits = bytearray()
        self._count = 0

    def add(self, index: int) -> None:
        byte, bit = divmod(index, 8)
        if byte >= len(self._bits):
            self._bits.extend(bytes(max(byte + 1 - len(self._bits), len(self._bits))))
        if not self._bits[byte] >> bit & 1:
            self._bits[byte] |= 1 << bit
            self._count += 1

    def __contains__(self, index: object) -> bool:
        if not isinstance(index, int) or index < 0:
            return False
        byte, bit = divmod(index, 8)
        return byte < len(self._bits) and bool(self._bits[byte] >> bit & 1)

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[int]:
        for byte, value in enumerate(self._bits):
            if value:
                yield from (byte * 8 + bit for bit in range(8) if value >> bit & 1)

    def first_missing(self, count: int) -> int | None:
        """The lowest index below `count` not in the set, or None when all of 0..count-1 are."""
        return next((i for i in range(count) if i not in self), None)


class Tally:
    """Running sums over a stream of shard records: which shards are done (a bitmap), the round's
    judge statistics, efficiency, rows and tokens. Holds no record."""

    def __init__(self) -> None:
        self.done = DoneIndexes()
        self.round = RoundSums()
        self.efficiency = EfficiencySums()
        self.rows = 0
        self.tokens = 0

    def add(self, index: int, rec: ShardRecord) -> None:
        self.done.add(index)
        self.round.add(rec)
        self.efficiency.add(rec)
        self.rows += int(rec.get("rows") or 0)
        self.tokens += int(rec.get("tokensIn") or 0) + int(rec.get("tokensOut") or 0)

    def add_all(self, records: Iterable[tuple[int, ShardRecord]]) -> Tally:
        for index, rec in records:
            self.add(index, rec)
        return self


def stream_records(job: BatchInferenceJob, round_no: int, kind: str = "done",
                   in_flight: int = READS_IN_FLIGHT) -> Iterator[tuple[int, ShardRecord]]:
    """(index, record) of every completion record (`kind` "done") or progress record ("progress") of a
    round, in no set order, read `in_flight` at a time. BadRecord when one is not a shard record."""
    prefix = layout.round_prefix(job, round_no)
    folder = layout.done_folder(prefix) if kind == "done" else layout.progress_folder(prefix)
    store = open_storage(folder, job.spec.storage.s3)
    yield from read_records(store, folder, "completion" if kind == "done" else "progress", in_flight)


def read_records(store: Storage, folder: str, what: str = "completion",
                 in_flight: int = READS_IN_FLIGHT) -> Iterator[tuple[int, ShardRecord]]:
    """(index, record) of each `<index>.json` record under `folder`, as `stream_records`. A record
    listed and gone before it is read (superseded) is skipped."""
    def read(uri: str) -> bytes | None:
        try:
            return store.read_bytes(uri)
        except NotFound:
            return None

    def landed(item: tuple[int, str, Future[bytes | None]]) -> Iterator[tuple[int, ShardRecord]]:
        index, uri, future = item
        data = future.result()
        if data is not None:
            yield index, decode_shard_record(data, f"{what} record {uri}")

    pending: deque[tuple[int, str, Future[bytes | None]]] = deque()
    with ThreadPoolExecutor(max(1, in_flight), thread_name_prefix="bij-records") as pool:
        try:
            for page in listed_ahead(store.list_pages(folder)):
                for obj in page:
                    name = obj.uri.rsplit("/", 1)[-1]
                    if not name.endswith(".json") or not name[:-5].isdigit():
                        continue
                    pending.append((int(name[:-5]), obj.uri, pool.submit(read, obj.uri)))
                    if len(pending) >= in_flight:
                        yield from landed(pending.popleft())
            while pending:
                yield from landed(pending.popleft())
        finally:
            for _, _, future in pending:  # a consumer that stopped early: do not wait for reads nobody wants
                future.cancel()


def read_in_order(store: Storage, uris: Iterable[str], in_flight: int = READS_IN_FLIGHT) -> Iterator[bytes]:
    """Each object's bytes, in the order of `uris`, with up to `in_flight` reads at a time (as
    `read_records`, for objects whose names are known and whose order counts)."""
    pending: deque[Future[bytes]] = deque()
    with ThreadPoolExecutor(max(1, in_flight), thread_name_prefix="bij-reads") as pool:
        try:
            for uri in uris:
                pending.append(pool.submit(store.read_bytes, uri))
                if len(pending) >= in_flight:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:  # a consumer that stopped early (or a read that failed)
                future.cancel()


def round_tally(job: BatchInferenceJob, round_no: int, in_flight: int = READS_IN_FLIGHT) -> Tally:
    """The running sums of a round's completion records, read as a stream."""
    return Tally().add_all(stream_records(job, round_no, "done", in_flight))


def shard_records(job: BatchInferenceJob, round_no: int) -> dict[int, ShardRecord]:
    """Completion records of a round's finished shards, by index (rows, errors, tokensIn, tokensOut, seconds).
    BadRecord (a permanent StorageError naming the object) when one is not a shard record."""
    return _records(job, round_no, "done")


def count_done(job: BatchInferenceJob, round_no: int) -> int:
    """How many of a round's shards have a completion record: one listing, no object read."""
    folder = layout.done_folder(layout.round_prefix(job, round_no))
    names = (o.uri.rsplit("/", 1)[-1] for o in open_storage(folder, job.spec.storage.s3).list(folder))
    return sum(1 for n in names if n.endswith(".json") and n[:-5].isdigit())


def live_records(job: BatchInferenceJob, round_no: int) -> dict[int, ShardRecord]:
    """Counts of every shard that has any: finished shards' completion records, and the
    progress records running shards rewrite every BIJ_PROGRESS_SECONDS (30 s by default).
    BadRecord when one is not a shard record."""
    return {**_records(job, round_no, "progress"), **_records(job, round_no, "done")}


def round_history(job: BatchInferenceJob, rounds: int) -> list[RoundStats]:
    """Statistics of rounds 0..rounds-1 from storage (every shard of them must be done)."""
    out = []
    for r in range(rounds):
        uri = layout.round_manifest_uri(job, r)
        plan = Plan.from_json(open_storage(uri, job.spec.storage.s3).read_bytes(uri), f"round plan {uri}")
        out.append(round_tally(job, r).round.stats(r, plan.shard_total))
    return out


def damage_records(job: BatchInferenceJob, round_no: int) -> list[DamageRecord]:
    """The input objects a round's workers found damaged, by shard: one listing of a folder that is
    empty but for them. BadRecord when one is not a damage record."""
    folder = layout.damaged_folder(layout.round_prefix(job, round_no))
    store = open_storage(folder, job.spec.storage.s3)
    out = []
    for obj in sorted(store.list(folder), key=lambda o: o.uri):
        try:
            out.append(DamageRecord.from_json(store.read_bytes(obj.uri), f"damage record {obj.uri}"))
        except NotFound:  # listed, then gone (the shard finished after its object was replaced)
            continue
    return out


def _records(job: BatchInferenceJob, round_no: int, kind: str) -> dict[int, ShardRecord]:
    return dict(sorted(stream_records(job, round_no, kind), key=lambda item: item[0]))
