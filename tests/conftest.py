"""Shared fixtures: where a test's data lives (file:// or the S3 server), datasets, specs, published output.

- `s3_service`, `s3_endpoint`: versitygw (a real S3 server, `make s3-bin`) on 127.0.0.1, one per
  session, its root account's credentials in the AWS_* environment, so boto3 never looks further;
  `s3_service.add_user(name)` makes another identity. moto stands in where versitygw is not built
  (outside CI only; the report header says which).
- `file_place`, `s3_place`, `place` (both): a fresh folder or bucket prefix, with its
  `Storage`, the spec's `storage` block and the environment a worker subprocess needs;
  `s3_tenant`: a new identity of the S3 server with a bucket of its own (versitygw only).
- `make_job`: write a BatchInferenceJob YAML (echo engine by default) and load it.
- `read_output`: the published manifest, checked against its files (rows, sha256),
  and every result and error row; `log_lines`: a round's raw durable records per shard.
- `publish_doc`: publish (the typed `publish_manifest`) and read back manifest.json as written.
- `run_shards`: plan round 0 and work its shards in this process (`recording_echo`:
  the echo engine, recording what it ran).
- `bij_bin`, `worker_env`: the environment for real `bij` / `bij-worker` subprocesses, with an
  optional test harness (see `_HARNESS`) that counts rows the echo engine computes,
  slows it down, fails a segment upload, caps S3 retries or fills the disk — the production code
  has no test hooks.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import azureserver
import pytest
import s3server
import yaml
import zstandard

VENV_BIN = Path(sys.executable).parent


def pytest_report_header(config: pytest.Config) -> str:
    exe = s3server.binary()
    if exe is not None:
        return f"S3 server: versitygw {s3server.VERSION} ({exe})"
    return ("S3 server: moto, an emulator (no versitygw: `make s3-bin` builds it, needs Go); tests that need real "
            "identities are skipped")


@dataclass
class S3Service:
    """The S3 server of the session: `endpoint`, `kind` ("versitygw", or "moto" where versitygw is not built
    outside CI), `root` (the identity in the AWS_* environment) and, on versitygw, `server` for more identities."""

    endpoint: str
    kind: str
    root: s3server.Identity
    server: s3server.S3Server | None = None

    def add_user(self, name: str) -> s3server.Identity:
        """A new identity the server knows (role user: only its own buckets); skips the test on moto, which
        checks no signature or permission."""
        if self.server is None:
            pytest.skip("needs real S3 identities: versitygw is not built (make s3-bin)")
        return self.server.add_user(name)

    def give_bucket(self, bucket: str, owner: s3server.Identity) -> None:
        assert self.server is not None
        self.server.give_bucket(bucket, owner)


@pytest.fixture(scope="session")
def s3_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Service]:
    """versitygw (built by `make s3-bin`) on 127.0.0.1, one per session; its root account's credentials are set
    in the AWS_* environment for the whole session, so boto3 never looks further. Without versitygw: moto's
    server, outside CI only (CI must test against the real server)."""
    exe = s3server.binary()
    if exe is None and os.environ.get("CI") == "true":
        pytest.fail("CI must run the S3 tests on versitygw: `make s3-bin` did not build it (is Go installed?)")
    server: s3server.S3Server | None = None
    moto: Any = None
    if exe is not None:
        server = s3server.S3Server(exe, tmp_path_factory.mktemp("versitygw"))
        root = server.root
    else:
        root = s3server.Identity("testing", "testing")
    env = {
        **root.env(), "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    saved = {k: os.environ.get(k) for k in [*env, "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL"]}
    os.environ.update(env)
    for k in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL"):
        os.environ.pop(k, None)
    try:
        if server is not None:
            server.start()
            service = S3Service(server.endpoint, "versitygw", root, server)
        else:
            from moto.server import ThreadedMotoServer

            port = s3server.free_port()  # moto's server takes it right after
            moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
            moto.start()
            service = S3Service(f"http://127.0.0.1:{port}", "moto", root)
        yield service
    finally:
        if server is not None:
            server.stop()
        if moto is not None:
            moto.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def s3_endpoint(s3_service: S3Service) -> str:
    """The session's S3 server (see `s3_service`)."""
    return s3_service.endpoint


