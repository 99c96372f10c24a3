"""Claims at scale: the requests one lane makes to start, resume, steal and finish (issue 38, item 5).

A lane's claims, done markers and completion marker live in a folder of its own (bij.worker.lanes,
`Claims`); before, every lane listed the round's whole claims and done folders and read the newest
claim of every claimed shard (`RoundClaims`, kept for rounds begun that way). This counts, in an
object store in memory that prices requests as S3 does (a LIST page per 1,000 keys, one request a
GET, HEAD, PUT or conditional create), the requests of ONE lane at lanes x shards = 100 x 10,000,
1,000 x 100,000 and 10,000 x 1,000,000 (a share of 100 shards a lane at each size); the rest of the
round is prefilled as the other lanes would have left it, old layout and new in the same run:

- start: a fresh lane's first claim at the round's start (every other lane holds its first shard);
- replacement: a replacement process's first claim mid-round (half of every share done, each lane
  holding its next shard; the lost process held one of its own and one it stole);
- steal: a lane whose own shards are done, taking its first unstarted shard of another lane;
- round end: the requests from the lane's taking its last shard to its exit (the done marker of
  that shard included), every other shard done and every other lane's walk stopped at this lane
  (its completion marker counts the lanes up to it).
  Reported, no target: the same with every marker counting one lane only (the walk's worst case).

Targets: the new layout's requests at 10,000 x 1,000,000 / at 100 x 10,000 <= 1.5 in each case (flat
in the round's size for a fixed share). Reported: old / new at each size.

    python bench/claims_scale.py [--sizes 100x10000,1000x100000,10000x1000000]
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

from bij.contract import layout  # noqa: E402
from bij.contract.records import ClaimRecord  # noqa: E402
from bij.storage import NotFound, ObjectInfo  # noqa: E402
from bij.worker import lanes as lanes_module  # noqa: E402
from bij.worker.claim import Claim, listing_requests  # noqa: E402
from bij.worker.lanes import Claims, open_claims, ring  # noqa: E402
from bij.worker.round_claims import RoundClaims  # noqa: E402

FLAT = 1.5  # new layout, largest / smallest round, per case
PREFIX = "s3://bucket/out/_bij/job/round-0"
FAR = 4e9  # a live lease's expiry (epoch seconds)
NOW = 1e9
CASES = ("start", "replacement", "steal", "round end")


class CountingStore:
    """Objects in memory, by folder, with the requests S3 would take counted by kind."""

    supports_append = False

    def __init__(self) -> None:
        self.folders: dict[str, dict[str, bytes]] = defaultdict(dict)
        self.counts: Counter[str] = Counter()

    def put(self, uri: str, data: bytes) -> None:
        """Prefill: not counted."""
        folder, _, name = uri.rpartition("/")
        self.folders[folder + "/"][name] = data

    def _keys(self, uri: str) -> list[str]:
        out = [f + n for f, names in self.folders.items() if f.startswith(uri) for n in names]
        out.sort()
        return out

    def list(self, uri: str) -> list[ObjectInfo]:
        keys = self._keys(uri)
        self.counts["LIST"] += listing_requests(len(keys))
        return [ObjectInfo(k, 0) for k in keys]

    def list_pages(self, uri: str) -> Iterator[list[ObjectInfo]]:
        keys = self._keys(uri)
        for i in range(0, max(1, len(keys)), 1000):
            self.counts["LIST"] += 1
            yield [ObjectInfo(k, 0) for k in keys[i:i + 1000]]

    def _get(self, uri: str) -> bytes | None:
        folder, _, name = uri.rpartition("/")
        names = self.folders.get(folder + "/")
        return None if names is None else names.get(name)

    def read_bytes(self, uri: str) -> bytes:
        self.counts["GET"] += 1
        data = self._get(uri)
        if data is None:
            raise NotFound(uri)
        return data

    def exists(self, uri: str) -> bool:
        self.counts["HEAD"] += 1
        return self._get(uri) is not None

    def write_bytes(self, uri: str, data: bytes) -> None:
        self.counts["PUT"] += 1
        self.put(uri, data)

    def create(self, uri: str, data: bytes) -> bool:
        self.counts["CREATE"] += 1
        if self._get(uri) is not None:
            return False
        self.put(uri, data)
        return True


class Round:
    """A round's objects as lanes of one layout leave them, written straight into the store."""

    def __init__(self, new: bool, lanes: int, shards: int):
        self.new, self.lanes, self.shards = new, lanes, shards
        self.store = CountingStore()
        self.other = ClaimRecord(0, 0, -2, "someone", FAR).to_json()  # a live claim of another lane

    def claim(self, shard: int, generation: int = 0, body: bytes | None = None, holder: int | None = None) -> None:
        owner = shard % self.lanes
        if self.new:
            self.store.put(layout.lane_claim_uri(PREFIX, owner, shard, generation), body or self.other)
            if holder is not None and holder != owner:
                self.store.put(layout.lane_held_uri(PREFIX, holder, shard, generation), b"")
        else:
            self.store.put(layout.claim_uri(PREFIX, shard, generation), body or self.other)

    def done(self, shard: int, worker: int | None = None) -> None:
        self.claim(shard)
        self.store.put(layout.done_uri(PREFIX, shard), b"{}")
        if self.new:
            for lane in {shard % self.lanes, shard % self.lanes if worker is None else worker}:
                self.store.put(layout.lane_done_uri(PREFIX, lane, shard), b"")

    def complete(self, lane: int, count: int) -> None:
        if self.new:
            self.store.put(layout.lane_complete_uri(PREFIX, lane), json.dumps({"lanes": count}).encode())

    def claims(self, lane: int, writer: str) -> Claims | RoundClaims:
        kw = dict(lane=lane, lanes=self.lanes, shards=self.shards, writer=writer, lease_seconds=60,
                  clock=lambda: NOW)
        return open_claims(self.store, PREFIX, **kw) if self.new else RoundClaims(self.store, PREFIX, **kw)


