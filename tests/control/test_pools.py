"""spec.workers.pools: the round's lanes spread over pools in order of preference, and a pool whose pods cannot
start gives its lanes (their ids and so their shards) to the next pool (`control.pools`); a pool's Job and pod.
The round over its pools in decide(): tests/control/rules/test_pool_round.py."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from rules.builders import NOW, OD, SPOT, env_of, pool_pod, pooled

from bij.contract.codes import LANE_OFFSET_ENV, POOL_LABEL, TENSOR_PARALLEL_ENV
from bij.contract.spec_workers import WorkerPool, WorkersSpec
from bij.control import pools
from bij.control.jobs import render_job
from bij.worker.main import engine_config, lane_offset
from bij.worker.shard import BadConfig

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
    early = [pool_pod("j", 0, created="2024-01-01T00:59:00Z", unschedulable=True)]
    late = [pool_pod("j", i, created="2024-01-01T00:57:00Z", unschedulable=True) for i in range(2)]
    assert pools.gives_up("j", 2, pool, early, NOW) is None
    assert pools.start_timeout_left("j", pool, early, NOW) == 60.0
    why = pools.gives_up("j", 2, pool, late, NOW)
    assert why is not None and "180s" in why and "node affinity/selector" in why
    # One of its pods runs: the pool keeps its lanes (that lane takes the others' shards).
    some = late + [pool_pod("j", 2, created="2024-01-01T00:57:00Z", running=True)]
    assert pools.gives_up("j", 3, pool, some, NOW) is None
    # Other Jobs' pods do not count.
    assert pools.gives_up("other", 2, pool, late, NOW) is None


def test_a_pool_whose_pods_are_preempted_again_and_again_gives_up() -> None:
    pool = WorkerPool(name="spot")
    lost = [pool_pod("j", 0, created="2024-01-01T00:59:00Z", preempted=True) for _ in range(pools.PREEMPTIONS_PER_LANE)]
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
