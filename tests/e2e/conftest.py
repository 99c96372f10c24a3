"""The kind end-to-end test's cluster: a throwaway kind cluster, the two images, MinIO, the chart.

Opt-in: `make e2e` (`pytest -m e2e tests/e2e`). Needs a running Docker engine, `kind` and
`kubectl`; `helm` too, or else the chart is rendered with helm_python and applied with kubectl.
Without them the module is skipped.

Environment:
  BIJ_E2E_KEEP=1          keep the cluster afterwards (`kind export kubeconfig --name <name>`)
  BIJ_E2E_KIND_IMAGE      node image for `kind create cluster --image` (Kubernetes >= 1.29)
  BIJ_E2E_WORKER_IMAGE    a worker image already built locally: used as is, not built
  BIJ_E2E_WORKER_BASE     the worker build's base image (build-arg VLLM_IMAGE); default: a plain
                          Python image when the Dockerfile can leave vLLM out (ARG WORKER_EXTRAS)
  BIJ_E2E_TIMEOUT         seconds for the whole test, builds included (default 5400)
  BIJ_E2E_JOB_TIMEOUT     seconds to wait for the BatchInferenceJob (default 600)
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import socket
import subprocess
import time
import uuid
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = Path(__file__).resolve().parent / "manifests"
CHART = ROOT / "charts" / "bij-operator"

# Where things run. NAMESPACE is also written into manifests/bij-job.yaml's endpoint URL.
NAMESPACE = "bij-e2e"
OPERATOR_NAMESPACE = "bij-system"
RELEASE = "bij-operator"  # the chart's full name is then the release name: Deployment bij-operator
S3_SECRET = "s3-credentials"
S3_ACCESS_KEY = "bij-e2e-access"
S3_SECRET_KEY = "bij-e2e-secret-key"

OPERATOR_IMAGE = "bij-operator:e2e"
CPU_WORKER_IMAGE = "bij-worker:e2e-cpu"
VLLM_WORKER_IMAGE = "bij-worker:e2e"
CPU_WORKER_BASE = "python:3.11-slim-bookworm"

E2E_TIMEOUT = int(os.environ.get("BIJ_E2E_TIMEOUT", "5400"))
BUILD_TIMEOUT = 3600  # the vLLM base image alone is several GB
LOAD_TIMEOUT = 1800


# --- running commands ----------------------------------------------------------------------------


class CommandError(AssertionError):
    """A command failed or timed out; the message has its output."""


def _tail(text: str | bytes | None, lines: int = 60) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return "\n".join((text or "").rstrip().splitlines()[-lines:])


def run(
    cmd: Sequence[str],
    *,
    timeout: float = 120,
    input: str | None = None,
    check: bool = True,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run `cmd` with its output captured; CommandError (with the output's tail) when it fails."""
    try:
        proc = subprocess.run(list(cmd), input=input, capture_output=True, text=True, timeout=timeout,
                              env=dict(env) if env is not None else None, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        raise CommandError(f"$ {shlex.join(cmd)}\ntimed out after {timeout:.0f}s\n{_tail(e.stdout)}\n"
                           f"{_tail(e.stderr)}") from None
    if check and proc.returncode != 0:
        raise CommandError(f"$ {shlex.join(cmd)}\nexit {proc.returncode}\n{_tail(proc.stdout)}\n{_tail(proc.stderr)}")
    return proc


# --- prerequisites --------------------------------------------------------------------------------


def _helm_python_available() -> bool:
    try:
        import helm_python  # noqa: F401
    except ImportError:
        return False
    return True


def missing_prerequisites() -> str | None:
    """Why the e2e test cannot run here, or None when it can."""
    for tool, hint in (("docker", "https://docs.docker.com/engine/install/"),
                       ("kind", "https://kind.sigs.k8s.io/docs/user/quick-start/#installation"),
                       ("kubectl", "https://kubernetes.io/docs/tasks/tools/")):
        if shutil.which(tool) is None:
            return f"e2e needs `{tool}` on PATH ({hint})"
    if shutil.which("helm") is None and not _helm_python_available():
        return "e2e needs `helm` on PATH or the helm_python package (pip install -e '.[dev]')"
    try:
        info = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True,
                              text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"e2e needs a running Docker engine: `docker info` failed ({e})"
    if info.returncode != 0:
        first = (info.stderr.strip().splitlines() or ["no output"])[0]
        return f"e2e needs a running Docker engine: `docker info` failed ({first})"
    return None


@pytest.fixture(scope="session")
def prerequisites() -> None:
    """Skip every kind test (test_kind.py uses this first), before any cluster work, when Docker, kind
    or kubectl is missing.

    A fixture rather than an import-time check, so that collecting the test suite (`make test`
    deselects these tests) never runs `docker info`.
    """
    reason = missing_prerequisites()
    if reason:
        pytest.skip(reason)


# --- the cluster ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Cluster:
    """A kind cluster and the kubeconfig that reaches it (never the user's own)."""

    name: str
    kubeconfig: Path

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig)}

    def kubectl(self, *args: str, input: str | None = None, timeout: float = 120, check: bool = True) -> str:
        return run(["kubectl", *args], input=input, timeout=timeout, check=check, env=self.env).stdout

    def apply(self, path: Path, namespace: str) -> None:
        self.kubectl("apply", "-n", namespace, "-f", str(path))

    def get_json(self, *args: str) -> dict[str, Any]:
        return yaml.safe_load(self.kubectl("get", *args, "-o", "json"))  # type: ignore[no-any-return]

    def wait_job(self, name: str, namespace: str, timeout: float = 300) -> None:
        """Wait for a batch/v1 Job to complete; CommandError with its pods' logs if it fails or hangs."""
        deadline = time.monotonic() + timeout
        outcome = f"did not complete within {timeout:.0f}s"
        while time.monotonic() < deadline:
            conditions = self.get_json("job", name, "-n", namespace).get("status", {}).get("conditions") or []
            done = {c["type"] for c in conditions if c.get("status") == "True"}
            if "Complete" in done:
                return
            if "Failed" in done:
                outcome = "failed"
                break
            time.sleep(2)
        logs = self.kubectl("logs", "-n", namespace, f"job/{name}", "--tail=50", check=False, timeout=30)
        described = self.kubectl("describe", "-n", namespace, "job", name, check=False, timeout=30)
        raise CommandError(f"job {namespace}/{name} {outcome}\n{described}\n{logs}")

    def diagnostics(self, namespace: str = NAMESPACE) -> str:
        """What to look at when the job did not succeed: objects, events, operator and worker logs."""
        commands = [
            ["get", "bij,jobs,pods", "-n", namespace, "-o", "wide"],
            ["describe", "bij", "-n", namespace],
            ["describe", "jobs", "-n", namespace, "-l", "batchinference.io/job"],
            ["describe", "pods", "-n", namespace, "-l", "batchinference.io/job"],
            ["get", "pods", "-n", OPERATOR_NAMESPACE, "-o", "wide"],
            ["describe", "pods", "-n", OPERATOR_NAMESPACE, "-l", "app.kubernetes.io/component=operator"],
            ["logs", "-n", OPERATOR_NAMESPACE, "-l", "app.kubernetes.io/component=operator", "--tail=300",
             "--prefix"],
            ["logs", "-n", namespace, "-l", "batchinference.io/job", "--tail=80", "--prefix",
             "--max-log-requests=50"],
            ["get", "events", "-A", "--sort-by=.lastTimestamp"],
        ]
        out = []
        for args in commands:
            proc = run(["kubectl", *args], check=False, timeout=60, env=self.env)
            out.append(f"$ kubectl {shlex.join(args)}\n{_tail(proc.stdout, 150)}\n{_tail(proc.stderr, 10)}")
        return "\n\n".join(out)

    @contextmanager
    def port_forward(self, target: str, namespace: str, remote_port: int) -> Iterator[int]:
        """`kubectl port-forward` to `target` (e.g. svc/minio); yields the local port."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        proc = subprocess.Popen(["kubectl", "port-forward", "-n", namespace, "--address", "127.0.0.1", target,
                                 f"{port}:{remote_port}"], env=self.env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 30
            while True:
                if proc.poll() is not None:
                    raise CommandError(f"kubectl port-forward {target} exited: {_tail(proc.communicate()[1])}")
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise CommandError(f"kubectl port-forward {target}: port {port} not open after 30s") \
                            from None
                    time.sleep(0.5)
            yield port
        finally:
            proc.terminate()
            try:
                proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A fresh kind cluster with a unique name, deleted afterwards even on failure (unless BIJ_E2E_KEEP=1)."""
    name = f"bij-e2e-{uuid.uuid4().hex[:8]}"
    kubeconfig = tmp_path_factory.mktemp("kind") / "kubeconfig"
    create = ["kind", "create", "cluster", "--name", name, "--kubeconfig", str(kubeconfig), "--wait", "180s"]
    if os.environ.get("BIJ_E2E_KIND_IMAGE"):
        create += ["--image", os.environ["BIJ_E2E_KIND_IMAGE"]]
    try:
        run(create, timeout=900)
        yield Cluster(name, kubeconfig)
    finally:
        if os.environ.get("BIJ_E2E_KEEP") == "1":
            warnings.warn(f"BIJ_E2E_KEEP=1: kept kind cluster {name!r}; `kind export kubeconfig --name {name}`, "
                          f"then `kind delete cluster --name {name}`", stacklevel=1)
        else:
            run(["kind", "delete", "cluster", "--name", name], check=False, timeout=300)


