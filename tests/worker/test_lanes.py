"""Lanes: claims with leases in the output store, taking over, one model load per lane process."""

from __future__ import annotations

import json
import math
import random
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from input_rows import numbered

from bij.contract import layout
from bij.contract.canary import canary_shards
from bij.local.publish import publish_manifest
from bij.steps.planner import plan_round
from bij.storage import FileStorage, NotFound, ObjectInfo
from bij.worker import claim as claim_module
from bij.worker.claim import Claim
from bij.worker.lanes import STEAL_PROBES, Claims, LeaseKeeper, open_claims
from bij.worker.round_claims import RoundClaims


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def claims(tmp_path: Path, lane: int, *, lanes: int = 2, shards: int = 6, writer: str | None = None,
           clock: Clock | None = None, share: bool = True) -> Claims:
    return Claims(FileStorage(), f"file://{tmp_path}/round-0", lane=lane, lanes=lanes, shards=shards,
                  writer=writer or f"w{lane}", lease_seconds=30, share=share, clock=clock or Clock())


def finish(tmp_path: Path, shard: int) -> None:
    FileStorage().write_bytes(f"file://{tmp_path}/round-0/done/{shard:05d}.json", b"{}")


def test_a_lane_claims_its_own_shards_in_order_then_the_end_of_the_busiest_lane(tmp_path: Path) -> None:
    a = claims(tmp_path, 0, lanes=3, shards=8)
    got = []
    while True:
        c = a.next()
        if c is None:
            break
        assert not isinstance(c, bool)
        got.append(c.shard)
        finish(tmp_path, c.shard)
    # Own shards 0, 3, 6; then lane 1 (1, 4, 7) and lane 2 (2, 5) from their ends, busiest first.
    assert got[:3] == [0, 3, 6]
    assert got[3] == 7 and sorted(got) == list(range(8))
    assert a.next() is None  # every shard done


def test_a_shard_claimed_by_a_live_lane_is_left_to_it_and_an_expired_one_is_taken_over(tmp_path: Path) -> None:
    clock = Clock()
    b = claims(tmp_path, 1, shards=2, clock=clock)
    assert b.next().shard == 1  # type: ignore[union-attr]
    a = claims(tmp_path, 0, shards=2, clock=clock)
    assert a.next().shard == 0  # type: ignore[union-attr]
    finish(tmp_path, 0)
    assert a.next() is True  # shard 1 is held by lane 1 and its lease is live: wait
    clock.now += 31  # lane 1 stopped renewing
    taken = a.next()
    assert not isinstance(taken, bool) and taken is not None
    assert (taken.shard, taken.generation, taken.lane) == (1, 1, 0)
    # The old holder sees the newer claim at its next renewal and gives the shard up.
    old = b.read(1, 0)
    assert old is not None and not b.renew(old)
    assert a.renew(taken)


