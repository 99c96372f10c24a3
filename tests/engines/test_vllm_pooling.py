"""Engine vllm for classify, score and rerank (the vLLM tier): LLM.classify / LLM.score on the pooling runner
answer what the transformers head says for the same rows, on tiny random models built here."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from tiny_models import CLASSIFIER_LABELS, build_bert_head  # noqa: E402

from bij.engines import create_engine  # noqa: E402
from bij.engines import vllm as adapter  # noqa: E402
from bij.engines.base import EngineConfig, Request  # noqa: E402

pytestmark = pytest.mark.vllm

# vLLM's CPU attention takes heads of 64 (hidden 128, 2 heads); eager and a small KV cache for 2 cores. Its
# kernels (and dtype) differ from torch's: answers agree to 1e-2.
KNOBS = {"maxModelLen": 128, "enforceEager": True, "kvCacheMemoryBytes": 1 << 26}
QUERY = "what is a pet"
DOCUMENTS = ["the cat sat on the mat", "x y z", "the dog ran fast"]


def engines(path: Path, task: str) -> tuple[Any, Any]:
    """The vllm engine and the transformers one on the same model (one LLM a process: the vllm one is new)."""
    adapter.shutdown_llm()
    config = {"task": task, "name": str(path), "truncate": True}
    served = create_engine("vllm", EngineConfig(vllm=KNOBS, **config))
    served.load()
    direct = create_engine("transformers", EngineConfig(device="cpu", **config))
    direct.load()
    return served, direct


def test_vllm_reranks_and_scores_as_the_cross_encoder_head_does(tmp_path: Path) -> None:
    path = build_bert_head(tmp_path / "ce", num_labels=1, max_positions=128, hidden_size=128)
    served, direct = engines(path, "rerank")
    try:
        rows = [Request(text=QUERY, documents=DOCUMENTS), Request(text="a b", documents=DOCUMENTS[:2])]
        got, want = served.run(rows), direct.run(rows)
        for g, w in zip(got, want, strict=True):
            assert [r["index"] for r in g.pooled["results"]] == [r["index"] for r in w.pooled["results"]]
            assert [r["relevance_score"] for r in g.pooled["results"]] == pytest.approx(
                [r["relevance_score"] for r in w.pooled["results"]], abs=1e-2)
            assert g.prompt_tokens == w.prompt_tokens
        served.config = EngineConfig(task="score", name=str(path), vllm=KNOBS, truncate=True)  # same LLM
        direct.config = EngineConfig(task="score", name=str(path), device="cpu", truncate=True)
        pairs = [Request(text=QUERY, pair=d) for d in DOCUMENTS]
        assert [r.pooled["score"] for r in served.run(pairs)] == pytest.approx(
            [r.pooled["score"] for r in direct.run(pairs)], abs=1e-2)
    finally:
        adapter.shutdown_llm()


def test_vllm_classifies_with_the_labels_of_id2label(tmp_path: Path) -> None:
    path = build_bert_head(tmp_path / "cls", num_labels=3, id2label=CLASSIFIER_LABELS, max_positions=128,
                           hidden_size=128)
    served, direct = engines(path, "classify")
    try:
        rows = [Request(text=t) for t in ("the cat sat", "x y z", "the dog ran fast on the mat")]
        for g, w in zip(served.run(rows), direct.run(rows), strict=True):
            assert g.pooled["probs"] == pytest.approx(w.pooled["probs"], abs=1e-2)
            assert g.pooled["label"] == w.pooled["label"] and g.pooled["label"] in CLASSIFIER_LABELS.values()
    finally:
        adapter.shutdown_llm()
