"""spec.notify: the signed POST of a job's end, its retries and its record, from the pure rules to `bij run`.

The webhook is a real HTTP server in a thread that answers 500 to its first attempts, then 200
(`webhook_receiver`)."""

from __future__ import annotations

import base64
import copy
import datetime as dt
import json
import socket
import time
from typing import Any

import pytest

from bij.contract import layout
from bij.contract import notify as contract
from bij.contract.spec import parse_job
from bij.contract.spec_base import SecretKeyRef
from bij.contract.status import JobStatus
from bij.control import notify
from bij.control.decisions import MarkFailed, Nothing
from bij.control.driver import Driver
from bij.control.driver_types import Observed

KEY = b"s3cret-hmac-key"
FAST = notify.Backoff(attempts=4, first_delay=0.05, max_delay=0.2, timeout=2.0)
NOW = dt.datetime(2026, 1, 1, 12, 0, tzinfo=dt.timezone.utc)


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/nobody-listens"


def a_job(*targets: dict[str, Any], labels: dict[str, str] | None = None, name: str = "emb") -> Any:
    return parse_job({"apiVersion": "batchinference.io/v1alpha1", "kind": "BatchInferenceJob",
                      "metadata": {"name": name, "namespace": "ml", "uid": "bij-uid", "labels": labels or {}},
                      "spec": {"input": {"uri": "file:///in/"}, "output": {"uri": "file:///out/"},
                               "notify": list(targets)}})


def target(url: str, *events: str, secret: str = "hooks") -> dict[str, Any]:
    out: dict[str, Any] = {"url": url, "secretRef": {"name": secret, "key": "hmac"}}
    if events:
        out["events"] = list(events)
    return out


SUCCEEDED = {"phase": "Succeeded", "round": 0, "message": "published 10 rows in 1 files (2 error rows) to file:///out/"
             "manifest.json", "rows": {"done": 10, "failed": 2}, "manifestUri": "file:///out/manifest.json",
             "completionTime": "2026-01-01T11:59:00Z", "outputUri": "file:///out/",
             "conditions": [{"type": "Succeeded", "status": "True", "reason": "Published", "message": "published"}]}


class EndedBackend:
    """A bij whose status is given (an ended one): status in memory, Events recorded, Secrets in a dict."""

    worker_image = steps_image = "img"
    file_volume = None

    def __init__(self, job: Any, status: dict[str, Any], secrets: dict[tuple[str, str], bytes] | None = None):
        self.job = job
        self.status = copy.deepcopy(status)
        self.events: list[tuple[str, str, str]] = []
        self.secrets = {("hooks", "hmac"): KEY} if secrets is None else secrets

    def observe(self) -> Observed:
        return Observed(job=self.job, spec_error=None, status=copy.deepcopy(self.status), generation=1,
                        output_uri=self.job.spec.output.uri, jobs=[])

    def write_status(self, patch: dict[str, Any]) -> None:
        from bij.local.run import merge_patch

        merge_patch(self.status, patch)

    def event(self, type_: str, reason: str, message: str) -> None:
        self.events.append((type_, reason, message))

    def notify_key(self, ref: SecretKeyRef) -> bytes:
        if (ref.name, ref.key) not in self.secrets:
            raise LookupError(f"Secret ml/{ref.name}: not found")
        return self.secrets[(ref.name, ref.key)]


