"""Tool calling and reasoning fields of an OpenAI chat body: `tools`, `tool_choice`,
`parallel_tool_calls`, `reasoning_effort`.

Read and checked here, once per row, as vLLM's OpenAI server checks them. A row that forces a
tool call (`tool_choice` "required" or a named function) is constrained while decoding, the whole
call, arguments included, against the tools' `parameters`: with a tool call parser as its
`adjust_request` constrains it (the JSON schema of the calls, or a structural tag in the model's
own call format with every tool strict), without one by `forced_schema`, the JSON schema vLLM's
server decodes a forced call under (`get_json_schema_from_tools`), the answer read as it reads
it (`forced_calls`). Its calls are checked after decoding (`call_problem`, `checked`): a row
whose calls break what it asked for, or that its token cap cut, is a `schema_violation` error row.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from bij.contract.sampling import BadField
from bij.engines.base import Choice, Request, Result, ToolAsk
from bij.engines.structured import MAX_CARRIED, SCHEMA_VIOLATION

# OpenAI's values and the ones vLLM's server adds ("max"); vLLM gives the value to the chat template
# as `reasoning_effort`, and `enable_thinking` false for "none", true for the others.
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
# The fields read here, as the request-field names an engine honours (`Engine.honours`).
TOOLS = "tools"
FORCED_TOOL_CHOICE = "toolChoice"  # "required" or a named function: a tool parser that reads JSON calls
REASONING_EFFORT = "reasoningEffort"
FIELDS = frozenset({"tools", "tool_choice", "parallel_tool_calls", "reasoning_effort"})


def tool_ask(body: Mapping[str, Any]) -> ToolAsk | None:
    """The tools a chat body gives and the call it asks for; None without tools. Raises BadField."""
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise BadField(f"body.parallel_tool_calls must be a boolean, got {_show(parallel)}")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise BadField("body.tool_choice needs body.tools")
        return None
    if not isinstance(tools, list):
        raise BadField(f"body.tools must be a list of function tools, got {_show(tools)}")
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise BadField(f"body.tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\", ...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise BadField(f"body.tools[{i}].function.name must be a non-empty string")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise BadField(f"body.tools[{i}].function.parameters must be a JSON schema object")
        names.append(name)
    if len(set(names)) != len(names):
        raise BadField("body.tools names a function twice")
    if choice is None:
        return ToolAsk(tuple(tools), "auto", False, parallel)
    if choice in ("none", "auto", "required"):
        return ToolAsk(tuple(tools), choice, False, parallel)
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise BadField('body.tool_choice must be "none", "auto", "required" or '
                       f'{{"type": "function", "function": {{"name": ...}}}}, got {_show(choice)}')
    if name not in names:
        raise BadField(f"body.tool_choice names function {name!r}, which is not in body.tools")
    return ToolAsk(tuple(tools), name, True, parallel)


def reasoning_effort(body: Mapping[str, Any]) -> str | None:
    """The body's `reasoning_effort` (None when unset); raises BadField for a value vLLM refuses."""
    v = body.get("reasoning_effort")
    if v is not None and v not in REASONING_EFFORTS:
        raise BadField(f"body.reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {_show(v)}")
    return v


def forced(ask: ToolAsk | None) -> bool:
    """Whether the row must call a tool: `tool_choice` "required" or a named function."""
    return ask is not None and (ask.named or ask.choice == "required")


def call_problem(ask: ToolAsk, calls: list[dict[str, Any]]) -> str | None:
    """Why a forced row's tool calls are not what it asked for (a call, to the named function, at
    most one without parallel calls, arguments valid against the function's parameters); None when
    they are."""
    import jsonschema

    if not calls:
        return "no tool call could be read from the answer"
    if ask.parallel is False and len(calls) > 1:
        return f"{len(calls)} tool calls, and body.parallel_tool_calls is false"
    params = {_name(t): _parameters(t) for t in ask.tools}
    for k, call in enumerate(calls):
        name, text = call["function"]["name"], call["function"]["arguments"]
        if name not in params or (ask.named and name != ask.choice):
            return f"tool call {k} calls {name!r}, not " + (repr(ask.choice) if ask.named else "one of body.tools")
        try:
            args = json.loads(text, parse_constant=_not_json)
        except ValueError as e:
            return f"tool call {k}: arguments are not valid JSON: {e}"
        error = next(iter(jsonschema.validators.validator_for(params[name])(params[name]).iter_errors(args)), None)
        if error is not None:
            where = "/".join(map(str, error.absolute_path)) or "(the arguments)"
            return f"tool call {k}: arguments at {where}: {error.message} (keyword {error.validator})"
    return None


