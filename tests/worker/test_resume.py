"""Resume: whatever stops a worker (kill -9, SIGTERM, a torn write, a failed upload), a rerun finishes
the shard with every row exactly once, recomputing at most the in-flight window and the commit queue."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import zstandard

from bij.contract import layout
from bij.contract.codes import EXIT_FAILED, EXIT_TERMINATED
from bij.contract.plan import Plan
from bij.local.publish import publish_manifest
from bij.steps.planner import plan_round
from bij.storage.segments import DamagedLog, ShardLog, frame_length
from bij.worker.shard import ShardWorker, StopFlag, load_plan


def rows_with_mixed_lengths(n: int, seed: int = 7, bad_every: int = 0) -> list[Any]:
    rnd = random.Random(seed)
    rows: list[Any] = []
    for i in range(n):
        if bad_every and i % bad_every == bad_every - 1:
            rows.append(f'{{"id": {i}, "text": ')  # invalid JSON: an error row, never sent to the engine
        else:
            rows.append({"id": i, "text": f"row {i} " + "w" * rnd.choice([1, 5, 40, 300])})
    return rows


def check_complete(out: Any, inputs: list[Any]) -> None:
    """Every input row is published exactly once: good rows as results (echo: output == text, in input
    order), bad rows as errors."""
    good = [r for r in inputs if isinstance(r, dict)]
    assert out.result_ids == [r["id"] for r in good]
    assert [r["output"] for r in out.results] == [r["text"] for r in good]
    assert len(out.errors) == len(inputs) - len(good)
    assert all(e["error"]["code"] == "invalid_json" for e in out.errors)
    assert out.manifest["counts"]["rows"] == len(good)
    assert out.manifest["counts"]["inputRows"] == len(inputs)


def places_once(log_lines: Any, place: Any, job: Any) -> int:
    """Raw durable records (no de-duplication): each row's place appears exactly once. Returns the count."""
    total = 0
    for index, records in log_lines(place, job).items():
        counts = Counter((r["at"][0], r["at"][1]) for r in records)
        assert max(counts.values()) == 1, f"shard {index} has a row committed twice"
        total += len(records)
    return total


def shard_plan(job: Any) -> Plan:
    plan_round(job, 0)
    return load_plan(layout.round_manifest_uri(job, 0), job.spec.storage.s3)


def chunked_job(file_place: Any, make_job: Any, inputs: list[Any]) -> Any:
    """One shard of chunks of 10 rows, 10 rows in flight and two chunks queued for commit."""
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", inputs),
                      sharding={"chunkRows": 10, "targetShardBytes": 1 << 20},
                      batching={"inFlightRows": 10, "commitQueueChunks": 2})
    return job


def stop_after_chunks(chunks: int) -> dict[str, Any]:
    """run_shards' stop and progress arguments that ask the worker to stop once `chunks` are durable."""
    stop = StopFlag()
    events: list[dict[str, Any]] = []

    def progress(ev: dict[str, Any]) -> None:
        events.append(ev)
        if sum(1 for e in events if e["event"] == "chunk") == chunks:
            stop.request()

    return {"stop": stop, "progress": progress}


def test_resume_skips_rows_already_durable(file_place, make_job, run_shards, recording_echo, read_output):
    inputs = rows_with_mixed_lengths(100)
    job = chunked_job(file_place, make_job, inputs)
    # Stop once three chunks are durable: no chunk joins the window after that; what is in the
    # window (one chunk) and the commit queue (two) is finished.
    first = run_shards(job, **stop_after_chunks(3))
    durable = first[0].rows
    assert first[0].status == "stopped" and durable in (30, 40, 50)

    engine = recording_echo()
    second = run_shards(job, engine=engine)
    assert second[0].status == "done" and second[0].rows == 100
    assert sorted(engine.seen) == sorted(r["text"] for r in inputs[durable:])  # batches run sorted by length
    publish_manifest(job)
    check_complete(read_output(job), inputs)


