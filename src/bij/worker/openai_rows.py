"""An OpenAI batch request line (`custom_id`, `method`, `url`, `body`) into its request: chat, completion,
embedding and pooling bodies, with their adapter (body.model), images, tools and token-id prompts."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from bij.contract.codes import OPENAI_ENDPOINTS
from bij.contract.engines import POOLING_TASKS
from bij.contract.sampling import (
    ADAPTERS,
    IMAGES,
    NO_SAMPLING,
    TOKEN_IDS,
    BadField,
    OpenAIAsk,
    Sampling,
    UnknownField,
    from_openai,
    json_schema_text,
)
from bij.engines import tools
from bij.engines.base import ToolAsk
from bij.worker import responses
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
    valid_id,
)

# The body fields each pooling endpoint takes (vLLM's ClassificationRequest, ScoreRequest, RerankRequest):
# the texts, and what may come beside them without changing the answer.
_POOLING_BODY = {
    "classify": frozenset({"input"}),
    "score": frozenset({"text_1", "text_2"}),
    "rerank": frozenset({"query", "documents", "top_n"}),
}
_POOLING_COMMON = frozenset({"model", "user"})


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


def parse_openai(obj: dict[str, Any], at: tuple[int, int, int], opts: InputOptions) -> Row:
    """An OpenAI batch request line into its request, or the error row that says what is wrong with it."""
    head = _envelope(obj, at, opts)
    if isinstance(head, Row):
        return head
    cid, url, kind, body = head
    if kind in POOLING_TASKS:
        return _parse_pooling(body, kind, url, at, cid, opts)
    if url == "/v1/responses":
        try:
            body = responses.chat_body(body)
        except (UnknownField, BadField) as e:
            return error_row(at, "invalid_request", str(e), cid)
    try:
        ask = from_openai(body, kind)
    except (UnknownField, BadField) as e:
        return error_row(at, "invalid_request", str(e), cid)
    asked = ask.sampling.asked()
    spelled = dict(ask.spelled)
    adapter = None
    model = body.get("model")
    if opts.adapters and model is not None and model != opts.model_name:
        # With adapters, body.model picks one (or the base model by its name).
        if model not in opts.adapters:
            return error_row(at, "invalid_request", f"body.model: unknown model {json.dumps(model)[:80]} "
                             f"(this job serves {opts.model_name} and adapters {', '.join(sorted(opts.adapters))})",
                             cid)
        adapter = model
        asked |= {ADAPTERS}
        spelled[ADAPTERS] = "body.model (a LoRA adapter)"
    if kind == "chat":
        return _chat_line(body, at, cid, url, _Line(ask, asked, spelled, adapter), opts)
    return _prompts_line(body, at, cid, url, kind, _Line(ask, asked, spelled, adapter), opts)


def _envelope(obj: dict[str, Any], at: tuple[int, int, int], opts: InputOptions
              ) -> tuple[str, str, str, dict[str, Any]] | Row:
    """A line's custom_id, url, the task its url runs and its body; or the error row for a bad one."""
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return error_row(at, "invalid_id", "custom_id must be a non-empty string", cid if valid_id(cid) else None)
    url = obj.get("url")
    if obj.get("method", "POST") != "POST":
        return error_row(at, "invalid_request", f"method must be POST, got {obj.get('method')!r}", cid)
    if url not in OPENAI_ENDPOINTS:
        return error_row(at, "invalid_request", f"url must be one of {', '.join(OPENAI_ENDPOINTS)}, got {url!r}",
                         cid)
    kind = OPENAI_ENDPOINTS[url]
    if kind != opts.task:
        return error_row(at, "invalid_request", f"url {url} needs model.task {kind}, the job runs {opts.task}", cid)
    body = obj.get("body")
    if not isinstance(body, dict):
        return error_row(at, "invalid_request", "body must be an object", cid)
    return cid, url, kind, body


@dataclass(frozen=True, slots=True)
class _Line:
    """What a line's body asks beside its content: its sampling (and the fields no engine honours), the
    fields an engine must honour for it, how each is named in a refusal, and its adapter."""

    ask: OpenAIAsk
    asked: frozenset[str]
    spelled: dict[str, str]
    adapter: str | None


def _refused(line: _Line, asked: frozenset[str], spelled: dict[str, str], at: tuple[int, int, int], cid: str,
             opts: InputOptions) -> Row | None:
    """The `unsupported` error row when the line asks what no engine here (or not this one) honours."""
    if line.ask.unhonoured:
        # Known OpenAI fields that no engine here honours: refused whatever the engine.
        return error_row(at, "unsupported",
                         f"engine {opts.engine or 'here'} cannot honour {', '.join(line.ask.unhonoured)}", cid)
    refused = engine_refusal(opts, asked, spelled)
    if refused:
        return error_row(at, "unsupported", refused, cid)
    return None


