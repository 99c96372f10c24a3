"""Lanes: one worker process works many shards of a round with its model loaded once.

A round's Job has one index per lane. Lane `i` works its own shards first (`i`,
`i + lanes`, ...), in order; with none left it takes unfinished shards of other
lanes: first ones nobody has started (from the end of the busiest of a few lanes it
looks at, so that lane keeps its order), then ones whose holder stopped renewing.

Every shard a process works it first claims in the output store with a conditional
create, so exactly one process wins each claim. What the round knows of a shard lives
in the folder of the lane that owns it (shard % lanes), so that a lane reads its share,
not the round:

    <round>/lanes/<lane:05d>/<shard:05d>-<generation:05d>.json   a claim {"lane", "writer", "expiresAt"}
                             <shard:05d>.done                    the shard is done (a hint: done/ holds the record)
                             <shard:05d>-<generation:05d>.held   this lane took that claim of another lane's shard
                             complete.json                       every shard of the lane is done; {"lanes": n}

The newest generation holds the shard. Its writer renews it (rewrites its own object
with a later `expiresAt`) every third of the lease while it works, and gives the shard
up as soon as it sees a newer generation. Anyone may take a shard whose newest claim
has expired by creating the next generation; a new process of the same lane (the
replacement pod after a preemption, which the Job starts only once the old pod has
terminated) takes its lane's claims at once, those in its own folder and those its
`.held` pointers name. A shard resumes from its durable prefix whoever works it, and two
writers by accident cannot lose or duplicate a row: each writer appends to its own log
(see segments.py).

A lane exits once every shard of the round is done: it walks the ring of lanes (shuffled,
the same for all), and at each lane not known complete takes its unstarted shards and
those whose lease expired, waiting while others hold them; a lane verified complete gets
`complete.json`, and a lane's own says how many lanes from it round the ring its walk has
verified, so other walks jump them. Every lane walks the whole ring, so while one lane
lives, the shards of lanes that died for good are taken over.

What a lane reads grows with its share and a few other lanes', not with the round:

- To start (or resume), one listing of its own folder, and a read of each claim of its
  own not done (at most the two shards a lane has open, and what it stole).
- To steal, a listing each of `STEAL_PROBES` other lanes; the lane with the most
  unstarted is taken from its end until its own lane's claim is met.
- At the end, per lane the walk stops at: a GET of its marker and a listing of its
  folder; lanes that finish in a random order stop a walk about ln(lanes) times.
- Between them the lane keeps what it learnt (claims, markers and completion records
  are never removed while a round runs); the conditional create is the test; a claim
  held by another is read again only once its last known expiry has passed; completion
  is checked one record at a time; a renewal asks whether the next generation exists.

A canary Job (spec.canary) works a few shards of round 0 alone (`only`): its lanes keep
their claims in the same folders, walk only the lanes holding those shards, and write no
completion marker, since the round's own Job, which comes next, takes a marker to say that
every shard of the lane is done.

A round begun by a version that kept every claim in `<round>/claims/` goes on there
(`round_claims.RoundClaims`, which lists the round's claims and completion records whole).

With a continuous-batching engine (vLLM, simulated) a lane starts its next shard as soon as
every row of the current one is in the engine (`engine_share.EngineShare`), so the engine's running
batch does not drain at each shard's end; at most two shards of a lane are open at once.
"""

from __future__ import annotations

import json
import logging
import random
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from bij.contract import layout
from bij.storage import NotFound, Storage, StorageError
from bij.worker.claim import CLAIM_RE, DEFAULT_LEASE_SECONDS, Claim, ClaimsBase, listing_requests
from bij.worker.round_claims import RoundClaims

log = logging.getLogger("bij.worker")

_MARK_RE = re.compile(r"^(\d{5,})\.done$")  # in a lane's folder: the shard is done
_HELD_RE = re.compile(r"^(\d{5,})-(\d{5,})\.held$")  # in a lane's folder: it held that claim
_COMPLETE = "complete.json"
STEAL_PROBES = 4  # lanes a lane with nothing left lists to find the busiest


