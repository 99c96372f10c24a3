"""A real Kubernetes control plane for tests and for `make cluster-up`: etcd, kube-apiserver,
kube-controller-manager and kube-scheduler built from Kubernetes' own modules, and a process
kubelet that runs pods as local processes."""

from .controlplane import ClusterError, ControlPlane, build, free_port
from .kubelet import DEFAULT_NODES, NodeSpec, ProcessKubelet

__all__ = ["DEFAULT_NODES", "ClusterError", "ControlPlane", "NodeSpec", "ProcessKubelet", "build", "build_or_skip",
           "free_port"]


def build_or_skip() -> None:
    """Build the control plane for a test module; without the toolchain skip it, except in CI."""
    import os

    import pytest

    try:
        build()
    except ClusterError as e:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the control-plane tests: {e}")
        pytest.skip(f"no local control plane: {e}")
