"""`make cluster-up` / `make cluster-down`: a local Kubernetes cluster with the bij operator.

    python -m cluster up [--state DIR]     build on first use, start, install the chart, print how to use it
    python -m cluster down [--state DIR]   stop everything (pods included)
    python -m cluster serve --state DIR    the background process `up` starts: control plane + kubelet

Run with tests/ on PYTHONPATH and this project's virtualenv (the Makefile does both)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from .controlplane import BIN, ROOT, ClusterError, build, free_port
from .harness import OPERATOR_NAMESPACE, WORKER_RULES, LocalCluster

DEFAULT_STATE = ROOT / ".cluster"
# bij-api's model map on the local cluster: the simulated engine answers chat and completions at the
# pace of a small GPU (8 sequences, 50 ms a token), so a batch can be watched and cancelled; echo
# embeds. Neither needs weights.
DEMO_MODELS = {
    "demo-chat": {"model": {"engine": "simulated", "simulated": {"stepSeconds": 0.05, "maxNumSeqs": 8}},
                  "workers": {"parallelism": 2}, "sharding": {"targetShardBytes": 65536, "chunkRows": 64}},
    "demo-embed": {"model": {"engine": "echo"}, "workers": {"parallelism": 2}},
}
API_NAMESPACE = "default"  # where the demo token's batches and files live
API_USER = "batcher"  # the demo token's service account: may create batchinferencejobs there


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _running(state: Path) -> dict[str, object] | None:
    info_path = state / "cluster.json"
    if not info_path.exists():
        return None
    info = json.loads(info_path.read_text())
    return info if _alive(int(info["pid"])) else None


def serve(state: Path) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    cluster = LocalCluster(state)
    try:
        cluster.start()
        (state / "cluster.json").write_text(json.dumps({"pid": os.getpid(), "server": cluster.plane.server}))
        stop.wait()
    finally:
        (state / "cluster.json").unlink(missing_ok=True)
        cluster.stop()
    return 0


def up(state: Path) -> int:
    started = time.monotonic()
    try:
        build()
    except ClusterError as e:
        print(f"cluster-up: {e}", file=sys.stderr)
        return 3
    state.mkdir(parents=True, exist_ok=True)
    if _running(state) is None:
        log = open(state / "serve.log", "ab")  # noqa: SIM115 - the child keeps it
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.Popen([sys.executable, "-m", "cluster", "serve", "--state", str(state)], env=env,
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 120
        while _running(state) is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (state / "serve.log").read_text(errors="replace")[-3000:]
                print(f"cluster-up: the control plane did not start; the end of {state / 'serve.log'}:\n{tail}",
                      file=sys.stderr)
                if proc.poll() is None:
                    proc.terminate()
                return 1
            time.sleep(0.3)
    print(f"cluster-up: control plane ready in {time.monotonic() - started:.0f} s; installing charts/bij-operator")
    cluster = LocalCluster(state).connect()
    api_state = state / "api.json"
    port = int(json.loads(api_state.read_text())["port"]) if api_state.exists() else free_port()
    try:
        cluster.install_operator(values={"logLevel": "INFO", "api": {
            "enabled": True, "port": port, "filesPrefix": f"file://{api_files(state)}/", "models": DEMO_MODELS}})
        token = api_user(cluster)
    except Exception as e:
        print(f"cluster-up: installing the chart failed: {e}", file=sys.stderr)
        return 1
    api_state.write_text(json.dumps({"port": port}))
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 120
    while not _answers(f"http://127.0.0.1:{port}/healthz"):
        if time.monotonic() > deadline:
            print(f"cluster-up: bij-api does not answer on port {port}; its log is under "
                  f"{state / 'kubelet' / 'pods'}", file=sys.stderr)
            return 1
        time.sleep(0.5)
    (state / "api.env").write_text(f"OPENAI_BASE_URL={url}\nOPENAI_API_KEY={token}\n")
    kubectl = BIN / "kubectl"
    print(f"""cluster-up: ready in {time.monotonic() - started:.0f} s; the bij operator runs in {OPERATOR_NAMESPACE}.

    export KUBECONFIG={cluster.kubeconfig}
    export PATH={kubectl.parent}:$PATH
    kubectl get nodes
    # a bij's pods run as bij-worker, made here in namespace {API_NAMESPACE} with its Role (docs/operations.md, RBAC)
    kubectl apply -f examples/local-embed.yaml      # file:// URIs must be absolute: pods do not share your cwd
    kubectl get bij -w

