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

`ShardWorker` holds the shard's lifecycle (resume, finish, damaged input); the parts it wires
together each have a module: row preparation (`prepare.Preparer`), the two schedulers
(`schedulers.StreamScheduler`, `schedulers.JudgeLoop`) and the committer (`committer.Committer`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bij.contract import layout
from bij.contract.codes import POOL_ENV
from bij.contract.errors import BijError
from bij.contract.plan import BadPlan, Plan
from bij.contract.records import DamageRecord, decode_shard_record, encode, shard_record
from bij.engines.base import Engine, is_continuous
from bij.storage import NotFound, Storage, StorageError, open_storage
from bij.worker.committer import Committer
from bij.worker.input_row import InputOptions, parquet_columns
from bij.worker.judge import Judge
from bij.worker.metrics import Metrics, Stats
from bij.worker.prepare import Preparer
from bij.worker.reader import DamagedObject, Prefetcher, iter_shard_blocks, prefix_digest
from bij.worker.schedulers import (
    MAX_PADDING_WASTE,
    Batching,
    EngineCalls,
    EngineFailure,
    JudgeLoop,
    StreamScheduler,
    run_isolating,
)
from bij.worker.stopflag import StopFlag

__all__ = ["BadConfig", "EngineFailure", "ShardOutcome", "ShardWorker", "StopFlag", "load_plan", "run_isolating"]

log = logging.getLogger("bij.worker")


class BadConfig(BijError):
    """A problem no retry can fix: a missing plan, an index out of range, an unknown engine or model."""

    permanent = True


def load_plan(uri: str, s3: Any) -> Plan:
    """Read a round plan (shards.json) with the job's S3 settings (see `open_storage`); a missing or
    unreadable plan is a bad configuration."""
    try:
        store = open_storage(uri, s3)
        # A plan written in parts: a lane reads only the parts of the shards it works.
        return Plan.from_json(store.read_bytes(uri), f"round plan {uri}").with_reader(store.read_bytes)
    except NotFound:
        raise BadConfig(f"round plan {uri} does not exist") from None
    except BadPlan as e:
        raise BadConfig(str(e)) from None


@dataclass
class ShardOutcome:
    status: str  # "done" | "stopped"
    rows: int
    errors: int


def batch_shape(engine: Engine) -> tuple[int, int]:
    """(maxBatchSize, targetBatchTokens) the engine prefers on its device, when the spec leaves them out."""
    return engine.batch_shape() or (256, 32000)


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
        if not 0 <= index < plan.shard_total:
            raise BadConfig(f"shard index {index} is out of range: the round has {plan.shard_total} shards")
        self.plan, self.index, self.engine = plan, index, engine
        self.lane = index if lane is None else lane
        self.round = plan.round
        try:
            self.pieces = plan.pieces(index)
        except NotFound as e:
            raise BadConfig(f"round plan {plan.round_prefix}: a part is missing: {e}") from None
        except BadPlan as e:
            raise BadConfig(str(e)) from None
        self.objects = plan.objects
        self.names = [o.display_name for o in self.objects]
        spec = plan.spec
        self.spec = spec
        self.opts = InputOptions.from_spec(spec, engine.name, engine.honours, round_no=plan.round)
        batching = spec.batching
        default_batch, default_tokens = batch_shape(engine)
        self.max_batch = batching.max_batch_size or default_batch
        self.chunk_rows = spec.sharding.chunk_rows
        self.batching = Batching(
            target_tokens=batching.target_batch_tokens or default_tokens, max_batch=self.max_batch,
            sort=batching.sort_by_length, prefix_order=batching.prefix_order, chunk_rows=self.chunk_rows,
            padding_waste=MAX_PADDING_WASTE if spec.model.task == "embed" else None,
            window=batching.in_flight_rows or self.default_window(), commit_slots=batching.commit_queue_chunks)
        self.depth = batching.prefetch_chunks
        self.max_line = spec.input.max_line_bytes
        self.on_damaged = spec.input.on_damaged_object
        self.s3 = spec.storage.s3
        self.judge = Judge(spec.judge) if spec.judge else None
        mode = plan.mode
        self.in_place = bool(self.judge) and mode.mode == "inPlace"
        self.metrics = metrics or Metrics()
        self.stop = stop or StopFlag()
        self.progress = progress or (lambda event: None)
        self.stats = stats or Stats()
        self._stores: dict[str, Storage] = {}
        self.out = self.storage_for(plan.round_prefix)
        self.prep = Preparer(self.opts, engine, self.names, max_input_tokens=spec.model.max_input_tokens,
                             storage_for=self.storage_for, corrupt=self._corrupt)
        self.committer = Committer(plan, index, self.lane, self.out, stats=self.stats, metrics=self.metrics,
                                   progress=self.progress,
                                   report_every=float(os.environ.get("BIJ_PROGRESS_SECONDS", "30")))
        self.log = self.committer.log
        self.calls = EngineCalls(engine, self.metrics, self.stats)
        # Called once when every row of the shard is in a continuous engine (see bij.worker.lanes).
        self.on_tail: Callable[[], None] | None = None

    def default_window(self) -> int:
        """Eight times what the engine runs at once, and never less than two chunks.

        Chunks commit in input order, so the window also holds rows that finished while an
        earlier chunk's longest row still runs; with twice the batch (what vLLM's run_batch
        keeps in flight) the batch ran half empty on mixed lengths, with eight times full.
        """
        engine = self.engine
        running = engine.concurrency() if is_continuous(engine) else self.max_batch
        return max(8 * running, 2 * self.chunk_rows)

    def storage_for(self, uri: str) -> Storage:
        scheme = uri.split("://", 1)[0]
        if scheme not in self._stores:
            self._stores[scheme] = open_storage(uri, self.s3)
        return self._stores[scheme]

    def object_name(self, obj: int) -> str:
        return self.names[obj]

    def token_limit(self) -> int | None:
        return self.prep.token_limit()

    def run(self) -> ShardOutcome:
        """Work the shard to its end, or until asked to stop."""
        self.committer.t0 = time.monotonic()
        done = self._done_before()
        if done is not None:
            return done
        self._carry_earlier_runs()
        t0 = self.committer.t0
        pending = self._resume_log()
        state = self.log.state
        attempts_loop = self._judge_loop()
        if pending and not attempts_loop.resume(pending):
            return self._stopped()
        blocks = iter_shard_blocks(self.storage_for, self.objects, self.pieces, state.cursor,
                                   parquet_columns(self.opts), self.max_line, on_damaged=self.on_damaged)
        # Engines whose compute lets go of the interpreter (torch, vLLM) get the next chunks parsed in
        # the reader thread meanwhile; for the others it would only take turns with them.
        parse = self.prep.parse if self.judge is None and self.engine.parallel_prepare else None
        prefetch = Prefetcher(blocks, self.chunk_rows, self.depth, prepare=parse, blocks=True)
        if not self._work(prefetch, attempts_loop):
            return self._stopped()
        if prefetch.damaged is not None:
            # Every row before the break is durable now; the round fails here, naming the object.
            self._damaged(prefetch.damaged)
        self._finish(t0)
        return ShardOutcome("done", self.stats.rows, self.stats.errors)

    def _done_before(self) -> ShardOutcome | None:
        """The outcome of an earlier run that finished the shard (its completion record), or None."""
        done_at = layout.done_uri(self.plan.round_prefix, self.index)
        if not self.out.exists(done_at):
            return None
        done = decode_shard_record(self.out.read_bytes(done_at), f"completion record {done_at}")
        self.progress({"event": "done", "index": self.index, "rows": done["rows"], "errors": done["errors"]})
        return ShardOutcome("done", done["rows"], done["errors"])

    def _carry_earlier_runs(self) -> None:
        """Time earlier runs of this shard spent (a preempted pod's last progress record) counts
        towards this shard's worker seconds, so a job's cost includes the work it lost; so do the
        model loads and the structured answers that record counted."""
        try:
            before = decode_shard_record(self.out.read_bytes(layout.progress_uri(self.plan.round_prefix, self.index)))
            self.committer.t0 -= float(before.get("seconds") or 0)
            self.stats.model_load_s += float(before.get("modelLoadSeconds") or 0)
            self.stats.model_loads += int(before.get("modelLoads") or 0)
            self.stats.weights_bytes += int(before.get("weightsBytes") or 0)
            # Structured answers validated before the stop (their result rows do not say so): as far as
            # the last progress record counted them.
            self.stats.structured_validated += int(before.get("structuredValidated") or 0)
            self.stats.structured_repaired += int(before.get("structuredRepaired") or 0)
        except (NotFound, ValueError):
            pass

    def _resume_log(self) -> list[dict[str, Any]]:
        """Count what the durable log holds and return the rows between attempts when the worker
        stopped (to continue at their next attempt), in input order."""
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
            self.committer.count_final(rec)
        pending = [rec for _, rec in sorted(attempts.items())]
        resumed_bytes += sum(rec["at"][2] - rec["at"][1] for rec in pending)
        if records:
            log.info("shard %d: resuming after %d durable records (%d rows between attempts, %d torn bytes skipped)",
                     self.index, records, len(pending), self.log.state.torn_bytes)
        self.stats.bytes = resumed_bytes
        self.progress({"event": "resume", "index": self.index, "rows": self.stats.rows,
                       "errors": self.stats.errors, "bytes": resumed_bytes})
        return pending

    def _work(self, prefetch: Prefetcher, attempts_loop: JudgeLoop) -> bool:
        """Run the read-ahead chunks through the engine (attempt by attempt for a judge job, streamed
        otherwise); True when the shard's input ran to its end, False when asked to stop."""
        self.metrics.engine_stopped()
        steps0, occupied0 = self.engine.steps, self.engine.occupied
        try:
            if self.judge is not None:
                return attempts_loop.by_chunk(prefetch)
            stream = StreamScheduler(self.engine, self.prep, self.committer, self.calls, self.batching,
                                     stop=self.stop, metrics=self.metrics, stats=self.stats, on_tail=self.on_tail)
            try:
                return stream.run(prefetch)
            finally:
                self.on_tail = stream.on_tail
        finally:
            prefetch.close()
            steps = self.engine.steps - steps0
            if steps and is_continuous(self.engine):
                self.stats.engine_steps += steps
                self.stats.occupied += self.engine.occupied - occupied0
                self.stats.max_num_seqs = self.engine.concurrency()

    def _judge_loop(self) -> JudgeLoop:
        """The loop that runs rows attempt by attempt (a judge job's chunks, rows resumed between attempts)."""
        spec = self.spec
        return JudgeLoop(self.engine, self.prep, self.committer, self.calls, self.batching, self.judge,
                         round_no=self.round, in_place=self.in_place, final_round=self.plan.mode.final,
                         max_attempts=spec.judge.max_attempts if spec.judge else 1, stop=self.stop,
                         metrics=self.metrics, stats=self.stats, progress=self.progress, index=self.index)

    def _corrupt(self, obj: int, offset: int, message: str) -> None:
        """A damaged object became an error row where it breaks (input.onDamagedObject: errorRow)."""
        info = self.objects[obj]
        self._record_damage(DamageRecord(self.index, obj, info.display_name, info.version, offset, "", message,
                                         "errorRow"))

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
            self.committer.report()
        except StorageError as e:  # a clean stop stays a clean stop; only the time is not carried over
            log.warning("shard %d: cannot write the progress record: %s", self.index, e)
        return ShardOutcome("stopped", self.stats.rows, self.stats.errors)

    def _finish(self, t0: float) -> None:
        if self.judge is not None:
            # The next round's input: every row this shard rejected, with its id and history.
            lines = [rec["line"] for rec in sorted(self.log.read().records,
                                                   key=lambda r: (r["at"][0], r["at"][1]))
                     if rec["kind"] == "rejected"]
            uri = layout.rejected_uri(self.plan.round_prefix, self.index)
            if lines:
                self.out.write_bytes(uri, ("\n".join(lines) + "\n").encode())
        # What the engine learnt it cannot serve at all (said once in the job's status, not per row).
        self.stats.notes = list(self.engine.notes)
        record = shard_record(self.index, self.round, self.lane, self.stats.as_record(), time.monotonic() - t0,
                              finished=True, pool=os.environ.get(POOL_ENV))
        self.out.write_bytes(layout.done_uri(self.plan.round_prefix, self.index), encode(record))
        if any(self.objects[obj].prefix is not None for obj, _, _ in self.pieces):
            # A damaged object of this shard was replaced and read to its end: nothing is damaged now.
            self.out.delete(layout.damaged_uri(self.plan.round_prefix, self.index))
        self.progress({"event": "done", "index": self.index, "rows": self.stats.rows, "errors": self.stats.errors})
