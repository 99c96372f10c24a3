"""The BatchInferenceJob spec: one model for `bij run`, the worker and the operator.

The YAML a user `kubectl apply`s is the input here too. Field names are the
camelCase ones from the CRD; Python attributes are snake_case. Every error
names the field path (``spec.model.engine``) and the reason.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

from bij.contract.codes import API_GROUP
from bij.contract.columns import RESULT_FIELDS, consumed
from bij.contract.engines import (
    CONTINUOUS_ENGINES,
    ENGINE_TASKS,
    ENGINES,
    GROUP_ENGINES,
    POOLING_TASKS,
    WEIGHTS_ENGINES,
    names,
)
from bij.contract.errors import BijError
from bij.contract.formats import OutputFormat
from bij.contract.globs import check_glob, has_glob
from bij.contract.prompt import compile_template
from bij.contract.sampling import DEFAULT_ROW_BUDGET, Basics, Sampling, basics, spec_defaults
from bij.contract.sampling import from_spec as sampling_from_spec
from bij.contract.schema import FREE_FORM, INT64, cel, cel_list, k8s
from bij.contract.schemes import REMOTE, SCHEMES, WRITABLE, forms, prefixes, scheme_of, uri_pattern

API_VERSION = "v1alpha1"
KIND = "BatchInferenceJob"
# A longer input line is an error row (its bytes are never held in memory).
DEFAULT_MAX_LINE_BYTES = 32 << 20
# One image of a chat row at most (OpenAI's own limit per image).
DEFAULT_MAX_IMAGE_BYTES = 20 << 20
# Ids one publish dedupe process holds at once, by default (spec.output.publishBucketRows), and the
# least a spec may ask for (fewer means more bucket files: shards x buckets).
PUBLISH_BUCKET_ROWS = 250_000
MIN_PUBLISH_BUCKET_ROWS = 1000

# Kubernetes object names (RFC 1123 subdomain); the round Job name `<name>-r<round>` must
# stay a valid DNS label, so the bij name itself is capped below 63.
NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
MAX_NAME_LEN = 52
# A Kubernetes resource quantity ("4", "500m", "16Gi"); the CRD uses the same pattern.
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]"
    r"|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)


# The CRD's rules (on the models below) say the same.
PARQUET_NOT_OPENAI = (
    "output.format parquet needs input.format jsonl or parquet: OpenAI batch output is JSON lines by definition"
)
PASS_THROUGH_NOT_OPENAI = (
    "input.passThrough needs input.format jsonl or parquet: an OpenAI batch output line has a fixed shape "
    "(custom_id, response, error) and carries no input columns"
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


def engine_tasks_message(engine: str) -> str:
    """Why a spec's task is refused for `engine`: the tasks it runs (contract.engines' table)."""
    tasks = ENGINE_TASKS[engine]
    return f"engine {engine} supports tasks {names(tasks)}" if len(tasks) > 1 else \
        f"engine {engine} only supports task {tasks[0]}"


def _engine_task_rule(engine: str) -> dict[str, Any]:
    return cel(f"!has(self.task) || (has(self.engine) ? self.engine : 'echo') != '{engine}' || "
               f"self.task in {cel_list(ENGINE_TASKS[engine])}", engine_tasks_message(engine))


WEIGHT_PREFIXES = REMOTE
WEIGHTS_BY_URI = (f"model.name as a URI is the object-store prefix of the model's files "
                  f"({', '.join(WEIGHT_PREFIXES)}), which engines {names(WEIGHTS_ENGINES)} load; give a Hugging Face "
                  "id or a local path otherwise")
POOLING_NEEDS_NAME = ("model.task classify, score and rerank need model.name: a sequence-classification model "
                      "(classify) or a cross-encoder with one label (score, rerank); no packaged model runs them")
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


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


# An S3 endpoint: scheme, host, optional port and path (botocore refuses anything else).
ENDPOINT_PATTERN = r"^https?://[^\s/?#:]+(:[0-9]{1,5})?(/[^\s]*)?$"
# A URI of a writable scheme (s3://bucket[/key], file:// with a path, ...) or of any scheme an input may
# name: made from contract.schemes' rows, as the CRD's rules are.
URI_PATTERN = uri_pattern(writable_only=True)
INPUT_PATTERN = uri_pattern()
HTTP_PATTERN = "^(" + "|".join(s.pattern for s in SCHEMES if s.prefix.startswith("http")) + ")$"
HF_PATTERN = "^(" + "|".join(s.pattern for s in SCHEMES if s.prefix == "hf://") + ")$"
# What the API server checks of a URI (CEL's matches(): RE2, a pattern inside a single-quoted string).
MAX_URI = 4096


def _matches(pattern: str) -> str:
    return "self.matches('" + pattern.replace("\\", "\\\\") + "')"


INPUT_URI_RULE = cel(_matches(INPUT_PATTERN), f"must start with {prefixes()}, as {forms()}")
STORE_URI_RULE = _matches(URI_PATTERN)
STORE_URI_MESSAGE = f"must start with {prefixes(writable_only=True)}, as {forms(writable_only=True)}"


class S3Options(_Model):
    endpoint_url: str | None = Field(None, json_schema_extra=k8s(pattern=ENDPOINT_PATTERN))
    """S3-compatible endpoint (MinIO, R2, GCS interop); default AWS"""
    region: str | None = None
    """the S3 region; default from the pods' environment"""

    @field_validator("endpoint_url")
    @classmethod
    def _endpoint(cls, url: str | None) -> str | None:
        if url is not None and not re.match(ENDPOINT_PATTERN, url):
            raise ValueError(f"must be an http(s) URL such as https://s3.example.com:9000, got {url!r}")
        return url


class StorageSpec(_Model):
    s3: S3Options = S3Options()
    """the S3 endpoint and region (also for gs:// through Google's S3-compatible API)"""
    credentials_secret: str | None = None
    """Secret with AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, passed to workers with envFrom; without it the pods'
    identity (IRSA, workload identity) is used"""


PASS_THROUGH_CLASH = cel(
    "!(self in [" + ", ".join(f"'{name}'" for name in sorted(RESULT_FIELDS)) + "])",
    "clashes with the result field of that name: result rows carry " + ", ".join(sorted(RESULT_FIELDS)))
