"""`decide()` as a dispatcher: which rule answers, in which order. Each rule's own tests are in tests/control/rules/
(one file per module of `bij.control.rules`)."""

from __future__ import annotations

from typing import Any

from rules.builders import PASSES, k8s_job, make_job

from bij.contract import codes
from bij.control.decisions import (
    CreateJob,
    CreatePublishJob,
    FinishRound,
    Nothing,
    PlanRound,
    PreparePublish,
    Publish,
    Wait,
)
from bij.control.reconcile import decide


def test_a_new_job_plans_round_zero() -> None:
    d = decide(make_job(), {}, [])
    assert isinstance(d, PlanRound)
    assert (d.round, d.phase) == (0, "Planning")


# --- replaying a whole run -----------------------------------------------------------------------------


def test_replaying_the_decisions_of_a_whole_run_reaches_succeeded_with_one_job_per_round_and_pass() -> None:
    """Apply each decision to a fake cluster the way the handler does, and count Jobs."""
    job = make_job()
    status: dict[str, Any] = {}
    jobs: list[dict[str, Any]] = []
    created: list[str] = []
    for step in range(30):  # noqa: B007 - asserted after the loop
        d = decide(job, status, jobs)
        status.update({"phase": d.phase, "round": d.round})
        if isinstance(d, PlanRound):
            status.setdefault("rounds", []).append({"round": d.round, "shards": 12, "lanes": 3})
        elif isinstance(d, CreateJob):
            created.append("r0")
            jobs.append(k8s_job(completions=d.completions, parallelism=3, active=3))
        elif isinstance(d, CreatePublishJob):
            created.append(d.pass_name)
            j = k8s_job(completions=d.completions, parallelism=d.completions, active=d.completions)
            del j["metadata"]["labels"][codes.ROUND_LABEL]
            j["metadata"]["labels"][codes.PUBLISH_LABEL] = d.pass_name
            jobs.append(j)
        elif isinstance(d, Wait):
            # The Job controller finishes every index of the Job last created.
            n = jobs[-1]["spec"]["completions"]
            jobs[-1]["status"] = {"completedIndexes": f"0-{n - 1}", "conditions": [
                {"type": "Complete", "status": "True"}]}
        elif isinstance(d, FinishRound):
            status["rounds"][d.round]["completionTime"] = "2024-01-01T01:00:00Z"
        elif isinstance(d, PreparePublish):
            status["publish"] = {"rounds": d.rounds, "planUri": "file:///p.json", "passes": PASSES}
        elif isinstance(d, Publish):
            status["phase"] = "Succeeded"
        elif isinstance(d, Nothing):
            break
    assert status["phase"] == "Succeeded"
    assert created == ["r0", "ids", "dedupe", "write"]
    assert jobs[0]["spec"]["completions"] == 3  # a Job of 3 lanes for 12 shards
    assert step < 20
