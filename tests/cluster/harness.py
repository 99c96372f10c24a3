"""A whole local cluster: the control plane, the process kubelet and the bij operator installed
from charts/bij-operator with real Helm, as `make cluster-up` and the cluster tests use it."""

from __future__ import annotations

import logging
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import kubernetes
from kubernetes.client import ApiException

from bij.control.permissions import worker_role_rules

from .controlplane import BIN, ROOT, ClusterError, ControlPlane, free_port
from .kubelet import ProcessKubelet

log = logging.getLogger("bij.cluster")

CHART = ROOT / "charts" / "bij-operator"
LOCAL_FILES = {"mountPath": tempfile.gettempdir(), "volume": {"hostPath": {"path": tempfile.gettempdir()}}}
OPERATOR_NAMESPACE = "bij-system"
RELEASE = "bij"
T = TypeVar("T")


def wait_for(fn: Callable[[], T | None], timeout: float, message: str, interval: float = 0.2) -> T:
    """Poll `fn` until it returns something other than None/False; fail naming `message`."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = fn()
            if value:
                return value
        except ApiException as e:
            last = e
        time.sleep(interval)
    why = f" (last error: {last})" if last else ""
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {message}{why}")


class LocalCluster:
    """Control plane + process kubelet (+ the operator, once `install_operator()` ran)."""

    def __init__(self, state: Path, kubelet_env: dict[str, str] | None = None):
        self.state = state.resolve()
        self.plane = ControlPlane(self.state)
        self.kubelet_env = kubelet_env or {}
        self.kubelet: ProcessKubelet | None = None
        self.api: kubernetes.client.ApiClient | None = None
        self.liveness_port = 0

    @property
    def kubeconfig(self) -> Path:
        return self.plane.admin_kubeconfig

    def connect(self) -> LocalCluster:
        """Talk to the cluster whose admin kubeconfig is under the state folder (started elsewhere)."""
        cfg = kubernetes.client.Configuration()
        kubernetes.config.load_kube_config(config_file=str(self.kubeconfig), client_configuration=cfg)
        self.api = kubernetes.client.ApiClient(cfg)
        return self

    def start(self) -> LocalCluster:
        self.plane.start()
        self.kubelet = ProcessKubelet(self.plane, self.state / "kubelet", env=self.kubelet_env).start()
        self.connect()
        n_nodes = len(self.kubelet.nodes)
        core = kubernetes.client.CoreV1Api(self.api)
        wait_for(lambda: all(any(c.type == "Ready" and c.status == "True" for c in n.status.conditions or [])
                             for n in core.list_node().items) and len(core.list_node().items) == n_nodes,
                 30, "every node Ready")
        return self

    def install_operator(self, values: dict[str, Any] | None = None, timeout: float = 120) -> dict[str, Any]:
        """`helm install bij charts/bij-operator -n bij-system --create-namespace`, then wait for the pod."""
        import helm_python as helm

        # Every pod of this cluster runs on this machine: the temp folder is a volume they all share, so
        # tests (and `make cluster-up`) may use file:// URIs under it.
        merged: dict[str, Any] = {"livenessPort": free_port(), "logLevel": "DEBUG", "fileStorage": LOCAL_FILES}
        merged.update(values or {})
        self.liveness_port = int(merged["livenessPort"])
        cfg = helm.Config(kubeconfig_path=str(self.kubeconfig), namespace=OPERATOR_NAMESPACE)
        try:
            try:
                cfg.status(RELEASE)
                release = cfg.upgrade(str(CHART), RELEASE, merged, namespace=OPERATOR_NAMESPACE, timeout=int(timeout))
            except helm.HelmNotFoundError:
                release = cfg.install(str(CHART), RELEASE, merged, namespace=OPERATOR_NAMESPACE,
                                      create_namespace=True, timeout=int(timeout))
        finally:
            cfg.close()
        self.operator_pod(timeout)
        return dict(release)

    def operator_pod(self, timeout: float = 60, not_uid: str | None = None) -> dict[str, Any]:
        """The Running operator pod (one other than `not_uid`, when given)."""
        core = kubernetes.client.CoreV1Api(self.api)

        def running() -> dict[str, Any] | None:
            pods = core.list_namespaced_pod(OPERATOR_NAMESPACE, label_selector="app.kubernetes.io/component=operator")
            for p in pods.items:
                if p.status.phase == "Running" and p.metadata.uid != not_uid and not p.metadata.deletion_timestamp:
                    return dict(self.api.sanitize_for_serialization(p))
            return None

        return wait_for(running, timeout, "the operator pod Running")

    def kubectl(self, *args: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess[str]:
        """kubectl of the same release as the control plane, as the cluster admin."""
        return subprocess.run([str(BIN / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args], capture_output=True,
                              text=True, check=check, input=input, timeout=60)

    def pod_logs(self, namespace: str, name_prefix: str = "") -> str:
        """What the pods of `namespace` whose names start with `name_prefix` printed (from the kubelet)."""
        assert self.kubelet is not None
        out = []
        for path in sorted((self.kubelet.workdir / "pods").glob(f"{namespace}_{name_prefix}*/*.log")):
            out.append(f"==== {path.parent.name}/{path.name}\n{path.read_text(errors='replace')}")
        return "\n".join(out)

    def stop(self) -> None:
        if self.kubelet is not None:
            self.kubelet.stop()
        self.plane.stop()


# The chart's worker Role (templates/rbac.yaml, rules.worker; tests/system/test_chart.py holds the two equal).
WORKER_RULES = worker_role_rules()


def add_worker_account(api: kubernetes.client.ApiClient, namespace: str, name: str = "bij-worker") -> None:
    """The worker service account and its Role, as the chart makes them in the namespaces it is told of
    (with watch.allNamespaces, the namespaces where bijs run are not known to it)."""
    core = kubernetes.client.CoreV1Api(api)
    rbac = kubernetes.client.RbacAuthorizationV1Api(api)
    core.create_namespaced_service_account(namespace, {"metadata": {"name": name}})
    rbac.create_namespaced_role(namespace, {"metadata": {"name": name}, "rules": WORKER_RULES})
    rbac.create_namespaced_role_binding(namespace, {
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]})


def remove_worker_account(api: kubernetes.client.ApiClient, namespace: str, name: str = "bij-worker") -> None:
    kubernetes.client.CoreV1Api(api).delete_namespaced_service_account(name, namespace)
    rbac = kubernetes.client.RbacAuthorizationV1Api(api)
    rbac.delete_namespaced_role_binding(name, namespace)
    rbac.delete_namespaced_role(name, namespace)


__all__ = ["CHART", "OPERATOR_NAMESPACE", "ClusterError", "LocalCluster", "add_worker_account",
           "remove_worker_account", "wait_for"]