@pytest.mark.parametrize("given", [False, True])
def test_a_resumed_shard_counts_the_rows_whose_id_is_their_place_as_one_run_does(given, file_place, make_job,
                                                                                  run_shards):
    # placeIds: final rows whose id is none or generated from their place; publishing skips its ids
    # and dedupe passes only when they are every row (`publish.ids_cannot_repeat`).
    inputs: list[Any] = [{"text": f"row {i}"} | ({"id": f"in.jsonl:x{i}"} if given else {}) for i in range(60)]
    inputs.append("bad line")
    job = chunked_job(file_place, make_job, inputs)
    assert run_shards(job, **stop_after_chunks(2))[0].status == "stopped"
    assert run_shards(job)[0].status == "done"
    plan = load_plan(layout.round_manifest_uri(job, 0), job.spec.storage.s3)
    done = json.loads(file_place.storage.read_bytes(layout.done_uri(plan.round_prefix, 0)))
    # Given ids (even ones shaped like a place's) are never counted: the error row without an id is.
    assert (done["rows"], done["errors"], done["placeIds"]) == (60, 1, 1 if given else 61)


def writer_log(plan: Plan, index: int) -> Path:
    """The one writer's log of a shard worked once (file://)."""
    (log,) = Path(layout.shard_prefix(plan.round_prefix, index)[len("file://"):]).glob("log-*.jsonl.zst")
    return log


def log_frames(log: Path) -> list[bytes]:
    """The zstd frames of a shard log: one per write the worker made."""
    data, frames, pos = log.read_bytes(), [], 0
    while pos < len(data):
        n = frame_length(data, pos)
        assert n, f"{log} holds a torn frame at byte {pos}"
        frames.append(data[pos:pos + n])
        pos += n
    return frames


def frame_records(frame: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in zstandard.ZstdDecompressor().decompress(frame).splitlines()]


def tear_log(log: Path, keep: int, partial: bool = True) -> bytes:
    """Keep `keep` whole frames of a shard log, plus (with `partial`) half of the next one, as a crash would."""
    frames = log_frames(log)
    torn = frames[keep][: len(frames[keep]) // 2] if partial else b""
    log.write_bytes(b"".join(frames[:keep]) + torn)
    return torn


def test_a_torn_last_frame_is_skipped_and_only_its_rows_recomputed(file_place, make_job, run_shards, recording_echo,
                                                                   read_output, log_lines):
    inputs = rows_with_mixed_lengths(40)
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", inputs),
                      sharding={"chunkRows": 8, "targetShardBytes": 1 << 20})
    run_shards(job)
    plan = shard_plan(job)
    log = writer_log(plan, 0)
    frames = log_frames(log)
    assert len(frames) > 1
    lost = frame_records(frames[-1])
    torn = tear_log(log, keep=len(frames) - 1)
    assert torn
    os.unlink(layout.done_uri(plan.round_prefix, 0)[len("file://"):])  # the crash came before the shard finished

    engine = recording_echo()
    run_shards(job, engine=engine)
    assert sorted(engine.seen) == sorted(r["row"]["output"] for r in lost)
    assert places_once(log_lines, file_place, job) == 40
    publish_manifest(job)
    check_complete(read_output(job), inputs)


def test_a_torn_tail_never_skips_an_earlier_row_of_its_chunk(file_place, make_job, run_shards, recording_echo,
                                                            read_output, log_lines):
    # Bad rows are recorded without the engine; the resume cursor (the furthest durable row) must never
    # jump over a good row whose record was lost with a torn frame.
    inputs: list[Any] = [{"id": i, "text": f"row {i}"} for i in range(11)]
    inputs[3] = "not json"
    inputs[10] = "not json either"
    # Published after each tear, then torn again: the log must outlive a publish.
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", inputs),
                      sharding={"chunkRows": 2, "targetShardBytes": 1 << 20}, output={"keepIntermediate": True},
                      # One chunk in flight, one waiting: each write (frame) holds one chunk.
                      batching={"inFlightRows": 2, "commitQueueChunks": 1})
    run_shards(job)
    plan = shard_plan(job)
    log = writer_log(plan, 0)
    full = log.read_bytes()
    frames = log_frames(log)
    assert len(frames) == 6
    for keep in range(len(frames)):
        for partial in (True, False):
            for other in log.parent.glob("log-*"):  # the last rerun's log
                if other != log:
                    other.unlink()
            log.write_bytes(full)
            tear_log(log, keep, partial)
            Path(layout.done_uri(plan.round_prefix, 0)[len("file://"):]).unlink(missing_ok=True)
            engine = recording_echo()
            run_shards(job, engine=engine)
            assert places_once(log_lines, file_place, job) == len(inputs), (keep, partial)
            # Only rows whose records were cut run again.
            assert len(engine.seen) <= len(inputs) - sum(len(frame_records(f)) for f in frames[:keep])
            publish_manifest(job)
            check_complete(read_output(job), inputs)


