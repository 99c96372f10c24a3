"""bij-api in this process for the `openai` SDK to call: stand-ins for tokens and the Kubernetes API,
and a server whose batches the operator's own driver runs on local worker processes (`LocalRunner`).
tests/api/test_api_local.py and the vLLM tier (tests/engines/test_vllm.py) use it."""

from __future__ import annotations

import asyncio
import copy
import datetime as dt
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from ports import free_port

from bij.api.auth import Caller, Unauthenticated
from bij.api.batches import LABEL, bij_name
from bij.api.files import FileStore
from bij.api.models import ModelMap
from bij.api.server import Api
from bij.contract.spec import parse_job
from bij.local.run import LocalRunner, merge_patch

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
    yield from serve_api(api, files)


def serve_api(api: Api, files: Path) -> Iterator[Server]:
    """`api` on a free port of this host, in a thread of its own, for the SDK to call."""
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
        import openai

        yield Server(openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60),
                     api.kube, files, url)  # type: ignore[arg-type]
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
