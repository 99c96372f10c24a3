"""The contract is typed: the round plan is one model (what the planner writes is what the worker reads,
and plans written before lanes or judge modes existed still load), and shard records are read through
`ShardRecord`, so a malformed one is an error naming it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bij.contract import layout
from bij.contract.plan import BadPlan, JudgeMode, Plan
from bij.contract.records import BadRecord, decode_shard_record
from bij.contract.spec_model import ModelSpec
from bij.storage import StorageError
from bij.worker.input_row import InputOptions
from bij.worker.main import engine_config


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
    basic = defaults.basics()  # maxTokens, temperature, seed: sampling.SPEC_DEFAULTS, the model leaves them unset
    assert (opts.max_tokens, opts.temperature, opts.truncate) == (basic.max_tokens, basic.temperature, True)
    cfg = engine_config(spec)
    assert cfg.max_tokens == basic.max_tokens
    assert cfg.vllm == spec.model.vllm == defaults.vllm  # the spec's options, typed, as planned
    assert cfg.vllm.max_num_seqs is None  # unset: vLLM's own default


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


# A completion record as the first workers wrote it: none of the counts added since.
OLD_DONE_RECORD = (b'{"index": 0, "rows": 7, "errors": 1, "tokensIn": 70, "tokensOut": 0, "batches": 1, "chunks": 1, '
                   b'"engineBusySeconds": 0.25, "modelLoadSeconds": 1.5, "seconds": 2.0, '
                   b'"finishedAt": "2026-10-01T00:00:00Z"}')


def test_a_completion_record_of_an_older_worker_still_reads_and_unknown_fields_are_kept() -> None:
    rec = decode_shard_record(OLD_DONE_RECORD)
    assert (rec["rows"], rec["errors"], rec.get("capped", 0), rec.get("modelLoads")) == (7, 1, 0, None)
    newer = decode_shard_record(json.dumps({**json.loads(OLD_DONE_RECORD), "meanOccupancy": None,
                                            "gpuWatts": 300.5}).encode())
    assert newer["gpuWatts"] == 300.5  # type: ignore[typeddict-item]


@pytest.mark.parametrize("broken, says", [
    (b'{"rows": 7, "err', "is not valid JSON"),
    (b'[7, 1]', "is not a JSON object"),
    (b'{"rows": 7, "seconds": 2.0}', "no errors"),
    (b'{"rows": "7", "errors": 1}', "rows is '7', not an int"),
    (b'{"rows": 7, "errors": 1, "seconds": "2s"}', "seconds is '2s', not a float"),
    (b'{"rows": 7, "errors": 1, "finishedAt": 5}', "finishedAt is 5, not a str"),
    (b'{"rows": true, "errors": 1}', "rows is True"),
])
def test_a_malformed_shard_record_is_a_permanent_error_naming_it(broken: bytes, says: str) -> None:
    with pytest.raises(BadRecord, match=f"^done/00003.json .*{says}") as err:
        decode_shard_record(broken, "done/00003.json")
    assert err.value.permanent and isinstance(err.value, StorageError)


def test_the_operator_reads_shard_records_through_the_contract_and_names_a_bad_one(file_place, make_job,
                                                                                  run_shards) -> None:
    from bij.local.publish import publish_manifest
    from bij.steps.progress import live_records, shard_records

    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", [{"id": i, "text": f"t{i}"} for i in range(9)]))
    run_shards(job)
    assert shard_records(job, 0)[0]["rows"] == 9 == live_records(job, 0)[0]["rows"]
    done = layout.done_uri(layout.round_prefix(job, 0), 0)
    file_place.storage.write_bytes(done, b'{"rows": 9}')  # no errors: a later KeyError, were it not checked
    for read in (shard_records, live_records):
        with pytest.raises(BadRecord, match=f"completion record {done} is not a shard record: no errors"):
            read(job, 0)
    with pytest.raises(BadRecord, match=f"completion record {done}"):
        publish_manifest(job)
    progress = layout.progress_uri(layout.round_prefix(job, 0), 1)
    file_place.storage.write_bytes(done, OLD_DONE_RECORD)
    file_place.storage.write_bytes(progress, b"{")
    assert shard_records(job, 0)[0]["rows"] == 7
    with pytest.raises(BadRecord, match=f"progress record {progress} is not valid JSON"):
        live_records(job, 0)
