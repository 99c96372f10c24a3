"""Cut a round's input into shards from object sizes alone, and write the round plan once.

Planning never reads rows beyond each JSONL object's first (the pass-through columns'
check, `check_first_rows`): it is O(number of objects). A shard is a list of
pieces ``[object index, start, end)``. A plain JSONL piece owns every line whose
first byte lies in ``[start, end)`` — the reader aligns to line starts — so byte
ranges can be cut anywhere and no line is read twice or lost. A `.zst` object
cannot be entered mid-stream, so it is always one whole piece. A Parquet
object is cut between row groups, whose sizes come from its footer (one ranged
read at its end); its pieces are ``[object index, first group, end group)``.
Small objects share a shard until it reaches `targetShardBytes`; a round is cut into
at least `shardsPerLane` shards per lane where `minShardBytes` allows. The round's Job
has one index per lane (`lanes`: workers.parallelism, at most one per shard); each lane
works many shards with its model loaded once (see bij.worker.lanes).
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Any, Literal

import orjson
import zstandard

from bij.contract import layout
from bij.contract import manifest as manifest_lists
from bij.contract.canary import canary_rows, spread_count
from bij.contract.columns import clash_message, first_clash
from bij.contract.errors import BijError
from bij.contract.fingerprint import PlanRefused, digest, input_changes, row_fields, spec_changes
from bij.contract.globs import glob_matches, split_glob
from bij.contract.plan import PLAN_VERSION, BadPlan, Fingerprint, JudgeMode, Plan, PlanObject
from bij.contract.records import DamageRecord, OwnerRecord
from bij.contract.rounds import RoundMode, round_mode
from bij.contract.spec import OVERLAP_MESSAGE, BatchInferenceJob, CanarySpec, job_to_dict, uris_overlap
from bij.steps.progress import round_history
from bij.storage import NotFound, ObjectInfo, Storage, StorageError, StorageRefused, open_storage
from bij.storage.parquet import SUFFIX as PARQUET_SUFFIX
from bij.storage.parquet import Footer, read_footer
from bij.storage.writers import writer_for

INPUT_SUFFIXES = (".jsonl", ".ndjson", ".json", ".jsonl.zst", ".ndjson.zst", ".json.zst")
# A temp file of an atomic write untouched this long was left by a killed writer.
STALE_TEMP_SECONDS = 600.0

Piece = tuple[int, int, int]  # (object index, start, end)


class PlanError(BijError):
    """The input cannot be planned (nothing there, wrong files); names the URI.

    `permanent`: the same on every retry (`bij run` exits 42); otherwise an outage that may pass.
    """

    def __init__(self, message: str, permanent: bool = True):
        super().__init__(message, permanent=permanent)


@dataclass(frozen=True)
class RoundPlan:
    manifest_uri: str
    shard_count: int
    objects: int
    # The round's size in the unit workers report progress in: bytes, or rows for Parquet objects.
    total_bytes: int
    unit: str = "bytes"
    # The round Job's indexes: each a worker that loads the model once and works many shards.
    lanes: int = 0
    # Round 0 with spec.canary: how many of its shards, spread over it, run alone first (`canary_shard_count`).
    canary_shards: int = 0


def _round_plan(uri: str, plan: Plan) -> RoundPlan:
    objects = plan.objects
    if any(o.row_groups is not None for o in objects):
        return RoundPlan(uri, plan.shard_total, len(objects),
                         sum(sum(o.row_groups or []) for o in objects), "rows", plan.lane_count)
    return RoundPlan(uri, plan.shard_total, len(objects), sum(o.size for o in objects), lanes=plan.lane_count)


def _with_canary(job: BatchInferenceJob, rp: RoundPlan, plan: Plan) -> RoundPlan:
    if plan.round != 0 or job.spec.canary is None or not plan.shard_total:
        return rp
    return dataclasses.replace(rp, canary_shards=canary_shard_count(job, job.spec.canary, plan))


def canary_shard_count(job: BatchInferenceJob, spec: CanarySpec, plan: Plan) -> int:
    """How many of round 0's shards the canary runs (`canary_shards`: spread over the round): enough to hold
    `canary_rows` rows. Rows are counted for Parquet (row groups) and estimated for JSONL from the mean line of
    the first object's first `SAMPLE_BYTES` (uncompressed), so the canary runs whole shards: more rows than
    asked, or a few less where other lines are shorter than those."""
    objects = plan.objects
    shard_rows = [0.0] * plan.shard_total
    if any(o.row_groups is not None for o in objects):
        for index, pieces in plan.iter_pieces():
            shard_rows[index] = float(sum(sum((objects[o].row_groups or [])[a:b]) for o, a, b in pieces))
    else:
        head = objects[0].uri
        per_row = mean_row_bytes(open_storage(head, job.spec.storage.s3), head, is_compressed(head))
        for index, pieces in plan.iter_pieces():
            shard_rows[index] = sum(b - a for _, a, b in pieces) / per_row
    return spread_count(shard_rows, canary_rows(spec, sum(shard_rows)))


def is_compressed(uri: str) -> bool:
    return layout.object_path(uri).endswith(".zst")


def input_objects(objects: list[ObjectInfo], input_uri: str = "", parquet: bool = False) -> list[ObjectInfo]:
    """The objects that are input rows: JSONL files, plain or zstd (or Parquet files); empty ones
    skipped, and so is anything whose name or folder (at any depth below `input_uri`) starts with
    "_" or "." (`_temporary/`, `.staging/`, `_bij/`, `_SUCCESS`)."""
    suffixes = (PARQUET_SUFFIX,) if parquet else INPUT_SUFFIXES
    base = input_uri.rstrip("/")
    out = []
    for o in objects:
        if not layout.object_path(o.uri).endswith(suffixes) or o.size <= 0:
            continue
        rel = o.uri[len(base):] if base and o.uri.startswith(base) else o.uri.rsplit("/", 1)[-1]
        if any(part.startswith((".", "_")) for part in rel.split("/") if part):
            continue
        out.append(o)
    return out


def plan_shards(sizes: list[tuple[int, bool]], target_bytes: int,
                groups: dict[int, list[int]] | None = None, whole: bool = False) -> list[list[Piece]]:
    """Shards for objects given as (size, compressed), in object order. Pure and O(objects + shards).

    An object in `groups` (Parquet: the compressed bytes of each row group) is cut between
    row groups, and its pieces are ``[object, first group, end group)``. With `whole`
    (output.partitionBy input) no object is cut: each is one piece of one shard.
    """
    if whole:
        whole_groups = {i: [sum(g)] for i, g in (groups or {}).items()}
        cut = plan_shards([(size, True) for size, _ in sizes], target_bytes, whole_groups)
        # A Parquet object's one piece spans all its row groups.
        return [[(i, 0, len(groups[i])) if groups and i in groups else (i, a, b) for i, a, b in shard]
                for shard in cut]
    shards: list[list[Piece]] = []
    current: list[Piece] = []
    fill = 0
    for idx, (size, compressed) in enumerate(sizes):
        if size <= 0:
            continue
        if groups is not None and idx in groups:
            start = 0
            for g, group_bytes in enumerate(groups[idx]):
                if fill > 0 and fill + group_bytes > target_bytes:
                    if g > start:
                        current.append((idx, start, g))
                    shards.append(current)
                    current, fill, start = [], 0, g
                fill += group_bytes
            if len(groups[idx]) > start:
                current.append((idx, start, len(groups[idx])))
            if fill >= target_bytes:
                shards.append(current)
                current, fill = [], 0
            continue
        if compressed:
            if current and fill + size > target_bytes:
                shards.append(current)
                current, fill = [], 0
            current.append((idx, 0, size))
            fill += size
            if fill >= target_bytes:
                shards.append(current)
                current, fill = [], 0
            continue
        offset = 0
        while offset < size:
            take = min(size - offset, target_bytes - fill)
            current.append((idx, offset, offset + take))
            offset += take
            fill += take
            if fill >= target_bytes:
                shards.append(current)
                current, fill = [], 0
    if current:
        shards.append(current)
    return shards


def round_target_bytes(job: BatchInferenceJob, round_no: int, total_bytes: int) -> int:
    """Shard size for a round: at most targetShardBytes, and small enough for `shardsPerLane`
    shards per lane, so the shards still running at a round's end are short and a lane that
    is done takes over the rest; never below minShardBytes (or targetShardBytes, if smaller).
    A judge round after the first, holding only the rows rejected before, is cut the same way."""
    sharding = job.spec.sharding
    target = sharding.target_shard_bytes
    share = -(-total_bytes // (sharding.shards_per_lane * job.spec.workers.parallelism))
    return max(min(target, sharding.min_shard_bytes), min(target, share))


def lanes_for(job: BatchInferenceJob, shards: int) -> int:
    """The round Job's indexes: workers.parallelism, never more than there are shards."""
    return min(job.spec.workers.parallelism, shards)


