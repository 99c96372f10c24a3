"""bij-api with the real `openai` SDK, on the real control plane: the chart's bij-api pod (TokenReview,
SubjectAccessReview and its own RBAC on the real API server), the operator pod, worker pods of the
process kubelet.

Each test works in a namespace of its own with a service account allowed to create
batchinferencejobs there ("batcher") and one that is not ("nobody"); their TokenRequest tokens
are the API keys.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes
import pytest
from cluster import build_or_skip
from cluster.controlplane import free_port
from cluster.harness import OPERATOR_NAMESPACE, LocalCluster, add_worker_account, wait_for
from kubernetes.client import ApiException

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
HOOKS = ROOT / "tests" / "cluster" / "podhooks"
MODELS = ("tiny-chat", "tiny-completions", "tiny-embed")


@dataclass
class ApiCluster:
    cluster: LocalCluster
    url: str
    files: Path
    gates: Path

    @property
    def api(self) -> kubernetes.client.ApiClient:
        assert self.cluster.api is not None
        return self.cluster.api


def api_pid(port: int) -> int:
    """The bij-api process of the chart's pod (the process kubelet runs it here)."""
    for d in Path("/proc").iterdir():
        try:
            args = (d / "cmdline").read_bytes().split(b"\0") if d.name.isdigit() else []
        except OSError:
            continue
        if b"api" in args and f"--port={port}".encode() in args:
            return int(d.name)
    raise AssertionError(f"no bij-api process with --port={port}")


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


