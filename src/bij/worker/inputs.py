"""Input rows in: `jsonl` rows and OpenAI batch request lines, each parsed into its request (or an error row).

A bad row never stops a shard: it becomes an error row that says what is wrong
and where the row is (object and byte offset). Rows without an id get a stable
one from their place, ``<object name>:<byte offset>``, the same on every run.

Each row's request is built here, once: its content, and its sampling fields from the
spec, the OpenAI body or the sampling column (`sampling.py`). A field bij does not know
is an ``invalid_request`` row; one the engine cannot honour, an ``unsupported`` row.

A plain row's other columns are carried to its result, error and capped rows
(`contract.columns`, input.passThrough); a row with a column named like a result field
is an ``invalid_row`` row naming it. Integers beyond 64 bits are read exactly (exact_json).

With spec.prompt a plain row's prompt is rendered from its columns (`contract.prompt`, once per row,
the template compiled once per lane): a row the template fails on (a missing column, a sandbox refusal)
is a ``template_error`` row naming why.

A row's ``_bij`` field is bij's own bookkeeping of judge rounds, read only from a later
round's input (which bij wrote); a user's row with one is an ``invalid_row`` row.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from itertools import repeat
from typing import TYPE_CHECKING, Any, cast

import orjson

from bij.contract.codes import OPENAI_ENDPOINTS
from bij.contract.columns import carried as carried_columns
from bij.contract.columns import clash_message, consumed, result_fields
from bij.contract.engines import POOLING_TASKS
from bij.contract.prompt import TEMPLATE_ERROR, PromptError, compiled_template, render
from bij.contract.sampling import (
    ADAPTERS,
    DEFAULT_MAX_TOKENS,
    DEFAULT_ROW_BUDGET,
    DEFAULT_SEED,
    DEFAULT_TEMPERATURE,
    IMAGES,
    NO_SAMPLING,
    TOKEN_IDS,
    BadField,
    Sampling,
    UnknownField,
    basics,
    from_column,
    from_openai,
    json_schema_text,
    over_budget,
    refusal,
)
from bij.engines import tools
from bij.engines.base import Image, Request, ToolAsk
from bij.storage.exact_json import beyond_int64, may_hold_big_int
from bij.worker import responses
from bij.worker.images import ImageProblem, parse_image

if TYPE_CHECKING:  # annotations only: a publish pass never loads the spec model
    from jinja2 import Template

    from bij.contract.spec import JobSpec

# Reserved field of re-dispatched rows (judge rounds): {"id", "attempts", "verdicts", "output"}.
CARRY_FIELD = "_bij"

# The body fields each pooling endpoint takes (vLLM's ClassificationRequest, ScoreRequest, RerankRequest):
# the texts, and what may come beside them without changing the answer.
_POOLING_BODY = {
    "classify": frozenset({"input"}),
    "score": frozenset({"text_1", "text_2"}),
    "rerank": frozenset({"query", "documents", "top_n"}),
}
_POOLING_COMMON = frozenset({"model", "user"})


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


def carry(obj: dict[str, Any], opts: InputOptions) -> dict[str, Any] | str:
    """A row's pass-through columns (contract.columns), or the name of one that clashes with a result field."""
    if opts.pass_through == ():
        return {}
    out = carried_columns(obj, opts.consumed, opts.pass_through)
    if opts.pass_through is None:
        clash = next((k for k in out if k in opts.result_fields), None)
        if clash is not None:
            return clash
    return out


def _valid_id(value: Any) -> bool:
    return (isinstance(value, str) and value != "") or (isinstance(value, int) and not isinstance(value, bool))


def _bad(at: tuple[int, int, int], code: str, msg: str, rid: Any = None) -> Row:
    return Row(at=at, id=rid, error_code=code, error=msg)


def _messages_ok(msgs: Any) -> str | None:
    if not isinstance(msgs, list) or not msgs:
        return "must be a non-empty list of {role, content} messages"
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return f"message {i} must be an object with a string role"
        c = m.get("content")
        calls = m.get("tool_calls")
        if calls is not None and (m["role"] != "assistant" or not isinstance(calls, list)
                                  or not all(isinstance(t, dict) and isinstance(t.get("function"), dict)
                                             for t in calls)):
            return f"message {i} tool_calls must be an assistant's list of {{id, type, function}} calls"
        if c is None and calls:  # an assistant turn that only called tools
            continue
        if not (isinstance(c, str) or isinstance(c, list)):
            return f"message {i} content must be a string or a list of parts"
    return None


