"""Models by hub id, for the engines that load through transformers and sentence-transformers.

Nothing here reaches the internet: a local HTTP server answers as the Hugging Face hub does
(``HF_ENDPOINT``) for a few repos made of local folders: the packaged all-MiniLM-L6-v2 and a
tiny random Llama built here. Workers run as subprocesses, because huggingface_hub reads its
endpoint and offline mode when it is imported.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import pytest

COMMIT = "0123456789abcdef0123456789abcdef01234567"
MINILM_ID = "bij-test/minilm"
LLAMA_ID = "bij-test/tiny-llama"


class FakeHub:
    """Repos (id -> folder) served with the hub's file API: HEAD/GET /<id>/resolve/<rev>/<path>,
    and /api/models/<id> for callers that ask what a repo holds. Every request is recorded."""

    def __init__(self, repos: dict[str, Path]):
        self.repos = repos
        self.requests: list[tuple[str, str]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_HEAD(self) -> None:
                hub.answer(self, body=False)

            def do_GET(self) -> None:
                hub.answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def files(self, repo: str) -> list[str]:
        root = self.repos[repo]
        return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())

    def downloaded(self) -> list[str]:
        return [path for method, path in self.requests if method == "GET" and "/resolve/" in path]

    def answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlparse(h.path).path)
        self.requests.append((h.command, path))
        headers = {"X-Repo-Commit": COMMIT}
        if path.startswith("/api/models/"):
            repo = next((r for r in self.repos if path[len("/api/models/"):].startswith(r)), None)
            if repo is None:
                return self.send(h, 404, b"", {"X-Error-Code": "RepoNotFound"}, body)
            rest = path[len(f"/api/models/{repo}"):]
            if rest.startswith("/tree/"):  # /tree/<rev>[/<folder>]: what the folder holds, or 404
                folder = rest[len("/tree/"):].partition("/")[2].strip("/")
                entries = [{"type": "file", "path": f, "size": (self.repos[repo] / f).stat().st_size,
                            "oid": hashlib.sha1((self.repos[repo] / f).read_bytes()).hexdigest()}
                           for f in self.files(repo) if not folder or f.startswith(folder + "/")]
                if not entries:
                    return self.send(h, 404, b"", {**headers, "X-Error-Code": "EntryNotFound"}, body)
                return self.send(h, 200, json.dumps(entries).encode(), {"Content-Type": "application/json"}, body)
            doc = {"id": repo, "modelId": repo, "sha": COMMIT, "private": False,
                   "siblings": [{"rfilename": f} for f in self.files(repo)]}
            return self.send(h, 200, json.dumps(doc).encode(), {"Content-Type": "application/json"}, body)
        repo = next((r for r in self.repos if path.startswith(f"/{r}/resolve/")), None)
        if repo is None:
            return self.send(h, 404, b"", {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"},
                             body)
        _, _, rest = path[len(f"/{repo}/resolve/"):].partition("/")  # drop the revision
        file = self.repos[repo] / rest
        if not rest or not file.is_file():
            return self.send(h, 404, b"", {**headers, "X-Error-Code": "EntryNotFound"}, body)
        data = file.read_bytes()
        etag = hashlib.sha256(data).hexdigest()
        return self.send(h, 200, data, {**headers, "ETag": f'"{etag}"', "Content-Type": "application/octet-stream"},
                         body)

    @staticmethod
    def send(h: BaseHTTPRequestHandler, code: int, data: bytes, headers: dict[str, str], body: bool) -> None:
        h.send_response(code)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from test_engines import build_model

    return build_model(tmp_path_factory.mktemp("tiny-llama"), wired=True)


@pytest.fixture(scope="module")
def hub(tiny_llama: Path) -> Iterator[FakeHub]:
    from bij.engines.sentence_transformers import default_model_path

    server = FakeHub({MINILM_ID: Path(default_model_path()), LLAMA_ID: tiny_llama})
    yield server
    server.close()


def hub_env(hub: FakeHub, cache: Path, *, offline: bool) -> dict[str, str]:
    """A worker's environment: the fake hub's endpoint, `cache` as HF_HOME, offline or not."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_", "SENTENCE_TRANSFORMERS"))}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(cache), HF_HUB_DISABLE_TELEMETRY="1", PYTHONUNBUFFERED="1")
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return env


LOAD = """
import json, sys
from bij.engines import create_engine
from bij.engines.base import EngineConfig, Request
engine, task, name = sys.argv[1:4]
e = create_engine(engine, EngineConfig(task=task, name=name, device="cpu"))
e.load()
(r,) = e.run([Request(text=sys.argv[4])])
print(json.dumps({"output": r.output, "embedding": r.embedding, "error": r.error}))
"""


