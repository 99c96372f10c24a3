"""The batch/v1 Job of one round: an Indexed Job whose pod `i` is lane `i` of the round plan.

A lane loads the model once and works its shards `i`, `i + lanes`, ..., then unfinished shards of
other lanes (bij.worker.lanes), so the Job has one index per lane, not per shard.

`render_job` is a pure function of the spec and the round; the operator creates what it returns
and `bij render` prints it. Everything that decides how a round survives spot preemptions lives
here: the pod failure policy, per-index retries, spot scheduling and the grace period.
"""

from __future__ import annotations

import copy
import json
import os
import posixpath
from dataclasses import dataclass
from typing import Any

from bij.contract import layout
from bij.contract.codes import (
    CANARY_LABEL,
    CANARY_SHARDS_ENV,
    EXIT_BAD_CONFIG,
    EXIT_GROUP_LOST,
    GROUP_LEADER_ENV,
    GROUP_PORT,
    JOB_LABEL,
    JOB_NAME_ENV,
    JOB_UID_ENV,
    LANE_OFFSET_ANNOTATION,
    LANE_OFFSET_ENV,
    MANIFEST_ANNOTATION,
    NODES_PER_LANE_ANNOTATION,
    NODES_PER_LANE_ENV,
    POD_NAME_ENV,
    POOL_ENV,
    POOL_LABEL,
    PUBLISH_LABEL,
    PUBLISH_PLAN_ANNOTATION,
    RAY_PORT,
    REPORT_ENV,
    REPORT_INTERVAL_ENV,
    ROUND_ENV,
    ROUND_LABEL,
    STEP_LABEL,
    TENSOR_PARALLEL_ENV,
)
from bij.contract.lane_report import report_interval
from bij.contract.spec import (
    API_GROUP,
    API_VERSION,
    HTTP_AUTHORIZATION_ENV,
    KIND,
    BatchInferenceJob,
    WorkerPool,
    job_to_dict,
)
from bij.control.observe import step_job_name, step_key
from bij.control.permissions import DEFAULT_SERVICE_ACCOUNT
from bij.control.rules.rounds import desired_parallelism
from bij.control.rules.steps import STEP_TRIES_ANNOTATION

DEFAULT_WORKER_IMAGE = "ghcr.io/bij-project/bij-worker:0.1.0"
WORKER_CONTAINER = "worker"
WORKER_METRICS_PORT = 9400
# Kubernetes caps completions at 10^5 when backoffLimitPerIndex is set.
MAX_COMPLETIONS = 100_000
WORKER_UID = 1000

KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"

# A lane of several pods (spec.workers.nodesPerLane): its pods reach the leader (rank 0) by the stable name
# `<job>-<index>.<service>` a headless Service gives an Indexed Job's pods (their hostname and subdomain).
# Its ports and env names are bij.contract.codes' (RAY_PORT, GROUP_PORT, NODES_PER_LANE_ENV, ...).

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


# The chart's fileStorage value, as the operator's environment carries it (JSON: mountPath, volume).
FILE_STORAGE_ENV = "BIJ_FILE_STORAGE"
FILE_VOLUME = "bij-files"


@dataclass(frozen=True)
class FileVolume:
    """A volume every pod of a bij mounts at `mount_path` (chart value fileStorage): on a cluster, file://
    URIs are only worked with where they lie under it, since nothing else is shared between pods."""

    mount_path: str
    source: dict[str, Any]

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> FileVolume | None:
        raw = (os.environ if env is None else env).get(FILE_STORAGE_ENV)
        if not raw:
            return None
        doc = json.loads(raw)
        mount, source = doc.get("mountPath"), doc.get("volume")
        if not isinstance(mount, str) or not mount.startswith("/") or not isinstance(source, dict) or not source:
            raise ValueError(f"{FILE_STORAGE_ENV}: expected {{\"mountPath\": \"/abs/path\", \"volume\": {{...}}}}, "
                             f"got {raw!r}")
        return cls(posixpath.normpath(mount), dict(source))

    def covers(self, uri: str) -> bool:
        path = posixpath.normpath(uri[len("file://"):])
        return path == self.mount_path or path.startswith(self.mount_path.rstrip("/") + "/")