# A passThrough column: the API server checks its length and name (InputSpec._pass_through does in Python).
ColumnName = Annotated[str, Field(json_schema_extra=k8s(PASS_THROUGH_CLASH, minLength=1, maxLength=256))]
# A string the API server refuses empty (a validator refuses it in Python).
NonEmpty = Annotated[str, Field(json_schema_extra=k8s(minLength=1))]


class InputSpec(_Model):
    model_config = ConfigDict(json_schema_extra=k8s(
        cel("!has(self.passThrough) || !has(self.format) || self.format != 'openai'", PASS_THROUGH_NOT_OPENAI,
            ".passThrough")))

    uri: str = Field(json_schema_extra=k8s(INPUT_URI_RULE, maxLength=MAX_URI))
    """file:///path, s3://bucket/prefix, gs://bucket/prefix (Google Cloud Storage) or az://container/prefix (Azure
    Blob Storage), or a glob below a folder:
    s3://bucket/logs/2026-*/part-*.jsonl, file:///data/**/*.jsonl (* and ? within a name, [abc], ** any folders),
    or one object at an https:// URL (a presigned or signed URL too), or files of a Hugging Face Hub dataset:
    hf://datasets/OWNER/NAME[@REVISION]/PATH"""
    format: Literal["jsonl", "openai", "parquet"] = "jsonl"
    """jsonl (one object per line), openai (OpenAI batch request lines) or parquet (*.parquet objects; idField,
    textField and messagesField name columns)"""
    id_field: str = "id"
    """field (JSONL) or column (Parquet) holding a row's id, carried to its result"""
    text_field: str = "text"
    """field (JSONL) or column (Parquet) holding a row's text: the prompt, or the text to embed"""
    messages_field: str | None = None
    """field holding a chat messages list (task chat); default wraps textField as one user message"""
    sampling_field: str = "sampling"
    """field (JSONL) or struct column (Parquet) holding a row's own sampling fields, with model.sampling's keys;
    they win over the spec's. Unknown keys are invalid_request error rows, fields the engine cannot honour
    unsupported error rows"""
    adapter_field: str = "adapter"
    """field (JSONL) or column (Parquet) naming a row's LoRA adapter from model.adapters"""
    pair_field: str = "pair"
    """task score: field (JSONL) or column (Parquet) holding the text scored against textField's"""
    query_field: str = "query"
    """task rerank: field (JSONL) or column (Parquet) holding the query"""
    documents_field: str = "documents"
    """task rerank: field (JSONL) or column (Parquet) holding the list of texts ranked against the query"""
    max_line_bytes: int = Field(DEFAULT_MAX_LINE_BYTES, ge=1024, le=1 << 31, json_schema_extra=INT64)
    """a longer input line is an error row (its bytes are never held in memory)"""
    max_image_bytes: int = Field(DEFAULT_MAX_IMAGE_BYTES, ge=1, le=1 << 31, json_schema_extra=INT64)
    """one image of a chat row (an image_url part: a data URL, file:// or s3://) at most; a larger one is an
    image_too_large error row"""
    image_root: str | None = Field(None, json_schema_extra=k8s(
        cel("self.matches('^file:///.+$')", "must be a file:// folder, as file:///path"), maxLength=MAX_URI))
    """the file:// folder file:// images may be read from (regular files only, never /proc, /sys, /dev, /etc or a
    service-account token); default the folder of a file:// input, none for an s3:// input"""
    on_damaged_object: Literal["fail", "errorRow"] = "fail"
    """a .zst object cut short or damaged: fail the round naming the object and the byte offset, the rows before it
    kept (a rerun after replacing the object resumes); or errorRow: one corrupt_input error row where it breaks,
    the rest of the object unread"""
    pass_through: list[ColumnName] | None = Field(None, max_length=1000,
                                                  json_schema_extra=k8s(x_kubernetes_list_type="set"))
    """input columns carried to each result (and error) row beside its result fields: unset, every column the
    request does not consume (not the id, text, messages, sampling or adapter columns); a list, those columns
    only; [] none. A column named like a result field is refused at plan time (unset) or here (listed). JSONL and
    Parquet input only"""

    @field_validator("pass_through")
    @classmethod
    def _pass_through(cls, names: list[str] | None) -> list[str] | None:
        if names is None:
            return None
        for name in names:
            if not name or len(name) > 256:
                raise ValueError(f"column names have 1 to 256 characters, got {name[:40]!r}")
            if name in RESULT_FIELDS:
                raise ValueError(f"column {name!r} clashes with the result field of that name; result rows carry "
                                 f"{', '.join(sorted(RESULT_FIELDS))}")
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"column {dup[0]!r} is named twice")
        return names

    @model_validator(mode="after")
    def _pass_through_format(self) -> InputSpec:
        if self.pass_through is not None and self.format == "openai":
            raise ValueError(PASS_THROUGH_NOT_OPENAI)
        return self

    @field_validator("uri")
    @classmethod
    def _uri_scheme(cls, uri: str) -> str:
        if uri.startswith(("https://", "http://")):
            # One object read with range requests (storage_http): HTTP lists nothing.
            if not re.match(HTTP_PATTERN, uri):
                raise ValueError(f"an http(s) input names one object: https://host/path, got {uri!r}")
            if has_glob(uri.split("?", 1)[0]):
                raise ValueError(f"an http(s) input names one object: no wildcards, got {uri!r}")
            return uri
        check_glob(uri)  # a glob below the folder it names: contract.globs
        if uri.startswith("hf://"):
            if not re.match(HF_PATTERN, uri):
                raise ValueError(f"an hf:// input is a dataset: hf://datasets/OWNER/NAME[@REVISION]/PATH, got {uri!r}")
            return uri
        return _check_uri(uri)

    @field_validator("image_root")
    @classmethod
    def _image_root(cls, uri: str | None) -> str | None:
        if uri is not None and not (uri.startswith("file:///") and len(uri) > len("file:///")):
            raise ValueError("must be a file:// folder, as file:///path")
        return uri

    def consumed_columns(self) -> frozenset[str]:
        """The columns a row's request consumes (contract.columns): never carried unless passThrough names them."""
        return consumed(self.id_field, self.text_field, self.messages_field, self.sampling_field, self.adapter_field)

    def carries_every_column(self) -> bool:
        """Whether rows carry every column their request does not consume (passThrough unset, plain input)."""
        return self.pass_through is None and self.format != "openai"

    def image_root_path(self) -> str | None:
        """The folder (a path) file:// images may come from, or None."""
        if self.image_root is not None:
            return self.image_root.removeprefix("file://")
        if self.uri.startswith("file://"):
            path = self.uri.removeprefix("file://")
            return path if path.endswith("/") else posixpath.dirname(path) or "/"
        return None


