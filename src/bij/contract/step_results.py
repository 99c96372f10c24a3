"""What each step reports as its result (``StepReport.result``), one model per step kind.

A step pod (`bij.steps.main`) makes its result as one of these and puts it in its report as JSON; the
operator (and `bij run`) reads it back with `parse_result`, keyed on the step's kind, in one place
(`control.rules.steps.step`): a result that does not fit its model is said there, never met later as a
missing key. The JSON is the same as before these models, field for field, so that step pods and
operators of this version and the one before read each other's reports: fields are camelCase, a field
this version does not know is ignored, and a result is written with exactly the fields it was made
with (`as_result`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from bij.contract.canary import CanaryFigures
from bij.contract.manifest import (
    CostFigures,
    EfficiencyFigures,
    Manifest,
    ManifestCounts,
    Number,
    Partial,
    RemovalFailed,
)
from bij.contract.rounds import RoundStats
from bij.contract.step_report import MOST_MESSAGE

# Damaged objects and notes named in a result at most: the status stays small; the manifest lists them all.
MOST_DAMAGED = 20


class _Result(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True)
    kind: ClassVar[str] = ""

    def as_result(self) -> dict[str, Any]:
        """The result's JSON, with the fields it was made (or read) with and no other."""
        return self.model_dump(by_alias=True, exclude_unset=True, mode="json")


class PlanResult(_Result):
    """The plan step: the round's plan (where it is, its shards and lanes) and what it covers."""

    kind: ClassVar[str] = "plan"
    manifest_uri: str = ""
    shards: int
    objects: int
    bytes: int
    unit: str = "bytes"  # what `bytes` counts: bytes, or rows of Parquet input
    lanes: int
    canary_shards: int = 0  # spec.canary: how many of the shards the canary runs first (absent: none)


class FinishStats(_Result):
    """A round's statistics as its finish step counted them (`RoundStats.as_status`)."""

    round: int = 0
    shards: int = 0
    approved: int = 0
    rejected: int = 0
    capped: int = 0
    errors: int = 0
    engine_calls: int = 0
    rows_in: int = 0
    approval_rate: Number = 1.0

    @classmethod
    def of(cls, stats: RoundStats) -> FinishStats:
        return cls.model_validate(stats.as_status())

    def stats(self, round_no: int, shards: int) -> RoundStats:
        """As the round's record holds them: `round_no` with its `shards` planned."""
        return RoundStats(round=round_no, shards=shards, approved=self.approved, rejected=self.rejected,
                          capped=self.capped, errors=self.errors, engine_calls=self.engine_calls)


class FinishResult(_Result):
    """The finish step: a round whose Job ended, its shards done, statistics, damaged objects its workers
    stopped at (a few, `damagedMore` the rest), and the efficiency and cost of the rounds so far."""

    kind: ClassVar[str] = "finish"
    done: int = 0
    stats: FinishStats = FinishStats()
    efficiency: EfficiencyFigures | None = None
    damaged: list[str] = []
    damaged_more: int = 0
    cost: CostFigures | None = None  # with a price per worker pod hour


class CanaryExample(_Result):
    id: str | None = None  # the row's id as text (null: unknown)
    code: str = ""
    message: str = ""


class CanaryResult(_Result):
    """The canary step: the figures of the canary's shards (`CanaryFigures.as_status`), how many it found
    done, and a few of its failing rows."""

    kind: ClassVar[str] = "canary"
    shards: int = 0
    rows: int = 0
    errors: int = 0
    length_cuts: int = 0
    schema_violations: int = 0
    tokens_out: int = 0
    lane_seconds: Number = 0.0
    bytes: int = 0
    tokens_per_second_per_lane: Number = 0.0
    done: int = 0
    examples: list[CanaryExample] = []

    def figures(self) -> CanaryFigures:
        return CanaryFigures.from_status(self.as_result())


class DamagedMessage(_Result):
    message: str = ""


class ManifestSummary(_Result):
    """The manifest step (and a publish-plan step that found the job published): what the operator says
    about the published manifest (counts, file count, a few damaged objects and notes)."""

    kind: ClassVar[str] = "manifest"
    counts: ManifestCounts = ManifestCounts()
    files: int = 0
    damaged_objects: list[DamagedMessage] = []
    damaged_more: int = 0
    notes: list[str] = []  # what the engine could not serve at all, once each
    partial: Partial | None = None  # Cancelled or Expired: the phase it ends in
    work_files_removal: RemovalFailed | None = None  # `REMOVAL_FAILED`: removing work files failed

    @classmethod
    def of(cls, manifest: Manifest) -> ManifestSummary:
        damaged = [DamagedMessage(message=o.message) for o in manifest.damaged_objects]
        out: dict[str, Any] = {"counts": manifest.counts, "files": manifest.file_count(),
                               "damaged_objects": damaged[:MOST_DAMAGED],
                               "damaged_more": max(0, len(damaged) - MOST_DAMAGED)}
        notes = [n[:MOST_MESSAGE] for n in manifest.notes]
        if notes:  # what the engine could not serve at all, once each (a few: they go into the status message)
            out["notes"] = notes[:MOST_DAMAGED]
        if manifest.partial is not None:
            out["partial"] = manifest.partial
        failed = manifest.work_files_removal
        if failed is not None:
            # Removing work files failed after the manifest was written: a warning, not a failure.
            out["work_files_removal"] = failed.model_copy(update={"error": str(failed.error)[:MOST_MESSAGE]})
        return cls(**out)


class PublishPlanResult(_Result):
    """The publish-plan step: the publish plan's URI and how many indexes each pass has; or, where the job
    was published before the status said so (a restart in between), `published`, the manifest's summary."""

    kind: ClassVar[str] = "publish-plan"
    plan_uri: str = ""
    passes: dict[str, int] = {}
    published: ManifestSummary | None = None

    @model_validator(mode="after")
    def _one(self) -> PublishPlanResult:
        if self.published is None and not self.plan_uri:
            raise ValueError("neither planUri nor published")
        return self


StepResult = PlanResult | FinishResult | CanaryResult | PublishPlanResult | ManifestSummary
RESULTS: dict[str, type[StepResult]] = {t.kind: t for t in (PlanResult, FinishResult, CanaryResult,
                                                                PublishPlanResult, ManifestSummary)}


class UnreadableResult(ValueError):
    """A step's result that does not fit its kind's model (a step pod of another bij version)."""


def parse_result(kind: str, raw: Mapping[str, Any]) -> StepResult:
    """The result a step of `kind` reported; `UnreadableResult` saying the first field that does not fit."""
    model = RESULTS.get(kind)
    if model is None:
        raise UnreadableResult(f"no step of kind {kind!r}")
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise UnreadableResult(f"{where + ': ' if where else ''}{err['msg']}") from None
