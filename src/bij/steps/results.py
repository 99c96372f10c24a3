"""What `bij results` and `bij status` read: published rows and a job's summary, without knowing the formats.

`bij results MANIFEST_URI` streams the rows the manifest lists as JSON lines (or one
Parquet or CSV stream), checking each file's sha256 against the manifest first; `bij status`
says in a few lines where a job stands: rounds, shards, rows, errors, truncated, cost.
Both read `file://` and `s3://` alike, through the one storage interface. Their command-line handlers are
`bij.cli.results`.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import shutil
import tempfile
from collections.abc import Iterator
from typing import IO, Any

from bij.contract import layout
from bij.contract import manifest as manifest_lists
from bij.contract.canary import describe_estimate
from bij.contract.efficiency import fmt_money, status_fields
from bij.contract.errors import BijError
from bij.contract.manifest import CostFigures, EfficiencyFigures, Manifest, ManifestFile
from bij.contract.plan import Plan
from bij.contract.records import ShardRecord
from bij.contract.spec import BatchInferenceJob
from bij.steps.progress import damage_records, live_records
from bij.storage import NotFound, Storage, StorageError, open_storage
from bij.storage.parquet import BeyondInt64, id_kind, is_int64, read_table, results_table
from bij.storage.writers import CSV, PARQUET, ResultShape, ResultWriter, writer_of_path

FILE_LISTS = {"results": "files", "errors": "errorFiles", "capped": "cappedFiles"}
CSV_BATCH_ROWS = 10_000  # rows encoded at a time as `bij results --format csv` writes


class ResultsError(BijError):
    """The results cannot be read: no manifest there, or a file that does not match it."""


def manifest_location(uri: str) -> str:
    """The manifest's URI: `uri` itself when it names one, else `<uri>/manifest.json`."""
    return uri if uri.endswith(".json") else layout.join(uri, "manifest.json")


def load_manifest(uri: str, s3: Any) -> tuple[Storage, str, Manifest]:
    """(storage, base URI of the listed paths, manifest) for a manifest URI or an output URI, read with
    the job's S3 settings (see `open_storage`)."""
    where = manifest_location(uri)
    store = open_storage(where, s3)
    try:
        manifest = Manifest.parse(store.read_bytes(where), where)
    except NotFound:
        raise ResultsError(f"no manifest at {where}: the job has not been published (or the URI is wrong)") from None
    except manifest_lists.BadManifest as e:
        raise ResultsError(str(e)) from None
    return store, where.rsplit("/", 1)[0] + "/", manifest


def read_file(store: Storage, base: str, entry: ManifestFile) -> bytes:
    """A listed file's bytes, after checking them against the manifest's sha256."""
    uri = base + entry.path
    data = store.read_bytes(uri)
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry.sha256:
        raise ResultsError(f"{uri}: sha256 {digest} does not match the manifest's {entry.sha256}; "
                           "the file changed after it was published")
    return data


def listed_files(store: Storage, base: str, manifest: Manifest, which: str) -> Iterator[ManifestFile]:
    """The entries of one of the manifest's file lists (results, errors or capped), from its parts where it
    has them (`contract.manifest`), one part in memory at a time."""
    try:
        yield from manifest_lists.iter_listed(manifest, FILE_LISTS[which], lambda path: store.read_bytes(base + path))
    except manifest_lists.BadManifestPart as e:
        raise ResultsError(str(e)) from None
    except NotFound as e:
        raise ResultsError(f"a part of the manifest at {base} is missing: {e}") from None


def file_writer(entry: ManifestFile) -> ResultWriter:
    """The writer of a listed file, known by its suffix."""
    try:
        return writer_of_path(entry.path)
    except ValueError as e:
        raise ResultsError(str(e)) from None


def iter_rows(uri: str, which: str, s3: Any) -> Iterator[dict[str, Any]]:
    """Every published row of `which` (results, errors or capped), in manifest order."""
    store, base, manifest = load_manifest(uri, s3)
    for entry in listed_files(store, base, manifest, which):
        data = read_file(store, base, entry)
        yield from file_writer(entry).rows(data, entry.path)


def write_jsonl(uri: str, which: str, out: IO[bytes], s3: Any) -> int:
    """Stream the rows as JSON lines; JSONL files are copied line for line. Returns the row count."""
    store, base, manifest = load_manifest(uri, s3)
    n = 0
    for entry in listed_files(store, base, manifest, which):
        data = read_file(store, base, entry)
        for line in file_writer(entry).lines(data, entry.path):
            out.write(line + b"\n")
            n += 1
    return n


