"""`/v1/responses` batch lines (OpenAI's Responses API, which its Batch API accepts): read as the
chat request they ask for, answered with a Responses object.

A Responses body maps onto a chat body field by field, as vLLM's server maps it: `input` (a string,
or a list of messages whose content is a string or `input_text` / `output_text` / `input_image`
parts) and `instructions` (a system message first) make the messages; `max_output_tokens` is
the token cap; `text.format` is the structured output (text, json_object, json_schema with the
schema flat in it); `reasoning.effort` is `reasoning_effort`; function tools are flat
(``{"type": "function", "name", "parameters"}``) and so is a named `tool_choice`. Other
Responses fields bij cannot honour (`previous_response_id`, `background`, built-in tools, a
reasoning summary, reasoning items in the input) make the row an error, never an answer without
them. Earlier calls in the input (`function_call`, `function_call_output` items) are the chat
history's assistant `tool_calls` and `tool` messages.
"""

from __future__ import annotations

import json
import time
from typing import Any

from bij.contract.sampling import BadField, UnknownField
from bij.engines.base import Choice, Request

# Fields passed to the chat body as they are (same name, same meaning).
_SAME = ("model", "user", "temperature", "top_p", "parallel_tool_calls", "metadata", "service_tier")
# Fields with no effect on the answer: `store` keeps a response for later retrieval (every answer
# is kept in the batch's output anyway); `stream` false is the batch's only way.
_NO_EFFECT = {"store": None, "stream": False}
_KNOWN = sorted({*_SAME, *_NO_EFFECT, "input", "instructions", "max_output_tokens", "text", "reasoning", "tools",
                 "tool_choice"})
_ROLES = ("user", "system", "developer", "assistant")


def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The chat completions body a Responses body asks for; raises BadField or UnknownField naming
    the Responses field."""
    chat: dict[str, Any] = {k: body[k] for k in _SAME if k in body}
    for key in body:
        if key not in _KNOWN:
            raise UnknownField(f"body.{key}", _KNOWN)
    if "stream" in body and body["stream"] not in (None, False):
        raise BadField("body.stream must be false in a batch")
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise BadField("body.instructions must be a string")
        messages.append({"role": "system", "content": instructions})
    messages.extend(_messages(body.get("input")))
    chat["messages"] = messages
    cap = body.get("max_output_tokens")
    if cap is not None:
        if not isinstance(cap, int) or isinstance(cap, bool) or cap < 1:
            raise BadField(f"body.max_output_tokens must be a positive integer, got {json.dumps(cap)[:80]}")
        chat["max_completion_tokens"] = cap
    text = body.get("text")
    if text is not None:
        chat.update(_text_format(text))
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict) or set(reasoning) - {"effort", "summary", "generate_summary"}:
            raise BadField('body.reasoning must be {"effort": ...}')
        if reasoning.get("summary") is not None or reasoning.get("generate_summary") is not None:
            raise BadField("body.reasoning.summary: no engine here writes reasoning summaries "
                           "(the reasoning itself is answered as a reasoning item)")
        if reasoning.get("effort") is not None:
            chat["reasoning_effort"] = reasoning["effort"]
    if body.get("tools") is not None:
        chat["tools"] = [_tool(i, t) for i, t in enumerate(_list(body["tools"], "body.tools"))]
    choice = body.get("tool_choice")
    if choice is not None:
        if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
            choice = {"type": "function", "function": {"name": choice.get("name")}}
        chat["tool_choice"] = choice
    return chat


def _list(v: Any, where: str) -> list[Any]:
    if not isinstance(v, list):
        raise BadField(f"{where} must be a list")
    return v


def _messages(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(_list(value, "body.input (a string or a list of messages)")):
        where = f"body.input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else type(item).__name__
        if kind in ("function_call", "function_call_output"):
            out.extend(_call_item(where, item, out))
            continue
        if kind != "message":
            raise BadField(f"{where}: only message, function_call and function_call_output items are known "
                           f"here, got {kind!r}")
        role, content = item.get("role"), item.get("content")
        if role not in _ROLES:
            raise BadField(f"{where}.role must be one of {', '.join(_ROLES)}, got {json.dumps(role)[:40]}")
        if isinstance(content, list):
            content = [_part(f"{where}.content[{j}]", p) for j, p in enumerate(content)]
        elif not isinstance(content, str):
            raise BadField(f"{where}.content must be a string or a list of parts")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    if not out:
        raise BadField("body.input must not be empty")
    return out


def _call_item(where: str, item: dict[str, Any], before: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An earlier tool call (function_call: joins the assistant turn before it, if that only called
    tools) or its result (function_call_output: a tool message), as chat history carries them."""
    call_id = item.get("call_id")
    if not isinstance(call_id, str):
        raise BadField(f"{where}.call_id must be a string")
    if item["type"] == "function_call_output":
        output = item.get("output")
        if not isinstance(output, str):
            raise BadField(f"{where}.output must be a string")
        return [{"role": "tool", "tool_call_id": call_id, "content": output}]
    name, arguments = item.get("name"), item.get("arguments")
    if not isinstance(name, str) or not isinstance(arguments, str):
        raise BadField(f"{where} must have a string name and arguments (JSON text)")
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    last = before[-1] if before else None
    if last is not None and last["role"] == "assistant" and last.get("tool_calls") and last["content"] is None:
        last["tool_calls"].append(call)
        return []
    return [{"role": "assistant", "content": None, "tool_calls": [call]}]


