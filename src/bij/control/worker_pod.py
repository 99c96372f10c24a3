"""The pod of a round's worker: its container, volumes, environment, resources and placement (spot and GPU
nodes merged with the user's and the pool's), as `jobs.render_job` puts it in the round Job."""

from __future__ import annotations

import copy
from typing import Any

from bij.contract import layout
from bij.contract.codes import (
    JOB_NAME_ENV,
    JOB_UID_ENV,
    LANE_OFFSET_ENV,
    POD_NAME_ENV,
    POOL_ENV,
    REPORT_ENV,
    REPORT_INTERVAL_ENV,
    TENSOR_PARALLEL_ENV,
)
from bij.contract.lane_report import report_interval
from bij.contract.spec import BatchInferenceJob
from bij.contract.spec_model import HTTP_AUTHORIZATION_ENV
from bij.contract.spec_workers import WorkerPool
from bij.control.file_volume import FILE_VOLUME, FileVolume
from bij.control.permissions import DEFAULT_SERVICE_ACCOUNT

WORKER_CONTAINER = "worker"
WORKER_METRICS_PORT = 9400
WORKER_UID = 1000

# Spot node labels by provider: (label, value). Karpenter and EKS managed node groups do not
# taint spot nodes by default; GKE (when asked to, as its docs recommend) and AKS do.
SPOT_NODE_LABELS: dict[str, tuple[str, str]] = {
    "gke": ("cloud.google.com/gke-spot", "true"),
    "eks": ("eks.amazonaws.com/capacityType", "SPOT"),
    "karpenter": ("karpenter.sh/capacity-type", "spot"),
    "aks": ("kubernetes.azure.com/scalesetpriority", "spot"),
}
SPOT_TOLERATIONS: dict[str, dict[str, str]] = {
    "gke": {"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true", "effect": "NoSchedule"},
    "aks": {
        "key": "kubernetes.azure.com/scalesetpriority",
        "operator": "Equal",
        "value": "spot",
        "effect": "NoSchedule",
    },
}
GPU_RESOURCE = "nvidia.com/gpu"
GPU_TOLERATION = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}


def _report_env(job: BatchInferenceJob) -> list[dict[str, Any]]:
    """Where the pod reports (a step: the bij's status subresource; a lane: a Lease of its own), under which
    key, for which Job, and how often a lane does (less often the more pods run at once, so the writes of a
    round stay flat in its lanes: `lane_report.report_interval`)."""
    pods = job.spec.workers.parallelism * job.spec.workers.nodes_per_lane
    return [
        {"name": REPORT_ENV, "value": f"kube:{job.metadata.namespace}/{job.metadata.name}"},
        {"name": POD_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": JOB_UID_ENV,
         "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['batch.kubernetes.io/controller-uid']"}}},
        {"name": JOB_NAME_ENV,
         "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['batch.kubernetes.io/job-name']"}}},
        {"name": REPORT_INTERVAL_ENV, "value": f"{report_interval(pods):g}"},
    ]


def pod_spec(job: BatchInferenceJob, manifest_uri: str, image: str,
             file_volume: FileVolume | None = None, pool: WorkerPool | None = None,
             lane_offset: int = 0) -> dict[str, Any]:
    """The worker pod of a round's Job (or of a pool's part of it): `image` working the plan at `manifest_uri`."""
    w = job.spec.workers
    volumes, mounts = _volumes(job, file_volume)
    container = _container(job, manifest_uri, image, mounts, pool, lane_offset)
    pod: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": w.termination_grace_period_seconds,
        "serviceAccountName": w.service_account_name or DEFAULT_SERVICE_ACCOUNT,
        # The pod's one use of the Kubernetes API: a merge patch of its own report into the bij's status
        # (bij.worker.report; the worker Role grants nothing else). Projected cloud identities (IRSA,
        # workload identity) do not depend on this token.
        "automountServiceAccountToken": True,
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": WORKER_UID,
            "runAsGroup": WORKER_UID,
            "fsGroup": WORKER_UID,
            # A model cache PVC can hold many GB of files: chown it once, not on every mount.
            "fsGroupChangePolicy": "OnRootMismatch",
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": volumes,
    }
    node_selector, tolerations, affinity = scheduling(job, pool)
    if node_selector:
        pod["nodeSelector"] = node_selector
    if tolerations:
        pod["tolerations"] = tolerations
    if affinity:
        pod["affinity"] = affinity
    if w.priority_class_name:
        pod["priorityClassName"] = w.priority_class_name
    return pod


