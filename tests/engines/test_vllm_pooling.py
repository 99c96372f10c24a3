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

from bij.engines import create_engine, vllm_llm  # noqa: E402
from bij.engines.base import EngineConfig, Request  # noqa: E402

pytestmark = pytest.mark.vllm

# vLLM's CPU attention takes heads of 64 (hidden 128, 2 heads); eager and a small KV cache for 2 cores. Its
# kernels (and dtype) differ from torch's: answers agree to 1e-2.
KNOBS = {"maxModelLen": 128, "enforceEager": True, "engineArgs": {"kvCacheMemoryBytes": 1 << 26}}
QUERY = "what is a pet"
DOCUMENTS = ["the cat sat on the mat", "x y z", "the dog ran fast"]


def engines(path: Path, task: str) -> tuple[Any, Any]:
    """The vllm engine and the transformers one on the same model (one LLM a process: the vllm one is new)."""
    vllm_llm.shutdown_llm()
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
        # the last pair is over the 128 positions: both cut it to them (model.truncate)
        pairs = [Request(text=QUERY, pair=d) for d in [*DOCUMENTS, " ".join(["the cat sat"] * 60)]]
        assert [r.pooled["score"] for r in served.run(pairs)] == pytest.approx(
            [r.pooled["score"] for r in direct.run(pairs)], abs=1e-2)
    finally:
        vllm_llm.shutdown_llm()


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
        vllm_llm.shutdown_llm()


def test_rerank_rows_run_through_the_worker_on_vllm_and_bad_rows_are_error_rows(
        tmp_path: Path, file_place: Any, make_job: Any, run_shards: Any, read_output: Any) -> None:
    from bij.local.publish import publish_manifest

    path = build_bert_head(tmp_path / "ce", num_labels=1, max_positions=128, hidden_size=128)
    lines = [{"id": i, "query": QUERY, "documents": DOCUMENTS[: i + 1]} for i in range(3)]
    lines.append({"id": "bad", "query": QUERY, "documents": [1, 2]})
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", lines),
                      model={"engine": "vllm", "task": "rerank", "name": str(path), "vllm": {"maxModelLen": 128}})
    served, direct = engines(path, "rerank")
    try:
        run_shards(job, served)
        publish_manifest(job)
        out = read_output(job)
        want = direct.run([Request(text=QUERY, documents=DOCUMENTS[: i + 1]) for i in range(3)])
        by_id = {r["id"]: r["results"] for r in out.results}
        assert [[r["index"] for r in by_id[i]] for i in range(3)] == \
            [[r["index"] for r in w.pooled["results"]] for w in want]
        assert [(e["id"], e["error"]["code"]) for e in out.errors] == [("bad", "invalid_text")]
        assert "field 'documents'[0] must be a string, got int" in out.errors[0]["error"]["message"]
    finally:
        vllm_llm.shutdown_llm()