class OutputSpec(_Model):
    uri: str = Field(json_schema_extra=k8s(
        cel(STORE_URI_RULE, STORE_URI_MESSAGE),
        cel("!self.matches('[*?\\\\[]')", "an output is one folder: no wildcards (* ? [)"), maxLength=MAX_URI))
    """file:///path, s3://bucket/prefix, gs://bucket/prefix or az://container/prefix; manifest.json is written
    here last"""
    format: OutputFormat = "jsonl"
    """result files as JSON lines or Parquet (error and capped files stay JSON lines)"""
    compression: Literal["zstd", "none"] = "zstd"
    """compression of the result files: zstd or none"""
    keep_intermediate: bool = False
    """keep the work files under _bij/ (durable logs, judge inputs) after a successful publish; when false they are
    removed and the job cannot be published again"""
    publish_bucket_rows: int = Field(PUBLISH_BUCKET_ROWS, ge=MIN_PUBLISH_BUCKET_ROWS, json_schema_extra=INT64)
    """ids one publish dedupe process holds at once (its memory); fewer ids a bucket means more bucket files (shards
    x buckets)"""
    partition_by: Literal["shard", "input"] = "shard"
    """shard: result files results/r<round>-<shard>[-<part>]; input: one result file per input object under results/
    with the input's name relative to the input folder or glob root (and the result format's extension), errors/
    and capped/ alike. With input, no object is cut across shards (parallelism is at most the input objects)"""

    @field_validator("uri")
    @classmethod
    def _uri_scheme(cls, uri: str) -> str:
        if has_glob(uri):
            raise ValueError(f"an output is one folder: no wildcards (* ? [), got {uri!r}")
        return _check_uri(uri)


# The reasoning and tool call parsers vLLM ships (0.32: ReasoningParserManager, ToolParserManager),
# known here so that a spec naming another fails at validation, not on the GPU node; the vLLM test
# tier checks the lists against the installed release.
REASONING_PARSERS = (
    "cohere_command3", "cohere_command4", "deepseek_r1", "deepseek_v3", "deepseek_v4", "deepseek_v41", "ernie45",
    "gemma4", "glm45", "glm47", "granite", "granite_thinking_parser", "hf", "holo2", "hunyuan_a13b", "hy_v3", "hy_v4",
    "inkling", "k2_horizon", "kimi_k2", "kimi_k3", "ling3", "mimo", "minicpmv", "minimax_m2",
    "minimax_m2_append_think", "minimax_m3", "mistral", "muse_glimmer", "nemotron_v3", "olmo3", "openai_gptoss",
    "plamo3", "poolside_v1", "qwen3", "seed_oss", "step3", "step3p5",
)
TOOL_CALL_PARSERS = (
    "apertus", "cohere_command3", "cohere_command4", "deepseek_v3", "deepseek_v31", "deepseek_v32", "deepseek_v4",
    "deepseek_v41", "dots", "ernie45", "functiongemma", "gemma4", "gigachat3", "glm45", "glm47", "granite",
    "granite-20b-fc", "granite4", "hermes", "hf", "hunyuan_a13b", "hy_v3", "hy_v4", "inkling", "internlm", "jamba",
    "k2_horizon", "kimi_k2", "kimi_k3", "lfm2", "ling3", "llama3_json", "llama4_json", "llama4_pythonic", "longcat",
    "mimo", "minicpm5", "minimax_m2", "minimax_m3", "mistral", "muse_glimmer", "olmo3", "openai", "phi4_mini_json",
    "plamo3", "poolside_v1", "pythonic", "qwen3_coder", "qwen3_json", "qwen3_xml", "seed_oss", "step3", "step3p5",
    "xlam",
)


