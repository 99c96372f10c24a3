"""Where a job's state lives under its output URI. One place, so nobody computes paths twice.

    <output>/manifest.json                          published last; readers trust only this
    <output>/results/r<round>-<index>.jsonl[.zst]  published result files
    <output>/errors/r<round>-<index>.jsonl[.zst]   published error rows
    <output>/_bij/owner.json                        which job owns this output (namespace, name, id)
    <output>/_bij/<job_id>/round-<r>/shards.json    the round plan (written once)
    <output>/_bij/<job_id>/round-<r>/shards/<index>/   durable logs of one shard (one per writer)
    <output>/_bij/<job_id>/round-<r>/done/<index>.json  a shard's completion record
    <output>/_bij/<job_id>/round-<r>/progress/<index>.json  a running shard's live counts
    <output>/_bij/<job_id>/round-<r>/input/        judge rounds: rejected rows, next round's input
    <output>/_bij/<job_id>/publish/                 the publish passes' plan, id buckets and shard summaries
    <output>/_bij/<job_id>/removed.json             what was removed after publishing (output.keepIntermediate)
"""

from __future__ import annotations

from .spec import BatchInferenceJob


def join(base: str, *parts: str) -> str:
    """Join URI parts with single slashes."""
    out = base.rstrip("/")
    for p in parts:
        out += "/" + p.strip("/")
    return out


def state_prefix(job: BatchInferenceJob) -> str:
    return join(job.spec.output.uri, "_bij", job.job_id)


def round_prefix(job: BatchInferenceJob, round_no: int) -> str:
    return join(state_prefix(job), f"round-{round_no}")


def round_manifest_uri(job: BatchInferenceJob, round_no: int) -> str:
    return join(round_prefix(job, round_no), "shards.json")


def owner_uri(job: BatchInferenceJob) -> str:
    return join(job.spec.output.uri, "_bij", "owner.json")


def removed_uri(job: BatchInferenceJob) -> str:
    """The record of the work files removed after a successful publish; its presence refuses a republish."""
    return join(state_prefix(job), "removed.json")


def manifest_uri(job: BatchInferenceJob) -> str:
    return join(job.spec.output.uri, "manifest.json")
