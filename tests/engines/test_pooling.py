"""The pooling tasks on tiny random models built here: classify, score and rerank answer what the library
called directly answers on the same inputs."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

# Nothing here may reach a model hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from tiny_models import CLASSIFIER_LABELS, build_bert_head  # noqa: E402

from bij.engines import create_engine  # noqa: E402
from bij.engines.base import EngineConfig, Request  # noqa: E402

QUERY = "what is a pet"
DOCUMENTS = ["the cat sat on the mat", "x y z", "the dog ran fast", "a b c d e f"]


@pytest.fixture(scope="module")
def classifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_bert_head(tmp_path_factory.mktemp("cls"), num_labels=3, id2label=CLASSIFIER_LABELS)


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_bert_head(tmp_path_factory.mktemp("ce"), num_labels=1)


def loaded(engine: str, task: str, path: Path, **kw: Any) -> Any:
    e = create_engine(engine, EngineConfig(task=task, name=str(path), device="cpu", **kw))
    e.load()
    return e


def direct_logits(path: Path, firsts: list[str], seconds: list[str] | None = None) -> Any:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.inference_mode():
        return model(**tok(firsts, seconds, padding=True, return_tensors="pt")).logits.float()


@pytest.mark.parametrize("engine", ["transformers", "sentence-transformers"])
def test_classify_answers_the_softmax_of_the_head_and_names_the_label_from_id2label(engine, classifier):
    import torch

    texts = ["the cat sat on the mat", "x", "the dog ran fast and the cat sat"]
    results = loaded(engine, "classify", classifier).run([Request(text=t) for t in texts])
    probs = torch.softmax(direct_logits(classifier, texts), dim=-1)
    for res, want in zip(results, probs.tolist(), strict=True):
        assert res.error is None
        assert res.pooled["probs"] == pytest.approx(want, abs=1e-5)
        assert res.pooled["label"] == CLASSIFIER_LABELS[max(range(3), key=want.__getitem__)]
        assert res.prompt_tokens is not None and res.prompt_tokens > 2
    assert {r.pooled["label"] for r in results} <= set(CLASSIFIER_LABELS.values())


@pytest.mark.parametrize("engine", ["transformers", "sentence-transformers"])
def test_score_equals_the_cross_encoder_called_directly(engine, cross_encoder):
    from sentence_transformers import CrossEncoder

    pairs = [(QUERY, d) for d in DOCUMENTS]
    results = loaded(engine, "score", cross_encoder).run([Request(text=a, pair=b) for a, b in pairs])
    want = CrossEncoder(str(cross_encoder), device="cpu").predict(pairs).tolist()
    assert [r.pooled["score"] for r in results] == pytest.approx(want, abs=1e-5)
    assert len(set(want)) == len(want)  # the scores tell the pairs apart: the test can see a mix-up


@pytest.mark.parametrize("engine", ["transformers", "sentence-transformers"])
def test_rerank_sorts_the_documents_by_the_cross_encoders_score(engine, cross_encoder):
    from sentence_transformers import CrossEncoder

    (res,) = loaded(engine, "rerank", cross_encoder).run([Request(text=QUERY, documents=DOCUMENTS)])
    want = CrossEncoder(str(cross_encoder), device="cpu").predict([(QUERY, d) for d in DOCUMENTS]).tolist()
    ranked = res.pooled["results"]
    assert [r["index"] for r in ranked] == sorted(range(len(DOCUMENTS)), key=lambda i: -want[i])
    assert [r["relevance_score"] for r in ranked] == pytest.approx(sorted(want, reverse=True), abs=1e-5)
    assert [r["index"] for r in ranked] != list(range(len(DOCUMENTS)))  # sorted, not in input order


def test_a_rerank_row_counts_its_longest_pair_and_its_usage_sums_them(cross_encoder):
    engine = loaded("transformers", "rerank", cross_encoder)
    tok = engine.tokenizer
    sizes = [len(tok(QUERY, d)["input_ids"]) for d in DOCUMENTS]
    req = Request(text=QUERY, documents=DOCUMENTS)
    assert engine.count_tokens([req]) == [max(sizes)]
    (res,) = engine.run([req])
    assert res.prompt_tokens == sum(sizes)


@pytest.mark.parametrize("engine", ["transformers", "sentence-transformers"])
def test_a_pair_over_the_limit_is_cut_when_truncating(engine, cross_encoder):
    from sentence_transformers import CrossEncoder

    long_doc = " ".join(["the cat sat"] * 40)  # over the 64 positions
    cutting = loaded(engine, "score", cross_encoder, truncate=True)
    (res,) = cutting.run([Request(text=QUERY, pair=long_doc)])
    assert res.error is None and res.prompt_tokens == cutting.max_input_tokens() == 64
    # CrossEncoder cuts a pair to its max_length too
    assert res.pooled["score"] == pytest.approx(
        CrossEncoder(str(cross_encoder), device="cpu").predict([(QUERY, long_doc)])[0], abs=1e-5)
    refusing = loaded(engine, "score", cross_encoder, truncate=False)
    (res,) = refusing.run([Request(text=QUERY, pair=long_doc)])
    assert res.pooled is None and "longer than the model's limit of 64" in (res.error or "")


@pytest.mark.parametrize("engine", ["transformers", "sentence-transformers"])
@pytest.mark.parametrize("task", ["score", "rerank"])
def test_a_classifier_with_several_labels_is_refused_for_score_and_rerank(engine, task, classifier):
    with pytest.raises(ValueError, match="has 3 labels; task .* needs a cross-encoder with one"):
        loaded(engine, task, classifier)