def parse_line(line: bytes, at: tuple[int, int, int], object_name: str, opts: InputOptions) -> Row:
    """Parse one input line into a Row (never raises for bad input)."""
    try:
        obj = orjson.loads(line)
    except ValueError:
        try:  # the stdlib's message says where the JSON breaks
            obj = json.loads(line)
        except ValueError as e:
            return _bad(at, "invalid_json", f"not valid JSON: {e}")
        # The stdlib also accepts what orjson refuses for good reason: a lone surrogate escape
        # ("\ud800") is no Unicode text, and no result or error row could be written with it.
        problem = _not_unicode(obj)
        if problem:
            rid = obj.get("custom_id" if opts.format == "openai" else opts.id_field) if isinstance(obj, dict) else None
            return _bad(at, "invalid_unicode", f"not valid Unicode: {problem}",
                        rid if _valid_id(rid) and not _not_unicode(rid) else None)
    else:
        if may_hold_big_int(line):
            # orjson reads integers beyond 64 bits as floats: ids and carried columns come back exactly as given.
            obj = json.loads(line)
    if not isinstance(obj, dict):
        return _bad(at, "invalid_row", f"a row must be a JSON object, got {type(obj).__name__}")
    own = obj.pop(CARRY_FIELD, _ABSENT)
    if opts.format == "openai":
        row = _parse_openai(obj, at, opts)
    else:
        columns = carry(obj, opts)
        if isinstance(columns, str):  # never written over a result field, nor dropped unsaid
            rid = obj.get(opts.id_field)
            return _bad(at, "invalid_row", clash_message(columns, "in this row"), rid if _valid_id(rid) else None)
        row = _parse_plain(obj, at, object_name, opts)
        row.carried = columns or None
    if own is not _ABSENT:
        # What bij records about a row comes from bij's own lines only (a later judge round's input),
        # never from a column of the user's.
        problem = _history(row, own) if opts.redispatched else _RESERVED
        if problem is not None:
            return _invalid_row(row, problem)
    big = _beyond_int64(row.carried, opts) if row.request is not None else None
    if big is not None:
        return _invalid_row(row, big)
    req = row.request
    if req is not None and opts.task in ("generate", "chat"):
        # A row's cost is bounded before it runs (model.rowBudget), whatever it asks.
        costly = over_budget(req.max_tokens, req.sampling, opts.row_budget, _SPELLED,
                             len(row.parts) if row.parts else 1)
        if costly:
            bad = _bad(at, "invalid_request", costly, row.id)
            bad.carried = row.carried
            return bad
        if (req.sampling.min_tokens or 0) > req.max_tokens:
            bad = _bad(at, "invalid_request", f"minTokens {req.sampling.min_tokens} is over maxTokens "
                       f"{req.max_tokens}", row.id)
            bad.carried = row.carried
            return bad
    return row


_ABSENT = object()
_RESERVED = (f"field {CARRY_FIELD!r} is reserved for bij's own bookkeeping of judge rounds and cannot be an input "
             "column; rename it")


def _invalid_row(row: Row, message: str) -> Row:
    """`row` as an `invalid_row` error row: its id, and its carried columns, kept."""
    bad = _bad(row.at, "invalid_row", message, row.id)
    bad.carried = row.carried
    return bad


def _history(row: Row, own: Any) -> str | None:
    """Take a judge round's bookkeeping (the `_bij` field bij wrote, see redispatch_line) into `row`: its id
    (even a generated one) and its attempts and verdicts so far; what is wrong with it, if anything."""
    if not isinstance(own, dict):
        return f"field {CARRY_FIELD!r} must be an object, got {type(own).__name__}"
    attempts, verdicts = own.get("attempts", 0), own.get("verdicts", [])
    if not isinstance(attempts, int) or isinstance(attempts, bool) or attempts < 0:
        return f"field {CARRY_FIELD!r}.attempts must be a non-negative integer, got {json.dumps(attempts)[:80]}"
    if not isinstance(verdicts, list):
        return f"field {CARRY_FIELD!r}.verdicts must be a list, got {type(verdicts).__name__}"
    if "id" in own:
        if not _valid_id(own["id"]):
            got = json.dumps(own["id"])[:80]
            return f"field {CARRY_FIELD!r}.id must be a non-empty string or an integer, got {got}"
        if row.generated_id:
            row.id, row.generated_id = own["id"], False
    row.prior_attempts, row.verdicts = attempts, [str(v) for v in verdicts]
    return None


