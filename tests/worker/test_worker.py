"""The worker: one shard per process, picked by JOB_COMPLETION_INDEX; exit codes the Job relies on."""

from __future__ import annotations

import functools
import json
import subprocess
from typing import Any

import pytest
from input_rows import numbered

from bij.contract import layout
from bij.contract.codes import EXIT_BAD_CONFIG
from bij.contract.plan import Plan
from bij.local.publish import publish_manifest
from bij.steps.planner import plan_round
from bij.worker.prepare import Preparer
from bij.worker.shard import (
    BadConfig,
    EngineFailure,
    ShardWorker,
    StopFlag,
    load_plan,
    run_isolating,
)

rows = functools.partial(numbered, filler="q", period=40)


def planned(job: Any) -> Plan:
    plan_round(job, 0)
    return load_plan(layout.round_manifest_uri(job, 0), job.spec.storage.s3)


def test_a_finished_shard_records_its_counts_and_is_not_worked_again(file_place, make_job, run_shards,
                                                                     recording_echo):
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", [*rows(50), "bad"]),
                      sharding={"chunkRows": 16, "targetShardBytes": 1 << 20})
    outcome = run_shards(job)[0]
    assert (outcome.status, outcome.rows, outcome.errors) == ("done", 50, 1)
    plan = planned(job)
    done = json.loads(file_place.storage.read_bytes(layout.done_uri(plan.round_prefix, 0)))
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
    publish_manifest(job)
    out = read_output(job)
    assert out.result_ids == [r["id"] for r in inputs if r["id"] != 17]
    [err] = out.errors
    assert err["id"] == 17 and err["error"]["code"] == "engine_rejected" and "poison" in err["error"]["message"]


def test_rows_that_each_break_the_engine_are_error_rows_when_a_plain_request_still_runs(
        file_place, make_job, run_shards, recording_echo, read_output):
    """Every row of a batch failing alone is no proof that the engine is broken: a plain canary
    request decides, and here it runs, so the rows are to blame and the job publishes them as errors."""
    inputs = rows(20)
    for r in inputs[4:8]:
        r["text"] = f"poison {r['id']}"
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", inputs),
                      batching={"maxBatchSize": 4, "sortByLength": False}, sharding={"chunkRows": 20})
    engine = recording_echo(fail_on="poison")
    run_shards(job, engine=engine)
    publish_manifest(job)
    out = read_output(job)
    assert out.result_ids == [r["id"] for r in inputs if not str(r["text"]).startswith("poison")]
    assert sorted(e["id"] for e in out.errors) == [4, 5, 6, 7]
    assert {e["error"]["code"] for e in out.errors} == {"engine_rejected"}
    assert all("RuntimeError: cannot run 'poison'" in e["error"]["message"] for e in out.errors)
    assert "Hello" in engine.seen  # the canary ran


def test_a_job_whose_every_row_fails_alone_still_publishes_its_error_file(
        file_place, make_job, run_shards, recording_echo, read_output):
    inputs = [{"id": i, "text": f"poison {i}"} for i in range(12)]
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", inputs), batching={"maxBatchSize": 4})
    run_shards(job, engine=recording_echo(fail_on="poison"))
    manifest = publish_manifest(job)
    out = read_output(job)
    assert out.results == [] and sorted(e["id"] for e in out.errors) == list(range(12))
    assert manifest.counts.error_codes == {"engine_rejected": 12} and manifest.error_files


def test_an_empty_exception_still_names_its_type_and_where_it_was_raised(
        file_place, make_job, run_shards, recording_echo, read_output):
    """A grammar backend's bare `assert` raises an AssertionError with no message: the row's error says
    what was raised and where, never just "AssertionError: "."""
    inputs = rows(6)
    inputs[2]["text"] = "poison"

    class Asserting(recording_echo):  # type: ignore[misc, valid-type]
        def run(self, requests: list[Any]) -> list[Any]:
            from bij.engines.base import request_text

            if any("poison" in request_text(r) for r in requests):
                raise AssertionError  # no message, as a bare `assert` outside pytest
            return super().run(requests)

    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", inputs), sharding={"chunkRows": 6})
    run_shards(job, engine=Asserting())
    publish_manifest(job)
    [err] = read_output(job).errors
    assert err["id"] == 2 and err["error"]["code"] == "engine_rejected"
    assert err["error"]["message"].startswith("the engine failed on this row: AssertionError raised at test_worker.py:")
    assert err["error"]["message"].endswith(" in run")


