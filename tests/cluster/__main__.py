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

from .controlplane import BIN, ROOT, ClusterError, build
from .harness import OPERATOR_NAMESPACE, LocalCluster

DEFAULT_STATE = ROOT / ".cluster"


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
    try:
        cluster.install_operator(values={"logLevel": "INFO"})
    except Exception as e:
        print(f"cluster-up: installing the chart failed: {e}", file=sys.stderr)
        return 1
    kubectl = BIN / "kubectl"
    print(f"""cluster-up: ready in {time.monotonic() - started:.0f} s; the bij operator runs in {OPERATOR_NAMESPACE}.

    export KUBECONFIG={cluster.kubeconfig}
    export PATH={kubectl.parent}:$PATH
    kubectl get nodes
    kubectl create serviceaccount bij-worker        # round pods run as bij-worker in the job's namespace
    kubectl apply -f examples/local-embed.yaml      # file:// URIs must be absolute: pods do not share your cwd
    kubectl get bij -w

Pods run as local processes; their output is under {state / 'kubelet' / 'pods'}. Stop with: make cluster-down""")
    return 0


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
