"""Result and error rows out: what a row's answer (or its failure) is published as, in the row's own shape
(a plain result row, or an OpenAI batch output line for /v1/chat/completions, /v1/completions,
/v1/embeddings, /v1/responses and the pooling endpoints). The rows themselves come in through `inputs`.
"""

from __future__ import annotations

import base64
import hashlib
import struct
import time
from typing import Any

from bij.contract.codes import OPENAI_ENDPOINTS
from bij.contract.engines import POOLING_TASKS
from bij.engines import tools
from bij.engines.base import Choice, Result, TokenLogprob
from bij.worker import responses
from bij.worker.input_row import InputOptions, Row


def _usage(res: Result) -> dict[str, int]:
    p, c = res.prompt_tokens, res.completion_tokens
    if p is not None and c is not None:  # the common case, in one dict display
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
    if p is not None:
        return {"prompt_tokens": p, "total_tokens": p}
    if c is not None:
        return {"completion_tokens": c, "total_tokens": c}
    return {}


def plain_result(rid: Any, res: Result, truncated: bool = False,
                 columns: dict[str, Any] | None = None) -> dict[str, Any]:
    """The published result row of a successful request in the plain (jsonl) shape, its pass-through
    `columns` after its own fields."""
    out: dict[str, Any] = {"id": rid}
    if res.pooled is not None:
        out.update(res.pooled)
    elif res.embedding is not None:
        out["embedding"] = res.embedding
    else:
        out["output"] = res.output
    usage = _usage(res)
    if usage:
        out["usage"] = usage
    if res.choices is not None:
        out["choices"] = [_plain_choice(i, c) for i, c in enumerate(res.choices)]
    parsed = res.extra.get("parsed")
    if isinstance(parsed, Choice) and parsed.reasoning is not None:
        out["reasoning"] = parsed.reasoning
    if truncated:
        out["truncated"] = True
    if columns:
        out.update(columns)
    return out


def _plain_choice(i: int, c: Choice) -> dict[str, Any]:
    """One of a plain result row's `choices`: index, output, finish_reason, completion_tokens, logprobs."""
    out: dict[str, Any] = {"index": i, "output": c.output, "finish_reason": c.finish_reason,
                           "completion_tokens": c.completion_tokens}
    if c.reasoning is not None:
        out["reasoning"] = c.reasoning
    if c.logprobs is not None:
        out["logprobs"] = [{"token": t.token, "logprob": t.logprob,
                            "top_logprobs": [{"token": s, "logprob": lp} for s, lp in t.top]} for t in c.logprobs]
    return out


def _chat_logprobs(lps: list[TokenLogprob] | None) -> dict[str, Any] | None:
    """OpenAI chat `choices[i].logprobs`: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    if lps is None:
        return None
    return {"content": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode("utf-8")),
                         "top_logprobs": [{"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}
                                          for s, lp in t.top]} for t in lps], "refusal": None}


def _completion_logprobs(lps: list[TokenLogprob] | None) -> dict[str, Any] | None:
    """OpenAI completions `choices[i].logprobs`: tokens, token_logprobs, top_logprobs, text_offset."""
    if lps is None:
        return None
    offsets, at = [], 0
    for t in lps:
        offsets.append(at)
        at += len(t.token)
    return {"tokens": [t.token for t in lps], "token_logprobs": [t.logprob for t in lps],
            "top_logprobs": [dict(t.top) for t in lps], "text_offset": offsets}


def _choices(res: Result, max_tokens: int) -> list[Choice]:
    """A result's answers: its `choices`, or its one output."""
    if res.choices is not None:
        return res.choices
    parsed = res.extra.get("parsed")
    if isinstance(parsed, Choice):  # parsed by the engine's reasoning and tool call parsers
        return [parsed]
    finish = res.extra.get("finish_reason") or ("length" if (res.completion_tokens or 0) >= max_tokens else "stop")
    return [Choice(output=res.output or "", completion_tokens=res.completion_tokens or 0, finish_reason=finish)]


def merged_result(row: Row, results: list[Result]) -> Result:
    """One Result for a row with several prompts (`row.parts`): the first failing prompt's error, named
    by its place in the body (a failing part fails the row), else the results summed over the prompts
    (usage), which result_row writes out prompt by prompt from `parts`."""
    field = "input" if OPENAI_ENDPOINTS.get(row.url or "") == "embed" else "prompt"
    for k, r in enumerate(results):
        if r.error is not None:
            return Result(output=r.output, prompt_tokens=r.prompt_tokens, error=f"body.{field}[{k}]: {r.error}",
                          extra=dict(r.extra))
    prompt = [r.prompt_tokens for r in results if r.prompt_tokens is not None]
    completion = [r.completion_tokens for r in results if r.completion_tokens is not None]
    return Result(output=results[0].output, embedding=results[0].embedding,
                  prompt_tokens=sum(prompt) if prompt else None,
                  completion_tokens=sum(completion) if completion else None,
                  extra={"parts": results})


def _vector(embedding: list[float] | None, encoding: str) -> list[float] | str | None:
    """An embedding as the row asked: floats, or base64 of little-endian float32 (OpenAI's)."""
    if encoding != "base64" or embedding is None:
        return embedding
    return base64.b64encode(struct.pack(f"<{len(embedding)}f", *embedding)).decode("ascii")


