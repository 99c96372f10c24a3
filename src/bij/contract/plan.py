"""The round plan (`shards.json`): what the operator writes once per round and every worker reads.

On disk it is camelCase JSON:

    {"version": 1, "round": 0, "createdAt": ..., "roundPrefix": <output>/_bij/<job_id>/round-<r>,
     "inputUri": ..., "judgeMode": {"mode", "final"}, "job": <the BatchInferenceJob>,
     "objects": [{"uri", "size", "name", "rowGroups"?, "version"?}], "fingerprint": {"spec", "input"},
     "shards": [[[object, start, end], ...], ...], "lanes": N}

The job is parsed with the spec model (`contract.spec`), so the worker has the same defaults as
the operator. Plans written before lanes existed have no `lanes` (one shard per index, no
sharing); plans from before judge modes have no `judgeMode`.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic.alias_generators import to_camel

from bij.contract.errors import BijError, json_object, validation_problems
from bij.contract.spec import BatchInferenceJob, JobSpec, SpecError, parse_job

PLAN_VERSION = 1

Piece = tuple[int, int, int]  # (object index, start, end): bytes, or row groups of a Parquet object


class BadPlan(BijError):
    """A round plan that cannot be read: no retry fixes it."""

    permanent = True


class _Doc(BaseModel):
    # Unknown keys are ignored: a plan written by a newer operator still loads.
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True)


class PlanObject(_Doc):
    """One input object of the round, as listed when the round was planned."""

    uri: str
    size: int
    name: str | None = None  # relative to the input folder: error rows name it
    row_groups: list[int] | None = None  # rows per row group (Parquet objects)
    version: str | None = None  # ETag (s3://) or mtime in ns (file://): another version is refused
    # Set when the object replaced one that was damaged after `bytes` good uncompressed bytes, which
    # are durable as rows: the replacement must begin with the same bytes (sha256), or it is refused.
    prefix: tuple[int, str] | None = None

    @property
    def display_name(self) -> str:
        return self.name or self.uri


class JudgeMode(_Doc):
    mode: Literal["none", "rounds", "inPlace"] = "none"
    final: bool = True  # rows rejected in this round are capped, not re-dispatched


class Fingerprint(_Doc):
    spec: str  # digest of the row-deciding spec fields
    input: str  # digest of the input objects (uri, size, version)


class Plan(_Doc):
    """A round plan; `Plan.load` / `Plan.from_json` read one, `to_json` writes one."""

    version: int = PLAN_VERSION
    round: int = 0
    created_at: str | None = None
    round_prefix: str
    input_uri: str | None = None
    judge_mode: JudgeMode | None = None
    job: BatchInferenceJob
    objects: list[PlanObject]
    fingerprint: Fingerprint | None = None
    shards: list[list[Piece]]
    lanes: int | None = None  # None: a plan from before lanes, one shard per Job index

    @property
    def spec(self) -> JobSpec:
        return self.job.spec

    @property
    def lane_count(self) -> int:
        """The round's lanes; a plan written before lanes existed has one per shard."""
        return self.lanes or len(self.shards)

    @property
    def shares_shards(self) -> bool:
        """Whether lanes take over each other's shards: plans written before lanes existed ran one
        shard per index and nothing else."""
        return self.lanes is not None

    @property
    def mode(self) -> JudgeMode:
        return self.judge_mode or JudgeMode()

    def to_doc(self) -> dict[str, Any]:
        """The JSON document (camelCase; fields without a value left out, as the job's own dict)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)

    def to_json(self) -> bytes:
        return json.dumps(self.to_doc(), separators=(",", ":")).encode()

    @classmethod
    def from_doc(cls, doc: Any, source: str = "round plan") -> Plan:
        if not isinstance(doc, dict):
            raise BadPlan(f"{source} is not a JSON object")
        try:
            job = parse_job(doc.get("job"), source)  # the spec's own messages name the bad field
            return cls.model_validate({**doc, "job": job})
        except SpecError as e:
            raise BadPlan(str(e)) from None
        except ValidationError as e:
            raise BadPlan(f"{source} is not a round plan: {validation_problems(e)}") from None

    @classmethod
    def from_json(cls, data: bytes, source: str = "round plan") -> Plan:
        return cls.from_doc(json_object(data, source, BadPlan), source)