class VllmOptions(_Model):
    gpu_memory_utilization: float = Field(0.92, gt=0, le=1)
    """share of each GPU's memory vLLM may use (weights, activations and KV cache)"""
    max_num_seqs: int | None = Field(None, ge=1)
    """sequences in one engine step (vLLM's max_num_seqs); unset means vLLM's own default for the machine"""
    enable_prefix_caching: bool = True
    """reuse the KV cache of prompt prefixes rows share (system prompts, few-shot blocks)"""
    quantization: str | None = None
    """vLLM's quantization method (its --quantization), e.g. fp8 or awq"""
    max_model_len: int | None = Field(8192, ge=1)
    """null means the model's own limit"""
    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs one model is split across within a pod (tensor parallel)"""
    pipeline_parallel_size: int = Field(1, ge=1)
    """pipeline stages the model is split into (with workers.nodesPerLane, one per pod)"""
    dtype: str = "auto"
    """the weights' and activations' type: auto, bfloat16, float16 or float32"""
    max_loras: int | None = Field(None, ge=1)
    """LoRA adapters in one batch (vLLM's max_loras), with model.adapters"""
    max_lora_rank: int | None = Field(None, ge=1)
    """the largest adapter rank (vLLM's max_lora_rank), with model.adapters"""
    enforce_eager: bool = False
    """no CUDA graphs (no compiled graphs on CPU); a quicker start, slower steps"""
    engine_args: dict[str, Any] = Field(default_factory=dict, json_schema_extra=FREE_FORM)
    """any other vLLM engine argument (EngineArgs names, snake_case or camelCase), passed as given; a name the
    worker's vLLM does not know fails the worker at start (exit 42)"""
    reasoning_parser: str | None = Field(None, json_schema_extra=k8s(enum=list(REASONING_PARSERS)))
    """vLLM's reasoning parser (its --reasoning-parser): chat answers carry the reasoning as
    message.reasoning_content, apart from the content"""
    tool_call_parser: str | None = Field(None, json_schema_extra=k8s(enum=list(TOOL_CALL_PARSERS)))
    """vLLM's tool call parser (its --tool-call-parser): chat lines may carry tools, answered with
    message.tool_calls"""

    @field_validator("reasoning_parser")
    @classmethod
    def _known_reasoning_parser(cls, v: str | None) -> str | None:
        if v is not None and v not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {v!r} (vLLM ships: {', '.join(REASONING_PARSERS)})")
        return v

    @field_validator("tool_call_parser")
    @classmethod
    def _known_tool_call_parser(cls, v: str | None) -> str | None:
        if v is not None and v not in TOOL_CALL_PARSERS:
            raise ValueError(f"unknown tool call parser {v!r} (vLLM ships: {', '.join(TOOL_CALL_PARSERS)})")
        return v

    @property
    def gpus(self) -> int:
        """GPUs one vLLM engine spans: tensor-parallel x pipeline-parallel."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


class SimulatedOptions(_Model):
    """The simulated engine: continuous batching on a clock (dry runs, cost estimates, benchmarks)."""

    max_num_seqs: int = Field(256, ge=1)
    """sequences in one simulated step"""
    step_seconds: float = Field(0.02, ge=0, le=60)
    """seconds one simulated step takes"""
    load_seconds: float = Field(0.0, ge=0, le=3600)  # slept once per process, as a model load
    """slept once per process, as a model load"""


class SecretKeyRef(_Model):
    """One key of a Secret in the job's namespace."""

    name: NonEmpty
    """the Secret's name"""
    key: NonEmpty
    """the key whose value is used"""


# Where engine http reads the Authorization header's value: the Job maps model.http.headersSecret onto it.
HTTP_AUTHORIZATION_ENV = "BIJ_HTTP_AUTHORIZATION"
HTTP_NEEDS_URL = "model.engine http needs model.http.baseUrl"


class HttpOptions(_Model):
    """An OpenAI-compatible server (vLLM, SGLang, KServe, a hosted API) that answers the rows (engine http)."""

    base_url: str | None = Field(None, json_schema_extra=k8s(pattern=ENDPOINT_PATTERN))
    """the server's URL without /v1, e.g. http://vllm.inference.svc:8000; rows go to /v1/chat/completions,
    /v1/completions or /v1/embeddings by model.task"""
    served_model: str | None = Field(None, max_length=256)
    """the model name the server knows, sent as every body's model; default model.name"""
    headers_secret: SecretKeyRef | None = None
    """a Secret's key whose value is sent as the Authorization header (a bare key as Bearer); with bij run set
    env BIJ_HTTP_AUTHORIZATION instead"""
    max_in_flight: int = Field(64, ge=1, le=4096)
    """requests one lane has in flight at most; below it the lane finds the server's capacity itself (AIMD)"""
    timeout_seconds: float = Field(600, gt=0, le=86400)
    """seconds one request may take; a timeout is retried, and counts as the server being full"""
    retries: int = Field(3, ge=0, le=20)
    """sends after the first for a retryable failure (408, 429, 5xx, timeouts, lost connections); a row is sent
    at most retries + 1 times"""

    @field_validator("base_url")
    @classmethod
    def _base_url(cls, url: str | None) -> str | None:
        if url is not None and not re.match(ENDPOINT_PATTERN, url):
            raise ValueError(f"must be an http(s) URL such as http://vllm.inference.svc:8000, got {url!r}")
        return url


# Each engine's options, by the engine's name: what spec.model.<engine> carries. The worker hands them to the
# engine as they are (EngineConfig); an engine not named here takes none.
ENGINE_OPTIONS: dict[str, type[_Model]] = {"vllm": VllmOptions, "simulated": SimulatedOptions, "http": HttpOptions}
_Options = TypeVar("_Options", bound=_Model)


def unknown_option(engine: str, key: str) -> str:
    """Why spec.model.<engine>.<key> is refused: the options the engine takes."""
    takes = ", ".join(f.alias or name for name, f in ENGINE_OPTIONS[engine].model_fields.items())
    return f"engine {engine} has no option {key!r} (model.{engine} takes {takes})"


def engine_options(kind: type[_Options], given: Mapping[str, Any] | _Options) -> _Options:
    """An engine's options (kind: a class of ENGINE_OPTIONS) from spec.model.<engine>'s mapping (camelCase or
    snake_case keys), as the spec parses them; a ValueError names each key the engine does not take."""
    if isinstance(given, kind):
        return given
    engine = next(name for name, options in ENGINE_OPTIONS.items() if options is kind)
    try:
        return kind.model_validate(dict(given))
    except ValidationError as e:
        raise ValueError("; ".join(_format_errors(e, f"model.{engine}."))) from None


class SamplingSpec(_Model):
    """Sampling defaults for every row (`model.sampling`); a row's own fields win (see sampling.py)."""

    max_tokens: int | None = Field(None, ge=1)
    """tokens generated per row at most"""
    temperature: float | None = Field(None, ge=0, le=2)
    """sampling temperature; 0 is greedy"""
    seed: int | None = None
    """sampling seed"""
    top_p: float | None = Field(None, gt=0, le=1)
    """nucleus sampling: only the most likely tokens whose probabilities add up to this"""
    top_k: int | None = Field(None, ge=-1)
    """only this many most likely tokens; -1 for all"""
    min_p: float | None = Field(None, ge=0, le=1)
    """tokens less likely than this share of the most likely one are left out"""
    stop: list[NonEmpty] | None = None
    """stop strings (a row's own field may also be one string)"""
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    """penalty for a token that appeared at all (OpenAI's presence_penalty)"""
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    """penalty for a token by how often it appeared (OpenAI's frequency_penalty)"""
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    """above 1 discourages repeating tokens of the prompt and the answer"""
    n: int | None = Field(None, ge=1, le=128)
    """answers per row"""
    logprobs: bool | None = None
    """return the log probability of each generated token"""
    top_logprobs: int | None = Field(None, ge=0, le=20)
    """with logprobs, also this many most likely tokens at each place"""

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and not all(v):
            raise ValueError("stop strings must not be empty")
        return v

    @model_validator(mode="after")
    def _logprobs(self) -> SamplingSpec:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("topLogprobs needs logprobs: true")
        return self


ADAPTER_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


class AdapterSpec(_Model):
    """A LoRA adapter rows may ask for by name: a folder as PEFT saves it (file:// or s3://)."""

    name: str = Field(pattern=ADAPTER_NAME)
    """the name rows ask for the adapter by"""
    uri: str = Field(json_schema_extra=k8s(cel(STORE_URI_RULE, STORE_URI_MESSAGE),
                                           maxLength=MAX_URI))
    """the adapter's folder as PEFT saves it: file://, s3://, gs:// or az://"""

    @field_validator("uri")
    @classmethod
    def _uri_scheme(cls, uri: str) -> str:
        return _check_uri(uri)


class StructuredOutputSpec(_Model):
    """Constrained decoding for every row (`model.structuredOutput`): exactly one of these."""

    model_config = ConfigDict(json_schema_extra=k8s(minProperties=1, maxProperties=1))

    json_schema: dict[str, Any] | None = None
    """answers are JSON that validates under this JSON Schema"""
    json_object: bool | None = Field(None, json_schema_extra=k8s(enum=[True]))
    """answers are one JSON object"""
    regex: str | None = Field(None, json_schema_extra=k8s(minLength=1))
    """answers match this regular expression"""
    choice: list[NonEmpty] | None = Field(None, json_schema_extra=k8s(minItems=1))
    """answers are exactly one of these strings"""
    grammar: str | None = Field(None, json_schema_extra=k8s(minLength=1))
    """EBNF (GBNF), root rule 'root'"""


class ModelSpec(_Model):
    # has(): the API server also checks each rule against the bare default {} (no nested defaults).
    model_config = ConfigDict(json_schema_extra=k8s(
        *(_engine_task_rule(engine) for engine in ENGINE_TASKS),
        cel(f"!has(self.task) || !(self.task in {cel_list(POOLING_TASKS)}) || has(self.name)",
            POOLING_NEEDS_NAME),
        cel("!has(self.engine) || self.engine != 'http' || (has(self.http) && has(self.http.baseUrl))",
            HTTP_NEEDS_URL),
        cel("!has(self.name) || !self.name.contains('://') || ("
            + " || ".join(f"self.name.startsWith('{p}')" for p in WEIGHT_PREFIXES)
            + f") && has(self.engine) && self.engine in {cel_list(WEIGHTS_ENGINES)}", WEIGHTS_BY_URI, ".name")))

    engine: Literal["echo", "sentence-transformers", "transformers", "vllm", "simulated", "http"] = "echo"
    """what runs the model: echo (answers with the input text, embeds it as a hash: for trying bij out),
    sentence-transformers (embeddings), transformers, vllm, simulated (continuous batching on a clock), or http
    (an OpenAI-compatible server that already runs, model.http; the pods need no GPU)"""
    name: str | None = None
    """model name or path (Hugging Face id, or a path under the model cache), or an s3:// or gs:// prefix of the
    model's files, copied into the model cache once per node before it loads"""
    served_name: str | None = Field(None, max_length=256)
    """the name OpenAI batch lines use for the base model (body.model) and results report; default: model.name.
    bij-api sets it to the model map's key"""
    task: Literal["embed", "generate", "chat", "classify", "score", "rerank"] = "embed"
    """embed (a vector per row), generate (a completion of the row's text), chat (an answer to the row's messages),
    classify (a label and class probabilities for the row's text: a sequence-classification model), score (the
    relevance of input.pairField to input.textField: a cross-encoder) or rerank (input.documentsField ranked by
    relevance to input.queryField: a cross-encoder); classify, score and rerank run on engines transformers,
    sentence-transformers and vllm"""
    # No defaults here (nor in the CRD): unset is None, so a spec the API server defaulted still tells
    # whether its user set these or model.sampling's (sampling.SPEC_DEFAULTS applies where neither does).
    max_tokens: int | None = Field(None, ge=1)
    """tokens generated per row at most (generate and chat), or set model.sampling.maxTokens (not both);
    default 256"""
    temperature: float | None = Field(None, ge=0, le=2)
    """sampling temperature, 0 is greedy; or set model.sampling.temperature (not both); default 0"""
    seed: int | None = None
    """sampling seed, or set model.sampling.seed (not both); default 0"""
    row_budget: int = Field(DEFAULT_ROW_BUDGET, ge=1, le=1 << 40, json_schema_extra=INT64)
    """what one row may cost before it runs: n x maxTokens x (1 + topLogprobs when it asks for logprobs); a row over
    it is an invalid_request error row naming its fields"""
    max_input_tokens: int | None = Field(None, ge=1)
    """the prompt limit in tokens; default is the engine's limit"""
    truncate: bool | None = None
    """cut a prompt over the limit to the limit (the row is marked truncated and counted in counts.truncated)
    instead of making it a too_many_tokens error row; unset means true for tasks embed, classify, score and
    rerank, false for generate and chat"""
    sampling: SamplingSpec = SamplingSpec()
    """sampling defaults for every row (a row's OpenAI body or sampling field wins); a field the engine cannot
    honour fails the job at start naming it (see the table in docs/user-guide.md)"""
    chat_template: str | None = Field(None, json_schema_extra=k8s(minLength=1))
    """a Jinja chat template for task chat instead of the tokenizer's own"""
    chat_template_kwargs: dict[str, Any] | None = None
    """variables the chat template reads, e.g. {enable_thinking false} for a reasoning model"""
    structured_output: StructuredOutputSpec | None = None
    """constrained decoding for every row, exactly one of these (a row's own response_format or sampling
    structuredOutput wins)"""
    adapters: list[AdapterSpec] = Field(default_factory=list, max_length=64, json_schema_extra=k8s(
        x_kubernetes_list_type="map", x_kubernetes_list_map_keys=["name"]))
    """LoRA adapters a row may name (OpenAI body.model, or input.adapterField): folders as PEFT saves them, fetched
    once per pod into the model cache (engines transformers and vllm)"""
    vllm: VllmOptions = VllmOptions()
    """engine vllm: its engine arguments"""
    simulated: SimulatedOptions = SimulatedOptions()
    """engine simulated, continuous batching on a clock (dry runs, cost estimates)"""
    http: HttpOptions | None = None
    """engine http: the OpenAI-compatible server, its model name, credentials and limits"""

    def resolved_sampling(self) -> Sampling:
        """Every row's sampling defaults: model.sampling, with model.maxTokens/temperature/seed under it
        and the effective defaults (sampling.SPEC_DEFAULTS) under both."""
        older = Sampling(max_tokens=self.max_tokens, temperature=self.temperature, seed=self.seed)
        return spec_defaults(self.own_sampling(), older)

    def basics(self) -> Basics:
        """The maxTokens, temperature and seed every row defaults to, resolved as `resolved_sampling` does."""
        return basics(self.resolved_sampling())

    def own_sampling(self) -> Sampling:
        """What model.sampling and model.structuredOutput set (the engine must honour each field they ask for)."""
        fields = self.sampling.model_dump(by_alias=True, exclude_none=True)
        if self.structured_output is not None:
            fields["structuredOutput"] = self.structured_output.model_dump(by_alias=True, exclude_none=True)
        return sampling_from_spec(fields)

    @property
    def truncates(self) -> bool:
        """Whether prompts over the limit are truncated (the task's default when unset)."""
        return self.truncate if self.truncate is not None else self.task not in ("generate", "chat")

    @model_validator(mode="after")
    def _task_fits_engine(self) -> ModelSpec:
        if self.task not in ENGINE_TASKS[self.engine]:
            raise ValueError(engine_tasks_message(self.engine))
        if self.task in POOLING_TASKS and self.name is None:
            raise ValueError(POOLING_NEEDS_NAME)
        if self.name and "://" in self.name and not (self.name.startswith(WEIGHT_PREFIXES)
                                                    and self.engine in WEIGHTS_ENGINES):
            raise ValueError(WEIGHTS_BY_URI)
        if self.engine == "http":
            if self.http is None or self.http.base_url is None:
                raise ValueError(HTTP_NEEDS_URL)
            if not (self.http.served_model or self.name):
                raise ValueError("model.engine http needs model.http.servedModel or model.name: the server's model")
            if self.task == "chat" and self.truncate:
                raise ValueError("model.truncate with engine http cuts text prompts only, not task chat's messages")
        # None is unset: neither the model nor the CRD defaults these, so a defaulted spec counts only
        # what its user wrote.
        both = [k for k in ("max_tokens", "temperature", "seed")
                if getattr(self, k) is not None and getattr(self.sampling, k) is not None]
        if both:
            names = ", ".join(f"model.{to_camel(k)} and model.sampling.{to_camel(k)}" for k in both)
            raise ValueError(f"{names} both set: set one")
        adapter_names = [a.name for a in self.adapters]
        dup = sorted({n for n in adapter_names if adapter_names.count(n) > 1})
        if dup:
            raise ValueError(f"model.adapters: the name {dup[0]!r} is used twice")
        for base in (self.name, self.served_name):
            if base is not None and base in adapter_names:
                raise ValueError(f"model.adapters: {base!r} is the base model's name")
        if self.adapters and self.engine not in ("transformers", "vllm"):
            raise ValueError(f"model.adapters needs engine transformers or vllm, not {self.engine}")
        asked = self.own_sampling().asked()
        if self.task not in ("generate", "chat") and asked:
            names = ", ".join("model.structuredOutput" if a == "structuredOutput" else f"model.sampling.{a}"
                              for a in sorted(asked))
            raise ValueError(f"{names} has no meaning for task {self.task}")
        return self


class ShardingSpec(_Model):
    target_shard_bytes: int = Field(64 * 1024 * 1024, ge=1024, le=1 << 40, json_schema_extra=INT64)
    """input bytes one shard holds at most"""
    shards_per_lane: int = Field(4, ge=1, le=64)
    """a round is cut into at least this many shards per lane, so its tail is short"""
    min_shard_bytes: int = Field(1024 * 1024, ge=1024, le=1 << 40, json_schema_extra=INT64)
    """never cut shards smaller than this to reach shardsPerLane"""
    chunk_rows: int = Field(512, ge=1, le=1_000_000)
    """rows made durable together; a preempted pod loses at most one chunk"""


class BatchingSpec(_Model):
    target_batch_tokens: int | None = Field(None, ge=1)
    """padded tokens per batch (batch engines); default chosen per engine and device"""
    max_batch_size: int | None = Field(None, ge=1)
    """rows per batch (batch engines); default chosen per engine and device"""
    sort_by_length: bool = True
    """rows of similar length run together within the in-flight window (less padding)"""
    prefix_order: bool = True
    """prompts sharing a prefix run together within the in-flight window"""
    prefetch_chunks: int = Field(2, ge=1, le=64)
    """chunks read ahead of the engine"""
    in_flight_rows: int | None = Field(None, ge=1, le=1_000_000)
    """rows read and not yet handed to the commit writer (default 8 x what the engine runs at once, at least 2
    chunks)"""
    commit_queue_chunks: int = Field(4, ge=1, le=64)
    """finished chunks waiting for storage before compute waits too (those waiting together are written in one
    commit)"""


class Toleration(_Model):
    # The rules the API server applies to a Pod's tolerations (_pod_rules says the same).
    model_config = ConfigDict(json_schema_extra=k8s(
        cel("!has(self.operator) || self.operator != 'Exists' || !has(self.value) || size(self.value) == 0",
            "a toleration with operator Exists must not have a value"),
        cel("(has(self.key) && size(self.key) > 0) || (has(self.operator) && self.operator == 'Exists')",
            "a toleration without a key must use operator Exists"),
        cel("!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
            "tolerationSeconds needs effect NoExecute")))

    key: str | None = Field(None, json_schema_extra=k8s(maxLength=317))
    """the taint's key; empty with operator Exists tolerates every taint"""
    operator: Literal["Exists", "Equal"] | None = None
    """Equal (key and value match) or Exists (the key matches)"""
    value: str | None = Field(None, json_schema_extra=k8s(maxLength=63))
    """the taint's value, with operator Equal"""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """the taint effect tolerated; empty for all"""
    toleration_seconds: int | None = Field(None, json_schema_extra=INT64)
    """with effect NoExecute, how long a pod stays on a node tainted so"""

    @model_validator(mode="after")
    def _pod_rules(self) -> Toleration:
        # The same rules the API server applies to a Pod; caught here, not when the Job is created.
        if self.operator == "Exists" and self.value:
            raise ValueError("a toleration with operator Exists must not have a value")
        if not self.key and self.operator != "Exists":
            raise ValueError("a toleration without a key must use operator Exists")
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise ValueError("tolerationSeconds needs effect NoExecute")
        return self


class ModelCacheSpec(_Model):
    model_config = ConfigDict(json_schema_extra=k8s(
        cel("!has(self.type) || self.type != 'hostPath' || (has(self.path) && size(self.path) > 0)",
            "modelCache.type hostPath needs modelCache.path"),
        cel("!has(self.type) || self.type != 'pvc' || (has(self.claimName) && size(self.claimName) > 0)",
            "modelCache.type pvc needs modelCache.claimName")))

    type: Literal["emptyDir", "hostPath", "pvc"] = "emptyDir"
    """emptyDir (the pod's own, gone with it), hostPath (a folder of the node) or pvc (a PersistentVolumeClaim)"""
    path: str | None = Field(None, json_schema_extra=k8s(maxLength=MAX_URI))  # hostPath only
    """hostPath only"""
    claim_name: str | None = Field(None, json_schema_extra=k8s(maxLength=253))  # pvc only
    """pvc only"""
    size_limit: str | None = Field(None, pattern=QUANTITY_PATTERN)  # emptyDir only
    """emptyDir only"""
    mount_path: str = "/models"
    """where the cache is mounted in the worker container"""

    @model_validator(mode="after")
    def _source(self) -> ModelCacheSpec:
        if self.type == "hostPath" and not self.path:
            raise ValueError("modelCache.type hostPath needs modelCache.path")
        if self.type == "pvc" and not self.claim_name:
            raise ValueError("modelCache.type pvc needs modelCache.claimName")
        return self


# A pool's name goes into its Jobs' label and messages: a short DNS label.
POOL_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]{0,14}[a-z0-9])?$"
MAX_POOLS = 8
POOLS_UNIQUE = "workers.pools: each pool needs a name of its own"
POOLS_NOT_GROUPS = "workers.pools cannot be combined with workers.nodesPerLane above 1"


