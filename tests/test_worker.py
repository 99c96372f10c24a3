"""The worker: one shard per process, picked by JOB_COMPLETION_INDEX; exit codes the Job relies on."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest
from bij_operator import layout
from bij_operator.planner import plan_round
from bij_operator.publish import publish
from bij_worker.worker import (
    EXIT_BAD_CONFIG,
    BadConfig,
    EngineFailure,
    ShardWorker,
    StopFlag,
    done_uri,
    load_plan,
    run_isolating,
)


def rows(n: int) -> list[dict[str, Any]]:
    return [{"id": i, "text": f"row {i} " + "q" * (i % 40)} for i in range(n)]


def planned(job: Any) -> dict[str, Any]:
    plan_round(job, 0)
    return load_plan(layout.round_manifest_uri(job, 0), job.spec.storage.s3)


def test_a_finished_shard_records_its_counts_and_is_not_worked_again(file_place, make_job, run_shards,
                                                                     recording_echo):
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", [*rows(50), "bad"]),
                      sharding={"chunkRows": 16, "targetShardBytes": 1 << 20})
    outcome = run_shards(job)[0]
    assert (outcome.status, outcome.rows, outcome.errors) == ("done", 50, 1)
    plan = planned(job)
    done = json.loads(file_place.storage.read_bytes(done_uri(plan, 0)))
    assert (done["index"], done["round"], done["rows"], done["errors"], done["chunks"]) == (0, 0, 50, 1, 4)
    assert done["engineCalls"] == 50
    engine = recording_echo()
    again = ShardWorker(plan, 0, engine).run()
    assert (again.status, again.rows, again.errors, engine.batches) == ("done", 50, 1, [])


def test_progress_events_add_up_to_the_shards_rows(file_place, make_job, run_shards):
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", [*rows(45), "bad"]),
                      sharding={"chunkRows": 10, "targetShardBytes": 1 << 20})
    events: list[dict[str, Any]] = []
    run_shards(job, progress=events.append)
    kinds = [e["event"] for e in events]
    assert kinds == ["resume"] + ["chunk"] * 5 + ["done"]
    chunks = [e for e in events if e["event"] == "chunk"]
    assert sum(e["rows"] for e in chunks) == 45 and sum(e["errors"] for e in chunks) == 1
    assert sum(e["bytes"] for e in chunks) == file_place.storage.list(file_place.uri("in.jsonl"))[0].size
    assert events[-1] == {"event": "done", "index": 0, "rows": 45, "errors": 1}


def test_one_row_that_breaks_the_engine_fails_alone(file_place, make_job, run_shards, recording_echo, read_output):
    inputs = rows(40)
    inputs[17]["text"] = "poison pill"
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", inputs),
                      batching={"maxBatchSize": 16}, sharding={"chunkRows": 40})
    run_shards(job, engine=recording_echo(fail_on="poison"))
    publish(job)
    out = read_output(job)
    assert out.result_ids == [r["id"] for r in inputs if r["id"] != 17]
    [err] = out.errors
    assert err["id"] == 17 and err["error"]["code"] == "engine_error" and "poison" in err["error"]["message"]


def test_an_engine_that_fails_every_row_fails_the_shard_instead_of_recording_errors(
        file_place, make_job, run_shards, recording_echo, log_lines):
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", rows(20)))
    with pytest.raises(EngineFailure, match="every row"):
        run_shards(job, engine=recording_echo(fail_on="row"))
    assert log_lines(file_place, job) == {}  # nothing committed: a retry starts clean

    class Short:
        def run(self, requests: list[Any]) -> list[Any]:
            return []

    with pytest.raises(EngineFailure, match="0 results for 2 requests"):
        run_isolating(Short(), [object(), object()])  # type: ignore[arg-type, list-item]


def test_chat_rows_can_carry_messages(file_place, make_job, run_shards, read_output):
    lines = [{"id": "m", "messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "there"}]},
             {"id": "t", "text": "plain"}, {"id": "bad", "messages": "nope"}]
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", lines), model={"task": "chat"},
                      input={"messagesField": "messages"})
    run_shards(job)
    publish(job)
    out = read_output(job)
    assert [(r["id"], r["output"]) for r in out.results] == [("m", "hi\nthere"), ("t", "plain")]
    assert [(e["id"], e["error"]["code"]) for e in out.errors] == [("bad", "invalid_messages")]


def test_an_index_out_of_range_is_a_bad_configuration(file_place, make_job, recording_echo):
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", rows(5)))
    with pytest.raises(BadConfig, match="shard index 3 is out of range: the round has 1 shards"):
        ShardWorker(planned(job), 3, recording_echo())


def worker(bij_bin: Any, env: dict[str, str], *args: str, index: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in env.items() if k != "JOB_COMPLETION_INDEX"}
    if index is not None:
        env["JOB_COMPLETION_INDEX"] = index
    return subprocess.run([bij_bin("bij-worker"), *args], env=env, capture_output=True, text=True, timeout=60)


def test_job_completion_index_picks_the_shard(place, make_job, worker_env, bij_bin):
    _, job = make_job(place, place.write_jsonl("in.jsonl", rows(300)), sharding={"targetShardBytes": 2048})
    plan = planned(job)
    assert len(plan["shards"]) >= 3
    p = worker(bij_bin, worker_env(place), "--manifest", layout.round_manifest_uri(job, 0), index="2")
    assert p.returncode == 0, p.stderr
    assert [place.storage.exists(done_uri(plan, i)) for i in range(3)] == [False, False, True]


def test_bad_configurations_exit_42(file_place, make_job, worker_env, bij_bin):
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", rows(5)))
    plan_uri = layout.round_manifest_uri(job, 0)
    plan = planned(job)
    env = worker_env()
    cases = {
        "no such plan": (["--manifest", plan_uri + ".missing"], "0"),
        "index out of range": (["--manifest", plan_uri], "7"),
        "no index": (["--manifest", plan_uri], None),
        "no plan given": ([], "0"),
    }
    for what, (args, index) in cases.items():
        p = worker(bij_bin, env, *args, index=index)
        assert p.returncode == EXIT_BAD_CONFIG, what
        assert "bad configuration" in p.stderr, what

    # A plan whose engine cannot be built (or loaded) is a bad configuration too, not a retry.
    for model in ({"engine": "no-such-engine"}, {"engine": "sentence-transformers", "name": "/no/such/model"},
                  {"engine": "transformers", "task": "generate"}):
        doc = {**plan, "job": {**plan["job"], "spec": {**plan["job"]["spec"], "model": model}}}
        file_place.storage.write_bytes(plan_uri + ".bad", json.dumps(doc).encode())
        p = worker(bij_bin, env, "--manifest", plan_uri + ".bad", index="0")
        assert p.returncode == EXIT_BAD_CONFIG, (model, p.stderr)


def test_a_storage_error_no_retry_fixes_exits_42(s3_place, make_job, worker_env, bij_bin):
    # A bucket that is not there (or access denied, or no credentials) is the same on every node and retry.
    p = worker(bij_bin, worker_env(s3_place), "--manifest", "s3://no-such-bucket-here/_bij/t/round-0/shards.json",
               index="0")
    assert p.returncode == EXIT_BAD_CONFIG, p.stderr
    assert "NoSuchBucket" in p.stderr and "create the bucket or fix the URI" in p.stderr


def test_a_compressed_input_resumes_inside_the_object(place, make_job, run_shards, recording_echo, read_output):
    inputs = rows(120)
    place.write_jsonl("in/a.jsonl.zst", inputs[:70], zst=True)
    place.write_jsonl("in/b.jsonl", inputs[70:])
    _, job = make_job(place, place.uri("in/"), sharding={"chunkRows": 20, "targetShardBytes": 1 << 20})
    stop = StopFlag()
    events: list[dict[str, Any]] = []

    def progress(ev: dict[str, Any]) -> None:
        events.append(ev)
        if sum(e["event"] == "chunk" for e in events) == 2:
            stop.request()

    assert run_shards(job, stop=stop, progress=progress)[0].rows == 40
    engine = recording_echo()
    run_shards(job, engine=engine)
    assert sorted(engine.seen) == sorted(r["text"] for r in inputs[40:])
    publish(job)
    assert read_output(job).result_ids == [r["id"] for r in inputs]


def test_a_running_shard_reports_live_counts_that_the_done_record_supersedes(file_place, make_job, monkeypatch):
    from bij_operator.progress import live_records, shard_records
    from bij_worker.engines.base import EngineConfig
    from bij_worker.engines.echo import EchoEngine
    from bij_worker.storage import open_storage
    from bij_worker.worker import progress_uri

    monkeypatch.setenv("BIJ_PROGRESS_SECONDS", "0")  # after every commit
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", rows(40)),
                      sharding={"chunkRows": 8, "targetShardBytes": 1 << 20})
    plan = planned(job)
    seen: list[int] = []

    class Watching(EchoEngine):
        def run(self, requests):  # type: ignore[no-untyped-def]
            # Before this chunk is committed, the operator sees the rows of the chunks before it.
            seen.append(sum(r["rows"] for r in live_records(job, 0).values()))
            return super().run(requests)

    ShardWorker(plan, 0, Watching(EngineConfig(task="generate"))).run()
    assert seen == [0, 8, 16, 24, 32]
    assert shard_records(job, 0)[0]["rows"] == 40 == live_records(job, 0)[0]["rows"]
    last = json.loads(open_storage(progress_uri(plan, 0)).read_bytes(progress_uri(plan, 0)))
    assert (last["index"], last["rows"], last["errors"]) == (0, 40, 0)
