"""Each kind of status patch the driver writes: built through the driver's own steps from one status, compared
key for key with the JSON merge patch the API is given (`StatusPatch.as_patch`)."""

from __future__ import annotations

import copy
import datetime as dt
from typing import Any

import pytest

from bij.contract.fingerprint import field_digests
from bij.contract.spec import SpecError, parse_job
from bij.contract.status import JobStatus, StatusPatch
from bij.contract.step_results import (
    FinishResult,
    ManifestSummary,
    PlanResult,
    PublishPlanResult,
)
from bij.control import driver as driver_module
from bij.control import driver_failures, driver_notify, driver_publish, driver_steps
from bij.control.decisions import (
    CanaryVerdict,
    CheckPermissions,
    CreateCanaryJob,
    FinishRound,
    MarkFailed,
    Nothing,
    PatchJob,
    PlanRound,
    PreparePublish,
    RerunStep,
    Retry,
    StopHeld,
    Wait,
)
from bij.control.driver import Driver
from bij.control.driver_types import Idle, Observed
from bij.control.observe import Lanes, Shards
from bij.control.permissions import WORKER_GRANTS, GrantCheck

NOW = dt.datetime(2026, 1, 1, 12, 0, tzinfo=dt.timezone.utc)
T = "2026-01-01T12:00:00Z"
EARLIER = "2026-01-01T11:00:00Z"
OUT = "file:///out/"

RUNNING: dict[str, Any] = {
    "phase": "Running", "round": 0, "startTime": EARLIER, "message": "round 0: running", "outputUri": OUT,
    "rounds": [{"round": 0, "shards": 4, "lanes": 2, "bytes": 100, "startTime": EARLIER,
                "specDigests": {"model": "d1"}}],
    "conditions": [{"type": "Ready", "status": "False", "reason": "Running", "message": "round 0: running",
                    "lastTransitionTime": EARLIER, "observedGeneration": 1}],
}


def cond(type_: str, status: str, reason: str, message: str, at: str = T) -> dict[str, Any]:
    """A condition as the driver writes it (observedGeneration 2)."""
    return {"lastTransitionTime": at, "message": message, "observedGeneration": 2, "reason": reason,
            "status": status, "type": type_}


def a_job(**spec: Any) -> Any:
    return parse_job({"apiVersion": "batchinference.io/v1alpha1", "kind": "BatchInferenceJob",
                      "metadata": {"name": "emb", "namespace": "ml", "uid": "bij-uid"},
                      "spec": {"input": {"uri": "file:///in/"}, "output": {"uri": OUT},
                               "model": {"engine": "echo", "task": "embed"}, **spec}})


class Recorder:
    """A bij whose status stays as given: each patch written is recorded, never applied."""

    worker_image = steps_image = "img"
    file_volume = None

    def __init__(self, job: Any, status: dict[str, Any], generation: int | None = 2):
        self.job, self.status, self.generation = job, status, generation
        self.patches: list[dict[str, Any]] = []
        self.lanes: Any = None

    def observe(self) -> Observed:
        return Observed(job=self.job, spec_error=None, status=copy.deepcopy(self.status), generation=self.generation,
                        output_uri=OUT, jobs=[], lanes=self.lanes)

    def create_job(self, body: dict[str, Any]) -> Any:
        return "created"

    def create_service(self, body: dict[str, Any]) -> None:
        pass

    def patch_job(self, name: str, spec: dict[str, Any]) -> None:
        pass

    def delete_job(self, name: str) -> None:
        pass

    def write_status(self, patch: dict[str, Any]) -> None:
        self.patches.append(patch)

    def event(self, type_: str, reason: str, message: str) -> None:
        pass

    def notify_key(self, ref: Any) -> bytes:
        return b"key"


SHARDS = Shards(done=1, total=4)
LANES = Lanes(done=0, failed=0, active=2, total=2)


def plan(driver: Driver, seen: Observed, job: Any) -> None:
    d = PlanRound(round=1, phase="Planning", reason="Planning", message="planning round 1",
                  result=PlanResult(shards=3, lanes=1, bytes=50, objects=2))
    driver.apply(seen, job, d)