def test_an_engine_that_fails_every_row_and_a_plain_request_fails_the_shard(
        file_place, make_job, run_shards, recording_echo, log_lines):
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", rows(20)))
    with pytest.raises(EngineFailure, match="fails on a batch of .* and on a plain request too"):
        run_shards(job, engine=recording_echo(fail_on=""))
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
    publish_manifest(job)
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


def test_job_completion_index_picks_the_lane_which_works_its_shards_first_then_the_rest(
        place, make_job, worker_env, bij_bin):
    _, job = make_job(place, place.write_jsonl("in.jsonl", rows(300)), sharding={"targetShardBytes": 2048},
                      workers={"parallelism": 3})
    plan = planned(job)
    n = len(plan.shards)
    assert n >= 7 and plan.lanes == 3
    p = worker(bij_bin, worker_env(place), "--manifest", layout.round_manifest_uri(job, 0), "--progress", index="2")
    assert p.returncode == 0, p.stderr
    order = [e["index"] for e in map(json.loads, p.stdout.splitlines()) if e["event"] == "done"]
    own = list(range(2, n, 3))
    assert order[:len(own)] == own  # its own shards, in order
    assert sorted(order) == list(range(n))  # then every other one: nobody else was working
    # The other lanes' shards were taken from the end of the lane with the most left (the first such lane).
    left = {lane: list(range(lane, n, 3)) for lane in (0, 1)}
    busiest = max(left, key=lambda lane: (len(left[lane]), -lane))
    assert order[len(own)] == left[busiest][-1]
    loads = [e for e in map(json.loads, p.stdout.splitlines()) if e["event"] == "loaded"]
    assert len(loads) == 1  # one model load for all of them
    records = [json.loads(place.storage.read_bytes(layout.done_uri(plan.round_prefix, i))) for i in range(n)]
    assert sum(r["modelLoads"] for r in records) == 1 and all(r["lane"] == 2 for r in records)
    # A lane whose round is done does nothing, not even load the model.
    again = worker(bij_bin, worker_env(place), "--manifest", layout.round_manifest_uri(job, 0), "--progress", index="0")
    assert again.returncode == 0 and '"loaded"' not in again.stdout


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
        doc = plan.to_doc()
        doc["job"]["spec"]["model"] = model
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
    _, job = make_job(place, place.uri("in/"), sharding={"chunkRows": 20, "targetShardBytes": 1 << 20},
                      batching={"inFlightRows": 20, "commitQueueChunks": 1})
    stop = StopFlag()
    events: list[dict[str, Any]] = []

    def progress(ev: dict[str, Any]) -> None:
        events.append(ev)
        if sum(e["event"] == "chunk" for e in events) == 2:
            stop.request()

    # Stopped after two chunks, with at most one more in the window and none beyond the queue's one:
    # either way inside the compressed object's 70 rows.
    durable = run_shards(job, stop=stop, progress=progress)[0].rows
    assert durable in (40, 60)
    engine = recording_echo()
    run_shards(job, engine=engine)
    assert sorted(engine.seen) == sorted(r["text"] for r in inputs[durable:])
    publish_manifest(job)
    assert read_output(job).result_ids == [r["id"] for r in inputs]