def start_worker(bij_bin: Any, env: dict[str, str], manifest: str, index: int, *args: str,
                 stderr: Any = subprocess.PIPE) -> subprocess.Popen[str]:
    return subprocess.Popen([bij_bin("bij-worker"), "--manifest", manifest, "--progress", *args],
                            env={**env, "JOB_COMPLETION_INDEX": str(index)}, stdout=subprocess.PIPE,
                            stderr=stderr, text=True)


def kill_9_after(p: subprocess.Popen[str], chunks: int, extra_s: float) -> bool:
    """SIGKILL a worker `extra_s` after its `chunks`-th commit (0: after it resumed, before any commit).
    False when it ended by itself first."""
    assert p.stdout is not None
    seen = -1
    # A worker that never gets to work (it waits on a live lease) is killed after a while, not waited on forever.
    watchdog = threading.Timer(90, p.kill)
    watchdog.start()
    try:
        while seen < chunks:
            line = p.stdout.readline()
            if not line:
                return False
            event = json.loads(line)["event"]
            seen += event in ("resume", "chunk")
    finally:
        watchdog.cancel()
    time.sleep(extra_s)
    if p.poll() is not None:
        return False
    p.send_signal(signal.SIGKILL)
    return True


# On s3 every worker start costs about a CPU second (boto3), which makes that sweep slow.
@pytest.mark.parametrize("place", ["file", pytest.param("s3", marks=pytest.mark.slow)], indirect=True)
def test_kill_9_at_many_points_then_rerun_publishes_every_row_once(place, make_job, read_output, log_lines,
                                                                   worker_env, bij_bin, tmp_path):
    rnd = random.Random(1234 if place.scheme == "file" else 4321)
    inputs = rows_with_mixed_lengths(450, bad_every=37)
    place.write_jsonl("in/a.jsonl", inputs[:200])
    place.write_jsonl("in/b.jsonl", inputs[200:])
    chunk_rows, window, queued = 8, 16, 2
    # A lane per shard; a killed lane's claim expires after 3 s for any other lane to take over.
    _, job = make_job(place, place.uri("in/"), sharding={"chunkRows": chunk_rows, "targetShardBytes": 18_000},
                      batching={"maxBatchSize": 4, "inFlightRows": window, "commitQueueChunks": queued},
                      workers={"parallelism": 3, "leaseSeconds": 3})
    plan = shard_plan(job)
    manifest = layout.round_manifest_uri(job, 0)
    shards = range(len(plan.shards))
    assert len(shards) == 3 and plan.lanes == 3
    logs = {i: tmp_path / f"computed-{i}.txt" for i in shards}
    kills = Counter[int]()

    # Each round starts the lane of every unfinished shard (like an Indexed Job's pods) and
    # kills each one a random moment after a random number of commits: before the first, in
    # the middle of a chunk, right after a commit. Rounds go on until 12 kills have landed: on a
    # loaded machine the thread that reads a worker's progress can fall behind the worker, and a
    # worker that finished first was not killed. A batch (4 rows) takes 50 ms: a shard takes seconds.
    for _ in range(30):
        todo = [i for i in shards if not place.storage.exists(layout.done_uri(plan.round_prefix, i))]
        if not todo or sum(kills.values()) >= 12:
            break
        with ThreadPoolExecutor(len(todo)) as pool:
            procs = {i: start_worker(bij_bin, worker_env(place, echo_log=logs[i], echo_delay=0.05), manifest, i,
                                     stderr=subprocess.DEVNULL) for i in todo}
            killed = {i: pool.submit(kill_9_after, p, rnd.randint(0, 4), rnd.uniform(0, 0.012))
                      for i, p in procs.items()}
            for i, p in procs.items():
                kills[i] += killed[i].result(timeout=60)
                p.wait(timeout=60)
                p.stdout.close()  # type: ignore[union-attr]
    assert sum(kills.values()) >= 12, "the kills must land while shards are being worked"

    finals = {i: start_worker(bij_bin, worker_env(place, echo_log=logs[i]), manifest, i) for i in shards}
    for p in finals.values():
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err

    assert places_once(log_lines, place, job) == len(inputs)
    # The engine computed each good row at least once, and again per kill at most what was not durable:
    # the in-flight window and the chunks in the commit queue (a lane may have worked any shard).
    records = log_lines(place, job)
    good = sum(1 for i in shards for r in records[i] if r["kind"] == "result")
    computed = sum(len(logs[i].read_text().splitlines()) for i in shards if logs[i].exists())
    total_kills = sum(kills.values())
    assert good <= computed <= good + total_kills * (window + queued * chunk_rows), (good, computed, total_kills)
    publish_manifest(job)
    check_complete(read_output(job), inputs)


