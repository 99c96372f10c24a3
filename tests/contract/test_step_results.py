"""Step results and the manifest as models: what a step pod or publishing wrote before these models
reads into them and writes back the same, key for key and in order (operators and step pods of this
version and the one before read each other's reports; manifest.json is the same text)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bij.contract.canary import CanaryFigures
from bij.contract.efficiency import EfficiencySums, cost
from bij.contract.manifest import Manifest, ManifestCounts
from bij.contract.rounds import RoundStats
from bij.contract.step_results import (
    RESULTS,
    CanaryResult,
    FinishResult,
    ManifestSummary,
    PlanResult,
    PublishPlanResult,
    UnreadableResult,
    parse_result,
)


def same_text(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return json.dumps(a) == json.dumps(b)


def _efficiency() -> dict[str, Any]:
    sums = EfficiencySums()
    sums.add({"seconds": 10.5, "modelLoadSeconds": 2, "modelLoads": 1, "engineBusySeconds": 8.25, "rows": 40,
              "tokensIn": 400, "tokensOut": 100, "pool": "spot"})
    return sums.result()


EFFICIENCY = _efficiency()
COST = cost(2, EFFICIENCY["workerSeconds"], 40, 0, 2, pool_prices={"spot": 1}, by_pool={"spot": 12.5})
SUMMARY = {  # what the manifest step reported (`manifest_summary` before the models)
    "counts": {"rows": 9, "errors": 1, "capped": 0, "duplicates": 0, "truncated": 0, "inputRows": 12,
               "tokensIn": 120, "tokensOut": 45, "reasoningTokens": 7, "notRun": 2, "errorCodes": {"timeout": 1},
               "structured": {"validated": 0, "repaired": 0, "violations": 0}},
    "files": 3, "damagedObjects": [{"message": "in/b.jsonl at byte 9: not JSON"}], "damagedMore": 0,
    "notes": ["the grammar cannot be written by this tokenizer"],
    "partial": {"phase": "Cancelled", "reason": "spec.cancel", "counts": {"completed": 9, "failed": 1, "notRun": 2}},
    "workFilesRemoval": {"removed": 2000, "bytes": 9, "left": "file:///out/_bij/x/", "error": "Permission denied"},
}

# Each step kind's result as the step pods wrote it before these models.
WRITTEN: list[tuple[str, dict[str, Any]]] = [
    ("plan", {"manifestUri": "file:///out/_bij/j/rounds/0/plan.json", "shards": 4, "objects": 2, "bytes": 1000,
              "unit": "bytes", "lanes": 2}),
    ("plan", {"manifestUri": "s3://b/o/plan.json", "shards": 40, "objects": 1, "bytes": 900, "unit": "rows",
              "lanes": 4, "canaryShards": 3}),
    ("finish", {"done": 4, "stats": RoundStats(round=0, shards=0, approved=10, rejected=2, capped=1, errors=1,
                                               engine_calls=3).as_status(),
                "efficiency": EFFICIENCY, "damaged": ["in/b.jsonl at byte 9: not JSON"], "damagedMore": 0,
                "cost": COST}),
    ("finish", {"done": 0, "stats": RoundStats(round=1, shards=0, approved=0, rejected=0, capped=0,
                                               errors=0).as_status(),
                "efficiency": EfficiencySums().result(), "damaged": [], "damagedMore": 0}),
    ("canary", {**CanaryFigures(shards=2, rows=18, errors=2, length_cuts=1, schema_violations=0, tokens_out=300,
                                lane_seconds=12.5, bytes=4000).as_status(), "done": 2,
                "examples": [{"id": "7", "code": "timeout", "message": "the engine did not answer"},
                             {"id": None, "code": "", "message": ""}]}),
    ("publish-plan", {"planUri": "file:///out/_bij/j/publish/plan.json", "passes": {"ids": 2, "dedupe": 2,
                                                                                    "write": 4}}),
    ("publish-plan", {"published": SUMMARY}),
    ("manifest", SUMMARY),
    ("manifest", {"counts": {}, "files": 0, "damagedObjects": [], "damagedMore": 0}),
]


@pytest.mark.parametrize("kind, written", WRITTEN)
def test_a_result_as_written_before_the_models_reads_into_its_kinds_model_and_writes_back_the_same(
        kind: str, written: dict[str, Any]) -> None:
    got = parse_result(kind, json.loads(json.dumps(written)))  # through JSON, as the status carries it
    assert isinstance(got, RESULTS[kind]) and type(got).kind == kind
    assert same_text(got.as_result(), written)


def test_a_result_is_read_by_its_fields() -> None:
    plan = parse_result("plan", WRITTEN[1][1])
    assert isinstance(plan, PlanResult) and (plan.shards, plan.lanes, plan.unit, plan.canary_shards) == \
        (40, 4, "rows", 3)
    plain = parse_result("plan", WRITTEN[0][1])
    assert isinstance(plain, PlanResult) and plain.canary_shards == 0
    finish = parse_result("finish", WRITTEN[2][1])
    assert isinstance(finish, FinishResult) and finish.stats.stats(0, 4) == RoundStats(
        round=0, shards=4, approved=10, rejected=2, capped=1, errors=1, engine_calls=3)
    assert COST is not None and finish.cost is not None and finish.cost.pools == COST["pools"]
    canary = parse_result("canary", WRITTEN[4][1])
    assert isinstance(canary, CanaryResult) and canary.figures() == CanaryFigures.from_status(WRITTEN[4][1])
    published = parse_result("publish-plan", WRITTEN[6][1])
    assert isinstance(published, PublishPlanResult) and published.published is not None
    summary = published.published
    assert summary.partial is not None and summary.partial.phase == "Cancelled"
    assert summary.work_files_removal is not None and summary.work_files_removal.removed == 2000
    assert summary.counts.not_run == 2 and summary.counts.error_codes == {"timeout": 1}


@pytest.mark.parametrize("kind, raw, says", [
    ("plan", {"shardCount": 3}, "shards: Field required"),
    ("plan", {"shards": "many", "objects": 1, "bytes": 1, "lanes": 1}, "shards: Input should be a valid integer"),
    ("finish", {"stats": []}, "stats: Input should be"),
    ("publish-plan", {"passes": {"ids": 1}}, "neither planUri nor published"),
    ("manifest", {"counts": {"rows": "x"}}, "counts.rows"),
    ("sweep", {}, "no step of kind 'sweep'"),
])
def test_a_result_that_does_not_fit_its_model_says_where(kind: str, raw: dict[str, Any], says: str) -> None:
    with pytest.raises(UnreadableResult, match=says.replace("(", r"\(")):
        parse_result(kind, raw)


MANIFEST: dict[str, Any] = {  # manifest.json as publishing wrote it before the model: a judged, partial job
    "apiVersion": "batchinference.io/v1alpha1",
    "kind": "BatchInferenceJobManifest",
    "job": {"name": "emb", "namespace": None, "id": "emb"},
    "outputUri": "file:///out/",
    "format": "jsonl",
    "compression": "zstd",
    "model": {"engine": "echo", "name": None, "task": "generate"},
    "judge": "regex",
    "parts": [{"path": "manifest-parts/p/00000.json", "bytes": 120, "sha256": "ab", "files": 2, "errorFiles": 1,
               "cappedFiles": 0}],
    "fileCounts": {"files": 2, "errorFiles": 1, "cappedFiles": 0},
    "counts": SUMMARY["counts"],
    "notes": [],
    "rounds": [{**RoundStats(round=0, shards=2, approved=8, rejected=1, capped=0, errors=1).as_status(),
                "rows": 8, "errors": 1},
               {"round": 1, "shards": 1, "rows": 1, "errors": 0}],
    "partial": SUMMARY["partial"],
    "damagedObjects": [{"round": 0, "shard": 1, "object": "in/b.jsonl", "offset": 9, "reason": "not JSON",
                        "message": "in/b.jsonl at byte 9: not JSON"}],
    "engine": {"busySeconds": 8.25, "steps": 0, "meanOccupancy": None, "prefixShare": None, "cachedTokens": 32},
    "efficiency": EFFICIENCY,
    "publishedAt": "2026-01-01T12:00:00Z",
    "cost": COST,
    "canary": {"shards": 2, "estimate": {"rows": 120, "laneSeconds": 30.5, "cost": 0.02},
               "actual": {"rows": 100, "laneSeconds": 28.0, "cost": 0.0156}, "error": {"rows": 0.2}},
    "aFieldOfALaterVersion": {"kept": True},
}


def test_a_manifest_as_published_before_the_model_reads_into_it_and_writes_back_the_same_text() -> None:
    text = json.dumps(MANIFEST, indent=2).encode()
    m = Manifest.parse(text)
    assert m.to_json() == text
    assert (m.job.name, m.partial and m.partial.phase, m.counts.tokens_in, m.file_count(), m.file_count("errorFiles"),
            m.part_paths()) == ("emb", "Cancelled", 120, 2, 1, ["manifest-parts/p/00000.json"])
    assert [r.count("rows") for r in m.rounds] == [8, 1] and m.rounds[0].count("approved") == 8
    # In one document: the lists where the parts stood.
    one: dict[str, Any] = {}
    for k, v in MANIFEST.items():
        if k == "parts":
            one.update({"files": [{"path": "results/a.jsonl.zst", "rows": 8, "bytes": 10, "sha256": "cd",
                                   "input": "day=1/a.jsonl", "round": 0, "shard": 0}],
                        "errorFiles": [], "cappedFiles": []})
        elif k not in ("fileCounts", "partial", "cost", "canary"):
            one[k] = v
    text = json.dumps(one, indent=2).encode()
    assert Manifest.parse(text).to_json() == text and Manifest.parse(text).file_count() == 1
    listed = Manifest.parse(text).files
    assert listed is not None and (listed[0].path, listed[0].input, listed[0].rows) == \
        ("results/a.jsonl.zst", "day=1/a.jsonl", 8)


def test_a_manifest_with_a_failed_removal_carries_it_beside_never_in_the_document() -> None:
    m = Manifest.parse({**MANIFEST, "workFilesRemoval": SUMMARY["workFilesRemoval"]})
    assert m.work_files_removal is not None and "workFilesRemoval" not in json.loads(m.to_json())
    summary = ManifestSummary.of(m)
    assert summary.as_result()["workFilesRemoval"] == SUMMARY["workFilesRemoval"]
    assert summary.files == 2 and summary.counts == ManifestCounts.model_validate(SUMMARY["counts"])


def test_what_is_not_a_manifest_is_said() -> None:
    from bij.contract.manifest import BadManifest

    with pytest.raises(BadManifest, match="m.json is not a manifest"):
        Manifest.parse(b"{not json", "m.json")
    with pytest.raises(BadManifest, match="counts.rows"):
        Manifest.parse({"counts": {"rows": "many"}}, "m.json")
