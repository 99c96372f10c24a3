"""A step's report: what a step pod (`bij-worker step ...`) tells the operator through the bij's status.

``status.reports.steps.<step Job name>`` holds one `StepReport` (camelCase JSON)::

    {"jobUid": ..., "pod": ..., "result": {...}}                                     done
    {"jobUid": ..., "pod": ..., "error": {"code": "PlanRefused", "message": ..., "permanent": true}}

`jobUid` names the Job that made it, so a report left by a deleted Job of the same name is never
taken. `result` is the JSON of its step kind's model (`step_results`), read into that model in one
place (`control.rules.steps.step`). An error is sorted by its `code`, a name of this contract that
stays when the code raising it is renamed or moved: `reconcile.decide()` turns each code into a
decision (fail, retry later), and `INTERNAL` (an error no code names: a bug, a crash) into a retry of
the pod by its Job, bounded by the spec's backoff fields, then Failed with the message.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

# The key of a manifest step's result (`ManifestSummary.work_files_removal`; beside a manifest, never in it)
# when removing work files failed after the manifest was written: {"removed", "bytes", "left", "error"}.
# The bij still succeeds, with the Condition `REMOVAL_CONDITION` False and a Warning Event.
REMOVAL_FAILED = "workFilesRemoval"
REMOVAL_CONDITION = "WorkFilesRemoved"

# A message longer than this is cut (a status is no place for a stack of text).
MOST_MESSAGE = 2000


class StepErrorCode(str, Enum):
    """Why a step failed, as the operator decides on it."""

    PLAN_REFUSED = "PlanRefused"  # the output belongs to another job or spec, or clashes: only an edit helps
    PLAN_FAILED = "PlanFailed"  # the input cannot be planned yet (missing, unreadable): time may help
    STORAGE_REFUSED = "StorageRefused"  # access denied, no such bucket: only a change of grants helps
    STORAGE_FAILED = "StorageFailed"  # an outage, a damaged record: time may help
    TOO_MANY_ERRORS = "TooManyErrors"  # spec.maxErrorRatio exceeded at publish
    WORK_FILES_REMOVED = "WorkFilesRemoved"  # published earlier and its work files are gone
    PUBLISH_FAILED = "PublishFailed"  # a shard summary missing, a plan that does not fit: time may help
    INVALID_SPEC = "InvalidSpec"  # the pod could not read the spec it was given (a version skew)
    INTERNAL = "Internal"  # anything else: the pod exits 1 and its Job runs it again


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True)


class StepError(_Model):
    code: StepErrorCode
    message: str = Field(max_length=MOST_MESSAGE + 10)
    permanent: bool = False

    @classmethod
    def of(cls, code: StepErrorCode, message: str, permanent: bool = False) -> StepError:
        if len(message) > MOST_MESSAGE:
            message = message[:MOST_MESSAGE] + " ..."
        return cls(code=code, message=message, permanent=permanent)


class StepReport(_Model):
    job_uid: str = ""
    pod: str = ""
    result: dict[str, Any] | None = None  # `step_results.parse_result(kind, result)` reads it
    error: StepError | None = None

    def as_status(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")

    @classmethod
    def parse(cls, raw: Any) -> StepReport | None:
        """The report in the status, or None when there is none or it is not one (a foreign writer,
        an older pod): the step is then judged by its Job alone."""
        if not isinstance(raw, Mapping):
            return None
        try:
            report = cls.model_validate(raw)
        except ValidationError:
            return None
        return report if (report.result is None) != (report.error is None) else None