# --- images --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Images:
    operator: str
    worker: str


def split_image(ref: str) -> tuple[str, str]:
    """("repo", "tag") of an image reference without a digest; a registry port is not a tag."""
    repo, sep, tag = ref.rpartition(":")
    if not sep or "/" in tag:
        return ref, "latest"
    return repo, tag


def docker_build(target: str, tag: str, build_args: Mapping[str, str]) -> None:
    args = [f"--build-arg={k}={v}" for k, v in build_args.items()]
    run(["docker", "build", "--target", target, "-t", tag, *args, str(ROOT)], timeout=BUILD_TIMEOUT,
        env={**os.environ, "DOCKER_BUILDKIT": "1"})


def dockerfile_declares(arg: str) -> bool:
    return re.search(rf"^\s*ARG\s+{re.escape(arg)}\b", (ROOT / "Dockerfile").read_text(), re.M) is not None


def build_worker() -> str:
    """The worker image for the echo engine: on a plain Python base without vLLM when the Dockerfile
    allows it (ARG WORKER_EXTRAS), otherwise the real vLLM worker (several GB)."""
    base = os.environ.get("BIJ_E2E_WORKER_BASE")
    if dockerfile_declares("WORKER_EXTRAS"):
        docker_build("worker", CPU_WORKER_IMAGE, {"VLLM_IMAGE": base or CPU_WORKER_BASE, "WORKER_EXTRAS": ""})
        return CPU_WORKER_IMAGE
    docker_build("worker", VLLM_WORKER_IMAGE, {"VLLM_IMAGE": base} if base else {})
    return VLLM_WORKER_IMAGE