def _beyond_int64(columns: dict[str, Any] | None, opts: InputOptions) -> str | None:
    """Why a row's carried columns cannot go into a Parquet result (an integer beyond 64 bits), else None."""
    if not opts.int64_columns or not columns:
        return None
    for name, value in columns.items():
        where = beyond_int64(value, name)
        if where is not None:
            return (f"column {name!r} holds an integer beyond 64 bits (at {where}), which a Parquet result "
                    "(output.format: parquet) cannot hold; make it a string, or use output.format jsonl")
    return None


def parse_plain_lines(lines: list[bytes], opts: InputOptions
                      ) -> tuple[list[Any], list[Request], list[dict[str, Any]] | None] | None:
    """The ids, requests and pass-through columns (None: no row carries any) of a chunk's lines in one
    pass, when every line is a plain good row; else None.

    A plain good row is what parse_line makes a request of without a second look: a JSON
    object with a string or integer id and a non-blank string text (no messages to check,
    no judge-round carry field). The checks run over the whole chunk at once, in C; any
    line that is not such a row sends the whole chunk to parse_line, line by line, which
    says what is wrong and where (a column that clashes with a result field too).
    """
    if opts.format != "jsonl" or not lines or opts.prompt is not None or opts.task in ("score", "rerank") or (
            opts.task in ("generate", "chat")
            and over_budget(opts.max_tokens, opts.sampling, opts.row_budget, _SPELLED)):
        return None
    try:
        objs = list(map(orjson.loads, lines))
    except ValueError:
        return None
    if set(map(type, objs)) != {dict}:
        return None
    ids = list(map(dict.get, objs, repeat(opts.id_field)))
    kinds = set(map(type, ids))
    # Not None (a generated id), a float (orjson's reading of an integer beyond 64 bits), a bool.
    if not kinds <= {str, int} or (str in kinds and "" in ids):
        return None
    texts = cast("list[str]", list(map(dict.get, objs, repeat(opts.text_field))))  # checked on the next line
    if set(map(type, texts)) != {str} or not all(texts) or any(map(str.isspace, texts)):
        return None
    if any(map(dict.__contains__, objs, repeat(CARRY_FIELD))) or \
            any(map(dict.__contains__, objs, repeat(opts.sampling_field))) or \
            any(map(dict.__contains__, objs, repeat(opts.adapter_field))):
        return None
    if opts.task == "chat":
        if opts.messages_field and any(map(dict.__contains__, objs, repeat(opts.messages_field))):
            return None
        requests = [Request(None, [{"role": "user", "content": text}], opts.max_tokens, opts.temperature, opts.seed,
                            opts.sampling) for text in texts]
    else:
        requests = list(map(Request, texts, repeat(None), repeat(opts.max_tokens), repeat(opts.temperature),
                            repeat(opts.seed), repeat(opts.sampling)))
    columns: list[dict[str, Any]] | None = None
    # Every row has its id and text (checked above): a row with no more fields has nothing to carry.
    if opts.pass_through != () and max(map(len, objs)) > len({opts.id_field, opts.text_field}):
        # Only a carried column can still hold an integer beyond 64 bits, which orjson reads as a float:
        # those lines again, exactly (exact_json; the scan only where columns are carried, the common rows
        # pay nothing).
        if may_hold_big_int(b"\n".join(lines)):
            if opts.int64_columns:
                return None  # line by line: a carried one a Parquet result cannot hold is an error row naming it
            objs = [json.loads(line) if may_hold_big_int(line) else obj
                    for line, obj in zip(lines, objs, strict=True)]
        keys: set[str] = set().union(*map(dict.keys, objs))
        kept = keys - opts.consumed if opts.pass_through is None else keys & set(opts.pass_through)
        if kept & opts.result_fields and opts.pass_through is None:
            return None  # line by line: each such row is an error row naming the column
        if kept:
            consumed, only = opts.consumed, opts.pass_through
            columns = [carried_columns(obj, consumed, only) for obj in objs]
    return ids, requests, columns