def forced_schema(ask: ToolAsk) -> dict[str, Any]:
    """The JSON schema a forced call is decoded under without a tool call parser, as vLLM's server
    builds it (`get_json_schema_from_tools`): a named function's parameters; for "required" an array
    of at least one {name, parameters} of any tool (at most one when parallel calls are off), the
    tools' `$defs` gathered at the top, where their `$ref`s point."""
    if ask.named:
        return next(_parameters(t) for t in ask.tools if _name(t) == ask.choice)
    calls: list[dict[str, Any]] = []
    defs: dict[str, Any] = {}
    for t in ask.tools:
        params = _parameters(t)
        defs.update(params.pop("$defs", None) or {})
        calls.append({"properties": {"name": {"type": "string", "enum": [_name(t)]}, "parameters": params},
                      "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
    if ask.parallel is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def forced_calls(ask: ToolAsk, text: str) -> list[dict[str, Any]]:
    """The calls of a forced answer decoded under `forced_schema`, read as vLLM's server reads them
    without a parser: a named function's arguments are the whole answer; "required" answers a JSON
    array of {name, parameters}. An answer that cannot be read has no calls (`call_problem` says so)."""
    if ask.named:
        return [_call(ask.choice, text)] if text.strip() else []
    try:
        value = json.loads(text, parse_constant=_not_json)
    except ValueError:
        return []
    if not isinstance(value, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str)
                                              and "parameters" in c for c in value):
        return []
    return [_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in value]


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": None, "type": "function", "function": {"name": name, "arguments": arguments}}


def forced_choice(ask: ToolAsk, c: Choice) -> Choice:
    """A forced answer decoded under `forced_schema`, as a choice with its calls and no content;
    finish_reason `tool_calls` for "required" (as vLLM's server answers), `stop` for a named function."""
    finish = "tool_calls" if not ask.named and c.finish_reason == "stop" else c.finish_reason
    return Choice(output="", completion_tokens=c.completion_tokens, finish_reason=finish, logprobs=c.logprobs,
                  reasoning=c.reasoning, tool_calls=forced_calls(ask, c.output), reasoning_tokens=c.reasoning_tokens)


def forced_result(req: Request, res: Result) -> Result:
    """A forced row's result decoded under `forced_schema`, its answers read as calls and checked."""
    if req.tools is None or res.error is not None:
        return res
    if res.choices is not None:
        res.choices = [forced_choice(req.tools, c) for c in res.choices]
        return checked(req, res, [c.output for c in res.choices])
    answer = res.output or ""
    parsed = forced_choice(req.tools, Choice(output=answer, completion_tokens=res.completion_tokens or 0,
                                             finish_reason=res.extra.get("finish_reason", "stop")))
    res.output, res.extra["finish_reason"], res.extra["parsed"] = "", parsed.finish_reason, parsed
    return checked(req, res, [answer])


def checked(req: Request, res: Result, answers: list[str] | None = None) -> Result:
    """A forced row's result, or its schema_violation error when a call breaks what it asked for (or
    its token cap cut the call short); `answers`: the text each answer carries into the error row."""
    if req.tools is None or not forced(req.tools) or res.error is not None:
        return res
    choices = res.choices or [res.extra["parsed"]]
    for k, c in enumerate(choices):
        why = call_problem(req.tools, c.tool_calls or [])
        if why is not None:
            if c.finish_reason == "length":
                why += f" (cut at its token cap: {c.completion_tokens} tokens; raise maxTokens)"
            which = f"answer {k}" if len(choices) > 1 else "the answer"
            text = answers[k] if answers is not None else c.output
            return Result(output=text[:MAX_CARRIED], prompt_tokens=res.prompt_tokens,
                          completion_tokens=res.completion_tokens,
                          error=f"{which} breaks its forced tool call (body.tool_choice {req.tools.choice!r}): {why}",
                          extra={"code": SCHEMA_VIOLATION})
    return res


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _name(tool: dict[str, Any]) -> str:
    return str(tool["function"]["name"])


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """A function's parameters schema (a copy); an object with no properties when it has none."""
    params = tool["function"].get("parameters")
    return json.loads(json.dumps(params)) if params else {"type": "object", "properties": {}}


def _show(v: Any) -> str:
    return json.dumps(v)[:80]
