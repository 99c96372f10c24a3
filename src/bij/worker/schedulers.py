"""The two ways a shard's rows go through the engine.

`StreamScheduler`: rows stream into the engine across chunk boundaries. Chunks join the
in-flight window (`batching.inFlightRows`) as they are read; a continuous-batching engine
(vLLM, simulated) is kept fed step by step, prompts sharing a prefix together; a batch engine
gets token-budget batches cut from the whole window sorted by length. A chunk whose rows are
all back goes to the commit writer, in input order.

`JudgeLoop`: judge jobs, chunk by chunk; a row runs again until the judge approves it or its
attempts run out, and every chunk (with `inPlace`, every attempt) is committed before the next.
"""

from __future__ import annotations

import itertools
import json
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import repeat
from typing import Any, cast

from bij.contract.errors import BijError
from bij.engines.base import (
    ENGINE_REJECTED,
    ContinuousEngine,
    Engine,
    Request,
    Result,
    is_continuous,
    refused,
    request_text,
)
from bij.worker.batcher import PrefixShare, first_batch, plan_batches, run_order
from bij.worker.commits import CommitWriter
from bij.worker.committer import Committer, length_cut
from bij.worker.input_row import Row
from bij.worker.inputs import redispatch_line
from bij.worker.judge import Judge, Verdict, attempt_params
from bij.worker.metrics import Metrics, Stats
from bij.worker.prepare import OpenChunk, Preparer
from bij.worker.reader import Line, Prefetcher
from bij.worker.result_rows import result_row
from bij.worker.stopflag import StopFlag

# Padding a batch engine may waste before a batch is cut short (see batcher.plan_batches): for
# embedding only, where a batch costs its rows x its longest prompt. A generation batch's cost is its
# decode steps, nearly the same for 16 rows as for 64: cut short, it runs those steps again for the
# rows left out (on an H200, a generate loop over bij's padding-cut batches took 2.7x as long).
MAX_PADDING_WASTE = 0.2


class EngineFailure(BijError):
    """The engine fails with no row to blame (a plain canary request fails too): the engine is broken."""


def describe_exception(e: BaseException) -> str:
    """`Type: message`, and where it was raised when the message is empty (an empty AssertionError
    says nothing by itself)."""
    text = str(e).strip()
    if text:
        return f"{type(e).__name__}: {text}"
    frames = traceback.extract_tb(e.__traceback__) if e.__traceback__ is not None else []
    if frames:
        f = frames[-1]
        return f"{type(e).__name__} raised at {f.filename.rsplit('/', 1)[-1]}:{f.lineno} in {f.name}"
    return f"{type(e).__name__} (no message)"


def rejected(e: BaseException) -> Result:
    """The error result of a row the engine failed on alone."""
    return Result(error=f"the engine failed on this row: {describe_exception(e)}", extra={"code": ENGINE_REJECTED})


def canary(like: Request) -> Request:
    """A plain request of the same task as `like`: no sampling fields, images, adapter or grammar,
    one token. When it fails too, the engine is broken, not the rows."""
    if like.messages is not None:
        return Request(messages=[{"role": "user", "content": "Hello"}], max_tokens=1)
    return Request(text="Hello", max_tokens=1)


def run_isolating(engine: Engine, requests: list[Request]) -> list[Result]:
    """Run a batch; if it raises, split it until the failing rows are found and only they fail.

    One bad row must not cost its batch, and a batch of bad rows must not cost the lane. When a
    batch raises, one plain canary request decides first: if it fails too, the engine itself is
    broken and the caller fails (and is retried), with no bisection spent on it; if it runs, the
    rows are to blame, and the batch is split until each row that fails alone is found: an
    `engine_rejected` error row with the engine's message.
    """
    return _isolate(engine, requests, canary_first=True)


def _check_canary(engine: Engine, requests: list[Request], e: Exception) -> None:
    """EngineFailure when a plain request of the batch's task fails too (the engine is broken)."""
    what = f"engine fails on a batch of {len(requests)} ({describe_exception(e)}) and on a plain request too"
    try:
        probe = engine.run([canary(requests[0])])
    except Exception as again:  # noqa: BLE001 - the engine's own failure, reported as such
        raise EngineFailure(f"{what}: {describe_exception(again)}") from again
    if len(probe) != 1 or probe[0].error is not None:
        raise EngineFailure(f"{what}: {probe[0].error if len(probe) == 1 else f'{len(probe)} results'}") from e


