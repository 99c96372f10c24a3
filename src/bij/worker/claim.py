"""One claim on a shard, as a lane's claims (`lanes.Claims`, `round_claims.RoundClaims`) read and make it,
how long its lease lasts, and what a listing of claims costs in requests."""

from __future__ import annotations

import re
from dataclasses import dataclass

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
