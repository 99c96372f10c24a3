"""Judge rounds: every row ends exactly once, approved or capped; attempts are durable."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
import zstandard

sys.path.insert(0, str(Path(__file__).parent.parent))
import coin_engine  # noqa: E402

from bij.contract import layout  # noqa: E402
from bij.contract.plan import JudgeMode  # noqa: E402
from bij.contract.rounds import RoundStats, needs_another_round, round_mode  # noqa: E402
from bij.contract.spec import JudgeSpec, load_job, parse_job  # noqa: E402
from bij.engines.base import EngineConfig, Request  # noqa: E402
from bij.engines.echo import EchoEngine  # noqa: E402
from bij.local.run import LocalRunner  # noqa: E402
from bij.steps.planner import plan_round  # noqa: E402
from bij.worker.judge import Judge, attempt_params  # noqa: E402
from bij.worker.shard import ShardWorker, load_plan  # noqa: E402


def write_rows(path: Path, n: int, text: Any = lambda i: f"row {i}") -> list[int]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"id": i, "text": text(i)}) + "\n")
    return list(range(n))


def job_doc(tmp: Path, judge: dict[str, Any], name: str = "judged", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "batchinference.io/v1alpha1", "kind": "BatchInferenceJob", "metadata": {"name": name},
        "spec": {"input": {"uri": f"file://{tmp}/in/"}, "output": {"uri": f"file://{tmp}/out/"},
                 "model": {"engine": "echo", "task": "generate"},
                 "sharding": {"targetShardBytes": 2048, "chunkRows": 20}, "workers": {"parallelism": 2},
                 "judge": judge, **spec},
    }


def run_job(tmp: Path, doc: dict[str, Any]) -> dict[str, Any]:
    spec_path = tmp / "job.yaml"
    spec_path.write_text(yaml.safe_dump(doc))
    rc = LocalRunner(load_job(spec_path), show_progress=False, worker_cmd=coin_engine.worker_cmd()).run()
    assert rc == 0
    return dict(json.loads((tmp / "out" / "manifest.json").read_text()))


def read_rows(tmp: Path, files: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for f in files:
        data = zstandard.ZstdDecompressor().decompress((tmp / "out" / f["path"]).read_bytes(),
                                                       max_output_size=1 << 30)
        rows = [json.loads(line) for line in data.splitlines()]
        assert len(rows) == f["rows"]
        out.extend(rows)
    return out


def test_rounds_every_row_ends_once_and_round_statuses_add_up(tmp_path: Path) -> None:
    ids = write_rows(tmp_path / "in" / "a.jsonl", 300)
    judge = {"type": "regex", "pattern": coin_engine.approve_pattern(30), "strategy": "rounds", "maxRounds": 3}
    m = run_job(tmp_path, job_doc(tmp_path, judge))
    results = read_rows(tmp_path, m["files"])
    capped = read_rows(tmp_path, m["cappedFiles"])
    got = sorted([r["id"] for r in results] + [r["id"] for r in capped])
    assert got == ids  # every row exactly once, approved or capped
    assert m["counts"]["rows"] == len(results) and m["counts"]["capped"] == len(capped) > 0
    rounds = m["rounds"]
    assert len(rounds) == 3
    for before, after in zip(rounds, rounds[1:], strict=False):
        assert after["rowsIn"] == before["rejected"]
    assert rounds[0]["rowsIn"] == 300
    assert sum(r["approved"] for r in rounds) == len(results)
    assert rounds[-1]["capped"] == len(capped) and rounds[-1]["rejected"] == 0
    # One attempt per round: the round that approved a row says how many it took.
    for r in results:
        assert r["attempts"] == r["round"] + 1
        assert r["output"].startswith(f"row {r['id']} #")
    for r in capped:
        assert r["attempts"] == 3 and len(r["verdicts"]) == 3 and r["error"]["code"] == "retry_cap_reached"
    # Published with keepIntermediate false: the rounds' rejected rows (the next rounds' inputs) went
    # with the logs; what went is on record.
    state = tmp_path / "out" / "_bij"
    assert list(state.glob("*/round-0/done/*.json")) and not list(state.glob("*/round-*/rejected/*"))
    (removed,) = state.glob("*/removed.json")
    assert any(f.endswith("/round-1/rejected/") for f in json.loads(removed.read_text())["folders"])


def test_a_users_bij_field_is_refused_in_round_0_and_later_rounds_keep_their_rows_ids(tmp_path: Path) -> None:
    ids: list[Any] = write_rows(tmp_path / "in" / "a.jsonl", 60)
    with (tmp_path / "in" / "a.jsonl").open("a") as f:
        for k in range(12):  # rows without an id: the later rounds must keep the id of their place in round 0
            ids.append(f"a.jsonl:{f.tell()}")
            f.write(json.dumps({"text": f"anon {k}"}) + "\n")
        claim = f.tell()
        f.write(json.dumps({"text": "claims 5", "_bij": {"id": 5, "attempts": 2, "verdicts": ["x"]}}) + "\n")
        f.write(json.dumps({"id": "many", "text": "bad", "_bij": {"attempts": "many"}}) + "\n")
    judge = {"type": "regex", "pattern": coin_engine.approve_pattern(30), "strategy": "rounds", "maxRounds": 3}
    m = run_job(tmp_path, job_doc(tmp_path, judge))
    results, capped = read_rows(tmp_path, m["files"]), read_rows(tmp_path, m["cappedFiles"])
    assert any(r["round"] > 0 and isinstance(r["id"], str) for r in results)  # an id-less row went on
    assert sorted(map(str, [r["id"] for r in results + capped])) == sorted(map(str, ids))  # each once
    for r in results:
        assert r["attempts"] == r["round"] + 1  # the history is bij's own
    errors = read_rows(tmp_path, m["errorFiles"])
    assert [(e["id"], e["error"]["code"]) for e in errors] == [(f"a.jsonl:{claim}", "invalid_row"),
                                                               ("many", "invalid_row")]
    assert all("field '_bij' is reserved" in e["error"]["message"] for e in errors)


def test_rounds_stop_early_when_nothing_is_rejected(tmp_path: Path) -> None:
    write_rows(tmp_path / "in" / "a.jsonl", 50)
    judge = {"type": "regex", "pattern": r"#\d\d$", "strategy": "rounds", "maxRounds": 5}
    m = run_job(tmp_path, job_doc(tmp_path, judge))
    assert len(m["rounds"]) == 1 and m["counts"]["rows"] == 50 and m["counts"]["capped"] == 0


def test_in_place_retries_up_to_max_attempts_with_one_round(tmp_path: Path) -> None:
    ids = write_rows(tmp_path / "in" / "a.jsonl", 300)
    judge = {"type": "regex", "pattern": coin_engine.approve_pattern(30), "strategy": "inPlace",
             "maxAttempts": 4}
    m = run_job(tmp_path, job_doc(tmp_path, judge))
    results = read_rows(tmp_path, m["files"])
    capped = read_rows(tmp_path, m["cappedFiles"])
    assert sorted([r["id"] for r in results] + [r["id"] for r in capped]) == ids
    assert len(m["rounds"]) == 1
    assert all(1 <= r["attempts"] <= 4 and r["round"] == 0 for r in results)
    assert all(r["attempts"] == 4 for r in capped)
    # Engine calls are exactly the attempts made.
    assert m["rounds"][0]["engineCalls"] == sum(r["attempts"] for r in results) + 4 * len(capped)


def test_hybrid_switches_to_in_place_when_approval_stalls(tmp_path: Path) -> None:
    ids = write_rows(tmp_path / "in" / "a.jsonl", 200)
    judge = {"type": "regex", "pattern": coin_engine.approve_pattern(30), "strategy": "hybrid",
             "maxRounds": 5, "maxAttempts": 3, "hybridMinApprovalRate": 0.5, "hybridSwitchAfterRounds": 3}
    m = run_job(tmp_path, job_doc(tmp_path, judge))
    # Round 0 approves about 30% < 50%: round 1 is the last, in place.
    assert len(m["rounds"]) == 2
    assert m["rounds"][1]["rejected"] == 0
    results = read_rows(tmp_path, m["files"])
    capped = read_rows(tmp_path, m["cappedFiles"])
    assert sorted([r["id"] for r in results] + [r["id"] for r in capped]) == ids
    assert all(r["attempts"] == 1 + 3 for r in capped)  # one round attempt, then three in place


class Crash(BaseException):
    """Stands for kill -9: nothing after it runs, nothing is committed by it."""


class CrashingCoin(coin_engine.CoinEngine):
    def __init__(self, crash_on_call: int | None):
        super().__init__(EngineConfig(task="generate"))
        self.crash_on_call = crash_on_call

    def run(self, requests: list[Request]) -> list[Any]:
        if self.crash_on_call is not None and len(self.calls) + 1 == self.crash_on_call:
            raise Crash()
        return super().run(requests)


def test_kill_during_attempt_k_resumes_at_attempt_k(tmp_path: Path) -> None:
    write_rows(tmp_path / "in" / "a.jsonl", 40)
    judge = {"type": "regex", "pattern": coin_engine.approve_pattern(10), "strategy": "inPlace",
             "maxAttempts": 6}
    doc = job_doc(tmp_path, judge)
    doc["spec"]["sharding"] = {"targetShardBytes": 1 << 20, "chunkRows": 1000}
    doc["spec"]["batching"] = {"maxBatchSize": 1000}
    job = parse_job(doc)
    plan = load_plan(plan_round(job, 0).manifest_uri, job.spec.storage.s3)
    first = CrashingCoin(crash_on_call=4)  # attempts 0, 1, 2 complete; the kill lands in attempt 3
    with pytest.raises(Crash):
        ShardWorker(plan, 0, first).run()
    seeds_before = [{r.seed for r in call} for call in first.calls]
    assert seeds_before == [{attempt_params(0.0, 0, k)[1]} for k in range(3)]
    second = CrashingCoin(crash_on_call=None)
    outcome = ShardWorker(plan, 0, second).run()
    assert outcome.status == "done"
    # The resumed worker's first call is attempt 3, for exactly the rows still rejected.
    assert {r.seed for r in second.calls[0]} == {attempt_params(0.0, 0, 3)[1]}
    assert len(second.calls[0]) == len(first.calls[2]) - sum(
        1 for r in first.calls[2] if coin_engine.coin(r.text or "", r.seed) < 10)
    from bij.local.publish import publish_manifest

    m = publish_manifest(job, rounds=1)
    assert m.counts.rows + m.counts.capped == 40


def test_llm_judge_asks_the_same_engine() -> None:
    judge = Judge(JudgeSpec(type="llm", prompt="{output}", approve_pattern=r"^good"))
    engine = EchoEngine(EngineConfig(task="generate"))
    reqs = [Request(text="good one"), Request(text="bad one")]
    verdicts = judge.judge(reqs, ["good one", "bad one"], engine)
    assert [v.approved for v in verdicts] == [True, False]
    assert judge.engine_calls == 2


def test_json_schema_judge_explains_rejections() -> None:
    judge = Judge(JudgeSpec.model_validate({"type": "jsonSchema", "schema": {
        "type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}))
    engine = EchoEngine(EngineConfig(task="generate"))
    v = judge.judge([Request(text="x")] * 3, ['{"name": "a"}', '{"name": 3}', "not json"], engine)
    assert v[0].approved and not v[1].approved and not v[2].approved
    assert "name" in v[1].reason and "not JSON" in v[2].reason


def test_retries_differ_from_the_first_attempt() -> None:
    t0, s0 = attempt_params(0.0, 7, 0)
    t1, s1 = attempt_params(0.0, 7, 1)
    assert (t0, s0) == (0.0, 7)
    assert t1 > 0 and s1 != s0  # a greedy retry would repeat the rejected answer


def judge_spec(**kw: Any) -> JudgeSpec:
    return JudgeSpec.model_validate({"type": "regex", "pattern": "x", **kw})


def stats(r: int, approved: int, rejected: int) -> RoundStats:
    return RoundStats(round=r, shards=1, approved=approved, rejected=rejected, capped=0, errors=0)


def test_round_modes_per_strategy() -> None:
    assert round_mode(None, []).mode == "none"
    assert round_mode(judge_spec(strategy="inPlace"), []).final
    rounds = judge_spec(strategy="rounds", maxRounds=3)
    assert [round_mode(rounds, [stats(0, 1, 1)] * n).final for n in range(3)] == [False, False, True]
    hybrid = judge_spec(strategy="hybrid", maxRounds=10, hybridMinApprovalRate=0.5, hybridSwitchAfterRounds=3)
    assert round_mode(hybrid, []).mode == "rounds"
    assert round_mode(hybrid, [stats(0, 80, 20)]).mode == "rounds"
    assert round_mode(hybrid, [stats(0, 20, 80)]).mode == "inPlace"  # stalled
    assert round_mode(hybrid, [stats(0, 80, 20)] * 3).mode == "inPlace"  # switch after 3 rounds


def test_another_round_only_while_rows_are_rejected() -> None:
    j = judge_spec(strategy="rounds")
    assert needs_another_round(j, [stats(0, 5, 3)])
    assert not needs_another_round(j, [stats(0, 8, 0)])
    assert not needs_another_round(None, [stats(0, 5, 3)])


def test_round_plans_carry_their_mode(tmp_path: Path) -> None:
    write_rows(tmp_path / "in" / "a.jsonl", 10)
    job = parse_job(job_doc(tmp_path, {"type": "regex", "pattern": "x", "strategy": "rounds", "maxRounds": 1}))
    plan = load_plan(plan_round(job, 0).manifest_uri, job.spec.storage.s3)
    assert plan_round(job, 0).manifest_uri == layout.round_manifest_uri(job, 0)
    assert plan.judge_mode == JudgeMode(mode="rounds", final=True)


def test_every_round_is_cut_into_shards_per_lane_within_the_size_limits(tmp_path: Path) -> None:
    from bij.steps.sharding import round_target_bytes

    write_rows(tmp_path / "in" / "a.jsonl", 10)
    doc = job_doc(tmp_path, {"type": "regex", "pattern": "x"})
    doc["spec"]["sharding"] = {"targetShardBytes": 64 << 20}
    doc["spec"]["workers"] = {"parallelism": 8}
    job = parse_job(doc)
    # 8 lanes x 4 shards each: 1 GiB is cut into 32 shards of 32 MiB, not 16 of 64 MiB ...
    assert round_target_bytes(job, 0, 1 << 30) == 32 << 20
    assert round_target_bytes(job, 1, 1 << 30) == 32 << 20  # ... in a judge round too
    assert round_target_bytes(job, 0, 8 << 30) == 64 << 20  # never above targetShardBytes
    assert round_target_bytes(job, 1, 8 << 20) == 1 << 20  # never below minShardBytes (1 MiB)
    doc["spec"]["sharding"] = {"targetShardBytes": 4096, "shardsPerLane": 2, "minShardBytes": 2048}
    small = parse_job(doc)
    assert round_target_bytes(small, 0, 64 << 10) == 4096  # the target wins when it is smaller
    assert round_target_bytes(small, 0, 40 << 10) == 2560  # 40 KiB / (8 lanes x 2)
    assert round_target_bytes(small, 0, 8 << 10) == 2048  # the minimum
