"""Prometheus metrics of one worker process, and the same numbers as plain stats for records."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from bij.contract.records import ShardCounts

log = logging.getLogger("bij.worker")


@dataclass
class Stats:
    """Counters the worker keeps whether or not Prometheus is scraped (they go into the done record)."""

    rows: int = 0
    errors: int = 0
    truncated: int = 0  # result rows whose prompt was cut to the model's limit
    tokens_in: int = 0
    tokens_out: int = 0
    rejected: int = 0  # judge: sent to the next round
    capped: int = 0  # judge: still rejected at the cap
    engine_calls: int = 0  # rows sent to the engine (every attempt counts)
    judge_calls: int = 0  # rows sent to the engine by an llm judge
    batches: int = 0
    chunks: int = 0
    engine_busy_s: float = 0.0
    model_load_s: float = 0.0
    model_loads: int = 0  # model loads counted with this shard (a lane's process loads once, for its first)
    weights_bytes: int = 0  # ... and the bytes of weights it copied from object storage before it
    started_at: float = 0.0
    engine_steps: int = 0  # continuous engines: steps taken
    occupied: int = 0  # ... and running sequences summed over those steps
    max_num_seqs: int = 0  # ... out of this many at most
    prefix_shared_chars: int = 0  # prompt characters shared with the prompt run just before
    prompt_chars: int = 0
    cached_tokens: int = 0  # prompt tokens the engine's prefix cache served (vLLM reports them per request)
    bytes: int = 0  # input bytes (Parquet: rows) of the shard behind the durable rows, for ETAs
    int_ids: int = 0  # result rows whose id is an integer ...
    str_ids: int = 0  # ... or a string (Parquet output picks the id column's type from these)
    place_ids: int = 0  # final rows whose id is none or generated from their place: none can repeat
    # Rows with structured output: answers checked and valid, and answers that broke it (error rows)
    # (bij.engines.structured); `notes`: what the engine could not serve at all, said once each.
    structured_validated: int = 0
    structured_repaired: int = 0  # ... valid only on the second grammar backend's try (among validated)
    structured_violations: int = 0
    length_cuts: int = 0  # result rows whose answer stopped at its token cap (finish_reason length)
    notes: list[str] = field(default_factory=list)

    @property
    def occupancy(self) -> float:
        """Mean running sequences per step / the most the engine runs at once."""
        return self.occupied / (self.engine_steps * self.max_num_seqs) if self.engine_steps else 0.0

    @property
    def prefix_share(self) -> float:
        return self.prefix_shared_chars / self.prompt_chars if self.prompt_chars else 0.0

    def as_record(self) -> ShardCounts:
        d = asdict(self)
        return {
            "rows": d["rows"], "errors": d["errors"], "truncated": d["truncated"],
            "tokensIn": d["tokens_in"], "tokensOut": d["tokens_out"],
            "rejected": d["rejected"], "capped": d["capped"], "engineCalls": d["engine_calls"],
            "judgeCalls": d["judge_calls"], "batches": d["batches"], "chunks": d["chunks"],
            "engineBusySeconds": round(d["engine_busy_s"], 3),
            "modelLoadSeconds": round(d["model_load_s"], 3), "modelLoads": d["model_loads"],
            "weightsBytes": d["weights_bytes"],
            "engineSteps": d["engine_steps"], "meanOccupancy": round(self.occupancy, 4),
            "prefixShare": round(self.prefix_share, 4), "promptChars": d["prompt_chars"],
            "cachedTokens": d["cached_tokens"],
            "bytes": d["bytes"], "intIds": d["int_ids"], "strIds": d["str_ids"],
            "placeIds": d["place_ids"],
            "structuredValidated": d["structured_validated"], "structuredRepaired": d["structured_repaired"],
            "structuredViolations": d["structured_violations"], "lengthCuts": d["length_cuts"],
            "notes": list(d["notes"]),
        }


class Metrics:
    """The worker's Prometheus series. A private registry, so tests can make many."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.rows = Counter("bij_rows", "Rows finished, by status (ok, error, or capped by the judge)",
                            ["status"], registry=r)
        self.row_errors = Counter("bij_row_errors", "Error rows, by error code (too_many_tokens, invalid_json, ...)",
                                  ["code"], registry=r)
        self.tokens = Counter("bij_tokens", "Tokens processed, by direction (in or out)", ["direction"], registry=r)
        # Label children resolved once: the worker counts per commit, and a lookup per call adds up.
        self.rows_ok, self.rows_error = self.rows.labels("ok"), self.rows.labels("error")
        self.rows_capped = self.rows.labels("capped")
        self.tokens_in, self.tokens_out = self.tokens.labels("in"), self.tokens.labels("out")
        self.batch_size = Histogram("bij_batch_size", "Rows per engine batch",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096), registry=r)
        self.batch_tokens = Histogram("bij_batch_tokens", "Padded tokens per engine batch",
                                      buckets=(64, 256, 1024, 4096, 8192, 16384, 32768, 65536, 131072, 524288),
                                      registry=r)
        self.engine_busy = Counter("bij_engine_busy_seconds", "Seconds the engine spent running batches",
                                   registry=r)
        self.engine_idle = Counter("bij_engine_idle_seconds",
                                   "Seconds the loaded engine waited for input or commits", registry=r)
        self.model_load = Gauge("bij_model_load_seconds", "Seconds the model took to load", registry=r)
        self.commit_latency = Histogram("bij_chunk_commit_seconds", "Seconds to make one chunk durable",
                                        buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30), registry=r)
        self.queue_depth = Gauge("bij_prefetch_queue_depth", "Chunks read ahead and waiting", registry=r)
        self._idle_since: float | None = None

    def serve(self, port: int) -> None:
        """Serve /metrics on `port`; a port already taken costs the metrics, never the shard."""
        try:
            start_http_server(port, registry=self.registry)
        except OSError as e:
            log.warning("metrics: cannot listen on port %d (%s); this worker runs without /metrics", port, e)

    def engine_started(self) -> None:
        if self._idle_since is not None:
            self.engine_idle.inc(time.perf_counter() - self._idle_since)
            self._idle_since = None

    def engine_stopped(self) -> None:
        self._idle_since = time.perf_counter()