class Claims(ClaimsBase):
    """The claims of one round, seen from one worker process (`writer`) of lane `lane`, kept by lane:
    what a lane reads to start, resume, steal and finish grows with a lane's share, not the round's.

    Not thread-safe across `next()` calls (the lane's thread makes them); `renew()` keeps no state
    and may run in any thread.
    """

    def __init__(self, store: Storage, round_prefix: str, *, lane: int, lanes: int, shards: int, writer: str,
                 lease_seconds: float = DEFAULT_LEASE_SECONDS, share: bool = True,
                 clock: Callable[[], float] = time.time, probes: int = STEAL_PROBES,
                 rng: random.Random | None = None, only: Sequence[int] | None = None):
        self.store, self.prefix = store, round_prefix.rstrip("/")
        self.share = share  # False: this lane's own shards only
        self.lane, self.lanes, self.shards = lane, lanes, shards
        # `only`: this process works those shards of the round alone (a canary Job's), by lane. It then writes
        # no completion marker: a marker says every shard of its lane is done, and the round's Job reads it.
        self._only: dict[int, list[int]] | None = None
        if only is not None:
            self._only = {}
            for s in sorted(only):
                self._only.setdefault(s % lanes, []).append(s)
        self._marks = share and only is None
        self._own = self._lane_shards(lane)
        self._own_at = 0  # the next of this lane's own shards to try
        self.writer, self.lease, self.clock = writer, float(lease_seconds), clock
        self.probes, self.rng = probes, rng or random.Random()
        # What this process learnt of the round (claims, markers and records stay while it runs).
        self._started = False
        self._done: set[int] = set()  # shards known done
        self._newest: dict[int, int] = {}  # a claimed shard's newest claim generation (at least this one)
        self._held: dict[int, Claim] = {}  # the last claim read (or made) of a shard, for its expiry
        self._inherited: list[int] = []  # shards an earlier process of this lane held, to continue first
        self._stealing = share and lanes > 1
        self._victim: int | None = None  # the lane stolen from, and its unstarted shards at its listing
        self._free: list[int] = []
        self._walk = 0  # lanes known complete, from this one on round the ring
        self._ring: list[int] | None = None  # the lanes in ring order, and this lane's place there
        self._at = 0
        self._marked = 0  # the count this lane's completion marker holds
        self._pending: list[int] | None = None  # shards not known done of the lane the walk is at
        self._listed = 0  # requests its listings cost (as on S3)

    # --- what the store says -------------------------------------------------------------------

    def owner(self, shard: int) -> int:
        return shard % self.lanes

    def uri(self, shard: int, generation: int) -> str:
        return layout.lane_claim_uri(self.prefix, self.owner(shard), shard, generation)

    def _lane_shards(self, lane: int) -> Sequence[int]:
        if self._only is not None:
            return self._only.get(lane, [])
        return range(lane, self.shards, self.lanes)

    def _list_lane(self, lane: int) -> tuple[bool, dict[int, int]]:
        """Learn a lane's claims and done markers from one listing of its folder; whether it has a
        completion marker, and the claims of other lanes' shards its processes held (shard: generation)."""
        objects = self.store.list(layout.lane_folder(self.prefix, lane))
        self._listed += listing_requests(len(objects))
        complete, held = False, dict[int, int]()
        for o in objects:
            name = o.uri.rsplit("/", 1)[-1]
            if m := CLAIM_RE.match(name):
                s, g = int(m.group(1)), int(m.group(2))
                self._newest[s] = max(g, self._newest.get(s, -1))
            elif m := _MARK_RE.match(name):
                self._done.add(int(m.group(1)))
            elif m := _HELD_RE.match(name):
                s, g = int(m.group(1)), int(m.group(2))
                held[s] = max(g, held.get(s, -1))
            elif name == _COMPLETE:
                complete = True
        return complete, held

    def _complete_count(self, lane: int) -> int:
        """How many lanes from `lane` on are known complete, from its marker (0: none yet)."""
        try:
            return max(0, int(json.loads(self.store.read_bytes(layout.lane_complete_uri(self.prefix, lane)))["lanes"]))
        except NotFound:
            return 0
        except (ValueError, KeyError, TypeError):
            return 0  # a marker we cannot read says nothing

    def _won_claim(self, shard: int, generation: int) -> None:
        """Another lane's shard taken leaves a `.held` pointer in this lane's folder."""
        if self.owner(shard) != self.lane:
            # So that a replacement of this lane finds the shard in its own folder.
            self.store.write_bytes(layout.lane_held_uri(self.prefix, self.lane, shard, generation), b"")

    def finished(self, shard: int) -> None:
        """The shard's completion record is written: mark it done in its lane's folder (and in this
        lane's, when it is another lane's shard), so that listings see it. A marker lost to a crash
        costs only a HEAD of the record later."""
        self._done.add(shard)
        for lane in sorted({self.owner(shard), self.lane}):
            try:
                self.store.write_bytes(layout.lane_done_uri(self.prefix, lane, shard), b"")
            except (StorageError, OSError) as e:
                log.warning("lane %d: cannot mark shard %d done in lane %d's folder: %s", self.lane, shard, lane, e)

    # --- which shard next ----------------------------------------------------------------------

    def next(self) -> Claim | None | bool:
        """Claim the next shard to work: a Claim; True when every shard left is held by a live
        lease of someone else (wait and ask again); None when every shard is done."""
        if not self._started:
            self._start()
        # 1. What an earlier process of this lane held; 2. this lane's own shards, in order.
        got = self._inherited_or_own()
        if got:
            return got
        # 3. Shards nobody started: from the end of the busiest of a few lanes looked at.
        if self._stealing:
            got = self._steal()
            if got:
                return got
        # 4. Round the ring of lanes: shards whose holder stopped renewing; done when every lane is.
        return self._watch()

    def _start(self) -> None:
        """Learn this lane's part of the round from one listing of its folder."""
        self._started = True
        complete, held = self._list_lane(self.lane)
        if complete:
            # Every shard of the lane is done (a replacement after that): with sharing on, the walk
            # goes on from where its marker says.
            self._done.update(self._lane_shards(self.lane))
            if self.share:
                self._walk = self._marked = max(1, self._complete_count(self.lane))
        for s, g in sorted(self._newest.items()):
            if s in self._done:
                continue
            c = self.read(s, g)
            if c is None:
                continue
            self._held[s] = c
            if c.lane == self.lane and c.writer != self.writer:
                self._inherited.append(s)
        for s, g in sorted(held.items()):
            if s in self._done or not self.share:
                continue
            c = self.read(s, g)
            if c is None or c.lane != self.lane or c.writer == self.writer:
                continue
            # The newest generation may be later: then the create is lost, and the shard is another's.
            self._newest[s] = max(g, self._newest.get(s, -1))
            self._held[s] = c
            self._inherited.append(s)

    def _steal(self) -> Claim | None:
        while True:
            if not self._free:
                self._victim = self._probe()
                if self._victim is None:
                    # Unstarted shards only get fewer; those the probes missed, the walk finds.
                    self._stealing = False
                    return None
            s = self._free.pop()
            got = self.take(s, 0)
            if got:
                return got
            winner = self.read(s, 0)
            if winner is not None:
                self._held[s] = winner
                if winner.lane == self._victim:
                    # Its own lane got there: a lane claims its own shards in order, so every
                    # earlier one of them is taken as well.
                    self._free.clear()

    def _probe(self) -> int | None:
        """List a few other lanes' folders (every one, where there are few); the one with the most
        unstarted shards, which it keeps in `_free`."""
        # Lanes that hold shards this process works: every lane, or a canary's few.
        holding = range(self.lanes) if self._only is None else sorted(self._only)
        others = [lane for lane in holding if lane != self.lane]
        picks = others if len(others) <= self.probes else self._sample_others(others)
        best: int | None = None
        self._free = []
        for lane in picks:
            self._list_lane(lane)
            free = [s for s in self._lane_shards(lane) if s not in self._done and s not in self._newest]
            if len(free) > len(self._free):
                best, self._free = lane, free
        return best

    def _sample_others(self, others: Sequence[int]) -> list[int]:
        return sorted(self.rng.sample(others, self.probes))

    def _watch(self) -> Claim | None | bool:
        """Walk the ring of lanes from this one: at each lane not known complete, take its shards
        whose lease expired (or that nobody started), and wait while others hold them; a lane's
        completion marker says how many lanes from it on are complete, so the walk jumps them.
        Every lane walks the whole ring before it exits: while one lane lives, every shard of a
        lane that died for good is taken over."""
        span = self.lanes if self.share else 1
        while self._walk < span:
            lane = self._ring_lane(self._walk)
            if self._pending is None and self._only is not None and not self._lane_shards(lane):
                self._walk += 1  # a lane none of whose shards this process works (a canary's)
                continue
            if self._pending is None:
                if self._walk > 0:
                    n = self._complete_count(lane)
                    if n:
                        self._walk += n
                        continue
                    self._list_lane(lane)
                self._pending = [s for s in self._lane_shards(lane) if s not in self._done]
            # Completion, one record at a time: the lane is not done while its first shard left is not.
            while self._pending and self._is_done(self._pending[0]):
                self._pending.pop(0)
            if self._pending:
                got = self._expired(self._pending)
                if got is not None:
                    return got
                self._pending = [s for s in self._pending if s not in self._done]
                self._mark()
                return True
            self._pending = None
            self._walk += 1
            marker = layout.lane_complete_uri(self.prefix, lane)
            if lane != self.lane and self._marks and not self.store.create(marker, b'{"lanes": 1}'):
                self._walk += max(0, self._complete_count(lane) - 1)  # its own walk got further
        self._mark()
        return None

    def _ring_lane(self, walk: int) -> int:
        """The lane `walk` steps after this one round the ring (the same ring for every lane)."""
        if self._ring is None:
            self._ring = ring(self.lanes)
            self._at = self._ring.index(self.lane)
        return self._ring[(self._at + walk) % self.lanes]

    def _mark(self) -> None:
        """Say in this lane's completion marker how far its walk got, for the walks of others to jump."""
        walked = min(self._walk, self.lanes)
        if self._marks and walked > self._marked:
            self.store.write_bytes(layout.lane_complete_uri(self.prefix, self.lane),
                                   json.dumps({"lanes": walked}).encode())
            self._marked = walked

    def _expired(self, pending: list[int]) -> Claim | None:
        """Take a shard of `pending` whose newest claim expired, or that was never claimed."""
        now = self.clock()
        unknown = float("-inf")
        # Unstarted shards of a lane that lives are taken from its end, as when stealing.
        for s in sorted(pending, key=lambda s: (self._held[s].expires_at if s in self._held else unknown, -s)):
            known = self._held.get(s)
            if known is not None and known.expires_at >= now:
                break  # renewals only move an expiry later: nothing after this one has expired either
            if s in self._done:
                continue
            if s not in self._newest:  # nobody started it, as far as the last listing said
                got = self.take(s, 0)
                if got:
                    return got
            g = self._newest.get(s, 0)
            c = self.read(s, g)
            if c is None:
                continue
            self._held[s] = c
            if c.expires_at >= now:
                continue
            if self._is_done(s):  # a finished shard's claim is no longer renewed
                continue
            got = self.take(s, g + 1)
            if got:
                log.info("lane %d: took over shard %d from lane %d (its lease expired %.0f s ago)",
                         self.lane, s, c.lane, now - c.expires_at)
                return got
        return None


