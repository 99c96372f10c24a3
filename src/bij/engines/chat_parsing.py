"""vLLM's reasoning and tool call parsers over finished chat answers, as vLLM's OpenAI server runs
them for a non-streaming chat completion (`spec.model.vllm.reasoningParser`, `toolCallParser`).

The server composes the two parsers into one (`ParserManager.get_parser`), lets it adjust the
request before generation (`adjust_request`: e.g. hermes keeps special tokens in the text), and
parses each finished answer into reasoning, content and tool calls (`Parser.parse`), counting the
reasoning's tokens (`count_reasoning_tokens`). The same calls are made here, on a vLLM
`ChatCompletionRequest` built from the row, so an answer reads as vLLM's server would answer it:

- content without the reasoning (`message.reasoning_content`) and without the tool calls;
- `tool_choice` auto: the calls the tool parser finds in the text, finish_reason ``tool_calls``;
- "required" or a named function: the answer was constrained as vLLM's server constrains it (the
  parser's `adjust_request`: a JSON schema of the calls, or a structural tag in the model's own call
  format, every tool made strict so that the tag constrains the arguments too) and read as vLLM
  reads it; finish_reason ``tool_calls`` for "required", ``stop`` for a named function; calls that
  break what the row asked for make it a `schema_violation` error row (tools.checked);
- "none": no calls are read.

Without a tool call parser only forced calls are served, as vLLM's server serves them without one:
decoded under `tools.forced_schema` and read by `tools.forced_calls`.
"""

from __future__ import annotations

import json
from typing import Any

from bij.engines.base import ENGINE_REJECTED, Choice, EngineConfig, Request, Result
from bij.engines.prompts import row_template_kwargs
from bij.engines.structured import MAX_CARRIED, grammar_schema
from bij.engines.tools import checked, forced, forced_result, forced_schema

# The prefix of vLLM's random tool call ids (vllm.renderers.chat_utils.make_tool_call_id).
_RANDOM_ID = "chatcmpl-tool-"