def test_a_running_shard_reports_live_counts_that_the_done_record_supersedes(file_place, make_job, monkeypatch):
    from bij.engines.base import EngineConfig
    from bij.engines.echo import EchoEngine
    from bij.steps.progress import live_records, shard_records
    from bij.storage import open_storage

    monkeypatch.setenv("BIJ_PROGRESS_SECONDS", "0")  # after every commit
    # One chunk in the window, one in the commit queue: when chunk j runs, chunk j-2 is durable.
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", rows(40)),
                      sharding={"chunkRows": 8, "targetShardBytes": 1 << 20},
                      batching={"inFlightRows": 8, "commitQueueChunks": 1})
    plan = planned(job)
    seen: list[int] = []

    class Watching(EchoEngine):
        def run(self, requests):  # type: ignore[no-untyped-def]
            # Before this chunk is committed, the operator sees the rows of the chunks before it.
            seen.append(sum(r["rows"] for r in live_records(job, 0).values()))
            return super().run(requests)

    ShardWorker(plan, 0, Watching(EngineConfig(task="generate"))).run()
    assert seen[0] == 0 and len(seen) == 5
    assert all(seen[j] in (8 * (j - 1), 8 * j) for j in range(1, 5)), seen
    assert shard_records(job, 0)[0]["rows"] == 40 == live_records(job, 0)[0]["rows"]
    at = layout.progress_uri(plan.round_prefix, 0)
    last = json.loads(open_storage(at, job.spec.storage.s3).read_bytes(at))
    assert (last["index"], last["rows"], last["errors"]) == (0, 40, 0)


# --- streaming: rows flow into the engine across chunk boundaries ----------------------------


def simulated_engine(max_num_seqs: int, step_seconds: float = 0.0) -> Any:
    from bij.engines import EngineConfig, create_engine

    return create_engine("simulated", EngineConfig(task="generate", simulated={
        "maxNumSeqs": max_num_seqs, "stepSeconds": step_seconds}))