def file_uri_problems(job: BatchInferenceJob, volume: FileVolume | None) -> list[str]:
    """The file:// URIs of `job` its pods on a cluster could not share: all of them without the chart's
    fileStorage volume, else those outside its mountPath."""
    uris = [("spec.input.uri", job.spec.input.uri), ("spec.output.uri", job.spec.output.uri)]
    uris += [(f"spec.model.adapters[{i}].uri", a.uri) for i, a in enumerate(job.spec.model.adapters)]
    problems = []
    for field, uri in uris:
        if not uri.startswith("file://"):
            continue
        if volume is None:
            problems.append(f"{field}: {uri}: file:// URIs need a volume shared by every pod of the bij, and this "
                            "operator has none: set the chart value fileStorage (volume and mountPath), or use s3:// or gs://")
        elif not volume.covers(uri):
            problems.append(f"{field}: {uri} is outside the shared volume at {volume.mount_path} (chart value "
                            "fileStorage.mountPath): pods elsewhere do not see it")
    return problems


def job_name(job: BatchInferenceJob, round_no: int) -> str:
    """The round Job's deterministic name, so a restarted operator finds instead of duplicates it."""
    return f"{job.metadata.name}-r{round_no}"


def worker_image_default() -> str:
    """The worker image when the spec names none: env BIJ_WORKER_IMAGE (set by the chart)."""
    return os.environ.get("BIJ_WORKER_IMAGE") or DEFAULT_WORKER_IMAGE


def job_labels(job: BatchInferenceJob, round_no: int) -> dict[str, str]:
    """Labels on the round Job and its pods (selectors for the operator, PodMonitor and kubectl)."""
    return {
        "app.kubernetes.io/name": "bij-worker",
        "app.kubernetes.io/instance": job.metadata.name,
        "app.kubernetes.io/component": "worker",
        "app.kubernetes.io/part-of": "bij",
        "app.kubernetes.io/managed-by": "bij-operator",
        JOB_LABEL: job.metadata.name,
        ROUND_LABEL: str(round_no),
    }


def lane_service_name(job: BatchInferenceJob) -> str:
    """The headless Service that names the pods of a bij's lanes of several pods (all its rounds)."""
    return f"{job.metadata.name}-lanes"


def render_lane_service(job: BatchInferenceJob, *, owner_uid: str | None = None) -> dict[str, Any]:
    """The headless Service of a bij whose lanes span several pods (spec.workers.nodesPerLane > 1): with it
    as their subdomain, the round Job's pods resolve as `<job>-<index>.<service>`, so a lane's members
    find its leader. Its addresses are published before the pods are ready: a member joins its leader
    while both start."""
    labels = {k: v for k, v in job_labels(job, 0).items() if k != ROUND_LABEL}
    metadata: dict[str, Any] = {"name": lane_service_name(job), "namespace": job.metadata.namespace,
                                "labels": labels}
    if owner_uid:
        metadata["ownerReferences"] = [{"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": KIND,
                                        "name": job.metadata.name, "uid": owner_uid, "controller": True,
                                        "blockOwnerDeletion": True}]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata,
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {JOB_LABEL: job.metadata.name, "app.kubernetes.io/component": "worker"},
            "ports": [{"name": "ray", "port": RAY_PORT, "protocol": "TCP"},
                      {"name": "group", "port": GROUP_PORT, "protocol": "TCP"}],
        },
    }


