"""Where a job's state lives under its output URI. One place, so nobody computes paths twice.

    <output>/manifest.json                          published last; readers trust only this
    <output>/results/r<round>-<index>.jsonl[.zst]  published result files
    <output>/errors/r<round>-<index>.jsonl[.zst]   published error rows
    <output>/results/<input name>.jsonl[.zst]      ... with output.partitionBy input: one per input object
                                                    (`partition_stem`), .parquet / .csv[.zst] for Parquet / CSV results
    <output>/_bij/owner.json                        which job owns this output (namespace, name, id)
    <output>/_bij/<job_id>/round-<r>/shards.json    the round plan (written once)
    <output>/_bij/<job_id>/round-<r>/plan/<lane>-<chunk>.json  a part of a large round plan
    <output>/_bij/<job_id>/round-<r>/shards/<index>/   durable logs of one shard (one per writer, zstd frames)
    <output>/_bij/<job_id>/round-<r>/done/<index>.json  a shard's completion record
    <output>/_bij/<job_id>/round-<r>/progress/<index>.json  a running shard's live counts
    <output>/_bij/<job_id>/round-<r>/lanes/<lane>/    which worker holds each shard lane <lane> owns, which are
                                                    done, whether the lane is (bij.worker.lanes)
    <output>/_bij/<job_id>/round-<r>/claims/<index>-<generation>.json  the same, in a round begun before that
    <output>/_bij/<job_id>/round-<r>/rejected/<index>.jsonl  judge rounds: rejected rows, next round's input
    <output>/_bij/<job_id>/publish/                 the publish passes' plan, ids files, losers and shard summaries
    <output>/_bij/<job_id>/removed.json             what was removed after publishing (output.keepIntermediate)

The operator knows the job; a worker knows only its round plan, so everything under a round
takes the plan's round prefix (`round_prefix(job, r)`, recorded in the plan as `roundPrefix`),
and everything under the publish folder takes the publish plan's prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # annotations only: a publish pass never loads the spec model
    from bij.contract.spec import BatchInferenceJob


def join(base: str, *parts: str) -> str:
    """Join URI parts with single slashes."""
    out = base.rstrip("/")
    for p in parts:
        out += "/" + p.strip("/")
    return out


def object_path(uri: str) -> str:
    """An object's URI without the query string of a signed http(s) URL (which names no part of the object):
    what its name and suffix (.jsonl, .zst) are read from."""
    return uri.split("?", 1)[0] if uri.startswith(("https://", "http://")) else uri


# Input suffixes a partitioned file's name drops (the planner's input suffixes, and .parquet).
PARTITION_SUFFIXES = (".jsonl.zst", ".ndjson.zst", ".json.zst", ".jsonl", ".ndjson", ".json", ".parquet")


def partition_stem(uri: str, name: str | None) -> str:
    """An input object's relative name (`PlanObject.name`) without its input suffix: the name its
    published files have under results/, errors/ and capped/ with output.partitionBy input, before
    the result's own suffix (`data/a/x.jsonl` under the input folder `data/` -> `a/x`). One
    https:// object (or one without a relative name) is named by its file name."""
    if name is None or uri.startswith(("https://", "http://")):
        name = object_path(uri).rsplit("/", 1)[-1]
    for suffix in PARTITION_SUFFIXES:
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[:-len(suffix)]
    return name


def partition_problem(stem: str) -> str | None:
    """Why a partition stem cannot name a file under the output folder, or None."""
    parts = stem.split("/")
    if stem.startswith("/") or any(p in ("", ".", "..") for p in parts):
        return "it is not a plain relative path (empty, '.' or '..' parts)"
    return None


class PathClash(NamedTuple):
    """Two published paths that cannot both be files: `first` and `second` index them (first < second);
    `file` is one of them, and `inside` the other when it lies in a folder named `file` (None: the same path)."""

    first: int
    second: int
    file: str
    inside: str | None


