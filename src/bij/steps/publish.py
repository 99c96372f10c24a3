"""Publish a finished job: result and error files, then `manifest.json` last, in one atomic write.

Readers trust only the manifest. Publishing keeps the first occurrence of each
id in input order (a retried index or a duplicate pod can leave a row twice; an
id repeated across shards is a bad row), writes result and error files per
shard, and then the manifest with row counts and checksums. The row-level work
runs in bounded-memory passes (`bij.steps.publish_rows`), as worker processes
or in this one; what is done here grows with shards, never with rows. It is
deterministic: publishing again gives the same files and the same manifest.

A publish is three steps: `prepare_publish` (the publish plan), the passes (`run_passes` in this
process, or each as a Job), then `finish_publish` (the manifest, returned as the `Manifest` model);
`bij.local.publish.publish_manifest` runs the three on one machine (`bij publish`).
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from bij.contract import layout
from bij.contract import manifest as manifest_lists
from bij.contract.canary import CanaryFigures, accuracy, estimate
from bij.contract.efficiency import EfficiencySums, cost
from bij.contract.errors import BijError
from bij.contract.fingerprint import PlanRefused, spec_changes
from bij.contract.manifest import (
    CanaryCheck,
    CostFigures,
    DamagedObject,
    EfficiencyFigures,
    EngineFigures,
    Manifest,
    ManifestCounts,
    ManifestJob,
    ManifestModel,
    ManifestRound,
    Partial,
)
from bij.contract.plan import BadPlan, Plan
from bij.contract.publish_plan import PublishPlan
from bij.contract.records import ShardRecord
from bij.contract.spec import BatchInferenceJob
from bij.steps import publish_rows
from bij.steps.progress import DoneIndexes, damage_records, read_in_order, read_records
from bij.steps.removal import Removal, remove_work_files, removed_record, resume_removal
from bij.storage import NotFound, Storage, open_storage
from bij.storage.parquet import id_kind
from bij.storage.writers import writer_for


class PublishError(BijError):
    """The job cannot be published yet: a round or shard has not finished.

    `permanent`: a publish process reported what no retry fixes (exit 42).
    """

    permanent = False


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
    reasoning_tokens: int = 0  # of tokens_out: what result rows' usage counts as reasoning
    rounds: list[dict[str, Any]] = field(default_factory=list)
    # From the shards' completion records: how busy the engine was and what its prefix cache could reuse.
    busy_s: float = 0.0
    steps: int = 0
    occupancy_steps: float = 0.0  # meanOccupancy x steps, summed
    shared_chars: float = 0.0  # prefixShare x promptChars, summed
    prompt_chars: int = 0
    cached_tokens: int = 0  # prompt tokens the engine's prefix cache served
    error_codes: dict[str, int] = field(default_factory=dict)  # error rows by code
    structured_validated: int = 0  # structured answers checked after decoding and valid
    structured_repaired: int = 0  # ... of them valid only on the second grammar backend's try
    structured_violations: int = 0  # ... and published as schema_violation error rows
    # What the engine could not serve at all, once each, by the first (round, shard) that said it:
    # records stream in no set order, and the manifest lists notes in shard order.
    first_noted: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Running sums of the completion records, which stream past and are not kept (memory flat in shards).
    eff: EfficiencySums = field(default_factory=EfficiencySums)
    int_ids: int = 0
    str_ids: int = 0
    ids_counted: bool = True  # every record counted its integer and string ids
    done_rows: int = 0  # rows, error rows and capped rows the records count: the publish plan's buckets
    done_count: int = 0  # completion records added
    # Every record's rows have ids none or generated from their place (`placeIds`): see ids_cannot_repeat.
    place_ids_only: bool = True

    def add_done(self, rec: ShardRecord, where: tuple[int, int] = (0, 0)) -> None:
        self.eff.add(rec)
        rows = int(rec.get("rows", 0)) + int(rec.get("errors", 0)) + int(rec.get("capped", 0))
        self.done_rows += rows
        self.done_count += 1
        if "placeIds" not in rec or int(rec["placeIds"]) != rows:
            self.place_ids_only = False
        if "intIds" in rec and "strIds" in rec:
            self.int_ids += int(rec["intIds"])
            self.str_ids += int(rec["strIds"])
        else:
            self.ids_counted = False
        self.busy_s += float(rec.get("engineBusySeconds", 0.0))
        steps = int(rec.get("engineSteps", 0))
        self.steps += steps
        self.occupancy_steps += float(rec.get("meanOccupancy", 0.0)) * steps
        chars = int(rec.get("promptChars", 0))
        self.prompt_chars += chars
        self.shared_chars += float(rec.get("prefixShare", 0.0)) * chars
        self.cached_tokens += int(rec.get("cachedTokens", 0))
        self.structured_validated += int(rec.get("structuredValidated", 0))
        self.structured_repaired += int(rec.get("structuredRepaired", 0))
        self.structured_violations += int(rec.get("structuredViolations", 0))
        for note in rec.get("notes") or []:
            if note not in self.first_noted or where < self.first_noted[note]:
                self.first_noted[note] = where

    @property
    def total(self) -> int:
        """The rows published: results, error rows and capped rows."""
        return self.rows + self.errors + self.capped

    @property
    def notes(self) -> list[str]:
        return sorted(self.first_noted, key=lambda note: self.first_noted[note])

    def id_kind(self) -> str:
        """'int', 'str' or 'mixed': the Parquet `id` column's type for the whole job, from the workers'
        counts of integer and string ids (a record without them counts as mixed)."""
        return id_kind(self.int_ids, self.str_ids) if self.ids_counted else id_kind(None, None)

    def engine(self) -> EngineFigures:
        return EngineFigures(busy_seconds=round(self.busy_s, 3), steps=self.steps,
                             mean_occupancy=round(self.occupancy_steps / self.steps, 4) if self.steps else None,
                             prefix_share=round(self.shared_chars / self.prompt_chars, 4) if self.prompt_chars
                             else None, cached_tokens=self.cached_tokens)


def load_round_plan(store: Storage, job: BatchInferenceJob, round_no: int) -> Plan:
    uri = layout.round_manifest_uri(job, round_no)
    try:
        # A plan written in parts is read as its head: its parts only where a shard's pieces are wanted.
        return Plan.from_json(store.read_bytes(uri), f"round plan {uri}").with_reader(store.read_bytes)
    except NotFound:
        raise PublishError(f"round {round_no} was never planned") from None
    except BadPlan as e:
        raise PublishError(str(e), permanent=True) from None


def write_publish_plan(store: Storage, job: BatchInferenceJob, plans: list[Plan],
                       done: _Totals, bucket_rows: int,
                       partial: str | None = None) -> tuple[str, PublishPlan]:
    """The plan the row-level passes follow: O(shards) to write, one bucket per `bucket_rows` ids.
    `done`: the sums of the rounds' completion records."""
    rows = done.done_rows
    prefix = layout.publish_prefix(job)
    unit_objects: list[list[int]] = []
    if job.spec.output.partition_by == "input":
        unit_objects = [[] for _ in range(sum(p.shard_total for p in plans))]
        first = 0
        for p in plans:
            for index, shard in p.iter_pieces():
                unit_objects[first + index] = sorted({obj for obj, _, _ in shard})
            first += p.shard_total
        counted = [obj for objs in unit_objects for obj in objs]
        if len(plans) != 1 or len(counted) != len(set(counted)):
            raise PublishError("output.partitionBy input needs one round whose shards hold whole input objects; "
                               f"round 0 of {job.metadata.name} was planned otherwise: start over with "
                               "`bij run --restart` or a new spec.output.uri", permanent=True)
    plan = PublishPlan(
        prefix=prefix,
        output_uri=job.spec.output.uri,
        round_shards=[(p.shard_total, p.round_prefix) for p in plans],
        object_names=[[o.display_name for o in p.objects] for p in plans],
        bucket_rows=bucket_rows,
        buckets=max(1, -(-rows // max(1, bucket_rows))),
        compression=job.spec.output.compression,
        format=job.spec.output.format,
        task=job.spec.model.task,
        judge=job.spec.judge is not None,
        id_kind=done.id_kind() if writer_for(job.spec.output.format).typed_ids else None,
        s3=job.spec.storage.s3.model_dump(by_alias=True, exclude_none=True),
        partial=partial,
        round_plans=[layout.round_manifest_uri(job, r) for r in range(len(plans))] if partial else [],
        partition_by=job.spec.output.partition_by,
        unit_objects=unit_objects,
        partitions=[layout.partition_stem(o.uri, o.name) for o in plans[0].objects] if unit_objects else [],
        unique_ids=ids_cannot_repeat(plans, done, partial),
    )
    uri = layout.publish_plan_uri(prefix)
    store.write_bytes(uri, plan.to_json())
    return uri, plan


def ids_cannot_repeat(plans: list[Plan], done: _Totals, partial: str | None) -> bool:
    """Whether no id of the job can appear twice, so publishing needs no ids and dedupe passes: one round,
    every shard finished, its objects' display names distinct, and every final row's id none or generated
    from its own place (`placeIds` of the completion records: an id `<object>:<offset>` names one place).
    A record of an older worker, without `placeIds`, proves nothing. `done`: the sums of the records."""
    if partial is not None or len(plans) != 1 or done.done_count != plans[0].shard_total:
        return False
    names = [o.display_name for o in plans[0].objects]
    if len(set(names)) != len(names):
        return False
    return done.place_ids_only


def run_passes(plan: PublishPlan) -> None:
    """Run the three row-level passes in this process, every index of each in turn (`bij.local.publish`
    runs them as the Jobs the operator would create, in worker processes)."""
    for pass_name in publish_rows.PASSES:
        for index in range(plan.count(pass_name)):
            publish_rows.run_pass(plan, pass_name, index)


def prepare_publish(job: BatchInferenceJob, rounds: int = 1, bucket_rows: int | None = None,
                    partial: str | None = None) -> tuple[str, PublishPlan]:
    """Check that rounds 0..rounds-1 are whole and made by this spec, and write the publish plan the
    row-level passes follow, with buckets of `bucket_rows` ids (default spec.output.publishBucketRows).
    `partial` (Cancelled or Expired, see `stopping`): shards need not be finished; each is published
    as far as it is durable and the passes count its rows not run. O(shards). Returns the plan's URI
    and the plan."""
    store = open_storage(job.spec.output.uri, job.spec.storage.s3)
    try:
        published = Manifest.parse(store.read_bytes(layout.manifest_uri(job)), layout.manifest_uri(job))
        stopped = published.partial.phase if published.partial is not None else None
    except NotFound:
        stopped = None
    if stopped:
        # Cancelled or expired: its partial manifest is its result for good.
        raise PublishError(f"{job.metadata.name} was {stopped.lower()} and its finished part published to "
                           f"{layout.manifest_uri(job)}: it is never published again; to run it anew, use a new "
                           "spec.output.uri (or bij run --restart)", permanent=True)
    removed = removed_record(store, job)
    if removed is not None:
        removal = resume_removal(store, job)  # one cut short goes on; the manifest stands either way
        raise WorkFilesRemoved(
            f"{job.metadata.name} was published and its work files removed at {removed.get('removedAt')} "
            f"(output.keepIntermediate: false): {layout.manifest_uri(job)} stays valid, but publishing again "
            "would find no rows; to publish anew, run the job into a new output URI", removal)
    t = _Totals()
    plans = [load_round_plan(store, job, r) for r in range(rounds)]
    for r, plan in enumerate(plans):
        changes = spec_changes(plan.job, job)
        if changes:
            # The manifest must name what made the rows, never a spec edited since.
            raise PlanRefused(f"cannot publish: {'; '.join(changes)} since round {r} was planned; undo the change, "
                              "or start over with `bij run --restart`")
    _read_done(store, plans, t, partial=partial is not None)  # time O(shards), memory flat
    return write_publish_plan(store, job, plans, t, bucket_rows or job.spec.output.publish_bucket_rows,
                              partial)


def _read_done(store: Storage, plans: list[Plan], t: _Totals, partial: bool = False) -> None:
    """Add every round's completion records to `t`, streamed (`progress.read_records`: a bounded pool of
    reads over the listing), and check that each shard has one (unless `partial`): which ones do is a
    bitmap, never the records."""
    for r, plan in enumerate(plans):
        done = DoneIndexes()
        for index, rec in read_records(store, layout.done_folder(plan.round_prefix)):
            if index < plan.shard_total:
                done.add(index)
                t.add_done(rec, (r, index))
        missing = done.first_missing(plan.shard_total)
        if missing is not None and not partial:
            raise PublishError(f"round {r} shard {missing} has not finished")


def finish_publish(job: BatchInferenceJob, rounds: int, pplan: PublishPlan) -> Manifest:
    """After the passes: the manifest from the completion records and the passes' per-shard summaries,
    read one at a time into running sums; its file lists, where longer than `manifest.PART_FILES`, go
    into manifest parts written as they fill. The manifest is written last in one atomic write; then the
    work files go (keepIntermediate false): where that fails, the manifest returned says so in
    `work_files_removal` (never written into manifest.json)."""
    out_uri = job.spec.output.uri
    store = open_storage(out_uri, job.spec.storage.s3)
    # A folder of its own for each publish's parts: a manifest already published keeps reading its own.
    lists = manifest_lists.PartWriter(lambda path, body: store.write_bytes(layout.join(out_uri, path), body),
                                      time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(4))
    plans = [load_round_plan(store, job, r) for r in range(rounds)]
    t = _Totals()
    _read_done(store, plans, t, partial=pplan.partial is not None)
    not_run = _read_summaries(store, pplan, plans, t, lists)
    if job.spec.judge is not None:
        # The judge's view of each round (rows in, approved, rejected, approval rate).
        from bij.steps.progress import round_history

        t.rounds = [{**h.as_status(), "rows": d["rows"], "errors": d["errors"]}
                    for h, d in zip(round_history(job, rounds), t.rounds, strict=True)]
    _check_error_ratio(job, t, pplan)
    manifest = _manifest(job, store, plans, pplan, t, not_run, lists)
    return _write_manifest(store, job, manifest, plans, pplan)


def _read_summaries(store: Storage, pplan: PublishPlan, plans: list[Plan], t: _Totals,
                    lists: manifest_lists.PartWriter) -> int:
    """Add the passes' per-shard summaries to `t` (and each round's rows to `t.rounds`), their file lists to
    `lists`; the rows not run (a partial publish)."""
    not_run = 0
    t.rounds = [{"round": r, "shards": p.shard_total, "rows": 0, "errors": 0} for r, p in enumerate(plans)]
    # In unit order (the file lists are), a bounded number of reads in flight: one round trip each on S3.
    uris = (layout.publish_summary_uri(pplan.prefix, unit) for unit in range(pplan.unit_count))
    for data in read_in_order(store, uris):
        summary = json.loads(data)
        c = summary["counts"]
        for key in manifest_lists.LISTS:
            lists.add(key, summary[key])
        t.rows += c["rows"]
        t.errors += c["errors"]
        t.capped += c["capped"]
        t.duplicates += c["duplicates"]
        t.truncated += c["truncated"]
        t.tokens_in += c["tokensIn"]
        t.tokens_out += c["tokensOut"]
        t.reasoning_tokens += int(c.get("reasoningTokens", 0))
        for code, n in (c.get("errorCodes") or {}).items():
            t.error_codes[code] = t.error_codes.get(code, 0) + int(n)
        t.rounds[summary["round"]]["rows"] += c["rows"]
        t.rounds[summary["round"]]["errors"] += c["errors"]
        not_run += int(c.get("notRun", 0))
    return not_run


def _check_error_ratio(job: BatchInferenceJob, t: _Totals, pplan: PublishPlan) -> None:
    """ErrorRatioExceeded when more rows failed than spec.maxErrorRatio allows."""
    total = t.total
    ratio = t.errors / total if total else 0.0
    limit = job.spec.max_error_ratio
    # A stopped job publishes what it has, whatever share of it failed: that was asked for.
    if limit is not None and ratio > limit and pplan.partial is None:
        raise ErrorRatioExceeded(
            f"{t.errors} of {total} rows failed ({ratio:.1%}), above spec.maxErrorRatio {limit:.1%}; "
            f"error rows are in {layout.join(job.spec.output.uri, 'errors')}/"
        )


def _counts(t: _Totals, not_run: int, pplan: PublishPlan) -> ManifestCounts:
    """The manifest's row and token counts."""
    return ManifestCounts.model_validate({
        "rows": t.rows, "errors": t.errors, "capped": t.capped, "duplicates": t.duplicates,
        "truncated": t.truncated, "inputRows": t.total + not_run,
        "tokensIn": t.tokens_in, "tokensOut": t.tokens_out, "reasoningTokens": t.reasoning_tokens,
        **({"notRun": not_run} if pplan.partial else {}),
        # Error rows by code; structured answers checked after decoding (bij.engines.structured).
        "errorCodes": dict(sorted(t.error_codes.items())),
        "structured": {"validated": t.structured_validated, "repaired": t.structured_repaired,
                       "violations": t.structured_violations}})


def _manifest(job: BatchInferenceJob, store: Storage, plans: list[Plan], pplan: PublishPlan, t: _Totals,
              not_run: int, lists: manifest_lists.PartWriter) -> Manifest:
    """The manifest of the sums in `t`, with its efficiency, cost and canary figures (its last parts written)."""
    eff = t.eff.result()
    spent = cost(job.spec.workers.price_per_hour, eff["workerSeconds"], t.rows,
                 t.tokens_in + t.tokens_out, job.spec.workers.nodes_per_lane,
                 pool_prices=job.spec.workers.pool_prices, by_pool=eff.get("workerSecondsByPool"))
    checked = canary_check(job, store, plans)
    counts = _counts(t, not_run, pplan)
    return Manifest(
        api_version=f"{job.api_version}",
        kind="BatchInferenceJobManifest",
        job=ManifestJob(name=job.metadata.name, namespace=job.metadata.namespace, id=job.job_id),
        output_uri=job.spec.output.uri,
        # What the result files hold: JSON lines (plain or OpenAI batch output), Parquet or CSV.
        format="openai" if job.spec.input.format == "openai" else job.spec.output.format,
        compression=job.spec.output.compression,
        model=ManifestModel(engine=job.spec.model.engine, name=job.spec.model.name, task=job.spec.model.task),
        judge=job.spec.judge.type if job.spec.judge else None,
        **lists.finish(),
        counts=counts,
        # What the engine could not serve at all (a grammar its tokenizer cannot write), said once each.
        notes=t.notes,
        rounds=[ManifestRound.model_validate(r) for r in t.rounds],
        **({"partial": partial_fields(pplan.partial, t.rows, t.errors, not_run)} if pplan.partial else {}),
        # input.onDamagedObject errorRow: objects published without what lay behind their break.
        damaged_objects=[DamagedObject(round=r, shard=rec.shard, object=rec.name, offset=rec.offset,
                                       reason=rec.reason, message=rec.describe())
                         for r in range(len(plans)) for rec in damage_records(job, r)],
        engine=t.engine(),
        efficiency=EfficiencyFigures.model_validate(eff),
        published_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **({"cost": CostFigures.model_validate(spent)} if spent is not None else {}),
        **({"canary": checked} if checked is not None else {}),
    )


def _write_manifest(store: Storage, job: BatchInferenceJob, manifest: Manifest, plans: list[Plan],
                    pplan: PublishPlan) -> Manifest:
    """Write the manifest (last, one atomic write), delete the parts of the one it replaced, then remove the
    work files (keepIntermediate false); a failed removal is said in the manifest returned."""
    before = _published_parts(store, job)
    store.write_bytes(layout.manifest_uri(job), manifest.to_json())
    for path in sorted(set(before) - set(manifest.part_paths())):
        store.delete(layout.join(job.spec.output.uri, path))  # parts of the manifest this one replaced
    if not job.spec.output.keep_intermediate:
        removal = remove_work_files(store, job, work_folders(plans, pplan))
        if removal.error is not None:
            # The manifest stands: a failed removal is a warning beside it, never a failed job.
            return manifest.model_copy(update={"work_files_removal": removal.as_result()})
    return manifest


def canary_check(job: BatchInferenceJob, store: Storage, plans: list[Plan]) -> CanaryCheck | None:
    """With spec.canary: the canary's estimate of round 0 (from the figures its step kept) against round 0's
    completion records, streamed; None without a canary, or where its figures were never kept."""
    if job.spec.canary is None or not plans:
        return None
    try:
        figures = CanaryFigures.from_status(json.loads(store.read_bytes(layout.canary_uri(job))))
    except NotFound:
        return None
    from bij.steps.progress import stream_records

    w = job.spec.workers
    round0 = CanaryFigures.of(rec for _, rec in stream_records(job, 0))
    est = estimate(figures, round0.bytes, min(plans[0].lane_count, w.parallelism), w.price_per_hour,
                   w.nodes_per_lane)
    return accuracy(est, round0, figures.shards, w.price_per_hour, w.nodes_per_lane)


def _published_parts(store: Storage, job: BatchInferenceJob) -> list[str]:
    """The parts of the manifest published before this one, if any."""
    try:
        return Manifest.parse(store.read_bytes(layout.manifest_uri(job))).part_paths()
    except (NotFound, ValueError, manifest_lists.BadManifest):
        return []


def work_folders(plans: list[Plan], publish_plan: PublishPlan) -> list[str]:
    """What only publishing needed: the shards' durable logs, judge rounds' inputs and the publish
    passes' id buckets. Plans, completion records and shard summaries stay (O(shards))."""
    folders = [layout.join(p.round_prefix, sub) + "/" for p in plans for sub in ("shards", "rejected")]
    return folders + [layout.join(publish_plan.prefix, sub) + "/" for sub in ("ids", "losers")]


def partial_fields(phase: str, completed: int, failed: int, not_run: int) -> Partial:
    """What marks a manifest partial: the phase the job stopped in and its rows completed (results),
    failed (error rows) and not run (no worker finished them), which add up to the input's rows."""
    reason = "spec.cancel" if phase == "Cancelled" else "spec.deadlineSeconds"
    return Partial.model_validate({"phase": phase, "reason": reason,
                                   "counts": {"completed": completed, "failed": failed, "notRun": not_run}})


class WorkFilesRemoved(PublishError):
    """The job was published and its work files removed (output.keepIntermediate false): it cannot be
    published again. `removal`: a removal cut short that was resumed here, and how that ended."""

    def __init__(self, message: str = "", removal: Removal | None = None, *, permanent: bool | None = None):
        super().__init__(message, permanent=permanent)
        self.removal = removal


def read_manifest(job: BatchInferenceJob) -> Manifest | None:
    """The published manifest, or None when the job has not been published."""
    store = open_storage(job.spec.output.uri, job.spec.storage.s3)
    try:
        return Manifest.parse(store.read_bytes(layout.manifest_uri(job)), layout.manifest_uri(job))
    except NotFound:
        return None