def results_id_kind(uri: str, s3: Any) -> str:
    """The `id` column's type for all of a job's results ('int', 'str' or 'mixed'), from one pass over them."""
    ints = strs = 0
    for row in iter_rows(uri, "results", s3):
        ints += is_int64(row.get("id"))
        strs += not is_int64(row.get("id"))
    return id_kind(ints, strs)


def write_parquet(uri: str, out: IO[bytes], s3: Any) -> int:
    """All result rows as one Parquet stream (the schema `output.format: parquet` writes)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    store, base, manifest = load_manifest(uri, s3)
    if manifest.format == "openai":
        raise ResultsError("OpenAI batch output lines stay JSON lines: use --format jsonl")
    files = listed_files(store, base, manifest, "results")
    first = next(files, None)
    task = manifest.model.task or "embed"
    judged = manifest.judge is not None
    ids = "mixed"
    if first is not None and file_writer(first) is not PARQUET:
        ids = results_id_kind(uri, s3)  # results not in Parquet: the stream has one schema
    writer: Any = None
    n = 0
    sink = pa.PythonFile(out, mode="w")
    try:
        for entry in itertools.chain([first] if first is not None else [], files):
            data = read_file(store, base, entry)
            fmt = file_writer(entry)
            if fmt is PARQUET:  # its table as written
                table = read_table(data)
            else:
                try:
                    table = results_table(list(fmt.rows(data, entry.path)), task, ids, judged)
                except BeyondInt64 as e:
                    raise ResultsError(f"{entry.path}: {e}; read the results as JSON lines") from None
            if writer is None:
                writer = pq.ParquetWriter(sink, table.schema, compression="zstd")
            try:
                table = table.cast(writer.schema)
            except (ValueError, TypeError, NotImplementedError):  # pyarrow: ArrowInvalid is a ValueError
                raise ResultsError(
                    f"{entry.path} has other columns than the files before it ({', '.join(table.column_names)} "
                    f"against {', '.join(writer.schema.names)}): its rows carry other pass-through columns "
                    "(input.passThrough); read the files one by one, or as JSON lines") from None
            writer.write_table(table)
            n += table.num_rows
        if writer is None:  # nothing published: still a valid, empty file
            pq.write_table(results_table([], task, ids, judged), sink)
    finally:
        if writer is not None:
            writer.close()
    return n


def write_csv(uri: str, out: IO[bytes], s3: Any) -> int:
    """All result rows as one uncompressed CSV stream, with the columns and cells `output.format: csv` writes
    (bij.storage.writers.csv), from results in any format. It reads the results twice (the `id` column's
    type, then the rows) and spools them on local disk, as publishing a CSV file does: the header, which
    names every pass-through column, comes before the first row."""
    _, _, manifest = load_manifest(uri, s3)
    if manifest.format == "openai":
        raise ResultsError("OpenAI batch output lines stay JSON lines: use --format jsonl")
    shape = ResultShape(manifest.model.task or "embed", results_id_kind(uri, s3), manifest.judge is not None, "none")
    stream = CSV.stream(shape, tempfile.TemporaryFile, CSV_BATCH_ROWS)
    n = 0
    try:
        for row in iter_rows(uri, "results", s3):
            stream.add(row)
            n += 1
        shutil.copyfileobj(stream.finish(), out)
    finally:
        stream.discard()
    return n


# --- bij status -------------------------------------------------------------------------------------


def manifest_summary(manifest: Manifest) -> list[str]:
    """A published job in a few lines."""
    c = manifest.counts
    lines = [f"{manifest.job.name or '?'}: published {manifest.published_at or '?'} to "
             f"{manifest.output_uri or '?'}"]
    shards = sum(r.shards for r in manifest.rounds)
    lines.append(f"  rounds    {len(manifest.rounds)}, {shards} shards")
    lines.append(f"  rows      {c.rows:,} results ({manifest.file_count('files')} "
                 f"{manifest.format} files), {c.errors:,} errors, "
                 f"{c.truncated:,} truncated, {c.capped:,} capped, "
                 f"{c.duplicates:,} duplicates")
    lines.append(f"  tokens    {c.tokens_in:,} in, {c.tokens_out:,} out")
    partial = manifest.partial
    if partial is not None:
        pc = partial.counts
        lines.append(f"  partial   {partial.phase.lower()} ({partial.reason or '?'}): "
                     f"{pc.completed:,} completed, {pc.failed:,} failed, "
                     f"{pc.not_run:,} not run")
    for o in manifest.damaged_objects:
        lines.append(f"  damaged   {o.message}: one corrupt_input error row, the rest of it unread")
    lines += _efficiency_lines(manifest.efficiency, manifest.cost)
    return lines


def _efficiency_lines(eff: EfficiencyFigures | None, spent: CostFigures | None) -> list[str]:
    lines = []
    if eff:
        lines.append(f"  workers   {eff.worker_seconds:,.1f} s ({eff.model_loads} model loads, "
                     f"{eff.model_load_seconds:,.1f} s), "
                     f"engine busy {eff.engine_busy_fraction:.0%}, {eff.rows_per_second_per_worker:,.1f} rows/s "
                     f"and {eff.tokens_per_second_per_worker:,.0f} tokens/s per worker")
    if spent:
        lines.append(f"  cost      {fmt_money(spent.total)} at {spent.price_per_hour:g}/hour per worker: "
                     f"{fmt_money(spent.per_million_rows)} per million rows, "
                     f"{fmt_money(spent.per_million_tokens)} per million tokens")
    return lines


def job_summary(job: BatchInferenceJob) -> list[str]:
    """A job from its spec: the manifest's summary once published, else its rounds so far."""
    try:
        _, _, manifest = load_manifest(layout.manifest_uri(job), job.spec.storage.s3)
        return manifest_summary(manifest)
    except ResultsError:
        pass
    store = open_storage(job.spec.output.uri, job.spec.storage.s3)
    lines = [f"{job.metadata.name}: not published yet ({job.spec.output.uri})"]
    lines += local_status_lines(store, job)
    records: list[ShardRecord] = []
    current: list[ShardRecord] = []
    r = 0
    while store.exists(layout.round_manifest_uri(job, r)):
        plan = Plan.from_json(store.read_bytes(layout.round_manifest_uri(job, r)), layout.round_manifest_uri(job, r))
        current = list(live_records(job, r).values())
        records += current
        done = sum(1 for rec in current if "finishedAt" in rec)
        rows = sum(int(rec.get("rows") or 0) for rec in current)
        errors = sum(int(rec.get("errors") or 0) for rec in current)
        truncated = sum(int(rec.get("truncated") or 0) for rec in current)
        lines.append(f"  round {r}   {done}/{plan.shard_total} shards done ({plan.lane_count} lanes), {rows:,} rows, "
                     f"{errors:,} errors, {truncated:,} truncated")
        for rec in damage_records(job, r):
            what = ("the round failed there; the rows before it are kept: replace the object and run again"
                    if rec.mode == "fail" else "one corrupt_input error row, the rest of it unread")
            lines.append(f"  damaged   {rec.describe()}: {what}")
        r += 1
    if r == 0:
        lines.append("  no round planned: run `bij run` (or apply it to a cluster)")
        return lines
    fields = status_fields(records, current, None, None, job.spec.workers.price_per_hour,
                           job.spec.workers.nodes_per_lane, job.spec.workers.pool_prices)
    spent = fields.get("cost")
    lines += _efficiency_lines(EfficiencyFigures.model_validate(fields["efficiency"]), None)
    if spent:
        lines.append(f"  cost      {fmt_money(spent['total'])} so far at {spent['pricePerHour']:g}/hour per worker")
    return lines


