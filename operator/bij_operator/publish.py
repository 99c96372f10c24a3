"""Publish a finished job: result and error files, then `manifest.json` last, in one atomic write.

Readers trust only the manifest. Publishing reads every shard's durable log in
input order, keeps the first occurrence of each id (a retried index or a
duplicate pod can leave a row twice; an id repeated across shards is a bad
row), writes one result file and one error file per shard, and then the
manifest with row counts and checksums. It is deterministic: publishing again
gives the same files and the same manifest.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

import zstandard
from bij_worker.inputs import id_key, row_id, row_usage
from bij_worker.parquet import SUFFIX as PARQUET_SUFFIX
from bij_worker.parquet import encode_results, id_kind
from bij_worker.segments import ShardLog, encode_records
from bij_worker.storage import NotFound, Storage, open_storage
from bij_worker.worker import done_uri, shard_prefix

from . import layout
from .efficiency import cost, efficiency
from .fingerprint import PlanRefused, spec_changes
from .spec import BatchInferenceJob


class PublishError(RuntimeError):
    """The job cannot be published yet: a round or shard has not finished."""


class ErrorRatioExceeded(PublishError):
    """More rows failed than spec.maxErrorRatio allows: the job failed, publishing again will not help."""


@dataclass
class _Totals:
    rows: int = 0
    errors: int = 0
    capped: int = 0
    duplicates: int = 0
    truncated: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    files: list[dict[str, Any]] = field(default_factory=list)
    error_files: list[dict[str, Any]] = field(default_factory=list)
    capped_files: list[dict[str, Any]] = field(default_factory=list)
    rounds: list[dict[str, Any]] = field(default_factory=list)
    # From the shards' completion records: how busy the engine was and what its prefix cache could reuse.
    busy_s: float = 0.0
    steps: int = 0
    occupancy_steps: float = 0.0  # meanOccupancy x steps, summed
    shared_chars: float = 0.0  # prefixShare x promptChars, summed
    prompt_chars: int = 0
    done_records: list[dict[str, Any]] = field(default_factory=list)  # O(shards): efficiency and cost

    def add_done(self, rec: dict[str, Any]) -> None:
        self.done_records.append(rec)
        self.busy_s += float(rec.get("engineBusySeconds", 0.0))
        steps = int(rec.get("engineSteps", 0))
        self.steps += steps
        self.occupancy_steps += float(rec.get("meanOccupancy", 0.0)) * steps
        chars = int(rec.get("promptChars", 0))
        self.prompt_chars += chars
        self.shared_chars += float(rec.get("prefixShare", 0.0)) * chars

    def engine(self) -> dict[str, Any]:
        return {"busySeconds": round(self.busy_s, 3), "steps": self.steps,
                "meanOccupancy": round(self.occupancy_steps / self.steps, 4) if self.steps else None,
                "prefixShare": round(self.shared_chars / self.prompt_chars, 4) if self.prompt_chars else None}


def load_round_plan(store: Storage, job: BatchInferenceJob, round_no: int) -> dict[str, Any]:
    try:
        return dict(json.loads(store.read_bytes(layout.round_manifest_uri(job, round_no))))
    except NotFound:
        raise PublishError(f"round {round_no} was never planned") from None


def _encode(rows: list[dict[str, Any]], compression: str) -> bytes:
    data = encode_records(rows)
    if compression == "zstd":
        return zstandard.ZstdCompressor(level=3).compress(data)
    return data


def _write_file(store: Storage, job: BatchInferenceJob, folder: str, name: str,
                rows: list[dict[str, Any]], ids: str | None = None) -> dict[str, Any]:
    """One published file; `ids` (the job's id kind) asks for Parquet (result files only)."""
    compression = job.spec.output.compression
    if ids is not None:
        path = f"{folder}/{name}{PARQUET_SUFFIX}"
        data = encode_results(rows, job.spec.model.task, ids, job.spec.judge is not None, compression)
    else:
        path = f"{folder}/{name}.jsonl" + (".zst" if compression == "zstd" else "")
        data = _encode(rows, compression)
    store.write_bytes(layout.join(job.spec.output.uri, path), data)
    return {"path": path, "rows": len(rows), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def result_id_kind(done_records: list[dict[str, Any]]) -> str:
    """'int', 'str' or 'mixed': the Parquet `id` column's type for the whole job, from the workers'
    counts of integer and string ids (a record without them counts as mixed)."""
    if any("intIds" not in rec or "strIds" not in rec for rec in done_records):
        return id_kind(None, None)
    return id_kind(sum(int(rec["intIds"]) for rec in done_records), sum(int(rec["strIds"]) for rec in done_records))


def publish(job: BatchInferenceJob, rounds: int = 1) -> dict[str, Any]:
    """Write result/error/capped files for rounds 0..rounds-1 and then the manifest. Returns the manifest.

    Rows a judge still rejected at the cap go to `capped/` files with their last
    output, attempts and verdicts, and are counted in `counts.capped`.
    """
    out_uri = job.spec.output.uri
    store = open_storage(out_uri, job.spec.storage.s3)
    seen: set[str] = set()
    t = _Totals()
    plans = [load_round_plan(store, job, r) for r in range(rounds)]
    for r, plan in enumerate(plans):
        changes = spec_changes(plan["job"]["spec"], job)
        if changes:
            # The manifest must name what made the rows, never a spec edited since.
            raise PlanRefused(f"cannot publish: {'; '.join(changes)} since round {r} was planned; undo the change, "
                              "or start over with `bij run --restart`")
    for r, plan in enumerate(plans):  # every completion record first: O(shards), and the id kind needs them all
        for index in range(len(plan["shards"])):
            try:
                t.add_done(json.loads(store.read_bytes(done_uri(plan, index))))
            except NotFound:
                raise PublishError(f"round {r} shard {index} has not finished") from None
    ids = result_id_kind(t.done_records) if job.spec.output.format == "parquet" else None
    for r, plan in enumerate(plans):
        names = [o.get("name") or o["uri"] for o in plan["objects"]]
        round_rows = round_errors = 0
        for index in range(len(plan["shards"])):
            records = ShardLog(store, shard_prefix(plan, index)).read().records
            records.sort(key=lambda rec: (rec["at"][0], rec["at"][1]))  # input order, whoever wrote them
            results: list[dict[str, Any]] = []
            errors: list[dict[str, Any]] = []
            capped: list[dict[str, Any]] = []
            for rec in records:
                if rec["kind"] in ("attempt", "rejected"):
                    continue  # steps on the way; the row's outcome is in a later record or round
                row = rec["row"]
                rid = row_id(row)
                key = id_key(rid) if rid is not None else None
                if rec["kind"] == "result":
                    if key in seen:
                        t.duplicates += 1
                        errors.append({"id": rid, "error": {
                            "code": "duplicate_id",
                            "message": f"id {json.dumps(rid)} was seen before; the first occurrence wins"},
                            "object": names[rec["at"][0]], "offset": rec["at"][1]})
                        continue
                    results.append(row)
                    t.truncated += bool(row.get("truncated"))
                    u = row_usage(row)
                    t.tokens_in += u.get("prompt_tokens", 0)
                    t.tokens_out += u.get("completion_tokens", 0)
                elif rec["kind"] == "capped":
                    capped.append(row)
                else:
                    errors.append(row)
                if key is not None:
                    seen.add(key)
            name = f"r{r}-{index:05d}"
            if results:
                t.files.append({**_write_file(store, job, "results", name, results, ids), "round": r,
                                "shard": index})
            if errors:
                t.error_files.append({**_write_file(store, job, "errors", name, errors), "round": r,
                                      "shard": index})
            if capped:
                t.capped_files.append({**_write_file(store, job, "capped", name, capped), "round": r,
                                       "shard": index})
            round_rows += len(results)
            round_errors += len(errors)
            t.capped += len(capped)
        t.rows += round_rows
        t.errors += round_errors
        t.rounds.append({"round": r, "shards": len(plan["shards"]), "rows": round_rows, "errors": round_errors})
    if job.spec.judge is not None:
        # The judge's view of each round (rows in, approved, rejected, approval rate).
        from .rounds import round_history

        t.rounds = [{**h.as_status(), "rows": d["rows"], "errors": d["errors"]}
                    for h, d in zip(round_history(job, rounds), t.rounds, strict=True)]
    total = t.rows + t.errors + t.capped
    ratio = t.errors / total if total else 0.0
    limit = job.spec.max_error_ratio
    if limit is not None and ratio > limit:
        raise ErrorRatioExceeded(
            f"{t.errors} of {total} rows failed ({ratio:.1%}), above spec.maxErrorRatio {limit:.1%}; "
            f"error rows are in {layout.join(out_uri, 'errors')}/"
        )
    eff = efficiency(t.done_records)
    manifest: dict[str, Any] = {
        "apiVersion": f"{job.api_version}",
        "kind": "BatchInferenceJobManifest",
        "job": {"name": job.metadata.name, "namespace": job.metadata.namespace, "id": job.job_id},
        "outputUri": out_uri,
        # What the result files hold: JSON lines (plain or OpenAI batch output) or Parquet.
        "format": "openai" if job.spec.input.format == "openai" else job.spec.output.format,
        "compression": job.spec.output.compression,
        "model": {"engine": job.spec.model.engine, "name": job.spec.model.name, "task": job.spec.model.task},
        "judge": job.spec.judge.type if job.spec.judge else None,
        "files": t.files,
        "errorFiles": t.error_files,
        "cappedFiles": t.capped_files,
        "counts": {"rows": t.rows, "errors": t.errors, "capped": t.capped, "duplicates": t.duplicates,
                   "truncated": t.truncated, "inputRows": total,
                   "tokensIn": t.tokens_in, "tokensOut": t.tokens_out},
        "rounds": t.rounds,
        "engine": t.engine(),
        "efficiency": eff,
        "publishedAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    spent = cost(job.spec.workers.price_per_hour, eff["workerSeconds"], t.rows,
                 t.tokens_in + t.tokens_out)
    if spent is not None:
        manifest["cost"] = spent
    store.write_bytes(layout.manifest_uri(job), json.dumps(manifest, indent=2).encode())
    return manifest


def read_manifest(job: BatchInferenceJob) -> dict[str, Any] | None:
    """The published manifest, or None when the job has not been published."""
    store = open_storage(job.spec.output.uri, job.spec.storage.s3)
    try:
        return dict(json.loads(store.read_bytes(layout.manifest_uri(job))))
    except NotFound:
        return None
