"""Work one shard: resume from what is durable, stream, batch, run the engine, commit each chunk.

Per chunk: parse rows (bad rows become error rows), drop ids seen before,
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
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .batcher import plan_batches
from .engines.base import Engine, Request, Result
from .inputs import InputOptions, Row, error_row, id_key, parse_line, result_row
from .metrics import Metrics, Stats
from .reader import Prefetcher, iter_shard
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
        self.pieces = shards[index]
        self.objects = plan["objects"]
        spec = plan["job"]["spec"]
        self.spec = spec
        self.opts = InputOptions.from_spec(spec)
        batching = spec.get("batching", {})
        self.target_tokens = int(batching.get("targetBatchTokens", 32000))
        self.max_batch = int(batching.get("maxBatchSize", 256))
        self.sort = bool(batching.get("sortByLength", True))
        self.depth = int(batching.get("prefetchChunks", 2))
        self.chunk_rows = int(spec.get("sharding", {}).get("chunkRows", 512))
        self.max_tokens = spec.get("model", {}).get("maxInputTokens")
        self.s3 = spec.get("storage", {}).get("s3")
        self.metrics = metrics or Metrics()
        self.stop = stop or StopFlag()
        self.progress = progress or (lambda event: None)
        self.stats = stats or Stats()
        self._stores: dict[str, Storage] = {}
        self.out = self.storage_for(plan["roundPrefix"])
        self.log = ShardLog(self.out, shard_prefix(plan, index))

    def storage_for(self, uri: str) -> Storage:
        scheme = uri.split("://", 1)[0]
        if scheme not in self._stores:
            self._stores[scheme] = open_storage(uri, self.s3)
        return self._stores[scheme]

    def object_name(self, obj: int) -> str:
        return str(self.objects[obj].get("name") or self.objects[obj]["uri"])

    def token_limit(self) -> int | None:
        limits = [x for x in (self.max_tokens, self.engine.max_input_tokens()) if x]
        return min(limits) if limits else None

    def run(self) -> ShardOutcome:
        """Work the shard to its end, or until asked to stop."""
        t0 = time.monotonic()
        if self.out.exists(done_uri(self.plan, self.index)):
            rec = json.loads(self.out.read_bytes(done_uri(self.plan, self.index)))
            self.progress({"event": "done", "index": self.index, "rows": rec["rows"], "errors": rec["errors"]})
            return ShardOutcome("done", rec["rows"], rec["errors"])
        state = self.log.read()
        seen: set[str] = set()
        rows = errors = 0
        tokens_in = tokens_out = 0
        resumed_bytes = 0
        for rec in state.records:
            rid = rec["row"].get("custom_id", rec["row"].get("id")) if self.opts.format == "openai" \
                else rec["row"].get("id")
            if rid is not None:
                seen.add(id_key(rid))
            resumed_bytes += rec["at"][2] - rec["at"][1]
            if rec["kind"] == "result":
                rows += 1
                usage = _usage_of(rec["row"])
                tokens_in += usage.get("prompt_tokens", 0)
                tokens_out += usage.get("completion_tokens", 0)
            else:
                errors += 1
        if state.records:
            log.info("shard %d: resuming after %d durable rows (%d torn bytes cut)", self.index,
                     len(state.records), state.torn_bytes)
        self.progress({"event": "resume", "index": self.index, "rows": rows, "errors": errors,
                       "bytes": resumed_bytes})
        self.stats.rows, self.stats.errors = rows, errors
        self.stats.tokens_in, self.stats.tokens_out = tokens_in, tokens_out

        lines = iter_shard(self.storage_for, self.objects, self.pieces, state.cursor)
        prefetch = Prefetcher(lines, self.chunk_rows, self.depth)
        self.metrics.engine_stopped()
        try:
            for chunk in prefetch:
                self.metrics.queue_depth.set(prefetch.depth())
                if self.stop.requested:
                    return ShardOutcome("stopped", self.stats.rows, self.stats.errors)
                records = self._work_chunk(chunk.lines, seen)
                if records is None:  # asked to stop and out of time: the chunk is dropped whole
                    return ShardOutcome("stopped", self.stats.rows, self.stats.errors)
                t = time.perf_counter()
                self.log.append(records)
                self.metrics.commit_latency.observe(time.perf_counter() - t)
                ok = sum(1 for r in records if r["kind"] == "result")
                self.stats.rows += ok
                self.stats.errors += len(records) - ok
                self.stats.chunks += 1
                self.metrics.rows.labels("ok").inc(ok)
                self.metrics.rows.labels("error").inc(len(records) - ok)
                self.progress({"event": "chunk", "index": self.index, "rows": ok, "errors": len(records) - ok,
                               "bytes": chunk.bytes})
        finally:
            prefetch.close()
        record = {"index": self.index, **self.stats.as_record(), "seconds": round(time.monotonic() - t0, 3),
                  "finishedAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        self.out.write_bytes(done_uri(self.plan, self.index), json.dumps(record).encode())
        self.progress({"event": "done", "index": self.index, "rows": self.stats.rows, "errors": self.stats.errors})
        return ShardOutcome("done", self.stats.rows, self.stats.errors)

    def _work_chunk(self, lines: list[tuple[tuple[int, int, int], bytes]], seen: set[str]) -> \
            list[dict[str, Any]] | None:
        rows: list[Row] = [parse_line(line, at, self.object_name(at[0]), self.opts) for at, line in lines]
        for row in rows:
            if row.id is None:
                continue
            key = id_key(row.id)
            if key in seen:
                if row.error is None:
                    row.error_code, row.error, row.request = "duplicate_id", \
                        f"id {json.dumps(row.id)} was seen before; the first occurrence wins", None
            else:
                seen.add(key)
        todo = [i for i, r in enumerate(rows) if r.request is not None]
        requests: list[Request] = [rows[i].request for i in todo]  # type: ignore[misc]
        tokens = self.engine.count_tokens(requests) if requests else []
        limit = self.token_limit()
        if limit:
            keep = []
            for i, t in zip(todo, tokens, strict=True):
                if t > limit:
                    rows[i].error_code = "too_many_tokens"
                    rows[i].error = f"prompt has {t} tokens, the model takes at most {limit}"
                    rows[i].request = None
                else:
                    keep.append((i, t))
            todo = [i for i, _ in keep]
            tokens = [t for _, t in keep]
        results: dict[int, Result] = {}
        if todo:
            if self.engine.schedules_itself:
                batches = [list(range(len(todo)))]
            else:
                batches = plan_batches(tokens, self.target_tokens, self.max_batch, self.sort)
            for batch in batches:
                if self.stop.drain_expired():
                    return None
                reqs: list[Request] = [rows[todo[j]].request for j in batch]  # type: ignore[misc]
                self.metrics.engine_started()
                t = time.perf_counter()
                out = run_isolating(self.engine, reqs)
                busy = time.perf_counter() - t
                self.metrics.engine_stopped()
                self.metrics.engine_busy.inc(busy)
                self.stats.engine_busy_s += busy
                self.stats.batches += 1
                self.metrics.batch_size.observe(len(batch))
                self.metrics.batch_tokens.observe(len(batch) * max(tokens[j] for j in batch))
                for j, res in zip(batch, out, strict=True):
                    results[todo[j]] = res
        records: list[dict[str, Any]] = []
        for i, row in enumerate(rows):
            res = results.get(i)
            if res is not None and res.error is not None:
                row.error_code, row.error = "engine_error", res.error
                res = None
            if res is None:
                records.append({"at": list(row.at), "kind": "error",
                                "row": error_row(row, self.object_name(row.at[0]), self.opts)})
                continue
            if res.prompt_tokens:
                self.stats.tokens_in += res.prompt_tokens
                self.metrics.tokens.labels("in").inc(res.prompt_tokens)
            if res.completion_tokens:
                self.stats.tokens_out += res.completion_tokens
                self.metrics.tokens.labels("out").inc(res.completion_tokens)
            records.append({"at": list(row.at), "kind": "result", "row": result_row(row, res, self.opts)})
        return records


def _usage_of(row: dict[str, Any]) -> dict[str, int]:
    usage = row.get("usage")
    if usage is None and isinstance(row.get("response"), dict):
        usage = row["response"].get("body", {}).get("usage")
    return usage or {}
