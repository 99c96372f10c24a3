"""The round plan is one typed model: what the planner writes is what the worker reads, and plans
written before lanes or judge modes existed still load."""

from __future__ import annotations

import json
from typing import Any

import pytest
from bij_worker.contract import layout
from bij_worker.contract.plan import BadPlan, JudgeMode, Plan
from bij_worker.contract.spec import ModelSpec
from bij_worker.inputs import InputOptions
from bij_worker.main import engine_config


def legacy_doc() -> dict[str, Any]:
    """A plan as written before lanes and judge modes: no `lanes`, no `judgeMode`, no fingerprint."""
    return {
        "version": 1, "roundPrefix": "file:///out/_bij/j/round-0",
        "job": {"apiVersion": "batchinference.io/v1alpha1", "kind": "BatchInferenceJob", "metadata": {"name": "j"},
                "spec": {"input": {"uri": "file:///in/"}, "output": {"uri": "file:///out/"}}},
        "objects": [{"uri": "file:///in/a.jsonl", "size": 10}],
        "shards": [[[0, 0, 5]], [[0, 5, 10]]],
    }


def test_a_plan_from_before_lanes_runs_one_shard_per_index_and_shares_none() -> None:
    plan = Plan.from_json(json.dumps(legacy_doc()).encode())
    assert plan.lane_count == 2 and not plan.shares_shards
    assert plan.round == 0 and plan.mode == JudgeMode(mode="none", final=True)
    assert plan.objects[0].display_name == "file:///in/a.jsonl"


def test_the_worker_takes_its_defaults_from_the_spec_model() -> None:
    spec = Plan.from_doc(legacy_doc()).spec
    defaults = ModelSpec()
    opts = InputOptions.from_spec(spec)
    assert (opts.max_tokens, opts.temperature, opts.truncate) == (defaults.max_tokens, defaults.temperature, True)
    cfg = engine_config(spec)
    assert cfg.max_tokens == defaults.max_tokens
    assert cfg.vllm["maxNumSeqs"] == defaults.vllm.max_num_seqs  # camelCase, as the plan carries it


def test_a_plan_written_is_the_plan_read() -> None:
    doc = {**legacy_doc(), "lanes": 1, "judgeMode": {"mode": "rounds", "final": False}}
    plan = Plan.from_doc(doc)
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.lane_count == 1 and again.shares_shards
    assert set(again.to_doc()) >= {"roundPrefix", "job", "objects", "shards", "lanes", "judgeMode"}


@pytest.mark.parametrize("broken", [b"{not json", b"[]", json.dumps({"roundPrefix": "x"}).encode()])
def test_an_unreadable_plan_is_a_permanent_error(broken: bytes) -> None:
    with pytest.raises(BadPlan) as err:
        Plan.from_json(broken)
    assert err.value.permanent


def test_every_round_path_is_under_the_plans_round_prefix() -> None:
    rp = Plan.from_doc(legacy_doc()).round_prefix
    assert layout.done_uri(rp, 3) == rp + "/done/00003.json"
    assert layout.progress_uri(rp, 3) == rp + "/progress/00003.json"
    assert layout.claim_uri(rp, 3, 1) == rp + "/claims/00003-00001.json"
    assert layout.shard_prefix(rp, 3) == rp + "/shards/00003"
    assert layout.rejected_uri(rp, 3) == rp + "/rejected/00003.jsonl"
