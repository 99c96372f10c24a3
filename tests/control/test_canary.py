"""spec.canary in decide(): shards of round 0 spread over it run alone, and their figures decide whether the rest
runs."""

from __future__ import annotations

from typing import Any

import pytest

from bij.contract import codes
from bij.contract.canary import CanaryFigures, broken, canary_rows, canary_shards, estimate, spread_count
from bij.contract.spec import CanarySpec, parse_job
from bij.control import observe
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

UID = "0b6a2c1e-uid"
SHARDS, CANARY = 40, 2


def make_job(canary: dict[str, Any] | None, price: float | None = None, **more: Any) -> Any:
    spec: dict[str, Any] = {**more, "input": {"uri": "file:///data/in"}, "output": {"uri": "file:///data/out"},
                            "model": {"engine": "echo", "task": "generate"}, "workers": {"parallelism": 4}}
    if price is not None:
        spec["workers"]["pricePerHour"] = price
    if canary is not None:
        spec["canary"] = canary
    return parse_job({"apiVersion": "batchinference.io/v1alpha1", "kind": "BatchInferenceJob",
                      "metadata": {"name": "emb", "namespace": "ml", "uid": UID}, "spec": spec})


def planned(**extra: Any) -> dict[str, Any]:
    rec = {"round": 0, "shards": SHARDS, "lanes": 4, "bytes": 4_000_000, "startTime": "2024-01-01T00:00:00Z",
           "canaryShards": CANARY}
    return {"phase": "Running", "round": 0, "rounds": [rec], **extra}


def canary_k8s_job(conditions: tuple[tuple[str, str], ...] = (), active: int = 0) -> dict[str, Any]:
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": "emb-r0-canary", "namespace": "ml",
                         "labels": {codes.JOB_LABEL: "emb", codes.ROUND_LABEL: "0", codes.CANARY_LABEL: "true"},
                         "ownerReferences": [{"uid": UID}]},
            "spec": {"completions": CANARY, "parallelism": CANARY},
            "status": {"active": active,
                       "conditions": [{"type": t, "status": "True", "reason": r} for t, r in conditions]}}


DONE = canary_k8s_job((("Complete", ""),))


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


def test_without_a_canary_round_0_creates_its_own_job_at_once() -> None:
    d = decide(make_job(None), planned(), [])
    assert isinstance(d, CreateJob) and d.completions == 4


def test_with_a_canary_its_job_comes_first_for_the_first_shards_only() -> None:
    d = decide(make_job({"maxErrorShare": 0.1}), planned(), [])
    assert isinstance(d, CreateCanaryJob)
    assert (d.canary_shards, d.completions, d.phase) == (CANARY, CANARY, "Running")


def test_a_running_canary_is_waited_for_and_no_round_job_is_made() -> None:
    d = decide(make_job({"maxErrorShare": 0.1}), planned(), [canary_k8s_job(active=2)], shards_done=1)
    assert isinstance(d, Wait) and d.reason == "Canary" and d.shards is not None
    assert d.shards.summary == "1/2"


@pytest.mark.parametrize("spec", [{"suspend": True}, {"cancel": True}])
def test_suspending_or_cancelling_during_the_canary_suspends_its_job_so_its_lanes_drain(spec: dict[str, Any]) -> None:
    d = decide(make_job({"maxErrorShare": 0.1}, **spec), planned(), [canary_k8s_job(active=2)])
    assert isinstance(d, PatchJob) and (d.job_name, d.suspend) == ("emb-r0-canary", True)


def test_a_finished_canary_is_counted_by_its_step() -> None:
    d = decide(make_job({"maxErrorShare": 0.1}), planned(), [DONE])
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
    status, step_job = with_figures(planned(), **figures)
    d = decide(make_job(canary), status, [DONE, step_job])
    assert isinstance(d, CanaryVerdict) and not d.passed
    assert (d.phase, d.reason) == ("CanaryFailed", "CanaryFailed")
    assert failing in d.message
    assert "id doc-7: template_error: the row has no column 'title'" in d.message
    assert "nothing was published" in d.message
    assert d.canary["verdict"] == "Failed" and d.canary["broken"] == [failing]


def test_a_canary_within_every_threshold_passes_with_the_estimate_of_the_whole_job() -> None:
    status, step_job = with_figures(planned(), errors=5, lengthCuts=10, schemaViolations=0)
    job = make_job({"maxErrorShare": 0.1, "maxLengthCutShare": 0.2, "maxSchemaViolationShare": 0.0,
                    "minTokensPerSecondPerLane": 100}, price=3.6)
    d = decide(job, status, [DONE, step_job])
    assert isinstance(d, CanaryVerdict) and d.passed and d.phase == "Running"
    # 40,000 of 4,000,000 bytes took 20 lane-seconds: the round takes 2,000, on 4 lanes 500 s; at 3.6 an hour, 2.
    assert d.canary["estimate"] == {"rows": 10_000, "laneSeconds": 2000.0, "seconds": 500.0, "cost": 2.0}
    assert "about 10,000 rows in 8m20s, costing about 2.000" in d.message