def round_inputs(job: BatchInferenceJob, round_no: int) -> str:
    """Where a round's input rows are: the spec's input for round 0, else the last round's rejects."""
    if round_no == 0:
        return job.spec.input.uri
    return layout.rejected_folder(layout.round_prefix(job, round_no - 1))


def is_parquet_round(job: BatchInferenceJob, round_no: int) -> bool:
    """Round 0 of a Parquet job reads Parquet; later rounds read the JSONL rows a judge rejected."""
    return round_no == 0 and job.spec.input.format == "parquet"


def read_footers(job: BatchInferenceJob, objects: list[ObjectInfo]) -> dict[int, Footer]:
    """Each Parquet object's footer (a ranged read at its end, no row read), checked for the
    columns the spec names: a missing text column is a planning error that names the field."""
    inp = job.spec.input
    footers: dict[int, Footer] = {}
    for i, o in enumerate(objects):
        try:
            footer = read_footer(open_storage(o.uri, job.spec.storage.s3), o.uri, o.size)
        except (OSError, ValueError) as e:  # pyarrow: ArrowInvalid is a ValueError, a bad footer
            raise PlanError(f"spec.input.uri: {o.uri} is not a readable Parquet file: {e}") from None
        wanted = [inp.text_field] + ([inp.messages_field] if inp.messages_field else [])
        # With spec.prompt the prompt comes from the template's columns: a row missing one is its error row.
        if job.spec.prompt is None and not any(c in footer.columns for c in wanted):
            field = "spec.input.textField" + (" / spec.input.messagesField" if inp.messages_field else "")
            raise PlanError(f"{field}: {o.uri} has no column {' or '.join(map(repr, wanted))} "
                            f"(its columns: {', '.join(footer.columns)})")
        clash = first_clash(footer.columns, inp.consumed_columns()) if inp.carries_every_column() else None
        if clash is not None:
            raise PlanError(f"spec.input.passThrough: {clash_message(clash, f'in {o.uri}')}")
        footers[i] = footer
    return footers


