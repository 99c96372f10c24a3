"""The publish plan (`publish/plan.json`): what the operator writes once before publishing and every
publish pass (`bij.steps.publish_rows`) and the operator's finish step read.

On disk it is camelCase JSON:

    {"prefix": <output>/_bij/<job_id>/publish, "outputUri": ...,
     "roundShards": [[shards, roundPrefix] per round], "objectNames": [[name, ...] per round],
     "bucketRows": N, "buckets": B, "compression": "zstd" | "none", "format": "jsonl" | "parquet" | "csv",
     "task": ..., "judge": bool, "idKind": "int" | "str" | "mixed" | null, "fileRows"?: N,
     "s3": {"endpointUrl"?: ..., "region"?: ...}, "partial"?: "Cancelled" | "Expired", "roundPlans"?: [uri, ...],
     "partitionBy"?: "input", "unitObjects"?: [[object index, ...] per unit], "partitions"?: [stem, ...],
     "uniqueIds"?: true}

The passes' units are the rounds' shards in order, one index each (`unit`): a plan names each round's
shard count and prefix, so it stays small whatever the shards. A plan written before lists every unit
instead, `"units": [[round, shard, shardPrefix], ...]`, and is read as it is.

`partitionBy` input (spec.output.partitionBy): the write pass publishes one file per input object, named
`partitions[object]` (`layout.partition_stem`), for the objects of each unit (`unitObjects`: each lies
whole in one unit).

`s3` is the spec's `storage.s3`: every pass opens the output with it, whatever its environment says.

`fileRows` (rows in one published file part) is written only to override the default, which
`publish_rows.FILE_ROWS` sets.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic.alias_generators import to_camel

from bij.contract import layout
from bij.contract.errors import BijError, json_object, validation_problems
from bij.contract.formats import OutputFormat

PASSES = ("ids", "dedupe", "write")  # the row-level publish passes, in the order they run
Unit = tuple[int, int, str]  # (round, shard, the shard's prefix): one index of the per-shard passes


class PublishPlanError(BijError):
    """The publish plan is missing or does not fit the pass asked for."""

    permanent = True


class PublishPlan(BaseModel):
    """A publish plan; `from_json` reads one, `to_json` writes one."""

    # Unknown keys are ignored: a plan written by a newer operator still loads.
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True)

    prefix: str
    output_uri: str
    units: list[Unit] = []  # a plan written before roundShards: every unit listed
    round_shards: list[tuple[int, str]] = []  # per round: (shards, round prefix), its units in order
    object_names: list[list[str]]  # per round, its objects' display names (error rows name them)
    bucket_rows: int
    buckets: int
    compression: Literal["zstd", "none"]
    format: OutputFormat  # spec.output.format (openai input publishes JSON lines)
    task: Literal["embed", "generate", "chat", "classify", "score", "rerank"]
    judge: bool
    id_kind: str | None  # the Parquet id column's type; None for JSON lines
    file_rows: int | None = None  # None: publish_rows.FILE_ROWS
    # spec.storage.s3 as camelCase JSON (endpointUrl, region), so the passes need no spec model; a
    # plan written before it was carried has none (the environment decides, as it did then).
    s3: dict[str, str] = {}
    # Cancelled or Expired: a stopped job's partial publish. Shards need not be finished; the write
    # pass counts each unfinished shard's rows not run, reading its input from `round_plans` (the
    # round plans' URIs, by round).
    partial: Literal["Cancelled", "Expired"] | None = None
    round_plans: list[str] = []
    partition_by: Literal["shard", "input"] = "shard"
    unit_objects: list[list[int]] = []  # partitionBy input: each unit's objects, in input order
    partitions: list[str] = []  # partitionBy input: each input object's published name (its stem)
    # No id of the job can repeat (`publish.ids_cannot_repeat`): the ids and dedupe passes have no
    # indexes, and the write pass reads each log once.
    unique_ids: bool = False

    def to_json(self) -> bytes:
        doc = self.model_dump(mode="json", by_alias=True)
        if self.file_rows is None:
            del doc["fileRows"]
        if not self.s3:
            del doc["s3"]
        if self.partial is None:
            del doc["partial"], doc["roundPlans"]
        if self.partition_by == "shard":
            del doc["partitionBy"], doc["unitObjects"], doc["partitions"]
        if not self.unique_ids:
            del doc["uniqueIds"]
        if not self.round_shards:
            del doc["roundShards"]
        elif not self.units:
            del doc["units"]
        return json.dumps(doc, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes, source: str = "publish plan") -> PublishPlan:
        """PublishPlanError, naming `source`, when `data` is no publish plan."""
        doc = json_object(data, source, PublishPlanError)
        try:
            return cls.model_validate(doc)
        except ValidationError as e:
            raise PublishPlanError(f"{source} is not a publish plan: {validation_problems(e)}") from None

    def count(self, pass_name: str) -> int:
        """How many indexes a pass has: one per shard, or one per bucket (`dedupe`); none for ids and
        dedupe where no id can repeat."""
        if self.unique_ids and pass_name in ("ids", "dedupe"):
            return 0
        return self.buckets if pass_name == "dedupe" else self.unit_count

    @property
    def unit_count(self) -> int:
        """The per-shard passes' indexes: every shard of every round."""
        return len(self.units) if self.units else sum(n for n, _ in self.round_shards)

    def unit(self, index: int) -> Unit:
        """(round, shard, the shard's prefix) of a per-shard index."""
        if self.units:
            return self.units[index]
        at = index
        for r, (n, prefix) in enumerate(self.round_shards):
            if 0 <= at < n:
                return r, at, layout.shard_prefix(prefix, at)
            at -= n
        raise IndexError(f"unit {index} is out of range: the publish plan has {self.unit_count}")