def path_clash(paths: Sequence[str]) -> PathClash | None:
    """The first two of `paths` that cannot both be written: the same path, or one of them a folder of
    the other (`x.jsonl` and `x.jsonl/y.jsonl`: a file system holds one of the two, and the second write
    fails). None when every path can be a file of its own. O(total length of the paths)."""
    files: dict[str, int] = {}
    folders: dict[str, tuple[int, str]] = {}  # every folder some path lies in: the first such path
    for i, path in enumerate(paths):
        if path in files:
            return PathClash(files[path], i, path, None)
        if path in folders:
            j, under = folders[path]
            return PathClash(j, i, path, under)
        folder = ""
        for part in path.split("/")[:-1]:
            folder = f"{folder}/{part}" if folder else part
            if folder in files:
                return PathClash(files[folder], i, folder, path)
            folders.setdefault(folder, (i, path))
        files[path] = i
    return None


# --- the job ------------------------------------------------------------------------------------


def state_prefix(job: BatchInferenceJob) -> str:
    return join(job.spec.output.uri, "_bij", job.job_id)


def round_prefix(job: BatchInferenceJob, round_no: int) -> str:
    return join(state_prefix(job), f"round-{round_no}")


def round_manifest_uri(job: BatchInferenceJob, round_no: int) -> str:
    return join(round_prefix(job, round_no), "shards.json")


def canary_uri(job: BatchInferenceJob) -> str:
    """The canary step's figures (spec.canary): the manifest compares the estimate made from them with round 0."""
    return join(round_prefix(job, 0), "canary.json")


def owner_uri(job: BatchInferenceJob) -> str:
    return join(job.spec.output.uri, "_bij", "owner.json")


def removed_uri(job: BatchInferenceJob) -> str:
    """The record of the work files removed after a successful publish; its presence refuses a republish."""
    return join(state_prefix(job), "removed.json")


def local_status_uri(job: BatchInferenceJob) -> str:
    """`bij run`'s status, kept whole as the API server keeps a bij's, published or not: what `bij status`
    shows, and what the next `bij run` takes up."""
    return join(state_prefix(job), "local-status.json")


def manifest_uri(job: BatchInferenceJob) -> str:
    return join(job.spec.output.uri, "manifest.json")


def publish_prefix(job: BatchInferenceJob) -> str:
    """The publish passes' working folder: their plan, id buckets and per-shard summaries."""
    return join(state_prefix(job), "publish")


# --- one round, from its plan's round prefix ------------------------------------------------------


def plan_part_uri(round_prefix: str, lane: int, chunk: int) -> str:
    """A part of a round plan written in parts (`contract.plan`): some of one lane's own shards."""
    return join(round_prefix, "plan", f"{lane:05d}-{chunk:05d}.json")


def shard_prefix(round_prefix: str, index: int) -> str:
    """The folder of a shard's durable logs (one log per writer)."""
    return join(round_prefix, "shards", f"{index:05d}")


def done_folder(round_prefix: str) -> str:
    return join(round_prefix, "done") + "/"


def done_uri(round_prefix: str, index: int) -> str:
    """A shard's completion record: written once, when every row of the shard is durable."""
    return join(round_prefix, "done", f"{index:05d}.json")


def progress_folder(round_prefix: str) -> str:
    return join(round_prefix, "progress") + "/"


def progress_uri(round_prefix: str, index: int) -> str:
    """A running shard's live counts (rewritten now and then; the done record supersedes it)."""
    return join(round_prefix, "progress", f"{index:05d}.json")


def damaged_folder(round_prefix: str) -> str:
    return join(round_prefix, "damaged") + "/"


def damaged_uri(round_prefix: str, index: int) -> str:
    """The damaged input object a shard met (`records.DamageRecord`): the object, where it breaks."""
    return join(round_prefix, "damaged", f"{index:05d}.json")