def mid_round(r: Round, lane: int, own_done: bool) -> None:
    """Half of every lane's share done, and each lane holding its next shard (`lane` too, unless its
    own share is all done)."""
    share = r.shards // r.lanes
    for other in range(r.lanes):
        mine = range(other, r.shards, r.lanes)
        upto = share if other == lane and own_done else share // 2
        for s in mine[:upto]:
            r.done(s)
        if upto < share and other != lane:
            r.claim(mine[upto])


def case(new: bool, lanes: int, shards: int, name: str, ones: bool = False) -> Counter[str]:
    r = Round(new, lanes, shards)
    lane = lanes // 2 + 1
    share = shards // lanes
    mine = range(lane, shards, lanes)
    if name == "start":
        for other in range(lanes):
            if other != lane:
                r.claim(other)
        got = r.claims(lane, "w").next()
        assert isinstance(got, Claim) and got.shard == lane, got
    elif name == "replacement":
        mid_round(r, lane, own_done=False)
        held = mine[share // 2]
        r.claim(held, body=ClaimRecord(held, 0, lane, "old", FAR).to_json())
        stolen = (lane + 1) % lanes + lanes * (share - 1)  # the end of the next lane's share
        r.claim(stolen, body=ClaimRecord(stolen, 0, lane, "old", FAR).to_json(), holder=lane)
        got = r.claims(lane, "new").next()
        assert isinstance(got, Claim) and (got.shard, got.generation) == (held, 1), got
    elif name == "steal":
        mid_round(r, lane, own_done=True)
        got = r.claims(lane, "w").next()
        assert isinstance(got, Claim) and got.shard % lanes != lane, got
    elif name == "round end":
        for s in range(shards):
            if s % lanes != lane:
                r.done(s)
        order = ring(lanes)
        at = {x: i for i, x in enumerate(order)}
        for other in range(lanes):
            if other != lane:
                r.complete(other, 1 if ones else (at[lane] - at[other]) % lanes)
        c = r.claims(lane, "w")
        while True:  # the lane works its share; counted from when it takes its last shard to its exit
            got = c.next()
            assert isinstance(got, Claim) and got.shard % lanes == lane, got
            if got.shard == mine[-1]:
                break
            r.store.put(layout.done_uri(PREFIX, got.shard), b"{}")
            c.finished(got.shard)
        r.store.counts.clear()
        assert c.next() is True  # nothing left to take while its last shard runs
        r.store.put(layout.done_uri(PREFIX, mine[-1]), b"{}")
        c.finished(mine[-1])
        assert c.next() is None
    return r.store.counts


class LaneView:
    """One lane's requests to the shared store, counted apart."""

    def __init__(self, store: CountingStore):
        self.store, self.counts = store, Counter[str]()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)

        def counted(*args: Any) -> Any:
            before = Counter(self.store.counts)
            try:
                return method(*args)
            finally:
                self.counts.update(self.store.counts - before)
        return counted


