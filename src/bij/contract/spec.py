"""The BatchInferenceJob spec: one model for `bij run`, the worker and the operator.

The YAML a user `kubectl apply`s is the input here too. Field names are the
camelCase ones from the CRD; Python attributes are snake_case. Every error
names the field path (``spec.model.engine``) and the reason.

This module binds the parts into `JobSpec` and `BatchInferenceJob` (with the rules across them) and
parses documents; the parts live beside it: spec_io (input, output, storage), spec_model (the model
and its engines' options), spec_workers (sharding, batching, workers), on spec_base's `SpecModel`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

from bij.contract.codes import API_GROUP
from bij.contract.engines import CONTINUOUS_ENGINES, ENGINES, GROUP_ENGINES, names
from bij.contract.errors import BijError
from bij.contract.prompt import compile_template
from bij.contract.schema import INT64, cel, cel_list, k8s
from bij.contract.spec_base import SecretKeyRef, SpecModel
from bij.contract.spec_io import MAX_URI, InputSpec, OutputSpec, StorageSpec, uris_overlap
from bij.contract.spec_model import ModelSpec, format_errors
from bij.contract.spec_workers import BatchingSpec, ShardingSpec, WorkersSpec

API_VERSION = "v1alpha1"
KIND = "BatchInferenceJob"

# Kubernetes object names (RFC 1123 subdomain); the round Job name `<name>-r<round>` must
# stay a valid DNS label, so the bij name itself is capped below 63.
NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
MAX_NAME_LEN = 52


# The CRD's rules (on the models below) say the same.
JSONL_FOR_OPENAI = (
    "output.format other than jsonl needs input.format jsonl or parquet: OpenAI batch output is JSON lines by "
    "definition"
)
PARTITION_NEEDS_ONE_ROUND = (
    "output.partitionBy input needs judge.strategy inPlace (or no judge): rows a judge round re-dispatches "
    "are read from the round's rejected files, no longer from their input object"
)
_KNOB, *_KNOBS = (ENGINES[e].in_flight for e in CONTINUOUS_ENGINES)
BATCH_SHAPE_NOT_CONTINUOUS = (
    "batching.targetBatchTokens and batching.maxBatchSize shape the batches of engines that run whole batches "
    f"({', '.join(e for e in ENGINES if e not in CONTINUOUS_ENGINES)}); engines {names(CONTINUOUS_ENGINES)} "
    f"schedule every step themselves: set {_KNOB} ({', '.join(str(k) for k in _KNOBS)}) and "
    "model.vllm.engineArgs.max_num_batched_tokens"
)
OVERLAP_MESSAGE = ("spec.output.uri must not be spec.input.uri, lie inside it or contain it: a job would read "
                   "its own (or an earlier job's) state and results as input; choose a separate output folder")
NODES_PER_LANE_ENGINE = (
    "workers.nodesPerLane above 1 needs model.engine vllm (pipeline parallel across the lane's pods over Ray) "
    "or simulated"
)
NODES_PER_LANE_PIPELINE = (
    "with workers.nodesPerLane above 1 the engine runs pipeline parallel across the lane's pods: leave "
    "model.vllm.pipelineParallelSize unset (or equal to nodesPerLane); model.vllm.tensorParallelSize is per pod"
)
PROMPT_NOT_OPENAI = (
    "prompt needs input.format jsonl or parquet: an OpenAI batch line brings its own request body"
)
PROMPT_NOT_MESSAGES = (
    "prompt renders each row's user message from its columns: leave input.messagesField unset"
)
SYSTEM_NEEDS_CHAT = (
    "prompt.system is a chat system message and needs model.task chat; for generate or embed put the "
    "instruction in prompt.template"
)
JUDGE_NEEDS_TEXT = "judge needs a generate or chat task: embeddings and pooling tasks have no text to judge"
GPUS_FOR_VLLM = (
    "workers.gpus must be at least model.vllm.tensorParallelSize x model.vllm.pipelineParallelSize "
    "with model.engine vllm (leave workers.gpus unset for exactly that many)"
)


# The longest spec.deadlineSeconds: 366 days (the CRD says the same).
MAX_DEADLINE_SECONDS = 366 * 24 * 3600


class SpecError(BijError):
    """A spec that can never work. The message names each bad field and why."""

    permanent = True

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems = problems
        self.source = source
        where = f"{source}: " if source else ""
        if len(problems) == 1:  # one line for one problem
            super().__init__(f"{where}invalid BatchInferenceJob: {problems[0]}")
        else:
            super().__init__(where + "invalid BatchInferenceJob:\n" + "\n".join(f"  - {p}" for p in problems))


class JudgeSpec(SpecModel):
    model_config = ConfigDict(json_schema_extra=k8s(
        cel("self.type != 'regex' || (has(self.pattern) && size(self.pattern) > 0)",
            "judge.type regex needs judge.pattern"),
        cel("self.type != 'jsonSchema' || has(self.schema)", "judge.type jsonSchema needs judge.schema"),
        cel("self.type != 'llm' || (has(self.prompt) && size(self.prompt) > 0)", "judge.type llm needs judge.prompt"),
        cel("self.type != 'llm' || !has(self.prompt) || self.prompt.contains('{output}')",
            "judge.prompt must contain {output}")))

    type: Literal["regex", "jsonSchema", "llm"]
    """regex (the output matches pattern), jsonSchema (it parses as JSON and validates under schema) or llm (the
    model, asked prompt, answers yes)"""
    pattern: str | None = Field(None, json_schema_extra=k8s(maxLength=4096))
    """regex judge; an output is approved when the pattern matches (re.search)"""
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    """jsonSchema judge; an output is approved when it parses as JSON and validates"""
    prompt: str | None = Field(None, json_schema_extra=k8s(maxLength=65536))
    """llm judge; {output} is replaced with the output to judge"""
    approve_pattern: str = Field(r"^\s*(yes|approve)", json_schema_extra=k8s(maxLength=4096))
    """llm judge: an output is approved when the judge's answer matches this (re.search, ignoring case)"""
    strategy: Literal["rounds", "inPlace", "hybrid"] = "rounds"
    """rounds (rejected rows run again in a next round), inPlace (retried inside the pod) or hybrid (rounds, then
    inPlace)"""
    max_rounds: int = Field(3, ge=1, le=20)
    """rounds at most, the first included; rows still rejected in the last are capped"""
    max_attempts: int = Field(3, ge=1, le=100)
    """inPlace: attempts per row at most; a row still rejected after them is capped"""
    # hybrid: switch to inPlace when a round approves less than this share of its rows,
    # or after this many rounds, whichever comes first.
    hybrid_min_approval_rate: float = Field(0.5, ge=0, le=1)
    """hybrid: switch to inPlace once a round approves less than this share of its rows"""
    hybrid_switch_after_rounds: int = Field(2, ge=1, le=20)
    """hybrid: switch to inPlace after this many rounds"""

    @model_validator(mode="after")
    def _judge_fields(self) -> JudgeSpec:
        if self.type == "regex":
            if not self.pattern:
                raise ValueError("judge.type regex needs judge.pattern")
            try:
                re.compile(self.pattern)
            except re.error as e:
                raise ValueError(f"judge.pattern is not a valid regular expression: {e}") from e
        if self.type == "jsonSchema" and self.json_schema is None:
            raise ValueError("judge.type jsonSchema needs judge.schema")
        if self.type == "llm":
            if not self.prompt:
                raise ValueError("judge.type llm needs judge.prompt")
            if "{output}" not in self.prompt:
                raise ValueError("judge.prompt must contain {output}")
        try:
            re.compile(self.approve_pattern)
        except re.error as e:
            raise ValueError(f"judge.approvePattern is not a valid regular expression: {e}") from e
        return self