# How a row's budget refusal names its fields (the spec's camelCase names, as a sampling field spells them).
_SPELLED = {"n": "n", "maxTokens": "maxTokens", "topLogprobs": "topLogprobs", "prompts": "prompts"}


def _not_unicode(value: Any) -> str | None:
    """Where a parsed value holds a string that cannot be UTF-8 (a lone surrogate), else None."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        return f"a lone surrogate escape (\\u{ord(e.object[e.start]):04x})"


def redispatch_line(line: bytes, row: Row, attempts: int, verdicts: list[str], output: str | None) -> str:
    """The input line for the next judge round: the original row plus its id and history."""
    obj = json.loads(line)
    obj[CARRY_FIELD] = {"id": row.id, "attempts": attempts, "verdicts": verdicts[-20:], "output": output}
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _parse_plain(obj: dict[str, Any], at: tuple[int, int, int], object_name: str, opts: InputOptions) -> Row:
    generated = opts.id_field not in obj or obj[opts.id_field] is None
    if generated:
        rid: Any = f"{object_name}:{at[1]}"
    else:
        rid = obj[opts.id_field]
        if not _valid_id(rid):
            return _bad(at, "invalid_id", f"field {opts.id_field!r} must be a non-empty string or an integer, "
                        f"got {json.dumps(rid)[:80]}")
    column = opts.sampling_field
    try:
        own = from_column(obj.get(column), column)
    except (UnknownField, BadField) as e:
        return _bad(at, "invalid_request", str(e), rid)
    spelled = {name: f"{column}.{name}" for name in own.asked()}
    adapter = obj.get(opts.adapter_field)
    if adapter is not None:
        problem = _unknown_adapter(adapter, opts, f"field {opts.adapter_field!r}")
        if problem:
            return _bad(at, "invalid_request", problem, rid)
        spelled[ADAPTERS] = f"field {opts.adapter_field!r} (a LoRA adapter)"
    asks = own.asked() | ({ADAPTERS} if adapter is not None else set())
    if opts.task == "chat" and opts.messages_field and opts.messages_field in obj:
        msgs = obj[opts.messages_field]
        problem = _messages_ok(msgs)
        if problem:
            return _bad(at, "invalid_messages", f"field {opts.messages_field!r} {problem}", rid)
        parts = _content_asks(msgs, opts.messages_field)
        if isinstance(parts, str):
            return _bad(at, "unsupported", f"engine {opts.engine} cannot honour {parts}", rid)
        refused = _refused(opts, asks | ({IMAGES} if parts else set()), {**spelled, IMAGES: _IMAGE_PART})
        if refused:
            return _bad(at, "unsupported", refused, rid)
        try:
            images = _images(parts, opts)
        except ImageProblem as e:
            return _bad(at, e.code, str(e), rid)
        return Row(at=at, id=rid, request=_request(opts, own, messages=msgs, adapter=adapter, images=images),
                   generated_id=generated)
    text_field = opts.query_field if opts.task == "rerank" else opts.text_field
    if opts.prompt is not None:
        try:
            text = render(opts.prompt, obj)
        except PromptError as e:
            return _bad(at, TEMPLATE_ERROR, str(e), rid)
        if not text or text.isspace():
            return _bad(at, "empty_text", "spec.prompt.template rendered an empty prompt for this row", rid)
    elif text_field not in obj:
        wanted = f"{text_field!r}" + (f" or {opts.messages_field!r}" if opts.messages_field else "")
        return _bad(at, "missing_text", f"no field {wanted}", rid)
    else:
        text = obj[text_field]
        if not isinstance(text, str):
            return _bad(at, "invalid_text", f"field {text_field!r} must be a string, got {type(text).__name__}",
                        rid)
        if not text or text.isspace():
            return _bad(at, "empty_text", f"field {text_field!r} is empty", rid)
    refused = _refused(opts, frozenset(asks), spelled)
    if refused:
        return _bad(at, "unsupported", refused, rid)
    if opts.task in ("score", "rerank"):
        req = _request(opts, own, text=text, adapter=adapter)
        bad_field = _pooling_texts(req, obj, opts.task, opts.pair_field, opts.documents_field, "field ")
        if bad_field is not None:
            return _bad(at, bad_field[0], bad_field[1], rid)
        return Row(at=at, id=rid, request=req, generated_id=generated)
    if opts.task == "chat":
        system = [{"role": "system", "content": opts.system}] if opts.system is not None else []
        req = _request(opts, own, messages=[*system, {"role": "user", "content": text}], adapter=adapter)
    else:
        req = _request(opts, own, text=text, adapter=adapter)
    return Row(at=at, id=rid, request=req, generated_id=generated)


def _request(opts: InputOptions, own: Sampling, *, text: str | None = None,
             messages: list[dict[str, Any]] | None = None, adapter: str | None = None,
             images: tuple[Image, ...] = (), token_ids: list[int] | None = None) -> Request:
    """A row's request: its own sampling fields over the spec's, its adapter and its images."""
    if own is NO_SAMPLING:
        return Request(text, messages, opts.max_tokens, opts.temperature, opts.seed, opts.sampling, adapter, images,
                       token_ids)
    s = own.over(opts.sampling)
    return Request(text, messages,
                   opts.max_tokens if own.max_tokens is None else own.max_tokens,
                   opts.temperature if own.temperature is None else own.temperature,
                   opts.seed if own.seed is None else own.seed, s, adapter, images, token_ids)


def _pooling_texts(req: Request, obj: dict[str, Any], task: str, pair: str, documents: str,
                   where: str) -> tuple[str, str] | None:
    """Put score's pair or rerank's documents from `obj` into `req`; else the error code and message, naming
    the field (`where` says how: "field " for a row's column, "body." for an OpenAI body)."""
    name = pair if task == "score" else documents
    if name not in obj:
        return "missing_text", f"no {where}{name!r}" if where == "field " else f"{where}{name} is required"
    value = obj[name]
    label = f"{where}{name!r}" if where == "field " else f"{where}{name}"
    if task == "score":
        if not isinstance(value, str):
            return "invalid_text", f"{label} must be a string, got {type(value).__name__}"
        if not value or value.isspace():
            return "empty_text", f"{label} is empty"
        req.pair = value
        return None
    if not isinstance(value, list) or not value:
        got = "an empty list" if isinstance(value, list) else type(value).__name__
        return "invalid_text", f"{label} must be a non-empty list of strings, got {got}"
    for i, doc in enumerate(value):
        if not isinstance(doc, str):
            return "invalid_text", f"{label}[{i}] must be a string, got {type(doc).__name__}"
    req.documents = value
    return None


# Prompts one row may hold (OpenAI's limit on an embeddings `input` list).
MAX_PROMPTS = 2048


def _prompts(value: Any, where: str) -> list[str | list[int]] | str:
    """An OpenAI `prompt` or `input`: a string, a list of strings, a list of token ids, or a list of such
    lists; the prompts in order, or what is wrong with it."""
    shape = f"{where} must be a non-empty string, a list of them, a list of token ids, or a list of such lists"
    if isinstance(value, str):
        return [value] if value.strip() else f"{where} must be a non-empty string"
    if not isinstance(value, list) or not value:
        return shape
    if _token_ids(value):
        return [value]
    if len(value) > MAX_PROMPTS:
        return f"{where} holds {len(value)} prompts, more than {MAX_PROMPTS}"
    for i, p in enumerate(value):
        if isinstance(p, str):
            if not p.strip():
                return f"{where}[{i}] must be a non-empty string"
        elif not (isinstance(p, list) and p and _token_ids(p)):
            return f"{where}[{i}] must be a non-empty string or a non-empty list of token ids (integers from 0)"
    return value


def _token_ids(value: list[Any]) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT64_MAX for t in value)