@pytest.fixture(scope="module")
def api_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiCluster]:
    build_or_skip()
    state = tmp_path_factory.mktemp("api-cluster")
    gates = state / "gates"
    gates.mkdir()
    pythonpath = os.pathsep.join(p for p in (str(HOOKS), os.environ.get("PYTHONPATH", "")) if p)
    workers = {"parallelism": 2, "backoffLimitPerIndex": 1, "terminationGracePeriodSeconds": 10,
               "env": {"PYTHONPATH": pythonpath, "BIJ_TEST_GATES": str(gates)}}
    sharding = {"targetShardBytes": 2048, "chunkRows": 8}
    models = {"tiny-chat": {"model": {"engine": "echo"}, "workers": workers, "sharding": sharding},
              "tiny-completions": {"model": {"engine": "echo"}, "workers": workers, "sharding": sharding},
              "tiny-embed": {"model": {"engine": "echo"}, "workers": workers, "sharding": sharding}}
    port = free_port()
    cluster = LocalCluster(state)
    try:
        cluster.start()
        cluster.install_operator(values={"extraArgs": ["--status-interval", "0.3"],
                                         "api": {"enabled": True, "port": port, "models": models,
                                                 "filesPrefix": f"file://{state}/files/"}})
        url = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            try:
                with urllib.request.urlopen(url + "/healthz", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        try:
            wait_for(healthy, 120, "bij-api answering /healthz")
        except TimeoutError:
            print(cluster.pod_logs(OPERATOR_NAMESPACE)[-4000:])
            raise
        yield ApiCluster(cluster, url, state / "files", gates)
    finally:
        cluster.stop()


@dataclass
class Tenant:
    ns: str
    client: Any  # openai.OpenAI as "batcher"
    token: str
    nobody: str  # a token without the RBAC
    core: kubernetes.client.CoreV1Api
    batch: kubernetes.client.BatchV1Api


def token(core: kubernetes.client.CoreV1Api, ns: str, sa: str) -> str:
    def ask() -> str | None:
        return str(core.create_namespaced_service_account_token(sa, ns, {"spec": {"expirationSeconds": 3600}})
                   .status.token)

    return wait_for(ask, 30, f"a token of {ns}/{sa}")


def make_tenant(env: ApiCluster) -> Tenant:
    ns = f"t-{uuid.uuid4().hex[:8]}"
    core = kubernetes.client.CoreV1Api(env.api)
    rbac = kubernetes.client.RbacAuthorizationV1Api(env.api)
    core.create_namespace({"metadata": {"name": ns}})
    wait_for(lambda: core.read_namespaced_service_account("default", ns), 30, "the namespace's default SA")
    add_worker_account(env.api, ns)  # a batch's pods run as bij-worker and report into its status
    for sa in ("batcher", "nobody"):
        core.create_namespaced_service_account(ns, {"metadata": {"name": sa}})
    rbac.create_namespaced_role(ns, {"metadata": {"name": "batches"}, "rules": [
        {"apiGroups": ["batchinference.io"], "resources": ["batchinferencejobs"], "verbs": ["create"]}]})
    rbac.create_namespaced_role_binding(ns, {
        "metadata": {"name": "batcher"}, "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                                     "name": "batches"},
        "subjects": [{"kind": "ServiceAccount", "name": "batcher", "namespace": ns}]})
    key = token(core, ns, "batcher")
    client = openai.OpenAI(base_url=env.url + "/v1", api_key=key, max_retries=0, timeout=120)
    # RBAC takes a moment to reach the authorizer's cache: the first batch call may be refused.
    def allowed() -> bool:
        try:
            return client.batches.list() is not None
        except openai.PermissionDeniedError:
            return False

    wait_for(allowed, 30, "the batcher's RBAC in effect")
    return Tenant(ns, client, key, token(core, ns, "nobody"), core, kubernetes.client.BatchV1Api(env.api))


@pytest.fixture()
def tenant(api_cluster: ApiCluster) -> Iterator[Tenant]:
    t = make_tenant(api_cluster)
    yield t
    (api_cluster.gates / "holdrow-all").unlink(missing_ok=True)
    try:
        t.core.delete_namespace(t.ns)
    except ApiException:
        pass


def chat_lines(n: int, model: str = "tiny-chat", hold: str = "") -> list[dict[str, Any]]:
    lines = []
    for i in range(n):
        text = f"row {i}: " + "lorem ipsum " * 3 + (hold if i == 0 else "")
        lines.append({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                      "body": {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 64}})
    return lines


def upload(client: Any, tmp: Path, lines: list[Any], name: str = "batch.jsonl") -> Any:
    path = tmp / name
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    with open(path, "rb") as f:
        return client.files.create(file=f, purpose="batch")


def wait_status(client: Any, batch_id: str, want: str, timeout: float = 240) -> Any:
    def reached() -> Any:
        b = client.batches.retrieve(batch_id)
        if b.status in ("completed", "failed", "expired", "cancelled") and b.status != want:
            raise AssertionError(f"batch {batch_id} ended {b.status} waiting for {want}: {b.errors}")
        return b if b.status == want else None

    return wait_for(reached, timeout, f"batch {batch_id} {want}", interval=0.5)


def lines_of(client: Any, file_id: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines() if line.strip()]


def check_output(lines: list[dict[str, Any]], model: Any) -> list[str]:
    """Every output line in OpenAI batch output shape, its body parsed by the SDK's own model."""
    ids = []
    for line in lines:
        assert line["error"] is None and line["response"]["status_code"] == 200
        model.model_validate(line["response"]["body"])
        ids.append(line["custom_id"])
    return ids


def first_job_seconds(t: Tenant, batch_id: str, started: float) -> float:
    name = "batch-" + batch_id[len("batch_"):] + "-r0"

    def made() -> bool:
        return any(j.metadata.name == name for j in t.batch.list_namespaced_job(t.ns).items)

    wait_for(made, 120, f"Job {name}", interval=0.05)
    return time.monotonic() - started


# --- the whole path ---------------------------------------------------------------------------------------


def test_a_chat_batch_runs_end_to_end_with_the_openai_sdk(tenant: Tenant, tmp_path: Path) -> None:
    from openai.types.chat import ChatCompletion

    c = tenant.client
    lines: list[Any] = chat_lines(40)
    lines.insert(5, "not json")
    lines.insert(9, {"custom_id": "bad-body", "method": "POST", "url": "/v1/chat/completions",
                     "body": {"model": "tiny-chat", "messages": "not a list"}})
    f = upload(c, tmp_path, lines)
    assert (f.purpose, f.status, f.bytes) == ("batch", "processed", (tmp_path / "batch.jsonl").stat().st_size)
    assert c.files.retrieve(f.id).id == f.id and f.id in [x.id for x in c.files.list()]
    assert c.files.content(f.id).content == (tmp_path / "batch.jsonl").read_bytes()

    started = time.monotonic()
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                         metadata={"team": "search"})
    seconds = first_job_seconds(tenant, b.id, started)
    print(f"\nbij-api: batches.create to the bij's first Job: {seconds:.2f} s")
    assert b.status in ("validating", "in_progress") and b.metadata == {"team": "search"}
    assert b.expires_at == b.created_at + 86400 and b.request_counts.total == 42

    done = wait_status(c, b.id, "completed")
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (42, 40, 2)
    assert done.completed_at and done.output_file_id and done.error_file_id
    assert done.in_progress_at <= done.finalizing_at <= done.completed_at
    out = lines_of(c, done.output_file_id)
    assert sorted(check_output(out, ChatCompletion)) == sorted(f"req-{i}" for i in range(40))
    assert all(line["response"]["body"]["choices"][0]["message"]["content"] for line in out)
    usage = [line["response"]["body"]["usage"] for line in out]
    assert done.usage is not None and (done.usage.input_tokens, done.usage.output_tokens) == \
        (sum(u["prompt_tokens"] for u in usage), sum(u["completion_tokens"] for u in usage))
    assert {line["response"]["body"]["model"] for line in out} == {"tiny-chat"}
    errors = lines_of(c, done.error_file_id)
    assert len(errors) == 2 and all(e["response"] is None and e["error"]["code"] for e in errors)
    assert "bad-body" in [e["custom_id"] for e in errors]
    assert c.files.retrieve(done.output_file_id).bytes == len(c.files.content(done.output_file_id).content)
    listed = c.batches.list(limit=10)
    assert [x.id for x in listed.data] == [b.id]