def test_a_scan_never_cuts_lines_another_writer_appends_meanwhile(file_place):
    # Two processes on one index (a replacement pod racing a slow termination, `bij run` started twice):
    # B starts reading while A commits more chunks. What A made durable must stay, whatever B does.
    prefix = file_place.uri("shards/00000")
    a = ShardLog(file_place.storage, prefix, writer_id="a")
    rec = lambda i: {"at": [0, i * 10, i * 10 + 10], "kind": "result", "row": {"id": i}}  # noqa: E731
    a.append([rec(i) for i in range(100)])
    b = ShardLog(file_place.storage, prefix, writer_id="b")
    scan = b.scan()
    first = next(scan)  # B has listed the logs and is reading them
    a.append([rec(i) for i in range(100, 200)])
    assert [first, *scan] == [rec(i) for i in range(100)]  # B sees what was there when it looked
    b.append([rec(i) for i in range(100, 110)])  # B recomputes from its cursor; the same rows, twice
    # A dies after its completion record: every row it committed is still durable.
    got = ShardLog(file_place.storage, prefix, writer_id="reader").read().records
    assert sorted(r["at"][1] for r in got) == [i * 10 for i in range(200)]


def test_a_torn_tail_of_another_writer_is_skipped_and_left_alone(file_place):
    prefix = file_place.uri("shards/00000")
    a = ShardLog(file_place.storage, prefix, writer_id="a")
    a.append([{"at": [0, 0, 10], "kind": "result", "row": {"id": 0}}])
    log = Path(a.log_uri[len("file://"):])
    frame = zstandard.ZstdCompressor(write_checksum=True).compress(b'{"at":[0,10,20],"kind":"result","row":{}}\n')
    with log.open("ab") as f:
        f.write(frame[:-3])  # still being written, or torn by a kill
    b = ShardLog(file_place.storage, prefix, writer_id="b")
    assert [r["row"]["id"] for r in b.read().records] == [0]
    assert b.state.cursor == (0, 10) and b.state.torn_bytes == len(frame) - 3
    assert log.read_bytes().endswith(frame[:-3])  # nothing cut: it may not be B's to cut


def rec(i: int) -> dict[str, Any]:
    return {"at": [0, i * 10, i * 10 + 10], "kind": "result", "row": {"id": i, "output": f"row {i} " * (i % 7)}}


