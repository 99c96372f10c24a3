"""bij-api in this process, with the real `openai` SDK: each batch's bij is run by the operator's own
driver on local worker processes (`LocalRunner`, as `bij run` runs one), and its status, as the driver
writes it, is what the API server reads back. Tokens and the Kubernetes API are stand-ins here; the
same server on the real control plane, with the operator and TokenReview, is test_api.py.
"""

from __future__ import annotations

import asyncio
import copy
import datetime as dt
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web
from cluster.controlplane import free_port

from bij.api.auth import Caller, Unauthenticated
from bij.api.batches import LABEL, bij_name
from bij.api.files import FileStore
from bij.api.models import ModelMap
from bij.api.server import Api
from bij.contract.spec import parse_job
from bij.local.run import LocalRunner, merge_patch

openai = pytest.importorskip("openai")

NAMESPACE = "team-a"
KEY = "a-service-account-token"


class Tokens:
    """One token, of one caller in `NAMESPACE` (TokenReview and SubjectAccessReview on a cluster)."""

    def caller(self, header: str | None) -> Caller:
        if header != f"Bearer {KEY}":
            raise Unauthenticated("not a token of this cluster")
        return Caller(user="system:serviceaccount:team-a:batcher", namespace=NAMESPACE)


class Objects:
    """The BatchInferenceJobs bij-api creates, kept as the API server keeps them."""

    def __init__(self) -> None:
        self.items: dict[tuple[str, str], dict[str, Any]] = {}

    def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        item = self.items.get((namespace, name))
        return copy.deepcopy(item) if item is not None else None

    def create(self, namespace: str, doc: dict[str, Any]) -> dict[str, Any]:
        doc = copy.deepcopy(doc)
        doc["metadata"]["creationTimestamp"] = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        self.items[(namespace, doc["metadata"]["name"])] = doc
        return copy.deepcopy(doc)

    def patch(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        merge_patch(self.items[(namespace, name)], patch)
        return copy.deepcopy(self.items[(namespace, name)])

    def list(self, namespace: str) -> list[dict[str, Any]]:
        return [copy.deepcopy(d) for (ns, _), d in self.items.items()
                if ns == namespace and LABEL in d["metadata"].get("labels", {})]


@dataclass
class Server:
    client: Any  # openai.OpenAI
    objects: Objects
    files: Path
    url: str

    def run(self, batch_id: str, **runner: Any) -> int:
        """Run the batch's bij to its end as the operator would (its driver, local worker processes),
        and keep the status the driver wrote on the object, where bij-api reads it."""
        name = bij_name(batch_id)
        assert name is not None
        doc = self.objects.items[(NAMESPACE, name)]
        local = LocalRunner(parse_job(doc), show_progress=False, **runner)
        code = local.run()
        doc["status"] = copy.deepcopy(local.backend.status)
        return code


def serve(models: dict[str, Any], files: Path) -> Iterator[Server]:
    objects = Objects()
    api = Api(FileStore(f"file://{files}/"), ModelMap.parse(models, "models.yaml"), Tokens(),  # type: ignore[arg-type]
              objects, {})  # type: ignore[arg-type]
    port = free_port()
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(api.app())
    started = threading.Event()

    def main() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    assert started.wait(30), "bij-api did not start"
    url = f"http://127.0.0.1:{port}"
    try:
        yield Server(openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60), objects, files, url)
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)


def upload(client: Any, tmp: Path, lines: list[dict[str, Any]]) -> Any:
    path = tmp / f"batch-{time.monotonic_ns()}.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with open(path, "rb") as f:
        return client.files.create(file=f, purpose="batch")


def lines_of(client: Any, file_id: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines() if line.strip()]


def durable_rows(job: Any) -> int:
    """Rows the bij's workers made durable so far (round 0's shard logs)."""
    from bij.contract import layout
    from bij.storage import open_storage
    from bij.storage.segments import object_records

    store = open_storage(job.spec.output.uri, None)
    prefix = layout.join(layout.round_prefix(job, 0), "shards") + "/"
    return sum(len(list(object_records(store, obj))) for obj in store.list(prefix))


def chat(i: int, model: str = "tiny-chat") -> dict[str, Any]:
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": f"row {i} " + "k" * (i * 7 % 90)}]}}


# --- the Batch object: usage, finalizing_at, expired and cancelled batches -------------------------------


@pytest.fixture
def echo_api(tmp_path: Path, worker_env: Any) -> Iterator[Server]:
    """bij-api with one chat model on the echo engine, slowed to 0.2 s a batch of 5 rows."""
    slow = worker_env(echo_delay=0.2)
    env = {k: slow[k] for k in ("BIJ_TEST_HARNESS", "BIJ_TEST_ECHO_DELAY", "PYTHONPATH")}
    models = {"tiny-chat": {"model": {"engine": "echo"}, "batching": {"maxBatchSize": 5},
                            "sharding": {"targetShardBytes": 6000, "chunkRows": 10},
                            "workers": {"parallelism": 2, "backoffLimitPerIndex": 0, "env": env}}}
    yield from serve(models, tmp_path / "files")