def test_embeddings_and_completions_batches_parse_with_the_sdk_models(tenant: Tenant, tmp_path: Path) -> None:
    from openai.types import Completion, CreateEmbeddingResponse

    c = tenant.client
    # Every third line has several inputs or prompts: still one line each, answered in one output line.
    emb = upload(c, tmp_path, [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
                                "body": {"model": "tiny-embed",
                                         "input": [f"text {i}", "more"] if i % 3 == 0 else f"text {i}"}}
                               for i in range(12)], "e.jsonl")
    cmp = upload(c, tmp_path, [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                                "body": {"model": "tiny-completions", "max_tokens": 8,
                                         "prompt": [f"say {i}", "and", "so"] if i % 3 == 0 else f"say {i}"}}
                               for i in range(12)], "c.jsonl")
    be = c.batches.create(input_file_id=emb.id, endpoint="/v1/embeddings", completion_window="24h")
    bc = c.batches.create(input_file_id=cmp.id, endpoint="/v1/completions", completion_window="24h")
    for b, model, n in ((be, CreateEmbeddingResponse, 12), (bc, Completion, 12)):
        done = wait_status(c, b.id, "completed")
        out = lines_of(c, done.output_file_id)
        assert len(check_output(out, model)) == n and done.error_file_id is None
        assert (done.request_counts.total, done.request_counts.completed) == (12, 12)
        items = [len(line["response"]["body"]["data" if model is CreateEmbeddingResponse else "choices"])
                 for line in out]
        assert sorted(items) == [1] * 8 + [2 if model is CreateEmbeddingResponse else 3] * 4
    # Paged newest first, as the SDK's cursor pagination walks it.
    first = c.batches.list(limit=1)
    assert first.has_more and [x.id for x in first.data] == [bc.id]
    assert [x.id for x in c.batches.list(limit=1, after=bc.id).data] == [be.id]
    assert [x.id for x in c.batches.list(limit=1)] == [bc.id, be.id]  # the SDK walks the pages


