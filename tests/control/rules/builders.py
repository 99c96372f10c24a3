"""Builders shared by the rules' tests: a bij, its status, the Jobs and pods the operator observes, and the
`Observation` and `JobView` a rule reads."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from bij.contract import codes
from bij.contract.spec import BatchInferenceJob, parse_job
from bij.contract.status import Condition, JobStatus
from bij.control.decisions import CreateJob, Decision
from bij.control.jobs import render_job
from bij.control.observe import Observation
from bij.control.reconcile import decide
from bij.control.status import decision_patch, rows_patch, with_condition, with_phase_conditions

UID = "0b6a2c1e-uid"
NOW = dt.datetime(2024, 1, 1, 1, 0, tzinfo=dt.timezone.utc)
# The publish plan's index count per pass, as a PreparePublish step records it.
PASSES = {"ids": 8, "dedupe": 3, "write": 8}
JUDGE = {"type": "regex", "pattern": "ok", "strategy": "rounds", "maxRounds": 3}


def make_job(*, suspend: bool = False, parallelism: int = 4, judge: dict | None = None,
             task: str = "embed", uid: str | None = UID, queue: str | None = None,
             max_error_ratio: float | None = None, **spec_fields: Any) -> BatchInferenceJob:
    """A bij of the echo engine; `spec_fields` are further top-level spec fields (cancel, canary, ...)."""
    spec: dict[str, Any] = {
        "input": {"uri": "file:///data/in"},
        "output": {"uri": "file:///data/out"},
        "model": {"engine": "echo", "task": task},
        "workers": {"parallelism": parallelism},
        "suspend": suspend,
        **spec_fields,
    }
    if queue:
        spec["workers"]["queueName"] = queue
    if max_error_ratio is not None:
        spec["maxErrorRatio"] = max_error_ratio
    if judge is not None:
        spec["judge"] = judge
    meta: dict[str, Any] = {"name": "emb", "namespace": "ml"}
    if uid:
        meta["uid"] = uid
    return parse_job({"apiVersion": "batchinference.io/v1alpha1", "kind": "BatchInferenceJob",
                      "metadata": meta, "spec": spec})


def planned(round_no: int = 0, shards: int = 8, done: bool = False, **extra: Any) -> dict[str, Any]:
    """A status whose rounds before `round_no` finished and round `round_no` is planned (`done`: finished too);
    `extra` goes into the round's record."""
    rounds = [{"round": r, "shards": shards, "startTime": "2024-01-01T00:00:00Z",
               "completionTime": "2024-01-01T01:00:00Z", "approved": 10, "rejected": 5} for r in range(round_no)]
    rec: dict[str, Any] = {"round": round_no, "shards": shards, "startTime": "2024-01-01T00:00:00Z"}
    if done:
        rec["completionTime"] = "2024-01-01T01:00:00Z"
    rec.update(extra)
    rounds.append(rec)
    return {"phase": "Running", "round": round_no, "rounds": rounds}


def k8s_job(round_no: int = 0, *, completions: int = 8, parallelism: int = 4, suspend: bool = False,
            completed: str = "", failed: str = "", active: int = 0,
            conditions: Sequence[tuple[str, str, str, str]] = (), owner_uid: str | None = UID,
            name: str = "emb", deleting: bool = False) -> dict[str, Any]:
    """Round `round_no`'s Job as the API server shows it; `conditions`: (type, status, reason, message)."""
    meta: dict[str, Any] = {
        "name": f"{name}-r{round_no}",
        "namespace": "ml",
        "labels": {codes.JOB_LABEL: name, codes.ROUND_LABEL: str(round_no)},
    }
    if owner_uid:
        meta["ownerReferences"] = [{"apiVersion": "batchinference.io/v1alpha1", "kind": "BatchInferenceJob",
                                    "name": name, "uid": owner_uid, "controller": True}]
    if deleting:
        meta["deletionTimestamp"] = "2024-01-01T00:00:00Z"
    status: dict[str, Any] = {"active": active}
    if completed:
        status["completedIndexes"] = completed
    if failed:
        status["failedIndexes"] = failed
    if conditions:
        status["conditions"] = [{"type": t, "status": s, "reason": r, "message": m}
                                for t, s, r, m in conditions]
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta,
            "spec": {"completions": completions, "parallelism": parallelism, "suspend": suspend,
                     "completionMode": "Indexed"},
            "status": status}