INT64_MAX = 2**63 - 1


def _unknown_adapter(name: Any, opts: InputOptions, where: str) -> str | None:
    """Why `name` names no adapter of the job, or None when it does."""
    if isinstance(name, str) and name in opts.adapters:
        return None
    known = ", ".join(sorted(opts.adapters)) if opts.adapters else "none: the job has no model.adapters"
    return f"{where}: unknown adapter {json.dumps(name)[:80]} (model.adapters: {known})"


def _refused(opts: InputOptions, asked: frozenset[str], spelled: dict[str, str]) -> str | None:
    """The `unsupported` message when the engine cannot honour what the row asks."""
    if opts.honours is None or not asked:
        return None
    return refusal(opts.engine, asked, opts.honours, spelled)


_IMAGE_PART = "an image_url content part"


def _content_asks(msgs: list[dict[str, Any]], where: str) -> list[tuple[str, dict[str, Any]]] | str:
    """The image_url parts of chat messages (each with where it is), or the name of a part no
    engine here can take (audio, files). Text parts ask nothing."""
    images: list[tuple[str, dict[str, Any]]] = []
    for i, m in enumerate(msgs):
        content = m.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                continue
            if kind == "image_url":
                images.append((f"{where}[{i}].content[{j}]", part))
            else:
                return f"{where}[{i}].content[{j}] of type {kind!r} (only text and image_url parts are known)"
    return images