# How much of an object's start the planner reads for its first row (a longer first row is left
# to the worker, which makes any row with a clashing column an error row naming it).
FIRST_ROW_BYTES = 1 << 20


def check_first_rows(job: BatchInferenceJob, objects: list[ObjectInfo]) -> None:
    """Refuse a JSONL job whose rows would carry a column named like a result field (input.passThrough
    unset: every column is carried), from the first row of each object: one short read per object."""
    inp = job.spec.input
    if not inp.carries_every_column():
        return
    skip = inp.consumed_columns()
    for o in objects:
        line = first_line(open_storage(o.uri, job.spec.storage.s3), o.uri, is_compressed(o.uri))
        try:
            row = orjson.loads(line) if line else None
        except ValueError:
            continue  # a bad first row is the worker's to report, as an error row
        clash = first_clash(row, skip) if isinstance(row, dict) else None
        if clash is not None:
            raise PlanError(f"spec.input.passThrough: {clash_message(clash, f'line 1 of {o.uri}')}")


def read_head(storage: Storage, uri: str, compressed: bool, limit: int, stop_at_line: bool = False) -> bytes | None:
    """An object's first `limit` bytes or more (decompressed for .zst; all of it when shorter), read in 64 KiB
    blocks; with `stop_at_line` only until its first newline. None when it cannot be read here."""
    try:
        with storage.open_read(uri) as raw:
            stream: Any = zstandard.ZstdDecompressor().stream_reader(raw) if compressed else raw
            head = b""
            while len(head) < limit:
                part = stream.read(64 << 10)
                if not part:
                    break
                head += part
                if stop_at_line and b"\n" in part:
                    break
            return head
    except (StorageError, zstandard.ZstdError, OSError):
        return None