def _volumes(job: BatchInferenceJob, file_volume: FileVolume | None
             ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The worker pod's volumes and its container's mounts of them: the model cache, a larger /dev/shm,
    the chart's fileStorage."""
    w = job.spec.workers
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    cache = w.model_cache
    if cache.type == "hostPath":
        # DirectoryOrCreate makes a root-owned directory: pre-create it writable for uid 1000
        # (or pre-fill it) when the workers should download into it.
        source: dict[str, Any] = {"hostPath": {"path": cache.path, "type": "DirectoryOrCreate"}}
    elif cache.type == "pvc":
        source = {"persistentVolumeClaim": {"claimName": cache.claim_name}}
    else:
        source = {"emptyDir": {"sizeLimit": cache.size_limit} if cache.size_limit else {}}
    volumes.append({"name": "model-cache", **source})
    mounts.append({"name": "model-cache", "mountPath": cache.mount_path})
    if w.shm_size:
        # NCCL and PyTorch data loaders need a /dev/shm larger than the runtime's 64 MiB default.
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": w.shm_size}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    if file_volume is not None:
        volumes.append({"name": FILE_VOLUME, **copy.deepcopy(file_volume.source)})
        mounts.append({"name": FILE_VOLUME, "mountPath": file_volume.mount_path})
    return volumes, mounts


def _container(job: BatchInferenceJob, manifest_uri: str, image: str, mounts: list[dict[str, Any]],
               pool: WorkerPool | None, lane_offset: int) -> dict[str, Any]:
    """The worker container: `bij-worker` on the plan, its environment, credentials and resources."""
    container: dict[str, Any] = {
        "name": WORKER_CONTAINER,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["bij-worker"],
        "args": ["--manifest", manifest_uri, "--metrics-port", str(WORKER_METRICS_PORT)],
        "env": _env(job, manifest_uri) + _report_env(job) + _http_env(job) + _pool_env(pool, lane_offset),
        "ports": [{"name": "metrics", "containerPort": WORKER_METRICS_PORT, "protocol": "TCP"}],
        "volumeMounts": mounts,
        # readOnlyRootFilesystem stays off: vLLM, torch.compile and Triton write caches under $HOME.
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True,
            "runAsUser": WORKER_UID,
            "runAsGroup": WORKER_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    if job.spec.storage.credentials_secret:
        # Credentials only by reference; the secret may also carry HF_TOKEN for gated models.
        container["envFrom"] = [{"secretRef": {"name": job.spec.storage.credentials_secret}}]
    resources = _resources(job, pool)
    if resources:
        container["resources"] = resources
    return container


def _http_env(job: BatchInferenceJob) -> list[dict[str, Any]]:
    """Engine http's Authorization value, by reference to the Secret's key (never copied into the Job)."""
    http = job.spec.model.http
    if job.spec.model.engine != "http" or http is None or http.headers_secret is None:
        return []
    ref = http.headers_secret
    return [{"name": HTTP_AUTHORIZATION_ENV, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}]


def _env(job: BatchInferenceJob, manifest_uri: str) -> list[dict[str, str]]:
    w = job.spec.workers
    env: dict[str, str] = {
        "HF_HOME": layout.join(w.model_cache.mount_path, "huggingface"),
        # After SIGTERM the in-flight chunk may run for two thirds of the grace period; the
        # rest is for its durable write and a clean exit before the kubelet's SIGKILL.
        "BIJ_DRAIN_SECONDS": str(max(1, w.termination_grace_period_seconds * 2 // 3)),
    }
    s3 = job.spec.storage.s3
    if s3.endpoint_url:
        env["AWS_ENDPOINT_URL"] = s3.endpoint_url
    if s3.region:
        env["AWS_REGION"] = s3.region
    env.update(w.env)  # the user's settings win over our defaults...
    env["BIJ_MANIFEST"] = manifest_uri  # ...except the plan the pod must work on
    return [{"name": k, "value": v} for k, v in env.items()]


def _pool_env(pool: WorkerPool | None, lane_offset: int) -> list[dict[str, str]]:
    """A pool's Job: the lane its index 0 is, and its engine overrides."""
    if pool is None:
        return []
    env = [{"name": LANE_OFFSET_ENV, "value": str(lane_offset)}, {"name": POOL_ENV, "value": pool.name}]
    if pool.tensor_parallel_size is not None:
        env.append({"name": TENSOR_PARALLEL_ENV, "value": str(pool.tensor_parallel_size)})
    return env


def pool_gpus(job: BatchInferenceJob, pool: WorkerPool | None) -> int:
    """GPUs per worker pod in `pool`: its gpus, else what its tensorParallelSize needs with vLLM, else the job's."""
    if pool is not None and pool.gpus is not None:
        return pool.gpus
    if pool is not None and pool.tensor_parallel_size is not None and job.spec.model.engine == "vllm":
        return pool.tensor_parallel_size * job.spec.model.vllm.pipeline_parallel_size
    return job.spec.gpus


def _resources(job: BatchInferenceJob, pool: WorkerPool | None = None) -> dict[str, dict[str, str]]:
    w = job.spec.workers
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    # Limits equal to requests: with cpu and memory both given the pod is Guaranteed QoS, the
    # last to be evicted when a node runs short.
    for name, value in (("cpu", w.cpu), ("memory", w.memory)):
        if value:
            requests[name] = limits[name] = value
    gpus = pool_gpus(job, pool)
    if gpus > 0:
        limits[GPU_RESOURCE] = str(gpus)  # extended resources: the request defaults to the limit
    out: dict[str, dict[str, str]] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def scheduling(job: BatchInferenceJob, pool: WorkerPool | None = None
                ) -> tuple[dict[str, str], list[dict[str, Any]], dict[str, Any]]:
    """nodeSelector, tolerations and affinity: spot and GPU placement merged with the user's (and the pool's)."""
    w = job.spec.workers
    node_selector: dict[str, str] = {}
    tolerations: list[dict[str, Any]] = []
    own_affinity = pool.affinity if pool is not None and pool.affinity is not None else w.affinity
    affinity: dict[str, Any] = copy.deepcopy(own_affinity) if own_affinity else {}
    spot = pool.spot if pool is not None and pool.spot is not None else w.spot
    if spot and w.spot_provider != "all":
        label, value = SPOT_NODE_LABELS[w.spot_provider]
        node_selector[label] = value
        if w.spot_provider in SPOT_TOLERATIONS:
            tolerations.append(dict(SPOT_TOLERATIONS[w.spot_provider]))
    elif spot:
        # A nodeSelector cannot say "any of these labels": tolerate every spot taint and prefer
        # (not require) nodes with any spot label, so a cluster without spot nodes still runs.
        tolerations += [dict(t) for t in SPOT_TOLERATIONS.values()]
        preferred = affinity.setdefault("nodeAffinity", {}).setdefault(
            "preferredDuringSchedulingIgnoredDuringExecution", []
        )
        for label, value in SPOT_NODE_LABELS.values():
            preferred.append(
                {
                    "weight": 100,
                    "preference": {"matchExpressions": [{"key": label, "operator": "In", "values": [value]}]},
                }
            )
    if pool_gpus(job, pool) > 0:
        tolerations.append(dict(GPU_TOLERATION))
    node_selector.update(w.node_selector)
    tolerations += [t.model_dump(by_alias=True, exclude_none=True) for t in w.tolerations]
    if pool is not None:
        node_selector.update(pool.node_selector)
        tolerations += [t.model_dump(by_alias=True, exclude_none=True) for t in pool.tolerations]
    unique: list[dict[str, Any]] = []
    for toleration in tolerations:
        if toleration not in unique:
            unique.append(toleration)
    return node_selector, unique, affinity