class PromptSpec(SpecModel):
    """A row's prompt rendered from its columns (instead of read from input.textField)."""

    system: str | None = Field(None, json_schema_extra=k8s(minLength=1, maxLength=65536))
    """task chat: a system message put before each row's rendered user message"""
    template: str = Field(json_schema_extra=k8s(minLength=1, maxLength=65536))
    """a Jinja template over the row's columns, as row.NAME (`{{ row.title }}: {{ row.body }}`), run sandboxed:
    the prompt (generate), the user message (chat) or the text to embed, an instruction prefix included. A row
    missing a column it uses is a template_error error row naming the column"""

    @field_validator("template")
    @classmethod
    def _template_parses(cls, source: str) -> str:
        if not source.strip():
            raise ValueError("must not be blank")
        compile_template(source)  # ValueError naming the line
        return source


# The canary's size when spec.canary.rows is not set: this share of the input's rows, at most CANARY_MAX_ROWS.
CANARY_SHARE = 0.005
CANARY_MAX_ROWS = 2000


class CanarySpec(SpecModel):
    """A first part of round 0 run alone, its results kept: the rest runs only if its rows pass these checks."""

    rows: int | None = Field(None, ge=1, le=1_000_000)
    """rows the canary runs at least (whole shards from the plan's start); default 0.5% of the input's rows,
    at most 2,000"""
    max_error_share: float | None = Field(None, ge=0, le=1)
    """stop (phase CanaryFailed) when more than this share of the canary's rows are error rows"""
    max_length_cut_share: float | None = Field(None, ge=0, le=1)
    """... when more than this share of its answers were cut at maxTokens (finish_reason length)"""
    max_schema_violation_share: float | None = Field(None, ge=0, le=1)
    """... when more than this share of its rows broke spec.model.structuredOutput (schema_violation)"""
    min_tokens_per_second_per_lane: float | None = Field(None, gt=0)
    """... when a lane wrote fewer output tokens per second than this"""


