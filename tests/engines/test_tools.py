"""Tool calling and reasoning fields of OpenAI chat lines: read and checked per row (tools.py, inputs.py),
answered as OpenAI's chat completion (message.tool_calls, message.reasoning_content, reasoning tokens).

The engine side (vLLM's parsers on real engine output) is in test_vllm.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from bij.contract.spec import SpecError, load_job
from bij.engines.base import BASIC_SAMPLING, Choice, EngineConfig, Request, Result, ToolAsk
from bij.engines.prompts import chat_messages, row_template_kwargs
from bij.engines.tools import call_problem, forced_calls, forced_schema
from bij.worker.input_row import InputOptions, Row
from bij.worker.inputs import parse_line
from bij.worker.result_rows import result_row

VLLM_FIELDS = BASIC_SAMPLING | {"structuredOutput"}
# A vLLM chat engine with a tool call parser that reads forced calls as JSON (hermes).
TOOLED = InputOptions(format="openai", task="chat", engine="vllm",
                      honours=VLLM_FIELDS | {"tools", "toolChoice", "reasoningEffort"})
UNTOOLED = InputOptions(format="openai", task="chat", engine="vllm", honours=VLLM_FIELDS | {"reasoningEffort"})
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}


def parse(obj: Any, opts: InputOptions) -> Row:
    line = json.dumps(obj).encode()
    return parse_line(line, (0, 0, len(line)), "in.jsonl", opts)


def chat(messages: list[dict[str, Any]] | None = None, **body: Any) -> dict[str, Any]:
    return {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": messages or [{"role": "user", "content": "weather in Oslo?"}], **body}}


def test_tools_reach_the_request_with_auto_as_the_default_choice() -> None:
    row = parse(chat(tools=[WEATHER, CLOCK], parallel_tool_calls=False), TOOLED)
    assert row.error is None and row.request is not None
    assert row.request.tools == ToolAsk((WEATHER, CLOCK), "auto", False, False)
    assert row.request.sampling.structured_output is None  # auto: the model may answer in words


def test_an_engine_without_a_tool_call_parser_refuses_tools_naming_the_knob() -> None:
    row = parse(chat(tools=[WEATHER]), UNTOOLED)
    assert row.error_code == "unsupported"
    assert row.error == "engine vllm cannot honour body.tools (a tool call parser: model.vllm.toolCallParser)"


def test_a_forced_call_needs_no_tool_call_parser() -> None:
    """vLLM's server serves required and named tool choice without a parser (the calls' JSON schema)."""
    forcing = InputOptions(format="openai", task="chat", engine="vllm", honours=VLLM_FIELDS | {"toolChoice"})
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        row = parse(chat(tools=[WEATHER], tool_choice=choice), forcing)
        assert row.error is None and row.request is not None and row.request.tools is not None
    assert parse(chat(tools=[WEATHER]), forcing).error_code == "unsupported"  # auto: the parser reads the calls


@pytest.mark.parametrize(("body", "needle"), [
    ({"tool_choice": "auto"}, "body.tool_choice needs body.tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "body.tool_choice must be"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "names function 'get_time', which is not in body.tools"),
    ({"tools": [{"type": "retrieval"}]}, "body.tools[0] must be"),
    ({"tools": [WEATHER, WEATHER]}, "names a function twice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "body.parallel_tool_calls must be a boolean"),
    ({"reasoning_effort": "extreme"}, "body.reasoning_effort must be one of none, minimal"),
    ({"tools": [WEATHER], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "body.response_format cannot be kept with a forced tool call"),
])
def test_bad_tool_fields_are_invalid_request_rows_naming_the_field(body: dict[str, Any], needle: str) -> None:
    row = parse(chat(**body), TOOLED)
    assert row.error_code == "invalid_request" and needle in str(row.error), row.error


def test_a_forced_calls_arguments_are_checked_against_the_tools_parameters() -> None:
    required = parse(chat(tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False), TOOLED)
    assert required.request is not None and required.request.tools is not None
    # Constrained by the engine (vLLM's own tool-call constraint), not by a structured output of the row's.
    assert required.request.sampling.structured_output is None
    ask = required.request.tools

    def call(name: str, arguments: str) -> dict[str, Any]:
        return {"id": None, "type": "function", "function": {"name": name, "arguments": arguments}}

    assert call_problem(ask, [call("get_weather", '{"city": "Oslo"}')]) is None
    assert call_problem(ask, [call("get_time", "{}")]) is None
    assert call_problem(ask, []) == "no tool call could be read from the answer"
    assert "2 tool calls, and body.parallel_tool_calls is false" in str(
        call_problem(ask, [call("get_time", "{}")] * 2))
    assert "arguments at (the arguments): 'city' is a required property" in str(
        call_problem(ask, [call("get_weather", "{}")]))
    assert "not valid JSON" in str(call_problem(ask, [call("get_weather", '{"city": NaN}')]))
    assert "calls 'get_date', not one of body.tools" in str(call_problem(ask, [call("get_date", "{}")]))
    named = ToolAsk((WEATHER, CLOCK), "get_weather", True)
    assert "calls 'get_time', not 'get_weather'" in str(call_problem(named, [call("get_time", "{}")]))
    bad = parse(chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
                     tool_choice="required"), TOOLED)
    assert bad.error_code == "invalid_request" and "body.tools[0].function.parameters is not a valid" in str(
        bad.error)


def test_an_engine_without_forced_calls_refuses_them_naming_the_choice() -> None:
    opts = InputOptions(format="openai", task="chat", engine="vllm", honours=VLLM_FIELDS | {"tools"})
    row = parse(chat(tools=[WEATHER], tool_choice="required"), opts)
    assert row.error_code == "unsupported" and "body.tool_choice 'required' (a forced tool call)" in str(row.error)
    assert parse(chat(tools=[WEATHER], tool_choice="none"), opts).error is None


def test_tool_role_messages_and_assistant_calls_in_the_history_reach_the_template() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    history = [{"role": "user", "content": "weather in Oslo?"},
               {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 3}'}]
    row = parse(chat(history, tools=[WEATHER]), TOOLED)
    assert row.error is None and row.request is not None
    rendered = chat_messages(row.request)
    # Chat templates read an earlier call's arguments as a dict, as vLLM's server gives them.
    assert rendered[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert rendered[2] == history[2]
    assert row_template_kwargs(row.request, {"x": 1}) == {"x": 1, "tools": [WEATHER]}
    bad = parse(chat([{"role": "user", "content": "hi", "tool_calls": [call]}], tools=[WEATHER]), TOOLED)
    assert bad.error_code == "invalid_request" and "tool_calls must be an assistant's" in str(bad.error)


def test_reasoning_effort_reaches_the_template_as_vllm_gives_it() -> None:
    row = parse(chat(reasoning_effort="none"), UNTOOLED)
    assert row.request is not None and row.request.reasoning_effort == "none"
    assert row_template_kwargs(row.request, None) == {"reasoning_effort": "none", "enable_thinking": False}
    high = Request(messages=[], reasoning_effort="high")
    assert row_template_kwargs(high, None) == {"reasoning_effort": "high", "enable_thinking": True}
    # The spec's own thinking switch wins.
    assert row_template_kwargs(high, {"enable_thinking": False})["enable_thinking"] is False
    refused = parse(chat(reasoning_effort="low"), InputOptions(format="openai", task="chat", engine="transformers",
                                                               honours=BASIC_SAMPLING))
    assert refused.error_code == "unsupported" and "body.reasoning_effort" in str(refused.error)


def _answer(row: Row, choice: Choice, prompt: int = 7) -> dict[str, Any]:
    res = Result(output=choice.output, prompt_tokens=prompt, completion_tokens=choice.completion_tokens,
                 extra={"finish_reason": choice.finish_reason, "parsed": choice})
    return result_row(row, res, TOOLED)


def test_answers_carry_tool_calls_reasoning_and_reasoning_tokens_in_the_openai_sdks_shape() -> None:
    chat_types = pytest.importorskip("openai.types.chat")
    auto = parse(chat(tools=[WEATHER]), TOOLED)
    call = {"id": None, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    line = _answer(auto, Choice(output="", completion_tokens=9, finish_reason="tool_calls", reasoning="cold north",
                                tool_calls=[call], reasoning_tokens=3))
    body = chat_types.ChatCompletion.model_validate(line["response"]["body"])
    msg = body.choices[0].message
    assert body.choices[0].finish_reason == "tool_calls" and msg.content is None
    assert msg.tool_calls is not None and msg.tool_calls[0].function.name == "get_weather"
    assert json.loads(msg.tool_calls[0].function.arguments) == {"city": "Oslo"}
    assert body.usage is not None and body.usage.completion_tokens_details is not None
    assert body.usage.completion_tokens_details.reasoning_tokens == 3
    raw = line["response"]["body"]["choices"][0]["message"]
    assert raw["reasoning_content"] == "cold north"
    # Call ids are stable across reruns: made of the row's id.
    assert raw["tool_calls"][0]["id"] == _answer(auto, Choice(
        output="", completion_tokens=9, finish_reason="tool_calls", tool_calls=[call]))["response"]["body"][
        "choices"][0]["message"]["tool_calls"][0]["id"]
    # A forced call has empty content, as vLLM's server answers it; a plain answer has no tool_calls.
    named = parse(chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}),
                  TOOLED)
    forced_msg = _answer(named, Choice(output='{"city": "Oslo"}', completion_tokens=6, finish_reason="stop",
                                       tool_calls=[call]))["response"]["body"]["choices"][0]["message"]
    assert forced_msg["content"] == "" and len(forced_msg["tool_calls"]) == 1
    plain = _answer(parse(chat(), TOOLED), Choice(output="hello", completion_tokens=1, finish_reason="stop"))
    assert plain["response"]["body"]["choices"][0]["message"] == {"role": "assistant", "content": "hello"}
    assert "completion_tokens_details" not in plain["response"]["body"]["usage"]


def test_the_spec_names_only_parsers_vllm_ships(tmp_path: Any) -> None:
    def load(**vllm: Any) -> Any:
        path = tmp_path / "job.yaml"
        path.write_text(json.dumps({
            "apiVersion": "batchinference.io/v1alpha1", "kind": "BatchInferenceJob", "metadata": {"name": "s"},
            "spec": {"input": {"uri": "file:///in/"}, "output": {"uri": "file:///out/"},
                     "model": {"engine": "vllm", "name": "/m", "task": "chat", "vllm": vllm}}}))
        return load_job(path).spec.model.vllm

    got = load(reasoningParser="deepseek_r1", toolCallParser="hermes")
    assert (got.reasoning_parser, got.tool_call_parser) == ("deepseek_r1", "hermes")
    with pytest.raises(SpecError, match="unknown tool call parser 'hermes2'"):
        load(toolCallParser="hermes2")
    with pytest.raises(SpecError, match="unknown reasoning parser 'r1'"):
        load(reasoningParser="r1")


def test_a_plain_rows_result_carries_the_reasoning_beside_the_output() -> None:
    from bij.worker.result_rows import plain_result

    parsed = Choice(output="yes", completion_tokens=7, finish_reason="stop", reasoning="ok", reasoning_tokens=2)
    row = plain_result(3, Result(output="yes", prompt_tokens=4, completion_tokens=7, extra={"parsed": parsed}))
    assert row == {"id": 3, "output": "yes", "reasoning": "ok",
                   "usage": {"prompt_tokens": 4, "completion_tokens": 7, "total_tokens": 11}}
    two = [parsed, Choice(output="no", completion_tokens=3, finish_reason="stop", reasoning="hm")]
    row = plain_result(4, Result(output="yes", prompt_tokens=4, completion_tokens=10, choices=two))
    assert [(c["output"], c["reasoning"]) for c in row["choices"]] == [("yes", "ok"), ("no", "hm")]


def test_the_forced_calls_schema_is_vllms_and_its_answers_read_back_as_calls() -> None:
    """What a forced call is decoded under without a parser: vLLM's `get_json_schema_from_tools` (the vLLM
    tier compares the two on the installed vLLM); a named call's arguments are the whole answer."""
    import jsonschema

    defs = {"Zone": {"enum": ["UTC", "CET"]}}
    clock = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"$ref": "#/$defs/Zone"}}, "required": ["zone"], "$defs": defs}}}
    required = ToolAsk((WEATHER, clock), "required", False, False)
    schema = forced_schema(required)
    assert schema["minItems"] == 1 and schema["maxItems"] == 1 and schema["$defs"] == defs
    assert [c["properties"]["name"] for c in schema["items"]["anyOf"]] == [
        {"type": "string", "enum": [n]} for n in ("get_weather", "get_time")]
    assert "$defs" in clock["function"]["parameters"]  # the row's own tools are left as they are
    answer = '[{"name": "get_time", "parameters": {"zone": "CET"}}]'
    jsonschema.validate(json.loads(answer), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {"zone": "PST"}}], schema)
    assert forced_calls(required, answer) == [
        {"id": None, "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]
    assert forced_calls(required, '[{"name": "get_ti') == []  # cut short: no call, call_problem says so
    named = ToolAsk((WEATHER, CLOCK), "get_weather", True)
    assert forced_schema(named) == WEATHER["function"]["parameters"]
    assert forced_schema(ToolAsk((WEATHER, CLOCK), "get_time", True)) == {"type": "object", "properties": {}}
    assert forced_calls(named, '{"city": "Oslo"}')[0]["function"] == {"name": "get_weather",
                                                                       "arguments": '{"city": "Oslo"}'}


# --- forced calls on a random-weight model (the transformers engine) ----------------------------

# Bounded strings and numbers: a random model fills them with anything the constraint allows.
CITY = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}, "days": {
        "type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"], "additionalProperties": False}}}
