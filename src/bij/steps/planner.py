"""Plan a round: its input cut into shards from object sizes alone, the round plan written once.

Planning never reads rows beyond each JSONL object's first (the pass-through columns'
check, `plan_input.check_first_rows`): it is O(number of objects). A shard (`sharding`) is a list of
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
import time
from dataclasses import dataclass

from bij.contract import layout
from bij.contract.canary import canary_rows, spread_count
from bij.contract.fingerprint import PlanRefused, digest, input_changes, row_fields, spec_changes
from bij.contract.globs import split_glob
from bij.contract.plan import PLAN_VERSION, BadPlan, Fingerprint, JudgeMode, Plan, PlanObject
from bij.contract.records import DamageRecord
from bij.contract.rounds import RoundMode, round_mode
from bij.contract.spec import BatchInferenceJob, CanarySpec, job_to_dict
from bij.steps.output_claim import check_places, take_output
from bij.steps.plan_input import (
    INPUT_SUFFIXES,
    PlanError,
    check_first_rows,
    is_compressed,
    list_input,
    mean_row_bytes,
    read_footers,
)
from bij.steps.progress import round_history
from bij.steps.sharding import Piece, lanes_for, plan_shards, round_target_bytes
from bij.storage import NotFound, ObjectInfo, Storage, open_storage
from bij.storage.parquet import SUFFIX as PARQUET_SUFFIX
from bij.storage.parquet import Footer
from bij.storage.writers import writer_for


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


def round_inputs(job: BatchInferenceJob, round_no: int) -> str:
    """Where a round's input rows are: the spec's input for round 0, else the last round's rejects."""
    if round_no == 0:
        return job.spec.input.uri
    return layout.rejected_folder(layout.round_prefix(job, round_no - 1))


def is_parquet_round(job: BatchInferenceJob, round_no: int) -> bool:
    """Round 0 of a Parquet job reads Parquet; later rounds read the JSONL rows a judge rejected."""
    return round_no == 0 and job.spec.input.format == "parquet"


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
            current = list_input(job, input_uri, is_parquet_round(job, 0))
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
    objects = list_input(job, input_uri, parquet)
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


def plan_shards_for(job: BatchInferenceJob, round_no: int = 0) -> int:
    """How many shards a round would have, without writing anything (for `bij render`)."""
    input_uri = round_inputs(job, round_no)
    parquet = is_parquet_round(job, round_no)
    objects = list_input(job, input_uri, parquet)
    footers = read_footers(job, objects) if parquet else None
    return build_plan(job, round_no, objects, input_uri, footers=footers).shard_total