def until_settled(driver: Driver, backend: EndedBackend, limit: float = 10.0) -> None:
    """Reconcile as the operator's daemon would: again when the driver asks to be woken."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        idle = driver.reconcile()
        if notify.settled(backend.job, JobStatus.read(backend.status)):
            return
        time.sleep(idle.recheck if idle.recheck is not None else 0.05)
    raise AssertionError(f"not settled: {backend.status.get('notified')}")


# --- the pure rules ------------------------------------------------------------------------------------


def test_the_backoff_doubles_from_the_first_delay_up_to_its_cap() -> None:
    b = notify.Backoff(attempts=8, first_delay=2, max_delay=30)
    assert [b.delay(n) for n in range(1, 7)] == [2, 4, 8, 16, 30, 30]


@pytest.mark.parametrize("phase, event, openai_type", [
    ("Succeeded", "succeeded", "batch.completed"),
    ("Failed", "failed", "batch.failed"),
    ("CanaryFailed", "canaryFailed", "batch.failed"),
    ("Cancelled", "cancelled", "batch.cancelled"),
    ("Expired", "expired", "batch.expired"),
    ("Running", None, None),
    ("Publishing", None, None),
    ("Cancelling", None, None),
])
def test_each_final_phase_is_one_event_and_one_openai_webhook_type(phase: str, event: str | None,
                                                                   openai_type: str | None) -> None:
    assert contract.event_of(phase) == event
    if event is not None:
        assert contract.OPENAI_TYPES[event] == openai_type


def test_only_the_webhooks_that_ask_for_the_event_are_due() -> None:
    job = a_job(target("https://a.example/x", "failed"), target("https://b.example/x"),
                target("https://c.example/x", "succeeded", "expired"))
    todo, wake = notify.due(job, JobStatus.read(SUCCEEDED), NOW)
    assert [d.target.url for d in todo] == ["https://b.example/x", "https://c.example/x"] and wake is None
    assert {d.event for d in todo} == {"succeeded"}
    running = {**SUCCEEDED, "phase": "Running"}
    assert notify.due(job, JobStatus.read(running), NOW) == ([], None)


def test_a_failed_attempt_is_due_again_after_its_backoff_and_given_up_after_the_last() -> None:
    job = a_job(target("https://a.example/x"))
    backoff = notify.Backoff(attempts=3, first_delay=10)
    (first,), _ = notify.due(job, JobStatus.read(SUCCEEDED), NOW)
    rec = notify.attempted(first.record, "HTTP 500 Internal Server Error", NOW, backoff)
    state = JobStatus.read({**SUCCEEDED, "notified": notify.merged(JobStatus.read(SUCCEEDED), [rec])})
    assert notify.due(job, state, NOW + dt.timedelta(seconds=9)) == ([], pytest.approx(1.0))
    (again,), _ = notify.due(job, state, NOW + dt.timedelta(seconds=10))
    assert again.record.attempts == 1
    rec = notify.attempted(notify.attempted(again.record, "HTTP 502", NOW, backoff), "HTTP 503", NOW, backoff)
    assert rec.gave_up and rec.attempts == 3 and rec.last_error == "HTTP 503" and rec.next_attempt_at is None
    given_up = JobStatus.read({**SUCCEEDED, "notified": notify.merged(state, [rec])})
    assert notify.due(job, given_up, NOW + dt.timedelta(days=1)) == ([], None) and notify.settled(job, given_up)


def test_the_body_carries_the_jobs_end_and_nothing_of_its_rows() -> None:
    job = a_job(target("https://a.example/x"))
    doc = json.loads(contract.body(job, JobStatus.read(SUCCEEDED), "succeeded", NOW))
    assert doc["type"] == "batch.completed" and doc["object"] == "event" and doc["data"] == {"id": "emb"}
    assert doc["created_at"] == int(dt.datetime(2026, 1, 1, 11, 59, tzinfo=dt.timezone.utc).timestamp())
    assert doc["bij"] == {"event": "succeeded", "name": "emb", "namespace": "ml", "uid": "bij-uid",
                          "phase": "Succeeded", "reason": None, "message": SUCCEEDED["message"],
                          "rows": {"done": 10, "failed": 2}, "manifestUri": "file:///out/manifest.json",
                          "outputUri": "file:///out/", "completionTime": "2026-01-01T11:59:00Z"}
    assert doc["id"] == contract.delivery_id(job, "succeeded") != contract.delivery_id(job, "failed")


def test_a_bij_api_batch_is_named_by_its_batch_id_as_openai_webhooks_name_it() -> None:
    job = a_job(target("https://a.example/x"), name="batch-0a1b2c",
                labels={"batchinference.io/openai-batch": "true"})
    failed = {**SUCCEEDED, "phase": "Failed", "conditions": [
        {"type": "Failed", "status": "True", "reason": "TooManyErrors", "message": "m"}]}
    doc = json.loads(contract.body(job, JobStatus.read(failed), "failed", NOW))
    assert doc["data"] == {"id": "batch_0a1b2c"} and doc["type"] == "batch.failed"
    assert doc["bij"]["reason"] == "TooManyErrors"


def test_the_signature_verifies_with_the_key_and_fails_with_another_key_a_changed_body_or_an_old_timestamp() -> None:
    payload = b'{"type":"batch.completed"}'
    sent = contract.headers(KEY, payload, "succeeded", "evt_1", 1_700_000_000)
    assert contract.verify(KEY, payload, sent, now=1_700_000_010)
    assert not contract.verify(b"other", payload, sent, now=1_700_000_010)
    assert not contract.verify(KEY, payload + b" ", sent, now=1_700_000_010)
    assert not contract.verify(KEY, payload, sent, now=1_700_000_000 + contract.TOLERANCE_SECONDS + 1)
    # The timestamp is signed too: moving it breaks the signature.
    assert not contract.verify(KEY, payload, {**sent, contract.TIMESTAMP_HEADER: "1700000005"}, now=1_700_000_010)


def test_openais_sdk_verifies_the_standard_webhook_headers_with_the_key_as_its_secret() -> None:
    openai = pytest.importorskip("openai")
    job = a_job(target("https://a.example/x"), name="batch-0a1b2c", labels={"batchinference.io/openai-batch": "true"})
    payload = contract.body(job, JobStatus.read(SUCCEEDED), "succeeded", NOW)
    sent = contract.headers(KEY, payload, "succeeded", contract.delivery_id(job, "succeeded"), int(time.time()))
    client = openai.OpenAI(api_key="unused", webhook_secret="whsec_" + base64.b64encode(KEY).decode())
    event = client.webhooks.unwrap(payload, sent)
    assert event.type == "batch.completed" and event.data.id == "batch_0a1b2c"
    with pytest.raises(openai.InvalidWebhookSignatureError):
        client.webhooks.unwrap(payload.replace(b"Succeeded", b"Failed"), sent)


def test_the_user_guides_verify_accepts_what_bij_sends_and_refuses_a_forgery() -> None:
    from pathlib import Path

    guide = (Path(__file__).resolve().parents[2] / "docs" / "user-guide.md").read_text()
    start = guide.index("```python", guide.index("Verify the raw body")) + len("```python")
    scope: dict[str, Any] = {}
    exec(guide[start:guide.index("```", start)], scope)  # the guide's own code, as a receiver would copy it
    payload = contract.body(a_job(target("https://a.example/x")), JobStatus.read(SUCCEEDED), "succeeded", NOW)
    sent = contract.headers(KEY, payload, "succeeded", "evt_1", int(time.time()))
    assert scope["verify"](KEY, payload, sent)
    assert not scope["verify"](b"guessed", payload, sent)
    assert not scope["verify"](KEY, payload.replace(b"Succeeded", b"Failed"), sent)


def test_bij_run_reads_the_key_from_an_environment_variable_named_after_the_secret_ref() -> None:
    assert notify.secret_env(SecretKeyRef(name="team-hooks", key="hmac.key")) == "BIJ_SECRET_TEAM_HOOKS_HMAC_KEY"


# --- through the driver -----------------------------------------------------------------------------------


def test_a_webhook_failing_its_first_attempts_is_told_once_signed_after_the_backoff(webhook) -> None:
    hook = webhook(fail_first=2)
    job = a_job(target(hook.url))
    backend = EndedBackend(job, SUCCEEDED)
    until_settled(Driver(backend, notify_backoff=FAST), backend)
    assert [code for _, _, code in hook.received] == [500, 500, 200]
    ((headers, payload),) = hook.delivered()
    assert contract.verify(KEY, payload, headers, now=time.time())
    assert json.loads(payload)["bij"]["phase"] == "Succeeded" and headers["X-Bij-Event"] == "succeeded"
    # Every attempt is the same delivery, so a receiver can drop one it has seen.
    assert {h["X-Bij-Delivery"] for h, _, _ in hook.received} == {contract.delivery_id(job, "succeeded")}
    (rec,) = JobStatus.read(backend.status).notified
    assert rec.url == hook.url and rec.event == "succeeded" and rec.attempts == 3 and rec.delivered_at
    assert [e[:2] for e in backend.events] == [("Normal", "Notified")]
    conditions = {c["type"]: c for c in backend.status["conditions"]}
    assert conditions["Notified"]["status"] == "True" and backend.status["phase"] == "Succeeded"
    # Asked again, and by an operator that restarted (a new driver over the same status): nothing is sent again.
    Driver(backend, notify_backoff=FAST).reconcile()
    Driver(backend, notify_backoff=FAST).reconcile()
    assert len(hook.received) == 3 and len(backend.events) == 1


def test_a_driver_woken_before_a_retry_is_due_sends_nothing_and_asks_to_be_woken_when_it_is(webhook) -> None:
    hook = webhook(fail_first=1)
    backend = EndedBackend(a_job(target(hook.url)), SUCCEEDED)
    driver = Driver(backend, notify_backoff=notify.Backoff(attempts=3, first_delay=30))
    first = driver.reconcile()
    assert len(hook.received) == 1 and first.recheck == pytest.approx(30, abs=1)
    again = driver.reconcile()  # woken early (a change, or a clock a little ahead)
    assert len(hook.received) == 1 and again.recheck is not None and 0 < again.recheck <= 30


def test_an_unreachable_webhook_ends_in_one_warning_and_a_condition_and_the_phase_stays(webhook) -> None:
    told = webhook()
    url = closed_port_url()
    job = a_job(target(url), target(told.url))
    backend = EndedBackend(job, SUCCEEDED)
    until_settled(Driver(backend, notify_backoff=FAST), backend)
    records = {r.url: r for r in JobStatus.read(backend.status).notified}
    assert records[url].gave_up and records[url].attempts == FAST.attempts and not records[url].delivered_at
    assert "Connection refused" in (records[url].last_error or "")
    assert records[told.url].delivered_at and len(told.received) == 1
    warnings = [e for e in backend.events if e[0] == "Warning"]
    assert [w[1] for w in warnings] == ["NotifyFailed"] and url in warnings[0][2]
    assert "the bij stays Succeeded" in warnings[0][2]
    condition = next(c for c in backend.status["conditions"] if c["type"] == "Notified")
    assert condition["status"] == "False" and condition["reason"] == "NotifyFailed" and url in condition["message"]
    assert backend.status["phase"] == "Succeeded"
    idle = Driver(backend, notify_backoff=FAST).reconcile()
    assert isinstance(idle.decision, Nothing) and idle.recheck is None and len(warnings) == 1


def test_a_missing_signing_key_is_a_failed_attempt_naming_the_secret_and_nothing_is_sent_unsigned(webhook) -> None:
    hook = webhook()
    job = a_job(target(hook.url, secret="absent"))
    backend = EndedBackend(job, SUCCEEDED)
    until_settled(Driver(backend, notify_backoff=FAST), backend)
    (rec,) = JobStatus.read(backend.status).notified
    assert rec.gave_up and rec.last_error == "no signing key: Secret ml/absent: not found"
    assert hook.received == []


def test_a_bij_that_fails_tells_its_webhook_in_the_same_reconcile(webhook) -> None:
    """The terminal transition itself (here MarkFailed: a step result this operator cannot read) sends the POST;
    no later change is needed to wake the driver."""
    from bij.contract.codes import GENERATION_LABEL, STEP_LABEL

    hook = webhook()
    job = a_job(target(hook.url, "failed"))
    name = "emb-plan-r0"
    status = {"reports": {"steps": {name: {"jobUid": "u1", "result": {"shardCount": 3}}}}}
    backend = EndedBackend(job, status)
    backend.observe = lambda: Observed(  # type: ignore[method-assign]
        job=job, spec_error=None, status=copy.deepcopy(backend.status), generation=1, output_uri="file:///out/",
        jobs=[{"metadata": {"name": name, "uid": "u1", "labels": {STEP_LABEL: "plan-r0", GENERATION_LABEL: "1"},
                            "ownerReferences": [{"uid": "bij-uid"}]},
               "spec": {}, "status": {"conditions": [{"type": "Complete", "status": "True"}]}}])
    idle = Driver(backend, notify_backoff=FAST).reconcile()
    assert isinstance(idle.decision, MarkFailed) and backend.status["phase"] == "Failed"
    ((headers, payload),) = hook.delivered()
    doc = json.loads(payload)
    assert doc["type"] == "batch.failed" and doc["bij"]["phase"] == "Failed"
    assert "its result cannot be read" in doc["bij"]["message"] and doc["bij"]["reason"] == "StepFailed"


def test_a_job_without_notify_never_reads_a_key_or_writes_notified() -> None:
    job = a_job()
    backend = EndedBackend(job, SUCCEEDED, secrets={})
    idle = Driver(backend).reconcile()
    assert isinstance(idle.decision, Nothing) and "notified" not in backend.status and backend.events == []


def test_the_operator_reads_the_key_from_the_named_secret_and_names_one_it_cannot_read() -> None:
    from kubernetes.client import ApiException, V1ObjectMeta, V1Secret

    from bij.control.backend import KubeBackend
    from bij.control.kube_api import Api

    class Core:
        def read_namespaced_secret(self, name: str, namespace: str) -> V1Secret:
            if name == "hooks":
                return V1Secret(metadata=V1ObjectMeta(name=name), data={"hmac": base64.b64encode(KEY).decode()})
            raise ApiException(status=403 if name == "theirs" else 404)

    api = object.__new__(Api)
    api.core = Core()  # type: ignore[assignment]
    backend = KubeBackend(api, "ml", "emb", jobs={}, worker_image="img")
    assert backend.notify_key(SecretKeyRef(name="hooks", key="hmac")) == KEY
    for ref, says in ((SecretKeyRef(name="hooks", key="other"), "Secret ml/hooks has no key other"),
                      (SecretKeyRef(name="gone", key="hmac"), "Secret ml/gone: not found"),
                      (SecretKeyRef(name="theirs", key="hmac"), "Secret ml/theirs: the operator may not read it")):
        with pytest.raises(LookupError, match=says):
            backend.notify_key(ref)


# --- bij run ------------------------------------------------------------------------------------------------


def test_bij_run_tells_the_webhook_before_it_exits_retrying_while_it_fails(webhook, file_place, make_job, worker_env,
                                                                           monkeypatch) -> None:
    from bij.local.run import LocalRunner

    hook = webhook(fail_first=1)
    rows = [{"id": i, "text": f"row {i}"} for i in range(20)]
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", rows),
                      notify=[{"url": hook.url, "secretRef": {"name": "team-hooks", "key": "hmac"}}])
    for k, v in worker_env(file_place).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("BIJ_SECRET_TEAM_HOOKS_HMAC", KEY.decode())
    runner = LocalRunner(job, show_progress=False, notify_backoff=FAST)
    assert runner.run() == 0
    assert [code for _, _, code in hook.received] == [500, 200]
    ((headers, payload),) = hook.delivered()
    assert contract.verify(KEY, payload, headers, now=time.time())
    doc = json.loads(payload)
    assert doc["type"] == "batch.completed" and doc["bij"]["rows"] == {"done": 20, "failed": 0}
    assert doc["bij"]["manifestUri"] == file_place.uri("out/manifest.json")
    assert "row 1" not in payload.decode()  # nothing of the rows themselves
    # A rerun takes the kept status up, the webhook's record with it: told once, as by an operator restarted.
    assert LocalRunner(job, show_progress=False, notify_backoff=FAST).run() == 0
    assert len(hook.received) == 2
    # Nor when the status was not kept (published by an older bij, or the file lost): the run that published
    # told the webhook before it ended; the rerun records it as not told again.
    file_place.storage.delete(layout.local_status_uri(job))
    assert LocalRunner(job, show_progress=False, notify_backoff=FAST).run() == 0
    assert len(hook.received) == 2