ZONE = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
BYTE_CHAT = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


@pytest.fixture(scope="module")
def random_chat(tmp_path_factory: pytest.TempPathFactory) -> Any:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from byte_model import build_byte_model

    from bij.engines.transformers import TransformersEngine

    model = build_byte_model(tmp_path_factory.mktemp("bytes"))
    engine = TransformersEngine(EngineConfig(task="chat", name=str(model), device="cpu", chat_template=BYTE_CHAT))
    engine.load()
    return engine


def _forced_rows(engine: Any, choice: Any, seeds: range, max_tokens: int = 96) -> list[tuple[Row, Result]]:
    opts = InputOptions(format="openai", task="chat", engine="transformers", honours=engine.honours,
                        max_tokens=max_tokens, temperature=1.0)
    # One call a row (parallel_tool_calls false): a random model writes a free array of calls until its cap.
    rows = [parse(chat(tools=[CITY, ZONE], tool_choice=choice, parallel_tool_calls=False, seed=s), opts)
            for s in seeds]
    assert all(r.request is not None for r in rows), rows[0].error
    return list(zip(rows, engine.run([r.request for r in rows]), strict=True))


def test_forced_calls_on_a_random_model_are_valid_calls_or_cut_rows_that_say_so(random_chat: Any) -> None:
    """A random-weight model writes anything it may: every forced answer is a call whose arguments keep
    to the tool's parameters, or an error row saying its token cap cut it."""
    import jsonschema

    params = {t["function"]["name"]: t["function"]["parameters"] for t in (CITY, ZONE)}
    named = {"type": "function", "function": {"name": "get_weather"}}
    valid = 0
    for choice in ("required", named):
        for row, res in _forced_rows(random_chat, choice, range(4)):
            if res.error is not None:
                assert res.extra["code"] == "schema_violation" and "cut at its token cap" in res.error, res.error
                continue
            valid += 1
            body = result_row(row, res, TOOLED)["response"]["body"]
            (answer,) = body["choices"]
            assert answer["message"]["content"] == ""
            assert answer["finish_reason"] == ("stop" if isinstance(choice, dict) else "tool_calls")
            for call in answer["message"]["tool_calls"]:
                name = call["function"]["name"]
                assert name == "get_weather" or choice == "required"
                jsonschema.validate(json.loads(call["function"]["arguments"]), params[name])
    assert valid >= 4


def test_a_forced_call_cut_by_its_token_cap_is_an_error_row_saying_so(random_chat: Any) -> None:
    for _, res in _forced_rows(random_chat, "required", range(2), max_tokens=8):
        assert res.extra["code"] == "schema_violation"
        assert "no tool call could be read" in str(res.error) and "cut at its token cap: 8 tokens" in str(res.error)