def test_two_lanes_racing_for_one_claim_get_it_once(tmp_path: Path) -> None:
    lanes = [claims(tmp_path, i, lanes=8, shards=1) for i in range(8)]
    won: list[Any] = []
    barrier = threading.Barrier(8)

    def race(c: Claims) -> None:
        barrier.wait()
        won.append(c.take(0, 0))

    threads = [threading.Thread(target=race, args=(c,)) for c in lanes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len([w for w in won if w is not None]) == 1


def test_a_new_process_of_a_lane_takes_its_lanes_claims_at_once(tmp_path: Path) -> None:
    # The replacement pod of a preempted lane starts only once the old pod is gone: no lease to wait out.
    old = claims(tmp_path, 1, writer="old")
    first = old.next()
    assert first is not None and not isinstance(first, bool) and first.shard == 1
    new = claims(tmp_path, 1, writer="new")
    again = new.next()
    assert again is not None and not isinstance(again, bool)
    assert (again.shard, again.generation, again.writer) == (1, 1, "new")


def test_without_sharing_a_lane_works_only_its_own_shards(tmp_path: Path) -> None:
    # Plans written before lanes existed: one shard per index, nothing else.
    a = claims(tmp_path, 1, lanes=3, shards=3, share=False)
    c = a.next()
    assert c is not None and not isinstance(c, bool) and c.shard == 1
    finish(tmp_path, 1)
    assert a.next() is None


def work_in_turn(tmp_path: Path, lanes: list[Claims]) -> dict[int, list[int]]:
    """Each lane claims and finishes a shard in turn until every one has none left; the shards each worked."""
    worked: dict[int, list[int]] = {c.lane: [] for c in lanes}
    while lanes:
        for c in list(lanes):
            got = c.next()
            if got is None:
                lanes.remove(c)
            elif isinstance(got, Claim):
                finish(tmp_path, got.shard)
                c.finished(got.shard)
                worked[c.lane].append(got.shard)
    return worked


def test_a_canarys_lanes_work_only_its_spread_shards_then_the_rounds_lanes_work_their_own_in_order(
        tmp_path: Path) -> None:
    # Round 0 of 12 shards in 3 lanes; its canary Job runs 2 lanes on the canary's shards, 2, 6 and 10 (lanes 2,
    # 0 and 1 own them): lane 2 does not run, so its canary shard is taken by one that does.
    only = canary_shards(12, 3)
    assert only == [2, 6, 10]
    store = FileStorage()
    canary = [Claims(store, f"file://{tmp_path}/round-0", lane=i, lanes=3, shards=12, writer=f"c{i}",
                     lease_seconds=30, only=only) for i in range(2)]
    worked = work_in_turn(tmp_path, canary)
    assert sorted(s for shards in worked.values() for s in shards) == only
    # No completion marker: the round's lanes take one to say every shard of the lane is done.
    assert not [o.uri for o in store.list(f"file://{tmp_path}/round-0/lanes/") if o.uri.endswith("complete.json")]
    got_by_lane = work_in_turn(tmp_path, [claims(tmp_path, i, lanes=3, shards=12) for i in range(3)])
    # Each its own shards in order, none of the canary's again.
    assert got_by_lane == {0: [0, 3, 9], 1: [1, 4, 7], 2: [5, 8, 11]}


def test_a_waiting_lane_exits_as_soon_as_the_last_shard_is_done_not_a_poll_later(tmp_path: Path) -> None:
    # With the default lease (60 s) a waiting lane once looked every 5 s (lease / 4, at most 5 s), and
    # every lane idled up to that long after the round's last shard (bench/lanes.py: 1.40x the ideal).
    b, a = (Claims(FileStorage(), f"file://{tmp_path}/round-0", lane=i, lanes=2, shards=2, writer=f"w{i}",
                   lease_seconds=60) for i in (1, 0))
    assert b.next().shard == 1  # type: ignore[union-attr]
    assert a.next().shard == 0  # type: ignore[union-attr]
    finish(tmp_path, 0)
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(a.next_or_wait(threading.Event())))
    waiter.start()
    time.sleep(0.3)
    assert got == []  # shard 1 is held by a live lease: lane 0 waits
    t0 = time.monotonic()
    finish(tmp_path, 1)
    waiter.join(timeout=10)
    assert got == [None] and time.monotonic() - t0 < 3


def test_a_lease_keeper_renews_and_reports_a_lost_claim(tmp_path: Path) -> None:
    a = Claims(FileStorage(), f"file://{tmp_path}/round-0", lane=0, lanes=1, shards=1, writer="a", lease_seconds=0.3)
    c = a.take(0, 0)
    assert c is not None
    before = json.loads(FileStorage().read_bytes(a.uri(0, 0)))["expiresAt"]
    lost = threading.Event()
    keeper = LeaseKeeper(a, c, lost.set)
    time.sleep(0.35)
    assert json.loads(FileStorage().read_bytes(a.uri(0, 0)))["expiresAt"] > before  # renewed
    assert not lost.is_set()
    b = Claims(FileStorage(), f"file://{tmp_path}/round-0", lane=0, lanes=1, shards=1, writer="b", lease_seconds=0.3)
    assert b.take(0, 1) is not None
    assert lost.wait(2)
    keeper.close()