def _isolate(engine: Engine, requests: list[Request], canary_first: bool = False) -> list[Result]:
    """Run `requests`, bisecting them when the engine raises; with `canary_first` a plain request decides
    first whether the engine itself is broken (below that, it is known to run one)."""
    try:
        results = engine.run(requests)
    except Exception as e:  # noqa: BLE001 - isolated below
        if canary_first:
            _check_canary(engine, requests, e)
        if len(requests) == 1:
            return [rejected(e)]
        mid = len(requests) // 2
        return _isolate(engine, requests[:mid]) + _isolate(engine, requests[mid:])
    if len(results) != len(requests):
        raise EngineFailure(f"engine returned {len(results)} results for {len(requests)} requests")
    return results


@dataclass(frozen=True)
class Batching:
    """How rows are batched and kept in flight (spec.batching, with the engine's defaults filled in)."""

    target_tokens: int
    max_batch: int
    sort: bool
    # Most padding (a share of a batch's padded tokens) before a batch is cut short; None: never.
    padding_waste: float | None
    prefix_order: bool
    chunk_rows: int
    window: int
    commit_slots: int


class EngineCalls:
    """Calls into the engine, timed: how busy it was, in the shard's stats and the metrics."""

    def __init__(self, engine: Engine, metrics: Metrics, stats: Stats):
        self.engine, self.metrics, self.stats = engine, metrics, stats

    def step(self, engine: ContinuousEngine) -> list[tuple[int, Result]]:
        self.metrics.engine_started()
        started = time.perf_counter()
        done = engine.step()
        busy = time.perf_counter() - started
        self.metrics.engine_stopped()
        self.metrics.engine_busy.inc(busy)
        self.stats.engine_busy_s += busy
        self.stats.engine_calls += len(done)
        return done

    def batch(self, requests: list[Request], tokens: list[int]) -> list[Result]:
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