def _chat_message(c: Choice, row: Row, call_ids: str) -> dict[str, Any]:
    """A chat answer's `message`: its content, the reasoning a reasoning parser kept apart from it
    (`reasoning_content`), and the tool calls a tool parser read (`tool_calls`, with ids stable
    across reruns: ``call_<row digest>_<choice>_<call>``)."""
    message: dict[str, Any] = {"role": "assistant", "content": c.output}
    if c.reasoning is not None:
        message["reasoning_content"] = c.reasoning
    if c.tool_calls is not None:
        # A forced call (required, a named function) has empty content, as vLLM's server answers it.
        ask = row.request.tools if row.request is not None else None
        message["content"] = "" if tools.forced(ask) else (c.output or None)
        message["tool_calls"] = [{**call, "id": call.get("id") or f"call_{call_ids}_{k}"}
                                 for k, call in enumerate(c.tool_calls)]
    return message


def _reasoning_usage(usage: dict[str, Any], choices: list[Choice]) -> dict[str, Any]:
    """`usage` with `completion_tokens_details.reasoning_tokens` when a reasoning parser counted them."""
    counted = [c.reasoning_tokens for c in choices if c.reasoning_tokens is not None]
    if not counted:
        return usage
    return {**usage, "completion_tokens_details": {"reasoning_tokens": sum(counted)}}


def result_row(row: Row, res: Result, opts: InputOptions) -> dict[str, Any]:
    """The published result row for a successful request (a row with several prompts: its merged_result)."""
    if opts.format != "openai":
        return plain_result(row.id, res, row.truncated, row.carried)
    usage = _usage(res)
    digest = hashlib.sha256(str(row.id).encode()).hexdigest()[:24]
    kind = OPENAI_ENDPOINTS.get(row.url or "", opts.task)
    body: dict[str, Any]
    served = row.request.adapter if row.request is not None and row.request.adapter else opts.model_name
    parts: list[Result] = res.extra.get("parts") or [res]
    if row.url == "/v1/responses":
        (choice,) = _choices(res, row.request.max_tokens if row.request else 0)[:1]
        body = responses.response_object(digest, served, choice, _reasoning_usage(usage, [choice]), f"{digest}_0",
                                         row.request, res.cached_tokens)
    elif kind in POOLING_TASKS:
        body = _pooling_body(kind, digest, served, row, res, usage)
    elif kind == "embed":
        body = {"object": "list", "model": served,
                "data": [{"object": "embedding", "index": i, "embedding": _vector(r.embedding, row.encoding)}
                         for i, r in enumerate(parts)], "usage": usage}
    elif kind == "chat":
        choices = _choices(res, row.request.max_tokens if row.request else 0)
        body = {"id": f"chatcmpl-{digest}", "object": "chat.completion", "created": int(time.time()),
                "model": served,
                "choices": [{"index": i, "message": _chat_message(c, row, f"{digest}_{i}"),
                             "logprobs": _chat_logprobs(c.logprobs), "finish_reason": c.finish_reason}
                            for i, c in enumerate(choices)], "usage": _reasoning_usage(usage, choices)}
    else:
        # Several prompts: each prompt's n choices in turn, numbered on (prompt-major, as OpenAI does).
        choices = [c for r in parts for c in _choices(r, row.request.max_tokens if row.request else 0)]
        body = {"id": f"cmpl-{digest}", "object": "text_completion", "created": int(time.time()),
                "model": served,
                "choices": [{"index": i, "text": c.output, "logprobs": _completion_logprobs(c.logprobs),
                             "finish_reason": c.finish_reason} for i, c in enumerate(choices)],
                "usage": usage}
    line = {"id": f"batch_req_{digest}", "custom_id": row.id,
            "response": {"status_code": 200, "request_id": f"req_{digest}", "body": body}, "error": None}
    if row.truncated:
        line["truncated"] = True
    return line


def _pooling_body(kind: str, digest: str, served: str, row: Row, res: Result, usage: dict[str, int]
                  ) -> dict[str, Any]:
    """The response body vLLM's server answers /classify, /v1/score or /v1/rerank with, for one line."""
    pooled = res.pooled or {}
    if kind == "classify":
        probs = pooled.get("probs") or []
        return {"id": f"classify-{digest}", "object": "list", "created": int(time.time()), "model": served,
                "data": [{"index": 0, "label": pooled.get("label"), "probs": probs, "num_classes": len(probs)}],
                "usage": usage}
    if kind == "score":
        return {"id": f"score-{digest}", "object": "list", "created": int(time.time()), "model": served,
                "data": [{"index": 0, "object": "score", "score": pooled.get("score")}], "usage": usage}
    documents = row.request.documents if row.request is not None and row.request.documents else []
    ranked = pooled.get("results") or []
    if row.top_n:
        ranked = ranked[:row.top_n]
    return {"id": f"rerank-{digest}", "model": served, "usage": usage,
            "results": [{"index": r["index"], "document": {"text": documents[r["index"]]},
                         "relevance_score": r["relevance_score"]} for r in ranked]}


def error_row(row: Row, object_name: str, opts: InputOptions) -> dict[str, Any]:
    """The published error row: the id (null if unknown), what went wrong, and where the row is."""
    out: dict[str, Any] = {"id": row.id, "error": {"code": row.error_code, "message": row.error},
                           "object": object_name, "offset": row.at[1]}
    if row.output is not None:
        out["output"] = row.output
    if opts.format == "openai":
        out["custom_id"] = row.id
        out["response"] = None
    elif row.carried:
        out.update(row.carried)
    return out
