"""What the tokenizer-backed engines share: chat messages, prompt token ids, device choice."""

from __future__ import annotations

import json
from typing import Any

from bij.engines.base import Request, estimate_tokens, request_text

# Below this a temperature is greedy (vLLM uses the same cut-off).
GREEDY_EPS = 1e-5


def pick_device(configured: str | None) -> str:
    """The configured device, else cuda when a GPU is visible, else cpu."""
    if configured:
        return configured
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def chat_messages(req: Request) -> list[dict[str, Any]]:
    """The request as chat messages: plain text becomes one user message, content parts become text.

    A request with images keeps its parts in the shape vision models' chat templates read
    (``{"type": "text", "text": ...}``, ``{"type": "image"}``): the template places each image's
    placeholder token, which the engine expands to the image's features.
    """
    if req.messages is None:
        return [{"role": "user", "content": req.text or ""}]
    out = []
    for m in req.messages:
        content = m.get("content")
        if isinstance(content, list):
            parts = [p for p in content if isinstance(p, dict)]
            if req.images:
                content = [{"type": "image"} if p.get("type") == "image_url" else
                           {"type": "text", "text": str(p.get("text", ""))} for p in parts]
            else:
                # OpenAI content parts; most chat templates expect a plain string.
                content = "".join(str(p.get("text", "")) for p in parts)
            m = {**m, "content": content}
        if m.get("role") == "assistant" and m.get("tool_calls"):
            m = {**m, "tool_calls": [_template_call(c) for c in m["tool_calls"]]}
        out.append(m)
    return out


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    """An assistant's earlier tool call as chat templates read it: its arguments a dict, not the
    JSON text OpenAI carries (vLLM's server makes the same change)."""
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        args = {}
    return {**call, "function": {**fn, "arguments": args if isinstance(args, dict) else {}}}


def row_template_kwargs(req: Request, kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The chat template's variables for a request: the spec's (model.chatTemplateKwargs), the row's
    tools, and its `reasoning_effort` with `enable_thinking` (false for "none") as vLLM's server gives
    them, unless the spec sets `enable_thinking` itself."""
    if req.tools is None and req.reasoning_effort is None:
        return kwargs or {}
    out = dict(kwargs or {})
    if req.tools is not None:
        out["tools"] = list(req.tools.tools)
    if req.reasoning_effort is not None:
        out["reasoning_effort"] = req.reasoning_effort
        out.setdefault("enable_thinking", req.reasoning_effort != "none")
    return out


def prompt_ids(tok: Any, requests: list[Request], chat: bool, template: str | None = None,
               template_kwargs: dict[str, Any] | None = None) -> list[list[int] | str]:
    """Token ids per request as the model receives them, or why a request cannot become a prompt.

    Plain prompts get the tokenizer's special tokens; a prompt given as token ids is taken as it is
    (ids outside the tokenizer's vocabulary refuse it); chat prompts are rendered with the chat
    template, which already holds BOS and friends, so none are added again. `template` replaces the
    tokenizer's own (spec.model.chatTemplate); `template_kwargs` are variables the template reads
    (spec.model.chatTemplateKwargs, e.g. a reasoning model's thinking switch; see
    `row_template_kwargs` for what a row's tools and reasoning effort add), under a row's own
    (`chatTemplateKwargs`); a row may also end the prompt without the generation prompt
    (`addGenerationPrompt` false) or leave its last message open to be continued
    (`continueFinalMessage`, an assistant prefill).
    """
    if not chat:
        texts = [request_text(r) for r in requests if r.token_ids is None]
        enc = iter(tok(texts, add_special_tokens=True, verbose=False)["input_ids"]) if texts else iter([])
        return [list(next(enc)) if r.token_ids is None else given_ids(tok, r.token_ids) for r in requests]
    rendered: list[str | None] = []
    problems: dict[int, str] = {}
    for i, r in enumerate(requests):
        s = r.sampling
        kwargs = dict(row_template_kwargs(r, template_kwargs))  # a copy: the row's own fields go on top
        if s.chat_template_kwargs:
            kwargs.update(json.loads(s.chat_template_kwargs))
        if s.continue_final_message:
            kwargs["continue_final_message"] = True
        try:
            rendered.append(tok.apply_chat_template(chat_messages(r), chat_template=template,
                                                    add_generation_prompt=s.add_generation_prompt is not False,
                                                    tokenize=False, **kwargs))
        except Exception as e:  # a template's raise_exception() (bad roles, order): this row only
            rendered.append(None)
            problems[i] = f"chat template rejected the messages: {e}"
    texts = [t for t in rendered if t is not None]
    ids = iter(tok(texts, add_special_tokens=False, verbose=False)["input_ids"]) if texts else iter([])
    return [problems[i] if t is None else list(next(ids)) for i, t in enumerate(rendered)]


def given_ids(tok: Any, ids: list[int]) -> list[int] | str:
    """A prompt given as token ids, or why the tokenizer has no such tokens."""
    size = len(tok)
    bad = [t for t in ids if t >= size]
    if bad:
        return f"token id {bad[0]} is outside the vocabulary of {size} tokens"
    return list(ids)


def count_prompt_tokens(tok: Any, requests: list[Request], chat: bool, template: str | None = None,
                        template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Prompt tokens per request; a request the template rejects is estimated (it fails in run)."""
    if not requests:
        return []
    return [len(p) if isinstance(p, list) else estimate_tokens(request_text(r))
            for r, p in zip(requests, prompt_ids(tok, requests, chat, template, template_kwargs), strict=True)]


def truncate_prompt(tok: Any, req: Request, ids: list[int], limit: int, embed: bool) -> list[int]:
    """A prompt cut to `limit` tokens.

    Embeddings keep the head, cut by the tokenizer itself so the special tokens stay (what
    `SentenceTransformer.encode` does); generation keeps the tail, as vLLM's
    `truncate_prompt_tokens` does, so the end of the text and a chat template's generation
    prompt stay next to the first generated token.
    """
    if len(ids) <= limit:
        return ids
    if embed and req.token_ids is None:
        enc = tok(request_text(req), add_special_tokens=True, truncation=True, max_length=limit, verbose=False)
        return list(enc["input_ids"])
    return ids[:limit] if embed else ids[-limit:]
