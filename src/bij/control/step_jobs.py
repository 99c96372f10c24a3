"""The one-pod Jobs of the driver's storage steps and the Jobs of the publish passes: each the round's Job
(`jobs.render_job`) reshaped for storage work, without GPUs or the workers' placement."""

from __future__ import annotations

import copy
import json
import os
from typing import Any

from bij.contract.codes import (
    PUBLISH_LABEL,
    PUBLISH_PLAN_ANNOTATION,
    ROUND_LABEL,
    STEP_LABEL,
)
from bij.contract.spec import BatchInferenceJob, job_to_dict
from bij.control.file_volume import FileVolume
from bij.control.jobs import DEFAULT_WORKER_IMAGE, KUEUE_QUEUE_LABEL, render_job, worker_image_default
from bij.control.observe import step_job_name, step_key
from bij.control.rules.steps import STEP_TRIES_ANNOTATION
from bij.control.worker_pod import GPU_RESOURCE, scheduling


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
        node_selector, tolerations, affinity = scheduling(job)
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