def test_a_responses_batch_is_answered_with_responses_objects_the_sdk_reads(tenant: Tenant, tmp_path: Path) -> None:
    from openai.types.responses import Response

    c = tenant.client
    f = upload(c, tmp_path, [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/responses",
                              "body": {"model": "tiny-chat", "input": f"say {i}", "instructions": "be brief",
                                       "max_output_tokens": 16}} for i in range(6)], "r.jsonl")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/responses", completion_window="24h")
    done = wait_status(c, b.id, "completed")
    out = lines_of(c, done.output_file_id)
    assert sorted(check_output(out, Response)) == [f"r{i}" for i in range(6)] and done.error_file_id is None
    assert all(Response.model_validate(line["response"]["body"]).output_text for line in out)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_a_cancelled_or_expired_batch_keeps_every_finished_row_once_and_counts_the_rest(
        api_cluster: ApiCluster, tenant: Tenant, tmp_path: Path, how: str) -> None:
    from openai.types.chat import ChatCompletion

    c = tenant.client
    needle = f"HOLD-{uuid.uuid4().hex[:8]}"
    (api_cluster.gates / "holdrow-all").write_text(needle)  # row 0's shard never finishes
    f = upload(c, tmp_path, chat_lines(60, hold=needle))
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                         completion_window="24h" if how == "cancel" else "20s")
    if how == "cancel":
        wait_for(lambda: c.batches.retrieve(b.id).request_counts.completed >= 20 or None, 180,
                 "rows done before the cancel", interval=0.5)
        cancelling = c.batches.cancel(b.id)
        assert cancelling.status == "cancelling" and cancelling.cancelling_at
    want = "cancelled" if how == "cancel" else "expired"
    done = wait_status(c, b.id, want)
    counts = done.request_counts
    # The requests never run are failed ones, each with OpenAI's line in the error file.
    assert counts.total == 60 and counts.completed + counts.failed == 60
    got = check_output(lines_of(c, done.output_file_id), ChatCompletion) if done.output_file_id else []
    assert len(got) == len(set(got)) == counts.completed and "req-0" not in got
    errors = lines_of(c, done.error_file_id)
    code = "batch_cancelled" if how == "cancel" else "batch_expired"
    assert len(errors) == counts.failed and all(e["response"] is None and e["error"]["code"] == code for e in errors)
    assert sorted(got + [e["custom_id"] for e in errors]) == sorted(f"req-{i}" for i in range(60))
    assert done.usage is not None and done.usage.input_tokens > 0  # the finished rows' tokens
    if how == "cancel":
        assert counts.completed >= 20 and done.cancelled_at and done.finalizing_at is None
    else:
        assert done.expired_at and done.expires_at == done.created_at + 20 and done.finalizing_at == done.expires_at
    # Stopped for good: releasing the held row changes nothing.
    (api_cluster.gates / "holdrow-all").unlink()
    again = c.batches.retrieve(b.id)
    assert again.status == want and again.request_counts == counts


# --- who may do what ---------------------------------------------------------------------------------------


