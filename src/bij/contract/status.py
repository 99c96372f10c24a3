"""A BatchInferenceJob's status: the typed shape of what `kubectl get bij -o yaml` shows.

The operator writes it (merge patches built in `bij.control.status` and the driver); the bij's own step
pods write only under `reports` (`StepReport`; lanes report into Leases of their own, `lane_report`);
`decide()`, `bij run`, `bij status` and bij-api read it through `JobStatus.read`, which keeps what
parses and says what did not (`JobStatus.problems`): a damaged entry is a named problem, never a crash
and never silently dropped (the driver shows the problems in the StatusDamaged condition and a Warning
Event). The CRD's status schema is generated from these models (`bij.contract.crd`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_serializer
from pydantic.alias_generators import to_camel

from bij.contract.manifest import CostFigures, EfficiencyFigures
from bij.contract.round_record import RoundRecord
from bij.contract.schema import FREE_FORM, INT64

DATE_TIME: dict[str, Any] = {"format": "date-time"}
# What the bij is doing (status.phase): decided by `bij.control.reconcile.decide`.
Phase = Literal["Pending", "Planning", "Running", "Suspended", "Publishing", "Succeeded", "Failed", "Cancelling",
                "Cancelled", "Expired", "CanaryFailed"]
ConditionStatus = Literal["True", "False", "Unknown"]


class _Status(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")

    def as_status(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class Shards(_Status):
    done: int = 0
    failed: int | None = None
    total: int = 0


class Lanes(_Status):
    done: int = 0
    failed: int = 0
    active: int = 0
    total: int = 0
    replaced: int = 0
    """lane groups (spec.workers.nodesPerLane > 1) of the current round replaced whole after one of their
    pods was lost; each is also a LaneGroupReplaced Warning Event"""


class PoolLanes(_Status):
    """One pool of spec.workers.pools in the current round: its lanes, and whether it gave them up."""

    name: str = ""
    lanes: int = 0
    """lanes of the round running in this pool (its own and those it took over)"""
    active: int = 0
    done: int = 0
    price_per_hour: float | None = None
    gave_up_round: int | None = None
    """the round in which this pool gave its lanes to the next pool (its pods could not start)"""
    message: str | None = None
    """why it gave up"""


class Rows(_Status):
    done: int = Field(0, json_schema_extra=INT64)
    failed: int = Field(0, json_schema_extra=INT64)
    not_run: int | None = Field(None, json_schema_extra=INT64)
    """Cancelled or Expired, the rows no worker finished (not in the partial manifest)"""


class Efficiency(_Status):
    worker_seconds: float = 0.0
    model_loads: int = 0
    model_load_seconds: float = 0.0
    engine_busy_seconds: float = 0.0
    engine_busy_fraction: float = 0.0
    rows_per_second_per_worker: float = 0.0
    tokens_per_second_per_worker: float = 0.0
    worker_seconds_by_pool: dict[str, float] | None = None
    """with spec.workers.pools, the worker seconds of each pool's pods"""


class Cost(_Status):
    price_per_hour: float = 0.0
    total: float = 0.0
    pools: dict[str, float] | None = None
    """with spec.workers.pools, what each pool's pods cost at its price"""
    per_million_rows: float | None = Field(None, json_schema_extra={"nullable": True})
    per_million_tokens: float | None = Field(None, json_schema_extra={"nullable": True})


class CanaryExample(_Status):
    id: str | None = None  # the row's id as text (null: unknown)
    code: str = ""
    message: str = ""


class CanaryEstimate(_Status):
    rows: int = Field(0, json_schema_extra=INT64)
    lane_seconds: float = 0.0
    seconds: float = 0.0
    cost: float | None = None


class Canary(_Status):
    """spec.canary's run: `shards` shards of round 0 (spread over it), run alone; their figures; the verdict."""

    shards: int = 0
    verdict: Literal["Passed", "Failed"] | None = None
    rows: int = Field(0, json_schema_extra=INT64)
    errors: int = Field(0, json_schema_extra=INT64)
    length_cuts: int = Field(0, json_schema_extra=INT64)
    schema_violations: int = Field(0, json_schema_extra=INT64)
    tokens_out: int = Field(0, json_schema_extra=INT64)
    lane_seconds: float = 0.0
    tokens_per_second_per_lane: float = 0.0
    broken: list[str] = []
    """each threshold of spec.canary its rows broke, with the figure and the limit"""
    examples: list[CanaryExample] = []
    """a few of its error rows: id, code and message"""
    estimate: CanaryEstimate | None = None
    """round 0 whole at the canary's pace: rows, lane-seconds, wall seconds on its lanes, cost (with pricePerHour)"""


