"""What the workers have finished: their per-shard completion records."""

from __future__ import annotations

from bij.contract import layout
from bij.contract.plan import Plan
from bij.contract.records import DamageRecord, ShardRecord, decode_shard_record
from bij.contract.rounds import RoundStats, summarize
from bij.contract.spec import BatchInferenceJob
from bij.storage import NotFound, open_storage


def shard_records(job: BatchInferenceJob, round_no: int) -> dict[int, ShardRecord]:
    """Completion records of a round's finished shards, by index (rows, errors, tokensIn, tokensOut, seconds).
    BadRecord (a permanent StorageError naming the object) when one is not a shard record."""
    return _records(job, round_no, "done")


def count_done(job: BatchInferenceJob, round_no: int) -> int:
    """How many of a round's shards have a completion record: one listing, no object read."""
    folder = layout.done_folder(layout.round_prefix(job, round_no))
    names = (o.uri.rsplit("/", 1)[-1] for o in open_storage(folder, job.spec.storage.s3).list(folder))
    return sum(1 for n in names if n.endswith(".json") and n[:-5].isdigit())


def live_records(job: BatchInferenceJob, round_no: int) -> dict[int, ShardRecord]:
    """Counts of every shard that has any: finished shards' completion records, and the
    progress records running shards rewrite every BIJ_PROGRESS_SECONDS (30 s by default).
    BadRecord when one is not a shard record."""
    return {**_records(job, round_no, "progress"), **_records(job, round_no, "done")}


def round_history(job: BatchInferenceJob, rounds: int) -> list[RoundStats]:
    """Statistics of rounds 0..rounds-1 from storage (every shard of them must be done)."""
    out = []
    for r in range(rounds):
        uri = layout.round_manifest_uri(job, r)
        plan = Plan.from_json(open_storage(uri, job.spec.storage.s3).read_bytes(uri), f"round plan {uri}")
        out.append(summarize(r, len(plan.shards), shard_records(job, r)))
    return out


def damage_records(job: BatchInferenceJob, round_no: int) -> list[DamageRecord]:
    """The input objects a round's workers found damaged, by shard: one listing of a folder that is
    empty but for them. BadRecord when one is not a damage record."""
    folder = layout.damaged_folder(layout.round_prefix(job, round_no))
    store = open_storage(folder, job.spec.storage.s3)
    out = []
    for obj in sorted(store.list(folder), key=lambda o: o.uri):
        try:
            out.append(DamageRecord.from_json(store.read_bytes(obj.uri), f"damage record {obj.uri}"))
        except NotFound:  # listed, then gone (the shard finished after its object was replaced)
            continue
    return out


def _records(job: BatchInferenceJob, round_no: int, kind: str) -> dict[int, ShardRecord]:
    prefix = layout.round_prefix(job, round_no)
    folder = layout.done_folder(prefix) if kind == "done" else layout.progress_folder(prefix)
    store = open_storage(folder, job.spec.storage.s3)
    out: dict[int, ShardRecord] = {}
    for obj in store.list(folder):
        name = obj.uri.rsplit("/", 1)[-1]
        if not name.endswith(".json") or not name[:-5].isdigit():
            continue
        try:
            data = store.read_bytes(obj.uri)
        except NotFound:  # listed, then gone before it could be read
            continue
        out[int(name[:-5])] = decode_shard_record(data, f"{'completion' if kind == 'done' else 'progress'} record "
                                                        f"{obj.uri}")
    return out