# spec.notify: the events a webhook may ask for, one per final phase (`contract.notify` maps them).
NotifyEvent = Literal["succeeded", "failed", "cancelled", "expired", "canaryFailed"]
NOTIFY_EVENTS: tuple[NotifyEvent, ...] = ("succeeded", "failed", "cancelled", "expired", "canaryFailed")
# A webhook: http(s), a host, an optional port, path and query; no user:password@ and no fragment.
NOTIFY_URL_PATTERN = r"^https?://[^\s/?#@:]+(:[0-9]{1,5})?([/?][^\s#]*)?$"
MAX_NOTIFY = 16


class NotifyTarget(SpecModel):
    """A webhook told when the job ends: one signed POST per event it asks for, retried with backoff (see
    "Told when it ends" in the user guide)."""

    url: str = Field(json_schema_extra=k8s(pattern=NOTIFY_URL_PATTERN, maxLength=MAX_URI))
    """the http:// or https:// URL the POST goes to"""
    secret_ref: SecretKeyRef
    """the Secret's key (in the job's namespace) that signs each POST (HMAC-SHA256 in header X-Bij-Signature);
    with bij run, env BIJ_SECRET_<NAME>_<KEY> (upper case, other characters _) holds the key instead"""
    events: list[NotifyEvent] = Field(default_factory=lambda: list(NOTIFY_EVENTS), min_length=1,
                                      max_length=len(NOTIFY_EVENTS),
                                      json_schema_extra=k8s(x_kubernetes_list_type="set"))
    """the ends it is told of: succeeded, failed, cancelled, expired, canaryFailed (default all)"""

    @field_validator("url")
    @classmethod
    def _url(cls, url: str) -> str:
        if not re.match(NOTIFY_URL_PATTERN, url) or len(url) > MAX_URI:
            raise ValueError(f"must be an http:// or https:// URL with a host (no user:password@, no #fragment), "
                             f"such as https://hooks.example.com/bij, got {url!r}")
        return url

    @field_validator("events")
    @classmethod
    def _events(cls, events: list[str]) -> list[str]:
        twice = sorted({e for e in events if events.count(e) > 1})
        if twice:
            raise ValueError(f"each event at most once, got {', '.join(twice)} more than once")
        return events