def first_line(storage: Storage, uri: str, compressed: bool) -> bytes | None:
    """An object's first line (decompressed for .zst), or None when it is longer than FIRST_ROW_BYTES
    or cannot be read here (the worker reads it and says what is wrong)."""
    head = read_head(storage, uri, compressed, FIRST_ROW_BYTES, stop_at_line=True)
    if head is None:
        return None
    if b"\n" in head:
        return head.split(b"\n", 1)[0]
    return head if len(head) < FIRST_ROW_BYTES else None


# What the canary's estimate of rows per byte reads of the input's first object.
SAMPLE_BYTES = 256 << 10


def mean_row_bytes(storage: Storage, uri: str, compressed: bool) -> float:
    """The mean length of the lines in an object's first SAMPLE_BYTES (decompressed for .zst; a .zst shard's
    bytes are compressed, so there it counts fewer rows than there are); 1 KiB when none can be read."""
    head = read_head(storage, uri, compressed, SAMPLE_BYTES)
    if head is None:
        return 1024.0
    lines = head.count(b"\n")
    if not lines:
        return float(max(len(head), 1024))
    return (head.rindex(b"\n") + 1) / lines


def build_plan(job: BatchInferenceJob, round_no: int, objects: list[ObjectInfo], input_uri: str,
               mode: RoundMode | None = None, footers: dict[int, Footer] | None = None) -> Plan:
    """The round plan document (shards.json) for these input objects (with Parquet footers, if any)."""
    mode = mode or round_mode(job.spec.judge, [])
    sizes = [(o.size, is_compressed(o.uri)) for o in objects]
    groups = {i: f.group_bytes for i, f in footers.items()} if footers else None
    shards = plan_shards(sizes, round_target_bytes(job, round_no, sum(s for s, _ in sizes)), groups,
                         whole=partitioned(job, round_no))
    folder, _ = split_glob(input_uri)
    base = folder if folder.endswith("/") else folder.rsplit("/", 1)[0] + "/"
    return Plan(
        version=PLAN_VERSION,
        round=round_no,
        created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        round_prefix=layout.round_prefix(job, round_no),
        input_uri=input_uri,
        judge_mode=JudgeMode(mode=mode.mode, final=mode.final),
        job=job,
        objects=[
            PlanObject(uri=o.uri, size=o.size, name=o.uri[len(base):] if o.uri.startswith(base) else o.uri,
                       row_groups=footers[i].group_rows if footers and i in footers else None, version=o.version)
            for i, o in enumerate(objects)
        ],
        fingerprint=Fingerprint(spec=digest(row_fields(job_to_dict(job)["spec"])),
                                input=digest([[o.uri, o.size, o.version] for o in objects])),
        shards=[[tuple(p) for p in s] for s in shards],
        lanes=lanes_for(job, len(shards)),
    )


def partitioned(job: BatchInferenceJob, round_no: int) -> bool:
    """Whether a round's objects are published one file each (output.partitionBy input: round 0 only,
    which the spec holds to: no judge rounds then)."""
    return round_no == 0 and job.spec.output.partition_by == "input"


def check_partition_names(plan: Plan) -> None:
    """With output.partitionBy input: refuse (`PlanRefused`: no retry helps, renaming or a narrower input
    does) a plan whose input objects cannot each have their own published files: a name that is no plain
    relative path, two that publish the same file, or one whose file would be a folder of another's
    (`c.jsonl` -> results/c.jsonl.zst, `c.jsonl.zst/d.jsonl` -> results/c.jsonl.zst/d.jsonl.zst).
    Found here, from the names alone, rather than by the write pass after every row was computed."""
    stems = []
    for o in plan.objects:
        stem = layout.partition_stem(o.uri, o.name)
        problem = layout.partition_problem(stem)
        if problem:
            raise PlanRefused(f"spec.output.partitionBy: input: {o.uri} cannot name a result file: {problem}")
        stems.append(stem)
    output = plan.spec.output
    results = writer_for(output.format)
    # capped/ files are written as errors/ files are: the same names.
    suffixes = {"results": results.suffix(output.compression),
                "errors": writer_for(results.error_format).suffix(output.compression)}
    for folder, suffix in suffixes.items():
        clash = layout.path_clash([f"{folder}/{stem}{suffix}" for stem in stems])
        if clash is None:
            continue
        both = f"{plan.objects[clash.first].uri} and {plan.objects[clash.second].uri}"
        what = (f"would both publish {clash.file}" if clash.inside is None else
                f"cannot both be published: {clash.file} would be both a file and the folder of {clash.inside}")
        raise PlanRefused(f"spec.output.partitionBy: input: {both} {what}: rename one, or narrow spec.input.uri")


