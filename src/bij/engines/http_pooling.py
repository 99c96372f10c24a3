"""Engine http for the pooling tasks classify, score and rerank: a fleet that serves a sequence classifier or
a cross-encoder with vLLM (`vllm serve`) answers each row at its /classify, /score or /rerank endpoint.

Everything but the bodies and the answers is http's (`HttpTransport`: the preflight, the congestion window,
retries, error rows, `close`). One row is one request: classify sends the row's text as `input`, score its
text and pair as `text_1` and `text_2`, rerank its query and documents as `query` and `documents` (no
`top_n`: every document comes back, and a line's own top_n is applied as its result row is written). The
answer becomes the result fields `pooling.pooled` makes for every other engine ({label, probs}, {score},
{results: [{index, relevance_score}], best first}), so a row's result does not depend on the engine.
"""

from __future__ import annotations

import json
from typing import Any

from bij.contract.engines import POOLING_TASKS
from bij.engines.base import EngineConfig, Request, Result, estimate_tokens
from bij.engines.http import BODY_CUT, HttpTransport
from bij.engines.pooling import pooled, row_pairs

# vLLM's routes (`/v1/score` and `/v1/rerank` answer the same, with a deprecation warning in its log).
PATHS = {"classify": "/classify", "score": "/score", "rerank": "/rerank"}


class HttpPoolingEngine(HttpTransport):
    """classify, score and rerank rows sent to a vLLM server's pooling endpoints."""

    def __init__(self, config: EngineConfig):
        if config.task not in POOLING_TASKS:
            raise ValueError(f"HttpPoolingEngine runs tasks {', '.join(POOLING_TASKS)}, not {config.task!r}")
        super().__init__(config)
        self.path = PATHS[config.task]

    def count_tokens(self, requests: list[Request]) -> list[int]:
        """Estimated tokens of each row's longest pair (both texts: a cross-encoder reads them together)."""
        task = self.config.task
        return [max(self._pair_tokens(a, b) for a, b in row_pairs(task, r)) for r in requests]

    @staticmethod
    def _pair_tokens(first: str, second: str | None) -> int:
        return estimate_tokens(first) + (estimate_tokens(second) if second is not None else 0)

    def tiny_request(self) -> Request:
        return Request(text="Hi", pair="Hi", documents=["Hi"])

    def body(self, req: Request) -> dict[str, Any]:
        """vLLM's ClassificationRequest, ScoreRequest (text_1, text_2) or RerankRequest for this row."""
        out: dict[str, Any] = {"model": self.served_model}
        text = req.text or ""
        if self.config.task == "classify":
            out["input"] = text
        elif self.config.task == "score":
            out["text_1"], out["text_2"] = text, req.pair or ""
        else:
            out["query"], out["documents"] = text, list(req.documents or [])
        if self.config.truncate:
            # The server cuts with the model's own tokenizer: to model.maxInputTokens, or without it to its
            # own limit (-1: the served model's max_model_len).
            out["truncate_prompt_tokens"] = self.config.max_input_tokens or -1
        return out

    def _result(self, req: Request, raw: bytes) -> Result:
        try:
            doc = json.loads(raw)
            fields = self._fields(req, doc)
            usage = doc.get("usage") or {}
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
            return Result(error=f"the server's answer is not a vLLM {self.path} answer ({type(e).__name__}: {e}): "
                                f"{raw.decode('utf-8', 'replace')[:BODY_CUT]}", extra={"code": "server_error"})
        prompt = usage.get("prompt_tokens")
        if not isinstance(prompt, int) or isinstance(prompt, bool):
            prompt = sum(self._pair_tokens(a, b) for a, b in row_pairs(self.config.task, req))
        return Result(prompt_tokens=prompt, pooled=fields)

    def _fields(self, req: Request, doc: dict[str, Any]) -> dict[str, Any]:
        """The row's result fields from vLLM's answer (raises on an answer of another shape)."""
        task = self.config.task
        if task == "classify":
            item = doc["data"][0]
            probs = [float(p) for p in item["probs"]]
            if not probs:
                raise ValueError("no probs")
            best = max(range(len(probs)), key=probs.__getitem__)
            label = item.get("label")
            return pooled(task, [probs], {best: label} if isinstance(label, str) else {})
        if task == "score":
            return pooled(task, [[float(doc["data"][0]["score"])]], {})
        ranked = doc["results"]
        scores = {int(r["index"]): float(r["relevance_score"]) for r in ranked}
        n = len(req.documents or [])
        if len(ranked) != n or sorted(scores) != list(range(n)):
            raise ValueError(f"it ranks documents {sorted(scores)}, not each of the row's {n} once")
        return pooled(task, [[scores[i]] for i in range(n)], {})
