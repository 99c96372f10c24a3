"""Work one shard: resume from what is durable, stream rows through the engine, commit each chunk.

Rows stream into the engine across chunk boundaries: chunks are read ahead,
parsed (bad rows become error rows) and their token counts taken as they join
the in-flight window (`batching.inFlightRows`, default eight times what the
engine runs at once). Within the window rows run in the order that suits the
engine: a continuous-batching engine (vLLM, simulated) is kept fed step by
step, prompts sharing a prefix together; a batch engine gets token-budget
batches cut from the whole window sorted by length. Results come back in any
order; a chunk whose rows are all back goes to the commit writer, a background
thread that appends it to the shard's durable log. Chunks are committed in
input order, so the durable part of a shard is always a prefix of it and a
restarted worker continues at the cursor: at most the in-flight window and the
commit queue (`batching.commitQueueChunks`) are recomputed. A finished shard
gets a completion record; a second run of a finished shard does nothing.

Jobs with a judge run chunk by chunk (a row may need several attempts before
its chunk can commit).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from itertools import repeat
from operator import attrgetter
from typing import Any

from .batcher import PrefixShare, first_batch, plan_batches, run_order
from .commits import CommitWriter
from .contract import layout
from .contract.errors import BijError
from .contract.plan import BadPlan, Plan
from .contract.records import DamageRecord, decode_shard_record, encode, shard_record
from .engines.base import ContinuousEngine, Engine, Request, Result, is_continuous, request_text
from .images import ImageProblem, fetch_images
from .inputs import (
    InputOptions,
    Row,
    error_row,
    parquet_columns,
    parse_line,
    parse_plain_lines,
    redispatch_line,
    result_row,
    row_id,
    row_usage,
)
from .judge import Judge, Verdict, attempt_params
from .metrics import Metrics, Stats
from .parquet import is_int64
from .reader import Chunk, DamagedObject, InputProblem, Line, Prefetcher, iter_shard_blocks, prefix_digest
from .segments import ShardLog, encode_plain_results
from .storage import NotFound, Storage, StorageError, open_storage

log = logging.getLogger("bij.worker")

class BadConfig(BijError):
    """A problem no retry can fix: a missing plan, an index out of range, an unknown engine or model."""

    permanent = True


class EngineFailure(BijError):
    """The engine failed on every row of a batch, one by one: the engine is broken, not the rows."""


class StopFlag:
    """Set by SIGTERM/SIGINT: take no new chunk; finish the in-flight one if there is time."""

    def __init__(self, drain_seconds: float = 15.0):
        self.drain_seconds = drain_seconds
        self._at: float | None = None
        self.event = threading.Event()

    def request(self, drain_seconds: float | None = None) -> None:
        """Stop; with `drain_seconds`, allow at most that long for the in-flight rows (0: none)."""
        if drain_seconds is not None:
            self.drain_seconds = min(self.drain_seconds, drain_seconds)
        if self._at is None:
            self._at = time.monotonic()
        self.event.set()

    @property
    def requested(self) -> bool:
        return self._at is not None

    def drain_expired(self) -> bool:
        return self._at is not None and time.monotonic() - self._at > self.drain_seconds


def load_plan(uri: str, s3: Any) -> Plan:
    """Read a round plan (shards.json) with the job's S3 settings (see `open_storage`); a missing or
    unreadable plan is a bad configuration."""
    try:
        store = open_storage(uri, s3)
        return Plan.from_json(store.read_bytes(uri), f"round plan {uri}")
    except NotFound:
        raise BadConfig(f"round plan {uri} does not exist") from None
    except BadPlan as e:
        raise BadConfig(str(e)) from None


def run_isolating(engine: Engine, requests: list[Request]) -> list[Result]:
    """Run a batch; if it raises, split it until the failing rows are found and only they fail.

    One bad row must not cost its batch. But when every row fails on its own too,
    the engine itself is broken and the caller should fail (and be retried), not
    record a whole batch of errors.
    """
    try:
        results = engine.run(requests)
    except Exception as e:  # noqa: BLE001 - isolated below
        if len(requests) == 1:
            return [Result(error=f"engine failed on this row: {type(e).__name__}: {e}")]
        mid = len(requests) // 2
        results = run_isolating(engine, requests[:mid]) + run_isolating(engine, requests[mid:])
        if all(r.error and r.error.startswith("engine failed") for r in results):
            raise EngineFailure(f"engine fails on every row of a batch of {len(requests)}: {e}") from e
        return results
    if len(results) != len(requests):
        raise EngineFailure(f"engine returned {len(results)} results for {len(requests)} requests")
    return results


@dataclass
class ShardOutcome:
    status: str  # "done" | "stopped"
    rows: int
    errors: int


@dataclass
class _Live:
    """A row being worked on in this process: its request, its line, and its attempts so far."""

    row: Row
    line: bytes
    attempts_here: int = 0  # attempts in this round (inPlace counts these against maxAttempts)


@dataclass(slots=True)
class _Open:
    """A chunk in the in-flight window: its rows' results fill in as the engine returns them.

    The rows for the engine are columns (places, ids, requests, tokens), filled a chunk at a
    time; `rows` keeps the parsed rows only where a chunk was parsed line by line.
    """

    chunk: Chunk
    records: list[dict[str, Any]]  # rows that never reach the engine (bad input, too long)
    places: list[tuple[int, int, int]]  # the rows for the engine: their places in the input
    ids: list[Any]
    requests: list[Request]
    results: list[Result | None]
    left: int  # rows still out
    rows: list[Row] | None = None  # the parsed rows, when the chunk was parsed line by line
    tokens: list[int] = field(default_factory=list)  # prompt tokens, once counted
    truncated: set[int] = field(default_factory=set)  # rows whose prompt the engine cuts to the limit
    final: bytes | None = None  # the chunk's log lines, once every row is back
    tally: _Tally | None = None  # what the final records add to the shard's counts


@dataclass(slots=True)
class _Tally:
    """What committed records add to the shard's counts."""

    results: int = 0
    errors: int = 0
    rejected: int = 0
    capped: int = 0
    truncated: int = 0
    int_ids: int = 0
    str_ids: int = 0
    codes: dict[str, int] = field(default_factory=dict)  # error rows by code

    @classmethod
    def of(cls, records: list[dict[str, Any]]) -> _Tally:
        t = cls()
        for rec in records:
            kind = rec["kind"]
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

    def add(self, other: _Tally) -> None:
        self.results += other.results
        self.errors += other.errors
        self.rejected += other.rejected
        self.capped += other.capped
        self.truncated += other.truncated
        self.int_ids += other.int_ids
        self.str_ids += other.str_ids
        for code, n in other.codes.items():
            self.codes[code] = self.codes.get(code, 0) + n

    def add_to(self, stats: Stats) -> None:
        """Count these records into a shard's statistics."""
        stats.rows += self.results
        stats.errors += self.errors
        stats.rejected += self.rejected
        stats.capped += self.capped
        stats.truncated += self.truncated
        stats.int_ids += self.int_ids
        stats.str_ids += self.str_ids