class WorkerPool(_Model):
    """One place the worker pods may run (spec.workers.pools, in order of preference): its placement, its price
    and how many lanes it takes; unset fields take spec.workers' value."""

    name: str = Field(pattern=POOL_NAME_PATTERN)
    """the pool's name (a DNS label of at most 16 characters), shown per pool in the status"""
    node_selector: dict[str, str] = {}
    """node labels this pool's worker pods must have (added to workers.nodeSelector)"""
    affinity: dict[str, Any] | None = None
    """a Pod affinity for this pool's pods; default workers.affinity"""
    tolerations: list[Toleration] = Field([], json_schema_extra=k8s(maxItems=64))
    """taints this pool's pods tolerate (added to workers.tolerations)"""
    gpus: int | None = Field(None, ge=0, le=64)
    """GPUs per worker pod in this pool; default workers.gpus"""
    spot: bool | None = None
    """whether this pool is spot/preemptible capacity; default workers.spot"""
    price_per_hour: float | None = Field(None, ge=0, strict=True)
    """price of one worker pod per hour in this pool; default workers.pricePerHour"""
    max_lanes: int | None = Field(None, ge=1, le=10_000)
    """at most this many lanes of a round in this pool; the rest go to the next pools; default no limit"""
    start_timeout_seconds: int = Field(300, ge=1, le=86_400)
    """a pool whose pods stay unschedulable this long (or are preempted again and again) gives its lanes to the
    next pool for the rest of the round"""
    queue_name: str | None = None
    """Kueue LocalQueue of this pool's Jobs; default workers.queueName"""
    tensor_parallel_size: int | None = Field(None, ge=1)
    """model.vllm.tensorParallelSize for this pool's pods (its GPUs differ); default the model's"""