class CountingStore:
    """An object store in memory that counts the requests S3 would take: one per GET, HEAD and PUT,
    and one per `page` keys a LIST returns (S3 returns 1,000 a page; a smaller page shows the same
    growth at a tenth of the size)."""

    def __init__(self, page: int):
        self.objects: dict[str, bytes] = {}
        self.page = page
        self.requests = 0
        self.creates: list[str] = []  # every conditional create tried, won or lost
        self.listed: list[str] = []  # every folder listed

    def list(self, uri: str) -> list[ObjectInfo]:
        self.listed.append(uri)
        keys = sorted(k for k in self.objects if k.startswith(uri))
        self.requests += max(1, math.ceil(len(keys) / self.page))
        return [ObjectInfo(k, len(self.objects[k])) for k in keys]

    def read_bytes(self, uri: str) -> bytes:
        self.requests += 1
        if uri not in self.objects:
            raise NotFound(uri)
        return self.objects[uri]

    def write_bytes(self, uri: str, data: bytes) -> None:
        self.requests += 1
        self.objects[uri] = data

    def create(self, uri: str, data: bytes) -> bool:
        self.requests += 1
        self.creates.append(uri)
        if uri in self.objects:
            return False
        self.objects[uri] = data
        return True

    def exists(self, uri: str) -> bool:
        self.requests += 1
        return uri in self.objects


def work_round(store: CountingStore, shards: int, ticks_per_shard: list[int]) -> tuple[int, list[list[int]]]:
    """Lanes of the given speeds claim and finish every shard of a round, taking turns, one tick of a
    shared clock a turn; a shard is done `ticks` turns after its lane claimed it. Returns the claim
    decisions made (claims won) and the shards each lane worked, in order."""
    prefix = "s3://bucket/job/round-0"
    clock = Clock()
    n = len(ticks_per_shard)
    lanes = [Claims(store, prefix, lane=i, lanes=n, shards=shards, writer=f"w{i}", lease_seconds=60, clock=clock)
             for i in range(n)]
    busy: dict[int, tuple[Claim, int]] = {}
    worked: list[list[int]] = [[] for _ in range(n)]
    running = set(range(n))
    won = 0
    while running:
        for i in sorted(running):
            if i in busy:
                claim, left = busy.pop(i)
                if left > 1:
                    busy[i] = (claim, left - 1)
                else:  # the worker's completion record: not a claim decision, so not counted
                    store.objects[layout.done_uri(prefix, claim.shard)] = b"{}"
                    lanes[i].finished(claim.shard)  # its marker in the lane's folder: a claims request
                continue
            got = lanes[i].next()
            if got is None:
                running.discard(i)
            elif isinstance(got, Claim):
                won += 1
                worked[i].append(got.shard)
                busy[i] = (got, ticks_per_shard[i])
        clock.now += 1
    return won, worked


def test_claim_decisions_cost_the_same_few_requests_per_shard_at_any_shard_count(monkeypatch) -> None:
    # Each decision once listed every claim and completion record of the round, so a round cost
    # O(shards^2) requests: at 10,000 shards on S3, hundreds of thousands of LISTs.
    monkeypatch.setattr(claim_module, "LIST_PAGE", 10, raising=False)
    per_shard, renewal = {}, {}
    for shards in (40, 400):
        store = CountingStore(page=10)
        # One lane at a third of the others' speed: the others take its unstarted shards.
        won, worked = work_round(store, shards, ticks_per_shard=[3, 1, 1, 1])
        assert won == shards and sorted(s for w in worked for s in w) == list(range(shards))  # each once
        assert worked[1][0] == 1 and worked[0][:3] == [0, 4, 8]  # own shards first, in order
        assert any(s % 4 == 0 for s in worked[1])  # ... then the slow lane's
        per_shard[shards] = store.requests / shards
        # A lease renewal (every third of the lease, per shard being worked) once listed the round too.
        holder = Claims(store, "s3://bucket/job/round-0", lane=0, lanes=4, shards=shards, writer="w0")
        before = store.requests
        assert holder.renew(Claim(worked[0][-1], 0, 0, "w0", 0.0))
        renewal[shards] = store.requests - before
    assert per_shard[400] <= 1.5 * per_shard[40], per_shard
    # At most 4, and a PUT per shard for its done marker (which spares every lane listing the round).
    assert per_shard[400] <= 5, per_shard
    assert renewal[40] == renewal[400] <= 2, renewal


