"""Engine http for classify, score and rerank: rows answered by a vLLM fleet's /classify, /score and /rerank (the
fake server answers as vLLM does, from the texts it got), through bij's commits, error rows and publish."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from test_http import CLASS_LABELS, FakeServer, class_probs, http_model, pair_score, run_job

from bij.contract.spec import parse_spec
from bij.engines import create_engine
from bij.engines.base import Request
from bij.engines.http_pooling import HttpPoolingEngine
from bij.engines.pooling import pooled
from bij.worker.main import engine_config

QUERY = "which pet sleeps the most"
DOCUMENTS = ["the cat sat on the mat", "dogs run fast", "a parrot talks", "fish swim all day", "x"]


@pytest.fixture
def fleet() -> Iterator[FakeServer]:
    s = FakeServer()
    threading.Thread(target=s.httpd.serve_forever, daemon=True).start()
    yield s
    s.release.set()
    s.httpd.shutdown()
    s.httpd.server_close()


def engine_for(server: FakeServer, task: str, **model: Any) -> HttpPoolingEngine:
    spec = parse_spec({"input": {"uri": "file:///in"}, "output": {"uri": "file:///out"},
                       "model": {**http_model(server, task, **model.pop("http", {})), **model}})
    engine = create_engine("http", engine_config(spec))
    assert isinstance(engine, HttpPoolingEngine)
    return engine


def test_the_scores_tell_the_test_documents_apart() -> None:
    scores = [pair_score(QUERY, d) for d in DOCUMENTS]
    assert len(set(scores)) == len(scores)  # a row mixed up with another, or a pair swapped, shows
    assert sorted(range(len(DOCUMENTS)), key=lambda i: -scores[i]) != list(range(len(DOCUMENTS)))
    assert pair_score("a b", "c d") != pair_score("c d", "a b")


def test_classify_rows_get_the_servers_label_and_probs(fleet: FakeServer, file_place: Any, make_job: Any,
                                                       run_shards: Any, read_output: Any) -> None:
    rows = [{"id": i, "text": f"review number {i} " + "good " * (i % 4)} for i in range(30)]
    out = run_job(file_place, make_job, run_shards, read_output, rows, http_model(fleet, "classify"))
    assert out.errors == [] and len(out.results) == 30
    texts = {r["id"]: r["text"] for r in rows}
    for r in out.results:
        probs = class_probs(texts[r["id"]])
        assert r["probs"] == pytest.approx(probs)
        assert r["label"] == CLASS_LABELS[max(range(3), key=probs.__getitem__)]
    assert set(fleet.paths) == {"/classify"} and len(fleet.bodies) == 30
    # model.truncate is on by default for classify: the server cuts to its own limit
    assert fleet.bodies[0].keys() == {"model", "input", "truncate_prompt_tokens"}
    assert fleet.bodies[0]["model"] == "fleet-model" and fleet.bodies[0]["truncate_prompt_tokens"] == -1


def test_score_rows_send_text_and_pair_in_their_places(fleet: FakeServer, file_place: Any, make_job: Any,
                                                       run_shards: Any, read_output: Any) -> None:
    rows = [{"id": i, "text": QUERY, "pair": d} for i, d in enumerate(DOCUMENTS)]
    out = run_job(file_place, make_job, run_shards, read_output, rows,
                  {**http_model(fleet, "score"), "maxInputTokens": 64})
    assert out.errors == []
    assert {r["id"]: r["score"] for r in out.results} == {
        i: pytest.approx(pair_score(QUERY, d)) for i, d in enumerate(DOCUMENTS)}
    assert set(fleet.paths) == {"/score"}
    assert {(b["text_1"], b["text_2"], b["truncate_prompt_tokens"]) for b in fleet.bodies} == {
        (QUERY, d, 64) for d in DOCUMENTS}
    usage = {r["id"]: r["usage"]["prompt_tokens"] for r in out.results}
    assert usage[0] == len(QUERY.split()) + len(DOCUMENTS[0].split())  # the server's count, not the estimate


def test_rerank_rows_rank_every_document_by_its_index_best_first(fleet: FakeServer, file_place: Any,
                                                                 make_job: Any, run_shards: Any,
                                                                 read_output: Any) -> None:
    rows = [{"id": i, "query": QUERY, "documents": DOCUMENTS[i:] + DOCUMENTS[:i]} for i in range(5)]
    out = run_job(file_place, make_job, run_shards, read_output, rows,
                  {**http_model(fleet, "rerank", maxInFlight=3), "truncate": False})
    assert out.errors == [] and len(out.results) == 5
    docs = {r["id"]: r["documents"] for r in rows}
    for r in out.results:
        scores = [pair_score(QUERY, d) for d in docs[r["id"]]]
        want = sorted(range(len(scores)), key=lambda i: -scores[i])
        assert [x["index"] for x in r["results"]] == want
        assert [x["relevance_score"] for x in r["results"]] == pytest.approx([scores[i] for i in want])
    assert set(fleet.paths) == {"/rerank"}
    assert all(b.keys() == {"model", "query", "documents"} for b in fleet.bodies)  # no top_n, no truncation


def test_the_engine_answers_what_every_pooling_engine_answers_for_the_same_outputs(fleet: FakeServer) -> None:
    """The result fields are pooling.pooled's, as vllm_pooling's, transformers' and sentence-transformers' are."""
    (res,) = engine_for(fleet, "rerank").run([Request(text=QUERY, documents=DOCUMENTS)])
    assert res.error is None
    assert res.pooled == pooled("rerank", [[pair_score(QUERY, d)] for d in DOCUMENTS], {})
    (res,) = engine_for(fleet, "score").run([Request(text=QUERY, pair=DOCUMENTS[2])])
    assert res.pooled == pooled("score", [[pair_score(QUERY, DOCUMENTS[2])]], {})
    (res,) = engine_for(fleet, "classify").run([Request(text="so so")])
    probs = class_probs("so so")
    best = max(range(3), key=probs.__getitem__)
    assert res.pooled == pooled("classify", [probs], {best: CLASS_LABELS[best]})


def test_an_openai_rerank_line_is_answered_with_its_top_n(fleet: FakeServer, file_place: Any, make_job: Any,
                                                          run_shards: Any, read_output: Any) -> None:
    lines = [{"custom_id": "r1", "method": "POST", "url": "/v1/rerank",
              "body": {"model": "m", "query": QUERY, "documents": DOCUMENTS, "top_n": 2}}]
    out = run_job(file_place, make_job, run_shards, read_output, lines, http_model(fleet, "rerank"),
                  input={"format": "openai"})
    (line,) = out.results
    got = line["response"]["body"]["results"]
    scores = [pair_score(QUERY, d) for d in DOCUMENTS]
    best = sorted(range(5), key=lambda i: -scores[i])[:2]
    assert [(r["index"], r["document"]["text"]) for r in got] == [(i, DOCUMENTS[i]) for i in best]
    assert "top_n" not in fleet.bodies[0]  # every document comes back; the line's top_n is applied here


@pytest.mark.parametrize("task", ["classify", "score", "rerank"])
def test_a_rejected_row_is_one_error_row_a_busy_one_is_retried_and_the_rest_go_on(
        fleet: FakeServer, file_place: Any, make_job: Any, run_shards: Any, read_output: Any, task: str) -> None:
    def policy(body: dict[str, Any], n: int, total: int) -> Any:
        text = body.get("input", body.get("text_1", body.get("query")))
        if text == "bad row":
            return 400, {}, '{"object": "error", "message": "This model\'s maximum context length is 8", "code": 400}'
        if text == "always busy":
            return 503, {}, '{"error": "overloaded"}'
        if text.startswith("busy once") and n == 1:
            return 503, {}, '{"error": "warming"}'
        return None

    fleet.policy = policy
    texts = ["good one", "bad row", "always busy", "busy once a", "good two", "busy once b"]
    field = {"classify": {}, "score": {"pair": "a pet"}, "rerank": {"documents": ["a pet", "a rock"]}}[task]
    first = "query" if task == "rerank" else "text"
    rows = [{"id": i, first: t, **field} for i, t in enumerate(texts)]
    out = run_job(file_place, make_job, run_shards, read_output, rows, http_model(fleet, task, retries=2))
    assert sorted(r["id"] for r in out.results) == [0, 3, 4, 5]
    errors = {e["id"]: e["error"] for e in out.errors}
    assert errors.keys() == {1, 2}
    assert errors[1]["code"] == "invalid_request" and "maximum context length" in errors[1]["message"]
    assert errors[2] == {"code": "server_error",
                         "message": 'the server answered 503 after 3 sends: {"error": "overloaded"}'}
    sent = {t: sum(1 for b in fleet.bodies if b.get("input", b.get("text_1", b.get("query"))) == t) for t in texts}
    assert sent == {"good one": 1, "bad row": 1, "always busy": 3, "busy once a": 2, "good two": 1,
                    "busy once b": 2}


def test_an_answer_of_another_shape_is_the_rows_server_error(fleet: FakeServer) -> None:
    # A server that honours a top_n it was not sent (or drops documents) must not pass for a ranking of them all.
    fleet.policy = lambda body, n, total: (200, {}, '{"results": [{"index": 1, "relevance_score": 0.5}]}')
    (res,) = engine_for(fleet, "rerank").run([Request(text=QUERY, documents=["a", "b"])])
    assert res.pooled is None and res.extra["code"] == "server_error"
    assert res.error is not None and res.error.startswith("the server's answer is not a vLLM /rerank answer")


def test_the_window_grows_additively_up_to_max_in_flight_and_rows_come_back_in_order(fleet: FakeServer) -> None:
    engine = engine_for(fleet, "score", http={"maxInFlight": 8})
    rows = [Request(text=f"q{i}", pair=f"document {i}") for i in range(200)]
    results = engine.run(rows)
    assert [r.pooled["score"] if r.pooled else None for r in results] == [
        pytest.approx(pair_score(f"q{i}", f"document {i}")) for i in range(200)]
    assert engine.stats()["largest"] == 8 and fleet.peak <= 8


def test_preflight_without_a_model_list_sends_one_tiny_pooling_request(fleet: FakeServer) -> None:
    fleet.models = None
    engine_for(fleet, "score").load()
    assert fleet.paths == ["/score"] and fleet.bodies[0]["text_1"] == fleet.bodies[0]["text_2"] == "Hi"


def test_a_row_counts_its_longest_pair_by_the_estimate() -> None:
    from bij.engines.base import EngineConfig

    engine = HttpPoolingEngine(EngineConfig(task="rerank", name="m", http={"baseUrl": "http://h:1"}))
    assert engine.count_tokens([Request(text="x" * 40, documents=["y" * 8, "y" * 80])]) == [10 + 20]
    assert engine.honours == frozenset() and engine.path == "/rerank"