def test_no_token_is_401_and_a_token_without_the_rbac_is_403(api_cluster: ApiCluster, tenant: Tenant) -> None:
    # The SDK always sends a key: without one, as plain HTTP.
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(api_cluster.url + "/v1/batches", timeout=30)
    assert e.value.code == 401 and "no bearer token" in json.loads(e.value.read())["error"]["message"]
    forged = openai.OpenAI(base_url=api_cluster.url + "/v1", api_key="not-a-token", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        forged.files.list()
    nobody = openai.OpenAI(base_url=api_cluster.url + "/v1", api_key=tenant.nobody, max_retries=0)
    with pytest.raises(openai.PermissionDeniedError, match="may not create batchinferencejobs"):
        nobody.batches.list()


def test_another_namespaces_batch_and_files_are_404(api_cluster: ApiCluster, tenant: Tenant, tmp_path: Path) -> None:
    c = tenant.client
    f = upload(c, tmp_path, chat_lines(4))
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    other = make_tenant(api_cluster)
    try:
        for call in (lambda: other.client.batches.retrieve(b.id), lambda: other.client.batches.cancel(b.id),
                     lambda: other.client.files.retrieve(f.id), lambda: other.client.files.content(f.id),
                     lambda: other.client.files.delete(f.id)):
            with pytest.raises(openai.NotFoundError):
                call()
        assert other.client.batches.list().data == [] and other.client.files.list().data == []
        with pytest.raises(openai.BadRequestError, match="no file"):
            other.client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    finally:
        other.core.delete_namespace(other.ns)
    wait_status(c, b.id, "completed")


def test_an_unknown_model_is_a_400_naming_the_known_ones(tenant: Tenant, tmp_path: Path) -> None:
    c = tenant.client
    f = upload(c, tmp_path, chat_lines(3, model="gpt-99"))
    with pytest.raises(openai.BadRequestError) as e:
        c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert "gpt-99" in str(e.value) and all(m in str(e.value) for m in MODELS)
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="soon")
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        c.batches.create(input_file_id=f.id, endpoint="/v1/images", completion_window="24h")  # type: ignore[arg-type]
    assert c.files.delete(f.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve(f.id)


def _multipart(parts: list[tuple[str, str | None, bytes]]) -> tuple[bytes, str]:
    """A multipart/form-data body with its parts in the order given: (name, filename or None, data)."""
    boundary = uuid.uuid4().hex
    out = b""
    for name, filename, data in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out += f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + data + b"\r\n"
    return out + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def _post(url: str, token: str, body: bytes, content_type: str) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, data=body, method="POST",
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_hostile_requests_get_openai_errors_and_a_refused_upload_keeps_nothing(
        api_cluster: ApiCluster, tenant: Tenant, tmp_path: Path) -> None:
    c = tenant.client
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve("file-" + "a" * 300)  # once a file system's ENAMETOOLONG, a 500
    with pytest.raises(openai.NotFoundError):
        c.files.content("file-../../etc/passwd")
    line = json.dumps(chat_lines(1)[0]).encode() + b"\n"
    for parts in ([("file", "a.jsonl", line), ("purpose", None, b"fine-tune")],
                  [("purpose", None, b"batch"), ("file", "a.jsonl", line), ("file", "b.jsonl", line)],
                  [("file", "a.jsonl", line)]):
        body, kind = _multipart(parts)
        status, answer = _post(api_cluster.url + "/v1/files", tenant.token, body, kind)
        assert status == 400 and answer["error"]["type"] == "invalid_request_error", answer
    assert [f.id for f in c.files.list()] == []  # nothing refused was kept
    status, answer = _post(api_cluster.url + "/v1/nothing-here", tenant.token, b"{}", "application/json")
    assert status == 404 and answer["error"]["code"] == "not_found", answer

    f = upload(c, tmp_path, chat_lines(3))
    with pytest.raises(openai.BadRequestError, match="unknown field priority") as e:
        c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                         extra_body={"priority": "high"})
    assert e.value.param == "priority"  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError, match="output_expires_after is not supported"):
        c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                         output_expires_after={"anchor": "created_at", "seconds": 3600})
    mixed = chat_lines(3)
    mixed[2]["url"] = "/v1/embeddings"
    g = upload(c, tmp_path, mixed, "mixed.jsonl")
    with pytest.raises(openai.BadRequestError, match="line 3 asks for /v1/embeddings, but the batch's endpoint is "
                                                     "/v1/chat/completions"):
        c.batches.create(input_file_id=g.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert c.batches.list().data == []


# --- memory ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_200_mb_file_uploads_and_downloads_with_the_servers_memory_flat(
        api_cluster: ApiCluster, tenant: Tenant, tmp_path: Path) -> None:
    c = tenant.client
    path = tmp_path / "big.jsonl"
    digest = hashlib.sha256()
    size = 0
    with open(path, "wb") as out:
        i = 0
        while size < 200 * 1024 * 1024:
            line = json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                               "body": {"model": "tiny-chat", "messages": [
                                   {"role": "user", "content": f"{i} " + "x" * 900}]}}).encode() + b"\n"
            out.write(line)
            digest.update(line)
            size += len(line)
            i += 1
    pid = api_pid(int(api_cluster.url.rsplit(":", 1)[1]))
    before = peak_rss_mib(pid)
    t0 = time.monotonic()
    with open(path, "rb") as f:
        up = c.files.create(file=f, purpose="batch")
    upload_s = time.monotonic() - t0
    assert up.bytes == size
    after_upload = peak_rss_mib(pid)
    got = hashlib.sha256()
    n = 0
    t0 = time.monotonic()
    with c.with_streaming_response.files.content(up.id) as resp:
        for chunk in resp.iter_bytes(1 << 20):
            got.update(chunk)
            n += len(chunk)
    download_s = time.monotonic() - t0
    assert n == size and got.hexdigest() == digest.hexdigest()
    after = peak_rss_mib(pid)
    print(f"\nbij-api peak RSS: {before:.1f} MiB before, {after_upload:.1f} MiB after a {size / 2**20:.0f} MiB upload "
          f"({upload_s:.1f} s), {after:.1f} MiB after its download ({download_s:.1f} s); {i} lines")
    # Flat: the server never holds the file; a few MiB of buffers, whatever the file's size.
    assert after - before < 40, (before, after_upload, after)