def _chat_line(body: dict[str, Any], at: tuple[int, int, int], cid: str, url: str, line: _Line,
               opts: InputOptions) -> Row:
    """A chat body: its messages and their images, its tools and reasoning fields."""
    asked, spelled = line.asked, dict(line.spelled)
    msgs = body.get("messages")
    problem = messages_problem(msgs)
    if problem:
        return error_row(at, "invalid_request", f"body.messages {problem}", cid)
    assert isinstance(msgs, list)
    parts = content_asks(msgs, "body.messages")
    if isinstance(parts, str):
        return error_row(at, "unsupported", f"engine {opts.engine or 'here'} cannot honour {parts}", cid)
    if parts:
        asked |= {IMAGES}
        spelled[IMAGES] = IMAGE_PART
    try:
        chat_ask = _chat_tools(body, line.ask.sampling)
    except BadField as e:
        return error_row(at, "invalid_request", str(e), cid)
    asked |= chat_ask.asked
    spelled.update(chat_ask.spelled)
    refused = _refused(line, asked, spelled, at, cid, opts)
    if refused is not None:
        return refused
    try:
        images = read_images(parts, opts)
    except ImageProblem as e:
        return error_row(at, e.code, str(e), cid)
    req = make_request(opts, line.ask.sampling, messages=msgs, adapter=line.adapter, images=images)
    req.tools, req.reasoning_effort = chat_ask.tools, chat_ask.reasoning_effort
    return Row(at=at, id=cid, request=req, url=url)


def _prompts_line(body: dict[str, Any], at: tuple[int, int, int], cid: str, url: str, kind: str, line: _Line,
                  opts: InputOptions) -> Row:
    """A completion or embedding body: its prompts (`prompt` or `input`), text or token ids, one request each."""
    asked, spelled = line.asked, dict(line.spelled)
    field = "input" if kind == "embed" else "prompt"
    prompts = _prompts(body.get(field), f"body.{field}")
    if isinstance(prompts, str):
        return error_row(at, "invalid_request", prompts, cid)
    if any(isinstance(p, list) for p in prompts):
        asked |= {TOKEN_IDS}
        spelled[TOKEN_IDS] = f"body.{field} as token ids"
    refused = _refused(line, asked, spelled, at, cid, opts)
    if refused is not None:
        return refused
    own, adapter = line.ask.sampling, line.adapter
    requests = [make_request(opts, own, text=p, adapter=adapter) if isinstance(p, str) else
                make_request(opts, own, token_ids=p, adapter=adapter) for p in prompts]
    return Row(at=at, id=cid, request=requests[0], url=url, parts=requests if len(requests) > 1 else None,
               encoding=line.ask.encoding)


def _parse_pooling(body: dict[str, Any], kind: str, url: str, at: tuple[int, int, int], cid: str,
                   opts: InputOptions) -> Row:
    """An OpenAI-format line for vLLM's /classify, /v1/score or /v1/rerank: one text (classify's `input`),
    one pair (score's `text_1`, `text_2`) or one query and its documents (rerank's, and `top_n`)."""
    unknown = sorted(set(body) - _POOLING_BODY[kind] - _POOLING_COMMON)
    if unknown:
        return error_row(at, "invalid_request", f"body.{unknown[0]} is not a field of {url} here (it takes "
                         f"{', '.join(sorted(_POOLING_BODY[kind] | _POOLING_COMMON))})", cid)
    first = {"classify": "input", "score": "text_1", "rerank": "query"}[kind]
    text = body.get(first)
    if not isinstance(text, str):
        got = "missing" if text is None else f"a {type(text).__name__}"
        return error_row(at, "invalid_request", f"body.{first} must be a string (one text per line), got {got}", cid)
    if not text or text.isspace():
        return error_row(at, "empty_text", f"body.{first} is empty", cid)
    top_n = body.get("top_n", 0)
    if not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0:
        return error_row(at, "invalid_request", f"body.top_n must be a non-negative integer, got {json.dumps(top_n)}",
                         cid)
    req = make_request(opts, NO_SAMPLING, text=text)
    if kind != "classify":
        problem = pooling_texts(req, body, kind, "text_2", "documents", "body.")
        if problem is not None:
            return error_row(at, "invalid_request" if problem[0] == "missing_text" else problem[0], problem[1], cid)
    return Row(at=at, id=cid, request=req, url=url, top_n=top_n)