bij-api, the OpenAI Batch API (models {', '.join(DEMO_MODELS)}; batches live in namespace {API_NAMESPACE}):

    export OPENAI_BASE_URL={url}
    export OPENAI_API_KEY={token}
    python examples/openai_batch.py                 # or: make api-demo

Pods run as local processes; their output is under {state / 'kubelet' / 'pods'}. Stop with: make cluster-down""")
    return 0


def api_files(state: Path) -> Path:
    """Where bij-api keeps the demo's files: under the temp folder, the volume this cluster's pods share
    (the chart's fileStorage, harness.LOCAL_FILES), one folder per checkout."""
    import hashlib
    import tempfile

    return Path(tempfile.gettempdir()) / f"bij-api-files-{hashlib.sha256(str(state).encode()).hexdigest()[:8]}"


def _answers(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def api_user(cluster: LocalCluster) -> str:
    """The demo's API key: a token of service account `API_USER`, allowed to create batchinferencejobs in
    `API_NAMESPACE` (a bij's pods there run as bij-worker, with the worker's Role). Idempotent."""
    import kubernetes
    from kubernetes.client import ApiException

    core = kubernetes.client.CoreV1Api(cluster.api)
    rbac = kubernetes.client.RbacAuthorizationV1Api(cluster.api)
    ns = API_NAMESPACE
    for create in (
        lambda: core.create_namespaced_service_account(ns, {"metadata": {"name": "bij-worker"}}),
        # The worker's Role as the chart makes it where it is told of a namespace: pods report into status.
        lambda: rbac.create_namespaced_role(ns, {"metadata": {"name": "bij-worker"}, "rules": WORKER_RULES}),
        lambda: rbac.create_namespaced_role_binding(ns, {
            "metadata": {"name": "bij-worker"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "bij-worker"},
            "subjects": [{"kind": "ServiceAccount", "name": "bij-worker", "namespace": ns}]}),
        lambda: core.create_namespaced_service_account(ns, {"metadata": {"name": API_USER}}),
        lambda: rbac.create_namespaced_role(ns, {"metadata": {"name": "bij-batches"}, "rules": [
            {"apiGroups": ["batchinference.io"], "resources": ["batchinferencejobs"],
             "verbs": ["create", "get", "list", "watch"]}]}),
        lambda: rbac.create_namespaced_role_binding(ns, {
            "metadata": {"name": f"bij-batches-{API_USER}"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "bij-batches"},
            "subjects": [{"kind": "ServiceAccount", "name": API_USER, "namespace": ns}]}),
    ):
        try:
            create()
        except ApiException as e:
            if e.status != 409:
                raise
    deadline = time.monotonic() + 30
    while True:  # the token controller may not know a new service account for a moment
        try:
            made = core.create_namespaced_service_account_token(API_USER, ns,
                                                                {"spec": {"expirationSeconds": 86400}})
            return str(made.status.token)
        except ApiException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def down(state: Path) -> int:
    info = _running(state)
    if info is None:
        print("cluster-down: no cluster is running")
        return 0
    pid = int(info["pid"])  # type: ignore[call-overload]
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)
    print("cluster-down: stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cluster")
    p.add_argument("command", choices=["up", "down", "serve"])
    p.add_argument("--state", type=Path, default=DEFAULT_STATE)
    args = p.parse_args(argv)
    state = args.state.resolve()
    return {"up": up, "down": down, "serve": serve}[args.command](state)


if __name__ == "__main__":
    sys.exit(main())