def _images(parts: list[tuple[str, dict[str, Any]]], opts: InputOptions) -> tuple[Image, ...]:
    """The images of a row's image_url parts, in order (data URLs decoded); raises ImageProblem."""
    return tuple(parse_image(part, where, opts.max_image_bytes) for where, part in parts)


@dataclass(frozen=True, slots=True)
class _ChatAsk:
    """What a chat body's tool and reasoning fields ask (tools.py), as the row's request takes it."""

    tools: ToolAsk | None
    reasoning_effort: str | None
    asked: frozenset[str]
    spelled: dict[str, str]


def _chat_tools(body: dict[str, Any], own: Sampling) -> _ChatAsk:
    """A chat body's `tools`, `tool_choice`, `parallel_tool_calls` and `reasoning_effort`; raises BadField."""
    ask = tools.tool_ask(body)
    effort = tools.reasoning_effort(body)
    asked: set[str] = set()
    spelled: dict[str, str] = {}
    if ask is not None and not tools.forced(ask):  # a forced call needs no parser (FORCED_TOOL_CHOICE below)
        asked.add(tools.TOOLS)
        spelled[tools.TOOLS] = "body.tools (a tool call parser: model.vllm.toolCallParser)"
    if effort is not None:
        asked.add(tools.REASONING_EFFORT)
        spelled[tools.REASONING_EFFORT] = "body.reasoning_effort"
    if ask is not None and tools.forced(ask):
        if own.structured_output is not None:
            raise BadField("body.response_format cannot be kept with a forced tool call "
                           f"(body.tool_choice {ask.choice!r}): the call's arguments are the answer's JSON")
        asked.add(tools.FORCED_TOOL_CHOICE)
        spelled[tools.FORCED_TOOL_CHOICE] = f"body.tool_choice {ask.choice!r} (a forced tool call)"
        for i, t in enumerate(ask.tools):  # checked as the calls' arguments will be
            if t["function"].get("parameters"):
                json_schema_text(f"body.tools[{i}].function.parameters", t["function"]["parameters"])
    return _ChatAsk(ask, effort, frozenset(asked), spelled)


