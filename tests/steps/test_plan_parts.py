"""A large round plan is written in parts: a lane reads the parts of the shards it works, not the round."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bij.contract import layout
from bij.contract import plan as plan_module
from bij.contract.plan import Plan
from bij.local.publish import publish_manifest
from bij.steps.plan_input import list_input
from bij.steps.planner import build_plan, plan_round
from bij.worker.shard import ShardWorker, load_plan


def rows(n: int) -> list[dict[str, Any]]:
    return [{"id": f"r{i}", "text": f"text {i} " + "y" * (i % 40)} for i in range(n)]


def planned_job(place: Any, make_job: Any, out_dir: str = "out/") -> Any:
    uri = place.uri("in.jsonl")
    if not place.storage.exists(uri):
        place.write_jsonl("in.jsonl", rows(1500))
    _, job = make_job(place, uri, out_dir=out_dir, sharding={"targetShardBytes": 1024, "minShardBytes": 1024},
                      workers={"parallelism": 3})
    return job


def test_a_lane_reads_only_the_parts_of_its_own_shards(file_place, make_job, monkeypatch):
    monkeypatch.setattr(plan_module, "PART_SHARDS", 3)
    job = planned_job(file_place, make_job)
    rp = plan_round(job, 0)
    uri = layout.round_manifest_uri(job, 0)
    head = json.loads(file_place.storage.read_bytes(uri))
    assert head["shards"] == [] and head["shardCount"] == rp.shard_count > 3 * 3 * 2 and head["partShards"] == 3
    whole = build_plan(job, 0, list_input(job, job.spec.input.uri), job.spec.input.uri)
    reads: list[str] = []

    def read(u: str) -> bytes:
        reads.append(u)
        return file_place.storage.read_bytes(u)

    lane, lanes = 1, head["lanes"]
    plan = Plan.from_json(file_place.storage.read_bytes(uri)).with_reader(read)
    own = range(lane, rp.shard_count, lanes)
    assert [plan.pieces(s) for s in own] == [whole.shards[s] for s in own]
    parts = -(-len(own) // 3)
    assert reads == [layout.plan_part_uri(rp.manifest_uri.rsplit("/", 1)[0], lane, c) for c in range(parts)]
    # Every shard, streamed part by part, is the shard the whole plan lists.
    assert dict(plan.iter_pieces()) == dict(enumerate(whole.shards))


def test_a_round_planned_in_parts_publishes_what_one_plan_document_does(file_place, make_job, run_shards,
                                                                       read_output, monkeypatch):
    one = planned_job(file_place, make_job, "one/")
    run_shards(one)
    monkeypatch.setattr(plan_module, "PART_SHARDS", 2)
    parted = planned_job(file_place, make_job, "parted/")
    run_shards(parted)
    assert load_plan(layout.round_manifest_uri(parted, 0), None).in_parts
    assert not load_plan(layout.round_manifest_uri(one, 0), None).in_parts
    a, b = publish_manifest(one), publish_manifest(parted)
    assert read_output(one).results == read_output(parted).results
    assert a.counts == b.counts and a.rounds == b.rounds


def test_the_parts_are_written_before_the_plan_head(file_place, make_job, monkeypatch):
    monkeypatch.setattr(plan_module, "PART_SHARDS", 4)
    job = planned_job(file_place, make_job)
    writes: list[str] = []
    real = type(file_place.storage).write_bytes

    def recording(self: Any, uri: str, data: bytes) -> None:
        writes.append(uri)
        real(self, uri, data)

    monkeypatch.setattr(type(file_place.storage), "write_bytes", recording)
    plan_round(job, 0)
    head = layout.round_manifest_uri(job, 0)
    parts = [w for w in writes if "/plan/" in w]
    assert parts and writes.index(head) > max(writes.index(p) for p in parts)


def test_a_plan_written_as_one_document_before_parts_still_runs(file_place, make_job, monkeypatch):
    job = planned_job(file_place, make_job)
    plan_round(job, 0)
    uri = layout.round_manifest_uri(job, 0)
    doc = json.loads(file_place.storage.read_bytes(uri))
    assert "shardCount" not in doc and "partShards" not in doc and len(doc["shards"]) > 4
    # A plan step of this version, and a lane, read it as it is, even where they would write parts.
    monkeypatch.setattr(plan_module, "PART_SHARDS", 2)
    assert plan_round(job, 0).shard_count == len(doc["shards"])
    plan = load_plan(uri, None)
    assert not plan.in_parts and plan.pieces(3) == [tuple(p) for p in doc["shards"][3]]
    assert not file_place.storage.list(layout.join(layout.round_prefix(job, 0), "plan") + "/")


def test_a_missing_plan_part_is_a_bad_configuration_naming_it(file_place, make_job, monkeypatch):
    from bij.worker.shard import BadConfig

    monkeypatch.setattr(plan_module, "PART_SHARDS", 2)
    job = planned_job(file_place, make_job)
    plan_round(job, 0)
    plan = load_plan(layout.round_manifest_uri(job, 0), None)
    gone = layout.plan_part_uri(plan.round_prefix, 0, 1)
    file_place.storage.delete(gone)
    with pytest.raises(BadConfig, match="part"):
        ShardWorker(plan, 0 + 2 * plan.lane_count, object())  # type: ignore[arg-type]


def test_a_plan_listing_no_shards_and_naming_no_parts_is_refused_naming_what_it_needs(file_place, make_job):
    from bij.contract.plan import BadPlan

    job = planned_job(file_place, make_job)
    plan_round(job, 0)
    doc = json.loads(file_place.storage.read_bytes(layout.round_manifest_uri(job, 0)))
    for broken in ({k: v for k, v in doc.items() if k != "shards"}, {**doc, "shardCount": 4}):
        with pytest.raises(BadPlan, match="needs shards, or shardCount and partShards"):
            Plan.from_doc(broken, "round plan x")