def plan_round(job: BatchInferenceJob, round_no: int = 0) -> RoundPlan:
    """Plan a round and write its shards.json, or read the one already written (idempotent).

    A plan already written must match the job: the same row-deciding spec fields and, for
    round 0, the same input objects; otherwise `PlanRefused` says what changed. The output must
    not overlap the input and must belong to this job (`claim_output`); nothing is written before
    the new plan passed its checks.
    """
    uri = layout.round_manifest_uri(job, round_no)
    store = open_storage(uri, job.spec.storage.s3)
    check_places(job)
    input_uri = round_inputs(job, round_no)
    if store.exists(uri):
        take_output(job, store)
        planned = read_plan(store, uri)
        changes = spec_changes(planned.job, job)
        if not changes and partitioned(job, round_no):
            check_partition_names(planned)  # a plan an earlier version wrote, before it checked these
        if round_no == 0 and not changes:
            current = _list_input(job, input_uri, is_parquet_round(job, 0))
            changes = input_changes(planned.objects, current)
            replaced = take_replacements(store, planned, current) if changes else None
            if replaced is not None:
                write_plan(store, uri, replaced)
                return _with_canary(job, _round_plan(uri, replaced), replaced)
        if changes:
            raise PlanRefused(
                f"{'; '.join(changes)} since round {round_no} was planned ({uri}): rows made before and after "
                "would be mixed. Undo the change, or start over: `bij run --restart` (deletes the plan and "
                "durable results under " + layout.state_prefix(job) + "/) or choose a new spec.output.uri")
        wanted = job.spec.input.on_damaged_object
        if planned.spec.input.on_damaged_object != wanted:
            # Workers read the spec from the plan: a rerun that says otherwise of damaged objects (errorRow,
            # to publish after a round failed on one) tells them so.
            planned = planned.model_copy(update={"job": planned.job.model_copy(update={"spec": planned.spec.model_copy(
                update={"input": planned.spec.input.model_copy(update={"on_damaged_object": wanted})})})})
            write_plan(store, uri, planned)
        return _with_canary(job, _round_plan(uri, planned), planned)
    parquet = is_parquet_round(job, round_no)
    objects = _list_input(job, input_uri, parquet)
    if not objects and round_no == 0:
        looked = PARQUET_SUFFIX if parquet else ", ".join(INPUT_SUFFIXES)
        raise PlanError(f"spec.input.uri: no input at {input_uri} (looked for non-empty {looked} files)")
    footers = read_footers(job, objects) if parquet else None
    if round_no == 0 and not parquet:
        check_first_rows(job, objects)
    # A judge round's mode depends on how the rounds before it went.
    mode = round_mode(job.spec.judge, round_history(job, round_no) if round_no else [])
    plan = build_plan(job, round_no, objects, input_uri, mode, footers)
    if partitioned(job, round_no):
        check_partition_names(plan)
    # Only a job that passed every check writes: a refused one leaves its output as it was.
    take_output(job, store)
    write_plan(store, uri, plan)
    return _with_canary(job, _round_plan(uri, plan), plan)


def take_output(job: BatchInferenceJob, store: Storage) -> None:
    """Claim the output for this job (`claim_output`), and remove the temp files of atomic writes that a
    kill cut short (file:// only; a PUT leaves none)."""
    claim_output(job, store)
    store.remove_stale_temp(job.spec.output.uri, STALE_TEMP_SECONDS)


