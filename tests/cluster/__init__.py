"""A real Kubernetes control plane for tests and for `make cluster-up`: etcd, kube-apiserver,
kube-controller-manager and kube-scheduler built from Kubernetes' own modules, and a process
kubelet that runs pods as local processes."""

from .controlplane import ClusterError, ControlPlane, build, free_port
from .kubelet import DEFAULT_NODES, NodeSpec, ProcessKubelet

__all__ = ["DEFAULT_NODES", "ClusterError", "ControlPlane", "NodeSpec", "ProcessKubelet", "build", "free_port"]
