"""`rules.canary`: with spec.canary, shards of round 0 spread over it run alone first, and their figures decide
whether the rest runs (`canary_gate`, `canary_verdict`)."""

from __future__ import annotations

from typing import Any

import pytest

from bij.contract.status import JobStatus
from bij.control.decisions import (
    CanaryVerdict,
    CheckCanary,
    CreateCanaryJob,
    CreateJob,
    MarkFailed,
    Nothing,
    PatchJob,
    Wait,
)
from bij.control.reconcile import decide
from bij.control.rules.canary import canary_gate
from rules.builders import (
    CANARY,
    CANARY_DONE,
    UID,
    canary_bij,
    canary_k8s_job,
    canary_planned,
    observation,
    with_figures,
)


def test_without_a_canary_round_0_creates_its_own_job_at_once() -> None:
    d = decide(canary_bij(None), canary_planned(), [])
    assert isinstance(d, CreateJob) and d.completions == 4


def test_with_a_canary_its_job_comes_first_for_the_first_shards_only() -> None:
    d = decide(canary_bij({"maxErrorShare": 0.1}), canary_planned(), [])
    assert isinstance(d, CreateCanaryJob)
    assert (d.canary_shards, d.completions, d.phase) == (CANARY, CANARY, "Running")


def test_a_running_canary_is_waited_for_and_no_round_job_is_made() -> None:
    d = decide(canary_bij({"maxErrorShare": 0.1}), canary_planned(), [canary_k8s_job(active=2)], shards_done=1)
    assert isinstance(d, Wait) and d.reason == "Canary" and d.shards is not None
    assert d.shards.summary == "1/2"


@pytest.mark.parametrize("spec", [{"suspend": True}, {"cancel": True}])
def test_suspending_or_cancelling_during_the_canary_suspends_its_job_so_its_lanes_drain(spec: dict[str, Any]) -> None:
    d = decide(canary_bij({"maxErrorShare": 0.1}, **spec), canary_planned(), [canary_k8s_job(active=2)])
    assert isinstance(d, PatchJob) and (d.job_name, d.suspend) == ("emb-r0-canary", True)


def test_a_finished_canary_is_counted_by_its_step() -> None:
    d = decide(canary_bij({"maxErrorShare": 0.1}), canary_planned(), [CANARY_DONE])
    assert isinstance(d, CheckCanary) and d.result is None
    assert d.step_args() == {"kind": "canary", "round_no": 0, "rounds": CANARY}


@pytest.mark.parametrize("canary, figures, failing", [
    ({"maxErrorShare": 0.1}, {"errors": 100, "rows": 100}, "100 of 100 error rows (100.0%), above "
                                                             "spec.canary.maxErrorShare 10.0%"),
    ({"maxLengthCutShare": 0.5}, {"lengthCuts": 60}, "60 of 100 answers cut at maxTokens (60.0%), above "
                                                     "spec.canary.maxLengthCutShare 50.0%"),
    ({"maxSchemaViolationShare": 0.0}, {"schemaViolations": 1, "errors": 1},
     "1 of 100 rows broke the schema (1.0%), above spec.canary.maxSchemaViolationShare 0.0%"),
    ({"minTokensPerSecondPerLane": 1000}, {}, "500.0 output tokens/s per lane, below "
                                              "spec.canary.minTokensPerSecondPerLane 1000"),
])
def test_each_broken_threshold_ends_the_job_canary_failed_with_its_figure_and_failing_rows(
        canary: dict[str, Any], figures: dict[str, Any], failing: str) -> None:
    status, step_job = with_figures(canary_planned(), **figures)
    d = decide(canary_bij(canary), status, [CANARY_DONE, step_job])
    assert isinstance(d, CanaryVerdict) and not d.passed
    assert (d.phase, d.reason) == ("CanaryFailed", "CanaryFailed")
    assert failing in d.message
    assert "id doc-7: template_error: the row has no column 'title'" in d.message
    assert "nothing was published" in d.message
    assert d.canary["verdict"] == "Failed" and d.canary["broken"] == [failing]


def test_a_canary_within_every_threshold_passes_with_the_estimate_of_the_whole_job() -> None:
    status, step_job = with_figures(canary_planned(), errors=5, lengthCuts=10, schemaViolations=0)
    job = canary_bij({"maxErrorShare": 0.1, "maxLengthCutShare": 0.2, "maxSchemaViolationShare": 0.0,
                    "minTokensPerSecondPerLane": 100}, price=3.6)
    d = decide(job, status, [CANARY_DONE, step_job])
    assert isinstance(d, CanaryVerdict) and d.passed and d.phase == "Running"
    # 40,000 of 4,000,000 bytes took 20 lane-seconds: the round takes 2,000, on 4 lanes 500 s; at 3.6 an hour, 2.
    assert d.canary["estimate"] == {"rows": 10_000, "laneSeconds": 2000.0, "seconds": 500.0, "cost": 2.0}
    assert "about 10,000 rows in 8m20s, costing about 2.000" in d.message