def test_a_completed_batch_has_its_usage_and_when_it_finalized(echo_api: Server, tmp_path: Path) -> None:
    c = echo_api.client
    lines = [chat(i) for i in range(20)]
    b = c.batches.create(input_file_id=upload(c, tmp_path, lines).id, endpoint="/v1/chat/completions",
                         completion_window="24h")
    assert b.usage is None and b.finalizing_at is None
    assert echo_api.run(b.id) == 0
    done = c.batches.retrieve(b.id)
    assert done.status == "completed" and done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (20, 20, 0)
    assert done.finalizing_at is not None and done.completed_at is not None
    assert done.created_at <= done.in_progress_at <= done.finalizing_at <= done.completed_at  # type: ignore[operator]
    out = lines_of(c, done.output_file_id or "")
    # The usage is the sum of the result lines' own, as OpenAI's is.
    prompt = sum(line["response"]["body"]["usage"]["prompt_tokens"] for line in out)
    completion = sum(line["response"]["body"]["usage"]["completion_tokens"] for line in out)
    assert done.usage is not None and prompt > 0 and completion > 0
    assert (done.usage.input_tokens, done.usage.output_tokens, done.usage.total_tokens) == \
        (prompt, completion, prompt + completion)
    assert done.usage.input_tokens_details.cached_tokens == 0  # the echo engine has no prefix cache
    assert done.usage.output_tokens_details.reasoning_tokens == 0
    assert [x.usage for x in c.batches.list().data] == [done.usage]
    # The model the results report is the one the lines named, not the engine's path.
    assert {line["response"]["body"]["model"] for line in out} == {"tiny-chat"}


def test_an_expired_batch_writes_each_request_never_run_as_batch_expired(echo_api: Server, tmp_path: Path) -> None:
    c = echo_api.client
    lines = [chat(i) for i in range(1000)]
    # 0.2 s a batch of 5: 1000 rows take about 20 s in two lanes; the window ends long before that.
    b = c.batches.create(input_file_id=upload(c, tmp_path, lines).id, endpoint="/v1/chat/completions",
                         completion_window="8s")
    assert echo_api.run(b.id) != 0
    done = c.batches.retrieve(b.id)
    assert done.status == "expired" and done.expired_at and done.expires_at == done.created_at + 8
    assert done.finalizing_at == done.expires_at and done.request_counts is not None
    counts = done.request_counts
    assert counts.total == 1000 and counts.completed + counts.failed == 1000 and 0 < counts.completed < 1000
    ok = [line["custom_id"] for line in lines_of(c, done.output_file_id or "")]
    errors = lines_of(c, done.error_file_id or "")
    assert len(ok) == counts.completed and len(errors) == counts.failed
    expired = {"code": "batch_expired", "message": "This request could not be executed before the completion window "
                                                   "expired."}
    assert all(e["response"] is None and e["error"] == expired for e in errors)
    assert sorted(ok + [e["custom_id"] for e in errors]) == sorted(line["custom_id"] for line in lines)
    assert done.usage is not None and done.usage.input_tokens > 0 and done.usage.output_tokens > 0