def _part(where: str, part: Any) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in ("input_text", "output_text") and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    if kind == "input_image" and isinstance(part.get("image_url"), str):
        return {"type": "image_url", "image_url": {"url": part["image_url"]}}
    raise BadField(f"{where} must be an input_text, output_text or input_image (image_url) part, got {kind!r}")


def _text_format(text: Any) -> dict[str, Any]:
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"} or (
            fmt is not None and not isinstance(fmt, dict)):
        raise BadField('body.text must be {"format": {"type": ...}}')
    if text.get("verbosity") not in (None, "medium"):
        raise BadField("body.text.verbosity: no engine here honours it")
    if fmt is None or fmt.get("type") == "text":
        return {}
    if fmt.get("type") == "json_object":
        return {"response_format": {"type": "json_object"}}
    if fmt.get("type") == "json_schema":
        if "schema" not in fmt:
            raise BadField("body.text.format.schema is missing")
        return {"response_format": {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "answer"), "schema": fmt["schema"], "strict": fmt.get("strict")}}}
    raise BadField(f"body.text.format.type must be text, json_object or json_schema, got {fmt.get('type')!r}")


def _tool(i: int, tool: Any) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise BadField(f"body.tools[{i}]: only function tools are known here, got {kind!r}")
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": fn}


def response_object(digest: str, served: str, choice: Choice, usage: dict[str, Any], call_ids: str,
                    request: Request | None, cached: int | None = None) -> dict[str, Any]:
    """The Responses object of an answer: a reasoning item (when a reasoning parser found some), the
    message (when there is content), one function_call item per tool call; status incomplete when
    the answer was cut at its token cap. The request's tools and tool choice are echoed, flat, as
    the Responses API echoes them."""
    output: list[dict[str, Any]] = []
    if choice.reasoning is not None:
        output.append({"type": "reasoning", "id": f"rs_{digest}", "summary": [],
                       "content": [{"type": "reasoning_text", "text": choice.reasoning}]})
    if choice.output or not choice.tool_calls:
        output.append({"type": "message", "id": f"msg_{digest}", "role": "assistant", "status": "completed",
                       "content": [{"type": "output_text", "text": choice.output, "annotations": []}]})
    for k, call in enumerate(choice.tool_calls or []):
        output.append({"type": "function_call", "id": f"fc_{digest}_{k}", "call_id": call.get("id") or
                       f"call_{call_ids}_{k}", "name": call["function"]["name"],
                       "arguments": call["function"]["arguments"], "status": "completed"})
    cut = choice.finish_reason == "length"
    prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    reasoning_tokens = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
    ask = request.tools if request is not None else None
    tools = [{"type": "function", **t["function"]} for t in ask.tools] if ask is not None else []
    tool_choice: Any = ({"type": "function", "name": ask.choice} if ask.named else ask.choice) if ask else "auto"
    return {
        "id": f"resp_{digest}", "object": "response", "created_at": int(time.time()), "model": served,
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "error": None,
        "max_output_tokens": request.max_tokens if request is not None else None, "output": output,
        "parallel_tool_calls": ask.parallel is not False if ask is not None else True,
        "tool_choice": tool_choice, "tools": tools,
        "temperature": request.temperature if request is not None else None,
        # cached: prompt tokens the engine's prefix cache served; nothing is written to a cache OpenAI bills.
        "usage": {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached or 0,
                                                                   "cache_write_tokens": 0},
                  "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                  "total_tokens": prompt + completion},
    }