def three_frames(place: Any) -> tuple[ShardLog, list[bytes]]:
    """A log of three writes (rows 0-4, 5-8, 9-11) and its frames."""
    log = ShardLog(place.storage, place.uri("shards/00000"), writer_id="a")
    for rows in (range(5), range(5, 9), range(9, 12)):
        log.append([rec(i) for i in rows])
    return log, log_frames(Path(log.log_uri[len("file://"):]))


def test_every_cut_of_a_log_keeps_exactly_the_frames_before_it(file_place):
    log, frames = three_frames(file_place)
    path = Path(log.log_uri[len("file://"):])
    data = path.read_bytes()
    assert data == b"".join(frames) and len(frames) == 3
    ends = [sum(map(len, frames[:k])) for k in range(4)]
    rows_before = [0, 5, 9, 12]
    for cut in range(len(data) + 1):
        path.write_bytes(data[:cut])
        reader = ShardLog(file_place.storage, log.prefix, writer_id="b")
        got = reader.read().records
        whole = max(k for k in range(4) if ends[k] <= cut)
        assert got == [rec(i) for i in range(rows_before[whole])], cut
        assert reader.state.torn_bytes == cut - ends[whole], cut
        assert reader.state.cursor == ((0, rows_before[whole] * 10) if whole else (-1, -1))


