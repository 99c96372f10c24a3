"""vLLM's reasoning and tool call parsers over finished chat answers, as vLLM's OpenAI server runs
them for a non-streaming chat completion (`spec.model.vllm.reasoningParser`, `toolCallParser`).

The server composes the two parsers into one (`ParserManager.get_parser`), lets it adjust the
request before generation (`adjust_request`: e.g. hermes keeps special tokens in the text), and
parses each finished answer into reasoning, content and tool calls (`Parser.parse`), counting the
reasoning's tokens (`count_reasoning_tokens`). The same calls are made here, on a vLLM
`ChatCompletionRequest` built from the row, so an answer reads as vLLM's server would answer it:

- content without the reasoning (`message.reasoning_content`) and without the tool calls;
- `tool_choice` auto: the calls the tool parser finds in the text, finish_reason ``tool_calls``;
- "required" or a named function: the answer was constrained to the JSON schema of such calls
  (tools.py), read as vLLM reads it; finish_reason ``tool_calls`` for "required", ``stop`` for a
  named function; the answer checked by bij's validator is that JSON (tools.forced_output);
- "none": no calls are read.
"""

from __future__ import annotations

from typing import Any

from ..tools import forced, forced_output
from .base import Choice, EngineConfig, Request, Result
from .prompts import row_template_kwargs


class ChatParsing:
    """The configured parsers of one engine (built once the tokenizer is loaded)."""

    def __init__(self, config: EngineConfig, tokenizer: Any, model_config: Any = None):
        from vllm.parser.parser_manager import ParserManager

        self.reasoning = config.vllm.get("reasoningParser") or config.vllm.get("reasoning_parser")
        self.tool_calls = config.vllm.get("toolCallParser") or config.vllm.get("tool_call_parser")
        self.config = config
        self.tokenizer = tokenizer
        self.model_config = model_config
        # Raises (naming the flag) when the tokenizer lacks what a parser needs, e.g. <think> tokens.
        self.cls = ParserManager.get_parser(tool_parser_name=self.tool_calls, reasoning_parser_name=self.reasoning,
                                            enable_auto_tools=self.tool_calls is not None, model_name=config.name,
                                            tokenizer=tokenizer)
        tool_cls = self.cls.tool_parser_cls if self.cls is not None else None
        # Forced calls are read as JSON only by parsers that say so; others read their own format.
        self.forces = tool_cls is not None and bool(tool_cls.supports_required_and_named)

    def request(self, req: Request) -> Any:
        """vLLM's ChatCompletionRequest for a row (what its parsers read: tools, tool_choice, messages)."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        body: dict[str, Any] = {"model": self.config.name or "", "messages": req.messages or [
            {"role": "user", "content": req.text or ""}]}
        if req.tools is not None:
            body.update(req.tools.body())
        if req.reasoning_effort is not None:
            body["reasoning_effort"] = req.reasoning_effort
        return ChatCompletionRequest.model_validate(body)

    def _parser(self, req: Request, vreq: Any) -> Any:
        kwargs = {k: v for k, v in row_template_kwargs(req, self.config.chat_template_kwargs).items() if k != "tools"}
        return self.cls(self.tokenizer, vreq.tools, chat_template_kwargs=kwargs, model_config=self.model_config)

    def keeps_special_tokens(self, req: Request) -> bool:
        """Whether the row's answer must keep special tokens in its text (the tool parser's adjust_request
        says so: tool-call markers that are special tokens would be lost before it reads them)."""
        if self.cls is None or req.tools is None:
            return False
        vreq = self.request(req)
        return not self._parser(req, vreq).adjust_request(vreq).skip_special_tokens

    def apply(self, req: Request, res: Result, outputs: list[Any]) -> Result:
        """The row's result with each answer parsed (`outputs`: vLLM's CompletionOutputs, by index)."""
        if self.cls is None or res.error is not None:
            return res
        vreq = self.request(req)
        if res.choices is None:
            c = self._parse(req, vreq, res.output or "", outputs[0].token_ids, res.extra.get("finish_reason", "stop"),
                            res.completion_tokens or 0)
            res.output = c.output
            res.extra["finish_reason"] = c.finish_reason
            res.extra["parsed"] = c
            return res
        res.choices = [self._parse(req, vreq, c.output, o.token_ids, c.finish_reason, c.completion_tokens, c.logprobs)
                       for c, o in zip(res.choices, outputs, strict=True)]
        res.output = res.choices[0].output
        res.extra["finish_reason"] = res.choices[0].finish_reason
        return res

    def _parse(self, req: Request, vreq: Any, text: str, token_ids: Any, finish: str, tokens: int,
               logprobs: Any = None) -> Choice:
        # One parser per answer: parsers keep state (vLLM's server does the same for n > 1).
        parser = self._parser(req, vreq)
        reasoning, content, calls = parser.parse(text, vreq, enable_auto_tools=self.tool_calls is not None,
                                                 model_output_token_ids=list(token_ids))
        reasoning_tokens = parser.count_reasoning_tokens(list(token_ids)) if self.reasoning else None
        ask = req.tools
        tool_calls = None
        if ask is not None and ask.choice != "none" and (calls or forced(ask)):
            tool_calls = [{"id": c.id, "type": "function",
                           "function": {"name": c.name, "arguments": c.arguments}} for c in calls or []]
        if ask is not None and forced(ask):
            output = forced_output(ask, tool_calls or [], content)
            if not ask.named and finish == "stop":
                finish = "tool_calls"
        else:
            output = content or ""
            if tool_calls:
                finish = "tool_calls"
        return Choice(output=output, completion_tokens=tokens, finish_reason=finish, logprobs=logprobs,
                      reasoning=reasoning, tool_calls=tool_calls, reasoning_tokens=reasoning_tokens)