def test_after_the_canary_passed_round_0_runs_its_own_job_and_a_canary_failed_job_does_nothing_more() -> None:
    job = make_job({"maxErrorShare": 0.1})
    d = decide(job, planned(canary={"shards": CANARY, "verdict": "Passed"}), [DONE])
    assert isinstance(d, CreateJob) and d.completions == 4  # the canary's Job is not taken for the round's
    failed = decide(job, {**planned(canary={"shards": CANARY, "verdict": "Failed"}), "phase": "CanaryFailed",
                          "message": "canary failed"}, [DONE])
    assert isinstance(failed, Nothing) and failed.phase == "CanaryFailed"


def test_a_canary_job_that_failed_with_shards_left_fails_the_job() -> None:
    status, step_job = with_figures(planned(), done=1)
    job_failed = canary_k8s_job((("Failed", "BackoffLimitExceeded"),))
    d = decide(make_job({"maxErrorShare": 0.1}), status, [job_failed, step_job])
    assert isinstance(d, MarkFailed) and "1 of 2 shards undone" in d.message


# --- the pure parts -----------------------------------------------------------------------------


def test_the_default_canary_is_half_a_percent_of_the_rows_at_most_2000_and_one_at_least() -> None:
    assert canary_rows(CanarySpec(), 10_000) == 50
    assert canary_rows(CanarySpec(), 10_000_000) == 2000
    assert canary_rows(CanarySpec(), 3) == 1
    assert canary_rows(CanarySpec(rows=700), 10_000_000) == 700


def test_the_canarys_shards_are_spread_over_the_round_one_at_the_middle_of_each_stretch() -> None:
    # One in each tenth of the plan (which is in input order), at its middle.
    assert canary_shards(1000, 10) == [50, 150, 250, 350, 450, 550, 650, 750, 850, 950]
    assert canary_shards(100, 3) == [16, 50, 83]
    assert canary_shards(5, 2) == [1, 3]
    assert canary_shards(7, 7) == list(range(7))  # the whole round
    assert canary_shards(7, 9) == list(range(7))
    assert canary_shards(1, 1) == [0]
    for total in range(1, 60):
        for count in range(1, total + 1):
            got = canary_shards(total, count)
            assert len(set(got)) == count and got == sorted(got) and 0 <= got[0] and got[-1] < total
            # The j-th holds the middle of the j-th stretch, (j + 1/2) * total / count.
            assert all(2 * s * count <= (2 * j + 1) * total < 2 * (s + 1) * count for j, s in enumerate(got))


def test_the_canary_takes_as_many_spread_shards_as_hold_its_rows() -> None:
    assert spread_count([30] * 10, 50) == 2
    assert spread_count([30] * 10, 10) == 1
    assert spread_count([30] * 10, 500) == 10
    assert spread_count([], 10) == 0
    # Shards of unequal length: grown until the shards it takes hold the rows, whichever those are.
    rows = [10.0, 1.0] * 50
    count = spread_count(rows, 40)
    assert sum(rows[s] for s in canary_shards(100, count)) >= 40


def test_no_threshold_set_breaks_nothing_and_figures_read_from_records() -> None:
    f = CanaryFigures.of([{"rows": 8, "errors": 2, "lengthCuts": 3, "tokensOut": 50, "seconds": 5.0, "bytes": 10},
                          {"rows": 10, "errors": 0, "seconds": 5.0, "bytes": 10}])  # an older worker: no lengthCuts
    assert (f.rows_in, f.errors, f.length_cuts, f.tokens_per_second_per_lane) == (20, 2, 3, 5.0)
    assert broken(CanarySpec(), f) == []
    assert estimate(f, 100, 2, None) == {"rows": 100, "laneSeconds": 50.0, "seconds": 25.0}


def test_the_canary_job_is_the_round_job_whose_lanes_work_only_the_first_shards() -> None:
    from bij.contract.codes import CANARY_SHARDS_ENV
    from bij.control.jobs import render_canary_job, render_job

    job = make_job({"maxErrorShare": 0.1})
    body = render_canary_job(job, 2, CANARY, "file:///data/out/_bij/x/round-0/shards.json")
    round_body = render_job(job, 0, 2, "file:///data/out/_bij/x/round-0/shards.json")
    assert body["metadata"]["name"] == "emb-r0-canary" != round_body["metadata"]["name"]
    assert body["metadata"]["labels"][codes.CANARY_LABEL] == "true"
    (container,) = body["spec"]["template"]["spec"]["containers"]
    assert {"name": CANARY_SHARDS_ENV, "value": str(CANARY)} in container["env"]
    assert observe.round_job(job, 0, [body]) is None and observe.canary_job(job, [body]) is not None


def test_a_worker_of_a_canary_job_works_only_the_canarys_spread_shards_and_refuses_a_bad_count() -> None:
    from bij.contract.codes import CANARY_SHARDS_ENV
    from bij.worker.main import worked_shards
    from bij.worker.shard import BadConfig

    assert worked_shards(40, {}) is None  # the round's
    assert worked_shards(40, {CANARY_SHARDS_ENV: "3"}) == [6, 20, 33]
    assert worked_shards(2, {CANARY_SHARDS_ENV: "3"}) == [0, 1]
    with pytest.raises(BadConfig, match="BIJ_CANARY_SHARDS must be a positive number of shards, not '0'"):
        worked_shards(40, {CANARY_SHARDS_ENV: "0"})