def load_and_run(env: dict[str, str], engine: str, task: str, name: str, text: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", LOAD, engine, task, name, text], env=env, capture_output=True,
                          text=True, timeout=300)


def cached_repo(cache: Path, repo: str) -> Path:
    return cache / "hub" / ("models--" + repo.replace("/", "--"))


def test_a_sentence_transformers_hub_id_downloads_into_an_empty_cache_then_loads_offline(hub, tmp_path):
    cache = tmp_path / "cache"
    hub.requests.clear()
    p = load_and_run(hub_env(hub, cache, offline=False), "sentence-transformers", "embed", MINILM_ID, "a cat")
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout.strip().splitlines()[-1])["embedding"]
    assert "model.safetensors" in {Path(f).name for f in hub.downloaded()}
    assert (cached_repo(cache, MINILM_ID) / "snapshots" / COMMIT / "model.safetensors").exists()
    # The same vectors as the packaged copy loaded by path.
    from bij.engines.sentence_transformers import default_model_path

    p = load_and_run(hub_env(hub, tmp_path / "unused", offline=True), "sentence-transformers", "embed",
                     default_model_path(), "a cat")
    assert p.returncode == 0, p.stderr
    want = json.loads(p.stdout.strip().splitlines()[-1])["embedding"]
    assert len(got) == 384 and max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-5
    # Offline, the cache is enough: nothing is asked of the hub.
    hub.requests.clear()
    p = load_and_run(hub_env(hub, cache, offline=True), "sentence-transformers", "embed", MINILM_ID, "a cat")
    assert p.returncode == 0, p.stderr
    assert hub.requests == []


def test_a_transformers_hub_id_downloads_into_an_empty_cache(hub, tmp_path):
    cache = tmp_path / "cache"
    hub.requests.clear()
    p = load_and_run(hub_env(hub, cache, offline=False), "transformers", "generate", LLAMA_ID, "a")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.strip().splitlines()[-1])["output"] == "b c d e f g h"  # the wired chain after a
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {Path(f).name for f in hub.downloaded()}
    assert (cached_repo(cache, LLAMA_ID) / "snapshots" / COMMIT / "model.safetensors").exists()


@pytest.mark.parametrize("engine, task, repo", [("sentence-transformers", "embed", MINILM_ID),
                                                ("transformers", "generate", LLAMA_ID)])
def test_offline_with_an_empty_cache_fails_naming_the_model(hub, tmp_path, engine, task, repo):
    hub.requests.clear()
    p = load_and_run(hub_env(hub, tmp_path / "cache", offline=True), engine, task, repo, "a")
    assert p.returncode != 0
    assert "ModelUnavailable" in p.stderr and f"spec.model.name {repo!r}" in p.stderr, p.stderr
    assert "HF_HUB_OFFLINE" in p.stderr and str(tmp_path / "cache") in p.stderr
    assert hub.requests == []


def test_a_hub_id_the_hub_does_not_have_is_a_bad_configuration_not_an_outage(hub, tmp_path):
    p = load_and_run(hub_env(hub, tmp_path / "cache", offline=False), "transformers", "generate", "bij-test/nope", "a")
    assert p.returncode != 0
    assert "ModelUnavailable" in p.stderr and "'bij-test/nope'" in p.stderr and "does not exist" in p.stderr, p.stderr


@pytest.mark.slow
def test_bij_run_embeds_with_a_hub_id_downloaded_by_its_worker(hub, file_place, make_job, bij_bin, read_output,
                                                               tmp_path):
    rows = [{"id": i, "text": f"sentence number {i}"} for i in range(20)]
    spec, job = make_job(file_place, file_place.write_jsonl("in.jsonl", rows),
                         model={"engine": "sentence-transformers", "task": "embed", "name": MINILM_ID},
                         workers={"parallelism": 1})
    cache = tmp_path / "cache"
    offline = subprocess.run([bij_bin("bij"), "run", str(spec)], env=hub_env(hub, cache, offline=True),
                             capture_output=True, text=True, timeout=300)
    assert offline.returncode == 42, offline.stderr
    assert f"spec.model.name {MINILM_ID!r}" in offline.stderr
    p = subprocess.run([bij_bin("bij"), "run", str(spec)], env=hub_env(hub, cache, offline=False),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    out = read_output(job)
    assert [r["id"] for r in out.results] == list(range(20))
    assert all(len(r["embedding"]) == 384 for r in out.results)