def counted(status: dict[str, Any], done: int, round_no: int = 0, damaged: Sequence[str] = ()) -> tuple[
        dict[str, Any], dict[str, Any]]:
    """`status` with the report of round `round_no`'s finish step (`done` shards), and that step's Job."""
    name = f"emb-finish-r{round_no}"
    step_job = {"metadata": {"name": name, "uid": "finish-uid", "labels": {codes.JOB_LABEL: "emb"}},
                "spec": {}, "status": {"conditions": [{"type": "Complete", "status": "True"}]}}
    report = {"jobUid": "finish-uid", "result": {"done": done, "damaged": list(damaged)}}
    return {**status, "reports": {"steps": {name: report}}}, step_job


def publish_pass_job(pass_name: str, state: str, *, owner_uid: str | None = UID) -> dict[str, Any]:
    """The Job of one publish pass: "done", "running" or "failed"."""
    j = k8s_job(completions=2, completed="0-1" if state == "done" else "", active=2 if state == "running" else 0,
                conditions=[("Complete", "True", "", "")] if state == "done" else
                [("Failed", "True", "FailedIndexes", "Job has failed indexes")] if state == "failed" else [],
                owner_uid=owner_uid)
    j["metadata"]["name"] = f"emb-publish-{pass_name}"
    del j["metadata"]["labels"][codes.ROUND_LABEL]
    j["metadata"]["labels"][codes.PUBLISH_LABEL] = pass_name
    return j


def publishing(**passes_done: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A status whose publish plan is written, and the pass Jobs: "done", "running" or "failed"."""
    status = planned(done=True)
    status["phase"] = "Publishing"
    status["publish"] = {"rounds": 1, "planUri": "file:///out/_bij/emb/publish/plan.json", "passes": PASSES}
    return status, [publish_pass_job(pass_name, state) for pass_name, state in passes_done.items()]


def step_job(name: str, *, uid: str = "step-uid", conditions: Sequence[tuple[str, str]] = (),
             owner_uid: str | None = UID, failed: int = 0, generation: int | None = None,
             at: str = "2024-01-01T00:59:00Z") -> dict[str, Any]:
    """A step's one-pod Job `name`; `conditions`: (type, reason), each true since `at`."""
    meta: dict[str, Any] = {"name": name, "uid": uid, "labels": {codes.JOB_LABEL: "emb"}}
    if generation is not None:
        meta["labels"][codes.GENERATION_LABEL] = str(generation)
    if owner_uid:
        meta["ownerReferences"] = [{"uid": owner_uid}]
    return {"metadata": meta, "spec": {},
            "status": {"failed": failed, "conditions": [{"type": t, "status": "True", "reason": r,
                                                         "lastTransitionTime": at} for t, r in conditions]}}


def reported(status: Mapping[str, Any], name: str, report: dict[str, Any], uid: str = "step-uid") -> dict[str, Any]:
    """`status` with step Job `name`'s report (its ``result`` or ``error``), made by the Job of `uid`."""
    return {**status, "reports": {"steps": {name: {"jobUid": uid, **report}}}}


def step_pod(job_name: str, index: int = 0, *, failed_with: int | None = None, waiting: str | None = None,
        created: str = "2024-01-01T00:30:00Z") -> dict[str, Any]:
    """A pod of step Job `job_name`: failed with an exit code, waiting for a reason (ErrImagePull), or running."""
    container: dict[str, Any] = {"name": "worker"}
    phase = "Running"
    if failed_with is not None:
        phase = "Failed"
        container["state"] = {"terminated": {"exitCode": failed_with, "reason": "Error"}}
    elif waiting is not None:
        phase = "Pending"
        container["state"] = {"waiting": {"reason": waiting, "message": f"{waiting}: the image"}}
    return {"metadata": {"name": f"{job_name}-{index}-x", "creationTimestamp": created,
                         "labels": {"batch.kubernetes.io/job-name": job_name}},
            "status": {"phase": phase, "containerStatuses": [container]}}


def observation(status: Mapping[str, Any] | None = None, jobs: Sequence[Mapping[str, Any]] = (),
                pods: Sequence[Mapping[str, Any]] = (), *, generation: int | None = None,
                now: dt.datetime = NOW) -> Observation:
    """What a rule sees beside the spec, as `decide()` builds it."""
    status = status or {}
    return Observation(status=status, state=JobStatus.read(status), jobs=jobs, pods=pods, generation=generation,
                       now=now)


# --- the worker identity's grants ----------------------------------------------------------------------

PATCH_STATUS = "patch batchinferencejobs/status.batchinference.io"


# --- spec.canary ---------------------------------------------------------------------------------------

SHARDS, CANARY = 40, 2


def canary_bij(canary: dict[str, Any] | None, price: float | None = None, **more: Any) -> Any:
    """A bij of the echo engine generating, with spec.canary `canary` (None: none)."""
    spec: dict[str, Any] = {**more, "input": {"uri": "file:///data/in"}, "output": {"uri": "file:///data/out"},
                            "model": {"engine": "echo", "task": "generate"}, "workers": {"parallelism": 4}}
    if price is not None:
        spec["workers"]["pricePerHour"] = price
    if canary is not None:
        spec["canary"] = canary
    return parse_job({"apiVersion": "batchinference.io/v1alpha1", "kind": "BatchInferenceJob",
                      "metadata": {"name": "emb", "namespace": "ml", "uid": UID}, "spec": spec})


def canary_planned(**extra: Any) -> dict[str, Any]:
    """Round 0 planned with `CANARY` canary shards of its `SHARDS`."""
    rec = {"round": 0, "shards": SHARDS, "lanes": 4, "bytes": 4_000_000, "startTime": "2024-01-01T00:00:00Z",
           "canaryShards": CANARY}
    return {"phase": "Running", "round": 0, "rounds": [rec], **extra}


def canary_k8s_job(conditions: tuple[tuple[str, str], ...] = (), active: int = 0) -> dict[str, Any]:
    """Round 0's canary Job; `conditions`: (type, reason), each true."""
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": "emb-r0-canary", "namespace": "ml",
                         "labels": {codes.JOB_LABEL: "emb", codes.ROUND_LABEL: "0", codes.CANARY_LABEL: "true"},
                         "ownerReferences": [{"uid": UID}]},
            "spec": {"completions": CANARY, "parallelism": CANARY},
            "status": {"active": active,
                       "conditions": [{"type": t, "status": "True", "reason": r} for t, r in conditions]}}


