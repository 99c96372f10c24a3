"""Work one shard: resume from what is durable, stream, batch, run the engine, commit each chunk.

Per chunk: parse rows (bad rows become error rows),
count tokens, sort and batch by token budget, run the engine, restore input
order, append the chunk to the shard's durable log. Chunks are committed in
input order, so the durable part of a shard is always a prefix of it and a
restarted worker continues at the cursor: at most the in-flight chunk is
recomputed. A finished shard gets a completion record; a second run of a
finished shard does nothing.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from .batcher import plan_batches
from .engines.base import Engine, Request, Result
from .inputs import InputOptions, Row, error_row, parse_line, redispatch_line, result_row, row_usage
from .judge import Judge, Verdict, attempt_params
from .metrics import Metrics, Stats
from .reader import DEFAULT_MAX_LINE_BYTES, InputProblem, Line, Prefetcher, iter_shard
from .segments import ShardLog
from .storage import NotFound, Storage, open_storage

log = logging.getLogger("bij.worker")

EXIT_OK = 0
EXIT_FAILED = 1  # worth a retry (the Job's backoffLimitPerIndex decides)
EXIT_BAD_CONFIG = 42  # never worth a retry: the Job's podFailurePolicy fails the Job
EXIT_TERMINATED = 143  # SIGTERM: the in-flight chunk was committed or dropped whole


class BadConfig(Exception):
    """A problem no retry can fix: a missing plan, an index out of range, an unknown engine or model."""


class EngineFailure(RuntimeError):
    """The engine failed on every row of a batch, one by one: the engine is broken, not the rows."""


class StopFlag:
    """Set by SIGTERM/SIGINT: take no new chunk; finish the in-flight one if there is time."""

    def __init__(self, drain_seconds: float = 15.0):
        self.drain_seconds = drain_seconds
        self._at: float | None = None
        self.event = threading.Event()

    def request(self) -> None:
        if self._at is None:
            self._at = time.monotonic()
        self.event.set()

    @property
    def requested(self) -> bool:
        return self._at is not None

    def drain_expired(self) -> bool:
        return self._at is not None and time.monotonic() - self._at > self.drain_seconds


def shard_prefix(plan: dict[str, Any], index: int) -> str:
    return f"{plan['roundPrefix']}/shards/{index:05d}"


def done_uri(plan: dict[str, Any], index: int) -> str:
    return f"{plan['roundPrefix']}/done/{index:05d}.json"


def progress_uri(plan: dict[str, Any], index: int) -> str:
    """A running shard's live counts (rewritten now and then; the done record supersedes it)."""
    return f"{plan['roundPrefix']}/progress/{index:05d}.json"


def load_plan(uri: str, s3: Any = None) -> dict[str, Any]:
    """Read a round plan (shards.json); a missing or unreadable plan is a bad configuration."""
    try:
        store = open_storage(uri, s3)
        return dict(json.loads(store.read_bytes(uri)))
    except NotFound:
        raise BadConfig(f"round plan {uri} does not exist") from None
    except ValueError as e:
        raise BadConfig(f"round plan {uri} is not valid JSON: {e}") from None


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


# Record kinds that end a row's story in a round; "attempt" records are the steps before.
FINAL_KINDS = ("result", "error", "rejected", "capped")