def test_after_the_canary_passed_round_0_runs_its_own_job_and_a_canary_failed_job_does_nothing_more() -> None:
    job = canary_bij({"maxErrorShare": 0.1})
    d = decide(job, canary_planned(canary={"shards": CANARY, "verdict": "Passed"}), [CANARY_DONE])
    assert isinstance(d, CreateJob) and d.completions == 4  # the canary's Job is not taken for the round's
    failed = decide(job, {**canary_planned(canary={"shards": CANARY, "verdict": "Failed"}), "phase": "CanaryFailed",
                          "message": "canary failed"}, [CANARY_DONE])
    assert isinstance(failed, Nothing) and failed.phase == "CanaryFailed"


def test_a_canary_job_that_failed_with_shards_left_fails_the_job() -> None:
    status, step_job = with_figures(canary_planned(), done=1)
    job_failed = canary_k8s_job((("Failed", "BackoffLimitExceeded"),))
    d = decide(canary_bij({"maxErrorShare": 0.1}), status, [job_failed, step_job])
    assert isinstance(d, MarkFailed) and "1 of 2 shards undone" in d.message


# --- canary_gate(): round 0's canary Job, its count, its verdict ---------------------------------------------

SPEC = {"maxErrorShare": 0.1}
JOBS = {"plain": canary_bij(SPEC), "suspended": canary_bij(SPEC, suspend=True)}
_queued = canary_bij(SPEC)
JOBS["queued"] = _queued.model_copy(update={"spec": _queued.spec.model_copy(update={
    "workers": _queued.spec.workers.model_copy(update={"queue_name": "gpu"})})})


def canary_job(*, suspend: bool = False, owner: str = UID, conditions: tuple[tuple[str, str], ...] = (),
               active: int = 0) -> dict[str, Any]:
    raw = canary_k8s_job(conditions, active=active)
    raw["spec"]["suspend"] = suspend
    raw["metadata"]["ownerReferences"] = [{"uid": owner}]
    return raw


@pytest.mark.parametrize(("job", "extra", "observed", "figures", "kind", "fields"), [
    ("plain", {"canary": {"shards": CANARY, "verdict": "Passed"}}, [], None, None, {}),
    ("plain", {}, [], None, CreateCanaryJob, {"completions": CANARY, "canary_shards": CANARY, "phase": "Running"}),
    ("plain", {}, [canary_job(owner="uid-of-the-old-object", active=2)], None, Wait, {"reason": "WaitingForOldJob"}),
    ("plain", {}, [canary_job(active=2)], None, Wait, {"reason": "Canary", "phase": "Running"}),
    ("suspended", {}, [canary_job(active=2)], None, PatchJob,
     {"suspend": True, "phase": "Suspended", "job_name": "emb-r0-canary"}),
    ("plain", {}, [canary_job(suspend=True)], None, PatchJob, {"suspend": False, "reason": "Canary"}),
    # Kueue admits a queued Job by unsuspending it: never the operator.
    ("queued", {}, [canary_job(suspend=True)], None, Wait, {"reason": "Queued", "phase": "Pending"}),
    ("suspended", {}, [canary_job(suspend=True)], None, Wait, {"reason": "Suspended", "phase": "Suspended"}),
    ("plain", {}, [CANARY_DONE], None, CheckCanary, {"result": None, "reason": "CanaryChecking"}),
    ("plain", {}, [CANARY_DONE], {"done": 1}, MarkFailed, {"reason": "JobFailed", "phase": "Failed"}),
    # A worker said the configuration is bad (exit 42): failed, though every canary shard got done.
    ("plain", {}, [canary_job(conditions=(("Failed", "PodFailurePolicy"),))], {}, MarkFailed,
     {"reason": "PodFailurePolicy"}),
    ("plain", {}, [CANARY_DONE], {}, CanaryVerdict, {"passed": True, "phase": "Running", "reason": "CanaryPassed"}),
    ("plain", {}, [CANARY_DONE], {"errors": 100}, CanaryVerdict,
     {"passed": False, "phase": "CanaryFailed", "reason": "CanaryFailed"}),
], ids=["passed-before", "no-job", "old-objects-job", "running", "suspend", "resume", "queued", "held-suspended",
        "ended-uncounted", "shards-left", "bad-configuration", "within-thresholds", "threshold-broken"])
def test_canary_gate(job: str, extra: dict[str, Any], observed: list[dict[str, Any]], figures: dict[str, Any] | None,
                     kind: type | None, fields: dict[str, Any]) -> None:
    status = canary_planned(**extra)
    jobs = list(observed)
    if figures is not None:
        status, step = with_figures(status, **figures)
        jobs.append(step)
    rec = JobStatus.read(status).round_records()[0]
    got = canary_gate(JOBS[job], observation(status, jobs), rec, 1)
    if kind is None:
        assert got is None
        return
    assert isinstance(got, kind), got
    assert {k: getattr(got, k) for k in fields} == fields
    if isinstance(got, (Wait, PatchJob)) and got.reason != "WaitingForOldJob":
        assert got.shards is not None and got.shards.summary == "1/2"