_ERROR = attrgetter("error")
_PROMPT_TOKENS = attrgetter("prompt_tokens")
_CACHED_TOKENS = attrgetter("cached_tokens")
_COMPLETION_TOKENS = attrgetter("completion_tokens")


# Padding a batch engine may waste before a batch is cut short (see batcher.plan_batches).
MAX_PADDING_WASTE = 0.2


def batch_shape(engine: Engine) -> tuple[int, int]:
    """(maxBatchSize, targetBatchTokens) the engine prefers on its device, when the spec leaves them out."""
    shape = getattr(engine, "batch_shape", None)
    return shape() if callable(shape) else (256, 32000)


class ShardWorker:
    """Runs one shard of a round plan with an already loaded engine."""

    def __init__(
        self,
        plan: Plan,
        index: int,
        engine: Engine,
        *,
        metrics: Metrics | None = None,
        stop: StopFlag | None = None,
        progress: Callable[[dict[str, Any]], None] | None = None,
        stats: Stats | None = None,
        lane: int | None = None,
    ):
        shards = plan.shards
        if not 0 <= index < len(shards):
            raise BadConfig(f"shard index {index} is out of range: the round has {len(shards)} shards")
        self.plan, self.index, self.engine = plan, index, engine
        self.lane = index if lane is None else lane
        self.round = plan.round
        self.pieces = shards[index]
        self.objects = plan.objects
        self.names = [o.display_name for o in self.objects]
        spec = plan.spec
        self.spec = spec
        self.opts = InputOptions.from_spec(spec, engine.name, engine.honours)
        batching = spec.batching
        default_batch, default_tokens = batch_shape(engine)
        self.target_tokens = batching.target_batch_tokens or default_tokens
        self.max_batch = batching.max_batch_size or default_batch
        self.sort = batching.sort_by_length
        self.prefix_order = batching.prefix_order
        self.depth = batching.prefetch_chunks
        self.chunk_rows = spec.sharding.chunk_rows
        self.window = batching.in_flight_rows or self.default_window()
        self.commit_slots = batching.commit_queue_chunks
        self.max_line = spec.input.max_line_bytes
        self.on_damaged = spec.input.on_damaged_object
        self.max_tokens = spec.model.max_input_tokens
        self.s3 = spec.storage.s3
        self.judge = Judge(spec.judge) if spec.judge else None
        mode = plan.mode
        self.in_place = bool(self.judge) and mode.mode == "inPlace"
        self.final_round = mode.final
        self.max_attempts = spec.judge.max_attempts if spec.judge else 1
        self.metrics = metrics or Metrics()
        self.stop = stop or StopFlag()
        self.progress = progress or (lambda event: None)
        self.stats = stats or Stats()
        # How often the shard's live progress record is rewritten (for `kubectl get bij` ROWS
        # while a long shard runs); one small atomic write, so never more than this often.
        self.report_every = float(os.environ.get("BIJ_PROGRESS_SECONDS", "30"))
        self._last_report = self._t0 = time.monotonic()
        self._stores: dict[str, Storage] = {}
        self.out = self.storage_for(plan.round_prefix)
        self.log = ShardLog(self.out, layout.shard_prefix(plan.round_prefix, index))
        # Called once when every row of the shard is in a continuous engine (see bij_worker.lanes).
        self.on_tail: Callable[[], None] | None = None

    def default_window(self) -> int:
        """Eight times what the engine runs at once, and never less than two chunks.

        Chunks commit in input order, so the window also holds rows that finished while an
        earlier chunk's longest row still runs; with twice the batch (what vLLM's run_batch
        keeps in flight) the batch ran half empty on mixed lengths, with eight times full.
        """
        engine = self.engine
        running = engine.concurrency() if is_continuous(engine) else self.max_batch  # type: ignore[attr-defined]
        return max(8 * running, 2 * self.chunk_rows)

    def storage_for(self, uri: str) -> Storage:
        scheme = uri.split("://", 1)[0]
        if scheme not in self._stores:
            self._stores[scheme] = open_storage(uri, self.s3)
        return self._stores[scheme]

    def object_name(self, obj: int) -> str:
        return self.names[obj]

    def token_limit(self) -> int | None:
        limits = [x for x in (self.max_tokens, self.engine.max_input_tokens()) if x]
        return min(limits) if limits else None

    def run(self) -> ShardOutcome:
        """Work the shard to its end, or until asked to stop."""
        t0 = self._t0 = time.monotonic()
        done_at = layout.done_uri(self.plan.round_prefix, self.index)
        if self.out.exists(done_at):
            done = decode_shard_record(self.out.read_bytes(done_at), f"completion record {done_at}")
            self.progress({"event": "done", "index": self.index, "rows": done["rows"], "errors": done["errors"]})
            return ShardOutcome("done", done["rows"], done["errors"])
        # Time earlier runs of this shard spent (a preempted pod's last progress record) counts
        # towards this shard's worker seconds, so a job's cost includes the work it lost.
        try:
            before = decode_shard_record(self.out.read_bytes(layout.progress_uri(self.plan.round_prefix, self.index)))
            t0 = self._t0 = t0 - float(before.get("seconds") or 0)
            self.stats.model_load_s += float(before.get("modelLoadSeconds") or 0)
            self.stats.model_loads += int(before.get("modelLoads") or 0)
        except (NotFound, ValueError):
            pass
        # Stream the durable log: resuming a long shard must not hold its records in memory.
        resumed_bytes = records = 0
        attempts: dict[tuple[int, int], dict[str, Any]] = {}  # rows between attempts, by place
        # Rows with a final record: another writer's log may list a row's attempts after it.
        finals: set[tuple[int, int]] = set()
        for rec in self.log.scan():
            records += 1
            place = (rec["at"][0], rec["at"][1])
            if rec["kind"] == "attempt":
                if place not in finals and (place not in attempts or rec["attempt"] > attempts[place]["attempt"]):
                    attempts[place] = rec
                continue
            if self.in_place:
                finals.add(place)
                attempts.pop(place, None)
            resumed_bytes += rec["at"][2] - rec["at"][1]
            self._count_final(rec)
        state = self.log.state
        # Rows between attempts when the worker stopped: continue them at their next attempt.
        pending = [rec for _, rec in sorted(attempts.items())]
        resumed_bytes += sum(rec["at"][2] - rec["at"][1] for rec in pending)
        if records:
            log.info("shard %d: resuming after %d durable records (%d rows between attempts, %d torn bytes skipped)",
                     self.index, records, len(pending), state.torn_bytes)
        self.stats.bytes = resumed_bytes
        self.progress({"event": "resume", "index": self.index, "rows": self.stats.rows,
                       "errors": self.stats.errors, "bytes": resumed_bytes})
        if pending and not self._resume_attempts(pending):
            return self._stopped()

        blocks = iter_shard_blocks(self.storage_for, self.objects, self.pieces, state.cursor,
                                   parquet_columns(self.opts), self.max_line, on_damaged=self.on_damaged)
        # Engines whose compute lets go of the interpreter (torch, vLLM) get the next chunks parsed in
        # the reader thread meanwhile; for the others it would only take turns with them.
        parse = self._parse if self.judge is None and getattr(self.engine, "parallel_prepare", False) else None
        prefetch = Prefetcher(blocks, self.chunk_rows, self.depth, prepare=parse, blocks=True)
        self.metrics.engine_stopped()
        steps0, occupied0 = getattr(self.engine, "steps", 0), getattr(self.engine, "occupied", 0)
        try:
            finished = self._by_chunk(prefetch) if self.judge is not None else self._stream(prefetch)
        finally:
            prefetch.close()
            steps = getattr(self.engine, "steps", 0) - steps0
            if steps:
                self.stats.engine_steps += steps
                self.stats.occupied += getattr(self.engine, "occupied", 0) - occupied0
                self.stats.max_num_seqs = self.engine.concurrency()  # type: ignore[attr-defined]
        if not finished:
            return self._stopped()
        if prefetch.damaged is not None:
            # Every row before the break is durable now; the round fails here, naming the object.
            self._damaged(prefetch.damaged)
        self._finish(t0)
        return ShardOutcome("done", self.stats.rows, self.stats.errors)

    def _damaged(self, e: DamagedObject) -> None:
        """input.onDamagedObject fail: record the damaged object and where it breaks (with the sha256 of
        the bytes before, which a replacement must begin with), and fail with `e`."""
        info = self.objects[e.obj]
        digest = prefix_digest(self.storage_for(info.uri), info.uri, e.offset, info.version) or ""
        self._record_damage(DamageRecord(self.index, e.obj, info.display_name, info.version, e.offset, digest,
                                         e.reason, "fail"))
        self._stopped()
        raise e

    def _record_damage(self, rec: DamageRecord) -> None:
        log.warning("shard %d: input object %s; %s", self.index, rec.describe(),
                    "the rows before it are durable: replace the object and run again, or set "
                    "spec.input.onDamagedObject: errorRow" if rec.mode == "fail" else
                    "the rest of it is one corrupt_input error row (spec.input.onDamagedObject: errorRow)")
        self.out.write_bytes(layout.damaged_uri(self.plan.round_prefix, self.index), rec.to_json())

    def _stopped(self) -> ShardOutcome:
        """Stopped before the end: the time spent so far goes into the progress record for the next run."""
        try:
            self._report()
        except StorageError as e:  # a clean stop stays a clean stop; only the time is not carried over
            log.warning("shard %d: cannot write the progress record: %s", self.index, e)
        return ShardOutcome("stopped", self.stats.rows, self.stats.errors)

    def _by_chunk(self, prefetch: Prefetcher) -> bool:
        """One chunk at a time, every attempt committed before the next chunk (judge jobs)."""
        for chunk in prefetch:
            self.metrics.queue_depth.set(prefetch.depth())
            if self.stop.requested:
                return False
            rows_before, errors_before = self.stats.rows, self.stats.errors
            if not self._work_chunk(chunk.lines):
                # Asked to stop and out of time: what was not committed is dropped whole.
                return False
            self.stats.chunks += 1
            self.stats.bytes += chunk.bytes
            self.progress({"event": "chunk", "index": self.index, "rows": self.stats.rows - rows_before,
                           "errors": self.stats.errors - errors_before, "bytes": chunk.bytes})
        return True

    def _stream(self, prefetch: Prefetcher) -> bool:
        """Stream rows through the engine across chunks; True when the shard's rows are all durable.

        Chunks join the window while it has room and leave it, in input order, as soon as
        all their rows are back: to the commit writer, which compute waits for only when its
        queue is full. After a stop request no chunk joins; rows in the window still run
        until the drain time is over, and whole chunks that finish are committed.
        """
        engine = self.engine
        continuous = is_continuous(engine)
        writer = CommitWriter(self._commit_chunks, self.commit_slots)
        opened: deque[_Open] = deque()
        pending: list[tuple[_Open, int]] = []  # rows in the window not yet given to the engine
        pending_tokens: list[int] = []  # their prompt tokens, in the same order
        taken = 0  # how many of `pending` went to the engine since it was last ordered
        tags: dict[int, tuple[_Open, int]] = {}
        next_tag = 0
        open_rows = 0
        share = PrefixShare()
        try:
            while True:
                writer.check()
                if self.stop.drain_expired():
                    return False
                # Fill the window with whole chunks (the reader keeps `prefetchChunks` ready, so this
                # waits only when reading is slower than the engine, which then starves anyway).
                joined = False
                while not prefetch.finished and not self.stop.requested and (
                        not opened or open_rows + self.chunk_rows <= self.window):
                    item = prefetch.next_chunk()
                    self.metrics.queue_depth.set(prefetch.depth())
                    if item is None:
                        break
                    op = self._count(item if isinstance(item, _Open) else self._parse(item))
                    opened.append(op)
                    open_rows += len(op.chunk.places)
                    if op.left == len(op.results):  # every row goes to the engine
                        pending.extend(zip(repeat(op), range(op.left)))
                        pending_tokens.extend(op.tokens)
                    else:
                        todo = [i for i, res in enumerate(op.results) if res is None]
                        pending.extend(zip(repeat(op), todo))
                        pending_tokens.extend(op.tokens[i] for i in todo)
                    joined = True
                # Chunks whose rows are all back leave the window, in input order, for the commit
                # writer; with its queue full they wait in the window while the engine has work.
                while opened and opened[0].left == 0:
                    op = opened[0]
                    if op.final is None:
                        self._count_tokens(op.results)  # type: ignore[arg-type]
                        op.final, op.tally = self._encode_chunk(op)
                    idle = taken >= len(pending) and not (continuous and engine.unfinished())  # type: ignore[attr-defined]
                    if not writer.put((op.chunk, op.final, op.tally), block=idle):
                        break
                    opened.popleft()
                    open_rows -= len(op.chunk.places)
                if not opened:
                    if prefetch.finished or self.stop.requested:
                        break
                    continue  # the window has room again
                if joined:
                    pending, pending_tokens = pending[taken:], pending_tokens[taken:]
                    taken = 0
                    by_prefix = self.prefix_order and continuous
                    texts = [request_text(op.requests[i]) for op, i in pending] if by_prefix else []
                    order = run_order(texts, pending_tokens, by_prefix=by_prefix, by_length=self.sort)
                    pending = list(map(pending.__getitem__, order))
                    pending_tokens = list(map(pending_tokens.__getitem__, order))
                if continuous:
                    # Keep the engine's own queue short: rows wait here, in window order, so that
                    # a chunk that joins later can still run before them where that is better.
                    most = engine.concurrency()  # type: ignore[attr-defined]
                    room = most + max(1, most // 8) - engine.unfinished()  # type: ignore[attr-defined]
                    while room > 0 and taken < len(pending):
                        op, i = pending[taken]
                        taken += 1
                        req = op.requests[i]
                        share.add(request_text(req))
                        try:
                            engine.submit(next_tag, req)  # type: ignore[attr-defined]
                        except ValueError as e:
                            self._place(op, i, Result(error=f"the engine rejected the request: {e}"))
                            continue
                        tags[next_tag] = (op, i)
                        next_tag += 1
                        room -= 1
                    if prefetch.finished and taken >= len(pending) and self.on_tail is not None:
                        # Every row is in the engine: only the shard's tail runs. The lane may start
                        # its next shard now, so the engine does not drain between them.
                        self.on_tail()
                        self.on_tail = None
                    if engine.unfinished():  # type: ignore[attr-defined]
                        for tag, res in self._step(engine):  # type: ignore[arg-type]
                            op, i = tags.pop(tag)
                            self._place(op, i, res)
                elif taken < len(pending):
                    k = first_batch(itertools.islice(pending_tokens, taken, taken + self.max_batch),
                                    self.target_tokens, self.max_batch, MAX_PADDING_WASTE if self.sort else None)
                    items = pending[taken:taken + k]
                    tokens = pending_tokens[taken:taken + k]
                    taken += k
                    # No prefix share here: a batch engine has no prefix cache to reuse it.
                    out = self._run_batch([op.requests[i] for op, i in items], tokens)
                    for (op, i), res in zip(items, out, strict=True):
                        op.results[i] = res
                        op.left -= 1
        finally:
            self.stats.prefix_shared_chars += share.shared
            self.stats.prompt_chars += share.total
            writer.close()
        return prefetch.finished

    def _step(self, engine: ContinuousEngine) -> list[tuple[int, Result]]:
        self.metrics.engine_started()
        started = time.perf_counter()
        done = engine.step()
        busy = time.perf_counter() - started
        self.metrics.engine_stopped()
        self.metrics.engine_busy.inc(busy)
        self.stats.engine_busy_s += busy
        self.stats.engine_calls += len(done)
        return done

    def _run_batch(self, requests: list[Request], tokens: list[int]) -> list[Result]:
        self.metrics.engine_started()
        started = time.perf_counter()
        out = run_isolating(self.engine, requests)
        busy = time.perf_counter() - started
        self.metrics.engine_stopped()
        self.metrics.engine_busy.inc(busy)
        self.stats.engine_busy_s += busy
        self.stats.batches += 1
        self.stats.engine_calls += len(requests)
        self.metrics.batch_size.observe(len(requests))
        self.metrics.batch_tokens.observe(len(requests) * max(tokens))
        return out

    @staticmethod
    def _place(op: _Open, i: int, res: Result) -> None:
        op.results[i] = res
        op.left -= 1

    def _parse(self, chunk: Chunk) -> _Open:
        """Parse a chunk's lines (in the reader thread or this one); bad rows are settled here.

        A chunk of plain good rows (the common case) is parsed in one pass over its lines
        (parse_plain_lines); any other chunk line by line, where every bad row becomes its
        error row.
        """
        if set(map(type, chunk.data)) == {bytes}:
            parsed = parse_plain_lines(chunk.data, self.opts)  # type: ignore[arg-type]
            if parsed is not None:
                ids, requests = parsed
                return _Open(chunk, [], chunk.places, ids, requests, [None] * len(ids), len(ids))
        names = self.names
        records: list[dict[str, Any]] = []
        rows: list[Row] = []
        for at, line in chunk.lines:
            if isinstance(line, InputProblem):  # an over-long line, a cut .zst: an error row in its place
                records.append(self._error_record(Row(at=at, id=None, error_code=line.code, error=line.message)))
                if line.code == "corrupt_input":
                    info = self.objects[at[0]]
                    self._record_damage(DamageRecord(self.index, at[0], info.display_name, info.version, at[1], "",
                                                     line.message, "errorRow"))
                continue
            row = self._prepare(line, at, names[at[0]])
            if row.request is None:
                records.append(self._error_record(row))
            else:
                rows.append(row)
        return _Open(chunk, records, [r.at for r in rows], [r.id for r in rows],
                     [r.request for r in rows], [None] * len(rows), len(rows), rows)  # type: ignore[misc]

    def _prepare(self, line: bytes, at: tuple[int, int, int], object_name: str) -> Row:
        """One line as a row to run (its images fetched) or an error row: what every path does with a line."""
        row = parse_line(line, at, object_name, self.opts)
        req = row.request
        if req is not None and req.images:
            try:
                req.images = fetch_images(req.images, self.storage_for, self.opts.max_image_bytes)
            except ImageProblem as e:
                row.request, row.error_code, row.error = None, e.code, str(e)
        return row

    def _count(self, op: _Open) -> _Open:
        """Count the prompts' tokens (the engine's tokenizer, in this thread); too long rows are settled."""
        if not op.requests:
            return op
        op.tokens = tokens = self.engine.count_tokens(op.requests)
        limit = self.token_limit()
        if limit and max(tokens) > limit:
            for i, t in enumerate(tokens):
                if t <= limit:
                    continue
                if self.opts.truncate:  # the engine cuts the prompt to the limit (it was told to)
                    tokens[i] = limit
                    op.truncated.add(i)
                    if op.rows is not None:
                        op.rows[i].truncated = True
                    continue
                op.results[i] = Result(error=f"prompt has {t} tokens, the model takes at most {limit}",
                                       extra={"code": "too_many_tokens"})
                op.left -= 1
        return op

    def _encode_chunk(self, op: _Open) -> tuple[bytes, _Tally]:
        """The chunk's log lines once every row is back, and what they add to the counts.

        A chunk parsed in one pass whose results all have the common shape is encoded in one
        pass too (encode_plain_results) and counted in bulk; any other builds its records.
        """
        results: list[Result] = op.results  # type: ignore[assignment]
        if op.rows is None and not op.truncated and set(map(_ERROR, results)) == {None}:
            data = encode_plain_results(op.places, op.ids, results)
            if data is not None:
                tally = _Tally(results=len(results))
                if set(map(type, op.ids)) == {str}:
                    tally.str_ids = len(results)
                else:
                    tally.int_ids = sum(map(is_int64, op.ids))
                    tally.str_ids = len(results) - tally.int_ids
                return data, tally
        rows = op.rows if op.rows is not None else [
            Row(at=at, id=rid, request=req, truncated=i in op.truncated)
            for i, (at, rid, req) in enumerate(zip(op.places, op.ids, op.requests, strict=True))]
        records = op.records
        opts = self.opts
        for row, res in zip(rows, results, strict=True):
            if res.error is not None:
                row.error_code, row.error = res.extra.get("code", "engine_error"), res.error
                records.append(self._error_record(row))
            else:
                records.append({"at": list(row.at), "kind": "result", "row": result_row(row, res, opts)})
        return ShardLog.encode(records), _Tally.of(records)

    def _commit_chunks(self, items: list[tuple[Chunk, bytes, _Tally]]) -> None:
        """The commit writer's work: make finished chunks durable in one write, then report each."""
        # Before the commit: its progress record counts the chunks' bytes.
        self.stats.bytes += sum(chunk.bytes for chunk, _, _ in items)
        tally = _Tally()
        for _, _, t in items:
            tally.add(t)
        self._commit_encoded(b"".join(data for _, data, _ in items), tally)
        for chunk, _, t in items:
            self.stats.chunks += 1
            self.progress({"event": "chunk", "index": self.index, "rows": t.results,
                           "errors": t.errors, "bytes": chunk.bytes})

    def _finish(self, t0: float) -> None:
        if self.judge is not None:
            # The next round's input: every row this shard rejected, with its id and history.
            lines = [rec["line"] for rec in sorted(self.log.read().records,
                                                   key=lambda r: (r["at"][0], r["at"][1]))
                     if rec["kind"] == "rejected"]
            uri = layout.rejected_uri(self.plan.round_prefix, self.index)
            if lines:
                self.out.write_bytes(uri, ("\n".join(lines) + "\n").encode())
        record = shard_record(self.index, self.round, self.lane, self.stats.as_record(), time.monotonic() - t0,
                              finished=True)
        self.out.write_bytes(layout.done_uri(self.plan.round_prefix, self.index), encode(record))
        if any(self.objects[obj].prefix is not None for obj, _, _ in self.pieces):
            # A damaged object of this shard was replaced and read to its end: nothing is damaged now.
            self.out.delete(layout.damaged_uri(self.plan.round_prefix, self.index))
        self.progress({"event": "done", "index": self.index, "rows": self.stats.rows, "errors": self.stats.errors})

    def _count_final(self, rec: dict[str, Any]) -> None:
        _Tally.of([rec]).add_to(self.stats)
        if rec["kind"] == "result":
            usage = row_usage(rec["row"])
            self.stats.tokens_in += usage.get("prompt_tokens", 0)
            self.stats.tokens_out += usage.get("completion_tokens", 0)

    def _resume_attempts(self, pending: list[dict[str, Any]]) -> bool:
        live = []
        for rec in pending:
            line = rec["line"].encode()
            row = self._prepare(line, tuple(rec["at"]), self.object_name(rec["at"][0]))  # type: ignore[arg-type]
            row.id = rec["id"]
            # "attempts" counts every attempt so far, earlier rounds included.
            row.prior_attempts = int(rec["attempts"]) - int(rec["attemptsHere"])
            row.verdicts = list(rec.get("verdicts", []))
            live.append(_Live(row, line, attempts_here=int(rec["attemptsHere"])))
        return self._attempt_loop(live, [])

    def _work_chunk(self, lines: list[Line]) -> bool:
        """Parse, run and commit one chunk. False when stopped before the chunk was committed.

        Ids repeated within or across shards are found at publish, which sees every shard
        in input order: a set of every id here would grow with the shard.
        """
        names = self.names
        records: list[dict[str, Any]] = []
        live = []
        for at, line in lines:
            if isinstance(line, InputProblem):
                records.append(self._error_record(Row(at=at, id=None, error_code=line.code, error=line.message)))
                continue
            row = self._prepare(line, at, names[at[0]])
            if row.request is None:
                records.append(self._error_record(row))
            else:
                live.append(_Live(row, line))
        return self._attempt_loop(live, records)

    def _error_record(self, row: Row) -> dict[str, Any]:
        return {"at": list(row.at), "kind": "error", "row": error_row(row, self.object_name(row.at[0]), self.opts)}

    def _attempt_loop(self, live: list[_Live], records: list[dict[str, Any]]) -> bool:
        """Run rows until each is final; with inPlace judging, commit every attempt as it completes."""
        while live:
            results = self._run_engine(live)
            if results is None:
                return False
            retry: list[_Live] = []
            self._count_tokens(results)
            verdicts = self._verdicts(live, results)
            for item, res, verdict in zip(live, results, verdicts, strict=True):
                row = item.row
                if res.error is not None:
                    row.error_code, row.error = res.extra.get("code", "engine_error"), res.error
                    records.append(self._error_record(row))
                    continue
                if verdict is None or verdict.approved:
                    out = result_row(row, res, self.opts)
                    if self.judge is not None:
                        out["attempts"] = row.prior_attempts + item.attempts_here + 1
                        out["round"] = self.round
                    records.append({"at": list(row.at), "kind": "result", "row": out})
                    continue
                item.attempts_here += 1
                row.verdicts.append(verdict.reason)
                total = row.prior_attempts + item.attempts_here
                if self.in_place and item.attempts_here < self.max_attempts:
                    records.append({"at": list(row.at), "kind": "attempt", "attempt": total, "id": row.id,
                                    "attempts": total, "attemptsHere": item.attempts_here,
                                    "line": item.line.decode("utf-8", "replace"), "output": res.output,
                                    "verdicts": row.verdicts})
                    retry.append(item)
                elif not self.final_round:
                    records.append({"at": list(row.at), "kind": "rejected", "row": {"id": row.id},
                                    "line": redispatch_line(item.line, row, total, row.verdicts, res.output)})
                else:
                    records.append({"at": list(row.at), "kind": "capped",
                                    "row": self._capped_row(row, total, res.output)})
            self._commit(records)
            records = []
            live = retry
        self._commit(records)
        return True

    def _capped_row(self, row: Row, attempts: int, output: str | None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": row.id, "output": output, "attempts": attempts, "round": self.round,
                               "verdicts": row.verdicts,
                               "error": {"code": "retry_cap_reached",
                                         "message": f"still rejected after {attempts} attempts"}}
        if self.opts.format == "openai":
            out["custom_id"] = row.id
        return out

    def _commit(self, records: list[dict[str, Any]]) -> None:
        """Make records durable and count them."""
        if records:
            self._commit_encoded(ShardLog.encode(records), _Tally.of(records))

    def _commit_encoded(self, data: bytes, tally: _Tally) -> None:
        """Make encoded records durable (ShardLog.encode, encode_plain_results) and count them."""
        if not data:
            return
        t = time.perf_counter()
        self.log.write(data)
        self.metrics.commit_latency.observe(time.perf_counter() - t)
        tally.add_to(self.stats)
        if time.monotonic() - self._last_report >= self.report_every:
            self._report()
        # Once per commit, not per row: each labelled increment takes a lock.
        self.metrics.rows_ok.inc(tally.results)
        self.metrics.rows_error.inc(tally.errors)
        self.metrics.rows_capped.inc(tally.capped)
        for code, n in tally.codes.items():
            self.metrics.row_errors.labels(code).inc(n)

    def _report(self) -> None:
        """Rewrite the shard's progress record: live counts, and the time spent on it so far."""
        self._last_report = time.monotonic()
        record = shard_record(self.index, self.round, self.lane, self.stats.as_record(),
                              time.monotonic() - self._t0, finished=False)
        self.out.write_bytes(layout.progress_uri(self.plan.round_prefix, self.index), encode(record))

    def _count_tokens(self, results: list[Result]) -> None:
        if set(map(_ERROR, results)) - {None}:
            results = [r for r in results if r.error is None]
        tokens_in = sum(filter(None, map(_PROMPT_TOKENS, results)))
        tokens_out = sum(filter(None, map(_COMPLETION_TOKENS, results)))
        self.stats.cached_tokens += sum(filter(None, map(_CACHED_TOKENS, results)))
        self.stats.tokens_in += tokens_in
        self.stats.tokens_out += tokens_out
        self.metrics.tokens_in.inc(tokens_in)
        self.metrics.tokens_out.inc(tokens_out)

    def _verdicts(self, live: list[_Live], results: list[Result]) -> list[Verdict | None]:
        if self.judge is None:
            return [None] * len(live)
        idx = [i for i, r in enumerate(results) if r.error is None]
        verdicts: list[Verdict | None] = [None] * len(live)
        if idx:
            reqs: list[Request] = [live[i].row.request for i in idx]  # type: ignore[misc]
            outs = [str(results[i].output) if results[i].output is not None
                    else json.dumps(results[i].embedding) for i in idx]
            t = time.perf_counter()
            got = self.judge.judge(reqs, outs, self.engine)
            self.stats.engine_busy_s += time.perf_counter() - t if self.judge.type == "llm" else 0.0
            for i, v in zip(idx, got, strict=True):
                verdicts[i] = v
        self.stats.judge_calls = self.judge.engine_calls
        return verdicts

    def _run_engine(self, live: list[_Live]) -> list[Result] | None:
        """Results for live rows in their order; None when stopped mid-way (nothing is kept)."""
        requests: list[Request] = []
        for item in live:
            req = item.row.request
            assert req is not None
            attempt = item.row.prior_attempts + item.attempts_here
            if attempt:
                temperature, seed = attempt_params(req.temperature, req.seed, attempt)
                req = replace(req, temperature=temperature, seed=seed)
            requests.append(req)
        tokens = self.engine.count_tokens(requests)
        limit = self.token_limit()
        results: list[Result | None] = [None] * len(live)
        todo = list(range(len(live)))
        if limit:
            for i, t in enumerate(tokens):
                if t <= limit:
                    continue
                if self.opts.truncate:  # the engine cuts the prompt to the limit (it was told to)
                    live[i].row.truncated = True
                    tokens[i] = limit
                else:
                    results[i] = Result(error=f"prompt has {t} tokens, the model takes at most {limit}",
                                        extra={"code": "too_many_tokens"})
            todo = [i for i in todo if results[i] is None]
        if todo:
            todo_tokens = [tokens[i] for i in todo]
            if self.engine.schedules_itself:
                batches = [list(range(len(todo)))]
            else:
                batches = plan_batches(todo_tokens, self.target_tokens, self.max_batch, self.sort)
            for batch in batches:
                if self.stop.drain_expired():
                    return None
                out = self._run_batch([requests[todo[j]] for j in batch], [todo_tokens[j] for j in batch])
                for j, res in zip(batch, out, strict=True):
                    results[todo[j]] = res
        final = [r for r in results if r is not None]
        assert len(final) == len(live)
        return final