class ShardWorker:
    """Runs one shard of a round plan with an already loaded engine."""

    def __init__(
        self,
        plan: dict[str, Any],
        index: int,
        engine: Engine,
        *,
        metrics: Metrics | None = None,
        stop: StopFlag | None = None,
        progress: Callable[[dict[str, Any]], None] | None = None,
        stats: Stats | None = None,
    ):
        shards = plan["shards"]
        if not 0 <= index < len(shards):
            raise BadConfig(f"shard index {index} is out of range: the round has {len(shards)} shards")
        self.plan, self.index, self.engine = plan, index, engine
        self.round = int(plan.get("round", 0))
        self.pieces = shards[index]
        self.objects = plan["objects"]
        self.names = [str(o.get("name") or o["uri"]) for o in self.objects]
        spec = plan["job"]["spec"]
        self.spec = spec
        self.opts = InputOptions.from_spec(spec)
        batching = spec.get("batching", {})
        self.target_tokens = int(batching.get("targetBatchTokens", 32000))
        self.max_batch = int(batching.get("maxBatchSize", 256))
        self.sort = bool(batching.get("sortByLength", True))
        self.depth = int(batching.get("prefetchChunks", 2))
        self.chunk_rows = int(spec.get("sharding", {}).get("chunkRows", 512))
        self.max_line = int(spec["input"].get("maxLineBytes", DEFAULT_MAX_LINE_BYTES))
        self.max_tokens = spec.get("model", {}).get("maxInputTokens")
        self.s3 = spec.get("storage", {}).get("s3")
        judge_spec = spec.get("judge")
        self.judge = Judge(judge_spec) if judge_spec else None
        mode = plan.get("judgeMode") or {}
        self.in_place = bool(self.judge) and mode.get("mode") == "inPlace"
        self.final_round = mode.get("final", True)
        self.max_attempts = int(judge_spec.get("maxAttempts", 3)) if judge_spec else 1
        self.metrics = metrics or Metrics()
        self.stop = stop or StopFlag()
        self.progress = progress or (lambda event: None)
        self.stats = stats or Stats()
        # How often the shard's live progress record is rewritten (for `kubectl get bij` ROWS
        # while a long shard runs); one small atomic write, so never more than this often.
        self.report_every = float(os.environ.get("BIJ_PROGRESS_SECONDS", "30"))
        self._last_report = time.monotonic()
        self._stores: dict[str, Storage] = {}
        self.out = self.storage_for(plan["roundPrefix"])
        self.log = ShardLog(self.out, shard_prefix(plan, index))

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
        t0 = time.monotonic()
        done_at = done_uri(self.plan, self.index)
        if self.out.exists(done_at):
            rec = json.loads(self.out.read_bytes(done_at))
            self.progress({"event": "done", "index": self.index, "rows": rec["rows"], "errors": rec["errors"]})
            return ShardOutcome("done", rec["rows"], rec["errors"])
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
            log.info("shard %d: resuming after %d durable records (%d rows between attempts, %d torn bytes cut)",
                     self.index, records, len(pending), state.torn_bytes)
        self.progress({"event": "resume", "index": self.index, "rows": self.stats.rows,
                       "errors": self.stats.errors, "bytes": resumed_bytes})
        if pending and not self._resume_attempts(pending):
            return ShardOutcome("stopped", self.stats.rows, self.stats.errors)

        lines = iter_shard(self.storage_for, self.objects, self.pieces, state.cursor, self.max_line)
        prefetch = Prefetcher(lines, self.chunk_rows, self.depth)
        self.metrics.engine_stopped()
        try:
            for chunk in prefetch:
                self.metrics.queue_depth.set(prefetch.depth())
                if self.stop.requested:
                    return ShardOutcome("stopped", self.stats.rows, self.stats.errors)
                rows_before, errors_before = self.stats.rows, self.stats.errors
                if not self._work_chunk(chunk.lines):
                    # Asked to stop and out of time: what was not committed is dropped whole.
                    return ShardOutcome("stopped", self.stats.rows, self.stats.errors)
                self.stats.chunks += 1
                self.progress({"event": "chunk", "index": self.index, "rows": self.stats.rows - rows_before,
                               "errors": self.stats.errors - errors_before, "bytes": chunk.bytes})
        finally:
            prefetch.close()
        self._finish(t0)
        return ShardOutcome("done", self.stats.rows, self.stats.errors)

    def _finish(self, t0: float) -> None:
        if self.judge is not None:
            # The next round's input: every row this shard rejected, with its id and history.
            lines = [rec["line"] for rec in sorted(self.log.read().records,
                                                   key=lambda r: (r["at"][0], r["at"][1]))
                     if rec["kind"] == "rejected"]
            uri = f"{self.plan['roundPrefix']}/rejected/{self.index:05d}.jsonl"
            if lines:
                self.out.write_bytes(uri, ("\n".join(lines) + "\n").encode())
        record = {"index": self.index, "round": self.round, **self.stats.as_record(),
                  "seconds": round(time.monotonic() - t0, 3),
                  "finishedAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        self.out.write_bytes(done_uri(self.plan, self.index), json.dumps(record).encode())
        self.progress({"event": "done", "index": self.index, "rows": self.stats.rows, "errors": self.stats.errors})

    def _count_final(self, rec: dict[str, Any]) -> None:
        kind = rec["kind"]
        if kind == "result":
            self.stats.rows += 1
            usage = row_usage(rec["row"])
            self.stats.tokens_in += usage.get("prompt_tokens", 0)
            self.stats.tokens_out += usage.get("completion_tokens", 0)
        elif kind == "error":
            self.stats.errors += 1
        elif kind == "rejected":
            self.stats.rejected += 1
        elif kind == "capped":
            self.stats.capped += 1

    def _resume_attempts(self, pending: list[dict[str, Any]]) -> bool:
        live = []
        for rec in pending:
            line = rec["line"].encode()
            row = parse_line(line, tuple(rec["at"]), self.object_name(rec["at"][0]), self.opts)  # type: ignore[arg-type]
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
        names, opts = self.names, self.opts
        records: list[dict[str, Any]] = []
        live = []
        for at, line in lines:
            if isinstance(line, InputProblem):
                records.append(self._error_record(Row(at=at, id=None, error_code=line.code, error=line.message)))
                continue
            row = parse_line(line, at, names[at[0]], opts)
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
        if not records:
            return
        t = time.perf_counter()
        self.log.append(records)
        self.metrics.commit_latency.observe(time.perf_counter() - t)
        counts = {"result": 0, "error": 0, "rejected": 0, "capped": 0, "attempt": 0}
        for rec in records:
            counts[rec["kind"]] += 1
        self.stats.rows += counts["result"]
        self.stats.errors += counts["error"]
        self.stats.rejected += counts["rejected"]
        self.stats.capped += counts["capped"]
        if time.monotonic() - self._last_report >= self.report_every:
            self._last_report = time.monotonic()
            record = {"index": self.index, "round": self.round, **self.stats.as_record(),
                      "updatedAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            self.out.write_bytes(progress_uri(self.plan, self.index), json.dumps(record).encode())
        # Once per commit, not per row: each labelled increment takes a lock.
        self.metrics.rows_ok.inc(counts["result"])
        self.metrics.rows_error.inc(counts["error"])
        self.metrics.rows_capped.inc(counts["capped"])

    def _count_tokens(self, results: list[Result]) -> None:
        tokens_in = sum(r.prompt_tokens or 0 for r in results if r.error is None)
        tokens_out = sum(r.completion_tokens or 0 for r in results if r.error is None)
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
                if t > limit:
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
                reqs = [requests[todo[j]] for j in batch]
                self.metrics.engine_started()
                started = time.perf_counter()
                out = run_isolating(self.engine, reqs)
                busy = time.perf_counter() - started
                self.metrics.engine_stopped()
                self.metrics.engine_busy.inc(busy)
                self.stats.engine_busy_s += busy
                self.stats.batches += 1
                self.stats.engine_calls += len(reqs)
                self.metrics.batch_size.observe(len(batch))
                self.metrics.batch_tokens.observe(len(batch) * max(todo_tokens[j] for j in batch))
                for j, res in zip(batch, out, strict=True):
                    results[todo[j]] = res
        final = [r for r in results if r is not None]
        assert len(final) == len(live)
        return final
