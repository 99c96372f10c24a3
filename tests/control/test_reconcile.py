"""`decide()` as a dispatcher: which rule answers, in which order. Each rule's own tests are in tests/control/rules/
(one file per module of `bij.control.rules`)."""

from __future__ import annotations

from typing import Any

import pytest
from rules.builders import JUDGE, NOW, OD, PASSES, SPOT, k8s_job, make_job, planned, pooled

from bij.contract import codes
from bij.contract.fingerprint import field_digests
from bij.contract.spec import BatchInferenceJob
from bij.control.decisions import (
    CheckPermissions,
    CreateCanaryJob,
    CreateJob,
    CreatePublishJob,
    FinishRound,
    MarkFailed,
    Nothing,
    PatchJob,
    PlanRound,
    PreparePublish,
    Publish,
    Wait,
)
from bij.control.observe import Shards
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


# --- which rule answers ---------------------------------------------------------------------------------------

CANARY_SPEC = {"maxErrorShare": 0.1}
DIGESTS = field_digests(make_job())  # what round 0 was planned from
EDITED = make_job(judge=JUDGE, task="generate")  # a row-deciding field changed since


@pytest.mark.parametrize(("job", "status", "jobs", "kw", "kind", "fields"), [
    # ended comes first: a bij that is over is left alone, grants or not.
    (make_job(), {**planned(done=True), "phase": "Succeeded"}, [], {"check_permissions": True}, Nothing,
     {"reason": "Published"}),
    # The grants before a stop: cancelling plans round 0 in a pod, which would be refused as well.
    (make_job(cancel=True), {}, [], {"check_permissions": True}, CheckPermissions, {"reason": "CheckingPermissions"}),
    # Asked only before round 0 is planned, and only where pods run under RBAC (the operator).
    (make_job(), planned(), [], {"check_permissions": True}, CreateJob, {"round": 0}),
    (make_job(), {}, [], {}, PlanRound, {"round": 0, "phase": "Planning"}),
    # A stop before a spec edit: the finished part is published whatever the spec says now.
    (make_job(cancel=True, judge=JUDGE, task="generate"), planned(specDigests=DIGESTS), [k8s_job(active=4)], {},
     PatchJob, {"reason": "Cancelling", "suspend": True}),
    (EDITED, planned(specDigests=DIGESTS), [k8s_job(active=4)], {}, MarkFailed, {"reason": "SpecChanged"}),
    # A bij failed for a spec edit is not over (ended lets it through): still edited, it stays failed.
    (EDITED, {**planned(specDigests=DIGESTS), "phase": "Failed",
              "conditions": [{"type": "Failed", "status": "True", "reason": "SpecChanged"}]}, [], {}, MarkFailed,
     {"reason": "SpecChanged"}),
    # A finished round goes on to the next round or publishing, whatever its canary or pools.
    (make_job(canary=CANARY_SPEC), planned(done=True, canaryShards=2), [], {}, PreparePublish, {"rounds": 1}),
    # The canary gate: round 0 only, and only when its record has canary shards.
    (make_job(canary=CANARY_SPEC), planned(canaryShards=2), [], {}, CreateCanaryJob, {"canary_shards": 2}),
    (make_job(canary=CANARY_SPEC), planned(), [], {}, CreateJob, {"round": 0}),
    (make_job(canary=CANARY_SPEC, judge=JUDGE, task="generate"), planned(1, canaryShards=2), [], {}, CreateJob,
     {"round": 1}),
    (make_job(), planned(canaryShards=2), [], {}, CreateJob, {"round": 0}),  # no spec.canary (any more)
    # Pools take a round of shards; an empty round finishes as a plain one does.
    (pooled(SPOT, OD), planned(lanes=4), [], {}, CreateJob, {"pool": "spot", "completions": 2}),
    (pooled(SPOT, OD), planned(shards=0, lanes=0), [], {}, FinishRound, {"reason": "RoundFinished"}),
    # The shards done that lanes report never count above the round's.
    (make_job(), planned(), [k8s_job(active=4)], {"shards_done": 20}, Wait, {"shards": Shards(done=8, total=8)}),
], ids=["ended-first", "grants-before-stop", "grants-only-before-round-0", "grants-only-under-rbac",
        "stop-before-spec-change", "spec-change-before-round", "spec-change-failure-not-over",
        "finished-round-before-canary", "canary-gate", "canary-without-canary-shards", "canary-round-0-only",
        "canary-spec-removed", "pools", "pools-empty-round", "shards-done-capped"])
def test_which_rule_answers(job: BatchInferenceJob, status: dict[str, Any], jobs: list[dict[str, Any]],
                            kw: dict[str, Any], kind: type, fields: dict[str, Any]) -> None:
    got = decide(job, status, jobs, now=NOW, **kw)
    assert isinstance(got, kind), got
    assert {k: getattr(got, k) for k in fields} == fields