def staggered_end(lanes: int, finish: str, shuffled: bool) -> tuple[float, int]:
    """Every lane holding its last shard, the lanes finish one at a time (in index order, or in a random
    order), every lane already finished asking again (one poll) after each: the mean and most requests
    a lane makes from its last shard's end to its exit, its polls (a HEAD each) left out. `shuffled`:
    the walk's ring as `ring()` shuffles it, else in index order."""
    saved = lanes_module.ring
    if not shuffled:
        lanes_module.ring = lambda n: list(range(n))
    try:
        shards = 2 * lanes
        store = CountingStore()
        views = [LaneView(store) for _ in range(lanes)]
        cs = [Claims(views[i], PREFIX, lane=i, lanes=lanes, shards=shards, writer=f"w{i}",  # type: ignore[arg-type]
                     lease_seconds=60, clock=lambda: NOW) for i in range(lanes)]
        for c in cs:
            first = c.next()
            assert isinstance(first, Claim)
            store.put(layout.done_uri(PREFIX, first.shard), b"{}")
            c.finished(first.shard)
            assert isinstance(c.next(), Claim)  # its last shard
        for v in views:
            v.counts.clear()
        order = list(range(lanes))
        if finish == "random":
            random.Random(5).shuffle(order)
        running: list[int] = []
        for lane in order:
            store.put(layout.done_uri(PREFIX, lane + lanes), b"{}")
            cs[lane].finished(lane + lanes)
            running.append(lane)
            for i in running:
                assert cs[i].next() is not False
        for i in running:
            assert cs[i].next() is None
        per = [sum(v.counts.values()) - v.counts["HEAD"] for v in views]
        return sum(per) / lanes, max(per)
    finally:
        lanes_module.ring = saved


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__, rows=0, repeats=1)
    p.add_argument("--sizes", default="100x10000,1000x100000,10000x1000000", help="lanes x shards, comma-separated")
    p.add_argument("--stagger-lanes", default="100,1000", help="lane counts of the staggered round end")
    args = harness.parse(p, argv)
    args.stagger_lanes = [int(n) for n in args.stagger_lanes.split(",")]
    sizes = [tuple(int(n) for n in s.split("x")) for s in args.sizes.split(",")]
    report = harness.Report("claims_scale")
    results: dict[str, dict[str, dict[str, dict[str, int]]]] = {}
    print(f"{'case':22} {'lanes x shards':>18} {'old':>8} {'new':>6} {'old/new':>9}   new by kind")
    for name, ones in [(c, False) for c in CASES] + [("round end", True)]:
        label = name + (" (markers of 1)" if ones else "")
        results[label] = {}
        for lanes, shards in sizes:
            t0 = time.perf_counter()
            old = case(False, lanes, shards, name) if not ones else None
            new = case(True, lanes, shards, name, ones)
            size = f"{lanes}x{shards}"
            results[label][size] = {"new": dict(new), **({"old": dict(old)} if old is not None else {})}
            o, n = (sum(old.values()) if old is not None else None), sum(new.values())
            print(f"{label:22} {size:>18} {o if o is not None else '-':>8} {n:>6} "
                  f"{(f'{o / n:9.1f}' if o is not None else '-'):>9}   {dict(sorted(new.items()))}"
                  f"  ({time.perf_counter() - t0:.0f}s)", flush=True)
        lo, hi = f"{sizes[0][0]}x{sizes[0][1]}", f"{sizes[-1][0]}x{sizes[-1][1]}"
        n_lo, n_hi = (sum(results[label][s]["new"].values()) for s in (lo, hi))
        report.ratio(f"new {label} requests {hi} / {lo}", n_hi / n_lo, None if ones else FLAT, False)
        if not ones:
            report.ratio(f"old / new {label} requests at {hi}",
                         sum(results[label][hi]["old"].values()) / n_hi, None)
    report.details["requests"] = results
    stagger: dict[str, list[float]] = {}
    for lanes in args.stagger_lanes:
        for finish in ("index", "random"):
            # The index-ordered ring costs O(lanes^2) in its worst case: shown at the smallest count only.
            for shuffled in (True, False) if lanes == args.stagger_lanes[0] else (True,):
                t0 = time.perf_counter()
                mean, most = staggered_end(lanes, finish, shuffled)
                key = f"{lanes} lanes finishing in {finish} order, ring {'shuffled' if shuffled else 'in index order'}"
                stagger[key] = [mean, most]
                print(f"round end, {key}: {mean:.1f} requests a lane (most {most}), polls left out"
                      f"  ({time.perf_counter() - t0:.0f}s)", flush=True)
    report.details["staggered end"] = stagger
    hi = args.stagger_lanes[-1]
    report.ratio(f"new round end, {hi} lanes finishing in index order: requests a lane (mean)",
                 stagger[f"{hi} lanes finishing in index order, ring shuffled"][0], None)
    report.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
