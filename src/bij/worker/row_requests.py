"""The parts of a row's request that plain rows (`plain_rows`) and OpenAI batch lines (`openai_rows`) share:
its id, chat messages and image parts checked, the request built from its own sampling fields over the spec's,
what the engine cannot honour, and the error row for what is wrong."""

from __future__ import annotations

import json
from typing import Any

from bij.contract.sampling import NO_SAMPLING, Sampling, refusal
from bij.engines.base import Image, Request
from bij.worker.images import parse_image
from bij.worker.input_row import InputOptions, Row


def valid_id(value: Any) -> bool:
    return (isinstance(value, str) and value != "") or (isinstance(value, int) and not isinstance(value, bool))


def error_row(at: tuple[int, int, int], code: str, msg: str, rid: Any = None) -> Row:
    return Row(at=at, id=rid, error_code=code, error=msg)


def messages_problem(msgs: Any) -> str | None:
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


def make_request(opts: InputOptions, own: Sampling, *, text: str | None = None,
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


def pooling_texts(req: Request, obj: dict[str, Any], task: str, pair: str, documents: str,
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


def unknown_adapter(name: Any, opts: InputOptions, where: str) -> str | None:
    """Why `name` names no adapter of the job, or None when it does."""
    if isinstance(name, str) and name in opts.adapters:
        return None
    known = ", ".join(sorted(opts.adapters)) if opts.adapters else "none: the job has no model.adapters"
    return f"{where}: unknown adapter {json.dumps(name)[:80]} (model.adapters: {known})"


def engine_refusal(opts: InputOptions, asked: frozenset[str], spelled: dict[str, str]) -> str | None:
    """The `unsupported` message when the engine cannot honour what the row asks."""
    if opts.honours is None or not asked:
        return None
    return refusal(opts.engine, asked, opts.honours, spelled)


IMAGE_PART = "an image_url content part"


def content_asks(msgs: list[dict[str, Any]], where: str) -> list[tuple[str, dict[str, Any]]] | str:
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


def read_images(parts: list[tuple[str, dict[str, Any]]], opts: InputOptions) -> tuple[Image, ...]:
    """The images of a row's image_url parts, in order (data URLs decoded); raises ImageProblem."""
    return tuple(parse_image(part, where, opts.max_image_bytes) for where, part in parts)