def test_a_lane_that_loses_a_steal_to_the_shards_own_lane_leaves_that_lanes_earlier_shards(monkeypatch) -> None:
    # Listings priced high (a request per object listed), so a lost create is not followed by a listing.
    monkeypatch.setattr(claim_module, "LIST_PAGE", 1)
    store = CountingStore(page=1)
    prefix = "s3://bucket/job/round-0"
    a, b = (Claims(store, prefix, lane=i, lanes=2, shards=8, writer=f"w{i}", clock=Clock()) for i in (0, 1))
    assert a.next().shard == 0  # type: ignore[union-attr]
    for shard in (1, 3, 5, 7):
        assert b.next().shard == shard  # type: ignore[union-attr]
        store.objects[layout.done_uri(prefix, shard)] = b"{}"
    assert b.next().shard == 6  # type: ignore[union-attr]  # the end of lane 0, from a listing
    assert a.next().shard == 2 and a.next().shard == 4  # type: ignore[union-attr]  # since that listing
    del store.creates[:]
    # b loses 4 to lane 0 itself: lane 0 claims its own shards in order, so 2 is taken too.
    assert b.next() is True
    assert [u for u in store.creates if "/lanes/" in u and u.endswith("-00000.json")] == [b.uri(4, 0)]


def lane_of(store: CountingStore, lane: int, lanes: int, shards: int, writer: str | None = None,
            clock: Clock | None = None, **kw: Any) -> Claims:
    return Claims(store, "s3://bucket/job/round-0", lane=lane, lanes=lanes, shards=shards,
                  writer=writer or f"w{lane}", lease_seconds=30, clock=clock or Clock(), **kw)


def work_some(store: CountingStore, c: Claims, n: int) -> list[int]:
    """`c` claims and finishes `n` shards (as the worker does: the completion record, then its marker)."""
    out = []
    for _ in range(n):
        got = c.next()
        assert isinstance(got, Claim)
        store.objects[layout.done_uri("s3://bucket/job/round-0", got.shard)] = b"{}"
        c.finished(got.shard)
        out.append(got.shard)
    return out


def test_a_lane_starts_reading_its_own_share_however_large_the_round() -> None:
    # A lane once listed the round's claims and completion records and read the newest claim of every
    # claimed shard: at 10,000 lanes, 10,000 GETs and 1,000 LIST pages a lane at every round start.
    cost = {}
    for lanes in (10, 200):
        store = CountingStore(page=1000)
        for i in range(lanes):
            if i != 3:
                assert lane_of(store, i, lanes, lanes * 20).next().shard == i  # type: ignore[union-attr]
        store.requests, store.listed = 0, []
        assert lane_of(store, 3, lanes, lanes * 20).next().shard == 3  # type: ignore[union-attr]
        assert store.listed == [layout.lane_folder("s3://bucket/job/round-0", 3)]
        cost[lanes] = store.requests
    assert cost[10] == cost[200] <= 2, cost


def test_a_replacement_lane_continues_its_predecessors_shards_reading_only_its_share() -> None:
    cost = {}
    for lanes in (10, 200):
        shards = lanes * 20
        store = CountingStore(page=1000)
        for i in range(lanes):  # every lane half way through its share, holding its next shard
            c = lane_of(store, i, lanes, shards, writer="old" if i == 3 else None)
            work_some(store, c, 10)
            held = c.next()
            assert isinstance(held, Claim)
            if i == 3:  # ... and lane 3's lost process held a shard of lane 4 as well
                stolen = c.take(4 + lanes * 19, 0)
                assert stolen is not None
        store.requests, store.listed = 0, []
        new = lane_of(store, 3, lanes, shards, writer="new")
        first = new.next()
        assert isinstance(first, Claim) and (first.shard, first.generation) == (3 + lanes * 10, 1)
        assert store.listed == [layout.lane_folder("s3://bucket/job/round-0", 3)]
        cost[lanes] = store.requests
        second = new.next()  # the stolen one next, before the lane's unstarted shards
        assert isinstance(second, Claim) and (second.shard, second.generation) == (4 + lanes * 19, 1)
    assert cost[10] == cost[200] <= 4, cost


