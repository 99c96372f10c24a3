"""Running the real `bij operator` process against the emulator, and the inputs tests feed it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .server import Emulator

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "batchinferencejobs.yaml"
BIJ = "batchinference.io/v1alpha1"
PLURAL = "batchinferencejobs"


class OperatorProcess:
    """`bij operator ARGS` as a subprocess, logged in through a kubeconfig for the emulator."""

    def __init__(self, api: Emulator, workdir: Path, args: Sequence[str] = ("--all-namespaces", "--standalone"),
                 env: dict[str, str] | None = None):
        self.api = api
        self.workdir = workdir
        self.args = list(args)
        self.env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.kubeconfig = api.write_kubeconfig(workdir / "kubeconfig")

    @property
    def log_path(self) -> Path:
        return self.workdir / f"operator-{self.starts}.log"

    def start(self) -> OperatorProcess:
        self.starts += 1
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
        env.update({"KUBECONFIG": str(self.kubeconfig), "BIJ_WORKER_IMAGE": "bij-worker:test"}, **self.env)
        log = open(self.log_path, "wb")  # noqa: SIM115 - the child owns it until it exits
        self.proc = subprocess.Popen([sys.executable, "-m", "bij_operator.cli", "operator", "--verbose", *self.args],
                                     env=env, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir)
        log.close()
        return self

    def kill(self) -> None:
        """SIGKILL: no cleanup, no goodbye, as when a node dies."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode

    def logs(self) -> str:
        return "\n".join((self.workdir / f"operator-{i}.log").read_text(errors="replace")
                         for i in range(1, self.starts + 1) if (self.workdir / f"operator-{i}.log").exists())

    def __enter__(self) -> OperatorProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def write_rows(folder: Path, n: int, name: str = "rows.jsonl") -> list[Any]:
    """`n` JSONL rows with mixed int and str ids (the manifest must give them back as given)."""
    folder.mkdir(parents=True, exist_ok=True)
    ids: list[Any] = [i if i % 3 else f"row-{i}" for i in range(n)]
    with open(folder / name, "w") as f:
        for i, rid in enumerate(ids):
            f.write(json.dumps({"id": rid, "text": f"row {i}: " + "lorem ipsum " * 3}) + "\n")
    return ids


def bij_doc(name: str, tmp: Path, **spec: Any) -> dict[str, Any]:
    """A small echo job over `tmp/in`, writing uncompressed results under `tmp/out-<name>`."""
    body: dict[str, Any] = {
        "input": {"uri": f"file://{tmp}/in"},
        "output": {"uri": f"file://{tmp}/out-{name}", "compression": "none"},
        "model": {"engine": "echo", "task": "generate"},
        "sharding": {"targetShardBytes": 1024, "chunkRows": 8},
        "workers": {"parallelism": 2, "backoffLimitPerIndex": 1, "terminationGracePeriodSeconds": 5},
    }
    for key, value in spec.items():
        if isinstance(value, dict) and isinstance(body.get(key), dict):
            body[key] = {**body[key], **value}
        else:
            body[key] = value
    return {"apiVersion": BIJ, "kind": "BatchInferenceJob", "metadata": {"name": name}, "spec": body}


def read_published(manifest_path: Path) -> list[dict[str, Any]]:
    """Every result row of a published (uncompressed) output, via its manifest."""
    manifest = json.loads(manifest_path.read_text())
    rows: list[dict[str, Any]] = []
    for f in manifest["files"]:
        with open(manifest_path.parent / f["path"]) as fh:
            rows.extend(json.loads(line) for line in fh if line.strip())
    return rows