class WorkerPermissions(_Status):
    service_account: str = ""
    result: Literal["Granted", "Missing", "Unknown"] = "Unknown"
    missing: list[str] = []
    message: str = ""
    check_time: str | None = Field(None, json_schema_extra=DATE_TIME)
    checks: int = 0


class Notified(_Status):
    """One webhook of spec.notify told (or being told) of the job's end: its attempts and their outcome."""

    url: str
    event: str
    attempts: int = 0
    delivered_at: str | None = Field(None, json_schema_extra=DATE_TIME)
    next_attempt_at: str | None = Field(None, json_schema_extra=DATE_TIME)
    last_error: str | None = None
    gave_up: bool = False


class PublishRecord(_Status):
    """The publish of the results, once its plan is made: the passes follow it, then the manifest."""

    rounds: int | None = None
    """rounds 0..rounds-1 are published"""
    plan_uri: str | None = None
    """the publish plan the passes' pods read"""
    passes: dict[str, int] | None = None
    """each pass's count of indexes (a pass of 0 runs no Job)"""
    started_at: str | None = Field(None, json_schema_extra=DATE_TIME)
    """when publishing began (bij-api's finalizing_at)"""
    partial: str | None = None
    """Cancelled or Expired: the finished part of a stopped job is published"""


class Condition(_Status):
    type: str
    status: ConditionStatus
    reason: str | None = None
    message: str | None = None
    last_transition_time: str | None = Field(None, json_schema_extra=DATE_TIME)
    observed_generation: int | None = Field(None, json_schema_extra=INT64)


class JobStatus(_Status):
    """Written by the operator, but for reports. Unknown fields are kept for newer operators."""

    model_config = ConfigDict(json_schema_extra=FREE_FORM)

    reports: dict[str, Any] = {}
    """Written by the bij's own step pods, each its own key (a JSON merge patch): steps.<Job name> is a
    storage step's result (planning, a round's statistics, the publish plan, the manifest). The operator
    reads these; it reads no storage. Lanes report their progress into Leases of their own, never here."""
    phase: Phase | None = None
    """Pending, Planning, Running, Publishing, Succeeded, Failed, Suspended, Cancelling (draining and
    publishing the finished part), Cancelled, Expired, or CanaryFailed (spec.canary's rows broke a threshold:
    nothing more ran, nothing was published)"""
    round: int | None = None
    """the current round (0 is the first)"""
    observed_generation: int | None = Field(None, json_schema_extra=INT64)
    """the spec generation the status describes"""
    shards: Shards | None = None
    """shards of the current round"""
    shards_summary: str | None = None
    """"<done>/<total>" of the current round, for kubectl get"""
    lanes: Lanes | None = None
    """lanes (pod indexes) of the current round's Job; each works many shards"""
    lanes_summary: str | None = None
    """"<done>/<total>" lanes of the current round (and "(<n> replaced)"), for kubectl get -o wide"""
    rows: Rows | None = None
    """rows done and failed so far, all rounds"""
    rows_per_second: float | None = None
    """rows done per second of wall time since startTime"""
    eta: str | None = None
    """time left in the current round at the rate so far"""
    efficiency: Efficiency | None = None
    """how well the workers were used, from their shard records (so far)"""
    cost: Cost | None = None
    """with spec.workers.pricePerHour, what the worker pods cost (so far)"""
    start_time: str | None = Field(None, json_schema_extra=DATE_TIME)
    """when the operator first handled the job"""
    completion_time: str | None = Field(None, json_schema_extra=DATE_TIME)
    """when the job ended (Succeeded, Failed, Cancelled or Expired)"""
    manifest_uri: str | None = None
    """the published manifest (results, errors, counts), once published"""
    output_uri: str | None = None
    """spec.output.uri"""
    message: str | None = None
    """what the job is doing or waiting for, or why it failed"""
    pools: list[PoolLanes] = []
    """with spec.workers.pools, each pool's lanes in the current round (and the pools that gave up theirs)"""
    pools_summary: str | None = None
    """"<pool> <active>/<lanes>" per pool, for kubectl get -o wide"""
    rounds: list[RoundRecord] = []
    """one entry per finished or running round"""
    publish: PublishRecord | None = None
    """the publish of the results, once it began: its plan, the passes done, when it started, and
    whether it publishes the finished part of a stopped job (partial)"""
    canary: Canary | None = None
    """spec.canary: its shards, figures, verdict, and the estimate of the whole job it gave"""
    worker_permissions: WorkerPermissions | None = None
    """The operator's check, before the first pod, that the worker service account holds every grant its
    pods use (a LocalSubjectAccessReview each); the WorkerPermissions condition says the same. While a grant
    is missing no pod starts and the check is repeated (checks in a row, backoff to 2 minutes)"""
    notified: list[Notified] = []
    """spec.notify's webhooks told of the job's end: one entry per URL and event, with its attempts, when it was
    delivered, or the last error once the retries gave up (then the Notified condition, reason NotifyFailed, and a
    Warning Event say so; the phase stays)"""
    conditions: list[Condition] = Field([], json_schema_extra={"x-kubernetes-list-type": "map",
                                                               "x-kubernetes-list-map-keys": ["type"]})
    """Ready, Running, Suspended, Succeeded and Failed from the phase; WorkerPermissions; StatusDamaged when a status
    entry cannot be read"""
    _problems: list[str] = PrivateAttr(default_factory=list)

    @property
    def problems(self) -> list[str]:
        """What `read` left out, each naming the field and why."""
        return self._problems

    def round_records(self) -> dict[int, RoundRecord]:
        """``rounds`` keyed by round number (a later entry of one round wins)."""
        return {r.round: r for r in self.rounds}

    @property
    def current_round(self) -> int:
        """The round the status shows (0 before the first is planned)."""
        return self.round if self.round is not None and self.round >= 0 else 0

    @classmethod
    def read(cls, status: Mapping[str, Any] | None) -> JobStatus:
        """The status as written, keeping every field that parses. A field that does not (a foreign writer,
        a damaged value) is left at its default and named in `problems`; so is each entry of `rounds` and
        `conditions` on its own, the others kept."""
        raw = dict(status or {})
        problems: list[str] = []
        for key, model in (("rounds", RoundRecord), ("conditions", Condition), ("notified", Notified)):
            value = raw.get(key)
            if value is None:
                continue
            kept = []
            for i, entry in enumerate(value if isinstance(value, list) else [value]):
                try:
                    kept.append(model.model_validate(entry))
                except ValidationError as e:
                    problems.append(f"status.{key}[{i}]: {_first_error(e)}")
            raw[key] = kept
        while True:
            try:
                out = cls.model_validate(raw)
                break
            except ValidationError as e:
                bad = {str(err["loc"][0]) for err in e.errors() if err["loc"]}
                if not bad:
                    raise
                for key in sorted(bad):
                    problems.append(f"status.{key}: {_first_error(e, key)}")
                    raw.pop(key, None)
                    raw.pop(to_camel(key), None)
        out._problems = problems
        return out