def test_a_lane_steals_the_end_of_the_busiest_of_a_few_lanes_it_lists() -> None:
    lanes, shards = 50, 1000
    store = CountingStore(page=1000)
    for i in range(lanes):  # lane i has done i of its 20 shards
        work_some(store, lane_of(store, i, lanes, shards), min(i, 20))
    store.requests, store.listed = 0, []
    thief = lane_of(store, 20, lanes, shards, rng=random.Random(7))
    got = thief.next()
    listed = [int(u.rstrip("/").rsplit("/", 1)[-1]) for u in store.listed]
    assert listed[0] == 20 and len(listed) == 1 + STEAL_PROBES  # its own folder, then the probed lanes'
    victim = min(listed[1:])  # the one with the most left
    assert isinstance(got, Claim) and got.shard == victim + lanes * 19  # from the end of its share
    assert store.requests <= 2 + STEAL_PROBES + 1


@pytest.mark.parametrize("dead", [{2, 3}, {0, 1, 2, 3, 4}])
def test_the_shards_of_lanes_dead_for_good_are_all_done_once_while_one_lane_lives(dead: set[int]) -> None:
    lanes, shards = 6, 30
    store, clock = CountingStore(page=1000), Clock()
    everyone = {i: lane_of(store, i, lanes, shards, clock=clock) for i in range(lanes)}
    for i in dead:  # each takes its first shard and is gone, never renewing, never replaced
        assert everyone[i].next().shard == i  # type: ignore[union-attr]
    alive = {i: c for i, c in everyone.items() if i not in dead}
    worked: list[int] = []
    while alive:
        for i, c in list(alive.items()):
            got = c.next()
            if got is None:
                del alive[i]
            elif isinstance(got, Claim):
                store.objects[layout.done_uri("s3://bucket/job/round-0", got.shard)] = b"{}"
                c.finished(got.shard)
                worked.append(got.shard)
        clock.now += 5  # the dead lanes' leases (30 s) run out after a while
    assert sorted(worked) == list(range(shards))  # every shard done, each once


def test_a_round_begun_with_the_claims_in_one_folder_goes_on_there(tmp_path: Path) -> None:
    # A Job recreated by a newer operator mid-round: claims in both layouts would let two lanes hold a shard.
    prefix = f"file://{tmp_path}/round-0"
    old = RoundClaims(FileStorage(), prefix, lane=0, lanes=2, shards=4, writer="w0")
    assert old.next().shard == 0  # type: ignore[union-attr]
    kw: dict[str, Any] = dict(lane=1, lanes=2, shards=4, writer="w1")
    resumed = open_claims(FileStorage(), prefix, **kw)
    assert isinstance(resumed, RoundClaims)
    assert resumed.next().shard == 1 and FileStorage().exists(layout.claim_uri(prefix, 1, 0))  # type: ignore[union-attr]
    assert isinstance(open_claims(FileStorage(), f"file://{tmp_path}/round-1", **kw), Claims)


rows = numbered