@pytest.fixture(scope="session")
def images() -> Images:
    """Both images of the Dockerfile, built from this checkout (the worker may be given prebuilt)."""
    docker_build("operator", OPERATOR_IMAGE, {})
    worker = os.environ.get("BIJ_E2E_WORKER_IMAGE") or build_worker()
    return Images(operator=OPERATOR_IMAGE, worker=worker)


# --- in-cluster S3 and the operator ---------------------------------------------------------------


def create_namespaces_and_secrets(cluster: Cluster) -> None:
    """The job's namespace and the operator's, each with the S3 credentials (workers and MinIO read
    them in NAMESPACE, the operator, which plans and publishes, in OPERATOR_NAMESPACE)."""
    for ns in (NAMESPACE, OPERATOR_NAMESPACE):
        cluster.kubectl("create", "namespace", ns)
        cluster.kubectl("create", "secret", "generic", S3_SECRET, "-n", ns,
                        f"--from-literal=AWS_ACCESS_KEY_ID={S3_ACCESS_KEY}",
                        f"--from-literal=AWS_SECRET_ACCESS_KEY={S3_SECRET_KEY}")


@pytest.fixture(scope="session")
def s3(cluster: Cluster) -> Cluster:
    """MinIO running in NAMESPACE as Service `minio` (port 9000), root user from the secret."""
    create_namespaces_and_secrets(cluster)
    cluster.apply(MANIFESTS / "minio.yaml", NAMESPACE)
    cluster.kubectl("rollout", "status", "-n", NAMESPACE, "deploy/minio", "--timeout=300s", timeout=320)
    return cluster


def chart_values(images: Images) -> dict[str, Any]:
    operator_repo, operator_tag = split_image(images.operator)
    worker_repo, worker_tag = split_image(images.worker)
    return {
        "image": {"repository": operator_repo, "tag": operator_tag, "pullPolicy": "Never"},
        "workerImage": {"repository": worker_repo, "tag": worker_tag},
        # The operator has no storage identity: the bij's pods (bij-worker, with its Role, in the job's
        # namespace) plan, work and publish with the job's spec.storage.credentialsSecret.
        "workerServiceAccount": {"namespaces": [NAMESPACE]},
        "logLevel": "DEBUG",
    }


def install_chart(cluster: Cluster, values: dict[str, Any], workdir: Path) -> None:
    """`helm install` the chart; without a helm binary, render it with helm_python and kubectl apply."""
    values_file = workdir / "values.yaml"
    values_file.write_text(yaml.safe_dump(values))
    if shutil.which("helm"):
        run(["helm", "install", RELEASE, str(CHART), "-n", OPERATOR_NAMESPACE, "-f", str(values_file),
             "--wait", "--timeout", "5m"], timeout=360, env=cluster.env)
        return
    import helm_python

    with helm_python.Chart.load(CHART) as chart:
        rendered = chart.render(values, name=RELEASE, namespace=OPERATOR_NAMESPACE, is_install=True)
    manifest = workdir / "chart.yaml"
    manifest.write_text("\n---\n".join(text for path, text in sorted(rendered.items())
                                       if not path.endswith("NOTES.txt")))
    cluster.kubectl("apply", "--server-side", "-f", str(CHART / "crds"))
    cluster.kubectl("wait", "--for=condition=Established", "crd", "--all", "--timeout=60s", timeout=90)
    cluster.kubectl("apply", "-n", OPERATOR_NAMESPACE, "-f", str(manifest))
    cluster.kubectl("rollout", "status", "-n", OPERATOR_NAMESPACE, f"deploy/{RELEASE}", "--timeout=300s",
                    timeout=320)


@pytest.fixture(scope="session")
def operator(s3: Cluster, images: Images, tmp_path_factory: pytest.TempPathFactory) -> Cluster:
    """The images loaded into the cluster and the chart installed with them; returns the cluster."""
    for image in (images.operator, images.worker):
        run(["kind", "load", "docker-image", image, "--name", s3.name], timeout=LOAD_TIMEOUT)
    install_chart(s3, chart_values(images), tmp_path_factory.mktemp("chart"))
    return s3