def test_a_continuous_engine_runs_rows_of_several_chunks_at_once(file_place, make_job, run_shards, read_output):
    inputs = [{"id": i, "text": " ".join(f"w{i}-{k}" for k in range(3 + i % 5))} for i in range(60)]
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", inputs),
                      model={"engine": "simulated", "task": "generate", "simulated": {"maxNumSeqs": 8}},
                      sharding={"chunkRows": 2, "targetShardBytes": 1 << 20})
    engine = simulated_engine(8)
    running: list[int] = []
    step = engine.step

    def recording_step() -> list[Any]:
        running.append(min(engine.unfinished(), 8))
        return step()

    engine.step = recording_step
    assert run_shards(job, engine=engine)[0].status == "done"
    done = json.loads(file_place.storage.read_bytes(layout.done_uri(planned(job).round_prefix, 0)))
    # Chunk by chunk, at most 2 rows (one chunk) could ever run together.
    assert max(running) == 8 and done["engineSteps"] == len(running)
    assert done["meanOccupancy"] == pytest.approx(sum(running) / (8 * len(running)), abs=1e-3)
    assert done["meanOccupancy"] > 0.6 and done["chunks"] == 30
    publish_manifest(job)
    out = read_output(job)
    assert out.result_ids == list(range(60))
    assert [r["output"] for r in out.results] == [r["text"] for r in inputs]
    assert out.results[0]["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


def test_a_batch_engine_cuts_batches_from_the_whole_window_sorted_by_length(file_place, make_job, run_shards,
                                                                           recording_echo, read_output):
    lengths = [3, 40, 7, 90, 1, 55, 12, 70, 5, 33, 64, 2, 18, 81, 9, 47]
    inputs = [{"id": i, "text": "x" * (4 * n)} for i, n in enumerate(lengths)]
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", inputs),
                      sharding={"chunkRows": 4, "targetShardBytes": 1 << 20},
                      batching={"maxBatchSize": 4, "targetBatchTokens": 100_000, "inFlightRows": 16})
    engine = recording_echo()
    run_shards(job, engine=engine)
    # The four chunks fill the window before anything runs: the first batch has the longest rows of all.
    assert [len(t) // 4 for t in engine.batches[0]] == [90, 81, 70, 64]
    assert [len(t) // 4 for t in engine.seen] == sorted(lengths, reverse=True)
    publish_manifest(job)
    assert read_output(job).result_ids == list(range(16))


@pytest.mark.parametrize("task", ["generate", "embed"])
def test_only_embedding_batches_are_cut_short_for_padding(task, file_place, make_job, run_shards, recording_echo):
    """An embedding batch costs its rows x its longest prompt, so short rows are not padded to long ones;
    a generation batch costs its decode steps, the same for 4 rows as for 16, so it is never cut short."""
    lengths = [100] * 4 + [10] * 12
    inputs = [{"id": i, "text": "x" * (4 * n)} for i, n in enumerate(lengths)]
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", inputs), model={"engine": "echo", "task": task},
                      sharding={"chunkRows": 16, "targetShardBytes": 1 << 20},
                      batching={"maxBatchSize": 16, "targetBatchTokens": 100_000})
    engine = recording_echo(task)
    run_shards(job, engine=engine)
    sizes = [len(b) for b in engine.batches]
    assert sum(sizes) == 16
    if task == "generate":
        assert sizes == [16]
    else:  # the long rows alone (with one short row at most: 20% of padding is allowed), then the short ones
        assert len(sizes) == 2 and sizes[0] in (4, 5)


def test_prompts_sharing_a_prefix_run_together_and_the_share_is_reported(file_place, make_job, run_shards,
                                                                        read_output):
    import random

    rnd = random.Random(3)
    systems = [f"You are assistant number {k}. Answer in the style of a {k}-line poem. " * 3 for k in range(4)]
    inputs = [{"id": i, "text": rnd.choice(systems) + f"question {i} " + "q " * rnd.randint(1, 9)}
              for i in range(96)]
    path = file_place.write_jsonl("in.jsonl", inputs)
    share = {}
    for prefix in (True, False):
        _, job = make_job(file_place, path, name=f"p{int(prefix)}", out_dir=f"out-{int(prefix)}/",
                          model={"engine": "simulated", "task": "generate"},
                          sharding={"chunkRows": 8, "targetShardBytes": 1 << 20},
                          batching={"prefixOrder": prefix, "inFlightRows": 48})
        run_shards(job, engine=simulated_engine(16))
        publish_manifest(job)
        out = read_output(job)
        assert out.result_ids == list(range(96))
        share[prefix] = out.manifest["engine"]["prefixShare"]
        done = json.loads(file_place.storage.read_bytes(layout.done_uri(planned(job).round_prefix, 0)))
        assert done["prefixShare"] == share[prefix]
    # Four prompts in random order: as read, a row follows one with its prefix about a quarter of the time.
    assert share[True] > 0.6 and share[False] < 0.45 and share[True] > share[False] + 0.25


def test_the_commit_writer_keeps_order_and_stops_at_the_first_failure():
    import threading

    from bij.worker.commits import CommitWriter

    written: list[list[int]] = []
    gate = threading.Event()

    def commit(items: list[int]) -> None:
        gate.wait(5)
        if 3 in items:
            raise OSError("storage down")
        written.append(items)

    writer = CommitWriter(commit, slots=2)
    writer.put(1)
    writer.put(2)
    assert written == []  # compute went on while storage waited
    gate.set()
    writer.put(3)
    writer.put(4)
    with pytest.raises(OSError, match="storage down"):
        writer.close()
    # In order, chunks that waited together in one write, nothing after the failed one.
    assert [i for group in written for i in group] == [1, 2]


def test_sigterm_stops_taking_chunks_and_finishes_the_window(file_place, make_job, run_shards, recording_echo):
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", rows(100)),
                      sharding={"chunkRows": 10, "targetShardBytes": 1 << 20},
                      batching={"inFlightRows": 20, "commitQueueChunks": 2})
    stop = StopFlag()
    events: list[dict[str, Any]] = []

    def progress(ev: dict[str, Any]) -> None:
        events.append(ev)
        if ev["event"] == "chunk":
            stop.request()

    outcome = run_shards(job, stop=stop, progress=progress)[0]
    # The window (2 chunks) and the commit queue (2 chunks) may hold work when the signal comes.
    assert outcome.status == "stopped" and outcome.rows % 10 == 0 and 10 <= outcome.rows <= 50
    assert sum(e["rows"] for e in events if e["event"] == "chunk") == outcome.rows


