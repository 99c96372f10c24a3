"""The batch/v1 Job of one round: an Indexed Job whose pod `i` is lane `i` of the round plan.

A lane loads the model once and works its shards `i`, `i + lanes`, ..., then unfinished shards of
other lanes (bij.worker.lanes), so the Job has one index per lane, not per shard.

`render_job` is a pure function of the spec and the round; the operator creates what it returns
and `bij render` prints it. Everything that decides how a round survives spot preemptions lives
here (the pod failure policy, per-index retries) and in its pod (`worker_pod`: spot scheduling,
the grace period).
"""

from __future__ import annotations

import os
from typing import Any

from bij.contract.codes import (
    API_GROUP,
    CANARY_LABEL,
    CANARY_SHARDS_ENV,
    EXIT_BAD_CONFIG,
    EXIT_GROUP_LOST,
    GROUP_LEADER_ENV,
    GROUP_PORT,
    JOB_LABEL,
    LANE_OFFSET_ANNOTATION,
    MANIFEST_ANNOTATION,
    NODES_PER_LANE_ANNOTATION,
    NODES_PER_LANE_ENV,
    POOL_LABEL,
    RAY_PORT,
    ROUND_ENV,
    ROUND_LABEL,
)
from bij.contract.spec import API_VERSION, KIND, BatchInferenceJob
from bij.contract.spec_workers import WorkerPool
from bij.control.file_volume import FileVolume
from bij.control.rules.rounds import desired_parallelism
from bij.control.worker_pod import WORKER_CONTAINER, pod_spec

DEFAULT_WORKER_IMAGE = "ghcr.io/bij-project/bij-worker:0.1.0"
# Kubernetes caps completions at 10^5 when backoffLimitPerIndex is set.
MAX_COMPLETIONS = 100_000

KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"

# A lane of several pods (spec.workers.nodesPerLane): its pods reach the leader (rank 0) by the stable name
# `<job>-<index>.<service>` a headless Service gives an Indexed Job's pods (their hostname and subdomain).
# Its ports and env names are bij.contract.codes' (RAY_PORT, GROUP_PORT, NODES_PER_LANE_ENV, ...).


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
        metadata["ownerReferences"] = _owner_references(job, owner_uid)
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


def render_job(job: BatchInferenceJob, round_no: int, completions: int, manifest_uri: str, *,
               image: str = DEFAULT_WORKER_IMAGE, owner_uid: str | None = None, file_volume: FileVolume | None = None,
               group: bool = True, pool: WorkerPool | None = None, name_suffix: str = "",
               lane_offset: int = 0) -> dict[str, Any]:
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
    queue_name = pool.queue_name if pool is not None and pool.queue_name else w.queue_name
    metadata = _round_metadata(job, job_name(job, round_no) + name_suffix, labels, manifest_uri,
                               queue_name=queue_name, lane_offset=None if pool is None else lane_offset,
                               owner_uid=owner_uid)
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
        "maxFailedIndexes": completions if w.max_failed_indexes is None else min(w.max_failed_indexes, completions),
        "podFailurePolicy": {"rules": _failure_rules()},
        # A replacement pod starts only once the old one has fully terminated, so it may take its
        # lane's claims at once: the preempted pod has committed its last chunk.
        "podReplacementPolicy": "Failed",
        "template": {
            "metadata": {
                "labels": dict(labels),
                "annotations": {"kubectl.kubernetes.io/default-container": WORKER_CONTAINER},
            },
            "spec": pod_spec(job, manifest_uri, w.image or image, file_volume, pool, lane_offset),
        },
    }
    if w.ttl_seconds_after_finished is not None:
        spec["ttlSecondsAfterFinished"] = w.ttl_seconds_after_finished
    if nodes > 1:
        _group_lanes(metadata, spec, job, nodes, round_no)
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata, "spec": spec}


def _owner_references(job: BatchInferenceJob, owner_uid: str) -> list[dict[str, Any]]:
    """The reference that makes the BatchInferenceJob own (and garbage-collect) what it is put on."""
    return [{"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": KIND, "name": job.metadata.name,
             "uid": owner_uid, "controller": True, "blockOwnerDeletion": True}]


def _round_metadata(job: BatchInferenceJob, name: str, labels: dict[str, str], manifest_uri: str, *,
                    queue_name: str | None, lane_offset: int | None, owner_uid: str | None) -> dict[str, Any]:
    """The round Job's metadata: its labels (and Kueue's queue), the plan it works, the first lane of a
    pool's Job (`lane_offset`), its owner."""
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": job.metadata.namespace,
        "labels": dict(labels),
        "annotations": {MANIFEST_ANNOTATION: manifest_uri},
    }
    if queue_name:
        metadata["labels"][KUEUE_QUEUE_LABEL] = queue_name
    if lane_offset is not None:
        metadata["annotations"][LANE_OFFSET_ANNOTATION] = str(lane_offset)
    if owner_uid:
        metadata["ownerReferences"] = _owner_references(job, owner_uid)
    return metadata


def _failure_rules() -> list[dict[str, Any]]:
    """The round Job's podFailurePolicy rules (`_group_lanes` adds one for a lane of several pods)."""
    return [
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
