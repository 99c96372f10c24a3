"""A job's output as planning checks and takes it: not overlapping the input (`check_places`), owned by
this job (`claim_output`, `output_standing`), its stale temp files removed; and started over
(`reset_output`)."""

from __future__ import annotations

import os
from typing import Literal

from bij.contract import layout
from bij.contract import manifest as manifest_lists
from bij.contract.fingerprint import PlanRefused
from bij.contract.globs import split_glob
from bij.contract.records import OwnerRecord
from bij.contract.spec import OVERLAP_MESSAGE, BatchInferenceJob
from bij.contract.spec_io import uris_overlap
from bij.storage import NotFound, Storage, open_storage

# A temp file of an atomic write untouched this long was left by a killed writer.
STALE_TEMP_SECONDS = 600.0


def take_output(job: BatchInferenceJob, store: Storage) -> None:
    """Claim the output for this job (`claim_output`), and remove the temp files of atomic writes that a
    kill cut short (file:// only; a PUT leaves none)."""
    claim_output(job, store)
    store.remove_stale_temp(job.spec.output.uri, STALE_TEMP_SECONDS)


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
        parts = manifest_lists.Manifest.parse(store.read_bytes(layout.manifest_uri(job))).part_paths()
    except (NotFound, ValueError, manifest_lists.BadManifest):
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