def test_what_a_crash_left_of_the_last_frame_is_a_torn_tail(file_place):
    log, frames = three_frames(file_place)
    path = Path(log.log_uri[len("file://"):])
    last = frames[2]
    flipped = bytearray(last)
    flipped[len(last) // 2] ^= 0x40
    # The last write's pages never reached the disk (zeros where its bytes, or some of them, were, with
    # its headers intact or not) or came back damaged: no good frame follows, so it is the torn tail.
    for tail, rows, torn in ((bytes(len(last)), 9, len(last)), (last[:7] + bytes(len(last) - 7), 9, len(last)),
                             (last[:-8] + bytes(8), 9, len(last)), (bytes(flipped), 9, len(last)),
                             (last + bytes(4096), 12, 4096)):
        path.write_bytes(frames[0] + frames[1] + tail)
        reader = ShardLog(file_place.storage, log.prefix)
        assert reader.read().records == [rec(i) for i in range(rows)]
        assert reader.state.torn_bytes == torn
        assert path.read_bytes().endswith(tail)  # skipped, never cut


def test_a_damaged_frame_before_the_tail_is_an_error_naming_the_log_and_byte(file_place, make_job, run_shards):
    log, frames = three_frames(file_place)
    path = Path(log.log_uri[len("file://"):])
    second = bytearray(frames[1])
    second[len(second) // 2] ^= 0x40  # bit rot inside the second write: its checksum no longer holds
    for data, offset in ((frames[0] + bytes(second) + frames[2], len(frames[0])),
                         (frames[0] + b"garbage!" + frames[1] + frames[2], len(frames[0])),
                         (frames[0][:-1] + frames[1] + frames[2], 0)):
        path.write_bytes(data)
        with pytest.raises(DamagedLog, match=rf"{path.name} is damaged at byte {offset}: .*remove the shard's logs"):
            ShardLog(file_place.storage, log.prefix).read()
        assert path.read_bytes() == data

    # A worker resuming over it stops with that error, and no retry can help.
    inputs = rows_with_mixed_lengths(30)
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", inputs),
                      sharding={"chunkRows": 10, "targetShardBytes": 1 << 20},
                      batching={"inFlightRows": 10, "commitQueueChunks": 1})
    run_shards(job)
    plan = shard_plan(job)
    shard_log = writer_log(plan, 0)
    frames = log_frames(shard_log)
    assert len(frames) == 3
    shard_log.write_bytes(frames[0][:-1] + b"".join(frames[1:]))
    os.unlink(layout.done_uri(plan.round_prefix, 0)[len("file://"):])
    with pytest.raises(DamagedLog) as err:
        run_shards(job)
    assert err.value.permanent and err.value.uri.endswith(shard_log.name) and err.value.offset == 0


def test_a_damaged_or_short_segment_is_an_error_never_a_torn_tail(s3_place):
    log = ShardLog(s3_place.storage, s3_place.uri("shards/00000"), writer_id="pod")
    log.append([rec(i) for i in range(5)])
    log.append([rec(i) for i in range(5, 9)])
    segs = s3_place.storage.list(log.prefix + "/")
    assert [o.uri.rsplit("/", 1)[-1] for o in segs] == ["seg-00000000-pod.jsonl.zst", "seg-00000001-pod.jsonl.zst"]
    assert ShardLog(s3_place.storage, log.prefix).read().records == [rec(i) for i in range(9)]
    whole = s3_place.storage.read_bytes(segs[1].uri)
    for data in (whole[:-2], bytes(len(whole)), whole[:-1] + bytes([whole[-1] ^ 1])):
        s3_place.storage.write_bytes(segs[1].uri, data)
        with pytest.raises(DamagedLog, match=r"seg-00000001-pod.jsonl.zst is damaged at byte 0"):
            ShardLog(s3_place.storage, log.prefix).read()


@pytest.mark.parametrize("place", ["file", "s3"], indirect=True)
def test_a_shard_logged_before_compression_resumes_and_publishes(place, make_job, run_shards, recording_echo,
                                                                 read_output, log_lines):
    from bij.storage.segments import encode_records

    inputs = rows_with_mixed_lengths(60, bad_every=11)
    _, job = make_job(place, place.write_jsonl("in.jsonl", inputs),
                      sharding={"chunkRows": 10, "targetShardBytes": 1 << 20})
    run_shards(job)
    plan = shard_plan(job)
    assert len(plan.shards) == 1
    prefix = layout.shard_prefix(plan.round_prefix, 0)
    records = ShardLog(place.storage, prefix).read().records
    for obj in place.storage.list(prefix + "/"):
        place.storage.delete(obj.uri)
    place.storage.delete(layout.done_uri(plan.round_prefix, 0))
    # What an older worker left: plain JSON lines, a log (file://) or segments (s3://), the file's last
    # line torn by a kill.
    if place.scheme == "file":
        place.storage.append_durable(f"{prefix}/log-old.jsonl", encode_records(records[:25]) + b'{"at":[0,')
    else:
        place.storage.write_bytes(f"{prefix}/seg-00000000-old.jsonl", encode_records(records[:20]))
        place.storage.write_bytes(f"{prefix}/seg-00000001-old.jsonl", encode_records(records[20:25]))

    engine = recording_echo()
    assert run_shards(job, engine=engine)[0].status == "done"
    assert sorted(engine.seen) == sorted(r["text"] for r in inputs[25:] if isinstance(r, dict))
    names = sorted(o.uri.rsplit("/", 1)[-1] for o in place.storage.list(prefix + "/"))
    assert any(n.endswith(".jsonl") for n in names) and any(n.endswith(".jsonl.zst") for n in names)
    assert places_once(log_lines, place, job) == len(inputs)
    publish_manifest(job)
    check_complete(read_output(job), inputs)


# A second writer needs a log big enough for its scan to overlap the first writer's commits: s3 segments are
# immutable (never cut), so the sweep matters on file:// and only runs there.
def test_second_writers_killed_at_many_points_while_the_first_works_lose_no_row(
        file_place, make_job, read_output, worker_env, bij_bin, tmp_path):
    rnd = random.Random(2024)
    inputs = rows_with_mixed_lengths(20000, bad_every=53)
    # B takes A's claim (a new process of the same lane); A gives the shard up at its next renewal and
    # takes it back once B's claim expires: 3 s leases keep that short.
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", inputs),
                      sharding={"chunkRows": 8, "targetShardBytes": 1 << 24, "shardsPerLane": 1},
                      batching={"maxBatchSize": 4}, workers={"parallelism": 1, "leaseSeconds": 3})
    plan = shard_plan(job)
    assert len(plan.shards) == 1
    manifest = layout.round_manifest_uri(job, 0)
    hold = tmp_path / "hold"
    hold.touch()
    # Writer A commits a chunk every 10 ms or so while `hold` exists (and has rows for 25 s of that): its log
    # grows as fast as a second writer can read it, and it is working whenever one starts.
    a = start_worker(bij_bin, worker_env(file_place, echo_delay=0.005, echo_hold=hold), manifest, 0,
                     stderr=subprocess.DEVNULL)
    # A's events are read as they come (a full pipe would stop it), and second writers start once it holds
    # the shard and works: one that started first would find A's claim live and wait for it instead.
    working = threading.Event()

    def drain() -> None:
        assert a.stdout is not None
        for line in a.stdout:
            if json.loads(line)["event"] == "chunk":
                working.set()
        working.set()  # ended: the loop below sees it

    threading.Thread(target=drain, daemon=True).start()
    assert working.wait(120), "writer A never committed a chunk"
    kills = 0
    while kills < 8 and a.poll() is None:
        # B resumes (reads every log while A appends) and dies right after, or a chunk later.
        b = start_worker(bij_bin, worker_env(file_place, echo_delay=0.005, echo_hold=hold), manifest, 0,
                         stderr=subprocess.DEVNULL)
        kills += kill_9_after(b, rnd.randint(0, 1), rnd.uniform(0, 0.01))
        b.wait(timeout=60)
        b.stdout.close()  # type: ignore[union-attr]
    hold.unlink()
    a.wait(timeout=120)
    assert a.returncode == 0
    assert kills >= 3, "second writers must come and go while writer A works"
    publish_manifest(job)
    check_complete(read_output(job), inputs)