@dataclass
class Place:
    """Where a test's input and output live: a file:// folder, or a prefix in a fresh bucket of the S3 server."""

    scheme: str
    base: str  # ends with "/"
    endpoint: str | None = None
    _storage: Any = field(default=None, repr=False)

    def uri(self, *parts: str) -> str:
        """A URI under the base; a trailing slash (a folder) is kept."""
        return self.base + "/".join(p.strip("/") for p in parts) + ("/" if parts and parts[-1].endswith("/") else "")

    @property
    def storage(self) -> Any:
        if self._storage is None:
            from bij.storage import open_storage

            self._storage = open_storage(self.base, {"endpointUrl": self.endpoint} if self.endpoint else None)
        return self._storage

    @property
    def spec_storage(self) -> dict[str, Any]:
        """The spec's `storage` block for this place (gs:// has no spec setting: its endpoint is GCS's)."""
        return {"s3": {"endpointUrl": self.endpoint}} if self.endpoint and self.scheme == "s3" else {}

    def env(self) -> dict[str, str]:
        """What a worker subprocess needs to reach this place (the Job sets the same for a pod)."""
        if not self.endpoint:
            return {}
        if self.scheme == "gs":  # the stand-in checks the region V4 signs with (GCS takes "auto")
            return {"BIJ_GCS_ENDPOINT_URL": self.endpoint, "BIJ_GCS_REGION": "us-east-1"}
        if self.scheme == "az":  # the account and its key, as the Azure CLI reads them
            return {"AZURE_STORAGE_ACCOUNT": azureserver.ACCOUNT, "AZURE_STORAGE_KEY": azureserver.KEY,
                    "AZURE_STORAGE_BLOB_ENDPOINT": self.endpoint}
        return {"AWS_ENDPOINT_URL": self.endpoint}

    def write_jsonl(self, name: str, rows: list[Any], *, zst: bool = False) -> str:
        """Write rows (dicts are JSON-encoded, str/bytes are written as the raw line) and return the URI."""
        data = b"".join(_line(r) for r in rows)
        if zst:
            data = zstandard.ZstdCompressor().compress(data)
        uri = self.uri(name)
        self.storage.write_bytes(uri, data)
        return uri


def _line(row: Any) -> bytes:
    if isinstance(row, bytes):
        return row if row.endswith(b"\n") else row + b"\n"
    if isinstance(row, str):
        return (row if row.endswith("\n") else row + "\n").encode()
    return json.dumps(row, ensure_ascii=False).encode() + b"\n"


@pytest.fixture
def file_place(tmp_path: Path) -> Place:
    (tmp_path / "data").mkdir()
    return Place("file", f"file://{tmp_path}/data/")


@pytest.fixture
def s3_place(s3_endpoint: str) -> Place:
    import boto3

    bucket = f"bij-test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=bucket)
    return Place("s3", f"s3://{bucket}/data/", s3_endpoint)