class JobSpec(SpecModel):
    model_config = ConfigDict(json_schema_extra=k8s(
        cel("!has(self.judge) || self.model.task in ['generate', 'chat']", JUDGE_NEEDS_TEXT, ".judge"),
        cel("!has(self.output.format) || !has(self.input.format) || self.output.format == 'jsonl' || "
            "self.input.format != 'openai'", JSONL_FOR_OPENAI, ".output.format"),
        cel("!has(self.model) || !has(self.model.engine) || self.model.engine != 'vllm' || !has(self.workers) || "
            "!has(self.workers.gpus) || self.workers.gpus >= (has(self.model.vllm) && "
            "has(self.model.vllm.tensorParallelSize) ? self.model.vllm.tensorParallelSize : 1) * "
            "(has(self.model.vllm) && has(self.model.vllm.pipelineParallelSize) ? "
            "self.model.vllm.pipelineParallelSize : 1)", GPUS_FOR_VLLM, ".workers.gpus"),
        cel("!has(self.model) || !has(self.model.engine) || "
            f"!(self.model.engine in {cel_list(CONTINUOUS_ENGINES)}) || "
            "!has(self.batching) || (!has(self.batching.targetBatchTokens) && !has(self.batching.maxBatchSize))",
            BATCH_SHAPE_NOT_CONTINUOUS, ".batching"),
        cel("!has(self.output.partitionBy) || self.output.partitionBy != 'input' || !has(self.judge) || "
            "(has(self.judge.strategy) && self.judge.strategy == 'inPlace')", PARTITION_NEEDS_ONE_ROUND,
            ".output.partitionBy"),
        # Neither URI may be the other or lie under it (compared as folders: in/ and in-old/ are apart).
        cel("!((self.output.uri.endsWith('/') ? self.output.uri : self.output.uri + '/').startsWith("
            "self.input.uri.endsWith('/') ? self.input.uri : self.input.uri + '/') || "
            "(self.input.uri.endsWith('/') ? self.input.uri : self.input.uri + '/').startsWith("
            "self.output.uri.endsWith('/') ? self.output.uri : self.output.uri + '/'))", OVERLAP_MESSAGE,
            ".output.uri"),
        cel("!has(self.prompt) || !has(self.input.format) || self.input.format != 'openai'", PROMPT_NOT_OPENAI,
            ".prompt"),
        cel("!has(self.prompt) || !has(self.input.messagesField)", PROMPT_NOT_MESSAGES, ".prompt"),
        cel("!has(self.prompt) || !has(self.prompt.system) || (has(self.model) && has(self.model.task) && "
            "self.model.task == 'chat')", SYSTEM_NEEDS_CHAT, ".prompt.system")))

    input: InputSpec
    """Where the rows come from. Every object under uri is read (*.jsonl, *.jsonl.zst; *.parquet for format
    parquet)."""
    output: OutputSpec
    """where the results go: result, error and capped files, and manifest.json last"""
    model: ModelSpec = ModelSpec()
    """the model, the task and the engine that runs every row"""
    prompt: PromptSpec | None = None
    """each row's prompt rendered from its columns by a sandboxed Jinja template, with an optional chat system
    message; unset, a row brings its prompt in input.textField (or input.messagesField)"""
    sharding: ShardingSpec = ShardingSpec()
    """how each round's input is cut into shards, the unit a lane claims and resumes"""
    batching: BatchingSpec = BatchingSpec()
    """how rows are read, ordered and batched for the engine"""
    workers: WorkersSpec = WorkersSpec()
    """the worker pods: how many at once, their resources, placement and retries"""
    storage: StorageSpec = StorageSpec()
    """the S3 endpoint, region and credentials for s3:// and gs:// URIs"""
    judge: JudgeSpec | None = None
    """Check each output; approved rows are results, rejected rows are retried in a next round (rounds) or inside
    the pod (inPlace)."""
    max_error_ratio: float | None = Field(None, ge=0, le=1)
    """fail the job when more than this share of rows are error rows"""
    canary: CanarySpec | None = None
    """run a few shards of round 0, spread over the input, alone and stop (phase CanaryFailed, nothing more
    spent) if their rows break these thresholds; their results are kept for the full run. The status then
    estimates the job's time and cost"""
    suspend: bool = False
    """suspend the round Job (running pods are stopped, durable work is kept)"""
    cancel: bool = False
    """stop for good: the workers drain as on preemption, then the rows finished so far are published as a partial
    manifest and the phase becomes Cancelled (never published again)"""
    # At most MAX_DEADLINE_SECONDS: creation time plus the deadline must be a date (a "9999999d" window is not).
    deadline_seconds: int | None = Field(None, ge=1, le=MAX_DEADLINE_SECONDS, json_schema_extra=INT64)
    """seconds after creation at which the job stops as on cancel and publishes what is finished (phase Expired); a
    job already publishing finishes; at most 366 days"""
    notify: list[NotifyTarget] = Field([], max_length=MAX_NOTIFY)
    """webhooks told when the job ends (Succeeded, Failed, Cancelled, Expired, CanaryFailed): a POST of the job's
    name, phase, counts and manifest URI (nothing of its rows), signed with a Secret's key, retried with backoff;
    delivered or given up, it is recorded in status.notified"""

    @model_validator(mode="after")
    def _cross_field(self) -> JobSpec:
        if self.judge is not None and self.model.task not in ("generate", "chat"):
            raise ValueError(JUDGE_NEEDS_TEXT)
        if self.output.format != "jsonl" and self.input.format == "openai":
            raise ValueError(JSONL_FOR_OPENAI)
        if self.output.partition_by == "input" and self.judge is not None and self.judge.strategy != "inPlace":
            raise ValueError(PARTITION_NEEDS_ONE_ROUND)
        nodes = self.workers.nodes_per_lane
        if nodes > 1 and self.model.engine not in GROUP_ENGINES:
            raise ValueError(NODES_PER_LANE_ENGINE)
        if nodes > 1 and self.model.vllm.pipeline_parallel_size not in (1, nodes):
            raise ValueError(NODES_PER_LANE_PIPELINE)
        if self.model.engine == "vllm" and self.workers.gpus is not None and self.workers.gpus < self.engine_gpus:
            raise ValueError(GPUS_FOR_VLLM)
        if uris_overlap(self.input.uri, self.output.uri):
            raise ValueError(OVERLAP_MESSAGE)
        if self.model.engine in CONTINUOUS_ENGINES and (self.batching.target_batch_tokens is not None
                                                        or self.batching.max_batch_size is not None):
            raise ValueError(BATCH_SHAPE_NOT_CONTINUOUS)
        if self.prompt is not None:
            if self.input.format == "openai":
                raise ValueError(PROMPT_NOT_OPENAI)
            if self.input.messages_field is not None:
                raise ValueError(PROMPT_NOT_MESSAGES)
            if self.prompt.system is not None and self.model.task != "chat":
                raise ValueError(SYSTEM_NEEDS_CHAT)
        return self

    @property
    def engine_gpus(self) -> int:
        """GPUs vLLM needs in one pod: tensor x pipeline parallel, or tensor parallel alone when the lane
        spans several pods (one pipeline stage a pod)."""
        if self.workers.nodes_per_lane > 1:
            return self.model.vllm.tensor_parallel_size
        return self.model.vllm.gpus

    @property
    def gpus(self) -> int:
        """GPUs per worker pod: spec.workers.gpus, else what vLLM needs in one pod (engine_gpus), else 0."""
        if self.workers.gpus is not None:
            return self.workers.gpus
        return self.engine_gpus if self.model.engine == "vllm" else 0


