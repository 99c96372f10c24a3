"""bij-api's webhooks: OpenAI's batch webhook events (batch.completed, ...) mapped onto each batch's spec.notify,
and the POST a batch's end sends read by OpenAI's own SDK."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from api_harness import Objects, Server, Tokens, serve_api, upload

from bij.api.batches import webhook_notify
from bij.api.files import FileStore
from bij.api.models import ModelMap
from bij.api.server import Api, parse_args
from bij.contract.spec import parse_job
from bij.control import notify

openai = pytest.importorskip("openai")

KEY = b"openai-style-webhook-key"


def test_openai_event_names_become_the_notify_events_they_stand_for() -> None:
    (target,) = webhook_notify([{"url": "https://hooks.example.com/openai", "secretRef": {"name": "wh", "key": "k"},
                                 "events": ["batch.failed", "batch.completed"]}], "webhooks.yaml")
    assert target["events"] == ["succeeded", "failed", "canaryFailed"]
    (every,) = webhook_notify([{"url": "https://hooks.example.com/openai", "secretRef": {"name": "wh", "key": "k"}}],
                              "webhooks.yaml")
    assert every["events"] == ["succeeded", "failed", "canaryFailed", "cancelled", "expired"]


@pytest.mark.parametrize("doc, says", [
    ({"url": "https://h.example/x", "secretRef": {"name": "wh", "key": "k"}, "events": ["batch.done"]},
     "webhooks.yaml[0].events: must be a non-empty list of batch.completed"),
    ({"url": "ftp://h.example/x", "secretRef": {"name": "wh", "key": "k"}},
     "webhooks.yaml[0].url: must be an http:// or https:// URL"),
    ({"url": "https://h.example/x"}, "webhooks.yaml[0].secretRef: Field required"),
])
def test_a_bad_webhook_entry_is_refused_at_start_naming_the_entry_and_field(doc: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError) as refused:
        webhook_notify([doc], "webhooks.yaml")
    assert str(refused.value).startswith(says)


def test_webhooks_come_from_a_file_named_by_a_flag_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BIJ_API_WEBHOOKS", "/etc/bij-api/webhooks.yaml")
    assert parse_args([]).webhooks == "/etc/bij-api/webhooks.yaml"


@pytest.fixture
def hooked_api(tmp_path: Path, worker_env: Any, webhook: Any) -> Iterator[tuple[Server, Any]]:
    hook = webhook(fail_first=1)
    env = {k: v for k, v in worker_env().items() if k in ("BIJ_TEST_HARNESS", "PYTHONPATH")}
    models = {"tiny-chat": {"model": {"engine": "echo"}, "workers": {"parallelism": 1, "env": env}}}
    targets = webhook_notify([{"url": hook.url, "secretRef": {"name": "openai-webhook", "key": "secret"},
                               "events": ["batch.completed"]}], "webhooks.yaml")
    api = Api(FileStore(f"file://{tmp_path}/files/"), ModelMap.parse(models, "models.yaml"), Tokens(),  # type: ignore[arg-type]
              Objects(), {}, targets)  # type: ignore[arg-type]
    for server in serve_api(api, tmp_path / "files"):
        yield server, hook


def test_a_completed_batch_tells_the_webhook_batch_completed_as_openais_sdk_reads_it(
        hooked_api: tuple[Server, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server, hook = hooked_api
    c = server.client
    lines = [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "tiny-chat", "messages": [{"role": "user", "content": f"row {i}"}]}} for i in range(6)]
    b = c.batches.create(input_file_id=upload(c, tmp_path, lines).id, endpoint="/v1/chat/completions",
                         completion_window="24h")
    (doc,) = server.objects.items.values()
    assert parse_job(doc).spec.notify[0].events == ["succeeded"]
    monkeypatch.setenv("BIJ_SECRET_OPENAI_WEBHOOK_SECRET", KEY.decode())
    assert server.run(b.id, notify_backoff=notify.Backoff(attempts=3, first_delay=0.05)) == 0
    assert [code for _, _, code in hook.received] == [500, 200]
    ((headers, payload),) = hook.delivered()
    verifier = openai.OpenAI(api_key="unused", webhook_secret="whsec_" + base64.b64encode(KEY).decode())
    event = verifier.webhooks.unwrap(payload, headers)
    assert event.type == "batch.completed" and event.data.id == b.id
    assert c.batches.retrieve(b.id).status == "completed"
    assert json.loads(payload)["bij"]["rows"] == {"done": 6, "failed": 0} and abs(event.created_at - time.time()) < 60
