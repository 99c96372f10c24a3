"""A shard's committer: finished records made durable in the shard's log, counted and reported.

Both schedulers hand it their records (encoded chunks from the streaming one, records of each
attempt from the judge loop); it appends them to the log, adds them to the shard's counts and
metrics, and rewrites the shard's progress record now and then.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

from bij.contract import layout
from bij.contract.codes import POOL_ENV
from bij.contract.plan import Plan
from bij.contract.records import encode, shard_record
from bij.contract.result_rows import row_id, row_usage
from bij.engines.base import Result
from bij.engines.structured import SCHEMA_VIOLATION
from bij.storage import Storage
from bij.storage.parquet import is_int64
from bij.storage.segments import ShardLog
from bij.worker.metrics import Metrics, Stats
from bij.worker.reader import Chunk

_ERROR = attrgetter("error")
_PROMPT_TOKENS = attrgetter("prompt_tokens")
_CACHED_TOKENS = attrgetter("cached_tokens")
_COMPLETION_TOKENS = attrgetter("completion_tokens")


def length_cut(res: Result) -> bool:
    """Whether a successful answer stopped at its token cap (finish_reason length, any of its choices)."""
    if res.error is not None:
        return False
    if res.choices:
        return any(c.finish_reason == "length" for c in res.choices)
    return res.extra.get("finish_reason") == "length"


def place_id(names: list[str], at: list[int]) -> str:
    """The id a row without one gets: its object's display name and its offset (`plain_rows.parse_plain`).
    Rows of one round whose ids are all their own places' are unique (publishing need not look)."""
    return f"{names[at[0]]}:{at[1]}"


@dataclass(slots=True)
class Tally:
    """What committed records add to the shard's counts."""

    results: int = 0
    errors: int = 0
    rejected: int = 0
    capped: int = 0
    truncated: int = 0
    int_ids: int = 0
    str_ids: int = 0
    place_ids: int = 0  # final rows whose id is none or their place's own generated id (`place_id`)
    codes: dict[str, int] = field(default_factory=dict)  # error rows by code
    validated: int = 0  # structured answers checked after decoding and valid
    repaired: int = 0  # ... of them, valid only on the second grammar backend's try
    length_cuts: int = 0  # result rows whose answer stopped at its token cap (finish_reason length)

    @classmethod
    def of(cls, records: list[dict[str, Any]], names: list[str] | None = None) -> Tally:
        """What `records` add; with `names` (the round's objects' display names), their place ids too."""
        t = cls()
        for rec in records:
            kind = rec["kind"]
            if names is not None and kind in ("result", "error", "capped"):
                rid = row_id(rec["row"])
                t.place_ids += rid is None or rid == place_id(names, rec["at"])
            if kind == "result":
                t.results += 1
                t.count_result(rec["row"])
            elif kind == "error":
                t.errors += 1
                code = str((rec["row"].get("error") or {}).get("code") or "unknown")
                t.codes[code] = t.codes.get(code, 0) + 1
            elif kind == "rejected":
                t.rejected += 1
            elif kind == "capped":
                t.capped += 1
        return t

    def count_result(self, row: dict[str, Any]) -> None:
        self.truncated += bool(row.get("truncated"))
        if is_int64(row_id(row)):
            self.int_ids += 1
        else:
            self.str_ids += 1

    def add(self, other: Tally) -> None:
        self.results += other.results
        self.errors += other.errors
        self.rejected += other.rejected
        self.capped += other.capped
        self.truncated += other.truncated
        self.int_ids += other.int_ids
        self.str_ids += other.str_ids
        self.place_ids += other.place_ids
        for code, n in other.codes.items():
            self.codes[code] = self.codes.get(code, 0) + n
        self.validated += other.validated
        self.repaired += other.repaired
        self.length_cuts += other.length_cuts

    def add_to(self, stats: Stats) -> None:
        """Count these records into a shard's statistics."""
        stats.rows += self.results
        stats.errors += self.errors
        stats.rejected += self.rejected
        stats.capped += self.capped
        stats.truncated += self.truncated
        stats.int_ids += self.int_ids
        stats.str_ids += self.str_ids
        stats.place_ids += self.place_ids
        stats.structured_validated += self.validated
        stats.structured_repaired += self.repaired
        stats.structured_violations += self.codes.get(SCHEMA_VIOLATION, 0)
        stats.length_cuts += self.length_cuts