def take_replacements(store: Storage, planned: Plan, current: list[ObjectInfo]) -> Plan | None:
    """The plan with its damaged objects' replacements, when the only input changes are objects that a
    round failed on (`DamageRecord`, input.onDamagedObject: fail) put back; else None.

    The rows made before the break stay: the worker checks that the replacement begins with the
    bytes they were made from (`PlanObject.prefix`) and resumes after them.
    """
    damaged: dict[int, DamageRecord] = {}
    for o in store.list(layout.damaged_folder(planned.round_prefix)):
        try:
            rec = DamageRecord.from_json(store.read_bytes(o.uri), f"damage record {o.uri}")
        except NotFound:
            continue
        if rec.mode == "fail" and rec.sha256 and 0 <= rec.object < len(planned.objects):
            damaged[rec.object] = rec
    now = {o.uri: o for o in current}
    if not damaged or set(now) != {o.uri for o in planned.objects}:
        return None
    objects = list(planned.objects)
    for i, before in enumerate(planned.objects):
        after = now[before.uri]
        if (after.size, after.version) == (before.size, before.version):
            continue
        found = damaged.get(i)
        if found is None or found.version != before.version:
            return None
        objects[i] = before.model_copy(update={"size": after.size, "version": after.version,
                                               "prefix": (found.offset, found.sha256)})
    # A .zst object is one whole piece of one shard: only its end moves.
    shards: list[list[Piece]] = [[] for _ in range(planned.shard_total)]
    try:
        for index, shard in planned.iter_pieces():
            shards[index] = [(obj, start, objects[obj].size if objects[obj] is not planned.objects[obj] else end)
                             for obj, start, end in shard]
    except (BadPlan, NotFound) as e:
        raise PlanError(f"round plan {planned.round_prefix}: {e}") from None
    fingerprint = planned.fingerprint and planned.fingerprint.model_copy(
        update={"input": digest([[o.uri, o.size, o.version] for o in objects])})
    # Written anew as a whole, and cut into parts again by `write_plan`.
    return planned.model_copy(update={"objects": objects, "shards": shards, "fingerprint": fingerprint,
                                      "shard_count": None, "part_shards": None})


def read_plan(store: Storage, uri: str) -> Plan:
    """A round plan already written (its parts read on demand); one that cannot be read is a planning error
    no retry fixes."""
    try:
        return Plan.from_json(store.read_bytes(uri), f"round plan {uri}").with_reader(store.read_bytes)
    except BadPlan as e:
        raise PlanError(str(e)) from None


def write_plan(store: Storage, uri: str, plan: Plan) -> None:
    """Write a round plan: a large one as its parts first, then its head (`Plan.split`), so that the
    head's presence means every part is there. A head read back is written alone (its parts stand)."""
    head, parts = plan.split()
    for part_uri, body in parts.items():
        store.write_bytes(part_uri, body)
    store.write_bytes(uri, head.to_json())


def _list_input(job: BatchInferenceJob, input_uri: str, parquet: bool = False) -> list[ObjectInfo]:
    base, pattern = split_glob(input_uri)
    try:
        listed = open_storage(base, job.spec.storage.s3).list(base)
        if pattern is not None:
            listed = [o for o in listed if glob_matches(pattern, o.uri[len(base):])]
        objects = input_objects(listed, base, parquet)
    except StorageRefused as e:  # stays a refusal: the bij fails rather than waiting for input to appear
        raise StorageRefused(f"spec.input.uri: cannot list {input_uri}: {e}") from None
    except StorageError as e:
        raise PlanError(f"spec.input.uri: cannot list {input_uri}: {e}", permanent=e.permanent) from None
    check_versions(objects)
    return objects


def check_versions(objects: list[ObjectInfo]) -> None:
    """Refuse an input object without a version (an https:// server that sends neither a strong ETag nor
    Last-Modified): shards read it at different times, and nothing could tell when it changed between
    them, so rows of two versions could be published as one input."""
    for o in objects:
        if o.version is None:
            raise PlanError(f"spec.input.uri: {o.uri} has no version to plan against: the server sends neither a "
                            "strong ETag nor a Last-Modified date, so a change between two shards' reads could not "
                            "be told. Serve it with an ETag (S3, GCS and common web servers do), or copy it to "
                            "s3:// or file://")