def read_events(p: subprocess.Popen[str], until: Any, timeout: float = 30) -> list[dict[str, Any]]:
    """Progress events from a worker's stdout until `until(events)` holds."""
    assert p.stdout is not None
    events: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while not until(events):
        assert time.monotonic() < deadline, "worker made no progress"
        line = p.stdout.readline()
        assert line, "worker ended early"
        events.append(json.loads(line))
    return events


@pytest.mark.parametrize("drain", [3.0, 0.05], ids=["drain-commits-in-flight-chunk", "drain-drops-it"])
def test_sigterm_mid_chunk_exits_143_within_the_drain_time_and_loses_nothing(
        drain, file_place, make_job, read_output, log_lines, worker_env, bij_bin):
    inputs = rows_with_mixed_lengths(80)
    chunk_rows = 10
    # A window of one chunk: the signal lands inside the second one.
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", inputs),
                      sharding={"chunkRows": chunk_rows, "targetShardBytes": 1 << 20},
                      batching={"maxBatchSize": 2, "inFlightRows": chunk_rows})
    shard_plan(job)
    manifest = layout.round_manifest_uri(job, 0)
    # 0.1 s per batch of 2: a chunk takes half a second, so the signal lands inside one.
    p = start_worker(bij_bin, worker_env(echo_delay=0.1), manifest, 0, "--drain-seconds", str(drain))
    events = read_events(p, lambda ev: sum(e["event"] == "chunk" for e in ev) == 1)
    time.sleep(0.25)
    t = time.monotonic()
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=30)
    elapsed = time.monotonic() - t
    assert p.returncode == EXIT_TERMINATED, err
    # The durable counts below pin what the drain did; the clock only catches a worker that hangs, with
    # room for a loaded machine (the short drain must not wait for its chunk, which takes longer than this).
    assert elapsed < drain + 10
    events += [json.loads(line) for line in out.splitlines()]
    committed = sum(e["rows"] + e["errors"] for e in events if e["event"] == "chunk")
    durable = places_once(log_lines, file_place, job)
    assert durable == committed
    # Long drain: the in-flight chunk is finished and committed. Short: it is dropped whole.
    assert durable == (2 * chunk_rows if drain > 1 else chunk_rows)

    p = start_worker(bij_bin, worker_env(), manifest, 0)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert places_once(log_lines, file_place, job) == len(inputs)
    publish_manifest(job)
    check_complete(read_output(job), inputs)


