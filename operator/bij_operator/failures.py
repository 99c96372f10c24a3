"""What a failed step means: the decision after a step of `reconcile.decide()` raised.

Kept apart from `reconcile` because it sorts the errors of the steps that touch the world
(planning, storage, publishing), so it imports their modules; `decide()` imports only pure ones.
"""

from __future__ import annotations

from bij_worker.publish_rows import PublishPlanError
from bij_worker.storage import StorageError, StorageRefused

from .fingerprint import PlanRefused
from .planner import PlanError
from .publish import ErrorRatioExceeded, PublishError, WorkFilesRemoved
from .reconcile import CreateJob, CreatePublishJob, Decision, MarkFailed, PlanRound, PreparePublish, Publish, Retry


def failed_step(d: Decision, error: Exception) -> Decision:
    """The decision after step `d` raised `error`: MarkFailed when only a spec change can help,
    Retry when time may. Anything else is a bug and is raised again, never retried as an outage."""
    r = d.round
    if isinstance(error, PlanRefused):
        # Another job owns the output, the URIs overlap, or what is there was made from another spec
        # or input: a retry cannot help, a spec edit may (the phase is not final).
        return MarkFailed(round=r, phase="Failed", reason="PlanRefused", message=str(error), event="PlanRefused")
    if isinstance(error, StorageRefused):
        # Denied access, a missing bucket, wrong credentials: the same on every retry until someone changes the
        # grants, the bucket or the credentials; the message names the URI and the access key id.
        what = (f"cannot plan round {r}" if isinstance(d, PlanRound) else "publish failed"
                if isinstance(d, (PreparePublish, Publish)) else f"round {r}")
        return MarkFailed(round=r, phase="Failed", reason="StorageRefused", message=f"{what}: {error}",
                          event="StorageRefused")
    if isinstance(d, PlanRound) and isinstance(error, (PlanError, StorageError, OSError)):
        # Missing or unreadable input may appear later (an upload still running).
        return Retry(round=r, phase="Pending", reason="PlanFailed", message=f"cannot plan round {r}: {error}",
                     delay=30.0, permanent=bool(getattr(error, "permanent", False)))
    if isinstance(d, (CreateJob, CreatePublishJob)) and isinstance(error, ValueError):
        # The Job cannot be made from this spec (more lanes than an Indexed Job may have): only a spec change helps.
        return MarkFailed(round=r, phase="Failed", reason="CannotCreateJob", message=f"round {r}: {error}",
                          shards=d.shards, event="CannotCreateJob")
    if isinstance(d, (PreparePublish, Publish)):
        if isinstance(error, ErrorRatioExceeded):
            # Duplicates found only at publish can push the share of bad rows over the limit.
            return MarkFailed(round=r, phase="Failed", reason="TooManyErrors", message=str(error),
                              event="TooManyErrors")
        if isinstance(error, WorkFilesRemoved):
            return MarkFailed(round=r, phase="Failed", reason="WorkFilesRemoved", message=str(error),
                              event="WorkFilesRemoved")
        if isinstance(error, (PublishError, StorageError, OSError, PublishPlanError)):
            return Retry(round=r, phase="Publishing", reason="PublishFailed", message=f"publish failed: {error}",
                         delay=30.0, permanent=bool(getattr(error, "permanent", False)))
    if isinstance(error, StorageError):
        # Reading the workers' records (a round's finish): an outage may pass; a damaged record says so.
        return Retry(round=r, phase=d.phase, reason="StorageFailed", message=f"round {r}: {error}", delay=30.0,
                     permanent=error.permanent)
    raise error