def plan_canary(driver: Driver, seen: Observed, job: Any) -> None:
    d = PlanRound(round=0, phase="Planning", reason="Planning", message="planning round 0",
                  result=PlanResult(shards=8, lanes=2, bytes=800, objects=1, canary_shards=2))
    driver.apply(seen, job, d)


def canary_start(driver: Driver, seen: Observed, job: Any) -> None:
    driver.apply(seen, job, CreateCanaryJob(round=0, phase="Running", reason="Canary", message="canary",
                                            completions=1, canary_shards=2))


def canary_verdict(driver: Driver, seen: Observed, job: Any) -> None:
    canary = {"shards": 2, "rows": 20, "errors": 1, "lengthCuts": 0, "schemaViolations": 0, "tokensOut": 300,
              "laneSeconds": 4.0, "tokensPerSecondPerLane": 75.0, "verdict": "Failed",
              "broken": ["1 of 20 error rows (5.0%), above spec.canary.maxErrorShare 1.0%"],
              "examples": [{"id": "7", "code": "engine_error", "message": "boom"}],
              "estimate": {"rows": 80, "laneSeconds": 16.0, "seconds": 8.0}}
    driver.apply(seen, job, CanaryVerdict(round=0, phase="CanaryFailed", reason="CanaryFailed", message="failed",
                                          passed=False, canary=canary, shards=Shards(done=2, total=4)))


def patch_job(driver: Driver, seen: Observed, job: Any) -> None:
    driver.apply(seen, job, PatchJob(round=0, phase="Suspended", reason="Suspended", message="suspended",
                                     job_name="emb-r0", suspend=True, shards=SHARDS, lanes=LANES))


def rerun(driver: Driver, seen: Observed, job: Any) -> None:
    driver.apply(seen, job, RerunStep(round=0, phase="Running", reason="Running", message="again",
                                      job_name="emb-finish-r0"))


def finish(driver: Driver, seen: Observed, job: Any) -> None:
    result = FinishResult.model_validate({
        "done": 4, "stats": {"approved": 90, "errors": 10, "rowsIn": 100, "approvalRate": 1.0},
        "efficiency": {"workerSeconds": 12.5, "modelLoads": 2, "weightsBytes": 7},
        "cost": {"podsPerLane": 1, "pricePerHour": 3.6, "total": 0.0125}})
    driver.apply(seen, job, FinishRound(round=0, phase="Running", reason="Running", message="finishing",
                                        shards=Shards(done=4, total=4), lanes=Lanes(done=2, failed=0, active=0,
                                                                                    total=2, replaced=1),
                                        result=result))


def wait(driver: Driver, seen: Observed, job: Any) -> None:
    driver.apply(seen, job, Wait(round=0, phase="Running", reason="Running", message="round 0: 1/4 shards",
                                 shards=SHARDS, lanes=LANES))


def stop_held(driver: Driver, seen: Observed, job: Any) -> None:
    driver.apply(seen, job, StopHeld(round=0, phase="Cancelled", reason="Cancelled", message="cancelled, held"))


def nothing(driver: Driver, seen: Observed, job: Any) -> None:
    driver.apply(seen, job, Nothing(round=0, phase="Cancelled", reason="Cancelled", message="cancelled"))


def failed(driver: Driver, seen: Observed, job: Any) -> None:
    driver.apply(seen, job, MarkFailed(round=0, phase="Failed", reason="RoundFailed", message="lanes failed",
                                       shards=SHARDS))


def retry(driver: Driver, seen: Observed, job: Any) -> None:
    driver.apply(seen, job, Retry(round=0, phase="Running", reason="InputMissing", message="no input yet",
                                  delay=5.0))


def invalid(driver: Driver, seen: Observed, job: Any) -> None:
    driver.mark_invalid(seen, SpecError(["spec.model: required"]))


def damaged(driver: Driver, seen: Observed, job: Any) -> None:
    status = {**RUNNING, "rows": "many"}
    driver.say_damage(seen, Observed(job=job, spec_error=None, status=status, generation=2, output_uri=OUT,
                                     jobs=[]).state)


def permissions(driver: Driver, seen: Observed, job: Any) -> None:
    driver.worker_grants = lambda sa: GrantCheck("ml", sa, WORKER_GRANTS[:1])
    driver.apply(seen, job, CheckPermissions(round=0, phase="Pending", reason="CheckingPermissions",
                                             message="checking", service_account="bij-worker"))


