"""Removing a published job's work files (output.keepIntermediate false), which cannot fail the job.

The manifest is written before removal starts, so the results stand whatever happens here: a storage
error becomes a `Removal` with an `error` (a warning on the bij, a Condition and an Event), never a
failed step. The listing is streamed a page at a time and deleted a page to a request (S3
DeleteObjects, 1,000 keys), so memory does not grow with the number of work objects. The
`RemovedRecord` is written first and kept up as it goes; a removal cut short is resumed by the next
publish or run (a missing key is no error). For very large jobs, a bucket lifecycle rule on the
`_bij/` prefix can do this instead (`output.keepIntermediate: true`; docs/operations.md).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

from bij.contract import layout
from bij.contract.manifest import RemovalFailed
from bij.contract.records import RemovedRecord, now_stamp
from bij.contract.spec import BatchInferenceJob
from bij.storage import NotFound, Storage, StorageError

REASON = "output.keepIntermediate is false: work files go once the manifest is published"
# The record is rewritten after this many pages, so that a removal cut short says how far it got.
SAVE_EVERY_PAGES = 20


@dataclass(frozen=True)
class Removal:
    """How a removal ended: `record` as last written, and `error` when it stopped short (what is left
    stays under `left`, and the next publish or run resumes it)."""

    record: RemovedRecord
    left: str
    error: str | None = None

    def warning(self) -> str | None:
        """The message a failed removal is reported with, or None when it finished."""
        if self.error is None:
            return None
        return (f"the manifest stands, but removing work files failed after {self.record['objects']} objects: "
                f"{self.error}; the rest are left under {self.left} (the next `bij run` or publish resumes "
                "the removal, or a bucket lifecycle rule on the _bij/ prefix can remove them)")

    def as_result(self) -> RemovalFailed:
        """What a step's result says about it (`workFilesRemoval`), for the driver's Condition."""
        return RemovalFailed(removed=self.record["objects"], bytes=self.record["bytes"], left=self.left,
                             error=self.error)


def removed_record(store: Storage, job: BatchInferenceJob) -> RemovedRecord | None:
    """What was removed after the job was published, or None when its work files are all there."""
    try:
        return json.loads(store.read_bytes(layout.removed_uri(job)))
    except NotFound:
        return None


def remove_work_files(store: Storage, job: BatchInferenceJob, folders: Iterable[str]) -> Removal:
    """Remove everything under `folders` (work files only publishing needed), or resume a removal that
    was cut short. Never raises a storage error: a failure is the returned `Removal.error`."""
    try:
        found = removed_record(store, job)
    except (StorageError, OSError, ValueError) as e:
        return Removal(_fresh(folders), _left(job), f"reading {layout.removed_uri(job)}: {e}")
    if found is not None and found.get("finishedAt"):
        return Removal(found, _left(job))
    return _remove(store, job, found if found is not None else _fresh(folders))


def resume_removal(store: Storage, job: BatchInferenceJob) -> Removal | None:
    """Finish a removal cut short (its record has no `finishedAt`); None when there is none to finish."""
    try:
        found = removed_record(store, job)
    except (StorageError, OSError, ValueError) as e:
        return Removal(_fresh([]), _left(job), f"reading {layout.removed_uri(job)}: {e}")
    if found is None or found.get("finishedAt"):
        return None
    return _remove(store, job, found)


def _fresh(folders: Iterable[str]) -> RemovedRecord:
    return {"removedAt": now_stamp(), "reason": REASON, "folders": list(folders), "objects": 0, "bytes": 0}


def _left(job: BatchInferenceJob) -> str:
    return layout.state_prefix(job) + "/"


def _remove(store: Storage, job: BatchInferenceJob, record: RemovedRecord) -> Removal:
    uri = layout.removed_uri(job)
    record = {**record}
    record.pop("failed", None)
    left = _left(job)
    try:
        # Written before the first delete: its presence refuses a republish that would find no rows.
        store.write_bytes(uri, _encode(record))
        pages = 0
        for folder in record["folders"]:
            for page in store.list_pages(folder):
                failed = store.delete_many(o.uri for o in page)
                gone = [o for o in page if o.uri not in failed]
                record["objects"] += len(gone)
                record["bytes"] += sum(o.size for o in gone)
                if failed:
                    key, why = next(iter(failed.items()))
                    raise StorageError(f"{len(failed)} objects of {folder} could not be deleted, {key} first: {why}")
                pages += 1
                if pages % SAVE_EVERY_PAGES == 0:
                    store.write_bytes(uri, _encode(record))
        record["finishedAt"] = now_stamp()
        store.write_bytes(uri, _encode(record))
        return Removal(record, left)
    except (StorageError, OSError) as e:
        record["failed"] = str(e)
        try:
            store.write_bytes(uri, _encode(record))
        except (StorageError, OSError):
            pass  # the record written before stays, and still resumes
        return Removal(record, left, str(e))


def _encode(record: RemovedRecord) -> bytes:
    return json.dumps(record, indent=1).encode()