# --- RBAC: what the chart grants bij-api is exactly what it uses ------------------------------------------


def test_the_chart_rbac_of_bij_api_is_exactly_what_it_uses(api_cluster: ApiCluster, tenant: Tenant,
                                                           tmp_path: Path) -> None:
    core = kubernetes.client.CoreV1Api(api_cluster.api)
    pods = {p.metadata.name for p in core.list_namespaced_pod(
        OPERATOR_NAMESPACE, label_selector="app.kubernetes.io/component=api").items}
    c = tenant.client
    f = upload(c, tmp_path, chat_lines(3))
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    c.batches.list()
    c.batches.cancel(b.id)
    wait_status(c, b.id, "cancelled")

    audit = api_cluster.cluster.plane.audit_log
    entries = [json.loads(line) for line in audit.read_text().splitlines()]
    ours = [e for e in entries if set((e["user"].get("extra") or {}).get(
        "authentication.kubernetes.io/pod-name") or []) & pods]
    assert ours, f"no audit entries carry the bij-api pods' names {pods}"
    denied = sorted({(e["verb"], e["requestURI"]) for e in ours if e.get("responseStatus", {}).get("code") == 403})
    assert not denied, f"the API server refused bij-api: {denied}"
    used = {(e["objectRef"].get("apiGroup", ""), e["objectRef"]["resource"], e["verb"]) for e in ours
            if (e.get("objectRef") or {}).get("resource")}
    rbac = kubernetes.client.RbacAuthorizationV1Api(api_cluster.api)
    sa = next(iter(core.list_namespaced_pod(OPERATOR_NAMESPACE, label_selector="app.kubernetes.io/component=api")
                   .items)).spec.service_account_name
    granted: set[tuple[str, str, str]] = set()
    for binding in rbac.list_cluster_role_binding().items:
        if any(s.kind == "ServiceAccount" and s.name == sa for s in binding.subjects or []):
            for rule in rbac.read_cluster_role(binding.role_ref.name).rules or []:
                granted |= {(g, r, v) for g in rule.api_groups or [] for r in rule.resources or []
                            for v in rule.verbs or []}
    assert granted == used, f"granted but unused: {sorted(granted - used)}; used: {sorted(used)}"
