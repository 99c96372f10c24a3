"""bij-api in this process, with the real `openai` SDK: each batch's bij is run by the operator's own
driver on local worker processes (`LocalRunner`, as `bij run` runs one), and its status, as the driver
writes it, is what the API server reads back. Tokens and the Kubernetes API are stand-ins here; the
same server on the real control plane, with the operator and TokenReview, is test_api.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from api_harness import KEY, NAMESPACE, Objects, Server, Tokens, lines_of, serve, serve_api, upload

from bij.api.auth import Caller, Forbidden
from bij.api.batches import bij_name
from bij.api.files import FileStore
from bij.api.models import ModelMap
from bij.api.server import Api
from bij.contract.spec import parse_job

openai = pytest.importorskip("openai")


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


def test_an_output_file_whose_manifest_lists_its_files_in_parts_is_the_one_it_lists_in_one_document(
        echo_api: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    c = echo_api.client
    lines = [chat(i) for i in range(80)]  # three shards of 6000 bytes: three result files
    served = {}
    for parts in ("", "1"):  # one document; then every file in a part of its own
        monkeypatch.setenv("BIJ_MANIFEST_PART_FILES", parts)
        b = c.batches.create(input_file_id=upload(c, tmp_path, lines).id, endpoint="/v1/chat/completions",
                             completion_window="24h")
        assert echo_api.run(b.id) == 0
        done = c.batches.retrieve(b.id)
        manifest = json.loads(Path(echo_api.objects.items[(NAMESPACE, bij_name(b.id))]["status"]["manifestUri"]
                                   .removeprefix("file://")).read_text())
        assert ("parts" in manifest) == bool(parts) and (parts or len(manifest["files"]) > 1)
        file = c.files.retrieve(done.output_file_id or "")
        out = lines_of(c, done.output_file_id or "")
        served[parts] = ([line["custom_id"] for line in out], [line["response"]["body"]["choices"] for line in out],
                         file.bytes)
    assert served[""] == served["1"] and len(served[""][0]) == 80


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


# --- every failure in OpenAI's error shape, with the status the SDK maps to its exception -------------------


class Failing(Objects):
    """The API server's stand-in, told what to raise next: `fail[verb]` is raised by that call."""

    def __init__(self) -> None:
        super().__init__()
        self.fail: dict[str, Exception] = {}
        self.calls: list[str] = []

    def _maybe(self, verb: str) -> None:
        self.calls.append(verb)
        if verb in self.fail:
            raise self.fail[verb]

    def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        self._maybe("get")
        return super().get(namespace, name)

    def create(self, namespace: str, doc: dict[str, Any]) -> dict[str, Any]:
        self._maybe("create")
        return super().create(namespace, doc)

    def list(self, namespace: str) -> list[dict[str, Any]]:
        self._maybe("list")
        return super().list(namespace)


class TwoTokens(Tokens):
    """`KEY` may use batches; "no-rbac" is a valid token whose identity may not."""

    def caller(self, header: str | None) -> Caller:
        if header == "Bearer no-rbac":
            raise Forbidden("system:serviceaccount:team-a:nobody may not create batchinferencejobs")
        return super().caller(header)


@dataclass
class Plain:
    server: Server
    api: Api
    objects: Failing


@pytest.fixture
def plain(tmp_path: Path) -> Iterator[Plain]:
    """bij-api whose Kubernetes stand-in and storage can be made to fail; no batch is ever run."""
    objects = Failing()
    api = Api(FileStore(f"file://{tmp_path}/files/"), ModelMap.parse({"tiny-chat": {"model": {"engine": "echo"}}},
                                                                     "models.yaml"),
              TwoTokens(), objects, {})  # type: ignore[arg-type]
    for server in serve_api(api, tmp_path / "files"):
        yield Plain(server, api, objects)


def shape(e: Any) -> dict[str, Any]:
    """The SDK's view of an error answer: `body` is the error object, checked to be OpenAI's shape."""
    assert set(e.body) == {"message", "type", "param", "code"} and e.body["message"], e.body
    return dict(e.body)