class Committer:
    """Appends a shard's records to its durable log and keeps its counts, metrics and progress record."""

    def __init__(self, plan: Plan, index: int, lane: int, out: Storage, *, stats: Stats, metrics: Metrics,
                 progress: Callable[[dict[str, Any]], None], report_every: float):
        self.plan, self.index, self.lane, self.out = plan, index, lane, out
        self.names = [o.display_name for o in plan.objects]
        self.log = ShardLog(out, layout.shard_prefix(plan.round_prefix, index))
        self.stats, self.metrics, self.progress = stats, metrics, progress
        # How often the shard's live progress record is rewritten (for `kubectl get bij` ROWS
        # while a long shard runs); one small atomic write, so never more than this often.
        self.report_every = report_every
        self.last_report = self.t0 = time.monotonic()  # t0: when work on the shard began, earlier runs included

    def commit(self, records: list[dict[str, Any]], validated: int = 0, repaired: int = 0,
               length_cuts: int = 0) -> None:
        """Make records durable and count them (`validated`: structured answers among them checked valid,
        `repaired` of those only on the second grammar backend's try, `length_cuts` answers cut at their cap)."""
        if records:
            tally = Tally.of(records, self.names)
            tally.validated, tally.repaired, tally.length_cuts = validated, repaired, length_cuts
            self.commit_encoded(ShardLog.encode(records), tally)

    def commit_chunks(self, items: list[tuple[Chunk, bytes, Tally]]) -> None:
        """The commit writer's work: make finished chunks durable in one write, then report each."""
        # Before the commit: its progress record counts the chunks' bytes.
        self.stats.bytes += sum(chunk.bytes for chunk, _, _ in items)
        tally = Tally()
        for _, _, t in items:
            tally.add(t)
        self.commit_encoded(b"".join(data for _, data, _ in items), tally)
        for chunk, _, t in items:
            self.stats.chunks += 1
            self.progress({"event": "chunk", "index": self.index, "rows": t.results,
                           "errors": t.errors, "bytes": chunk.bytes})

    def commit_encoded(self, data: bytes, tally: Tally) -> None:
        """Make encoded records durable (ShardLog.encode, encode_plain_results) and count them."""
        if not data:
            return
        t = time.perf_counter()
        self.log.write(data)
        self.metrics.commit_latency.observe(time.perf_counter() - t)
        tally.add_to(self.stats)
        if time.monotonic() - self.last_report >= self.report_every:
            self.report()
        # Once per commit, not per row: each labelled increment takes a lock.
        self.metrics.rows_ok.inc(tally.results)
        self.metrics.rows_error.inc(tally.errors)
        self.metrics.rows_capped.inc(tally.capped)
        for code, n in tally.codes.items():
            self.metrics.row_errors.labels(code).inc(n)

    def report(self) -> None:
        """Rewrite the shard's progress record: live counts, and the time spent on it so far."""
        self.last_report = time.monotonic()
        record = shard_record(self.index, self.plan.round, self.lane, self.stats.as_record(),
                              time.monotonic() - self.t0, finished=False, pool=os.environ.get(POOL_ENV))
        self.out.write_bytes(layout.progress_uri(self.plan.round_prefix, self.index), encode(record))

    def count_final(self, rec: dict[str, Any]) -> None:
        """Count a record already durable (a resumed shard's log)."""
        Tally.of([rec], self.names).add_to(self.stats)
        if rec["kind"] == "result":
            usage = row_usage(rec["row"])
            self.stats.tokens_in += usage.get("prompt_tokens", 0)
            self.stats.tokens_out += usage.get("completion_tokens", 0)

    def count_tokens(self, results: list[Result]) -> None:
        """Count the tokens of the engine's answers (error rows have none)."""
        if set(map(_ERROR, results)) - {None}:
            results = [r for r in results if r.error is None]
        tokens_in = sum(filter(None, map(_PROMPT_TOKENS, results)))
        tokens_out = sum(filter(None, map(_COMPLETION_TOKENS, results)))
        self.stats.cached_tokens += sum(filter(None, map(_CACHED_TOKENS, results)))
        self.stats.tokens_in += tokens_in
        self.stats.tokens_out += tokens_out
        self.metrics.tokens_in.inc(tokens_in)
        self.metrics.tokens_out.inc(tokens_out)