class StreamScheduler:
    """Streams a shard's rows through the engine across chunks (every job without a judge)."""

    def __init__(self, engine: Engine, prep: Preparer, committer: Committer, calls: EngineCalls, batching: Batching,
                 *, stop: StopFlag, metrics: Metrics, stats: Stats, on_tail: Callable[[], None] | None = None):
        self.engine, self.prep, self.committer, self.calls = engine, prep, committer, calls
        self.batching, self.stop, self.metrics, self.stats = batching, stop, metrics, stats
        # Called once when every row of the shard is in a continuous engine (see bij.worker.lanes).
        self.on_tail = on_tail

    def run(self, prefetch: Prefetcher) -> bool:
        """Stream rows through the engine across chunks; True when the shard's rows are all durable.

        Chunks join the window while it has room and leave it, in input order, as soon as
        all their rows are back: to the commit writer, which compute waits for only when its
        queue is full. After a stop request no chunk joins; rows in the window still run
        until the drain time is over, and whole chunks that finish are committed.
        """
        engine = self.engine
        stepper = engine if is_continuous(engine) else None  # submit / step: its own continuous batching
        writer = CommitWriter(self.committer.commit_chunks, self.batching.commit_slots)
        w = _Window()
        try:
            while True:
                writer.check()
                if self.stop.drain_expired():
                    return False
                joined = self._fill(w, prefetch)
                self._release(w, writer, stepper)
                if not w.opened:
                    if prefetch.finished or self.stop.requested:
                        break
                    continue  # the window has room again
                if joined:
                    self._reorder(w, continuous=stepper is not None)
                if stepper is not None:
                    self._feed(w, stepper, prefetch)
                elif w.taken < len(w.pending):
                    self._batch(w)
        finally:
            self.stats.prefix_shared_chars += w.share.shared
            self.stats.prompt_chars += w.share.total
            writer.close()
        return prefetch.finished

    def _fill(self, w: _Window, prefetch: Prefetcher) -> bool:
        """Fill the window with whole chunks (the reader keeps `prefetchChunks` ready, so this waits only
        when reading is slower than the engine, which then starves anyway); whether any joined."""
        b = self.batching
        joined = False
        while not prefetch.finished and not self.stop.requested and (
                not w.opened or w.rows + b.chunk_rows <= b.window):
            item = prefetch.next_chunk()
            self.metrics.queue_depth.set(prefetch.depth())
            if item is None:
                break
            op = self.prep.count(item if isinstance(item, OpenChunk) else self.prep.parse(item))
            w.opened.append(op)
            w.rows += len(op.chunk.places)
            if op.left == len(op.results):  # every row goes to the engine
                w.pending.extend(zip(repeat(op), range(op.left)))
                w.pending_tokens.extend(op.tokens)
            else:
                todo = [i for i, res in enumerate(op.results) if res is None]
                w.pending.extend(zip(repeat(op), todo))
                w.pending_tokens.extend(op.tokens[i] for i in todo)
            joined = True
        return joined

    def _release(self, w: _Window, writer: CommitWriter, stepper: ContinuousEngine | None) -> None:
        """Chunks whose rows are all back leave the window, in input order, for the commit writer; with
        its queue full they wait in the window while the engine has work."""
        while w.opened and w.opened[0].left == 0:
            op = w.opened[0]
            if op.final is None:
                self.committer.count_tokens(op.answers())
                op.final, op.tally = self.prep.encode(op)
            idle = w.taken >= len(w.pending) and not (stepper is not None and stepper.unfinished())
            if not writer.put((op.chunk, op.final, op.tally), block=idle):
                break
            w.opened.popleft()
            w.rows -= len(op.chunk.places)

    def _reorder(self, w: _Window, *, continuous: bool) -> None:
        """Put the rows not yet given to the engine in their run order (by prefix, by length)."""
        b = self.batching
        pending, tokens = w.pending[w.taken:], w.pending_tokens[w.taken:]
        w.taken = 0
        by_prefix = b.prefix_order and continuous
        texts = [request_text(op.requests[i]) for op, i in pending] if by_prefix else []
        order = run_order(texts, tokens, by_prefix=by_prefix, by_length=b.sort)
        w.pending = list(map(pending.__getitem__, order))
        w.pending_tokens = list(map(tokens.__getitem__, order))

    def _feed(self, w: _Window, stepper: ContinuousEngine, prefetch: Prefetcher) -> None:
        """Give a continuous engine rows while its queue is short, then take what one step answers."""
        # Keep the engine's own queue short: rows wait here, in window order, so that
        # a chunk that joins later can still run before them where that is better.
        most = stepper.concurrency()
        room = most + max(1, most // 8) - stepper.unfinished()
        while room > 0 and w.taken < len(w.pending):
            op, i = w.pending[w.taken]
            w.taken += 1
            req = op.requests[i]
            w.share.add(request_text(req))
            try:
                stepper.submit(w.next_tag, req)
            except ValueError as e:
                op.place(i, refused(e))
                continue
            w.tags[w.next_tag] = (op, i)
            w.next_tag += 1
            room -= 1
        if prefetch.finished and w.taken >= len(w.pending) and self.on_tail is not None:
            # Every row is in the engine: only the shard's tail runs. The lane may start
            # its next shard now, so the engine does not drain between them.
            self.on_tail()
            self.on_tail = None
        if stepper.unfinished():
            for tag, res in self.calls.step(stepper):
                op, i = w.tags.pop(tag)
                op.place(i, res)

    def _batch(self, w: _Window) -> None:
        """Run the next batch of the window's rows through a batch engine."""
        b = self.batching
        k = first_batch(itertools.islice(w.pending_tokens, w.taken, w.taken + b.max_batch),
                        b.target_tokens, b.max_batch, b.padding_waste if b.sort else None)
        items = w.pending[w.taken:w.taken + k]
        tokens = w.pending_tokens[w.taken:w.taken + k]
        w.taken += k
        # No prefix share here: a batch engine has no prefix cache to reuse it.
        out = self.calls.batch([op.requests[i] for op, i in items], tokens)
        for (op, i), res in zip(items, out, strict=True):
            op.results[i] = res
            op.left -= 1


class _Window:
    """The chunks a stream has open, and their rows not yet given to the engine (`StreamScheduler.run`)."""

    def __init__(self) -> None:
        self.opened: deque[OpenChunk] = deque()
        self.rows = 0  # rows of the open chunks
        self.pending: list[tuple[OpenChunk, int]] = []  # rows in the window not yet given to the engine
        self.pending_tokens: list[int] = []  # their prompt tokens, in the same order
        self.taken = 0  # how many of `pending` went to the engine since it was last ordered
        self.tags: dict[int, tuple[OpenChunk, int]] = {}  # a continuous engine's rows, by the tag given it
        self.next_tag = 0
        self.share = PrefixShare()


@dataclass
class _Live:
    """A row being worked on in this process: its request, its line, and its attempts so far."""

    row: Row
    line: bytes
    attempts_here: int = 0  # attempts in this round (inPlace counts these against maxAttempts)


class JudgeLoop:
    """Judge jobs: chunk by chunk, each row until the judge approves it or its attempts run out.

    Without a judge each row runs once (rows a judge run left between attempts, resumed).
    """

    def __init__(self, engine: Engine, prep: Preparer, committer: Committer, calls: EngineCalls, batching: Batching,
                 judge: Judge | None, *, round_no: int, in_place: bool, final_round: bool, max_attempts: int,
                 stop: StopFlag, metrics: Metrics, stats: Stats, progress: Callable[[dict[str, Any]], None],
                 index: int):
        self.engine, self.prep, self.committer, self.calls = engine, prep, committer, calls
        self.batching, self.judge = batching, judge
        self.round, self.in_place, self.final_round, self.max_attempts = round_no, in_place, final_round, max_attempts
        self.stop, self.metrics, self.stats, self.progress, self.index = stop, metrics, stats, progress, index

    def by_chunk(self, prefetch: Prefetcher) -> bool:
        """One chunk at a time, every attempt committed before the next chunk."""
        for chunk in prefetch:
            self.metrics.queue_depth.set(prefetch.depth())
            if self.stop.requested:
                return False
            rows_before, errors_before = self.stats.rows, self.stats.errors
            if not self.work_chunk(chunk.lines):
                # Asked to stop and out of time: what was not committed is dropped whole.
                return False
            self.stats.chunks += 1
            self.stats.bytes += chunk.bytes
            self.progress({"event": "chunk", "index": self.index, "rows": self.stats.rows - rows_before,
                           "errors": self.stats.errors - errors_before, "bytes": chunk.bytes})
        return True

    def resume(self, pending: list[dict[str, Any]]) -> bool:
        """Continue rows that were between attempts when the shard last stopped."""
        live = []
        for rec in pending:
            line = rec["line"].encode()
            row = self.prep.row(line, tuple(rec["at"]))
            row.id = rec["id"]
            # "attempts" counts every attempt so far, earlier rounds included.
            row.prior_attempts = int(rec["attempts"]) - int(rec["attemptsHere"])
            row.verdicts = list(rec.get("verdicts", []))
            live.append(_Live(row, line, attempts_here=int(rec["attemptsHere"])))
        return self.attempt_loop(live, [])

    def work_chunk(self, lines: list[Line]) -> bool:
        """Parse, run and commit one chunk. False when stopped before the chunk was committed.

        Ids repeated within or across shards are found at publish, which sees every shard
        in input order: a set of every id here would grow with the shard.
        """
        rows, records = self.prep.rows(lines)
        return self.attempt_loop([_Live(row, line) for row, line in rows], records)

    def attempt_loop(self, live: list[_Live], records: list[dict[str, Any]]) -> bool:
        """Run rows until each is final; with inPlace judging, commit every attempt as it completes."""
        validated = repaired = cuts = 0  # structured answers checked valid, counted with the commit that holds them
        while live:
            results = self._run_engine(live)
            if results is None:
                return False
            retry: list[_Live] = []
            self.committer.count_tokens(results)
            checked = self.prep.validator.check(cast("list[Request]", [item.row.request for item in live]), results)
            validated += checked.validated
            repaired += checked.repaired
            verdicts = self._verdicts(live, results)
            for item, res, verdict in zip(live, results, verdicts, strict=True):
                row = item.row
                if res.error is not None:
                    self.prep.fail(row, res)
                    records.append(self.prep.error_record(row))
                    continue
                if verdict is None or verdict.approved:
                    out = result_row(row, res, self.prep.opts)
                    if self.judge is not None:
                        out["attempts"] = row.prior_attempts + item.attempts_here + 1
                        out["round"] = self.round
                    records.append({"at": list(row.at), "kind": "result", "row": out})
                    cuts += length_cut(res)
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
            self.committer.commit(records, validated, repaired, cuts)
            records, validated, repaired, cuts = [], 0, 0, 0
            live = retry
        self.committer.commit(records, validated, repaired, cuts)
        return True

    def _capped_row(self, row: Row, attempts: int, output: str | None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": row.id, "output": output, "attempts": attempts, "round": self.round,
                               "verdicts": row.verdicts,
                               "error": {"code": "retry_cap_reached",
                                         "message": f"still rejected after {attempts} attempts"}}
        if self.prep.opts.format == "openai":
            out["custom_id"] = row.id
        elif row.carried:
            out.update(row.carried)
        return out

    def _verdicts(self, live: list[_Live], results: list[Result]) -> list[Verdict | None]:
        if self.judge is None:
            return [None] * len(live)
        idx = [i for i, r in enumerate(results) if r.error is None]
        verdicts: list[Verdict | None] = [None] * len(live)
        if idx:
            reqs = cast("list[Request]", [live[i].row.request for i in idx])  # a live row has a request
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
        cut, refused = self.prep.over_limit(tokens)
        for i in cut:
            live[i].row.truncated = True
        results: list[Result | None] = [refused.get(i) for i in range(len(live))]
        todo = [i for i in range(len(live)) if results[i] is None]
        if todo:
            todo_tokens = [tokens[i] for i in todo]
            b = self.batching
            if self.engine.schedules_itself:
                batches = [list(range(len(todo)))]
            else:
                batches = plan_batches(todo_tokens, b.target_tokens, b.max_batch, b.sort)
            for batch in batches:
                if self.stop.drain_expired():
                    return None
                out = self.calls.batch([requests[todo[j]] for j in batch], [todo_tokens[j] for j in batch])
                for j, res in zip(batch, out, strict=True):
                    results[todo[j]] = res
        final = [r for r in results if r is not None]
        assert len(final) == len(live)
        return final