class WorkersSpec(_Model):
    model_config = ConfigDict(json_schema_extra=k8s(
        cel("!has(self.pools) || size(self.pools) == 0 || !has(self.nodesPerLane) || self.nodesPerLane == 1",
            POOLS_NOT_GROUPS, ".pools")))

    parallelism: int = Field(4, ge=1, le=10_000)
    """lanes (worker pods, or groups of nodesPerLane pods) that run at once; each works many shards"""
    image: str | None = None  # default: the operator's configured worker image
    """worker image; default is the operator's configured worker image"""
    gpus: int | None = Field(None, ge=0, le=64)
    """GPUs per worker pod (nvidia.com/gpu); unset means tensorParallelSize x pipelineParallelSize for engine vllm,
    none for the other engines"""
    price_per_hour: float | None = Field(None, ge=0, strict=True)
    """price of one worker pod per hour, in any currency; the manifest and status then report cost (total,
    perMillionRows, perMillionTokens)"""
    cpu: str | None = Field(None, pattern=QUANTITY_PATTERN)
    """CPU request and limit, a Kubernetes quantity ("4", "500m")"""
    memory: str | None = Field(None, pattern=QUANTITY_PATTERN)
    """memory request and limit, a Kubernetes quantity ("16Gi")"""
    shm_size: str | None = Field("8Gi", pattern=QUANTITY_PATTERN)
    """size of the in-memory /dev/shm; null mounts none"""
    spot: bool = False
    """schedule on spot/preemptible nodes (preemptions are not counted as failures)"""
    spot_provider: Literal["all", "gke", "eks", "karpenter", "aks"] = "all"
    """which spot node labels to select: one provider's (nodeSelector), or all (tolerate every spot taint and prefer
    any spot label)"""
    steps_on_worker_nodes: bool = False
    """run the step Jobs (plan, finish, publish plan, manifest: small pods without a GPU) with the workers'
    placement (nodeSelector, tolerations, affinity, spot and GPU); default: on any node"""
    node_selector: dict[str, str] = {}
    """node labels the worker pods must have"""
    tolerations: list[Toleration] = Field([], json_schema_extra=k8s(maxItems=64))
    """taints the worker pods tolerate (with spot, also the providers' spot taints)"""
    affinity: dict[str, Any] | None = None
    """a Pod affinity, merged with the spot node affinity"""
    priority_class_name: str | None = None
    """the worker pods' PriorityClass"""
    queue_name: str | None = None
    """Kueue LocalQueue; the round Jobs get the kueue.x-k8s.io/queue-name label"""
    service_account_name: str | None = None
    """the pods' service account; default bij-worker (installed by the chart)"""
    backoff_limit_per_index: int = Field(3, ge=0, le=100)
    """retries of one lane (pod index) after real failures (preemptions do not count)"""
    # A lane renews its claim on the shard it works this often / 3; a shard whose claim is older
    # than this (its pod died) is taken over by another lane.
    lease_seconds: int = Field(60, ge=3, le=3600)
    """a shard whose worker stopped renewing its claim this long is taken over by another lane"""
    nodes_per_lane: int = Field(1, ge=1, le=64)
    """pods (nodes) one lane spans; above 1 the leader runs a Ray head and the bij worker, the others Ray workers,
    and vLLM runs pipeline parallel across them (engine vllm or simulated)"""
    # Kubernetes caps maxFailedIndexes (and completions with backoffLimitPerIndex) at 100000.
    max_failed_indexes: int | None = Field(None, ge=0, le=100_000)
    """fail the round once more shards than this have failed; default lets every shard run"""
    termination_grace_period_seconds: int = Field(60, ge=1, le=3600)
    """seconds a worker pod has after SIGTERM to commit its finished chunks before it is killed"""
    ttl_seconds_after_finished: int | None = Field(86400, ge=0)
    """delete finished round Jobs after this long; null keeps them"""
    model_cache: ModelCacheSpec = ModelCacheSpec()
    """where the model's files are kept on the node: emptyDir, hostPath or a PVC"""
    env: dict[str, str] = {}
    """extra environment variables for the worker container"""
    pools: list[WorkerPool] = Field([], json_schema_extra=k8s(
        maxItems=MAX_POOLS, x_kubernetes_list_type="map", x_kubernetes_list_map_keys=["name"]))
    """places the worker pods may run, in order of preference (a spot pool first, say): a round's lanes fill them
    in order (up to maxLanes each), and a pool whose pods cannot start gives its lanes to the next; each row is
    still done once. Empty: one pool, as workers says"""

    @property
    def pool_prices(self) -> dict[str, float | None] | None:
        """Each pool's price per hour (its own, else pricePerHour); None without pools."""
        if not self.pools:
            return None
        return {p.name: p.price_per_hour if p.price_per_hour is not None else self.price_per_hour for p in self.pools}

    @model_validator(mode="after")
    def _pools(self) -> WorkersSpec:
        names = [p.name for p in self.pools]
        if len(set(names)) != len(names):
            raise ValueError(POOLS_UNIQUE)
        if self.pools and self.nodes_per_lane > 1:
            raise ValueError(POOLS_NOT_GROUPS)
        return self