def prepare_publish(driver: Driver, seen: Observed, job: Any) -> None:
    result = PublishPlanResult(plan_uri="file:///out/_bij/publish/plan.json", passes={"dedupe": 2, "results": 0})
    driver.apply(seen, job, PreparePublish(round=0, phase="Publishing", reason="Publishing", message="planning",
                                           rounds=1, partial="Cancelled", result=result))


def published(driver: Driver, seen: Observed, job: Any) -> None:
    summary = ManifestSummary.model_validate({
        "counts": {"rows": 90, "errors": 10, "notRun": 5}, "files": 1,
        "partial": {"phase": "Cancelled", "reason": "spec.cancel is true"},
        "workFilesRemoval": {"removed": 3, "left": "file:///out/_bij/x/", "error": "denied"}})
    d = PreparePublish(round=0, phase="Publishing", reason="Publishing", message="publishing", rounds=1)
    driver.published(seen, job, d, summary)


def notified(driver: Driver, seen: Observed, job: Any) -> None:
    driver.notify_ended(job, Idle(Nothing(round=0, phase="Succeeded", reason="Published", message="done")))


# What each step writes, key for key: the JSON the backend is given, as the driver wrote it when it built these
# patches as dicts (the clock frozen at T).
EXPECTED: dict[str, dict[str, Any]] = {
    "plan": {
        "conditions": [
            cond("Ready", "False", "Planning", "planning round 1", at=EARLIER),
            cond("Running", "True", "Planning", "planning round 1"),
            cond("Suspended", "False", "NotSuspended", "phase is Planning"),
            cond("Succeeded", "False", "NotSucceeded", "phase is Planning"),
            cond("Failed", "False", "NotFailed", "phase is Planning"),
        ],
        "message": "round 1: planned 3 shards in 1 lanes from 2 input objects (50 bytes)",
        "observedGeneration": 2,
        "outputUri": OUT,
        "phase": "Planning",
        "round": 1,
        "rounds": [
            {"bytes": 100, "lanes": 2, "round": 0, "shards": 4, "specDigests": {"model": "d1"}, "startTime": EARLIER},
            {"bytes": 50, "lanes": 1, "round": 1, "shards": 3, "startTime": T},
        ],
        "rows": {"done": 0, "failed": 0},
        "shards": {"done": 0, "total": 3},
        "shardsSummary": "0/3",
    },
    "plan_canary": {
        "conditions": [
            cond("Ready", "False", "Planning", "planning round 0"),
            cond("Running", "True", "Planning", "planning round 0"),
            cond("Suspended", "False", "NotSuspended", "phase is Planning"),
            cond("Succeeded", "False", "NotSucceeded", "phase is Planning"),
            cond("Failed", "False", "NotFailed", "phase is Planning"),
        ],
        "message": ("round 0: planned 8 shards in 2 lanes from 1 input objects (800 bytes); the"
                    " canary runs 2 of them, spread over the input, alone first"),
        "observedGeneration": 2,
        "outputUri": OUT,
        "phase": "Planning",
        "round": 0,
        "rounds": [
            {
                "bytes": 800,
                "canaryShards": 2,
                "lanes": 2,
                "round": 0,
                "shards": 8,
                "specDigests": field_digests(a_job()),
                "startTime": T,
            },
        ],
        "rows": {"done": 0, "failed": 0},
        "shards": {"done": 0, "total": 8},
        "shardsSummary": "0/8",
        "startTime": T,
    },
    "canary_start": {
        "canary": {"shards": 2},
        "conditions": [
            cond("Ready", "False", "Canary", "canary", at=EARLIER),
            cond("Running", "True", "Canary", "canary"),
            cond("Suspended", "False", "NotSuspended", "phase is Running"),
            cond("Succeeded", "False", "NotSucceeded", "phase is Running"),
            cond("Failed", "False", "NotFailed", "phase is Running"),
        ],
        "message": "canary: created Job emb-r0-canary with 1 lanes for 2 shards of round 0, spread over the input",
        "observedGeneration": 2,
        "outputUri": OUT,
        "phase": "Running",
        "round": 0,
    },
    "canary_verdict": {
        "canary": {
            "broken": ["1 of 20 error rows (5.0%), above spec.canary.maxErrorShare 1.0%"],
            "errors": 1,
            "estimate": {"laneSeconds": 16.0, "rows": 80, "seconds": 8.0},
            "examples": [{"code": "engine_error", "id": "7", "message": "boom"}],
            "laneSeconds": 4.0,
            "lengthCuts": 0,
            "rows": 20,
            "schemaViolations": 0,
            "shards": 2,
            "tokensOut": 300,
            "tokensPerSecondPerLane": 75.0,
            "verdict": "Failed",
        },
        "completionTime": T,
        "conditions": [
            cond("Ready", "False", "CanaryFailed", "failed", at=EARLIER),
            cond("Running", "False", "NotRunning", "phase is CanaryFailed"),
            cond("Suspended", "False", "NotSuspended", "phase is CanaryFailed"),
            cond("Succeeded", "False", "NotSucceeded", "phase is CanaryFailed"),
            cond("Failed", "True", "CanaryFailed", "failed"),
            cond("Canary", "False", "CanaryFailed", "failed"),
        ],
        "message": "failed",
        "observedGeneration": 2,
        "outputUri": OUT,
        "phase": "CanaryFailed",
        "round": 0,
        "shards": {"done": 2, "total": 4},
        "shardsSummary": "2/4",
    },
    "patch_job": {
        "conditions": [
            cond("Ready", "False", "Suspended", "suspended", at=EARLIER),
            cond("Running", "False", "NotRunning", "phase is Suspended"),
            cond("Suspended", "True", "Suspended", "suspended"),
            cond("Succeeded", "False", "NotSucceeded", "phase is Suspended"),
            cond("Failed", "False", "NotFailed", "phase is Suspended"),
        ],
        "lanes": {"active": 2, "done": 0, "failed": 0, "replaced": 0, "total": 2},
        "lanesSummary": "0/2",
        "message": "round 0: Job emb-r0 suspended (durable work is kept)",
        "observedGeneration": 2,
        "outputUri": OUT,
        "phase": "Suspended",
        "round": 0,
        "shards": {"done": 1, "total": 4},
        "shardsSummary": "1/4",
    },
    "rerun": {
        "conditions": [
            cond("Ready", "False", "Running", "again", at=EARLIER),
            cond("Running", "True", "Running", "again"),
            cond("Suspended", "False", "NotSuspended", "phase is Running"),
            cond("Succeeded", "False", "NotSucceeded", "phase is Running"),
            cond("Failed", "False", "NotFailed", "phase is Running"),
        ],
        "message": "again",
        "observedGeneration": 2,
        "outputUri": OUT,
        "phase": "Running",
        "round": 0,
    },
    "finish": {
        "conditions": [
            cond("Ready", "False", "Running", "finishing", at=EARLIER),
            cond("Running", "True", "Running", "finishing"),
            cond("Suspended", "False", "NotSuspended", "phase is Running"),
            cond("Succeeded", "False", "NotSucceeded", "phase is Running"),
            cond("Failed", "False", "NotFailed", "phase is Running"),
        ],
        "cost": {"podsPerLane": 1, "pricePerHour": 3.6, "total": 0.0125},
        "efficiency": {"modelLoads": 2, "weightsBytes": 7, "workerSeconds": 12.5},
        "lanes": {"active": 0, "done": 2, "failed": 0, "replaced": 1, "total": 2},
        "lanesSummary": "2/2 (1 replaced)",
        "message": "round 0 finished: 4/4 shards, 90 rows, 10 error rows; lane groups replaced: 1",
        "observedGeneration": 2,
        "outputUri": OUT,
        "phase": "Running",
        "round": 0,
        "rounds": [
            {
                "approvalRate": 1.0,
                "approved": 90,
                "bytes": 100,
                "capped": 0,
                "completionTime": T,
                "engineCalls": 0,
                "errors": 10,
                "groupsReplaced": 1,
                "lanes": 2,
                "rejected": 0,
                "round": 0,
                "rowsIn": 100,
                "shards": 4,
                "specDigests": {"model": "d1"},
                "startTime": EARLIER,
            },
        ],
        "rows": {"done": 90, "failed": 10},
        "rowsPerSecond": 0.03,
        "shards": {"done": 4, "total": 4},
        "shardsSummary": "4/4",
    },
    "wait": {
        "conditions": [
            cond("Ready", "False", "Running", "round 0: 1/4 shards", at=EARLIER),
            cond("Running", "True", "Running", "round 0: 1/4 shards"),
            cond("Suspended", "False", "NotSuspended", "phase is Running"),
            cond("Succeeded", "False", "NotSucceeded", "phase is Running"),
            cond("Failed", "False", "NotFailed", "phase is Running"),
        ],
        "eta": "3h00m",
        "lanes": {"active": 2, "done": 0, "failed": 0, "replaced": 0, "total": 2},
        "lanesSummary": "0/2",
        "message": "round 0: 1/4 shards",
        "observedGeneration": 2,
        "outputUri": OUT,
        "phase": "Running",
        "round": 0,
        "rows": {"done": 7, "failed": 1},
        "rowsPerSecond": 0.0,
        "shards": {"done": 1, "total": 4},
        "shardsSummary": "1/4",
    },
    "stop_held": {
        "completionTime": T,
        "conditions": [
            cond("Ready", "False", "Cancelled", "cancelled, held"),
            cond("Running", "False", "NotRunning", "phase is Cancelled"),
            cond("Suspended", "False", "NotSuspended", "phase is Cancelled"),
            cond("Succeeded", "False", "NotSucceeded", "phase is Cancelled"),
            cond("Failed", "False", "NotFailed", "phase is Cancelled"),
        ],
        "message": "cancelled, held",
        "observedGeneration": 2,
        "outputUri": OUT,
        "phase": "Cancelled",
        "round": 0,
    },
    "nothing": {
        "conditions": [
            cond("Ready", "False", "Cancelled", "cancelled", at=EARLIER),
            cond("Running", "False", "NotRunning", "phase is Cancelled"),
            cond("Suspended", "False", "NotSuspended", "phase is Cancelled"),
            cond("Succeeded", "False", "NotSucceeded", "phase is Cancelled"),
            cond("Failed", "False", "NotFailed", "phase is Cancelled"),
        ],
        "observedGeneration": 2,
    },
    "failed": {
        "completionTime": T,
        "conditions": [
            cond("Ready", "False", "RoundFailed", "lanes failed", at=EARLIER),
            cond("Running", "False", "NotRunning", "phase is Failed"),
            cond("Suspended", "False", "NotSuspended", "phase is Failed"),
            cond("Succeeded", "False", "NotSucceeded", "phase is Failed"),
            cond("Failed", "True", "RoundFailed", "lanes failed"),
        ],
        "message": "lanes failed",
        "observedGeneration": 2,
        "outputUri": OUT,
        "phase": "Failed",
        "round": 0,
        "rows": {"done": 0, "failed": 0},
        "rowsPerSecond": 0.0,
        "shards": {"done": 1, "total": 4},
        "shardsSummary": "1/4",
    },
    "retry": {
        "conditions": [
            cond("Ready", "False", "InputMissing", "no input yet", at=EARLIER),
            cond("Running", "True", "InputMissing", "no input yet"),
            cond("Suspended", "False", "NotSuspended", "phase is Running"),
            cond("Succeeded", "False", "NotSucceeded", "phase is Running"),
            cond("Failed", "False", "NotFailed", "phase is Running"),
        ],
        "message": "no input yet",
        "observedGeneration": 2,
        "outputUri": OUT,
        "phase": "Running",
        "round": 0,
    },
    "invalid": {
        "conditions": [
            cond("Ready", "False", "InvalidSpec", "invalid spec: spec.model: required", at=EARLIER),
            cond("Running", "False", "NotRunning", "phase is Failed"),
            cond("Suspended", "False", "NotSuspended", "phase is Failed"),
            cond("Succeeded", "False", "NotSucceeded", "phase is Failed"),
            cond("Failed", "True", "InvalidSpec", "invalid spec: spec.model: required"),
        ],
        "message": "invalid spec: spec.model: required",
        "observedGeneration": 2,
        "phase": "Failed",
    },
    "damaged": {
        "conditions": [
            {
                "lastTransitionTime": EARLIER,
                "message": "round 0: running",
                "observedGeneration": 1,
                "reason": "Running",
                "status": "False",
                "type": "Ready",
            },
            {
                "lastTransitionTime": T,
                "message": ("status entries left out as unreadable: status.rows: Input should be a"
                            " valid dictionary or instance of Rows"),
                "observedGeneration": 2,
                "reason": "UnreadableEntries",
                "status": "True",
                "type": "StatusDamaged",
            },
        ],
    },
    "permissions": {
        "conditions": [
            cond("Ready", "False", "CheckingPermissions", "checking", at=EARLIER),
            cond("Running", "False", "NotRunning", "phase is Pending"),
            cond("Suspended", "False", "NotSuspended", "phase is Pending"),
            cond("Succeeded", "False", "NotSucceeded", "phase is Pending"),
            cond("Failed", "False", "NotFailed", "phase is Pending"),
            {
                "lastTransitionTime": T,
                "message": ("system:serviceaccount:ml:bij-worker may not patch"
                            " batchinferencejobs/status.batchinference.io: its pods cannot report"
                            " into the bij's status, so the bij would never get past its first step;"
                            " no pod is started until it may (checked again every 120 s at most)."
                            " Fix: kubectl -n ml create role bij-worker --verb=patch"
                            " --resource=batchinferencejobs.batchinference.io/status && kubectl -n ml"
                            " create rolebinding bij-worker --role=bij-worker"
                            " --serviceaccount=ml:bij-worker  (or list ml in the chart's"
                            " workerServiceAccount.namespaces)"),
                "observedGeneration": 2,
                "reason": "MissingPermissions",
                "status": "False",
                "type": "WorkerPermissions",
            },
        ],
        "message": "checking",
        "observedGeneration": 2,
        "outputUri": OUT,
        "phase": "Pending",
        "round": 0,
        "workerPermissions": {
            "checkTime": T,
            "checks": 1,
            "message": ("system:serviceaccount:ml:bij-worker may not patch"
                        " batchinferencejobs/status.batchinference.io: its pods cannot report into"
                        " the bij's status, so the bij would never get past its first step; no pod is"
                        " started until it may (checked again every 120 s at most). Fix: kubectl -n"
                        " ml create role bij-worker --verb=patch"
                        " --resource=batchinferencejobs.batchinference.io/status && kubectl -n ml"
                        " create rolebinding bij-worker --role=bij-worker"
                        " --serviceaccount=ml:bij-worker  (or list ml in the chart's"
                        " workerServiceAccount.namespaces)"),
            "missing": ["patch batchinferencejobs/status.batchinference.io"],
            "result": "Missing",
            "serviceAccount": "bij-worker",
        },
    },
    "prepare_publish": {
        "conditions": [
            cond("Ready", "False", "Publishing", "planning", at=EARLIER),
            cond("Running", "True", "Publishing", "planning"),
            cond("Suspended", "False", "NotSuspended", "phase is Publishing"),
            cond("Succeeded", "False", "NotSucceeded", "phase is Publishing"),
            cond("Failed", "False", "NotFailed", "phase is Publishing"),
        ],
        "message": "publishing 1 round(s): passes dedupe 2, results 0 indexes (partial)",
        "observedGeneration": 2,
        "outputUri": OUT,
        "phase": "Publishing",
        "publish": {
            "partial": "Cancelled",
            "passes": {"dedupe": 2, "results": 0},
            "planUri": "file:///out/_bij/publish/plan.json",
            "rounds": 1,
            "startedAt": T,
        },
        "round": 0,
    },
    "published": {
        "completionTime": T,
        "conditions": [
            {
                "lastTransitionTime": T,
                "message": ("cancelled (spec.cancel is true): published 90 rows in 1 files (10 error"
                            " rows) to file:///out/manifest.json; 5 rows not run; RemovalFailed:"
                            " removing work files failed after 3 objects: denied; the rest are left"
                            " under file:///out/_bij/x/ (a rerun resumes the removal, or a bucket"
                            " lifecycle rule on the _bij/ prefix removes them)"),
                "observedGeneration": 2,
                "reason": "Cancelled",
                "status": "True",
                "type": "Ready",
            },
            cond("Running", "False", "NotRunning", "phase is Cancelled"),
            cond("Suspended", "False", "NotSuspended", "phase is Cancelled"),
            cond("Succeeded", "False", "NotSucceeded", "phase is Cancelled"),
            cond("Failed", "False", "NotFailed", "phase is Cancelled"),
            {
                "lastTransitionTime": T,
                "message": ("RemovalFailed: removing work files failed after 3 objects: denied; the"
                            " rest are left under file:///out/_bij/x/ (a rerun resumes the removal,"
                            " or a bucket lifecycle rule on the _bij/ prefix removes them)"),
                "observedGeneration": 2,
                "reason": "RemovalFailed",
                "status": "False",
                "type": "WorkFilesRemoved",
            },
        ],
        "manifestUri": "file:///out/manifest.json",
        "message": ("cancelled (spec.cancel is true): published 90 rows in 1 files (10 error rows) to"
                    " file:///out/manifest.json; 5 rows not run; RemovalFailed: removing work files"
                    " failed after 3 objects: denied; the rest are left under file:///out/_bij/x/ (a"
                    " rerun resumes the removal, or a bucket lifecycle rule on the _bij/ prefix"
                    " removes them)"),
        "observedGeneration": 2,
        "outputUri": OUT,
        "phase": "Cancelled",
        "round": 0,
        "rows": {"done": 90, "failed": 10, "notRun": 5},
        "rowsPerSecond": 0.0,
    },
    "notified": {
        "conditions": [
            {
                "lastTransitionTime": EARLIER,
                "message": "round 0: running",
                "observedGeneration": 1,
                "reason": "Running",
                "status": "False",
                "type": "Ready",
            },
            cond("Notified", "True", "Delivered", "every webhook of spec.notify was told"),
        ],
        "notified": [
            {"attempts": 1, "deliveredAt": T, "event": "succeeded", "gaveUp": False, "url": "http://hook.example/"},
        ],
    },
}