class StatusPatch(_Status):
    """A JSON merge patch of the status, as the operator writes it: only the fields set are written (`as_patch`),
    a field set to None deletes it. Fields written whole (a merge patch replaces a list whole) are written as the
    contract serializes them (`as_status`); ``canary`` and the entries of ``rounds``, ``efficiency`` and ``cost``
    with the fields they were made (or read) with, so that the canary's start sets only its shard count."""

    phase: Phase | None = None
    round: int | None = None
    observed_generation: int | None = None
    output_uri: str | None = None
    message: str | None = None
    shards: Shards | None = None
    shards_summary: str | None = None
    lanes: Lanes | None = None
    lanes_summary: str | None = None
    pools: list[PoolLanes] | None = None
    pools_summary: str | None = None
    rows: Rows | None = None
    rows_per_second: float | None = None
    eta: str | None = None
    efficiency: EfficiencyFigures | None = None
    """as the round-statistics step reported them (`FinishResult`)"""
    cost: CostFigures | None = None
    start_time: str | None = None
    completion_time: str | None = None
    manifest_uri: str | None = None
    rounds: list[RoundRecord] | None = None
    publish: PublishRecord | None = None
    canary: Canary | None = None
    worker_permissions: WorkerPermissions | None = None
    notified: list[Notified] | None = None
    conditions: list[Condition] | None = None

    @field_serializer("shards", "lanes", "pools", "rows", "publish", "worker_permissions", "notified", "conditions")
    def _whole(self, value: _Status | list[_Status] | None) -> Any:
        if isinstance(value, list):
            return [v.as_status() for v in value]
        return None if value is None else value.as_status()

    def as_patch(self) -> dict[str, Any]:
        """The merge patch: the fields set, camelCase (None where one is deleted)."""
        return self.model_dump(by_alias=True, exclude_unset=True, mode="json")

    def updated(self, other: StatusPatch, *, leave: tuple[str, ...] = ()) -> StatusPatch:
        """This patch with the fields `other` sets (but those named in `leave`) set as there."""
        return self.model_copy(update={k: getattr(other, k) for k in other.model_fields_set if k not in leave})


def _first_error(e: ValidationError, key: str | None = None) -> str:
    for err in e.errors():
        if key is None or (err["loc"] and str(err["loc"][0]) == key):
            where = ".".join(str(p) for p in err["loc"][1 if key else 0:])
            return f"{where + ': ' if where else ''}{err['msg']}"
    return str(e)
