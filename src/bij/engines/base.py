"""The one engine interface: echo, sentence-transformers, transformers and vLLM sit behind it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, Protocol, TypeGuard

from bij.contract.sampling import DEFAULT_MAX_TOKENS, DEFAULT_SEED, DEFAULT_TEMPERATURE, NO_SAMPLING, Sampling
from bij.contract.spec_model import ENGINE_OPTIONS, HttpOptions, SimulatedOptions, VllmOptions, engine_options

# What every engine honours: how many tokens, how random, which seed (see the table in docs/user-guide.md, "Sampling").
BASIC_SAMPLING: frozenset[str] = frozenset({"maxTokens", "temperature", "seed"})
# How a chat row's template renders (engines that render chat templates: transformers, vLLM).
CHAT_TEMPLATE_FIELDS: frozenset[str] = frozenset({"chatTemplateKwargs", "addGenerationPrompt", "continueFinalMessage"})


@dataclass(frozen=True, slots=True)
class Image:
    """One image of a chat row, in the order of its `image_url` parts: where it came from (a
    `file://` or `s3://` URI, or a data URL's media type) and its bytes, once fetched."""

    source: str
    data: bytes | None = None  # None until the worker fetched it (file://, s3://)


@dataclass(frozen=True, slots=True)
class ToolAsk:
    """A chat row's tools (OpenAI `tools`, function tools only), which one it must call (`tool_choice`:
    "none", "auto", "required" or a function's name) and whether it may call several at once."""

    tools: tuple[dict[str, Any], ...]
    choice: str = "auto"  # none | auto | required | the name of a function in `tools`
    named: bool = False  # `choice` names a function
    parallel: bool | None = None  # OpenAI `parallel_tool_calls`; None: not set (several allowed)

    def body(self) -> dict[str, Any]:
        """The fields as an OpenAI chat body carries them."""
        choice: Any = {"type": "function", "function": {"name": self.choice}} if self.named else self.choice
        out: dict[str, Any] = {"tools": list(self.tools), "tool_choice": choice}
        if self.parallel is not None:
            out["parallel_tool_calls"] = self.parallel
        return out


@dataclass(slots=True)  # not frozen: a frozen dataclass pays a setattr call per field, per row
class Request:
    """One row's work (or one of its prompts): `text` (or `token_ids`) for embed/generate, `messages`
    (OpenAI chat shape) for chat."""

    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = DEFAULT_TEMPERATURE
    seed: int | None = None
    # Every sampling field in force for this row (spec defaults under the row's own); the three
    # above are its resolved max_tokens, temperature and seed.
    sampling: Sampling = NO_SAMPLING
    adapter: str | None = None  # a LoRA adapter's name (spec.model.adapters); None: the base model
    images: tuple[Image, ...] = ()  # the images of the messages' image_url parts, in order
    # A prompt given as token ids (OpenAI `prompt`/`input` of integers): the model gets them as they
    # are, no special tokens added; `text` is then None.
    token_ids: list[int] | None = None
    tools: ToolAsk | None = None  # a chat row's tools (OpenAI `tools`, `tool_choice`)
    reasoning_effort: str | None = None  # OpenAI `reasoning_effort`, given to the chat template
    # Task score: the text scored against `text`. Task rerank: the documents ranked against `text` (the query).
    pair: str | None = None
    documents: list[str] | None = None


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token: its text, log-probability, and the most likely tokens at its place."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@dataclass(slots=True)
class Choice:
    """One of a row's `n` answers (sampling `n`), or its only answer when it asked for logprobs."""

    output: str
    completion_tokens: int
    finish_reason: str
    logprobs: list[TokenLogprob] | None = None  # when the row asked for them
    reasoning: str | None = None  # the reasoning a reasoning parser found, apart from `output`
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI message.tool_calls a tool parser found
    reasoning_tokens: int | None = None  # tokens of the reasoning (with a reasoning parser)


@dataclass(slots=True)
class Result:
    """One row's answer, or an error that belongs to this row alone.

    A row that asked for `n` > 1 answers or for logprobs has `choices` (n of them); `output`
    is the first choice's text and `completion_tokens` counts the tokens of every choice,
    as OpenAI's usage does.
    """

    output: str | None = None
    embedding: list[float] | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    choices: list[Choice] | None = None
    cached_tokens: int | None = None  # prompt tokens the engine's prefix cache served (vLLM)
    # A pooling task's answer, the result row's own fields: {label, probs} (classify), {score} (score) or
    # {results: [{index, relevance_score}], best first} (rerank).
    pooled: dict[str, Any] | None = None


@dataclass(frozen=True)
class EngineConfig:
    """What an engine needs from the spec (spec.model), flattened."""

    task: str = "embed"  # embed | generate | chat | classify | score | rerank
    name: str | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = DEFAULT_TEMPERATURE
    seed: int = DEFAULT_SEED
    max_input_tokens: int | None = None
    # Cut prompts over max_input_tokens() to it instead of refusing them (spec.model.truncate).
    truncate: bool = False
    # The engines' options as spec.model carries them (model.vllm, model.simulated, model.http), typed and
    # validated: one field per engine of contract.spec_model.ENGINE_OPTIONS, named after it. A config built by hand
    # (tests, benchmarks) may give the spec's mapping instead: it is parsed here, once, and a key the engine
    # does not take is a ValueError naming it and the engine.
    vllm: VllmOptions = field(default_factory=VllmOptions)
    simulated: SimulatedOptions = field(default_factory=SimulatedOptions)
    http: HttpOptions | None = None
    device: str | None = None  # None: cuda when available, else cpu
    # Chat prompts: a template instead of the tokenizer's own, and variables it reads.
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # LoRA adapters by name: their local folders (fetched by the worker before the engine loads).
    adapters: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, kind in ENGINE_OPTIONS.items():
            given = getattr(self, name)
            if given is not None and not isinstance(given, kind):
                object.__setattr__(self, name, engine_options(kind, given))


class Engine(Protocol):
    """A loaded model. `load` runs once per process; `run` many times.

    `run` returns one Result per request, in the same order. A problem with one
    row is that row's `Result.error`; an exception means the whole batch (and
    the process) is in trouble.
    """

    # What it declares about itself, read-only for the worker (plain attributes in an engine).

    @property
    def name(self) -> str: ...

    @property
    def schedules_itself(self) -> bool:
        """It schedules a whole chunk itself (vLLM): the worker hands it the chunk at once instead of
        token-budget batches."""
        ...

    @property
    def continuous(self) -> bool:
        """It is a ContinuousEngine (submit / step, its own continuous batching); False: batches go
        through `run`."""
        ...

    @property
    def parallel_prepare(self) -> bool:
        """Its compute lets go of the interpreter (torch, vLLM): the worker parses the next chunks in its
        reader thread meanwhile (for the others that would only take turns with them)."""
        ...

    @property
    def honours(self) -> frozenset[str]:
        """The request fields (camelCase sampling names, `sampling.IMAGES`) it honours for its task; a
        row that asks for another is an `unsupported` error row naming it."""
        ...

    @property
    def steps(self) -> int:
        """Engine steps taken (continuous engines count them; 0 for the others)."""
        ...

    @property
    def occupied(self) -> int:
        """Running sequences summed over its steps: occupied / (steps x concurrency) is occupancy."""
        ...

    @property
    def notes(self) -> Sequence[str]:
        """What it learnt it cannot serve at all (a grammar its tokenizer cannot take, ...), once each:
        said once in the job's status, not per row."""
        ...

    def load(self) -> None: ...

    def batch_shape(self) -> tuple[int, int] | None:
        """(maxBatchSize, targetBatchTokens) it prefers on its device, for a spec that leaves them
        out; None: the worker's defaults."""
        ...

    def count_tokens(self, requests: list[Request]) -> list[int]:
        """Prompt tokens per request: the real tokenizer where the engine has one."""
        ...

    def max_input_tokens(self) -> int | None:
        """Longest prompt the model accepts, or None when unbounded."""
        ...

    def run(self, requests: list[Request]) -> list[Result]: ...

    def close(self) -> None:
        """Let go of what the engine holds outside this process's memory (engine processes, connections),
        once its process has no more work for it; calling it again does nothing. The worker calls it
        once, as the lane ends (bij.worker.main), on every path."""
        ...


class EngineBase:
    """What an engine that has nothing to say about them declares: no steps counted, no notes, no
    preferred batch shape, nothing to let go of at close. Every engine subclasses it and sets the
    capabilities `Engine` names."""

    steps: int = 0
    occupied: int = 0
    notes: Sequence[str] = ()

    def batch_shape(self) -> tuple[int, int] | None:
        return None

    def close(self) -> None:
        return None


class EstimatedTokens:
    """For an engine with no tokenizer here (echo, http): tokens are estimated from the text, and the
    input limit is config.max_input_tokens alone."""

    config: EngineConfig

    def count_tokens(self, requests: list[Request]) -> list[int]:
        return estimate_many(request_texts(requests))

    def max_input_tokens(self) -> int | None:
        return self.config.max_input_tokens


class ContinuousEngine(Engine, Protocol):
    """An engine with its own continuous batching (vLLM, simulated): requests join and leave
    the running batch at any step, so the worker keeps it fed instead of handing it batches.

    `submit` queues one request under the caller's tag (a request it cannot take at all
    may raise ValueError: that row fails alone); each `step` advances every running
    sequence and returns the requests that finished, in any order; `unfinished` counts
    requests submitted and not yet returned; `concurrency` is how many run at once;
    `abort` drops requests not yet returned (those tags, or all), which no step returns then.
    """

    def concurrency(self) -> int: ...

    def submit(self, tag: int, request: Request) -> None: ...

    def step(self) -> list[tuple[int, Result]]: ...

    def unfinished(self) -> int: ...

    def abort(self, tags: Sequence[int] | None = None) -> None: ...


# The error code of a row the engine failed on alone, or refused when it was submitted.
ENGINE_REJECTED = "engine_rejected"


def refused(e: ValueError) -> Result:
    """The error result of a row a continuous engine refused when it was submitted."""
    code = getattr(e, "code", ENGINE_REJECTED)  # an engine's refusal may name its own code
    if code != ENGINE_REJECTED:
        return Result(error=str(e), extra={"code": code})
    return Result(error=f"the engine rejected the request: {e or type(e).__name__}", extra={"code": ENGINE_REJECTED})


def is_continuous(engine: Engine) -> TypeGuard[ContinuousEngine]:
    """The engine runs its own continuous batching (submit / step), as it declares."""
    return engine.continuous


def run_to_completion(engine: ContinuousEngine, requests: list[Request]) -> list[Result]:
    """`run` for a continuous engine: submit every request, step until all are back, in order.

    Only for an engine with nothing else in flight (the worker's judge path, tests).
    """
    results: list[Result | None] = [None] * len(requests)
    for i, req in enumerate(requests):
        try:
            engine.submit(i, req)
        except ValueError as e:
            results[i] = refused(e)
    while engine.unfinished():
        for tag, res in engine.step():
            results[tag] = res
    return [r if r is not None else Result(error="the engine returned no result") for r in results]


def estimate_tokens(text: str) -> int:
    """A tokenizer-free estimate (about 4 bytes a token for English BPE vocabularies)."""
    # An ASCII string's length is its size in UTF-8: no copy to count it.
    return max(1, (len(text) if text.isascii() else len(text.encode("utf-8", "replace"))) // 4)


def estimate_many(texts: list[str]) -> list[int]:
    """estimate_tokens of each text, in one pass (one encode each, in C; ASCII text encodes as a copy)."""
    return [n >> 2 or 1 for n in map(len, map(str.encode, texts, repeat("utf-8"), repeat("replace")))]


def request_texts(requests: list[Request]) -> list[str]:
    """request_text of each request, plain text without a call per row."""
    return [r.text if r.text is not None else request_text(r) for r in requests]


def request_text(req: Request) -> str:
    """The text a request carries, chat messages flattened (for counting and echo)."""
    if req.text is not None:
        return req.text
    parts = []
    for m in req.messages or []:
        c = m.get("content")
        if isinstance(c, str):
            parts.append(c)
        elif isinstance(c, list):
            parts.extend(str(p.get("text", "")) for p in c if isinstance(p, dict))
    return "\n".join(parts)