def test_failed_segment_upload_fails_the_worker_and_a_rerun_completes(s3_place, make_job, read_output, log_lines,
                                                                     worker_env, bij_bin):
    inputs = rows_with_mixed_lengths(60)
    _, job = make_job(s3_place, s3_place.write_jsonl("in.jsonl", inputs),
                      sharding={"chunkRows": 10, "targetShardBytes": 1 << 20},
                      # One chunk in flight, one waiting: each segment holds one chunk.
                      batching={"inFlightRows": 10, "commitQueueChunks": 1})
    shard_plan(job)
    manifest = layout.round_manifest_uri(job, 0)
    p = start_worker(bij_bin, worker_env(s3_place, fail_segment=3), manifest, 0)
    _, err = p.communicate(timeout=60)
    assert p.returncode == EXIT_FAILED, err  # worth a retry: not 0, not 42 (bad config), not 143
    assert "simulated failed upload" in err
    assert places_once(log_lines, s3_place, job) == 20  # the two segments before the failure

    p = start_worker(bij_bin, worker_env(s3_place), manifest, 0)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert places_once(log_lines, s3_place, job) == len(inputs)
    publish_manifest(job)
    check_complete(read_output(job), inputs)


def test_a_stopped_worker_leaves_no_done_record_and_a_finished_shard_is_not_rerun(
        file_place, make_job, run_shards, recording_echo):
    inputs = rows_with_mixed_lengths(30)
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", inputs), sharding={"chunkRows": 10})
    stop = StopFlag()
    stop.request()
    assert run_shards(job, stop=stop)[0].status == "stopped"
    plan = shard_plan(job)
    assert not file_place.storage.exists(layout.done_uri(plan.round_prefix, 0))
    run_shards(job)
    engine = recording_echo()
    outcome = ShardWorker(plan, 0, engine).run()
    assert (outcome.status, outcome.rows, engine.seen) == ("done", 30, [])


def test_results_encoded_a_chunk_at_once_are_the_records_resume_and_publish_read():
    """The one-pass encoding of the common result shape writes, byte for byte, what the records would."""
    from bij.engines.base import Result
    from bij.storage.segments import encode_plain_results, loads_record
    from bij.worker.input_row import InputOptions, Row
    from bij.worker.result_rows import result_row

    rnd = random.Random(3)
    ids: list[Any] = ["a", 1, 0, -7, "é ✓", 9223372036854775807, 18446744073709551615, "1", "x\"y\\z\n"]
    outputs: list[Any] = ["", "plain", "ünïcødé 🙂", 'quote " back \\ slash', "\x00\x1f ctl", None, "a\u2028b"]
    for _ in range(200):
        n = rnd.randint(1, 20)
        places = sorted({(rnd.randint(0, 2), rnd.randint(0, 10**9), 0) for _ in range(n)})
        places = [(o, off, off + rnd.randint(1, 500)) for o, off, _ in places]
        row_ids = [rnd.choice(ids) for _ in places]
        results = [Result(output=rnd.choice(outputs), prompt_tokens=rnd.randint(0, 10**6),
                          completion_tokens=rnd.randint(0, 4096)) for _ in places]
        records = [{"at": list(at), "kind": "result", "row": result_row(Row(at=at, id=rid), res, InputOptions())}
                   for at, rid, res in zip(places, row_ids, results, strict=True)]
        data = encode_plain_results(places, row_ids, results)
        assert data == ShardLog.encode(records)
        assert [loads_record(line) for line in data.splitlines()] == records  # type: ignore[union-attr]
    # Any other shape is the records' to encode.
    one = [(0, 0, 5)]
    assert encode_plain_results(one, [1], [Result(embedding=[0.5], prompt_tokens=3)]) is None
    assert encode_plain_results(one, [1], [Result(output="x", prompt_tokens=3)]) is None
    assert encode_plain_results(one, [1], [Result(output="x", prompt_tokens=True, completion_tokens=1)]) is None
    assert encode_plain_results(one, [2**70], [Result(output="x", prompt_tokens=1, completion_tokens=1)]) is None
    assert encode_plain_results(one, [1], [Result(output="\ud800", prompt_tokens=1, completion_tokens=1)]) is None
    assert encode_plain_results([], [], []) == b""