def test_a_lane_killed_mid_shard_and_never_restarted_is_taken_over_after_its_lease(
        file_place, make_job, worker_env, bij_bin, read_output, tmp_path):
    inputs = rows(1200)
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", inputs),
                      sharding={"targetShardBytes": 8000, "chunkRows": 16}, batching={"maxBatchSize": 8},
                      workers={"parallelism": 2, "leaseSeconds": 3})
    plan = plan_round(job, 0)
    assert plan.lanes == 2 and plan.shard_count >= 6
    manifest = layout.round_manifest_uri(job, 0)
    logs = [tmp_path / "computed-0.txt", tmp_path / "computed-1.txt"]

    def lane(i: int, delay: float) -> subprocess.Popen[str]:
        return subprocess.Popen([bij_bin("bij-worker"), "--manifest", manifest, "--progress"],
                                env={**worker_env(file_place, echo_log=logs[i], echo_delay=delay),
                                     "JOB_COMPLETION_INDEX": str(i)},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    # Lane 0 is slow: it commits a chunk or two of its first shard, then is killed and never comes back.
    a = lane(0, 0.05)
    assert a.stdout is not None
    seen = 0
    while seen < 2:
        event = json.loads(a.stdout.readline())
        seen += event["event"] == "chunk"
    a.send_signal(signal.SIGKILL)
    a.wait(timeout=10)
    b = lane(1, 0.0)
    out, err = b.communicate(timeout=120)
    assert b.returncode == 0, err
    assert "took over shard 0 from lane 0" in err
    done = [json.loads(line) for line in out.splitlines() if json.loads(line)["event"] == "done"]
    assert sorted(e["index"] for e in done) == list(range(plan.shard_count))
    publish_manifest(job)
    out_rows = read_output(job).results
    assert sorted(r["id"] for r in out_rows) == [r["id"] for r in inputs]  # every row exactly once
    # Lane 1 resumed shard 0 after what lane 0 made durable: at most lane 0's window was computed twice.
    computed = sum(len(p.read_text().splitlines()) for p in logs if p.exists())
    assert len(inputs) <= computed <= len(inputs) + 512 + 4 * 16


@pytest.mark.parametrize("parallelism", [1, 3])
def test_bij_run_loads_the_model_once_per_lane(parallelism, file_place, make_job, worker_env, bij_bin,
                                               read_output):
    inputs = rows(900)
    spec, job = make_job(file_place, file_place.write_jsonl("in.jsonl", inputs),
                         model={"engine": "simulated", "task": "generate", "maxTokens": 4,
                                "simulated": {"maxNumSeqs": 64, "stepSeconds": 0.0, "loadSeconds": 0.2}},
                         sharding={"targetShardBytes": 4000, "chunkRows": 32}, workers={"parallelism": parallelism})
    p = subprocess.run([bij_bin("bij"), "run", str(spec)], env=worker_env(file_place), capture_output=True,
                       text=True, timeout=180)
    assert p.returncode == 0, p.stderr
    plan = plan_round(job, 0)
    assert plan.shard_count >= 4 * parallelism and plan.lanes == parallelism
    manifest = read_output(job).manifest
    assert manifest["counts"]["rows"] == len(inputs)
    eff = manifest["efficiency"]
    # One load per lane that worked: a lane that starts after the others took every shard exits
    # without loading (on a loaded machine that happens), so count the lanes that did work.
    from bij.steps.progress import shard_records

    working = {int(r["lane"]) for r in shard_records(job, 0).values()}
    assert eff["modelLoads"] == len(working) and 1 <= len(working) <= parallelism
    assert 0.19 * len(working) <= eff["modelLoadSeconds"] < 0.2 * len(working) + 2
    assert f"{plan.shard_count} shards in {parallelism} lanes" in p.stderr


def test_an_engine_share_routes_each_shards_results_to_it_and_drops_a_closed_ones() -> None:
    from bij.engines import EngineConfig, create_engine
    from bij.engines.base import Request
    from bij.worker.engine_share import EngineShare

    engine: Any = create_engine("simulated", EngineConfig(task="generate", max_tokens=8,
                                                          simulated={"maxNumSeqs": 4, "stepSeconds": 0.0}))
    share = EngineShare(engine)
    a, b, c = share.view(), share.view(), share.view()
    for tag in range(3):
        a.submit(tag, Request(text=f"a{tag} " * (tag + 1), max_tokens=8))
        b.submit(tag, Request(text=f"b{tag} " * (3 - tag), max_tokens=8))
    c.submit(0, Request(text="c " * 8, max_tokens=8))
    c.close()  # its row still runs in the engine; its result goes nowhere
    got: dict[str, dict[int, str]] = {"a": {}, "b": {}}
    while a.unfinished() or b.unfinished():
        for name, view in (("a", a), ("b", b)):
            if view.unfinished():
                got[name].update((tag, res.output) for tag, res in view.step())
    assert got["a"] == {0: "a0", 1: "a1 a1", 2: "a2 a2 a2"}
    assert got["b"] == {0: "b0 b0 b0", 1: "b1 b1", 2: "b2"}
    while not share.idle():
        assert a.step() == []  # stepping on finishes the closed view's row and drops it
    assert a.concurrency() == 4  # the rest is the engine's


def test_a_lane_starts_its_next_shard_while_the_last_rows_of_the_current_one_run(
        file_place, make_job, worker_env, bij_bin):
    # 48 words a row, one per 30 ms step: a shard's last rows keep the engine busy for about a second
    # and a half, far longer than claiming the next shard takes even on a loaded machine (at 10 ms
    # steps the margin was half a second, which a full suite on two shared cores used up).
    long_rows = [{"id": f"doc-{i}", "text": " ".join(f"w{i}-{j}" for j in range(48))} for i in range(160)]
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", long_rows),
                      model={"engine": "simulated", "task": "generate", "maxTokens": 48,
                             "simulated": {"maxNumSeqs": 16, "stepSeconds": 0.03}},
                      sharding={"targetShardBytes": 10000, "chunkRows": 16}, workers={"parallelism": 1})
    plan = plan_round(job, 0)
    assert plan.lanes == 1 and plan.shard_count >= 4
    p = subprocess.run([bij_bin("bij-worker"), "--manifest", layout.round_manifest_uri(job, 0), "--progress"],
                       env={**worker_env(file_place), "JOB_COMPLETION_INDEX": "0"}, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    events = [json.loads(line) for line in p.stdout.splitlines()]
    order = [(e["event"], e["index"]) for e in events if e["event"] in ("resume", "done")]
    # Shard k + 1 starts (its resume event) before shard k is done: the engine never drains between them.
    for k in range(plan.shard_count - 1):
        assert order.index(("resume", k + 1)) < order.index(("done", k)), order


def test_claims_in_either_store_go_to_one_racer_and_an_expired_one_passes_on(place) -> None:
    # Claims rest on the store's conditional create (O_EXCL on file://, If-None-Match: * on S3): here the
    # real S3 server's, with eight lanes racing for one shard, then a takeover of its expired lease.
    clock = Clock()
    prefix = place.uri("round-0")
    lanes = [Claims(place.storage, prefix, lane=i, lanes=8, shards=1, writer=f"w{i}", lease_seconds=30,
                    clock=clock) for i in range(8)]
    barrier = threading.Barrier(8)

    def race(c: Claims) -> Any:
        barrier.wait()
        return c.take(0, 0)

    with ThreadPoolExecutor(8) as pool:
        won = [w for w in pool.map(race, lanes) if w is not None]
    assert len(won) == 1
    holder = next(c for c in lanes if c.writer == won[0].writer)
    assert holder.renew(won[0])
    other = next(c for c in lanes if c is not holder)
    assert other.next() is True  # held by a live lease: wait
    clock.now += 31
    taken = other.next()
    assert not isinstance(taken, bool) and taken is not None and (taken.shard, taken.generation) == (0, 1)
    assert not holder.renew(won[0])  # the old holder sees the newer claim and gives the shard up


def test_a_model_load_longer_than_the_lease_keeps_the_lanes_claim(file_place, make_job, worker_env, bij_bin,
                                                                   read_output, log_lines):
    # A big model loads for minutes, longer than a lease: the lane must not find its own claim
    # expired once loaded and work the shard a second time.
    # The whole shard fits in the engine at once: its tail (when the lane looks for its next shard)
    # comes at once, before the first renewal of the claim once the shard has started.
    inputs = rows(40)
    spec, job = make_job(file_place, file_place.write_jsonl("in.jsonl", inputs),
                         model={"engine": "simulated", "task": "generate", "maxTokens": 4,
                                "simulated": {"maxNumSeqs": 64, "stepSeconds": 0.05, "loadSeconds": 5}},
                         sharding={"targetShardBytes": 1 << 20, "chunkRows": 32},
                         workers={"parallelism": 1, "leaseSeconds": 3}, output={"keepIntermediate": True})
    p = subprocess.run([bij_bin("bij"), "run", str(spec)], env=worker_env(file_place), capture_output=True,
                       text=True, timeout=180)
    assert p.returncode == 0, p.stderr
    assert plan_round(job, 0).shard_count == 1
    records = [r for recs in log_lines(file_place, job).values() for r in recs]
    assert len(records) == len(inputs)  # one writer: every row computed and logged once
    eff = read_output(job).manifest["efficiency"]
    assert eff["modelLoads"] == 1 and eff["modelLoadSeconds"] >= 5