def test_chunks_parsed_in_the_reader_thread_give_the_same_output(file_place, make_job, run_shards, recording_echo,
                                                                 read_output):
    import threading

    inputs: list[Any] = [*rows(70), "not json", {"id": "x"}, *rows(75)[70:]]
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", inputs),
                      sharding={"chunkRows": 8, "targetShardBytes": 1 << 20}, batching={"maxBatchSize": 4})
    engine = recording_echo()
    engine.parallel_prepare = True  # as torch and vLLM engines say: parse while the engine computes
    parsed_in: set[str] = set()
    parse = Preparer.parse

    def watching(self: Any, chunk: Any) -> Any:
        parsed_in.add(threading.current_thread().name)
        return parse(self, chunk)

    Preparer.parse = watching  # type: ignore[method-assign]
    try:
        assert run_shards(job, engine=engine)[0].rows == 75
    finally:
        Preparer.parse = parse  # type: ignore[method-assign]
    assert parsed_in == {"bij-prefetch"}
    publish_manifest(job)
    out = read_output(job)
    assert out.result_ids == list(range(75))
    assert [e["error"]["code"] for e in out.errors] == ["invalid_json", "missing_text"]


def test_chunks_of_plain_rows_and_chunks_with_bad_rows_give_the_same_records(file_place, make_job, run_shards,
                                                                           read_output, log_lines, monkeypatch):
    """Plain chunks are parsed and encoded in one pass, others row by row: the rows cannot tell."""
    good: list[Any] = [{"id": i if i % 3 else f"s{i}", "text": f"ünïcødé {i} ✓" + "w" * (i % 7)} for i in range(40)]
    inputs: list[Any] = [*good[:16], *good[16:20], b'{"id": 99, "text": ', *good[20:23],  # chunk 3: a bad line
                         *good[23:32], {"id": "1", "text": "string one"}, *good[32:]]
    uri = file_place.write_jsonl("in.jsonl", inputs)
    _, job = make_job(file_place, uri, sharding={"chunkRows": 8, "targetShardBytes": 1 << 20})
    from bij.worker import prepare

    line_by_line: list[bytes] = []
    parse_line = prepare.parse_line
    monkeypatch.setattr(prepare, "parse_line", lambda line, *a: line_by_line.append(line) or parse_line(line, *a))
    assert run_shards(job)[0].rows == 41
    assert len(line_by_line) == 8  # the bad line's chunk alone
    records = log_lines(file_place, job)[0]
    results = [r for r in records if r["kind"] == "result"]
    texts = {json.dumps(r["id"]): r["text"] for r in [*good, {"id": "1", "text": "string one"}]}
    for rec in results:
        row = rec["row"]
        n = max(1, len(texts[json.dumps(row["id"])].encode()) // 4)
        assert row == {"id": row["id"], "output": texts[json.dumps(row["id"])],
                       "usage": {"prompt_tokens": n, "completion_tokens": n, "total_tokens": 2 * n}}
        assert list(rec) == ["at", "kind", "row"] and list(row) == ["id", "output", "usage"]
    [bad] = [r for r in records if r["kind"] == "error"]
    offset = file_place.storage.read_bytes(uri).index(b'{"id": 99, "text": ')
    assert bad["at"][1] == offset and bad["row"]["offset"] == offset and bad["row"]["object"].endswith("in.jsonl")
    assert bad["row"]["error"]["code"] == "invalid_json" and "not valid JSON" in bad["row"]["error"]["message"]
    publish_manifest(job)
    out = read_output(job)
    assert out.result_ids == [r["id"] for r in [*good[:32], {"id": "1"}, *good[32:]]]
    assert [type(i) for i in out.result_ids] == [type(r["id"]) for r in [*good[:32], {"id": "1"}, *good[32:]]]
    assert [r["output"] for r in out.results] == [texts[json.dumps(i)] for i in out.result_ids]
