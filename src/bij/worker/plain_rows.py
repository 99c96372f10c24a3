"""A plain input row (a JSONL or Parquet row of the user's columns) into its request: its id, sampling
column, adapter, and its text (its text field, or spec.prompt rendered from its columns), chat messages or
a pooling task's texts."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from bij.contract.prompt import TEMPLATE_ERROR, PromptError, render
from bij.contract.sampling import ADAPTERS, IMAGES, BadField, Sampling, UnknownField, from_column
from bij.worker.images import ImageProblem
from bij.worker.input_row import InputOptions, Row
from bij.worker.row_requests import (
    IMAGE_PART,
    content_asks,
    engine_refusal,
    error_row,
    make_request,
    messages_problem,
    pooling_texts,
    read_images,
    unknown_adapter,
    valid_id,
)


@dataclass(frozen=True, slots=True)
class _Asks:
    """What a plain row asks beside its content: its own sampling fields, its adapter, and how each is
    named in a refusal."""

    own: Sampling
    adapter: Any
    asked: Any  # the sampling fields (and ADAPTERS) the row asks for
    spelled: dict[str, str]


def parse_plain(obj: dict[str, Any], at: tuple[int, int, int], object_name: str, opts: InputOptions) -> Row:
    """A plain row into its request, or the error row that says what is wrong with it."""
    generated = opts.id_field not in obj or obj[opts.id_field] is None
    if generated:
        rid: Any = f"{object_name}:{at[1]}"
    else:
        rid = obj[opts.id_field]
        if not valid_id(rid):
            return error_row(at, "invalid_id", f"field {opts.id_field!r} must be a non-empty string or an integer, "
                             f"got {json.dumps(rid)[:80]}")
    asks = _asks(obj, at, rid, opts)
    if isinstance(asks, Row):
        return asks
    own, adapter = asks.own, asks.adapter
    if opts.task == "chat" and opts.messages_field and opts.messages_field in obj:
        return _chat_row(obj[opts.messages_field], at, rid, generated, asks, opts)
    text = _text(obj, at, rid, opts)
    if isinstance(text, Row):
        return text
    refused = engine_refusal(opts, frozenset(asks.asked), asks.spelled)
    if refused:
        return error_row(at, "unsupported", refused, rid)
    if opts.task in ("score", "rerank"):
        req = make_request(opts, own, text=text, adapter=adapter)
        bad_field = pooling_texts(req, obj, opts.task, opts.pair_field, opts.documents_field, "field ")
        if bad_field is not None:
            return error_row(at, bad_field[0], bad_field[1], rid)
        return Row(at=at, id=rid, request=req, generated_id=generated)
    if opts.task == "chat":
        system = [{"role": "system", "content": opts.system}] if opts.system is not None else []
        req = make_request(opts, own, messages=[*system, {"role": "user", "content": text}], adapter=adapter)
    else:
        req = make_request(opts, own, text=text, adapter=adapter)
    return Row(at=at, id=rid, request=req, generated_id=generated)


def _asks(obj: dict[str, Any], at: tuple[int, int, int], rid: Any, opts: InputOptions) -> _Asks | Row:
    """The row's sampling column and adapter, or the error row for a bad one."""
    column = opts.sampling_field
    try:
        own = from_column(obj.get(column), column)
    except (UnknownField, BadField) as e:
        return error_row(at, "invalid_request", str(e), rid)
    spelled = {name: f"{column}.{name}" for name in own.asked()}
    adapter = obj.get(opts.adapter_field)
    if adapter is not None:
        problem = unknown_adapter(adapter, opts, f"field {opts.adapter_field!r}")
        if problem:
            return error_row(at, "invalid_request", problem, rid)
        spelled[ADAPTERS] = f"field {opts.adapter_field!r} (a LoRA adapter)"
    return _Asks(own, adapter, own.asked() | ({ADAPTERS} if adapter is not None else set()), spelled)


def _chat_row(msgs: Any, at: tuple[int, int, int], rid: Any, generated: bool, asks: _Asks,
              opts: InputOptions) -> Row:
    """A chat row with its own messages (input.messagesField): checked, with their images."""
    problem = messages_problem(msgs)
    if problem:
        return error_row(at, "invalid_messages", f"field {opts.messages_field!r} {problem}", rid)
    parts = content_asks(msgs, str(opts.messages_field))
    if isinstance(parts, str):
        return error_row(at, "unsupported", f"engine {opts.engine} cannot honour {parts}", rid)
    refused = engine_refusal(opts, asks.asked | ({IMAGES} if parts else set()), {**asks.spelled, IMAGES: IMAGE_PART})
    if refused:
        return error_row(at, "unsupported", refused, rid)
    try:
        images = read_images(parts, opts)
    except ImageProblem as e:
        return error_row(at, e.code, str(e), rid)
    return Row(at=at, id=rid, generated_id=generated,
               request=make_request(opts, asks.own, messages=msgs, adapter=asks.adapter, images=images))


def _text(obj: dict[str, Any], at: tuple[int, int, int], rid: Any, opts: InputOptions) -> str | Row:
    """The row's prompt: spec.prompt rendered from its columns, else its text field (rerank's query);
    or the error row for a missing, wrong or empty one."""
    text_field = opts.query_field if opts.task == "rerank" else opts.text_field
    if opts.prompt is not None:
        try:
            text = render(opts.prompt, obj)
        except PromptError as e:
            return error_row(at, TEMPLATE_ERROR, str(e), rid)
        if not text or text.isspace():
            return error_row(at, "empty_text", "spec.prompt.template rendered an empty prompt for this row", rid)
        return text
    if text_field not in obj:
        wanted = f"{text_field!r}" + (f" or {opts.messages_field!r}" if opts.messages_field else "")
        return error_row(at, "missing_text", f"no field {wanted}", rid)
    text = obj[text_field]
    if not isinstance(text, str):
        return error_row(at, "invalid_text", f"field {text_field!r} must be a string, got {type(text).__name__}",
                         rid)
    if not text or text.isspace():
        return error_row(at, "empty_text", f"field {text_field!r} is empty", rid)
    return text
