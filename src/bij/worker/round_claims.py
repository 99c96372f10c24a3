"""The claims of a round begun by a version that kept every claim in `<round>/claims/` (`RoundClaims`):
such a round goes on there, its claims and completion records listed whole (`lanes.open_claims`)."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Sequence

from bij.contract import layout
from bij.storage import Storage
from bij.worker.claim import CLAIM_RE, DEFAULT_LEASE_SECONDS, Claim, ClaimsBase, listing_requests

log = logging.getLogger("bij.worker")

_DONE_RE = re.compile(r"^(\d{5,})\.json$")


class RoundClaims(ClaimsBase):
    """The claims of a round begun before claims were kept by lane: one folder for the round, listed
    whole (O(round) requests at a lane's start and end). Seen from one worker process (`writer`).

    Not thread-safe across `next()` calls (the lane's thread makes them); `renew()` keeps no state
    and may run in any thread.
    """

    def __init__(self, store: Storage, round_prefix: str, *, lane: int, lanes: int, shards: int, writer: str,
                 lease_seconds: float = DEFAULT_LEASE_SECONDS, share: bool = True,
                 clock: Callable[[], float] = time.time, only: Sequence[int] | None = None):
        self.store, self.prefix = store, round_prefix.rstrip("/")
        self.share = share  # False: this lane's own shards only
        self.lane, self.lanes, self.shards = lane, lanes, shards
        # The shards this process works: the round's, or `only` those (a canary Job's).
        self._universe: Sequence[int] = range(shards) if only is None else sorted(only)
        self._own: Sequence[int] = [s for s in self._universe if s % lanes == lane]
        self._own_at = 0  # the next of this lane's own shards to try
        self.writer, self.lease, self.clock = writer, float(lease_seconds), clock
        # What this process learnt of the round (claims and completion records stay while it runs).
        self._started = False
        self._done: set[int] = set()  # shards with a completion record
        self._newest: dict[int, int] = {}  # a claimed shard's newest claim generation (at least this one)
        self._held: dict[int, Claim] = {}  # the last claim read (or made) of a shard, for its expiry
        self._inherited: list[int] = []  # shards an earlier process of this lane held, to continue first
        self._free: dict[int, list[int]] | None = None  # unstarted shards by lane, at the last claims listing
        self._pending: list[int] | None = None  # shards not known done, once nothing is left to start
        self._won = 0  # claims this process created
        self._listed = 0  # requests its listings cost (as on S3)

    # --- what the store says -------------------------------------------------------------------

    def uri(self, shard: int, generation: int) -> str:
        return layout.claim_uri(self.prefix, shard, generation)

    def _mine(self, shard: int) -> bool:
        return self.share or shard % self.lanes == self.lane

    def done(self) -> set[int]:
        """Shards with a completion record, from one listing."""
        objects = self.store.list(layout.done_folder(self.prefix))
        self._listed += listing_requests(len(objects))
        out = set()
        for o in objects:
            m = _DONE_RE.match(o.uri.rsplit("/", 1)[-1])
            if m:
                out.add(int(m.group(1)))
        return out

    def newest(self) -> dict[int, int]:
        """The newest claim generation of every claimed shard, from one listing."""
        objects = self.store.list(layout.claims_folder(self.prefix))
        self._listed += listing_requests(len(objects))
        out: dict[int, int] = {}
        for o in objects:
            m = CLAIM_RE.match(o.uri.rsplit("/", 1)[-1])
            if m:
                s, g = int(m.group(1)), int(m.group(2))
                out[s] = max(g, out.get(s, -1))
        return out

    def _learn_claims(self) -> None:
        for s, g in self.newest().items():
            self._newest[s] = max(g, self._newest.get(s, -1))

    def _won_claim(self, shard: int, generation: int) -> None:
        """Counted: listing again to steal costs no more requests than the claims won (`_steal`)."""
        self._won += 1

    # --- which shard next ----------------------------------------------------------------------

    def next(self) -> Claim | None | bool:
        """Claim the next shard to work: a Claim; True when every shard left is held by a live
        lease of someone else (wait and ask again); None when every shard is done."""
        if not self._started:
            if self._start():
                return None
        # 1. What an earlier process of this lane held; 2. this lane's own shards, in order.
        got = self._inherited_or_own()
        if got:
            return got
        # 3. Shards nobody started: from the end of the lane with the most left.
        if self.share:
            got = self._steal()
            if got:
                return got
        # 4. Shards whose holder stopped renewing; done when every shard is.
        return self._expired()

    def _start(self) -> bool:
        """Learn the round from one listing of each kind; True when every shard of ours is done."""
        self._started = True
        self._done = self.done()
        if all(s in self._done for s in self._universe if self._mine(s)):
            self._own_at, self._free, self._pending = len(self._own), {}, []
            return True
        self._learn_claims()
        for s, g in sorted(self._newest.items()):
            if s in self._done or not self._mine(s):
                continue
            c = self.read(s, g)
            if c is None:
                continue
            self._held[s] = c
            if c.lane == self.lane and c.writer != self.writer:
                self._inherited.append(s)
        return False

    def _steal(self) -> Claim | None:
        if self._free is None:  # this lane's own shards have just run out
            self._list_free()
        while True:
            assert self._free is not None
            left = [(-len(shards), lane) for lane, shards in self._free.items() if shards]
            if not left:
                return None
            lane = min(left)[1]
            s = self._free[lane].pop()
            got = self.take(s, 0)
            if got:
                return got
            # Lost: the listing is out of date. List again while listings have cost no more
            # requests than the claims this process won (so the busiest lane is the one it really
            # is); otherwise learn from who won.
            if self._listed <= self._won:
                self._list_free()
                continue
            winner = self.read(s, 0)
            if winner is not None:
                self._held[s] = winner
                if winner.lane == lane:
                    # Its own lane got there: a lane claims its own shards in order, so every
                    # earlier one of them is taken as well.
                    self._free[lane].clear()

    def _list_free(self) -> None:
        """The unstarted shards of other lanes, from a listing of the round's claims."""
        self._learn_claims()
        self._free = {}
        for s in self._universe:
            if s % self.lanes != self.lane and s not in self._done and s not in self._newest:
                self._free.setdefault(s % self.lanes, []).append(s)

    def _expired(self) -> Claim | None | bool:
        if self._pending is None:
            # Nothing left to start: one listing says which shards others finished meanwhile.
            self._done |= self.done()
            self._pending = [s for s in self._universe if self._mine(s) and s not in self._done]
        # Completion, one record at a time: the round is not done while the first shard left is not.
        while self._pending and self._is_done(self._pending[0]):
            self._pending.pop(0)
        if not self._pending:
            return None
        now = self.clock()
        unknown = float("-inf")
        for s in sorted(self._pending, key=lambda s: self._held[s].expires_at if s in self._held else unknown):
            known = self._held.get(s)
            if known is not None and known.expires_at >= now:
                break  # renewals only move an expiry later: nothing after this one has expired either
            if s in self._done:
                continue
            g = self._newest.get(s, 0)
            c = self.read(s, g)
            if c is None:
                if s not in self._newest:  # never claimed after all: take it
                    got = self.take(s, 0)
                    if got:
                        return got
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
        self._pending = [s for s in self._pending if s not in self._done]
        return True

    def finished(self, shard: int) -> None:
        """The shard's completion record is written: this layout keeps no marker of its own."""
        self._done.add(shard)