class ChatParsing:
    """The configured parsers of one engine (built once the tokenizer is loaded)."""

    def __init__(self, config: EngineConfig, tokenizer: Any, model_config: Any = None):
        from vllm.parser.parser_manager import ParserManager

        self.reasoning = config.vllm.reasoning_parser
        self.tool_calls = config.vllm.tool_call_parser
        self.config = config
        self.tokenizer = tokenizer
        self.model_config = model_config
        # Raises (naming the flag) when the tokenizer lacks what a parser needs, e.g. <think> tokens.
        self.cls = ParserManager.get_parser(tool_parser_name=self.tool_calls, reasoning_parser_name=self.reasoning,
                                            enable_auto_tools=self.tool_calls is not None, model_name=config.name,
                                            tokenizer=tokenizer)

    def reads(self, req: Request) -> bool:
        """Whether a row's answers are read here: every answer with a parser, a forced call's without."""
        return self.cls is not None or forced(req.tools)

    def request(self, req: Request, strict: bool = False) -> Any:
        """vLLM's ChatCompletionRequest for a row (what its parsers read: tools, tool_choice, messages);
        `strict`: every tool marked strict, so that a structural tag constrains its arguments."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        body: dict[str, Any] = {"model": self.config.name or "", "messages": req.messages or [
            {"role": "user", "content": req.text or ""}]}
        if req.tools is not None:
            body.update(req.tools.body())
            if strict:  # length-bounded strings tightened against raw control characters (structured.py)
                body["tools"] = [{**t, "function": {**t["function"], "strict": True, **(
                    {"parameters": json.loads(grammar_schema(json.dumps(t["function"]["parameters"])))}
                    if t["function"].get("parameters") else {})}} for t in body["tools"]]
        if req.reasoning_effort is not None:
            body["reasoning_effort"] = req.reasoning_effort
        return ChatCompletionRequest.model_validate(body)

    def _parser(self, req: Request, vreq: Any) -> Any:
        kwargs = {k: v for k, v in row_template_kwargs(req, self.config.chat_template_kwargs).items() if k != "tools"}
        return self.cls(self.tokenizer, vreq.tools, chat_template_kwargs=kwargs, model_config=self.model_config)

    def adjusted(self, req: Request) -> tuple[Any, bool]:
        """What the parsers' `adjust_request` makes of a tool row, as vLLM's server generates it: the
        structured outputs to decode it with (None: the row's own), and whether its text keeps special
        tokens (tool-call markers that are special tokens would be lost before the parser reads them).
        A forced call is always constrained so; an auto row only when it has no structured output of its own."""
        if req.tools is None or req.tools.choice == "none":
            return None, False
        if self.cls is None:  # no parser: a forced call's JSON, as vLLM's server decodes it without one
            if not forced(req.tools):
                return None, False
            from vllm.sampling_params import StructuredOutputsParams

            # Length-bounded strings tightened against raw control characters (bij.engines.structured).
            return StructuredOutputsParams(json=json.loads(grammar_schema(json.dumps(forced_schema(req.tools))))), False
        # A forced call's arguments are constrained whatever the tool's own `strict` says: vLLM's structural
        # tag leaves a lax tool's arguments free, and a model that does not already answer well fills them
        # with anything.
        vreq = self.request(req, strict=forced(req.tools))
        vreq = self._parser(req, vreq).adjust_request(vreq)
        structured = vreq.structured_outputs
        if req.sampling.structured_output is not None and not forced(req.tools):
            structured = None
        return structured, not vreq.skip_special_tokens

    def apply(self, req: Request, res: Result, outputs: list[Any], prompt: Any = None) -> Result:
        """The row's result with each answer parsed (`outputs`: vLLM's CompletionOutputs, by index;
        `prompt`: the prompt's token ids, which parsers that read state from the prompt are given)."""
        if res.error is not None:
            return res
        if self.cls is None:
            return forced_result(req, res) if forced(req.tools) else res
        try:
            return self._apply(req, res, outputs, prompt)
        except Exception as e:  # a parser failing on one answer (or on the row's messages): that row alone
            return Result(output=(res.output or "")[:MAX_CARRIED], prompt_tokens=res.prompt_tokens,
                          completion_tokens=res.completion_tokens,
                          error=f"vLLM's reasoning or tool call parser failed on the answer: {e}",
                          extra={"code": ENGINE_REJECTED})

    def _apply(self, req: Request, res: Result, outputs: list[Any], prompt: Any) -> Result:
        vreq = self.request(req)
        if res.choices is None:
            c = self._parse(req, vreq, prompt, res.output or "", outputs[0].token_ids,
                            res.extra.get("finish_reason", "stop"), res.completion_tokens or 0)
            res.output = c.output
            res.extra["finish_reason"] = c.finish_reason
            res.extra["parsed"] = c
            return self.checked(req, res)
        res.choices = [self._parse(req, vreq, prompt, c.output, o.token_ids, c.finish_reason, c.completion_tokens,
                                   c.logprobs)
                       for c, o in zip(res.choices, outputs, strict=True)]
        res.output = res.choices[0].output
        res.extra["finish_reason"] = res.choices[0].finish_reason
        return self.checked(req, res)

    def checked(self, req: Request, res: Result) -> Result:
        """A forced row's result, or its schema_violation error when a call breaks what it asked for."""
        return checked(req, res)

    def _parse(self, req: Request, vreq: Any, prompt: Any, text: str, token_ids: Any, finish: str, tokens: int,
               logprobs: Any = None) -> Choice:
        # One parser per answer: parsers keep state (vLLM's server does the same for n > 1).
        parser = self._parser(req, vreq)
        if prompt is not None:
            parser.set_prompt_token_ids(prompt)
        reasoning, content, calls = parser.parse(text, vreq, enable_auto_tools=self.tool_calls is not None,
                                                 model_output_token_ids=list(token_ids))
        reasoning_tokens = parser.count_reasoning_tokens(list(token_ids)) if self.reasoning else None
        ask = req.tools
        tool_calls = None
        if ask is not None and ask.choice != "none" and (calls or forced(ask)):
            # vLLM's random call ids ("chatcmpl-tool-<uuid>") would change when a row is run again (a resumed
            # shard): they are left out, and the answer's row makes stable ones. A model's own ids stay.
            tool_calls = [{"id": None if not c.id or c.id.startswith(_RANDOM_ID) else c.id, "type": "function",
                           "function": {"name": c.name, "arguments": c.arguments}} for c in calls or []]
        output = content or ""
        if ask is not None and forced(ask):
            if not ask.named and finish == "stop":
                finish = "tool_calls"
        elif tool_calls:
            finish = "tool_calls"
        return Choice(output=output, completion_tokens=tokens, finish_reason=finish, logprobs=logprobs,
                      reasoning=reasoning, tool_calls=tool_calls, reasoning_tokens=reasoning_tokens)
