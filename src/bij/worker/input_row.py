"""A parsed input row (`Row`: its request, or the error it is) and the options lines are parsed with
(`InputOptions`, from the job's spec)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bij.contract.columns import consumed, result_fields
from bij.contract.prompt import compiled_template
from bij.contract.sampling import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_ROW_BUDGET,
    DEFAULT_SEED,
    DEFAULT_TEMPERATURE,
    NO_SAMPLING,
    Sampling,
    basics,
)
from bij.engines.base import Request

if TYPE_CHECKING:  # annotations only: a publish pass never loads the spec model
    from jinja2 import Template

    from bij.contract.spec import JobSpec

# Reserved field of re-dispatched rows (judge rounds): {"id", "attempts", "verdicts", "output"}.

@dataclass(slots=True)
class Row:
    """One parsed input line: a request to run, or an error to record."""

    at: tuple[int, int, int]  # (object index, offset, end)
    id: Any  # str or int exactly as given (or generated); None when unknown
    request: Request | None = None
    error_code: str | None = None
    error: str | None = None
    url: str | None = None  # OpenAI batch lines: which endpoint shape to answer in
    generated_id: bool = False
    # Judge rounds: attempts and verdicts a row already had in earlier rounds
    # (carried in the re-dispatched line's "_bij" field).
    prior_attempts: int = 0
    verdicts: list[str] = field(default_factory=list)
    tokens: int = 0  # prompt tokens, once the worker has counted them
    truncated: bool = False  # the prompt was over the limit and the engine cut it (model.truncate)
    output: str | None = None  # a schema_violation error row: the answer that broke its structured output
    # A row with several prompts (an OpenAI list `input` or `prompt`): one request each, in order,
    # answered in one result row; `request` is the first. None: the row has one prompt.
    parts: list[Request] | None = None
    encoding: str = "float"  # /v1/embeddings encoding_format: float or base64
    carried: dict[str, Any] | None = None  # its pass-through columns (contract.columns), None for none
    top_n: int = 0  # an OpenAI /v1/rerank line's top_n: the best n documents answered (0: all)


@dataclass(frozen=True)
class InputOptions:
    format: str = "jsonl"
    id_field: str = "id"
    text_field: str = "text"
    messages_field: str | None = None
    task: str = "embed"
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = DEFAULT_TEMPERATURE
    seed: int = DEFAULT_SEED
    model_name: str = "bij"
    truncate: bool = True  # prompts over the token limit are cut (and marked) rather than refused
    sampling_field: str = "sampling"  # a JSONL/Parquet row's own sampling fields (spec keys)
    sampling: Sampling = NO_SAMPLING  # the spec's sampling defaults, every field resolved
    # The engine that will run the rows and the fields it honours (None: rows are not checked
    # against an engine, as in a publish pass).
    engine: str = ""
    honours: frozenset[str] | None = None
    adapter_field: str = "adapter"  # a plain row's LoRA adapter name
    adapters: frozenset[str] = frozenset()  # spec.model.adapters' names
    max_image_bytes: int = 20 << 20  # input.maxImageBytes (DEFAULT_MAX_IMAGE_BYTES): one image's bytes at most
    image_root: str | None = None  # the folder (a path) file:// images may come from; None: none may
    row_budget: int = DEFAULT_ROW_BUDGET  # model.rowBudget: n x maxTokens x (1 + topLogprobs) a row may ask
    # input.passThrough (contract.columns): None every column the request does not consume, else these.
    pass_through: tuple[str, ...] | None = None
    # The lines are a later judge round's input, written by bij (redispatch_line): only then is a row's
    # `_bij` field bij's bookkeeping; in the user's input it is a reserved name, an error row.
    redispatched: bool = False
    # The results are Parquet (output.format): a carried integer must fit int64, else the row is an error row.
    int64_columns: bool = False
    # spec.prompt: the compiled template a plain row's prompt is rendered with (None: the row's textField),
    # and task chat's system message before it.
    prompt: Template | None = None
    system: str | None = None
    pair_field: str = "pair"  # task score: the text scored against the row's text
    query_field: str = "query"  # task rerank: the query
    documents_field: str = "documents"  # task rerank: the texts ranked

    @classmethod
    def from_spec(cls, spec: JobSpec, engine: str = "", honours: frozenset[str] | None = None, *,
                  round_no: int = 0) -> InputOptions:
        """From the job's spec (as carried in the round plan) for round `round_no`, checked against `engine`'s
        `honours`."""
        inp, model = spec.input, spec.model
        sampling = model.resolved_sampling()
        basic = basics(sampling)
        return cls(
            format=inp.format,
            id_field=inp.id_field,
            text_field=inp.text_field,
            messages_field=inp.messages_field,
            task=model.task,
            max_tokens=basic.max_tokens,
            temperature=basic.temperature,
            seed=basic.seed,
            model_name=model.served_name or model.name or model.engine,
            truncate=model.truncates,
            sampling_field=inp.sampling_field,
            sampling=sampling,
            adapter_field=inp.adapter_field,
            adapters=frozenset(a.name for a in model.adapters),
            max_image_bytes=inp.max_image_bytes,
            image_root=inp.image_root_path(),
            row_budget=model.row_budget,
            engine=engine or model.engine,
            honours=honours,
            pass_through=() if inp.format == "openai" else
            None if inp.pass_through is None else tuple(inp.pass_through),
            redispatched=round_no > 0,  # round 0 reads the user's input, every later one a round's rejects
            int64_columns=spec.output.format == "parquet",
            prompt=None if spec.prompt is None else compiled_template(spec.prompt.template),
            system=None if spec.prompt is None else spec.prompt.system,
            pair_field=inp.pair_field,
            query_field=inp.query_field,
            documents_field=inp.documents_field,
        )

    @property
    def consumed(self) -> frozenset[str]:
        """The columns a row's request consumes: never carried by every-column pass-through."""
        return consumed(self.id_field, self.text_field, self.messages_field, self.sampling_field,
                        self.adapter_field) | frozenset(self.task_columns)

    @property
    def task_columns(self) -> tuple[str, ...]:
        """The columns a pooling task reads beside the text: score's pair, rerank's query and documents."""
        if self.task == "score":
            return (self.pair_field,)
        if self.task == "rerank":
            return (self.query_field, self.documents_field)
        return ()

    @property
    def result_fields(self) -> frozenset[str]:
        """The names the task's result rows use themselves (an input column of such a name clashes)."""
        return result_fields(self.task)


def parquet_columns(opts: InputOptions) -> list[str] | None:
    """The columns a Parquet input is read for: id, text, chat messages, sampling and adapter fields, and the
    pass-through columns (None: every column, as a prompt template may read any)."""
    if opts.pass_through is None or opts.prompt is not None:
        return None
    wanted = [c for c in (opts.id_field, opts.text_field, opts.messages_field, opts.sampling_field,
                          opts.adapter_field, *opts.task_columns) if c]
    return wanted + [c for c in opts.pass_through if c not in wanted]