def render_job(
    job: BatchInferenceJob,
    round_no: int,
    completions: int,
    manifest_uri: str,
    *,
    image: str = DEFAULT_WORKER_IMAGE,
    owner_uid: str | None = None,
    file_volume: FileVolume | None = None,
    group: bool = True,
    pool: WorkerPool | None = None,
    name_suffix: str = "",
    lane_offset: int = 0,
) -> dict[str, Any]:
    """The batch/v1 Job that runs round `round_no` of `job` with `completions` lanes.

    With `pool` (one of spec.workers.pools) the Job runs lanes ``lane_offset ..`` of the round in that pool: its
    placement, GPUs, queue and engine overrides, named ``<bij>-r<round><name_suffix>`` (`pools.Placed.suffix`).

    A lane is one index, or with spec.workers.nodesPerLane = n > 1 (and `group`) n indexes: index i is
    rank i % n of lane i // n, rank 0 its leader (the bij worker and a Ray head), the others Ray workers
    that join it by name through the headless Service of `render_lane_service`.
    `image` is the operator's default worker image; spec.workers.image wins over it.
    With `owner_uid` the Job is owned by (and garbage-collected with) the BatchInferenceJob.
    With `file_volume` (chart value fileStorage) its pods mount the volume file:// URIs lie on.
    """
    w = job.spec.workers
    nodes = w.nodes_per_lane if group else 1
    if not 1 <= completions * nodes <= MAX_COMPLETIONS:
        raise ValueError(f"a round needs 1 to {MAX_COMPLETIONS} pods, got {completions} lanes of {nodes}")
    if round_no < 0:
        raise ValueError(f"round must be >= 0, got {round_no}")
    lanes, completions = completions, completions * nodes
    labels = job_labels(job, round_no)
    if pool is not None:
        labels[POOL_LABEL] = pool.name
    metadata: dict[str, Any] = {
        "name": job_name(job, round_no) + name_suffix,
        "namespace": job.metadata.namespace,
        "labels": dict(labels),
        "annotations": {MANIFEST_ANNOTATION: manifest_uri},
    }
    queue_name = pool.queue_name if pool is not None and pool.queue_name else w.queue_name
    if queue_name:
        metadata["labels"][KUEUE_QUEUE_LABEL] = queue_name
    if pool is not None:
        metadata["annotations"][LANE_OFFSET_ANNOTATION] = str(lane_offset)
    if owner_uid:
        metadata["ownerReferences"] = [
            {
                "apiVersion": f"{API_GROUP}/{API_VERSION}",
                "kind": KIND,
                "name": job.metadata.name,
                "uid": owner_uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
    max_failed = completions if w.max_failed_indexes is None else min(w.max_failed_indexes, completions)
    spec: dict[str, Any] = {
        "completionMode": "Indexed",
        "completions": completions,
        "parallelism": desired_parallelism(job, lanes) if nodes > 1 else min(w.parallelism, completions),
        # Kueue admits a queued Job by unsuspending it, so such a Job is created suspended.
        "suspend": job.spec.suspend or bool(queue_name),
        # Retries are counted per lane: one bad lane cannot use up the whole round's budget.
        "backoffLimitPerIndex": w.backoff_limit_per_index,
        # Lanes are independent and their finished chunks durable, so by default every lane gets
        # its chance: the shards of a lane that failed for good are taken over by the others, and
        # the operator decides about the round from which shards are done. A job-wide mistake is
        # stopped by the FailJob rule below.
        "maxFailedIndexes": max_failed,
        "podFailurePolicy": {
            "rules": [
                # A preempted/evicted pod (spot reclaim, node drain) is not a failure: its index
                # is retried without counting against backoffLimitPerIndex.
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
                # Bad configuration (unknown model, missing plan) fails every lane the same way:
                # FailJob stops the round at once. FailIndex would only stop that index and let
                # every other lane start, pull the image and load the model, just to fail too.
                {
                    "action": "FailJob",
                    "onExitCodes": {
                        "containerName": WORKER_CONTAINER,
                        "operator": "In",
                        "values": [EXIT_BAD_CONFIG],
                    },
                },
            ]
        },
        # A replacement pod starts only once the old one has fully terminated, so it may take its
        # lane's claims at once: the preempted pod has committed its last chunk.
        "podReplacementPolicy": "Failed",
        "template": {
            "metadata": {
                "labels": dict(labels),
                "annotations": {"kubectl.kubernetes.io/default-container": WORKER_CONTAINER},
            },
            "spec": _pod_spec(job, manifest_uri, w.image or image, file_volume, pool, lane_offset),
        },
    }
    if w.ttl_seconds_after_finished is not None:
        spec["ttlSecondsAfterFinished"] = w.ttl_seconds_after_finished
    if nodes > 1:
        _group_lanes(metadata, spec, job, nodes, round_no)
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata, "spec": spec}


def canary_job_name(job: BatchInferenceJob) -> str:
    return f"{job_name(job, 0)}-canary"


def render_canary_job(job: BatchInferenceJob, completions: int, shards: int, manifest_uri: str, *,
                      image: str = DEFAULT_WORKER_IMAGE, owner_uid: str | None = None,
                      file_volume: FileVolume | None = None) -> dict[str, Any]:
    """Round 0's canary Job (spec.canary): the round's Job, but its `completions` lanes work only `shards` shards
    spread over the plan (`CANARY_SHARDS_ENV`; which ones, `contract.canary.canary_shards`); what they make
    durable is round 0's, which the round's own Job then skips."""
    # With spec.workers.pools, in the preferred pool (its lanes are the round's first).
    pool = job.spec.workers.pools[0] if job.spec.workers.pools else None
    body = render_job(job, 0, completions, manifest_uri, image=image, owner_uid=owner_uid, file_volume=file_volume,
                      pool=pool)
    body["metadata"]["name"] = canary_job_name(job)
    for labels in (body["metadata"]["labels"], body["spec"]["template"]["metadata"]["labels"]):
        labels[CANARY_LABEL] = "true"
    for container in body["spec"]["template"]["spec"]["containers"]:
        container["env"].append({"name": CANARY_SHARDS_ENV, "value": str(shards)})
    return body


def _group_lanes(metadata: dict[str, Any], spec: dict[str, Any], job: BatchInferenceJob, nodes: int,
                 round_no: int) -> None:
    """Make the round Job's lanes groups of `nodes` pods.

    All or nothing: with spec.workers.queueName Kueue admits the Job whole (its pods' resources at once);
    without it the group's indexes are next to each other, and the Job controller starts pending indexes
    lowest first, so a lane's pods are created together. A group is replaced whole: a member whose peer is
    gone (its leader, or a member of the leader's) exits EXIT_GROUP_LOST, which the podFailurePolicy does
    not count against that index (the member that failed counts, a preempted one does not), so every
    index of the lane starts again and the new group joins afresh; the lane's uncommitted rows are redone,
    its committed ones never are (the replacement leader resumes the lane's claims).
    """
    metadata["annotations"][NODES_PER_LANE_ANNOTATION] = str(nodes)
    rules = spec["podFailurePolicy"]["rules"]
    rules.insert(1, {"action": "Ignore",
                     "onExitCodes": {"containerName": WORKER_CONTAINER, "operator": "In",
                                     "values": [EXIT_GROUP_LOST]}})
    pod = spec["template"]["spec"]
    # hostname <job>-<index> (set by the Job controller for Indexed Jobs) under this subdomain
    pod["subdomain"] = lane_service_name(job)
    (container,) = pod["containers"]
    container["env"].append({"name": NODES_PER_LANE_ENV, "value": str(nodes)})
    # A member reads no plan; the round names its report when it sees its leader gone.
    container["env"].append({"name": ROUND_ENV, "value": str(round_no)})
    if GROUP_LEADER_ENV not in job.spec.workers.env:  # the user's setting wins (another DNS name, say)
        container["env"].append({"name": GROUP_LEADER_ENV,
                                 "value": f"{metadata['name']}-{{index}}.{lane_service_name(job)}"})
    container["ports"] += [{"name": "ray", "containerPort": RAY_PORT, "protocol": "TCP"},
                           {"name": "group", "containerPort": GROUP_PORT, "protocol": "TCP"}]


def publish_job_name(job: BatchInferenceJob, pass_name: str) -> str:
    return f"{job.metadata.name}-publish-{pass_name}"


def render_publish_job(job: BatchInferenceJob, pass_name: str, completions: int, plan_uri: str, *,
                       image: str = DEFAULT_WORKER_IMAGE, owner_uid: str | None = None,
                       file_volume: FileVolume | None = None) -> dict[str, Any]:
    """The batch/v1 Job of one publish pass (ids, dedupe, write): `completions` pods, pod `i` working
    indexes i, i + completions, ... of the pass (`bij-worker publish --stride`), each in the memory one
    index needs. The row-level work of publishing runs here, never in the operator.

    Same image, identity, storage settings and failure policy as the round's workers, but no GPU and
    none of the spot/GPU placement: publishing reads and writes storage, on any node.
    """
    body = render_job(job, 0, completions, plan_uri, image=image, owner_uid=owner_uid, file_volume=file_volume,
                      group=False)
    meta = body["metadata"]
    meta["name"] = publish_job_name(job, pass_name)
    for labels in (meta["labels"], body["spec"]["template"]["metadata"]["labels"]):
        labels.pop(ROUND_LABEL)
        labels["app.kubernetes.io/component"] = "publish"
        labels[PUBLISH_LABEL] = pass_name
    meta["annotations"] = {PUBLISH_PLAN_ANNOTATION: plan_uri}
    spec = body["spec"]
    # `completions` is already how many pods to run at once (each works every completions-th index):
    # fewer at a time would only run the strides one after another.
    spec["parallelism"] = completions
    spec["suspend"] = False  # publishing is short and follows a round the queue admitted
    meta["labels"].pop(KUEUE_QUEUE_LABEL, None)
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    container["args"] = ["publish", "--plan", plan_uri, "--pass", pass_name, "--stride", str(completions)]
    container["env"] = [e for e in container["env"] if e["name"] != "BIJ_MANIFEST"]
    container.pop("ports", None)
    limits = container.get("resources", {}).get("limits", {})
    limits.pop(GPU_RESOURCE, None)
    if "resources" in container and not limits:
        container["resources"].pop("limits", None)
    if not container.get("resources"):
        container.pop("resources", None)
    w = job.spec.workers
    for key in ("nodeSelector", "tolerations", "affinity"):
        pod.pop(key, None)
    if w.node_selector:
        pod["nodeSelector"] = dict(w.node_selector)
    if w.tolerations:
        pod["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in w.tolerations]
    if w.affinity:
        pod["affinity"] = copy.deepcopy(w.affinity)
    return body


# A step reads and writes small records (plans, footers, summaries): a small pod anywhere, never a GPU's.
STEP_RESOURCES = {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}
STEP_RESOURCES_ENV = "BIJ_STEP_RESOURCES"  # the chart's stepResources, as JSON


def step_resources_default() -> dict[str, Any]:
    """The step pods' container resources: env BIJ_STEP_RESOURCES (the chart value stepResources, JSON with
    `requests` and `limits`), else STEP_RESOURCES. ValueError naming the variable when it is not that shape."""
    text = os.environ.get(STEP_RESOURCES_ENV, "").strip()
    if not text:
        return copy.deepcopy(STEP_RESOURCES)
    try:
        got = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{STEP_RESOURCES_ENV} is not JSON ({e}): {text[:200]!r}") from None
    if (not isinstance(got, dict) or not got or set(got) - {"requests", "limits"}
            or not all(isinstance(v, dict) and all(isinstance(q, (str, int)) for q in v.values())
                       for v in got.values())):
        raise ValueError(f"{STEP_RESOURCES_ENV} must be an object of `requests` and/or `limits`, each mapping a "
                         f"resource to a quantity (the chart value stepResources): got {text[:200]!r}")
    return got


def steps_image_default() -> str:
    """The image step Jobs run: env BIJ_STEPS_IMAGE (chart value stepsImage: bij without an engine),
    else the worker image."""
    return os.environ.get("BIJ_STEPS_IMAGE") or worker_image_default()


def render_step_job(job: BatchInferenceJob, kind: str, round_no: int = 0, *, rounds: int = 0, plan_uri: str = "",
                    partial: str | None = None, image: str = DEFAULT_WORKER_IMAGE, owner_uid: str | None = None,
                    file_volume: FileVolume | None = None) -> dict[str, Any]:
    """The one-pod batch/v1 Job of one of the driver's storage steps (`bij.steps.main`): planning
    round `round_no`, its statistics once its Job ended, the publish plan, the manifest.

    Like a publish pass: the bij's service account and storage settings; but `image` (the steps image,
    bij without an engine) whatever spec.workers.image says, small requests, and none of the workers'
    placement (GPU, spot, spec.workers nodeSelector/tolerations/affinity) unless
    spec.workers.stepsOnWorkerNodes asks for it: a one-second step never waits for a GPU node or an
    engine's image. Its pod is retried as a lane is (spec.workers.backoffLimitPerIndex,
    disruptions not counted); an expected failure (access denied, a plan refused) is a report, not a
    failed pod. Its container's termination message falls back to the end of its log.
    """
    body = render_publish_job(job, "ids", 1, plan_uri, image=image, owner_uid=owner_uid, file_volume=file_volume)
    meta = body["metadata"]
    meta["name"] = step_job_name(job, kind, round_no)
    key = step_key(kind, round_no)
    for labels in (meta["labels"], body["spec"]["template"]["metadata"]["labels"]):
        labels.pop(PUBLISH_LABEL)
        labels["app.kubernetes.io/component"] = "step"
        labels[STEP_LABEL] = key
    w = job.spec.workers
    meta["annotations"] = {STEP_TRIES_ANNOTATION: str(w.backoff_limit_per_index)}
    spec = body["spec"]
    spec["maxFailedIndexes"] = 0
    spec["podFailurePolicy"] = {"rules": [
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]}
    pod = spec["template"]["spec"]
    for placement in ("nodeSelector", "tolerations", "affinity", "priorityClassName"):
        pod.pop(placement, None)
    if w.steps_on_worker_nodes:
        # Asked for: where nothing but the workers' pool may run (every node tainted for GPUs, say).
        node_selector, tolerations, affinity = _scheduling(job)
        pod.update({k: v for k, v in (("nodeSelector", node_selector), ("tolerations", tolerations),
                                      ("affinity", affinity)) if v})
    pod["volumes"] = [v for v in pod["volumes"] if v["name"] not in ("model-cache", "dshm")]
    (container,) = pod["containers"]
    container["image"] = image
    container["volumeMounts"] = [m for m in container["volumeMounts"] if m["name"] not in ("model-cache", "dshm")]
    container["resources"] = step_resources_default()
    container["terminationMessagePolicy"] = "FallbackToLogsOnError"
    container["env"] = [e for e in container["env"] if e["name"] != "HF_HOME"]
    args = ["step", kind, "--key", meta["name"], "--round", str(round_no), "--rounds", str(rounds),
            "--job-spec", json.dumps(job_to_dict(job), separators=(",", ":"))]
    if plan_uri:
        args += ["--plan", plan_uri]
    if partial:
        args += ["--partial", partial]
    container["args"] = args
    return body


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


def _pod_spec(job: BatchInferenceJob, manifest_uri: str, image: str,
              file_volume: FileVolume | None = None, pool: WorkerPool | None = None,
              lane_offset: int = 0) -> dict[str, Any]:
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
    node_selector, tolerations, affinity = _scheduling(job, pool)
    if node_selector:
        pod["nodeSelector"] = node_selector
    if tolerations:
        pod["tolerations"] = tolerations
    if affinity:
        pod["affinity"] = affinity
    if w.priority_class_name:
        pod["priorityClassName"] = w.priority_class_name
    return pod


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


def _scheduling(job: BatchInferenceJob, pool: WorkerPool | None = None
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