HOOK = [{"url": "http://hook.example/", "secretRef": {"name": "hooks", "key": "hmac"}}]


def patches_of(step: Any, job: Any, status: dict[str, Any], lanes: Any = None,
               generation: int | None = 2) -> list[dict[str, Any]]:
    """The status patches `step` writes through a driver whose clock stands at NOW."""
    backend = Recorder(job, status, generation)
    backend.lanes = lanes
    driver = Driver(backend, send=lambda *a: None)
    step(driver, backend.observe(), job)
    return backend.patches


@pytest.fixture(autouse=True)
def frozen_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in (driver_module, driver_failures, driver_notify, driver_publish, driver_steps):
        monkeypatch.setattr(module, "now_utc", lambda: NOW)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_kind_of_patch_the_driver_writes_is_this_json_key_for_key(name: str) -> None:
    from bij.contract.lane_report import tally

    job, status, lanes = a_job(), copy.deepcopy(RUNNING), None
    if name == "notified":
        job, status = a_job(notify=HOOK), {**status, "phase": "Succeeded", "completionTime": T}
    elif name == "plan_canary":
        status = {}
    elif name == "wait":
        lanes = tally([{"round": 0, "lane": 0, "rows": 7, "errors": 1, "bytes": 25}], 0)
    assert patches_of(globals()[name], job, status, lanes) == [EXPECTED[name]]


def test_a_field_set_to_none_is_written_as_null_so_the_merge_patch_deletes_it() -> None:
    assert StatusPatch(observed_generation=None, message="m").as_patch() == {"observedGeneration": None,
                                                                             "message": "m"}
    (patch,) = patches_of(invalid, a_job(), copy.deepcopy(RUNNING), generation=None)
    assert patch["observedGeneration"] is None
    assert "observedGeneration" not in patch["conditions"][-1]


def test_status_publish_is_read_typed() -> None:
    (patch,) = patches_of(prepare_publish, a_job(), copy.deepcopy(RUNNING))
    publish = JobStatus.read({**RUNNING, **patch}).publish
    assert publish is not None and publish.rounds == 1 and publish.passes == {"dedupe": 2, "results": 0}
    assert publish.plan_uri == "file:///out/_bij/publish/plan.json" and publish.partial == "Cancelled"
    assert publish.started_at == T
