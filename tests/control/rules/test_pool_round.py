"""`rules.pool_round`: a round over spec.workers.pools: each block's Job in the pool it runs in now, the lanes of
a pool that gives up moved to the next, the pools' Jobs merged into one view. The plain rules (`control.pools`)
and the pools' Jobs: tests/control/test_pools.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from bij.contract.codes import LANE_OFFSET_ENV
from bij.contract.spec import parse_job
from bij.control.decisions import (
    CreateJob,
    FinishRound,
    MovePoolLanes,
    PatchJob,
    Wait,
)
from bij.control.jobs import render_job
from bij.control.reconcile import decide
from bij.control.rules.pool_round import pool_round
from rules.builders import (
    NOW,
    OD,
    SPOT,
    UID,
    decision_status,
    env_of,
    made,
    observation,
    pool_planned,
    pool_pod,
    pooled,
    start_pools,
)


def test_a_rounds_lanes_start_in_the_preferred_pool_and_spill_to_the_next() -> None:
    job = pooled(SPOT, OD)
    jobs = start_pools(job, pool_planned())
    assert [(j["metadata"]["name"], j["spec"]["completions"], env_of(j)[LANE_OFFSET_ENV]) for j in jobs] == \
        [("emb-r0-p0", 2, "0"), ("emb-r0-p1", 2, "2")]
    d = decide(job, pool_planned(), jobs, now=NOW)
    assert isinstance(d, Wait) and d.lanes is not None and d.lanes.total == 4 and d.pools is not None
    patch = decision_status({}, d, generation=1, now=NOW, output_uri="file:///data/out")
    assert [(p["name"], p["lanes"], p["pricePerHour"]) for p in patch["pools"]] == [("spot", 2, 1.0), ("od", 2, 3.0)]
    assert patch["poolsSummary"] == "spot 2/2, od 2/2"


def test_a_pool_whose_pods_find_no_node_gives_its_lanes_with_their_ids_to_the_next_pool() -> None:
    job = pooled(SPOT, OD)
    status = pool_planned()
    jobs = start_pools(job, status)
    stuck = [pool_pod("emb-r0-p0", i, created="2024-01-01T00:55:00Z", unschedulable=True) for i in range(2)]
    jobs[0]["status"] = {"active": 2}
    d = decide(job, status, jobs, now=NOW, pods=stuck)
    assert isinstance(d, MovePoolLanes) and d.pool == "spot" and d.to_pool == "od" and d.job_names == ("emb-r0-p0",)
    assert "no node took its pods" in d.message
    # The driver records it, then deletes the pool's Job; the lanes 0-1 are then made in pool od.
    status["pools"] = decision_status(status, d, generation=1, now=NOW, output_uri="")["pools"]
    assert status["pools"][0]["gaveUpRound"] == 0
    left = jobs[1:]
    d = decide(job, status, left, now=NOW)
    assert isinstance(d, CreateJob) and (d.pool, d.lane_offset, d.completions, d.name_suffix) == ("od", 0, 2, "-p1f0")
    left.append(made(job, d, active=2))
    d = decide(job, status, left, now=NOW)
    assert isinstance(d, Wait) and d.pools is not None and [(p.name, p.lanes) for p in d.pools] == \
        [("spot", 0), ("od", 4)]
    # Both Jobs of od done: the round ends, whatever pool ran which lane.
    for j in left:
        j["status"] = {"completedIndexes": "0-1", "conditions": [{"type": "Complete", "status": "True"}]}
    d = decide(job, status, left, now=NOW)
    assert isinstance(d, FinishRound) and d.lanes is not None and d.lanes.done == 4


def test_a_pools_job_left_behind_by_an_interrupted_move_is_deleted_again() -> None:
    job = pooled(SPOT, OD)
    status = pool_planned(pools=[{"name": "spot", "gaveUpRound": 0, "message": "no node"}, {"name": "od"}])
    first = start_pools(job, pool_planned())  # the Jobs made before spot gave up
    d = decide(job, status, first, now=NOW)
    assert isinstance(d, MovePoolLanes) and d.job_names == ("emb-r0-p0",)


def test_pods_waiting_within_the_start_timeout_are_looked_at_again_when_it_runs_out() -> None:
    job = pooled(SPOT, OD)
    jobs = start_pools(job, pool_planned())
    jobs[1]["status"]["completedIndexes"] = "0"  # pool od is under way
    waiting = [pool_pod("emb-r0-p0", 0, created="2024-01-01T00:59:30Z", unschedulable=True)]
    d = decide(job, pool_planned(), jobs, now=NOW, pods=waiting)
    assert isinstance(d, Wait) and d.recheck == pytest.approx(91.0)
    # Its pods not listed yet (the operator lists them once they are slow to start): looked at again soon.
    d = decide(job, pool_planned(), jobs, now=NOW)
    assert isinstance(d, Wait) and d.recheck == pytest.approx(31.0)


def test_the_last_pool_keeps_its_lanes_however_long_its_pods_wait() -> None:
    job = pooled(SPOT, OD)
    status = pool_planned(pools=[{"name": "spot", "gaveUpRound": 0}])
    jobs = start_pools(job, status)
    assert [j["metadata"]["name"] for j in jobs] == ["emb-r0-p1f0", "emb-r0-p1"]
    stuck = [pool_pod(j["metadata"]["name"], 0, created="2024-01-01T00:00:00Z", unschedulable=True) for j in jobs]
    d = decide(job, status, jobs, now=NOW, pods=stuck)
    assert isinstance(d, Wait)


def test_the_next_round_starts_in_the_preferred_pool_again() -> None:
    job = pooled(SPOT, OD)
    status = pool_planned(round_no=1, pools=[{"name": "spot", "gaveUpRound": 0}, {"name": "od"}])
    jobs = start_pools(job, status)
    assert [j["metadata"]["name"] for j in jobs] == ["emb-r1-p0", "emb-r1-p1"]


def test_suspending_a_pooled_round_suspends_every_pools_job() -> None:
    job = pooled(SPOT, OD, suspend=True)
    jobs = start_pools(pooled(SPOT, OD), pool_planned())
    d = decide(job, pool_planned(), jobs, now=NOW)
    assert isinstance(d, PatchJob) and d.suspend is True and d.job_name == "emb-r0-p0"
    jobs[0]["spec"]["suspend"] = True
    d = decide(job, pool_planned(), jobs, now=NOW)
    assert isinstance(d, PatchJob) and d.job_name == "emb-r0-p1"


def test_a_spec_without_pools_keeps_one_round_job_named_as_before() -> None:
    job = parse_job({"apiVersion": "batchinference.io/v1alpha1", "kind": "BatchInferenceJob",
                     "metadata": {"name": "emb", "namespace": "ml", "uid": UID},
                     "spec": {"input": {"uri": "file:///data/in"}, "output": {"uri": "file:///data/out"}}})
    d = decide(job, pool_planned(), [], now=NOW)
    assert isinstance(d, CreateJob) and d.pool is None and d.pools is None
    body = render_job(job, 0, d.completions, "file:///m")
    assert body["metadata"]["name"] == "emb-r0" and LANE_OFFSET_ENV not in env_of(body)


# --- pool_round(): each pool's Job, moving a pool's lanes, the Jobs merged -----------------------------------


def _old_object(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    jobs[0]["metadata"]["ownerReferences"] = [{"uid": "uid-of-the-old-object"}]
    return jobs


def _all_suspended(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for j in jobs:
        j["spec"]["suspend"] = True
    return jobs


def _all_done(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for j in jobs:
        j["status"] = {"completedIndexes": "0-1", "conditions": [{"type": "Complete", "status": "True"}]}
    return jobs


def _od_under_way(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    jobs[1]["status"]["completedIndexes"] = "0"
    return jobs


def _unschedulable(created: str) -> list[dict[str, Any]]:
    return [pool_pod("emb-r0-p0", i, created=created, unschedulable=True) for i in range(2)]


GAVE_UP = {"pools": [{"name": "spot", "gaveUpRound": 0, "message": "no node"}, {"name": "od"}]}


@pytest.mark.parametrize(("status", "observe", "pods", "suspend", "kind", "fields"), [
    ({}, lambda js: [], [], False, CreateJob,
     {"pool": "spot", "lane_offset": 0, "completions": 2, "name_suffix": "-p0", "suspend": False}),
    ({}, lambda js: [], [], True, CreateJob, {"pool": "spot", "suspend": True, "phase": "Suspended"}),
    ({}, lambda js: js[:1], [], False, CreateJob, {"pool": "od", "lane_offset": 2, "completions": 2}),
    ({}, _old_object, [], False, Wait, {"reason": "WaitingForOldJob"}),
    # Spot gave its lanes up this round, its Job is still there (a move cut short): deleted again.
    (GAVE_UP, lambda js: js, [], False, MovePoolLanes, {"pool": "spot", "to_pool": "od", "job_names": ("emb-r0-p0",)}),
    (GAVE_UP, lambda js: js[1:], [], False, CreateJob, {"pool": "od", "lane_offset": 0, "name_suffix": "-p1f0"}),
    ({}, lambda js: js, [], True, PatchJob, {"suspend": True, "job_name": "emb-r0-p0"}),
    # Spot's Job is queued in Kueue (its pool's queueName): only od's is resumed by the operator.
    ({}, _all_suspended, [], False, PatchJob, {"suspend": False, "job_name": "emb-r0-p1"}),
    ({}, lambda js: js, _unschedulable("2024-01-01T00:55:00Z"), False, MovePoolLanes,
     {"pool": "spot", "to_pool": "od", "job_names": ("emb-r0-p0",)}),
    # Within spot's start timeout: merged, looked at again when it runs out (or soon, its pods not listed yet).
    ({}, _od_under_way, _unschedulable("2024-01-01T00:59:30Z"), False, tuple, {"recheck": 91.0}),
    ({}, lambda js: js, [], False, tuple, {"recheck": 31.0, "name": "emb-r0-p0, emb-r0-p1", "completions": 4}),
    ({}, _all_done, [], False, tuple, {"recheck": None, "succeeded": True}),
    # A Job that ended is not suspended.
    ({}, _all_done, [], True, tuple, {"succeeded": True}),
], ids=["no-job", "no-job-suspended", "spill-to-next-pool", "old-objects-job", "gave-up-job-left",
        "gave-up-lanes-moved", "suspend", "resume-unqueued", "no-node-past-timeout", "within-timeout", "running",
        "all-done", "all-done-suspended"])
def test_pool_round(status: dict[str, Any], observe: Callable[[list[dict[str, Any]]], list[dict[str, Any]]],
                    pods: list[dict[str, Any]], suspend: bool, kind: type, fields: dict[str, Any]) -> None:
    jobs = observe(start_pools(pooled(SPOT, OD), pool_planned()))
    status = pool_planned(**status)
    got = pool_round(pooled(SPOT, OD, suspend=suspend), observation(status, jobs, pods), 0, 4, 8, None)
    assert isinstance(got, kind), got
    if isinstance(got, tuple):
        merged, lanes, recheck = got
        assert {k: recheck if k == "recheck" else getattr(merged, k) for k in fields} == fields
        assert [(p.name, p.lanes) for p in lanes] == [("spot", 2), ("od", 2)]
        return
    assert {k: getattr(got, k) for k in fields} == fields
    if isinstance(got, MovePoolLanes) and pods:
        assert got.pools is not None and got.pools[0].gave_up_round == 0 and "no node took its pods" in got.message