CANARY_DONE = canary_k8s_job((("Complete", ""),))


def with_figures(status: dict[str, Any], **figures: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """`status` with the canary step's report (100 rows over the 2 canary shards, 1% of the input's bytes, unless
    `figures` say otherwise), and that step's Job."""
    result = {"done": CANARY, "shards": CANARY, "rows": 100, "errors": 0, "lengthCuts": 0, "schemaViolations": 0,
              "tokensOut": 10_000, "laneSeconds": 20.0, "bytes": 40_000,
              "examples": [{"id": "doc-7", "code": "template_error", "message": "the row has no column 'title'"}],
              **figures}
    step_job = {"metadata": {"name": "emb-canary", "uid": "canary-uid", "labels": {codes.JOB_LABEL: "emb"}},
                "spec": {}, "status": {"conditions": [{"type": "Complete", "status": "True"}]}}
    return {**status, "reports": {"steps": {"emb-canary": {"jobUid": "canary-uid", "result": result}}}}, step_job


# --- spec.workers.pools --------------------------------------------------------------------------------

SPOT = {"name": "spot", "nodeSelector": {"pool": "spot"}, "spot": True, "pricePerHour": 1.0, "maxLanes": 2,
        "startTimeoutSeconds": 120, "queueName": "spot-queue", "gpus": 1, "tensorParallelSize": 1}
OD = {"name": "od", "nodeSelector": {"pool": "od"}, "pricePerHour": 3.0, "gpus": 2, "tensorParallelSize": 2}


def pooled(*pool_specs: dict[str, Any], suspend: bool = False) -> BatchInferenceJob:
    """A bij of 4 lanes at once over spec.workers.pools `pool_specs`, in order of preference."""
    return parse_job({"apiVersion": "batchinference.io/v1alpha1", "kind": "BatchInferenceJob",
                      "metadata": {"name": "emb", "namespace": "ml", "uid": UID},
                      "spec": {"input": {"uri": "file:///data/in"}, "output": {"uri": "file:///data/out"},
                               "model": {"engine": "vllm", "task": "generate", "name": "m"},
                               "workers": {"parallelism": 4, "pools": list(pool_specs)}, "suspend": suspend}})


def pool_planned(round_no: int = 0, shards: int = 8, lanes: int = 4, **status: Any) -> dict[str, Any]:
    """Round `round_no` planned in `lanes` lanes, the rounds before it finished; `status`: more status fields."""
    rounds = [{"round": r, "shards": shards, "lanes": lanes, "startTime": "2024-01-01T00:00:00Z",
               "completionTime": "2024-01-01T00:30:00Z"} for r in range(round_no)]
    rounds.append({"round": round_no, "shards": shards, "lanes": lanes, "startTime": "2024-01-01T00:00:00Z"})
    return {"phase": "Running", "round": round_no, "rounds": rounds, **status}


def made(job: BatchInferenceJob, d: CreateJob, **status: Any) -> dict[str, Any]:
    """The Job the driver would create for `d`, as the API server then shows it."""
    pool = next(p for p in job.spec.workers.pools if p.name == d.pool)
    body = render_job(job, d.round, d.completions, "file:///data/out/_bij/emb/round-0/shards.json",
                      owner_uid=UID, pool=pool, name_suffix=d.name_suffix, lane_offset=d.lane_offset)
    body["metadata"]["uid"] = f"uid-{body['metadata']['name']}"
    body["spec"]["suspend"] = False  # admitted by Kueue
    body["status"] = status
    return body


def pool_pod(job_name: str, index: int, *, created: str, unschedulable: bool = False, running: bool = False,
             preempted: bool = False) -> dict[str, Any]:
    """A pod of a pool's Job: pending (`unschedulable`: no node takes it), running, or preempted."""
    conditions = []
    phase = "Pending"
    if unschedulable:
        conditions.append({"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                           "message": "0/3 nodes are available: 3 node(s) didn't match Pod's node affinity/selector."})
    if running:
        phase = "Running"
        conditions.append({"type": "PodScheduled", "status": "True"})
    if preempted:
        phase = "Failed"
        conditions += [{"type": "PodScheduled", "status": "True"},
                       {"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}]
    return {"metadata": {"name": f"{job_name}-{index}-x", "creationTimestamp": created,
                         "labels": {"batch.kubernetes.io/job-name": job_name}},
            "status": {"phase": phase, "conditions": conditions}}


def env_of(body: dict[str, Any]) -> dict[str, str]:
    (container,) = body["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value") for e in container["env"]}


def start_pools(job: BatchInferenceJob, status: dict[str, Any]) -> list[dict[str, Any]]:
    """Decide until no Job is left to create; the Jobs made."""
    jobs: list[dict[str, Any]] = []
    while isinstance(d := decide(job, status, jobs, now=NOW), CreateJob):
        jobs.append(made(job, d, active=d.completions))
    return jobs


# --- the status patch as JSON, as the merge patch writes it (the driver builds it typed: control.status) ---


def set_condition(conditions: Iterable[Mapping[str, Any]], type_: str, status: bool | None, reason: str,
                  message: str, *, generation: int | None, now: dt.datetime) -> list[dict[str, Any]]:
    """`with_condition` on conditions as JSON (as the status holds them)."""
    out = with_condition([Condition.model_validate(c) for c in conditions], type_, status, reason, message,
                         generation=generation, now=now)
    return [c.as_status() for c in out]


def phase_conditions(conditions: Iterable[Mapping[str, Any]], phase: str, reason: str, message: str, *,
                     generation: int | None, now: dt.datetime, ready: bool | None = None) -> list[dict[str, Any]]:
    """`with_phase_conditions` on conditions as JSON (as the status holds them)."""
    out = with_phase_conditions([Condition.model_validate(c) for c in conditions], phase, reason, message,
                                generation=generation, now=now, ready=ready)
    return [c.as_status() for c in out]


def rows_progress(
    records: Iterable[Mapping[str, Any]],
    started: str | None,
    now: dt.datetime,
) -> dict[str, Any]:
    """``rows`` and ``rowsPerSecond`` from the finished shards' completion records.

    Throughput is over wall time since ``startTime``: what a user waiting for the job sees,
    including scheduling and preemption, not the per-pod engine speed.
    """
    done = failed = 0
    for rec in records:
        done += int(rec.get("rows") or 0)
        failed += int(rec.get("errors") or 0)
    return rows_patch(done, failed, started, now).as_patch()


def decision_status(old: Mapping[str, Any], decision: Decision, *, generation: int | None, now: dt.datetime,
                    output_uri: str) -> dict[str, Any]:
    """`decision_patch` on the status as JSON, as the merge patch writes it."""
    return decision_patch(JobStatus.read(old), decision, generation=generation, now=now,
                          output_uri=output_uri).as_patch()