class JudgeSpec(_Model):
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


class PromptSpec(_Model):
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


class CanarySpec(_Model):
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


class NotifyTarget(_Model):
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


class JobSpec(_Model):
    model_config = ConfigDict(json_schema_extra=k8s(
        cel("!has(self.judge) || self.model.task in ['generate', 'chat']", JUDGE_NEEDS_TEXT, ".judge"),
        cel("!has(self.output.format) || !has(self.input.format) || self.output.format != 'parquet' || "
            "self.input.format != 'openai'", PARQUET_NOT_OPENAI, ".output.format"),
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
        if self.output.format == "parquet" and self.input.format == "openai":
            raise ValueError(PARQUET_NOT_OPENAI)
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


class Metadata(_Model):
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


class BatchInferenceJob(_Model):
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


def _check_uri(uri: str) -> str:
    if not uri.startswith(WRITABLE):
        raise ValueError(f"must start with {prefixes(writable_only=True)}, got {uri!r}")
    scheme = scheme_of(uri)
    if scheme is not None and not re.match(f"^({scheme.pattern})$", uri):
        raise ValueError(f"{scheme.prefix} needs {scheme.needs} ({scheme.form}), got {uri!r}")
    return uri


def folder_key(uri: str) -> str:
    """A URI as a folder, for comparing places: one trailing slash, `.`/`..` resolved in file:// paths."""
    if uri.startswith("file://"):
        path = posixpath.normpath(uri[len("file://"):])
        uri = "file://" + path
    return uri.rstrip("/") + "/"


def uris_overlap(a: str, b: str) -> bool:
    """Whether one URI is the other or lies under it (`in/` and `in-old/` do not overlap)."""
    fa, fb = folder_key(a), folder_key(b)
    return fa.startswith(fb) or fb.startswith(fa)


# The path of an engine's option (spec.model.vllm.maxNumSeqs): the engine and the key.
_ENGINE_OPTION = re.compile(r"(?:^|\.)model\.(" + "|".join(ENGINE_OPTIONS) + r")\.([^.]+)$")


def _format_errors(err: ValidationError, prefix: str = "") -> list[str]:
    problems = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"] if p not in ("function-after",))
        path = f"{prefix}{loc}" if loc else prefix.rstrip(".") or "(document)"
        msg = e["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        if e["type"] == "extra_forbidden":
            msg = "unknown field"
            option = _ENGINE_OPTION.search(path)
            if option is not None:
                msg = unknown_option(option[1], option[2])
        problems.append(f"{path}: {msg}")
    return problems


def parse_job(doc: Any, source: str | None = None) -> BatchInferenceJob:
    """Validate a BatchInferenceJob document (a dict as parsed from YAML or from the API)."""
    if not isinstance(doc, dict):
        raise SpecError(["(document): must be a mapping with apiVersion, kind, metadata and spec"], source)
    if "spec" not in doc:
        raise SpecError(["spec: missing"], source)
    try:
        return BatchInferenceJob.model_validate(doc)
    except ValidationError as e:
        raise SpecError(_format_errors(e), source) from None


def parse_spec(spec: Any, name: str = "job", source: str | None = None) -> JobSpec:
    """Validate only a `spec` mapping (the operator gets metadata from the API)."""
    try:
        return JobSpec.model_validate(spec)
    except ValidationError as e:
        raise SpecError(_format_errors(e, "spec."), source) from None


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