@pytest.fixture
def gs_place(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Place:
    """A gs:// place: GCS's XML API is S3's, so the session's S3 server stands in for storage.googleapis.com
    (BIJ_GCS_ENDPOINT_URL points gs:// there, as it may point to a private GCS endpoint; versitygw checks the
    signing region, which BIJ_GCS_REGION sets)."""
    import boto3

    bucket = f"bij-gcs-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=bucket)
    place = Place("gs", f"gs://{bucket}/data/", s3_endpoint)
    for k, v in place.env().items():
        monkeypatch.setenv(k, v)
    return place


@pytest.fixture(scope="session")
def az_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[azureserver.Azurite]:
    """Azurite's Blob service (`make azure-bin`), one per session; skipped without it, except in CI."""
    exe = azureserver.binary()
    if exe is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI must run the az:// tests on Azurite: `make azure-bin` did not install it (is npm there?)")
        pytest.skip("needs Azurite, the Azure Blob emulator: make azure-bin (needs npm)")
    server = azureserver.Azurite(exe, tmp_path_factory.mktemp("azurite"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def az_place(az_service: azureserver.Azurite, monkeypatch: pytest.MonkeyPatch) -> Place:
    """An az:// place: a fresh container of the session's Azurite, its account in this test's environment."""
    container = f"bij-test-{uuid.uuid4().hex[:12]}"
    azureserver.create_container(az_service.endpoint, container)
    place = Place("az", f"az://{container}/data/", az_service.endpoint)
    for k, v in place.env().items():
        monkeypatch.setenv(k, v)
    return place


@dataclass
class Tenant:
    """An identity of the S3 server and a place in a bucket it owns (the root account may use it too)."""

    identity: s3server.Identity
    place: Place

    def env(self) -> dict[str, str]:
        """A worker subprocess's environment additions to reach the place as this identity."""
        return {**self.place.env(), **self.identity.env()}


@pytest.fixture
def s3_tenant(s3_service: S3Service) -> Tenant:
    """A new IAM user of the S3 server (role user) with a bucket of its own; skipped on moto."""
    import boto3

    who = s3_service.add_user(f"tenant-{uuid.uuid4().hex[:8]}")
    bucket = f"bij-tenant-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_service.endpoint).create_bucket(Bucket=bucket)
    s3_service.give_bucket(bucket, who)
    return Tenant(who, Place("s3", f"s3://{bucket}/data/", s3_service.endpoint))


@pytest.fixture(params=["file", "s3"])
def place(request: pytest.FixtureRequest) -> Place:
    """Each test that takes `place` runs once on file:// and once on s3:// (the session's S3 server)."""
    return request.getfixturevalue(f"{request.param}_place")  # type: ignore[no-any-return]


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@pytest.fixture
def make_job(tmp_path: Path) -> Any:
    """make_job(place, input_uri, out_dir="out/", **spec) -> (spec path, job); spec keys merge into the defaults."""
    from bij.contract.spec import load_job

    def make(place: Place, input_uri: str, *, name: str = "t", out_dir: str = "out/", **spec: Any) -> Any:
        doc = {
            "apiVersion": "batchinference.io/v1alpha1", "kind": "BatchInferenceJob", "metadata": {"name": name},
            "spec": _merge({
                "input": {"uri": input_uri},
                "output": {"uri": place.uri(out_dir), "compression": "none"},
                "model": {"engine": "echo", "task": "generate"},
                "sharding": {"targetShardBytes": 4096, "chunkRows": 16},
                "workers": {"parallelism": 2, "backoffLimitPerIndex": 0},
                "storage": place.spec_storage,
            }, spec),
        }
        path = tmp_path / f"{name}-{uuid.uuid4().hex[:6]}.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path, load_job(path)

    return make


@dataclass
class Output:
    manifest: dict[str, Any]
    results: list[dict[str, Any]]  # in file order (files in manifest order)
    errors: list[dict[str, Any]]
    raw: dict[str, bytes]  # path -> stored bytes of every listed file

    @property
    def result_ids(self) -> list[Any]:
        return [r.get("custom_id", r.get("id")) for r in self.results]


@pytest.fixture
def read_output() -> Any:
    """read_output(job) -> Output; fails when a file's rows, bytes or sha256 disagree with the manifest."""
    from bij.storage import open_storage

    def read(job: Any) -> Output:
        out_uri = job.spec.output.uri.rstrip("/") + "/"
        store = open_storage(out_uri, job.spec.storage.s3)
        manifest = json.loads(store.read_bytes(out_uri + "manifest.json"))
        raw: dict[str, bytes] = {}

        def rows_of(files: list[Any]) -> list[dict[str, Any]]:  # the manifest's `ManifestFile`s
            rows: list[dict[str, Any]] = []
            for f in files:
                data = store.read_bytes(out_uri + f.path)
                raw[f.path] = data
                assert hashlib.sha256(data).hexdigest() == f.sha256, f.path
                assert len(data) == f.bytes, f.path
                if f.path.endswith(".zst"):
                    data = zstandard.ZstdDecompressor().decompress(data, max_output_size=1 << 30)
                got = [json.loads(line) for line in data.splitlines()]
                assert len(got) == f.rows, f.path
                rows += got
            return rows

        from bij.contract.manifest import listed

        def read_listed(path: str) -> bytes:  # a manifest part (one with more files than a part holds)
            return store.read_bytes(out_uri + path)

        return Output(manifest, rows_of(listed(manifest, "files", read_listed)),
                      rows_of(listed(manifest, "errorFiles", read_listed)), raw)

    return read


@pytest.fixture
def publish_doc() -> Any:
    """publish_doc(job, rounds=1, processes=0, bucket_rows=None) -> dict: publish with the typed
    `bij.local.publish.publish_manifest` (the passes in this process unless `processes`) and return the
    document written to `layout.manifest_uri(job)`, parsed: manifest.json, the public contract."""
    from bij.contract import layout
    from bij.local.publish import publish_manifest
    from bij.storage import open_storage

    def publish(job: Any, rounds: int = 1, processes: int = 0, bucket_rows: int | None = None) -> dict[str, Any]:
        publish_manifest(job, rounds, processes, bucket_rows)
        uri = layout.manifest_uri(job)
        doc: dict[str, Any] = json.loads(open_storage(uri, job.spec.storage.s3).read_bytes(uri))
        return doc

    return publish


def shard_log_lines(place: Place, job: Any, round_no: int = 0) -> dict[int, list[dict[str, Any]]]:
    """Every raw durable record of each shard, as written (no de-duplication), by shard index; a torn
    tail of a log is not a record."""
    from bij.contract import layout
    from bij.storage.segments import object_records

    prefix = layout.join(layout.round_prefix(job, round_no), "shards") + "/"
    out: dict[int, list[dict[str, Any]]] = {}
    for obj in place.storage.list(prefix):
        index = int(obj.uri[len(prefix):].split("/", 1)[0])
        out.setdefault(index, []).extend(object_records(place.storage, obj))
    return out


@pytest.fixture
def log_lines() -> Any:
    """log_lines(place, job) -> {shard index: [raw durable records]} (see `shard_log_lines`)."""
    return shard_log_lines


# Loaded as `sitecustomize` into worker subprocesses (PYTHONPATH), so the real entry points
# (`bij run`, `bij-worker`) run unchanged while a test observes or disturbs the engine and storage.
_HARNESS = '''
import os

if os.environ.get("BIJ_TEST_HARNESS"):
    import time

    from bij.engines import echo
    from bij.engines.base import request_text
    from bij import storage

    _log = os.environ.get("BIJ_TEST_ECHO_LOG")  # one line per row the engine computes
    _delay = float(os.environ.get("BIJ_TEST_ECHO_DELAY", "0"))  # seconds per batch
    _hold = os.environ.get("BIJ_TEST_ECHO_HOLD")  # with it, the delay holds only while this file exists
    _fail = int(os.environ.get("BIJ_TEST_FAIL_SEGMENT", "0"))  # the n-th segment upload fails
    _run = echo.EchoEngine.run

    def run(self, requests):
        if _delay and (not _hold or os.path.exists(_hold)):
            time.sleep(_delay)
        out = _run(self, requests)
        if _log:
            with open(_log, "a") as f:
                f.write("".join(request_text(r).replace("\\n", " ") + "\\n" for r in requests))
        return out

    echo.EchoEngine.run = run

    _attempts = os.environ.get("BIJ_TEST_S3_ATTEMPTS")  # S3 retries before giving up (default 8)
    if _attempts:
        _init = storage.S3Storage.__init__

        def init(self, *args, **kwargs):
            _init(self, *args, **kwargs)
            self.max_attempts, self.base_delay = int(_attempts), 0.01

        storage.S3Storage.__init__ = init

    _full = os.environ.get("BIJ_TEST_FULL_DISK")  # writes of files whose path has this in it: ENOSPC
    if _full:
        import errno

        _fdopen = os.fdopen

        class _FullDisk:
            def __init__(self, f):
                self.f = f

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.f.close()

            def write(self, data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

            def __getattr__(self, name):
                return getattr(self.f, name)

        def fdopen(fd, *args, **kwargs):
            f = _fdopen(fd, *args, **kwargs)
            try:
                path = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                return f
            return _FullDisk(f) if _full in path and "w" in (args[0] if args else kwargs.get("mode", "r")) else f

        os.fdopen = fdopen

    if _fail:
        _write = storage.S3Storage.write_bytes
        _segments = [0]

        def write_bytes(self, uri, data):
            if uri.rsplit("/", 1)[-1].startswith("seg-"):
                _segments[0] += 1
                if _segments[0] == _fail:
                    raise storage.StorageError(f"write {uri}: InternalError: simulated failed upload")
            return _write(self, uri, data)

        storage.S3Storage.write_bytes = write_bytes
'''


@pytest.fixture(scope="session")
def _harness_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("harness")
    (d / "sitecustomize.py").write_text(_HARNESS)
    return d


@pytest.fixture
def worker_env(_harness_dir: Path) -> Any:
    """worker_env(place, echo_log=None, echo_delay=0, echo_hold=None, fail_segment=0, s3_attempts=0, full_disk="",
    **extra) -> env for bij/bij-worker; with `echo_hold`, the echo delay applies only while that file exists;
    `s3_attempts` caps S3 retries (fast, for unreachable endpoints); `full_disk` makes writes of files whose
    path contains it fail with ENOSPC."""

    def env(place: Place | None = None, *, echo_log: Path | None = None, echo_delay: float = 0.0,
            echo_hold: Path | None = None, fail_segment: int = 0, s3_attempts: int = 0, full_disk: str = "",
            **extra: str) -> dict[str, str]:
        e = dict(os.environ)
        e.update(place.env() if place else {})
        e["PYTHONUNBUFFERED"] = "1"
        e["HF_HUB_OFFLINE"] = e["TRANSFORMERS_OFFLINE"] = "1"
        if echo_log or echo_delay or fail_segment or s3_attempts or full_disk:
            e["BIJ_TEST_HARNESS"] = "1"
            e["PYTHONPATH"] = os.pathsep.join(p for p in (str(_harness_dir), e.get("PYTHONPATH")) if p)
            if echo_log:
                e["BIJ_TEST_ECHO_LOG"] = str(echo_log)
            if echo_delay:
                e["BIJ_TEST_ECHO_DELAY"] = str(echo_delay)
            if echo_hold:
                e["BIJ_TEST_ECHO_HOLD"] = str(echo_hold)
            if fail_segment:
                e["BIJ_TEST_FAIL_SEGMENT"] = str(fail_segment)
            if s3_attempts:
                e["BIJ_TEST_S3_ATTEMPTS"] = str(s3_attempts)
            if full_disk:
                e["BIJ_TEST_FULL_DISK"] = full_disk
        e.update(extra)
        return e

    return env


@pytest.fixture
def bij_bin() -> Any:
    """bij_bin("bij-worker") -> the console script of this environment."""
    return lambda name: str(VENV_BIN / name)


class RecordingEcho:
    """The echo engine, recording every batch it runs; `fail_on` makes rows containing it raise."""

    steps = occupied = 0
    notes = ()

    def __init__(self, task: str = "generate", max_input_tokens: int | None = None, fail_on: str | None = None,
                 truncate: bool = False):
        from bij.engines.base import EngineConfig
        from bij.engines.echo import EchoEngine

        self.inner = EchoEngine(EngineConfig(task=task, max_input_tokens=max_input_tokens, truncate=truncate))
        self.name, self.schedules_itself, self.honours = "echo", False, self.inner.honours
        self.continuous = self.parallel_prepare = False
        self.fail_on = fail_on
        self.batches: list[list[str]] = []

    @property
    def seen(self) -> list[str]:
        """Texts in the order the engine ran them."""
        return [t for b in self.batches for t in b]

    def load(self) -> None:
        self.inner.load()

    def count_tokens(self, requests: list[Any]) -> list[int]:
        return self.inner.count_tokens(requests)

    def max_input_tokens(self) -> int | None:
        return self.inner.max_input_tokens()

    def batch_shape(self) -> None:
        return None

    def close(self) -> None:
        self.inner.close()

    def run(self, requests: list[Any]) -> list[Any]:
        from bij.engines.base import request_text

        texts = [request_text(r) for r in requests]
        if self.fail_on is not None and any(self.fail_on in t for t in texts):
            raise RuntimeError(f"cannot run {self.fail_on!r}")
        self.batches.append(texts)
        return self.inner.run(requests)


@pytest.fixture
def run_shards() -> Any:
    """run_shards(job, engine=None, indexes=None, stop=None) -> {index: ShardOutcome}, in this process.

    Plans round 0 (or reads its plan) and works the shards with `engine` (a RecordingEcho
    for the job's task by default; it is returned as `run_shards.engine`).
    """
    from bij.contract import layout
    from bij.steps.planner import plan_round
    from bij.worker.shard import ShardWorker, load_plan

    def run(job: Any, engine: Any = None, indexes: list[int] | None = None, **kw: Any) -> dict[int, Any]:
        plan_round(job, 0)
        plan = load_plan(layout.round_manifest_uri(job, 0), job.spec.storage.s3)
        if engine is None:
            m = job.spec.model
            engine = RecordingEcho(m.task, m.max_input_tokens, truncate=m.truncates)
        run.engine = engine  # type: ignore[attr-defined]
        engine.load()
        todo = range(plan.shard_total) if indexes is None else indexes
        return {i: ShardWorker(plan, i, engine, **kw).run() for i in todo}

    return run


@pytest.fixture
def recording_echo() -> Any:
    """recording_echo(task="generate", max_input_tokens=None, fail_on=None, truncate=False) -> RecordingEcho."""
    return RecordingEcho


@pytest.fixture
def webhook() -> Iterator[Any]:
    """webhook(fail_first=0) -> a `webhook_receiver.Webhook` on a free port, answering 500 to its first
    `fail_first` POSTs; closed after the test."""
    from webhook_receiver import Webhook

    hooks: list[Webhook] = []

    def make(fail_first: int = 0) -> Webhook:
        hooks.append(Webhook(fail_first))
        return hooks[-1]

    yield make
    for h in hooks:
        h.close()