def test_a_cancelled_batch_writes_each_request_never_run_as_batch_cancelled(echo_api: Server, tmp_path: Path,
                                                                           bij_bin: Any) -> None:
    c = echo_api.client
    lines = [chat(i) for i in range(240)]
    b = c.batches.create(input_file_id=upload(c, tmp_path, lines).id, endpoint="/v1/chat/completions",
                         completion_window="24h")
    # The bij runs a while (bij run, stopped with Ctrl-C once rows are durable), then is cancelled.
    name = bij_name(b.id)
    spec = tmp_path / "bij.yaml"
    spec.write_text(yaml.safe_dump(echo_api.objects.items[(NAMESPACE, name or "")]))
    run = subprocess.Popen([bij_bin("bij"), "run", str(spec)], env=dict(os.environ), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    job = parse_job(echo_api.objects.items[(NAMESPACE, name or "")])
    deadline = time.monotonic() + 120
    while durable_rows(job) < 20:
        assert run.poll() is None and time.monotonic() < deadline, "bij run made no progress"
        time.sleep(0.1)
    os.killpg(run.pid, signal.SIGINT)
    run.communicate(timeout=60)
    cancelling = c.batches.cancel(b.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at
    assert echo_api.run(b.id) != 0
    done = c.batches.retrieve(b.id)
    assert done.status == "cancelled" and done.cancelled_at and done.finalizing_at is None
    counts = done.request_counts
    assert counts is not None and counts.completed + counts.failed == 240 and 0 < counts.completed < 240
    errors = lines_of(c, done.error_file_id or "")
    assert len(errors) == counts.failed and all(
        e["response"] is None and e["error"]["code"] == "batch_cancelled" for e in errors)
    ok = [line["custom_id"] for line in lines_of(c, done.output_file_id or "")]
    assert sorted(ok + [e["custom_id"] for e in errors]) == sorted(line["custom_id"] for line in lines)


# --- a LoRA adapter through bij-api ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    pytest.importorskip("peft")
    from byte_model import build_byte_model, build_lora

    base = build_byte_model(tmp_path_factory.mktemp("base"))
    return (base, build_lora(base, tmp_path_factory.mktemp("fr"), seed=1),
            build_lora(base, tmp_path_factory.mktemp("de"), seed=2))


@pytest.fixture
def lora_api(tmp_path: Path, lora_models: tuple[Path, Path, Path]) -> Iterator[Server]:
    base, fr, de = lora_models
    workers = {"parallelism": 1, "backoffLimitPerIndex": 0, "env": {"HF_HUB_OFFLINE": "1"}}
    models = {"tiny-gen": {"model": {"engine": "transformers", "name": str(base), "maxTokens": 12,
                                     "adapters": [{"name": "tiny-gen-fr", "uri": f"file://{fr}"},
                                                  {"name": "tiny-gen-de", "uri": f"file://{de}"}]},
                           "workers": workers},
              "other": {"model": {"engine": "echo"}}}
    yield from serve(models, tmp_path / "files")


def completion(cid: str, model: str) -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions",
            "body": {"model": model, "prompt": "the quick", "max_tokens": 12}}


def test_lines_naming_an_adapter_run_on_it_and_lines_naming_the_model_on_its_base(
        lora_api: Server, lora_models: tuple[Path, Path, Path], tmp_path: Path) -> None:
    from bij.engines.base import EngineConfig, Request
    from bij.engines.transformers import TransformersEngine

    c = lora_api.client
    listed = {m.id: getattr(m, "parent", None) for m in c.models.list()}
    assert listed == {"tiny-gen": None, "tiny-gen-fr": "tiny-gen", "tiny-gen-de": "tiny-gen", "other": None}
    assert c.models.retrieve("tiny-gen-fr").id == "tiny-gen-fr"
    lines = [completion("b", "tiny-gen"), completion("f", "tiny-gen-fr"), completion("d", "tiny-gen-de"),
             completion("f2", "tiny-gen-fr")]
    b = c.batches.create(input_file_id=upload(c, tmp_path, lines).id, endpoint="/v1/completions",
                         completion_window="24h")
    assert b.model == "tiny-gen"
    assert lora_api.run(b.id) == 0
    done = c.batches.retrieve(b.id)
    assert done.status == "completed" and done.error_file_id is None
    bodies = {line["custom_id"]: line["response"]["body"] for line in lines_of(c, done.output_file_id or "")}
    assert {k: body["model"] for k, body in bodies.items()} == \
        {"b": "tiny-gen", "f": "tiny-gen-fr", "d": "tiny-gen-de", "f2": "tiny-gen-fr"}
    text = {k: body["choices"][0]["text"] for k, body in bodies.items()}
    # Each line answered as its adapter (or the base model) alone answers the prompt.
    base, fr, de = lora_models
    engine = TransformersEngine(EngineConfig(task="generate", name=str(base), device="cpu",
                                             adapters={"tiny-gen-fr": str(fr), "tiny-gen-de": str(de)}))
    engine.load()
    alone = {a: engine.run([Request(text="the quick", max_tokens=12, adapter=a)])[0].output
             for a in (None, "tiny-gen-fr", "tiny-gen-de")}
    assert text == {"b": alone[None], "f": alone["tiny-gen-fr"], "d": alone["tiny-gen-de"],
                    "f2": alone["tiny-gen-fr"]}
    assert len(set(alone.values())) == 3


def test_a_line_naming_no_served_model_or_another_models_adapter_is_refused_at_creation(
        lora_api: Server, tmp_path: Path) -> None:
    c = lora_api.client
    unknown = upload(c, tmp_path, [completion("a", "tiny-gen"), completion("b", "tiny-gen-es")])
    with pytest.raises(openai.BadRequestError) as e:
        c.batches.create(input_file_id=unknown.id, endpoint="/v1/completions", completion_window="24h")
    assert "line 2 names model 'tiny-gen-es'" in str(e.value) and "tiny-gen-fr" in str(e.value)
    assert e.value.body["param"] == "model"  # type: ignore[index]
    mixed = upload(c, tmp_path, [completion("a", "tiny-gen-fr"), completion("b", "other")])
    with pytest.raises(openai.BadRequestError, match="line 2 names 'other'"):
        c.batches.create(input_file_id=mixed.id, endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("tiny-gen-es")
    assert lora_api.objects.items == {}  # nothing was created