def local_place(uri: str) -> str:
    """A URI with a file:// path made absolute, links resolved (the place it names on this machine)."""
    if uri.startswith("file://"):
        return "file://" + os.path.realpath(uri[len("file://"):]) + ("/" if uri.endswith("/") else "")
    return uri


def check_places(job: BatchInferenceJob) -> None:
    """Refuse an output that is the input, lies inside it or contains it, with file:// paths resolved
    (the spec check compares the URIs as written)."""
    # A glob's input is everything it may match: the folder listed for it.
    if uris_overlap(local_place(split_glob(job.spec.input.uri)[0]), local_place(job.spec.output.uri)):
        raise PlanRefused(f"{OVERLAP_MESSAGE} (input {job.spec.input.uri}, output {job.spec.output.uri})")


def claim_output(job: BatchInferenceJob, store: Storage) -> None:
    """Record this job as the owner of its output URI, or refuse when another job owns it.

    The owner is the job's namespace and name. The same name with another id is the same job
    made again (deleted and re-applied): it takes the output over and starts a new generation,
    and the old generation's manifest is removed first, so no reader trusts it over new files.
    """
    uri = layout.owner_uri(job)
    mine = OwnerRecord(job.metadata.namespace, job.metadata.name, job.job_id)
    body = mine.to_json()
    if store.create(uri, body):
        return
    try:
        owner = OwnerRecord.from_json(store.read_bytes(uri))
    except (NotFound, ValueError):
        store.write_bytes(uri, body)  # removed or damaged in between: ours now
        return
    if not owner.same_job(mine):
        raise PlanRefused(
            f"spec.output.uri: {job.spec.output.uri} belongs to BatchInferenceJob "
            f"{owner.namespace}/{owner.name} (recorded in {uri}); two jobs must not share an "
            "output: choose another spec.output.uri, or delete that job's output first")
    if owner.id != mine.id:
        delete_manifest(job, store)
        store.write_bytes(uri, body)


def delete_manifest(job: BatchInferenceJob, store: Storage) -> None:
    """Delete the job's manifest, then the manifest parts it names (a manifest of many files)."""
    try:
        parts = manifest_lists.part_paths(orjson.loads(store.read_bytes(layout.manifest_uri(job))))
    except (NotFound, ValueError):
        parts = []
    store.delete(layout.manifest_uri(job))
    for path in parts:
        store.delete(layout.join(job.spec.output.uri, path))


def output_standing(job: BatchInferenceJob, store: Storage) -> Literal["ours", "unclaimed", "refused"]:
    """Where the job's output stands with the plan step's checks, read only: "ours" once `claim_output`
    recorded this job as its owner, "refused" when it overlaps the input or another job owns it, else
    "unclaimed". A StorageError when it cannot be read."""
    try:
        check_places(job)
    except PlanRefused:
        return "refused"
    try:
        owner = OwnerRecord.from_json(store.read_bytes(layout.owner_uri(job)))
    except NotFound:
        return "unclaimed"
    except ValueError:
        return "refused"  # damaged: the plan step decides (`claim_output` takes it over)
    mine = OwnerRecord(job.metadata.namespace, job.metadata.name, job.job_id)
    return "ours" if owner.same_job(mine) and owner.id == mine.id else "refused"


def reset_output(job: BatchInferenceJob) -> int:
    """Start the job over: delete its manifest, then its plans and durable results (how many objects).
    An output that overlaps the input is refused first (`PlanRefused`): those would be the input's files."""
    check_places(job)
    store = open_storage(job.spec.output.uri, job.spec.storage.s3)
    delete_manifest(job, store)  # first: no reader may trust it over what follows
    objects = store.list(layout.state_prefix(job) + "/")
    for o in objects:
        store.delete(o.uri)
    return len(objects)


def plan_shards_for(job: BatchInferenceJob, round_no: int = 0) -> int:
    """How many shards a round would have, without writing anything (for `bij render`)."""
    input_uri = round_inputs(job, round_no)
    parquet = is_parquet_round(job, round_no)
    objects = _list_input(job, input_uri, parquet)
    footers = read_footers(job, objects) if parquet else None
    return build_plan(job, round_no, objects, input_uri, footers=footers).shard_total