def local_status_lines(store: Any, job: BatchInferenceJob) -> list[str]:
    """The phase, failure reason and message of its last `bij run`, as `kubectl get bij` shows a cluster's
    (a retry or a failure says its step, pod and cause); none where it kept none."""
    try:
        kept = json.loads(store.read_bytes(layout.local_status_uri(job)))
    except (StorageError, OSError, ValueError):
        return []
    if not isinstance(kept, dict) or not kept.get("phase"):
        return []
    reason = next((c.get("reason") for c in kept.get("conditions") or [] if isinstance(c, dict)
                   and c.get("type") == "Failed" and c.get("status") == "True"), None)
    phase = f"{kept['phase']} ({reason})" if reason else str(kept["phase"])
    lines = [f"  phase     {phase}: {kept.get('message') or ''}".rstrip(": ")]
    canary = kept.get("canary")
    if isinstance(canary, dict) and canary.get("verdict"):
        line = (f"  canary    {canary['verdict']}: {int(canary.get('rows') or 0):,} rows, "
                f"{int(canary.get('errors') or 0):,} errors, {int(canary.get('lengthCuts') or 0):,} cut at maxTokens")
        if isinstance(canary.get("estimate"), dict):
            line += f"; round 0 whole: {describe_estimate(canary['estimate'])}"
        lines.append(line)
    return lines
