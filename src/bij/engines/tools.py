"""Tool calling and reasoning fields of an OpenAI chat body: `tools`, `tool_choice`,
`parallel_tool_calls`, `reasoning_effort`.

Read and checked here, once per row, as vLLM's OpenAI server checks them. A row that forces a
tool call (`tool_choice` "required" or a named function) is constrained while decoding as vLLM's
server constrains it (its tool parser's `adjust_request`: the JSON schema of the calls, or a
structural tag in the model's own call format), and its calls are checked after decoding
(`call_problem`): a row whose calls break what it asked for is a `schema_violation` error row.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from bij.contract.sampling import BadField
from bij.engines.base import ToolAsk

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
