"""`/v1/responses` batch lines: read as the chat request they ask for, answered with a Responses object
that the `openai` SDK's own model reads (responses.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bij.engines.base import BASIC_SAMPLING, Choice, Result
from bij.worker.input_row import InputOptions, Row
from bij.worker.inputs import parse_line
from bij.worker.result_rows import result_row

OPTS = InputOptions(format="openai", task="chat", engine="vllm", model_name="m",
                    honours=BASIC_SAMPLING | {"structuredOutput", "tools", "toolChoice", "reasoningEffort", "topP"})
WEATHER = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def parse(body: dict[str, Any], opts: InputOptions = OPTS) -> Row:
    line = json.dumps({"custom_id": "r1", "method": "POST", "url": "/v1/responses",
                       "body": {"model": "m", **body}}).encode()
    return parse_line(line, (0, 0, len(line)), "in.jsonl", opts)


def test_input_instructions_and_caps_make_the_chat_request() -> None:
    row = parse({"input": [{"role": "developer", "content": "be brief"},
                           {"role": "user", "content": [{"type": "input_text", "text": "hi "},
                                                         {"type": "input_text", "text": "there"}]}],
                 "instructions": "you are terse", "max_output_tokens": 12, "temperature": 0.5, "top_p": 0.9,
                 "store": True})
    assert row.error is None and row.request is not None, row.error
    req = row.request
    assert req.messages == [{"role": "system", "content": "you are terse"},
                            {"role": "system", "content": "be brief"},
                            {"role": "user", "content": [{"type": "text", "text": "hi "},
                                                         {"type": "text", "text": "there"}]}]
    assert (req.max_tokens, req.temperature, req.sampling.top_p) == (12, 0.5, 0.9)
    assert parse({"input": "just text"}).request.messages == [{"role": "user", "content": "just text"}]  # type: ignore[union-attr]


def test_text_format_reasoning_and_flat_tools_map_to_their_chat_fields() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    row = parse({"input": "x", "text": {"format": {"type": "json_schema", "name": "s", "schema": schema,
                                                   "strict": True}},
                 "reasoning": {"effort": "low"}})
    assert row.request is not None, row.error
    assert row.request.sampling.structured_output == ("json_schema", json.dumps(schema, separators=(",", ":")))
    assert row.request.reasoning_effort == "low"
    tooled = parse({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}})
    assert tooled.request is not None and tooled.request.tools is not None, tooled.error
    assert tooled.request.tools.named and tooled.request.tools.choice == "get_weather"
    assert tooled.request.tools.tools[0]["function"]["parameters"] == WEATHER["parameters"]


@pytest.mark.parametrize(("body", "needle"), [
    ({"input": "x", "previous_response_id": "resp_1"}, "unknown field 'body.previous_response_id'"),
    ({"input": "x", "reasoning": {"effort": "low", "summary": "auto"}}, "body.reasoning.summary"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "only function tools are known here"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "only message, function_call and function_call_output"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]}, "output must be a string"),
    ({"input": "x", "max_output_tokens": 0}, "body.max_output_tokens must be a positive integer"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "body.text.format.type must be"),
    ({"input": []}, "body.input must not be empty"),
])
def test_what_a_responses_line_asks_beyond_bij_is_an_invalid_request_naming_the_field(
        body: dict[str, Any], needle: str) -> None:
    row = parse(body)
    assert row.error_code == "invalid_request" and needle in str(row.error), row.error


def test_answers_are_responses_objects_the_openai_sdk_reads() -> None:
    responses = pytest.importorskip("openai.types.responses")
    row = parse({"input": "x", "tools": [WEATHER], "max_output_tokens": 20})
    call = {"id": None, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    choice = Choice(output="", completion_tokens=9, finish_reason="tool_calls", reasoning="cold north",
                    tool_calls=[call], reasoning_tokens=3)
    res = Result(output="", prompt_tokens=5, completion_tokens=9, extra={"parsed": choice})
    line = result_row(row, res, OPTS)
    assert line["custom_id"] == "r1" and line["response"]["status_code"] == 200
    body = responses.Response.model_validate(line["response"]["body"])
    assert body.status == "completed" and body.model == "m"
    assert [o.type for o in body.output] == ["reasoning", "function_call"]
    assert body.output[1].name == "get_weather" and json.loads(body.output[1].arguments) == {"city": "Oslo"}
    assert body.usage is not None and (body.usage.input_tokens, body.usage.output_tokens) == (5, 9)
    assert body.usage.output_tokens_details.reasoning_tokens == 3
    assert body.tools[0].name == "get_weather" and body.max_output_tokens == 20
    cut = Result(output="once upon", prompt_tokens=5, completion_tokens=20, extra={"finish_reason": "length"})
    body = responses.Response.model_validate(result_row(parse({"input": "x", "max_output_tokens": 20}), cut, OPTS)[
        "response"]["body"])
    assert body.status == "incomplete" and body.incomplete_details is not None
    assert body.incomplete_details.reason == "max_output_tokens" and body.output_text == "once upon"


def test_bij_api_takes_every_endpoint_the_worker_answers() -> None:
    from bij.api.bodies import CreateBatch
    from bij.contract.codes import OPENAI_ENDPOINTS

    for url in OPENAI_ENDPOINTS:
        assert CreateBatch(input_file_id="file-1", endpoint=url).endpoint == url
    assert OPENAI_ENDPOINTS["/v1/responses"] == "chat"


def test_earlier_calls_in_the_input_are_the_chat_historys_tool_calls_and_tool_messages() -> None:
    row = parse({"input": [
        {"role": "user", "content": "weather in Oslo and Paris?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "3 C"},
        {"type": "function_call_output", "call_id": "c2", "output": "9 C"}], "tools": [WEATHER]})
    assert row.request is not None, row.error
    user, assistant, *results = row.request.messages or []
    assert assistant["role"] == "assistant" and assistant["content"] is None
    assert [(c["id"], c["function"]["arguments"]) for c in assistant["tool_calls"]] == [
        ("c1", '{"city": "Oslo"}'), ("c2", '{"city": "Paris"}')]
    assert results == [{"role": "tool", "tool_call_id": "c1", "content": "3 C"},
                       {"role": "tool", "tool_call_id": "c2", "content": "9 C"}]