def claims_folder(round_prefix: str) -> str:
    return join(round_prefix, "claims") + "/"


def claim_uri(round_prefix: str, shard: int, generation: int) -> str:
    """Claim `generation` of a shard in a round begun before claims were kept by lane (`lane_claim_uri`)."""
    return join(round_prefix, "claims", f"{shard:05d}-{generation:05d}.json")


def lane_folder(round_prefix: str, lane: int) -> str:
    """What the round knows of the shards lane `lane` owns (shard % lanes == lane), so that a lane
    starts, resumes and watches by listing one lane's folder, never the round's: the claims of those
    shards, a marker per shard done, the lane's completion marker, and pointers to the shards of other
    lanes that a process of this lane held (`bij.worker.lanes`)."""
    return join(round_prefix, "lanes", f"{lane:05d}") + "/"


def lane_claim_uri(round_prefix: str, lane: int, shard: int, generation: int) -> str:
    """Claim `generation` of a shard of lane `lane` (created once, conditionally; the newest holds it)."""
    return lane_folder(round_prefix, lane) + f"{shard:05d}-{generation:05d}.json"


def lane_done_uri(round_prefix: str, lane: int, shard: int) -> str:
    """A marker that a shard is done, in the folder of its lane (and of the lane that worked it): a
    hint for listings; `done_uri` stays the record of completion."""
    return lane_folder(round_prefix, lane) + f"{shard:05d}.done"


def lane_held_uri(round_prefix: str, lane: int, shard: int, generation: int) -> str:
    """A pointer, in the folder of lane `lane`, to claim `generation` of a shard of another lane that a
    process of `lane` took: its replacement finds the shard without listing that lane."""
    return lane_folder(round_prefix, lane) + f"{shard:05d}-{generation:05d}.held"


def lane_complete_uri(round_prefix: str, lane: int) -> str:
    """Every shard of lane `lane` is done, and so of the lanes after it round the lanes' ring (see
    `bij.worker.lanes.ring`), `n` lanes in all counting it ({"lanes": n})."""
    return lane_folder(round_prefix, lane) + "complete.json"


def rejected_folder(round_prefix: str) -> str:
    """A judge round's rejected rows: the next round's input."""
    return join(round_prefix, "rejected") + "/"


def rejected_uri(round_prefix: str, index: int) -> str:
    return join(round_prefix, "rejected", f"{index:05d}.jsonl")


# --- publishing, from the publish plan's prefix ---------------------------------------------------


def publish_plan_uri(prefix: str) -> str:
    return join(prefix, "plan.json")


def publish_ids_uri(prefix: str, unit: int) -> str:
    """The ids of one shard (unit) with their places, grouped by bucket behind an index of byte offsets
    (`bij.steps.publish_rows.IdsHeader`): one object per shard, whatever the buckets."""
    return join(prefix, "ids", f"{unit:05d}.ids")


def publish_bucket_ids_uri(prefix: str, unit: int, bucket: int) -> str:
    """Before one ids file per shard: the ids of one shard in one bucket (one zstd frame), read only
    where a pass 1 of an older version left them."""
    return join(prefix, "ids", f"{unit:05d}", f"{bucket:05d}.jsonl.zst")


def publish_order_uri(prefix: str, unit: int) -> str:
    """Before one ids file per shard: whether the shard's log was in input order (its ids file says it now)."""
    return join(prefix, "ids", f"{unit:05d}", "order.json")


def publish_losers_folder(prefix: str) -> str:
    return join(prefix, "losers") + "/"


def publish_losers_uri(prefix: str, bucket: int) -> str:
    """The places of one bucket's duplicate ids that lost to an earlier occurrence (only a bucket with some)."""
    return join(prefix, "losers", f"{bucket:05d}.json")


def publish_summary_uri(prefix: str, unit: int) -> str:
    """A shard's summary after the write pass: counts, files and checksums."""
    return join(prefix, "shards", f"{unit:05d}.json")