def multipart(parts: list[tuple[str, str | None, bytes]]) -> tuple[bytes, str]:
    """A multipart/form-data body with its parts in the order given: (name, filename or None, data)."""
    boundary = uuid.uuid4().hex
    out = b""
    for name, filename, data in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out += f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + data + b"\r\n"
    return out + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def raw(url: str, method: str, body: bytes = b"", content_type: str = "application/json",
        key: str = KEY) -> tuple[int, dict[str, str], dict[str, Any]]:
    req = urllib.request.Request(url, data=body if method != "GET" else None, method=method,
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def test_a_malformed_batch_body_is_a_400_naming_its_field(plain: Plain, tmp_path: Path) -> None:
    c = plain.server.client
    f = upload(c, tmp_path, [chat(0)])
    good = {"input_file_id": f.id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    cases = [
        ({k: v for k, v in good.items() if k != "input_file_id"}, "input_file_id", "missing_required_parameter"),
        ({k: v for k, v in good.items() if k != "endpoint"}, "endpoint", "missing_required_parameter"),
        ({**good, "input_file_id": 7}, "input_file_id", "invalid_value"),
        ({**good, "endpoint": "/v1/images"}, "endpoint", "invalid_value"),
        ({**good, "completion_window": 24}, "completion_window", "invalid_value"),
        ({**good, "completion_window": "soon"}, "completion_window", "invalid_value"),
        ({**good, "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "invalid_value"),
        ({**good, "metadata": {"team": 5}}, "metadata", "invalid_value"),
        ({**good, "priority": "high"}, "priority", "unknown_parameter"),
        ({**good, "output_expires_after": {"anchor": "created_at", "seconds": 3600}}, "output_expires_after",
         "invalid_value"),
        ({**good, "input_file_id": "file-" + "0" * 24}, "input_file_id", None),
    ]
    for body, param, code in cases:
        with pytest.raises(openai.BadRequestError) as e:
            c.post("/batches", body=body, cast_to=object)
        err = shape(e.value)
        assert (e.value.status_code, e.value.param, e.value.code, err["type"]) == \
            (400, param, code, "invalid_request_error"), (body, err)
        assert param in err["message"], err
    assert plain.objects.items == {}  # nothing refused was created
    for data in (b"{not json", b"[1, 2]", b'"a string"'):
        status, _, answer = raw(plain.server.url + "/v1/batches", "POST", data)
        assert status == 400 and answer["error"]["type"] == "invalid_request_error", answer
    status, _, answer = raw(plain.server.url + "/v1/batches", "POST", b'{"x": "' + b"a" * (2 << 20) + b'"}')
    assert (status, answer["error"]["code"]) == (413, "request_too_large"), answer
    assert c.batches.create(**good).status == "validating"  # type: ignore[arg-type]


def test_list_queries_and_upload_forms_are_parsed_and_a_wrong_one_is_a_400_naming_it(plain: Plain,
                                                                                     tmp_path: Path) -> None:
    c = plain.server.client
    for call, param in ((lambda: c.batches.list(limit=0), "limit"), (lambda: c.files.list(limit=101), "limit"),
                        (lambda: c.batches.list(extra_query={"limit": "many"}), "limit"),
                        (lambda: c.files.list(extra_query={"order": "sideways"}), "order"),
                        (lambda: c.batches.list(after="batch_0123"), "after")):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert (e.value.param, shape(e.value)["type"]) == (param, "invalid_request_error"), e.value.body
    line = (json.dumps(chat(0)) + "\n").encode()
    with pytest.raises(openai.BadRequestError) as e:
        c.files.create(file=("a.jsonl", line), purpose="fine-tune")
    assert (e.value.param, e.value.code) == ("purpose", "invalid_value") and "fine-tune" in e.value.message
    url = plain.server.url + "/v1/files"
    for parts, param, code in (([("file", "a.jsonl", line)], "purpose", "missing_required_parameter"),
                               ([("purpose", None, b"batch")], "file", "missing_required_parameter")):
        body, kind = multipart(parts)
        status, _, answer = raw(url, "POST", body, kind)
        assert (status, answer["error"]["param"], answer["error"]["code"]) == (400, param, code), answer
    status, _, answer = raw(url, "POST", b"{}")
    assert (status, answer["error"]["param"]) == (400, "file"), answer
    assert c.files.list().data == []  # nothing refused was kept
    first = upload(c, tmp_path, [chat(0)]).id
    upload(c, tmp_path, [chat(1)])
    assert [x.id for x in c.files.list(order="asc", limit=1).data] == [first]


def test_auth_routes_and_state_errors_are_the_sdks_exceptions(plain: Plain, tmp_path: Path) -> None:
    s = plain.server
    for key, cls, code in (("not-a-token", openai.AuthenticationError, "invalid_api_key"),
                           ("no-rbac", openai.PermissionDeniedError, "forbidden")):
        other = openai.OpenAI(base_url=s.url + "/v1", api_key=key, max_retries=0)
        with pytest.raises(cls) as e:
            other.batches.list()
        assert e.value.code == code and shape(e.value)["type"] in ("invalid_request_error", "permission_error")
    c = s.client
    for call in (lambda: c.batches.retrieve("batch_" + "0" * 24), lambda: c.files.retrieve("file-" + "0" * 24),
                 lambda: c.models.retrieve("gpt-99"), lambda: c.get("/nothing-here", cast_to=object)):
        with pytest.raises(openai.NotFoundError) as nf:
            call()
        assert shape(nf.value)["code"] == "not_found"
    with pytest.raises(openai.APIStatusError) as e:
        c.delete("/batches", cast_to=object)
    assert (e.value.status_code, e.value.code) == (405, "method_not_allowed") and "GET" in e.value.message
    assert e.value.response.headers["Allow"]
    # Cancelling a completed batch is a 409 the SDK is told not to retry: asking again changes nothing.
    b = c.batches.create(input_file_id=upload(c, tmp_path, [chat(0)]).id, endpoint="/v1/chat/completions",
                         completion_window="24h")
    plain.objects.items[(NAMESPACE, bij_name(b.id) or "")]["status"] = {"phase": "Succeeded"}
    gets = plain.objects.calls.count("get")
    with pytest.raises(openai.ConflictError) as conflict:
        c.with_options(max_retries=2).batches.cancel(b.id)
    assert shape(conflict.value)["code"] == "conflict" and "completed" in conflict.value.message
    assert conflict.value.response.headers["x-should-retry"] == "false"
    assert plain.objects.calls.count("get") == gets + 1


def _api_exception(status: int, message: str | None = None, headers: dict[str, str] | None = None) -> Exception:
    from kubernetes.client import ApiException

    e = ApiException(status=status, reason="Refused")
    e.body = json.dumps({"kind": "Status", "status": "Failure", "message": message, "code": status}) \
        if message else None
    e.headers = headers
    return e


def test_kubernetes_api_errors_are_a_400_with_its_message_or_a_retryable_503(plain: Plain, tmp_path: Path) -> None:
    from urllib3.exceptions import MaxRetryError

    c = plain.server.client
    f = upload(c, tmp_path, [chat(0)])
    create = {"input_file_id": f.id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    invalid = ('BatchInferenceJob.batchinference.io "batch-x" is invalid: spec.workers.gpus: Invalid value: 9: '
               "must be at most 8")
    for status, message in ((422, invalid), (403, 'exceeded quota: compute, requested: count/batchinferencejobs'),
                            (404, 'namespaces "team-a" not found'), (409, "already exists")):
        plain.objects.fail["create"] = _api_exception(status, message)
        with pytest.raises(openai.BadRequestError) as e:
            c.batches.create(**create)  # type: ignore[arg-type]
        assert message in shape(e.value)["message"] and e.value.code == "invalid_request", e.value.body
    plain.objects.fail["create"] = _api_exception(503, "etcdserver: leader changed")
    with pytest.raises(openai.InternalServerError) as down:
        c.batches.create(**create)  # type: ignore[arg-type]
    assert (down.value.status_code, down.value.code, shape(down.value)["type"]) == \
        (503, "kubernetes_unavailable", "service_unavailable_error")
    assert "leader changed" in down.value.message and down.value.response.headers["Retry-After"]
    del plain.objects.fail["create"]
    plain.objects.fail["list"] = MaxRetryError(None, "/apis", "connection refused")  # type: ignore[arg-type]
    with pytest.raises(openai.InternalServerError) as unreachable:
        c.batches.list()
    assert (unreachable.value.status_code, unreachable.value.code) == (503, "kubernetes_unavailable")
    plain.objects.fail["list"] = _api_exception(429, "too many requests", {"Retry-After": "2"})
    with pytest.raises(openai.RateLimitError) as throttled:
        c.batches.list()
    assert throttled.value.code == "rate_limit_exceeded" and throttled.value.response.headers["Retry-After"] == "2"
    plain.objects.fail["get"] = _api_exception(403, 'cannot get resource "batchinferencejobs"')
    with pytest.raises(openai.InternalServerError) as refused:
        c.batches.retrieve("batch_" + "0" * 24)
    assert (refused.value.status_code, refused.value.code) == (503, "kubernetes_refused")
    assert refused.value.response.headers["x-should-retry"] == "false"
    plain.objects.fail["list"] = KeyError("a bug")
    with pytest.raises(openai.InternalServerError) as bug:
        c.batches.list()
    assert (bug.value.status_code, shape(bug.value)["type"]) == (500, "server_error")
    assert "a bug" not in bug.value.message  # the cause is in the server's log, not the answer


def test_storage_outages_are_503_and_a_file_gone_from_storage_is_404(plain: Plain, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from bij.storage import StorageError, StorageRefused

    c = plain.server.client
    f = upload(c, tmp_path, [chat(0)])
    # Its bytes removed behind the server's back: the download is a 404, not a status then a broken body.
    (plain.server.files / NAMESPACE / "files" / f.id / "content.jsonl").unlink()
    with pytest.raises(openai.NotFoundError):
        c.files.content(f.id)
    store = plain.api.files.store
    for error, code, retry in ((StorageError("read s3://b/f: still failing after 5 attempts: reset"),
                                "storage_unavailable", None),
                               (StorageRefused("s3://b/f: access denied for key AKIA..."), "storage_refused",
                                "false")):
        def fail(*args: Any, _e: Exception = error, **kwargs: Any) -> Any:
            raise _e

        monkeypatch.setattr(store, "read_bytes", fail)
        monkeypatch.setattr(store, "list", fail)
        for call in (lambda: c.files.list(), lambda: c.files.retrieve(f.id),
                     lambda: c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                              completion_window="24h")):
            with pytest.raises(openai.InternalServerError) as e:
                call()
            assert (e.value.status_code, e.value.code, shape(e.value)["type"]) == \
                (503, code, "service_unavailable_error"), e.value.body
            assert e.value.response.headers.get("x-should-retry") == retry
        monkeypatch.setattr(store, "write_stream", fail)
        with pytest.raises(openai.InternalServerError) as up:
            upload(c, tmp_path, [chat(1)])
        assert (up.value.status_code, up.value.code) == (503, code)