def ring(lanes: int) -> list[int]:
    """The lanes in the order their walks take them, shuffled the same for every lane: in index order,
    lanes that finish in index order (pods start so) would each stop at every lane after them."""
    def mix(lane: int) -> int:  # splitmix64: the same in every process, unlike hash() of a str
        z = (lane + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        return z ^ (z >> 31)
    return sorted(range(lanes), key=mix)


def open_claims(store: Storage, round_prefix: str, **kwargs: Any) -> Claims | RoundClaims:
    """The claims of a round as its lanes keep them: by lane, unless the round was begun by a version
    that kept them in one folder (a Job recreated by a newer operator mid-round), whose claims then
    go on there, so that no shard is claimed in both places."""
    first = next(iter(store.list_pages(layout.claims_folder(round_prefix))), [])
    if first:
        return RoundClaims(store, round_prefix, **kwargs)
    return Claims(store, round_prefix, **kwargs)


class LeaseKeeper:
    """Renews a claim every third of the lease while its shard is worked; calls `lost` once if a
    newer claim took the shard."""

    def __init__(self, claims: Claims | RoundClaims, claim: Claim, lost: Callable[[], None]):
        self.claims, self.claim, self.lost = claims, claim, lost
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{claim.shard}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        every = self.claims.lease / 3
        while not self._stop.wait(every):
            try:
                if not self.claims.renew(self.claim):
                    log.warning("lane %d: shard %d was taken over by another worker; giving it up",
                                self.claims.lane, self.claim.shard)
                    self.lost()
                    return
            except (StorageError, OSError) as e:  # a storage hiccup: try again at the next renewal
                log.warning("lane %d: cannot renew the claim on shard %d: %s", self.claims.lane,
                            self.claim.shard, e)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
