"""The spec's model (spec.model): what runs every row, the task, the sampling defaults, LoRA adapters,
structured output, and each engine's own options (ENGINE_OPTIONS).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal, TypeVar

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

from bij.contract.engines import ENGINE_TASKS, POOLING_TASKS, WEIGHTS_ENGINES, names
from bij.contract.sampling import DEFAULT_ROW_BUDGET, Basics, Sampling, basics, spec_defaults
from bij.contract.sampling import from_spec as sampling_from_spec
from bij.contract.schema import FREE_FORM, INT64, cel, cel_list, k8s
from bij.contract.schemes import REMOTE
from bij.contract.spec_base import NonEmpty, SecretKeyRef, SpecModel
from bij.contract.spec_io import ENDPOINT_PATTERN, MAX_URI, STORE_URI_MESSAGE, STORE_URI_RULE, check_uri


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


class VllmOptions(SpecModel):
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


class SimulatedOptions(SpecModel):
    """The simulated engine: continuous batching on a clock (dry runs, cost estimates, benchmarks)."""

    max_num_seqs: int = Field(256, ge=1)
    """sequences in one simulated step"""
    step_seconds: float = Field(0.02, ge=0, le=60)
    """seconds one simulated step takes"""
    load_seconds: float = Field(0.0, ge=0, le=3600)  # slept once per process, as a model load
    """slept once per process, as a model load"""

# Where engine http reads the Authorization header's value: the Job maps model.http.headersSecret onto it.
HTTP_AUTHORIZATION_ENV = "BIJ_HTTP_AUTHORIZATION"
HTTP_NEEDS_URL = "model.engine http needs model.http.baseUrl"


class HttpOptions(SpecModel):
    """An OpenAI-compatible server (vLLM, SGLang, KServe, a hosted API) that answers the rows (engine http)."""

    base_url: str | None = Field(None, json_schema_extra=k8s(pattern=ENDPOINT_PATTERN))
    """the server's URL without /v1, e.g. http://vllm.inference.svc:8000; rows go to /v1/chat/completions,
    /v1/completions, /v1/embeddings, or vLLM's /classify, /score or /rerank by model.task"""
    served_model: str | None = Field(None, max_length=256)
    """the model name the server knows, sent as every body's model; default model.name"""
    headers_secret: SecretKeyRef | None = None
    """a Secret's key whose value is sent as the Authorization header (a bare key as Bearer); with bij run set
    env BIJ_HTTP_AUTHORIZATION instead"""
    max_in_flight: int = Field(64, ge=1, le=4096)
    """requests one lane has in flight at most; below it the lane's congestion window finds the server's capacity"""
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
ENGINE_OPTIONS: dict[str, type[SpecModel]] = {"vllm": VllmOptions, "simulated": SimulatedOptions, "http": HttpOptions}
_Options = TypeVar("_Options", bound=SpecModel)


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
        raise ValueError("; ".join(format_errors(e, f"model.{engine}."))) from None


class SamplingSpec(SpecModel):
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


class AdapterSpec(SpecModel):
    """A LoRA adapter rows may ask for by name: a folder as PEFT saves it (file:// or s3://)."""

    name: str = Field(pattern=ADAPTER_NAME)
    """the name rows ask for the adapter by"""
    uri: str = Field(json_schema_extra=k8s(cel(STORE_URI_RULE, STORE_URI_MESSAGE),
                                           maxLength=MAX_URI))
    """the adapter's folder as PEFT saves it: file://, s3://, gs:// or az://"""

    @field_validator("uri")
    @classmethod
    def _uri_scheme(cls, uri: str) -> str:
        return check_uri(uri)


class StructuredOutputSpec(SpecModel):
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


class ModelSpec(SpecModel):
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
    """model name or path (Hugging Face id, or a path under the model cache), or an s3://, gs:// or az:// prefix of the
    model's files, copied into the model cache once per node before it loads"""
    served_name: str | None = Field(None, max_length=256)
    """the name OpenAI batch lines use for the base model (body.model) and results report; default: model.name.
    bij-api sets it to the model map's key"""
    task: Literal["embed", "generate", "chat", "classify", "score", "rerank"] = "embed"
    """embed (a vector per row), generate (a completion of the row's text), chat (an answer to the row's messages),
    classify (a label and class probabilities for the row's text: a sequence-classification model), score (the
    relevance of input.pairField to input.textField: a cross-encoder) or rerank (input.documentsField ranked by
    relevance to input.queryField: a cross-encoder); classify, score and rerank run on engines transformers,
    sentence-transformers, vllm and http"""
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


# The path of an engine's option (spec.model.vllm.maxNumSeqs): the engine and the key.
_ENGINE_OPTION = re.compile(r"(?:^|\.)model\.(" + "|".join(ENGINE_OPTIONS) + r")\.([^.]+)$")


def format_errors(err: ValidationError, prefix: str = "") -> list[str]:
    """Each problem pydantic found as `path: reason`, the path under `prefix` (an engine's unknown option says
    what the engine takes)."""
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