def _parse_openai(obj: dict[str, Any], at: tuple[int, int, int], opts: InputOptions) -> Row:
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return _bad(at, "invalid_id", "custom_id must be a non-empty string", cid if _valid_id(cid) else None)
    url = obj.get("url")
    if obj.get("method", "POST") != "POST":
        return _bad(at, "invalid_request", f"method must be POST, got {obj.get('method')!r}", cid)
    if url not in OPENAI_ENDPOINTS:
        return _bad(at, "invalid_request", f"url must be one of {', '.join(OPENAI_ENDPOINTS)}, got {url!r}", cid)
    kind = OPENAI_ENDPOINTS[url]
    if kind != opts.task:
        return _bad(at, "invalid_request", f"url {url} needs model.task {kind}, the job runs {opts.task}", cid)
    body = obj.get("body")
    if not isinstance(body, dict):
        return _bad(at, "invalid_request", "body must be an object", cid)
    if kind in POOLING_TASKS:
        return _parse_pooling(body, kind, url, at, cid, opts)
    if url == "/v1/responses":
        try:
            body = responses.chat_body(body)
        except (UnknownField, BadField) as e:
            return _bad(at, "invalid_request", str(e), cid)
    try:
        ask = from_openai(body, kind)
    except (UnknownField, BadField) as e:
        return _bad(at, "invalid_request", str(e), cid)
    own = ask.sampling
    asked = own.asked()
    spelled = dict(ask.spelled)
    adapter = None
    image_parts: list[tuple[str, dict[str, Any]]] = []
    model = body.get("model")
    if opts.adapters and model is not None and model != opts.model_name:
        # With adapters, body.model picks one (or the base model by its name).
        if model not in opts.adapters:
            return _bad(at, "invalid_request", f"body.model: unknown model {json.dumps(model)[:80]} "
                        f"(this job serves {opts.model_name} and adapters {', '.join(sorted(opts.adapters))})", cid)
        adapter = model
        asked |= {ADAPTERS}
        spelled[ADAPTERS] = "body.model (a LoRA adapter)"
    if kind == "chat":
        msgs = body.get("messages")
        problem = _messages_ok(msgs)
        if problem:
            return _bad(at, "invalid_request", f"body.messages {problem}", cid)
        assert isinstance(msgs, list)
        parts = _content_asks(msgs, "body.messages")
        if isinstance(parts, str):
            return _bad(at, "unsupported", f"engine {opts.engine or 'here'} cannot honour {parts}", cid)
        image_parts = parts
        if parts:
            asked |= {IMAGES}
            spelled[IMAGES] = _IMAGE_PART
        try:
            chat_ask = _chat_tools(body, own)
        except BadField as e:
            return _bad(at, "invalid_request", str(e), cid)
        asked |= chat_ask.asked
        spelled.update(chat_ask.spelled)
    else:
        field = "input" if kind == "embed" else "prompt"
        prompts = _prompts(body.get(field), f"body.{field}")
        if isinstance(prompts, str):
            return _bad(at, "invalid_request", prompts, cid)
        if any(isinstance(p, list) for p in prompts):
            asked |= {TOKEN_IDS}
            spelled[TOKEN_IDS] = f"body.{field} as token ids"
    if ask.unhonoured:
        # Known OpenAI fields that no engine here honours: refused whatever the engine.
        return _bad(at, "unsupported", f"engine {opts.engine or 'here'} cannot honour {', '.join(ask.unhonoured)}",
                    cid)
    refused = _refused(opts, asked, spelled)
    if refused:
        return _bad(at, "unsupported", refused, cid)
    if kind == "chat":
        try:
            images = _images(image_parts, opts)
        except ImageProblem as e:
            return _bad(at, e.code, str(e), cid)
        req = _request(opts, own, messages=msgs, adapter=adapter, images=images)
        req.tools, req.reasoning_effort = chat_ask.tools, chat_ask.reasoning_effort
        return Row(at=at, id=cid, request=req, url=url)
    requests = [_request(opts, own, text=p, adapter=adapter) if isinstance(p, str) else
                _request(opts, own, token_ids=p, adapter=adapter) for p in prompts]
    return Row(at=at, id=cid, request=requests[0], url=url, parts=requests if len(requests) > 1 else None,
               encoding=ask.encoding)



def _parse_pooling(body: dict[str, Any], kind: str, url: str, at: tuple[int, int, int], cid: str,
                   opts: InputOptions) -> Row:
    """An OpenAI-format line for vLLM's /classify, /v1/score or /v1/rerank: one text (classify's `input`),
    one pair (score's `text_1`, `text_2`) or one query and its documents (rerank's, and `top_n`)."""
    unknown = sorted(set(body) - _POOLING_BODY[kind] - _POOLING_COMMON)
    if unknown:
        return _bad(at, "invalid_request", f"body.{unknown[0]} is not a field of {url} here (it takes "
                    f"{', '.join(sorted(_POOLING_BODY[kind] | _POOLING_COMMON))})", cid)
    first = {"classify": "input", "score": "text_1", "rerank": "query"}[kind]
    text = body.get(first)
    if not isinstance(text, str):
        got = "missing" if text is None else f"a {type(text).__name__}"
        return _bad(at, "invalid_request", f"body.{first} must be a string (one text per line), got {got}", cid)
    if not text or text.isspace():
        return _bad(at, "empty_text", f"body.{first} is empty", cid)
    top_n = body.get("top_n", 0)
    if not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0:
        return _bad(at, "invalid_request", f"body.top_n must be a non-negative integer, got {json.dumps(top_n)}", cid)
    req = _request(opts, NO_SAMPLING, text=text)
    if kind != "classify":
        problem = _pooling_texts(req, body, kind, "text_2", "documents", "body.")
        if problem is not None:
            return _bad(at, "invalid_request" if problem[0] == "missing_text" else problem[0], problem[1], cid)
    return Row(at=at, id=cid, request=req, url=url, top_n=top_n)
