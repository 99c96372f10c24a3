"""Engine http: rows answered by an OpenAI-compatible server, with bij's commits, error rows and publish."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from bij.contract import layout
from bij.contract.spec import SpecError, parse_spec
from bij.engines import create_engine
from bij.engines.http import HttpEngine, Window, retry_after_seconds
from bij.local.publish import publish_manifest
from bij.worker.main import engine_config

# policy(body, sends of this row so far including this one, sends in all) -> None (answer) | (status, headers,
# body) | "hang"
Policy = Callable[[dict[str, Any], int, int], Any]


def row_key(body: dict[str, Any]) -> str:
    if "messages" in body:
        return str(body["messages"][-1]["content"])
    if "text_1" in body:  # vLLM's /score
        return f"{body['text_1']} | {body['text_2']}"
    return str(body.get("prompt", body.get("input", body.get("query"))))


def embedding_of(text: str) -> list[float]:
    return [float(len(text)), float(sum(map(ord, text)) % 97)]


CLASS_LABELS = ("negative", "neutral", "positive")


def class_probs(text: str) -> list[float]:
    """The fake classifier: probabilities made from the text alone (a wrong row's text gives others)."""
    weights = [1.0 + len(text) % 5, 1.0 + sum(map(ord, text)) % 7, 1.0 + text.count(" ") % 3]
    return [w / sum(weights) for w in weights]


def pair_score(first: str, second: str) -> float:
    """The fake cross-encoder: a score in [0, 1) made from both texts, each weighed its own way, so a pair sent
    the wrong way round or with another row's text scores differently."""
    return (sum(map(ord, first)) * 31 + sum(i * ord(c) for i, c in enumerate(second, 1))) % 997 / 997


def pooling_answer(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ClassificationResponse, ScoreResponse or RerankResponse (vllm/entrypoints/pooling) for the body."""
    if path == "/classify":
        probs = class_probs(body["input"])
        best = max(range(len(probs)), key=probs.__getitem__)
        tokens = len(body["input"].split())
        return {"id": "classify-1", "object": "list", "created": 0, "model": body["model"],
                "data": [{"index": 0, "label": CLASS_LABELS[best], "probs": probs, "num_classes": len(probs)}],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}}
    if path == "/score":
        tokens = len(body["text_1"].split()) + len(body["text_2"].split())
        return {"id": "score-1", "object": "list", "created": 0, "model": body["model"],
                "data": [{"index": 0, "object": "score", "score": pair_score(body["text_1"], body["text_2"])}],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}}
    docs = body["documents"]
    results = sorted(({"index": i, "document": {"text": d}, "relevance_score": pair_score(body["query"], d)}
                      for i, d in enumerate(docs)), key=lambda r: -r["relevance_score"])
    top_n = body.get("top_n", 0)
    tokens = sum(len(body["query"].split()) + len(d.split()) for d in docs)
    return {"id": "rerank-1", "model": body["model"], "results": results[:top_n] if top_n else results,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


class FakeServer:
    """An OpenAI-compatible server on 127.0.0.1 that answers from the request and records what it got (and
    vLLM's pooling endpoints: /classify, /score, /rerank)."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.paths: list[str] = []
        self.sends: Counter[str] = Counter()
        self.in_flight = 0
        self.peak = 0
        self.lock = threading.Lock()
        self.policy: Policy = lambda body, n, total: None
        self.release = threading.Event()  # set to end hung requests
        self.arrivals: list[float] = []
        self.authorization: list[str | None] = []
        self.models: list[str] | None = ["fleet-model"]  # what GET /v1/models lists; None: no such endpoint
        self.gets: list[str | None] = []  # the Authorization header of each GET
        self.get_verdict: tuple[int, str] | None = None  # (status, body) every GET answers instead
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                return None

            def do_GET(self) -> None:
                server.gets.append(self.headers.get("Authorization"))
                if server.get_verdict is not None:
                    status, text = server.get_verdict
                elif self.path == "/v1/models" and server.models is not None:
                    status, text = 200, json.dumps({"object": "list", "data": [
                        {"id": m, "object": "model"} for m in server.models]})
                else:
                    status, text = 404, '{"detail": "Not Found"}'
                out = text.encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.bodies.append(body)
                    server.paths.append(self.path)
                    server.authorization.append(self.headers.get("Authorization"))
                    server.arrivals.append(time.monotonic())
                    key = row_key(body)
                    server.sends[key] += 1
                    n, total = server.sends[key], len(server.bodies)
                    server.in_flight += 1
                    server.peak = max(server.peak, server.in_flight)
                answered = False

                def done() -> None:
                    # A request is in flight until it is answered: counted off before the answer is on its way,
                    # else a client that sends its next request the moment it has one would be seen with one
                    # more than it holds.
                    nonlocal answered
                    if not answered:
                        answered = True
                        with server.lock:
                            server.in_flight -= 1

                try:
                    verdict = server.policy(body, n, total)
                    if verdict == "hang":
                        server.release.wait(10)
                        return
                    if verdict is None:
                        time.sleep(0.005)
                        status, headers, out = 200, {}, json.dumps(server.answer(self.path, body)).encode()
                    else:
                        status, headers, text = verdict
                        out = text.encode()
                    done()
                    self.send_response(status)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(out)))
                    self.end_headers()
                    self.wfile.write(out)
                finally:
                    done()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    @staticmethod
    def answer(path: str, body: dict[str, Any]) -> dict[str, Any]:
        key = row_key(body)
        usage = {"prompt_tokens": len(key.split()), "completion_tokens": len(key.split()) + 1}
        if path in ("/classify", "/score", "/rerank"):
            return pooling_answer(path, body)
        if path == "/v1/embeddings":
            return {"data": [{"embedding": embedding_of(key)}], "usage": {"prompt_tokens": len(key.split())}}
        if path == "/v1/chat/completions":
            return {"choices": [{"message": {"role": "assistant", "content": "re: " + key}, "finish_reason": "stop"}],
                    "usage": usage}
        return {"choices": [{"text": "re: " + key, "finish_reason": "length"}], "usage": usage}


@pytest.fixture
def server() -> Iterator[FakeServer]:
    s = FakeServer()
    t = threading.Thread(target=s.httpd.serve_forever, daemon=True)
    t.start()
    yield s
    s.release.set()
    s.httpd.shutdown()
    s.httpd.server_close()


def http_model(server: FakeServer, task: str, **http: Any) -> dict[str, Any]:
    return {"engine": "http", "task": task, "name": "hf/some-model",
            "http": {"baseUrl": server.url, "servedModel": "fleet-model", **http}}


def run_job(file_place: Any, make_job: Any, run_shards: Any, read_output: Any, rows: list[dict[str, Any]],
            model: dict[str, Any], **spec: Any) -> Any:
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", rows), model=model, **spec)
    engine = create_engine("http", engine_config(job.spec))
    run_shards(job, engine=engine)
    publish_manifest(job)
    out = read_output(job)
    out.engine = engine
    return out


def chat_line(cid: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": f"text of {cid}"}], **body}}


def test_chat_rows_are_answered_by_the_server_with_model_and_sampling_fields_sent(
        server: FakeServer, file_place: Any, make_job: Any, run_shards: Any, read_output: Any) -> None:
    lines = [chat_line(f"c{i}", top_p=0.5, stop=["END"], temperature=0.3, max_tokens=7, seed=5) for i in range(40)]
    out = run_job(file_place, make_job, run_shards, read_output, lines, http_model(server, "chat"),
                  input={"format": "openai"})
    assert out.errors == []
    got = {r["custom_id"]: r["response"]["body"] for r in out.results}
    assert sorted(got) == sorted(f"c{i}" for i in range(40))
    assert got["c3"]["choices"][0]["message"]["content"] == "re: text of c3"
    assert got["c3"]["usage"]["prompt_tokens"] == 3 and got["c3"]["usage"]["completion_tokens"] == 4
    assert set(server.paths) == {"/v1/chat/completions"}
    assert len(server.bodies) == 40  # each row sent once
    body = server.bodies[0]
    assert body["model"] == "fleet-model"
    assert (body["top_p"], body["stop"], body["temperature"], body["max_tokens"], body["seed"]) == (
        0.5, ["END"], 0.3, 7, 5)
    assert body["messages"][0]["role"] == "user"


def test_completions_and_embeddings_go_to_their_endpoints(server: FakeServer, file_place: Any, make_job: Any,
                                                          run_shards: Any, read_output: Any) -> None:
    rows = [{"id": i, "text": f"words of row {i}"} for i in range(20)]
    out = run_job(file_place, make_job, run_shards, read_output, rows, http_model(server, "generate"))
    assert out.errors == [] and len(out.results) == 20
    assert {r["id"]: r["output"] for r in out.results}[4] == "re: words of row 4"
    assert set(server.paths) == {"/v1/completions"} and server.bodies[0]["prompt"].startswith("words of row")
    assert server.bodies[0]["model"] == "fleet-model"

    server.bodies.clear()
    server.paths.clear()
    out = run_job(file_place, make_job, run_shards, read_output, rows, http_model(server, "embed"),
                  output={"uri": file_place.uri("emb/"), "compression": "none"})
    assert out.errors == [] and len(out.results) == 20
    assert {r["id"]: r["embedding"] for r in out.results}[7] == embedding_of("words of row 7")
    assert set(server.paths) == {"/v1/embeddings"}
    assert set(server.bodies[0]) == {"model", "input"}


def test_429_with_retry_after_and_503s_shrink_the_window_and_every_row_still_succeeds(
        server: FakeServer, file_place: Any, make_job: Any, run_shards: Any, read_output: Any) -> None:
    def policy(body: dict[str, Any], n: int, total: int) -> Any:
        if total <= 6:
            return 429, {"Retry-After": "1"}, '{"error": "slow down"}'
        if total % 7 == 0:
            return 503, {}, '{"error": "busy"}'
        return None

    server.policy = policy
    rows = [{"id": i, "text": f"row {i}"} for i in range(60)]
    start = time.monotonic()
    out = run_job(file_place, make_job, run_shards, read_output, rows, http_model(server, "generate", retries=5),
                  workers={"parallelism": 1})
    took = time.monotonic() - start
    assert out.errors == [] and len(out.results) == 60
    stats = out.engine.stats()
    assert stats["cuts"] >= 2 and stats["smallest"] < 4  # it started at 4 and was cut
    assert stats["pausedSeconds"] >= 0.5 and took >= 1.0  # the Retry-After was waited
    first_ok = server.arrivals[6]  # the first request after the six 429s
    assert first_ok - server.arrivals[0] >= 0.9
    assert server.peak <= 64


def test_a_400_is_one_error_row_with_status_and_body_and_a_row_always_503_is_sent_retries_plus_one_times(
        server: FakeServer, file_place: Any, make_job: Any, run_shards: Any, read_output: Any) -> None:
    def policy(body: dict[str, Any], n: int, total: int) -> Any:
        if body["prompt"] == "bad row":
            return 400, {}, '{"error": {"message": "prompt is bad' + "x" * 5000 + '"}}'
        if body["prompt"] == "busy row":
            return 503, {}, '{"error": "overloaded"}'
        return None

    server.policy = policy
    rows = [{"id": 1, "text": "good one"}, {"id": 2, "text": "bad row"}, {"id": 3, "text": "busy row"},
            {"id": 4, "text": "good two"}]
    out = run_job(file_place, make_job, run_shards, read_output, rows, http_model(server, "generate", retries=2))
    assert sorted(r["id"] for r in out.results) == [1, 4]
    errors = {e["id"]: e["error"] for e in out.errors}
    assert errors[2]["code"] == "invalid_request"
    assert errors[2]["message"].startswith('the server answered 400: {"error": {"message": "prompt is bad')
    assert len(errors[2]["message"]) < 1100  # the body is cut
    assert errors[3]["code"] == "server_error"
    assert errors[3]["message"] == 'the server answered 503 after 3 sends: {"error": "overloaded"}'
    assert server.sends["bad row"] == 1  # a 400 is not retried
    assert server.sends["busy row"] == 3  # retries + 1


def test_a_hanging_server_times_out_is_retried_then_an_error_row(server: FakeServer, file_place: Any,
                                                                 make_job: Any, run_shards: Any,
                                                                 read_output: Any) -> None:
    server.policy = lambda body, n, total: "hang" if body["prompt"] == "slow row" else None
    rows = [{"id": 1, "text": "slow row"}, {"id": 2, "text": "fast row"}]
    out = run_job(file_place, make_job, run_shards, read_output, rows,
                  http_model(server, "generate", timeoutSeconds=0.3, retries=1))
    assert [r["id"] for r in out.results] == [2]
    [err] = out.errors
    assert err["id"] == 1 and err["error"]["code"] == "timeout"
    assert "after 2 sends" in err["error"]["message"] and "timed out" in err["error"]["message"]
    assert server.sends["slow row"] == 2
    assert out.engine.stats()["cuts"] >= 1  # a timeout says the server is full


def test_a_rerun_does_not_resend_rows_already_durable(server: FakeServer, file_place: Any, make_job: Any,
                                                      run_shards: Any) -> None:
    rows = [{"id": i, "text": f"row {i}"} for i in range(40)]
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", rows), model=http_model(server, "generate"))
    run_shards(job, engine=create_engine("http", engine_config(job.spec)))
    assert len(server.bodies) == 40
    run_shards(job, engine=create_engine("http", engine_config(job.spec)))
    assert len(server.bodies) == 40


def test_the_window_grows_additively_up_to_max_in_flight(server: FakeServer) -> None:
    spec = parse_spec({"input": {"uri": "file:///in"}, "output": {"uri": "file:///out"},
                       "model": http_model(server, "generate", maxInFlight=8)})
    engine = create_engine("http", engine_config(spec))
    assert isinstance(engine, HttpEngine)
    from bij.engines.base import Request

    results = engine.run([Request(text=f"r{i}") for i in range(200)])
    assert [r.output for r in results] == [f"re: r{i}" for i in range(200)]  # in order
    assert engine.stats()["largest"] == 8 and server.peak <= 8


def round_trips(window: Window, capacity: int, n: int) -> tuple[list[int], int]:
    """`n` round trips against a fleet that takes `capacity` requests at once: each sends as many as the
    window holds and the fleet refuses (429) those over its capacity. (Rows served each round trip, refused.)"""
    served, refused = [], 0
    for _ in range(n):
        sent = int(window.size)
        tickets = [window.acquire() for _ in range(sent)]
        for i, ticket in enumerate(tickets):
            window.release(ticket, congested=i >= capacity, retry_after=None)
        served.append(min(sent, capacity))
        refused += max(0, sent - capacity)
    return served, refused


def test_the_window_stays_near_what_the_fleet_takes_and_aims_lower_when_the_fleet_takes_less() -> None:
    window = Window(128)
    served, refused = round_trips(window, 32, 400)
    assert window.cuts >= 5 and max(served) == 32  # it found the fleet's capacity, again and again
    # Halving and adding one a round trip served 0.79 of the capacity; near the ceiling it serves over 0.9.
    assert sum(served[100:]) >= 0.9 * 32 * 300
    assert refused <= 0.02 * sum(served)  # probing past the ceiling costs few refusals
    served, _ = round_trips(window, 16, 200)  # other lanes came: the fleet takes 16 of this lane's requests
    assert window.ceiling is not None and window.ceiling < 17
    assert sum(served[100:]) >= 0.9 * 16 * 100  # halving: 0.83
    served, _ = round_trips(window, 64, 100)  # they left: the probing finds the room within tens of round trips
    assert served.index(64) < 40


def test_an_aborted_row_is_not_sent_again_and_no_thread_holds_up_the_exit(server: FakeServer) -> None:
    from bij.engines.base import Request

    server.policy = lambda body, n, total: (503, {}, "busy")
    spec = parse_spec({"input": {"uri": "file:///in"}, "output": {"uri": "file:///out"},
                       "model": http_model(server, "generate", retries=20)})
    engine = create_engine("http", engine_config(spec))
    assert isinstance(engine, HttpEngine)
    engine.submit(0, Request(text="doomed"))
    deadline = time.monotonic() + 5
    while not server.sends["doomed"] and time.monotonic() < deadline:
        time.sleep(0.01)
    engine.abort()
    assert engine.unfinished() == 0 and engine.step() == []
    time.sleep(0.5)  # longer than the backoffs of the next sends would have taken
    assert server.sends["doomed"] <= 2  # the send on the wire at the abort, at most: not the 21 allowed
    assert all(t.daemon for t in engine._threads)


def test_the_authorization_env_var_is_sent_a_bare_key_as_bearer(server: FakeServer,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from bij.engines.base import Request

    spec = parse_spec({"input": {"uri": "file:///in"}, "output": {"uri": "file:///out"},
                       "model": http_model(server, "generate")})
    monkeypatch.setenv("BIJ_HTTP_AUTHORIZATION", "sk-123")
    create_engine("http", engine_config(spec)).run([Request(text="a")])
    monkeypatch.setenv("BIJ_HTTP_AUTHORIZATION", "Basic dXNlcg==")
    create_engine("http", engine_config(spec)).run([Request(text="b")])
    monkeypatch.delenv("BIJ_HTTP_AUTHORIZATION")
    create_engine("http", engine_config(spec)).run([Request(text="c")])
    assert server.authorization == ["Bearer sk-123", "Basic dXNlcg==", None]


@pytest.mark.parametrize(("model", "needle"), [
    ({"engine": "http", "task": "chat", "name": "m"}, "needs model.http.baseUrl"),
    ({"engine": "http", "task": "chat", "http": {"baseUrl": "http://x:1"}}, "servedModel or model.name"),
    ({"engine": "http", "task": "chat", "name": "m", "http": {"baseUrl": "ftp://x"}}, "baseUrl"),
])
def test_an_http_spec_without_what_it_needs_names_the_field(model: dict[str, Any], needle: str) -> None:
    with pytest.raises(SpecError, match=needle):
        parse_spec({"input": {"uri": "file:///in"}, "output": {"uri": "file:///out"}, "model": model})


def test_retry_after_takes_seconds_or_an_http_date() -> None:
    assert retry_after_seconds("2") == 2.0
    assert retry_after_seconds(None) is None and retry_after_seconds("soon") is None
    assert 9 <= (retry_after_seconds("Sun, 06 Dec 2026 00:00:10 GMT", now=1796515200.0) or 0) <= 11


def worker_pids(manifest: str) -> list[int]:
    """Pids of the live workers working on this round's plan."""
    pids = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and manifest.encode() in (d / "cmdline").read_bytes().split(b"\0"):
                pids.append(int(d.name))
        except OSError:
            continue
    return pids


def test_bij_run_killed_mid_job_resumes_without_resending_durable_rows(
        server: FakeServer, file_place: Any, make_job: Any, read_output: Any, worker_env: Any, bij_bin: Any) -> None:
    import signal
    import subprocess

    server.policy = lambda body, n, total: "hang" if int(body["prompt"].split()[1]) >= 32 else None
    rows = [{"id": i, "text": f"row {i}"} for i in range(100)]
    # In input order, so rows 0-31 are the first two chunks.
    spec, job = make_job(file_place, file_place.write_jsonl("in.jsonl", rows), model=http_model(server, "generate"),
                         workers={"parallelism": 1}, sharding={"targetShardBytes": 1 << 20, "chunkRows": 16},
                         batching={"sortByLength": False, "prefixOrder": False})
    p = subprocess.Popen([bij_bin("bij"), "run", str(spec)], env=worker_env(file_place), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while len(server.bodies) <= 32 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(server.bodies) > 32, "the first run never got past its first 32 rows"
        time.sleep(2)  # the two answered chunks commit
    finally:
        # bij and its worker, which leads a session of its own (as a pod's kill ends every process in it).
        for pid in [*worker_pids(layout.round_manifest_uri(job, 0)), p.pid]:
            os.kill(pid, signal.SIGKILL)
        p.wait()
    time.sleep(0.5)
    first = len(server.bodies)
    server.release.set()
    server.policy = lambda body, n, total: None
    rerun = subprocess.run([bij_bin("bij"), "run", str(spec)], env=worker_env(file_place), capture_output=True,
                           text=True, timeout=120)
    assert rerun.returncode == 0, rerun.stderr
    out = read_output(job)
    assert sorted(r["id"] for r in out.results) == list(range(100)) and out.errors == []
    durable = int(re.search(r"resuming after (\d+) durable records", rerun.stderr).group(1))  # type: ignore[union-attr]
    assert durable == 32
    resent = [row_key(b) for b in server.bodies[first:]]
    assert len(resent) == len(set(resent)) == 100 - durable  # each row not yet durable once, no other


def http_engine(server: FakeServer, task: str = "generate", **http: Any) -> HttpEngine:
    spec = parse_spec({"input": {"uri": "file:///in"}, "output": {"uri": "file:///out"},
                       "model": http_model(server, task, **http)})
    engine = create_engine("http", engine_config(spec))
    assert isinstance(engine, HttpEngine)
    return engine


def test_preflight_passes_when_v1_models_lists_the_served_model_and_sends_no_row(server: FakeServer) -> None:
    http_engine(server).load()
    assert len(server.gets) == 1 and server.bodies == []


def test_preflight_names_the_url_and_the_models_served_when_the_served_model_is_wrong(server: FakeServer) -> None:
    from bij.engines.http import ServerRefused

    server.models = ["other-model", "third"]
    with pytest.raises(ServerRefused, match=re.escape(f"{server.url}/v1/models does not list model.http.servedModel "
                                                      "'fleet-model'; it serves: other-model, third")):
        http_engine(server).load()
    assert server.bodies == []


@pytest.mark.parametrize(("status", "needle"), [
    (401, "answered 401: the credential"), (403, "answered 403: the credential"),
    (404, "answered 404: model.http.baseUrl or model.http.servedModel 'fleet-model' is wrong")])
def test_preflight_refuses_a_wrong_credential_or_base_url_naming_url_and_status(
        server: FakeServer, status: int, needle: str) -> None:
    from bij.engines.http import ServerRefused

    server.models = None  # a wrong baseUrl: nothing under it answers, POST neither
    server.get_verdict = (status, '{"error": "nope"}')
    server.policy = lambda body, n, total: (status, {}, '{"error": "nope"}')
    with pytest.raises(ServerRefused, match=re.escape(f"preflight: {server.url}/v1/") + ".*" + re.escape(needle)):
        http_engine(server).load()
    assert len(server.gets) == 1  # not retried


def test_preflight_without_a_model_list_sends_one_tiny_request(server: FakeServer) -> None:
    server.models = None
    http_engine(server, "chat").load()
    [body] = server.bodies
    assert server.paths == ["/v1/chat/completions"] and body["max_tokens"] == 1 and body["model"] == "fleet-model"


def test_preflight_retries_a_busy_server_then_says_it_is_unreachable_not_misconfigured(server: FakeServer) -> None:
    from bij.engines.http import ServerUnreachable

    server.get_verdict = (503, "warming up")
    with pytest.raises(ServerUnreachable, match=re.escape(f"{server.url}/v1/models answered 503 through 2 tries")):
        http_engine(server, retries=1).load()
    assert len(server.gets) == 2
    server.get_verdict = None
    http_engine(server, retries=1).load()  # up again: it passes


def test_bij_run_against_a_wrong_served_model_fails_fast_without_error_rows(
        server: FakeServer, file_place: Any, make_job: Any, worker_env: Any, bij_bin: Any) -> None:
    import subprocess

    server.models = ["the-real-model"]
    rows = [{"id": i, "text": f"row {i}"} for i in range(50)]
    spec, job = make_job(file_place, file_place.write_jsonl("in.jsonl", rows), model=http_model(server, "generate"))
    start = time.monotonic()
    done = subprocess.run([bij_bin("bij"), "run", str(spec)], env=worker_env(file_place), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0
    assert f"{server.url}/v1/models does not list model.http.servedModel 'fleet-model'" in done.stderr
    assert "bad configuration" in done.stderr
    assert server.bodies == []  # no row was sent, so none became an error row
    assert not file_place.storage.exists(file_place.uri("out/manifest.json"))
    assert time.monotonic() - start < 60


SLOW_SERVER = """
import json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        time.sleep(0.02)
        out = json.dumps({"choices": [{"text": "ok", "finish_reason": "stop"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

s = ThreadingHTTPServer(("127.0.0.1", 0), H)
s.daemon_threads = True
print(s.server_address[1], flush=True)
s.serve_forever()
"""


def test_a_lane_with_many_requests_waiting_spends_little_cpu_per_row() -> None:
    """Hundreds of rows submitted and a window of a few dozen: waiting rows cost no CPU (the next in line
    alone is woken), and neither do rows still unanswered when a step collects answers."""
    import subprocess
    import sys

    from bij.engines.base import Request

    proc = subprocess.Popen([sys.executable, "-c", SLOW_SERVER], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        url = f"http://127.0.0.1:{proc.stdout.readline().strip()}"
        spec = parse_spec({"input": {"uri": "file:///in"}, "output": {"uri": "file:///out"},
                           "model": {"engine": "http", "task": "generate", "name": "m",
                                     "http": {"baseUrl": url, "maxInFlight": 256}}})
        engine = create_engine("http", engine_config(spec))
        rows = 800
        cpu = time.process_time()
        results = engine.run([Request(text=f"r{i}") for i in range(rows)])
        cpu = time.process_time() - cpu
    finally:
        proc.kill()
        proc.wait()
    assert [r.output for r in results] == ["ok"] * rows
    assert cpu / rows < 0.0015, f"{cpu / rows * 1000:.2f} ms of CPU a row"


def test_connections_are_kept_alive_and_one_the_server_closed_while_idle_is_opened_again() -> None:
    """Rows reuse their thread's connection; a server that drops a kept connection without saying so (its
    keep-alive timeout) costs no row a retry or an error."""
    from bij.engines.base import Request

    connections: list[int] = []
    answered: Counter[str] = Counter()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            return None

        def setup(self) -> None:
            super().setup()
            connections.append(1)
            self.served = 0

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            answered[body["prompt"]] += 1
            out = json.dumps({"choices": [{"text": "re: " + body["prompt"], "finish_reason": "stop"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)
            self.served += 1
            self.close_connection = self.served % 3 == 0  # closed after the answer, unannounced

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        spec = parse_spec({"input": {"uri": "file:///in"}, "output": {"uri": "file:///out"},
                           "model": {"engine": "http", "task": "generate", "name": "m",
                                     "http": {"baseUrl": f"http://127.0.0.1:{httpd.server_address[1]}",
                                              "maxInFlight": 4, "retries": 0}}})
        results = create_engine("http", engine_config(spec)).run([Request(text=f"r{i}") for i in range(120)])
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert [r.output for r in results] == [f"re: r{i}" for i in range(120)]
    assert set(answered.values()) == {1}  # each row answered once, none failed on a dropped connection
    assert len(connections) <= 120 // 3 + 8  # a connection per three rows, not one per row


def test_rows_go_through_the_http_proxy_the_environment_names(server: FakeServer,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """As urllib honours HTTP_PROXY: the proxy (here the test server) gets each request with its absolute URL."""
    from bij.engines.base import Request

    monkeypatch.setenv("HTTP_PROXY", server.url)
    monkeypatch.setenv("http_proxy", server.url)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    spec = parse_spec({"input": {"uri": "file:///in"}, "output": {"uri": "file:///out"},
                       "model": {"engine": "http", "task": "generate", "name": "m",
                                 "http": {"baseUrl": "http://fleet.example:8000/gw"}}})
    results = create_engine("http", engine_config(spec)).run([Request(text="via proxy")])
    assert [r.output for r in results] == ["re: via proxy"]
    assert server.paths == ["http://fleet.example:8000/gw/v1/completions"]