class Metadata(SpecModel):
    name: str
    namespace: str = "default"
    uid: str | None = None
    creation_timestamp: str | None = None  # set by the API server; spec.deadlineSeconds counts from it
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True
    )

    @model_validator(mode="after")
    def _name(self) -> Metadata:
        if not NAME_RE.match(self.name) or len(self.name) > MAX_NAME_LEN:
            raise ValueError(
                f"metadata.name {self.name!r} must be lowercase letters, digits and '-', "
                f"start and end alphanumeric, at most {MAX_NAME_LEN} characters"
            )
        return self


class BatchInferenceJob(SpecModel):
    api_version: str = f"{API_GROUP}/{API_VERSION}"
    kind: str = KIND
    metadata: Metadata
    spec: JobSpec

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True
    )

    @model_validator(mode="after")
    def _kind(self) -> BatchInferenceJob:
        if self.kind != KIND:
            raise ValueError(f"kind must be {KIND}, got {self.kind!r}")
        if self.api_version != f"{API_GROUP}/{API_VERSION}":
            raise ValueError(f"apiVersion must be {API_GROUP}/{API_VERSION}, got {self.api_version!r}")
        return self

    @property
    def job_id(self) -> str:
        """Stable id of this job's working state: the uid in a cluster, the name locally."""
        return self.metadata.uid or self.metadata.name


def parse_job(doc: Any, source: str | None = None) -> BatchInferenceJob:
    """Validate a BatchInferenceJob document (a dict as parsed from YAML or from the API)."""
    if not isinstance(doc, dict):
        raise SpecError(["(document): must be a mapping with apiVersion, kind, metadata and spec"], source)
    if "spec" not in doc:
        raise SpecError(["spec: missing"], source)
    try:
        return BatchInferenceJob.model_validate(doc)
    except ValidationError as e:
        raise SpecError(format_errors(e), source) from None


def parse_spec(spec: Any, name: str = "job", source: str | None = None) -> JobSpec:
    """Validate only a `spec` mapping (the operator gets metadata from the API)."""
    try:
        return JobSpec.model_validate(spec)
    except ValidationError as e:
        raise SpecError(format_errors(e, "spec."), source) from None


def load_job(path: str | Path) -> BatchInferenceJob:
    """Load and validate a BatchInferenceJob from a YAML file."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise SpecError([f"cannot read file: {e.strerror}"], str(p)) from None
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as e:
        raise SpecError([f"not valid YAML: {e}"], str(p)) from None
    jobs = [d for d in docs if isinstance(d, dict) and d.get("kind") == KIND]
    if len(jobs) != 1:
        raise SpecError([f"expected exactly one {KIND} document, found {len(jobs)}"], str(p))
    return parse_job(jobs[0], str(p))


def job_to_dict(job: BatchInferenceJob) -> dict[str, Any]:
    """The job as a JSON-able dict with camelCase keys (what the worker receives)."""
    return job.model_dump(mode="json", by_alias=True, exclude_none=True)
