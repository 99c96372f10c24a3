"""One claim on a shard, as a lane's claims (`lanes.Claims`, `round_claims.RoundClaims`) read and make it,
how long its lease lasts, what a listing of claims costs in requests, and what both ways of keeping a
round's claims do alike (`ClaimsBase`)."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bij.contract import layout
from bij.contract.records import ClaimRecord
from bij.storage import NotFound, Storage

DEFAULT_LEASE_SECONDS = 60.0
CLAIM_RE = re.compile(r"^(\d{5,})-(\d{5,})\.json$")  # a claim object: <shard>-<generation>.json


@dataclass(frozen=True)
class Claim:
    shard: int
    generation: int
    lane: int
    writer: str
    expires_at: float


LIST_PAGE = 1000  # keys one S3 LIST request returns: what a listing of n objects costs, in requests


def listing_requests(objects: int) -> int:
    """Requests one listing of `objects` objects costs on S3 (one at least, for an empty folder)."""
    return max(1, -(-objects // LIST_PAGE))


class ClaimsBase:
    """What a round's claims do alike however they are kept (`lanes.Claims` by lane,
    `round_claims.RoundClaims` in one folder for the round): read, take and renew one claim, tell
    whether a shard is done, and wait for the next shard. A subclass says where a claim lives (`uri`),
    which shard comes next (`next`) and what else a claim it won leaves behind (`_won_claim`)."""

    store: Storage
    prefix: str
    lane: int
    writer: str
    lease: float
    clock: Callable[[], float]
    _done: set[int]  # shards known done
    _newest: dict[int, int]  # a claimed shard's newest claim generation (at least this one)
    _held: dict[int, Claim]  # the last claim read (or made) of a shard, for its expiry
    _inherited: list[int]  # shards an earlier process of this lane held, to continue first
    _own: Sequence[int]  # this lane's own shards, in order
    _own_at: int  # the next of them to try

    def uri(self, shard: int, generation: int) -> str:
        raise NotImplementedError

    def next(self) -> Claim | None | bool:
        """Claim the next shard to work: a Claim; True when every shard left is held by a live
        lease of someone else (wait and ask again); None when every shard is done."""
        raise NotImplementedError

    def _won_claim(self, shard: int, generation: int) -> None:
        """This process created claim `generation` of `shard` (before `take` returns it)."""
        raise NotImplementedError

    def _inherited_or_own(self) -> Claim | None:
        """The first two places `next` looks in, the same however claims are kept; None when neither
        has a shard left to take."""
        # 1. What an earlier process of this lane held: it has stopped (a replacement pod starts
        #    only once the old one is gone), so its shards continue here first.
        while self._inherited:
            s = self._inherited.pop(0)
            got = self.take(s, self._newest[s] + 1)
            if got:
                return got
        # 2. This lane's own shards, in order; a lost create means someone took the shard.
        while self._own_at < len(self._own):
            s = self._own[self._own_at]
            self._own_at += 1
            if s not in self._done and s not in self._newest:
                got = self.take(s, 0)
                if got:
                    return got
        return None

    def is_done(self, shard: int) -> bool:
        """Whether the shard has a completion record (known, or one HEAD)."""
        return self._is_done(shard)

    def _is_done(self, shard: int) -> bool:
        if shard in self._done:
            return True
        if self.store.exists(layout.done_uri(self.prefix, shard)):
            self._done.add(shard)
            return True
        return False

    def read(self, shard: int, generation: int) -> Claim | None:
        try:
            rec = ClaimRecord.from_json(self.store.read_bytes(self.uri(shard, generation)), shard, generation)
            return Claim(shard, generation, rec.lane, rec.writer, rec.expires_at)
        except NotFound:
            return None
        except (ValueError, KeyError, TypeError):
            # A claim we cannot read holds nothing: treat it as expired.
            return Claim(shard, generation, -1, "", 0.0)

    def _body(self, shard: int, generation: int) -> bytes:
        return ClaimRecord(shard, generation, self.lane, self.writer, self.clock() + self.lease).to_json()

    def take(self, shard: int, generation: int) -> Claim | None:
        """Create claim `generation` of `shard`; None when another process created it first."""
        won = self.store.create(self.uri(shard, generation), self._body(shard, generation))
        self._newest[shard] = max(generation, self._newest.get(shard, -1))
        if not won:
            return None
        self._won_claim(shard, generation)
        claim = Claim(shard, generation, self.lane, self.writer, self.clock() + self.lease)
        self._held[shard] = claim
        return claim

    def renew(self, claim: Claim) -> bool:
        """Extend our lease; False when a newer claim took the shard from us."""
        # Claims are created generation after generation, so a newer one exists iff the next does.
        if self.store.exists(self.uri(claim.shard, claim.generation + 1)):
            return False
        self.store.write_bytes(self.uri(claim.shard, claim.generation), self._body(claim.shard, claim.generation))
        return True

    def next_or_wait(self, stopped: threading.Event, poll: float | None = None) -> Claim | None:
        """`next()`, waiting while others hold every shard left; None when all are done or when
        `stopped` is set."""
        # Often enough that a lane waiting at the round's end exits soon after the last shard is done.
        poll = poll if poll is not None else max(0.2, min(0.5, self.lease / 4))
        while not stopped.is_set():
            got = self.next()
            if got is None or isinstance(got, Claim):
                return got
            stopped.wait(poll)
        return None
