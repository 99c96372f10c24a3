"""The steps read a round's completion records as a stream: a bounded pool of reads over the listing,
running sums, a bitmap of which shards are done; memory flat in shards, time records / reads in flight."""

from __future__ import annotations

import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

from bij.contract import layout
from bij.contract.records import ShardRecord, encode, shard_record
from bij.steps.main import round_figures
from bij.steps.progress import READS_IN_FLIGHT, DoneIndexes, read_records
from bij.steps.publish import prepare_publish
from bij.storage import FileStorage, open_storage


def a_record(index: int, round_no: int = 0) -> ShardRecord:
    """A completion record as a worker writes one, every count filled in (a few hundred bytes of JSON)."""
    counts: Any = {"rows": 10, "errors": 1, "truncated": 0, "tokensIn": 100, "tokensOut": 50, "rejected": 2,
                   "capped": 0, "engineCalls": 3, "judgeCalls": 0, "batches": 1, "chunks": 1,
                   "engineBusySeconds": 0.5, "modelLoadSeconds": 0.0, "modelLoads": 0, "engineSteps": 4,
                   "meanOccupancy": 0.5, "prefixShare": 0.1, "promptChars": 1000, "cachedTokens": 0, "bytes": 999,
                   "intIds": 11, "strIds": 0, "structuredValidated": 0, "structuredRepaired": 0,
                   "structuredViolations": 0, "notes": []}
    return shard_record(index, round_no, index % 7, counts, 1.0, finished=True)


def write_done(round_prefix: str, shards: int) -> None:
    """Completion records of shards 0..shards-1 under a file:// round prefix (plain writes: no fsync)."""
    folder = Path(layout.done_folder(round_prefix).removeprefix("file://"))
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(shards):
        (folder / f"{i:05d}.json").write_bytes(encode(a_record(i)))


class SlowReads(FileStorage):
    """Local files whose reads take `delay` seconds, counting the reads in flight and started."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.lock = threading.Lock()
        self.in_flight = self.most_in_flight = self.started = 0

    def read_bytes(self, uri: str) -> bytes:
        with self.lock:
            self.started += 1
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            time.sleep(self.delay)
            return super().read_bytes(uri)
        finally:
            with self.lock:
                self.in_flight -= 1


def test_records_are_read_in_parallel_a_bounded_number_at_a_time(tmp_path) -> None:
    prefix = f"file://{tmp_path}/round-0"
    write_done(prefix, 160)
    store = SlowReads(delay=0.01)
    stream = read_records(store, layout.done_folder(prefix))
    next(stream)
    # Taking one record started at most the pool's worth of reads: the rest wait for the consumer.
    assert store.started <= READS_IN_FLIGHT + 1
    t0 = time.monotonic()
    seen = [1 + sum(1 for _ in stream)]
    elapsed = time.monotonic() - t0
    assert seen == [160]
    assert store.most_in_flight <= READS_IN_FLIGHT
    assert store.most_in_flight >= READS_IN_FLIGHT // 2  # in parallel, not one after another
    assert elapsed < 160 * 0.01 / 3  # serial reads would take 1.6 s


class PagedListing(FileStorage):
    """Local files listed 20 a page; a read of the first page's records waits (up to 10 s) for the second
    page to be asked for, and says whether it was."""

    def __init__(self) -> None:
        self.second_page_asked = threading.Event()
        self.waited_in_vain = 0

    def list_pages(self, uri: str) -> Any:
        objects = self.list(uri)
        for n, start in enumerate(range(0, len(objects), 20)):
            if n == 1:
                self.second_page_asked.set()
            yield objects[start:start + 20]

    def read_bytes(self, uri: str) -> bytes:
        if int(uri.rsplit("/", 1)[-1][:-5]) < 20 and not self.second_page_asked.wait(10):
            self.waited_in_vain += 1
        return super().read_bytes(uri)


def test_the_next_page_is_listed_while_this_pages_records_are_read(tmp_path) -> None:
    """A listing's round trip per page overlaps the reads of the page before (on an object store a LIST of
    1,000 keys is a round trip the 16 reads in flight would otherwise wait for)."""
    prefix = f"file://{tmp_path}/round-0"
    write_done(prefix, 50)
    store = PagedListing()
    assert sorted(i for i, _ in read_records(store, layout.done_folder(prefix))) == list(range(50))
    assert store.waited_in_vain == 0


def test_finish_holds_running_sums_not_the_rounds_records(file_place, make_job) -> None:
    _, job = make_job(file_place, file_place.uri("in.jsonl"))
    shards = 3000
    write_done(layout.round_prefix(job, 0), shards)
    tracemalloc.start()
    try:
        out = round_figures(job, 0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert out.done == shards
    assert out.stats.approved == 10 * shards and out.stats.rejected == 2 * shards
    assert out.stats.engine_calls == 3 * shards
    assert out.efficiency is not None and out.efficiency.worker_seconds == shards * 1.0
    # The records decoded whole take ~3 KB each (9 MB here); a page of the listing and the reads in
    # flight take well under 2 MB.
    assert peak < 2 << 20, f"finish peaked at {peak / 2**20:.1f} MiB for {shards} records"


def test_publish_finds_the_missing_shard_from_a_bitmap_of_done_ones(file_place, make_job) -> None:
    from bij.steps.publish import PublishError

    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", [{"id": i, "text": "x" * 50}
                                                                     for i in range(400)]))
    from bij.steps.planner import plan_round

    plan = plan_round(job, 0)
    assert plan.shard_count > 3
    store = open_storage(job.spec.output.uri, None)
    prefix = layout.round_prefix(job, 0)
    write_done(prefix, plan.shard_count)
    store.delete(layout.done_uri(prefix, 2))
    try:
        prepare_publish(job, 1)
    except PublishError as e:
        assert "round 0 shard 2 has not finished" in str(e)
    else:
        raise AssertionError("published a round with a shard not done")


def test_done_indexes_are_a_bitmap() -> None:
    done = DoneIndexes()
    for i in (0, 3, 9, 1_000_000, 3):
        done.add(i)
    assert len(done) == 4 and 9 in done and 8 not in done and -1 not in done
    assert list(done) == [0, 3, 9, 1_000_000]
    assert done.first_missing(4) == 1 and DoneIndexes().first_missing(0) is None
    assert len(done._bits) <= 2 * (1_000_000 // 8 + 1)  # bits, not a set of ints


def test_objects_read_in_order_keep_their_order_with_reads_in_flight(tmp_path):
    import threading
    import time as _time

    from bij.steps.progress import read_in_order
    from bij.storage import FileStorage

    store = FileStorage()
    uris = []
    for i in range(40):
        path = tmp_path / f"{i:03d}.json"
        path.write_bytes(str(i).encode())
        uris.append(path.as_uri())
    busy, most = [0], [0]
    lock = threading.Lock()

    class Slow:
        def read_bytes(self, uri: str) -> bytes:
            with lock:
                busy[0] += 1
                most[0] = max(most[0], busy[0])
            _time.sleep(0.01 if uri.endswith("0.json") else 0.001)  # later reads land first
            with lock:
                busy[0] -= 1
            return store.read_bytes(uri)

    got = [int(b) for b in read_in_order(Slow(), uris, in_flight=8)]  # type: ignore[arg-type]
    assert got == list(range(40)) and 1 < most[0] <= 8
