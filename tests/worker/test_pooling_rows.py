"""Pooling tasks end to end: classify, score and rerank rows in (JSONL and OpenAI-format lines), result rows out
(JSONL and Parquet), on tiny random models built here; a bad row is one error row naming its field."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from tiny_models import CLASSIFIER_LABELS, build_bert_head  # noqa: E402

from bij.engines import create_engine  # noqa: E402
from bij.engines.base import EngineConfig, Request  # noqa: E402
from bij.local.publish import publish_manifest  # noqa: E402
from bij.storage.parquet import read_table, table_rows  # noqa: E402
from bij.worker.input_row import InputOptions  # noqa: E402
from bij.worker.inputs import parse_line  # noqa: E402

AT = (0, 0, 10)


def parse(obj: Any, opts: InputOptions) -> Any:
    return parse_line(json.dumps(obj).encode(), AT, "in/a.jsonl", opts)


@pytest.fixture(scope="module")
def classifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_bert_head(tmp_path_factory.mktemp("cls"), num_labels=3, id2label=CLASSIFIER_LABELS)


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_bert_head(tmp_path_factory.mktemp("ce"), num_labels=1)


def engine_for(job: Any) -> Any:
    m = job.spec.model
    return create_engine(m.engine, EngineConfig(task=m.task, name=m.name, device="cpu", truncate=m.truncates))


# --- rows in ----------------------------------------------------------------------------------------


def test_a_score_row_reads_its_pair_from_pair_field():
    row = parse({"id": 1, "q": "what is a pet", "d": "the cat"}, InputOptions(task="score", text_field="q",
                                                                             pair_field="d"))
    assert (row.error, row.request.text, row.request.pair) == (None, "what is a pet", "the cat")
    assert row.carried is None  # the pair is consumed, never carried beside the score


def test_a_rerank_row_reads_its_query_and_documents():
    row = parse({"id": "r", "query": "q", "documents": ["a", "b"], "lang": "en"}, InputOptions(task="rerank"))
    assert (row.request.text, row.request.documents, row.carried) == ("q", ["a", "b"], {"lang": "en"})


@pytest.mark.parametrize("task, obj, code, message", [
    ("score", {"id": 1, "text": "t"}, "missing_text", "no field 'pair'"),
    ("score", {"id": 1, "text": "t", "pair": 7}, "invalid_text", "field 'pair' must be a string, got int"),
    ("score", {"id": 1, "text": "t", "pair": " "}, "empty_text", "field 'pair' is empty"),
    ("score", {"id": 1, "pair": "p"}, "missing_text", "no field 'text'"),
    ("rerank", {"id": 1, "documents": ["a"]}, "missing_text", "no field 'query'"),
    ("rerank", {"id": 1, "query": "q"}, "missing_text", "no field 'documents'"),
    ("rerank", {"id": 1, "query": "q", "documents": "a"}, "invalid_text",
     "field 'documents' must be a non-empty list of strings, got str"),
    ("rerank", {"id": 1, "query": "q", "documents": []}, "invalid_text",
     "field 'documents' must be a non-empty list of strings, got an empty list"),
    ("rerank", {"id": 1, "query": "q", "documents": ["a", {"text": "b"}]}, "invalid_text",
     "field 'documents'[1] must be a string, got dict"),
    ("classify", {"id": 1, "text": ["a"]}, "invalid_text", "field 'text' must be a string, got list"),
    ("classify", {"id": 1, "text": "t", "label": "gold"}, "invalid_row", "input column 'label' (in this row) clashes"),
])
def test_a_pooling_row_missing_its_field_or_of_the_wrong_type_is_an_error_row_naming_it(task, obj, code, message):
    row = parse(obj, InputOptions(task=task))
    assert row.request is None and row.id == 1
    assert row.error_code == code and message in row.error


def test_a_label_column_is_carried_as_any_column_by_the_other_tasks():
    row = parse({"id": 1, "text": "t", "label": "gold"}, InputOptions(task="generate"))
    assert row.error is None and row.carried == {"label": "gold"}


@pytest.mark.parametrize("url, body, message", [
    ("/v1/score", {"text_1": "a"}, "body.text_2 is required"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": "c"},
     "body.text_1 must be a string (one text per line), got a list"),
    ("/v1/rerank", {"query": "q", "documents": "d"}, "body.documents must be a non-empty list of strings"),
    ("/v1/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, "body.top_n must be a non-negative integer"),
    ("/v1/rerank", {"query": "q", "documents": ["d"], "temperature": 0},
     "body.temperature is not a field of /v1/rerank"),
    ("/classify", {"model": "m"}, "body.input must be a string (one text per line), got missing"),
])
def test_an_openai_pooling_line_with_a_bad_body_is_an_error_row_naming_the_field(url, body, message):
    task = {"/v1/score": "score", "/v1/rerank": "rerank", "/classify": "classify"}[url]
    row = parse({"custom_id": "c", "method": "POST", "url": url, "body": body},
                InputOptions(format="openai", task=task))
    assert row.request is None and row.id == "c" and message in row.error


def test_an_openai_line_for_another_pooling_endpoint_names_the_task_it_needs():
    row = parse({"custom_id": "c", "url": "/v1/score", "body": {"text_1": "a", "text_2": "b"}},
                InputOptions(format="openai", task="rerank"))
    assert row.error == "url /v1/score needs model.task score, the job runs rerank"


# --- results out, through the worker and publish ------------------------------------------------------


def test_classify_rows_publish_labels_from_id2label_and_the_heads_probabilities(
        file_place, make_job, run_shards, read_output, classifier):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    texts = ["the cat sat on the mat", "x y z", "the dog ran fast", "a b c"]
    lines = [{"id": i, "text": t} for i, t in enumerate(texts)] + [{"id": "bad", "text": 3}]
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", lines),
                      model={"engine": "transformers", "task": "classify", "name": str(classifier)})
    run_shards(job, engine_for(job))
    publish_manifest(job)
    out = read_output(job)
    tok = AutoTokenizer.from_pretrained(classifier)
    model = AutoModelForSequenceClassification.from_pretrained(classifier).eval()
    with torch.inference_mode():
        want = torch.softmax(model(**tok(texts, padding=True, return_tensors="pt")).logits, -1).tolist()
    got = sorted(out.results, key=lambda r: r["id"])
    assert [r["id"] for r in got] == [0, 1, 2, 3]
    for r, probs in zip(got, want, strict=True):
        assert r["probs"] == pytest.approx(probs, abs=1e-5)
        assert r["label"] == CLASSIFIER_LABELS[probs.index(max(probs))]
        assert "output" not in r and r["usage"]["prompt_tokens"] > 0
    assert [(e["id"], e["error"]["code"]) for e in out.errors] == [("bad", "invalid_text")]
    assert "field 'text'" in out.errors[0]["error"]["message"]


def test_rerank_rows_publish_their_documents_best_first_in_jsonl_and_parquet(
        file_place, make_job, run_shards, read_output, cross_encoder):
    from sentence_transformers import CrossEncoder

    docs = ["the cat sat on the mat", "x y z", "the dog ran fast", "a b c d"]
    lines = [{"id": "q1", "query": "what is a pet", "documents": docs, "lang": "en"},
             {"id": "q2", "query": "a b", "documents": docs[:2]},
             {"id": "q3", "query": "a b", "documents": "not a list"}]
    ce = CrossEncoder(str(cross_encoder), device="cpu")
    for fmt in ("jsonl", "parquet"):
        _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", lines), out_dir=f"out-{fmt}/",
                          output={"format": fmt},
                          model={"engine": "sentence-transformers", "task": "rerank", "name": str(cross_encoder)})
        run_shards(job, engine_for(job))
        manifest = publish_manifest(job)
        if fmt == "jsonl":
            out = read_output(job)
            results = out.results
            assert [(e["id"], e["error"]["code"]) for e in out.errors] == [("q3", "invalid_text")]
        else:  # read back as `bij results` reads a Parquet file
            table = read_table(file_place.storage.read_bytes(file_place.uri(f"out-{fmt}/" +
                                                                            manifest.files[0].path)))
            assert table.schema.field("results").type == pa.list_(
                pa.struct([("index", pa.int64()), ("relevance_score", pa.float64())]))
            results = list(table_rows(table))
            assert manifest.counts.errors == 1
        by_id = {r["id"]: r for r in results}
        for rid, query, n in (("q1", "what is a pet", 4), ("q2", "a b", 2)):
            scores = ce.predict([(query, d) for d in docs[:n]]).tolist()
            ranked = by_id[rid]["results"]
            assert [r["index"] for r in ranked] == sorted(range(n), key=lambda i: -scores[i])
            assert [r["relevance_score"] for r in ranked] == pytest.approx(sorted(scores, reverse=True), abs=1e-5)
        assert by_id["q1"]["lang"] == "en" and by_id["q2"].get("lang") is None
        assert set(by_id["q1"]) == {"id", "results", "usage", "lang"}


def test_classify_probs_are_a_float32_list_column_in_parquet(file_place, make_job, run_shards, classifier):
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", [{"id": 1, "text": "the cat"}]),
                      output={"format": "parquet"},
                      model={"engine": "sentence-transformers", "task": "classify", "name": str(classifier)})
    run_shards(job, engine_for(job))
    manifest = publish_manifest(job)
    table = pq.read_table(pa.BufferReader(file_place.storage.read_bytes(
        file_place.uri("out/" + manifest.files[0].path))))
    assert table.schema.field("probs").type == pa.list_(pa.float32())
    assert table.schema.field("label").type == pa.string()
    assert table.column("label").to_pylist()[0] in CLASSIFIER_LABELS.values()


def test_openai_pooling_lines_are_answered_in_vllms_response_shapes(
        file_place, make_job, run_shards, read_output, classifier, cross_encoder):
    docs = ["the cat", "x y z", "the dog ran"]
    cases = {
        "rerank": {"url": "/v1/rerank", "body": {"model": "m", "query": "a pet", "documents": docs, "top_n": 2}},
        "score": {"url": "/v1/score", "body": {"model": "m", "text_1": "a pet", "text_2": "the cat"}},
        "classify": {"url": "/classify", "body": {"model": "m", "input": "the cat sat"}},
    }
    answers = {}
    for task, line in cases.items():
        path = classifier if task == "classify" else cross_encoder
        _, job = make_job(file_place, file_place.write_jsonl(f"{task}.jsonl", [{"custom_id": task, **line}]),
                          out_dir=f"out-{task}/", input={"format": "openai"},
                          model={"engine": "transformers", "task": task, "name": str(path), "servedName": "m"})
        run_shards(job, engine_for(job))
        publish_manifest(job)
        (result,) = read_output(job).results
        assert result["custom_id"] == task and result["error"] is None
        assert result["response"]["status_code"] == 200
        answers[task] = result["response"]["body"]
    rerank = answers["rerank"]
    assert rerank["model"] == "m" and rerank["id"].startswith("rerank-")
    assert len(rerank["results"]) == 2  # top_n
    assert [r["document"]["text"] for r in rerank["results"]] == [docs[r["index"]] for r in rerank["results"]]
    assert rerank["results"][0]["relevance_score"] >= rerank["results"][1]["relevance_score"]
    assert rerank["usage"]["prompt_tokens"] == rerank["usage"]["total_tokens"] > 0
    (score,) = answers["score"]["data"]
    assert answers["score"]["object"] == "list" and score["object"] == "score" and 0 < score["score"] < 1
    (data,) = answers["classify"]["data"]
    assert data["label"] in CLASSIFIER_LABELS.values() and data["num_classes"] == 3
    assert sum(data["probs"]) == pytest.approx(1, abs=1e-5)
    # the answer is what the engine says for the same text, alone
    engine = create_engine("transformers", EngineConfig(task="classify", name=str(classifier), device="cpu"))
    engine.load()
    (direct,) = engine.run([Request(text="the cat sat")])
    assert data["probs"] == pytest.approx(direct.pooled["probs"], abs=1e-6) and data["label"] == direct.pooled["label"]
