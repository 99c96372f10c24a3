"""spec.workers.pools: the round's lanes spread over pools in order of preference, and a pool whose pods cannot
start gives its lanes (their ids and so their shards) to the next pool."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from pydantic import ValidationError

from bij.contract.codes import LANE_OFFSET_ENV, POOL_LABEL, TENSOR_PARALLEL_ENV
from bij.contract.spec import BatchInferenceJob, parse_job
from bij.contract.spec_workers import WorkerPool, WorkersSpec
from bij.control import pools
from bij.control.decisions import CreateJob, FinishRound, MovePoolLanes, PatchJob, Wait
from bij.control.jobs import render_job
from bij.control.reconcile import decide
from bij.control.status import decision_status
from bij.worker.main import engine_config, lane_offset
from bij.worker.shard import BadConfig

UID = "pool-uid"
NOW = dt.datetime(2024, 1, 1, 1, 0, tzinfo=dt.timezone.utc)
SPOT = {"name": "spot", "nodeSelector": {"pool": "spot"}, "spot": True, "pricePerHour": 1.0, "maxLanes": 2,
        "startTimeoutSeconds": 120, "queueName": "spot-queue", "gpus": 1, "tensorParallelSize": 1}
OD = {"name": "od", "nodeSelector": {"pool": "od"}, "pricePerHour": 3.0, "gpus": 2, "tensorParallelSize": 2}


def pooled(*pool_specs: dict[str, Any], suspend: bool = False) -> BatchInferenceJob:
    return parse_job({"apiVersion": "batchinference.io/v1alpha1", "kind": "BatchInferenceJob",
                      "metadata": {"name": "emb", "namespace": "ml", "uid": UID},
                      "spec": {"input": {"uri": "file:///data/in"}, "output": {"uri": "file:///data/out"},
                               "model": {"engine": "vllm", "task": "generate", "name": "m"},
                               "workers": {"parallelism": 4, "pools": list(pool_specs)}, "suspend": suspend}})


def planned(round_no: int = 0, shards: int = 8, lanes: int = 4, **status: Any) -> dict[str, Any]:
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


def pod(job_name: str, index: int, *, created: str, unschedulable: bool = False, running: bool = False,
        preempted: bool = False) -> dict[str, Any]:
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


def start(job: BatchInferenceJob, status: dict[str, Any]) -> list[dict[str, Any]]:
    """Decide until no Job is left to create; the Jobs made."""
    jobs: list[dict[str, Any]] = []
    while isinstance(d := decide(job, status, jobs, now=NOW), CreateJob):
        jobs.append(made(job, d, active=d.completions))
    return jobs


# --- the rules ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lanes, caps, gave_up, expected", [
    # In order of preference, each up to its maxLanes; no limit takes all the rest.
    (4, [2, None], set(), [(0, 0, 2), (1, 2, 2)]),
    (4, [None, None], set(), [(0, 0, 4)]),
    # More lanes than every pool has room for: the rest are not run (the others take their shards).
    (6, [2, 1], set(), [(0, 0, 2), (1, 2, 1)]),
    # A pool that gave up: its block runs in the next pool, up to that pool's room.
    (4, [2, None], {0}, [(1, 0, 2), (1, 2, 2)]),
    (4, [2, 2], {0}, [(1, 0, 0), (1, 2, 2)]),
    # Wrapping around to a pool earlier in the order.
    (4, [2, None, None], {1}, [(0, 0, 2), (2, 2, 2)]),
    (4, [2, 2, None], {2}, [(0, 0, 2), (1, 2, 2)]),
])
def test_lanes_fill_the_pools_in_order_of_preference(lanes: int, caps: list[int | None], gave_up: set[int],
                                                     expected: list[tuple[int, int, int]]) -> None:
    spec_pools = [WorkerPool(name=f"p{i}", max_lanes=c) for i, c in enumerate(caps)]
    got = [(p.pool, p.block.offset, p.lanes) for p in pools.placement(lanes, spec_pools, gave_up)]
    assert got == expected


def test_the_last_pool_left_has_nowhere_to_give_its_lanes() -> None:
    assert pools.next_pool(0, 2, set()) == 1
    assert pools.next_pool(1, 2, {0}) is None
    assert pools.next_pool(0, 1, set()) is None


def test_a_pool_gives_up_only_once_every_pod_waited_past_its_start_timeout_without_a_node() -> None:
    pool = WorkerPool(name="spot", start_timeout_seconds=120)
    early = [pod("j", 0, created="2024-01-01T00:59:00Z", unschedulable=True)]
    late = [pod("j", i, created="2024-01-01T00:57:00Z", unschedulable=True) for i in range(2)]
    assert pools.gives_up("j", 2, pool, early, NOW) is None
    assert pools.start_timeout_left("j", pool, early, NOW) == 60.0
    why = pools.gives_up("j", 2, pool, late, NOW)
    assert why is not None and "180s" in why and "node affinity/selector" in why
    # One of its pods runs: the pool keeps its lanes (that lane takes the others' shards).
    some = late + [pod("j", 2, created="2024-01-01T00:57:00Z", running=True)]
    assert pools.gives_up("j", 3, pool, some, NOW) is None
    # Other Jobs' pods do not count.
    assert pools.gives_up("other", 2, pool, late, NOW) is None


def test_a_pool_whose_pods_are_preempted_again_and_again_gives_up() -> None:
    pool = WorkerPool(name="spot")
    lost = [pod("j", 0, created="2024-01-01T00:59:00Z", preempted=True) for _ in range(pools.PREEMPTIONS_PER_LANE)]
    assert pools.gives_up("j", 1, pool, lost, NOW) is not None
    assert pools.gives_up("j", 1, pool, lost[:-1], NOW) is None


# --- the spec and the Jobs -------------------------------------------------------------------------------------


def test_pool_names_are_unique_and_pools_do_not_span_several_pods_a_lane() -> None:
    with pytest.raises(ValidationError, match="a name of its own"):
        WorkersSpec.model_validate({"pools": [{"name": "a"}, {"name": "a"}]})
    with pytest.raises(ValidationError, match="nodesPerLane"):
        WorkersSpec.model_validate({"pools": [{"name": "a"}], "nodesPerLane": 2})
    with pytest.raises(ValidationError):
        WorkersSpec.model_validate({"pools": [{"name": "Not_A_Label"}]})


def test_a_pools_job_runs_its_lanes_with_the_pools_placement_queue_gpus_and_engine() -> None:
    job = pooled(SPOT, OD)
    body = render_job(job, 3, 2, "file:///m", pool=job.spec.workers.pools[1], name_suffix="-p1f0", lane_offset=4)
    meta, pod_spec = body["metadata"], body["spec"]["template"]["spec"]
    assert meta["name"] == "emb-r3-p1f0" and meta["labels"][POOL_LABEL] == "od"
    assert pod_spec["nodeSelector"] == {"pool": "od"}
    assert pod_spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert env_of(body)[LANE_OFFSET_ENV] == "4" and env_of(body)[TENSOR_PARALLEL_ENV] == "2"
    spot = render_job(job, 0, 2, "file:///m", pool=job.spec.workers.pools[0], name_suffix="-p0")
    assert spot["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "spot-queue" and spot["spec"]["suspend"]
    assert spot["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "spot"}
    tolerated = {t.get("key") for t in spot["spec"]["template"]["spec"]["tolerations"]}
    assert "cloud.google.com/gke-spot" in tolerated  # spot: true in this pool only
    assert "cloud.google.com/gke-spot" not in {t.get("key") for t in pod_spec.get("tolerations", [])}


def test_a_pools_tensor_parallel_size_replaces_the_models_in_its_pods(monkeypatch: pytest.MonkeyPatch) -> None:
    job = pooled(SPOT, OD)
    assert engine_config(job.spec).vllm.tensor_parallel_size == 1
    monkeypatch.setenv(TENSOR_PARALLEL_ENV, "2")
    assert engine_config(job.spec).vllm.tensor_parallel_size == 2


def test_a_pools_pod_works_its_lane_offset_plus_its_index() -> None:
    assert lane_offset({LANE_OFFSET_ENV: "6"}) == 6 and lane_offset({}) == 0
    with pytest.raises(BadConfig, match=LANE_OFFSET_ENV):
        lane_offset({LANE_OFFSET_ENV: "-1"})


# --- the round over its pools ---------------------------------------------------------------------------------


def test_a_rounds_lanes_start_in_the_preferred_pool_and_spill_to_the_next() -> None:
    job = pooled(SPOT, OD)
    jobs = start(job, planned())
    assert [(j["metadata"]["name"], j["spec"]["completions"], env_of(j)[LANE_OFFSET_ENV]) for j in jobs] == \
        [("emb-r0-p0", 2, "0"), ("emb-r0-p1", 2, "2")]
    d = decide(job, planned(), jobs, now=NOW)
    assert isinstance(d, Wait) and d.lanes is not None and d.lanes.total == 4 and d.pools is not None
    patch = decision_status({}, d, generation=1, now=NOW, output_uri="file:///data/out")
    assert [(p["name"], p["lanes"], p["pricePerHour"]) for p in patch["pools"]] == [("spot", 2, 1.0), ("od", 2, 3.0)]
    assert patch["poolsSummary"] == "spot 2/2, od 2/2"


def test_a_pool_whose_pods_find_no_node_gives_its_lanes_with_their_ids_to_the_next_pool() -> None:
    job = pooled(SPOT, OD)
    status = planned()
    jobs = start(job, status)
    stuck = [pod("emb-r0-p0", i, created="2024-01-01T00:55:00Z", unschedulable=True) for i in range(2)]
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
    status = planned(pools=[{"name": "spot", "gaveUpRound": 0, "message": "no node"}, {"name": "od"}])
    first = start(job, planned())  # the Jobs made before spot gave up
    d = decide(job, status, first, now=NOW)
    assert isinstance(d, MovePoolLanes) and d.job_names == ("emb-r0-p0",)


def test_pods_waiting_within_the_start_timeout_are_looked_at_again_when_it_runs_out() -> None:
    job = pooled(SPOT, OD)
    jobs = start(job, planned())
    jobs[1]["status"]["completedIndexes"] = "0"  # pool od is under way
    waiting = [pod("emb-r0-p0", 0, created="2024-01-01T00:59:30Z", unschedulable=True)]
    d = decide(job, planned(), jobs, now=NOW, pods=waiting)
    assert isinstance(d, Wait) and d.recheck == pytest.approx(91.0)
    # Its pods not listed yet (the operator lists them once they are slow to start): looked at again soon.
    d = decide(job, planned(), jobs, now=NOW)
    assert isinstance(d, Wait) and d.recheck == pytest.approx(31.0)


def test_the_last_pool_keeps_its_lanes_however_long_its_pods_wait() -> None:
    job = pooled(SPOT, OD)
    status = planned(pools=[{"name": "spot", "gaveUpRound": 0}])
    jobs = start(job, status)
    assert [j["metadata"]["name"] for j in jobs] == ["emb-r0-p1f0", "emb-r0-p1"]
    stuck = [pod(j["metadata"]["name"], 0, created="2024-01-01T00:00:00Z", unschedulable=True) for j in jobs]
    d = decide(job, status, jobs, now=NOW, pods=stuck)
    assert isinstance(d, Wait)


def test_the_next_round_starts_in_the_preferred_pool_again() -> None:
    job = pooled(SPOT, OD)
    status = planned(round_no=1, pools=[{"name": "spot", "gaveUpRound": 0}, {"name": "od"}])
    jobs = start(job, status)
    assert [j["metadata"]["name"] for j in jobs] == ["emb-r1-p0", "emb-r1-p1"]


def test_suspending_a_pooled_round_suspends_every_pools_job() -> None:
    job = pooled(SPOT, OD, suspend=True)
    jobs = start(pooled(SPOT, OD), planned())
    d = decide(job, planned(), jobs, now=NOW)
    assert isinstance(d, PatchJob) and d.suspend is True and d.job_name == "emb-r0-p0"
    jobs[0]["spec"]["suspend"] = True
    d = decide(job, planned(), jobs, now=NOW)
    assert isinstance(d, PatchJob) and d.job_name == "emb-r0-p1"


def test_a_spec_without_pools_keeps_one_round_job_named_as_before() -> None:
    job = parse_job({"apiVersion": "batchinference.io/v1alpha1", "kind": "BatchInferenceJob",
                     "metadata": {"name": "emb", "namespace": "ml", "uid": UID},
                     "spec": {"input": {"uri": "file:///data/in"}, "output": {"uri": "file:///data/out"}}})
    d = decide(job, planned(), [], now=NOW)
    assert isinstance(d, CreateJob) and d.pool is None and d.pools is None
    body = render_job(job, 0, d.completions, "file:///m")
    assert body["metadata"]["name"] == "emb-r0" and LANE_OFFSET_ENV not in env_of(body)
