"""Lanes: a round's model loads and wall time with lanes vs one process per shard (issue 12).

A round's Job has one index per lane; a lane process loads the model once and works
many shards, taking over unstarted shards of other lanes and shards whose lease
expired. This runs `bij run`'s LocalRunner (in this process, lanes as subprocesses)
with the simulated engine (model.simulated: maxNumSeqs, stepSeconds, loadSeconds
slept once per process) over --shards shards (targetShardBytes = input / shards) in
--lanes lanes, and measures, in one run:

1. lanes vs legacy: model loads (target = lanes) and the round's wall time ÷ the ideal,
   loadSeconds + total engine work / lanes, the work being every step full
   (generated words / maxNumSeqs x stepSeconds); target <= 1.25. The anchor ("legacy")
   is the same plan rewritten without its "lanes" key, the contract before lanes:
   every index works exactly one shard, one process (one model load) per shard, at
   most --lanes at once. Reported: its loads and wall time.
2. one lane slowed to a third of the speed (a worker wrapper multiplies lane 0's
   stepSeconds by 3): the round's wall time ÷ that of four equal lanes, target <= 1.3.
   For contrast (reported): the same slowdown with one shard per lane
   (sharding.shardsPerLane 1), where nothing is left for the others to take over.
3. lane 0 killed with SIGKILL mid-shard (by the wrapper itself, after it finished
   --kill-after-shards shards and committed 2 chunks of the next) and never restarted
   (backoffLimitPerIndex 0), workers.leaseSeconds --lease-seconds: the other lanes
   finish every shard; checked: every input row exactly once in the published output.
   Reported: wall time ÷ that of the equal lanes, and which shards were taken over.

The wall time is the round's: `bij run`'s LocalRunner.run_round, from starting the first
lane process to the exit of the last, as the Job's pods would run. Only the killed run is
published (publishing runs a process per shard and pass, and is no part of the comparison;
its time is in the JSON summary); for the others every shard has one completion record and
their rows add up to the input's.

    python bench/lanes.py [--rows 60000] [--shards 64] [--lanes 4] [--load-seconds 3]
                          [--max-num-seqs 32] [--step-seconds 0.005] [--max-words 12]
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CHILD_FLAG = "--worker-child"

TARGET_WALL = 1.25  # lanes wall / (load + work / lanes)
TARGET_SLOW = 1.3  # one lane at a third of the speed / four equal lanes
SLOW_FACTOR = 3.0


# ---------------------------------------------------------------- the worker wrapper (a lane process)


class _KillAfter:
    """sys.stdout for the lane to kill: passes progress events on and SIGKILLs its own process right
    after the event that completes the condition (`shards` shards done, then `chunks` chunks committed)."""

    def __init__(self, stream: Any, shards: int, chunks: int):
        self.stream, self.shards, self.chunks = stream, shards, chunks
        self.done = self.seen = 0

    def write(self, text: str) -> int:
        n = self.stream.write(text)
        for line in text.splitlines():
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if ev.get("event") == "done":
                self.done += 1
            elif ev.get("event") == "chunk" and self.done >= self.shards:
                self.seen += 1
                if self.seen >= self.chunks:
                    self.stream.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
        return n

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def worker_child(argv: list[str]) -> int:
    """`bij-worker` as a lane process, after the changes the environment asks of this lane:

    BIJ_BENCH_SLOW_LANE=i: lane i's simulated steps take BIJ_BENCH_SLOW_FACTOR x stepSeconds;
    BIJ_BENCH_KILL_LANE=i, BIJ_BENCH_KILL_AFTER=shards:chunks: lane i kills itself (SIGKILL).
    """
    from bij.engines import simulated
    from bij.worker import main as worker_main

    lane = os.environ.get("JOB_COMPLETION_INDEX", "")
    if lane and lane == os.environ.get("BIJ_BENCH_SLOW_LANE"):
        factor = float(os.environ.get("BIJ_BENCH_SLOW_FACTOR", SLOW_FACTOR))
        init = simulated.SimulatedEngine.__init__

        def slow_init(self: Any, config: Any) -> None:
            init(self, config)
            self.step_seconds *= factor

        simulated.SimulatedEngine.__init__ = slow_init  # type: ignore[method-assign]
    if lane and lane == os.environ.get("BIJ_BENCH_KILL_LANE"):
        shards, chunks = (int(x) for x in os.environ.get("BIJ_BENCH_KILL_AFTER", "0:2").split(":"))
        sys.stdout = _KillAfter(sys.stdout, shards, chunks)  # type: ignore[assignment]
    return worker_main.main(argv)


if __name__ == "__main__" and sys.argv[1:2] == [CHILD_FLAG]:
    sys.exit(worker_child(sys.argv[2:]))


# ---------------------------------------------------------------- the benchmark

import harness  # noqa: E402  (a lane process needs none of it)


def word_rows(n: int, max_words: int, seed: int = 12) -> list[str]:
    """Texts of 1..max_words words (uniform): one generated token per word in the simulated engine."""
    rnd = random.Random(seed)
    vocab = [f"w{i}" for i in range(500)]
    return [" ".join(rnd.choice(vocab) for _ in range(rnd.randint(1, max_words))) for _ in range(n)]


@contextlib.contextmanager
def environ(**values: str) -> Iterator[None]:
    """Extra environment variables for the lane processes started meanwhile."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__, rows=60000, repeats=1)
    p.add_argument("--shards", type=int, default=64, help="shards in the round (targetShardBytes = input / shards)")
    p.add_argument("--lanes", type=int, default=4, help="workers.parallelism: lanes, and legacy processes at once")
    p.add_argument("--load-seconds", type=float, default=3.0, help="model.simulated.loadSeconds (slept per process)")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--step-seconds", type=float, default=0.005)
    p.add_argument("--max-words", type=int, default=12, help="longest row, in words (= generated tokens)")
    p.add_argument("--chunk-rows", type=int, default=64, help="spec.sharding.chunkRows")
    p.add_argument("--lease-seconds", type=int, default=5, help="workers.leaseSeconds of the kill run")
    p.add_argument("--kill-after-shards", type=int, default=None,
                   help="lane 0 is killed after this many shards done and 2 chunks of the next "
                        "(default: a quarter of its own shards)")
    p.add_argument("--skip", default="", help="comma-separated runs to leave out: legacy,slowed,one_per_lane,killed")
    args = harness.parse(p, argv)
    skip = set(filter(None, args.skip.split(",")))
    if args.kill_after_shards is None:
        args.kill_after_shards = args.shards // args.lanes // 4

    import yaml

    from bij.contract.efficiency import efficiency
    from bij.contract.spec import load_job
    from bij.local.publish import publish_manifest
    from bij.local.run import LocalRunner
    from bij.steps.planner import plan_round
    from bij.storage import open_storage

    report = harness.Report("lanes")
    work = harness.work_dir("lanes", args.keep)
    try:
        texts = word_rows(args.rows, args.max_words)
        words = sum(len(t.split()) for t in texts)
        engine_work = words / args.max_num_seqs * args.step_seconds
        ideal = args.load_seconds + engine_work / args.lanes
        input_path = work / "input" / "rows.jsonl"
        size = harness.write_rows(input_path, texts)
        model = {"engine": "simulated", "task": "generate", "maxTokens": args.max_words,
                 "simulated": {"maxNumSeqs": args.max_num_seqs, "stepSeconds": args.step_seconds,
                               "loadSeconds": args.load_seconds}}
        print(f"lanes: {args.rows} rows ({size:,} bytes), {words} words to generate, maxNumSeqs {args.max_num_seqs}, "
              f"step {args.step_seconds * 1000:g} ms, load {args.load_seconds:g}s: engine work {engine_work:.1f}s "
              f"at full occupancy; {args.shards} shards in {args.lanes} lanes: ideal "
              f"{args.load_seconds:g} + {engine_work:.1f}/{args.lanes} = {ideal:.2f}s", flush=True)
        # Lane processes run this file's wrapper with the interpreter (and PYTHONPATH) of this process.
        worker_cmd = [sys.executable, str(HERE / "lanes.py"), CHILD_FLAG]

        def run(name: str, legacy: bool = False, shards_per_lane: int | None = None, lease: int | None = None,
                env: dict[str, str] | None = None, publish: bool = False) -> dict[str, Any]:
            """Plan round 0 and run its lanes as `bij run` does; publish too when asked."""
            out = work / f"out-{name}"
            spec_path = harness.write_spec(work / f"spec-{name}.yaml", f"bench-lanes-{name.replace('_', '-')}",
                                           input_path, out, model, args.chunk_rows,
                                           shard_bytes=-(-size // args.shards))
            doc = yaml.safe_load(spec_path.read_text())
            doc["spec"]["workers"].update(parallelism=args.lanes, backoffLimitPerIndex=0,
                                          **({"leaseSeconds": lease} if lease else {}))
            if shards_per_lane is not None:  # whole lanes: one shard each, as big as they come
                doc["spec"]["sharding"].update(shardsPerLane=shards_per_lane, targetShardBytes=1 << 40,
                                               minShardBytes=1024)
            spec_path.write_text(yaml.safe_dump(doc, sort_keys=False))
            job = load_job(spec_path)
            planned = plan_round(job, 0)
            if legacy:  # the contract before lanes: one index (one process, one model load) per shard
                store = open_storage(planned.manifest_uri, None)
                plan_doc = json.loads(store.read_bytes(planned.manifest_uri))
                del plan_doc["lanes"]
                store.write_bytes(planned.manifest_uri, json.dumps(plan_doc).encode())
                planned = plan_round(job, 0)  # read back, as bij run would: one lane per shard
            runner = LocalRunner(job, show_progress=False, worker_cmd=worker_cmd)
            said = io.StringIO()  # bij run's own lines (lane failures, published counts)
            with environ(BIJ_LOG_LEVEL="WARNING", **(env or {})), contextlib.redirect_stdout(said), \
                    contextlib.redirect_stderr(said):
                t0 = time.perf_counter()
                ok, msg = runner.run_round(0, planned)
                wall = time.perf_counter() - t0
                round_end = time.time()
                publish_s = None
                if ok and publish:
                    t0 = time.perf_counter()
                    manifest = publish_manifest(job, rounds=1, processes=args.lanes)
                    publish_s = time.perf_counter() - t0
            if not ok:
                raise RuntimeError(f"{name}: the round failed: {msg}\n{said.getvalue()[-3000:]}")
            records = harness.done_records(out)
            eff = efficiency(records)
            # Every shard done once, and its rows add up; published, every row id exactly once.
            exactly_once = sorted(r["index"] for r in records) == list(range(planned.shard_count)) \
                and sum(int(r["rows"]) + int(r["errors"]) for r in records) == args.rows
            if publish:
                ids = [json.loads(line)["id"] for f in manifest.files or []
                       for line in (out / f.path).read_text().splitlines()]
                exactly_once = exactly_once and len(ids) == len(set(ids)) == args.rows \
                    and set(ids) == {f"doc-{i:07d}" for i in range(args.rows)}
            taken = [] if legacy else sorted(r["index"] for r in records if r["lane"] != r["index"] % planned.lanes)
            last_done = max(p.stat().st_mtime for p in out.glob("_bij/*/round-0/done/*.json"))
            r = {"wall_s": wall, "shards": planned.shard_count, "processes": planned.lanes,
                 "model_loads": int(eff["modelLoads"]), "model_load_s": float(eff["modelLoadSeconds"]),
                 "worker_s": float(eff["workerSeconds"]), "exactly_once": exactly_once, "published": publish,
                 "publish_s": publish_s, "taken_over": taken,
                 "shards_by_lane": _count(r.get("lane") for r in records),
                 "exit_after_last_done_s": round_end - last_done,
                 "bij_said": [line for line in said.getvalue().splitlines() if "failed" in line]}
            print(f"  {name:19} round {wall:6.2f}s = {wall / ideal:5.3f} x ideal: {r['shards']} shards, "
                  f"{r['processes']} lanes, {r['model_loads']} model loads ({r['model_load_s']:.1f}s), "
                  f"every row once{' (published)' if publish else ''}: {exactly_once}"
                  + (f"; taken over: {taken}" if taken else ""), flush=True)
            return r

        slow = {"BIJ_BENCH_SLOW_LANE": "0", "BIJ_BENCH_SLOW_FACTOR": str(SLOW_FACTOR)}
        kinds: dict[str, Any] = {"lanes": lambda i: run("lanes")}
        if "legacy" not in skip:
            kinds["legacy"] = lambda i: run("legacy", legacy=True)
        if "slowed" not in skip:
            kinds["slowed"] = lambda i: run("slowed", env=slow)
        if "one_per_lane" not in skip:
            kinds["one_per_lane_slowed"] = lambda i: run("one_per_lane_slowed", shards_per_lane=1, env=slow)
        if "killed" not in skip:
            kinds["killed"] = lambda i: run("killed", lease=args.lease_seconds, publish=True, env={
                "BIJ_BENCH_KILL_LANE": "0", "BIJ_BENCH_KILL_AFTER": f"{args.kill_after_shards}:2"})

        runs = harness.interleave(args.repeats, **kinds)
        report.details.update(rows=args.rows, bytes=size, words=words, engine_work_s=engine_work, ideal_s=ideal,
                              shards=args.shards, lanes=args.lanes, load_seconds=args.load_seconds,
                              max_num_seqs=args.max_num_seqs, step_seconds=args.step_seconds,
                              max_words=args.max_words, chunk_rows=args.chunk_rows,
                              lease_seconds=args.lease_seconds, runs=runs)

        def med(name: str, key: str = "wall_s") -> float:
            return harness.median(r[key] for r in runs[name])

        bad = [f"{k} run {i}" for k, rs in runs.items() for i, r in enumerate(rs) if not r["exactly_once"]]
        if bad:
            report.note(f"NOT every shard and row exactly once in: {', '.join(bad)}")
        lanes_loads = max(r["model_loads"] for r in runs["lanes"])
        report.ratio("model loads with lanes / lanes", lanes_loads / args.lanes, 1.0, higher_is_better=False,
                     note=f"{lanes_loads} loads for {args.lanes} lanes")
        report.ratio("lanes round wall / ideal", med("lanes") / ideal, TARGET_WALL, higher_is_better=False,
                     note=f"{med('lanes'):.1f}s vs load + work / {args.lanes} = {ideal:.1f}s")
        if "legacy" in runs:
            report.ratio("legacy model loads / lanes model loads",
                         med("legacy", "model_loads") / max(1, lanes_loads), None,
                         note=f"{med('legacy', 'model_loads'):.0f} vs {lanes_loads}")
            report.ratio("legacy round wall / ideal", med("legacy") / ideal, None)
            report.ratio("lanes round wall / legacy round wall", med("lanes") / med("legacy"), None,
                         note=f"{med('lanes'):.1f}s vs {med('legacy'):.1f}s")
        if "slowed" in runs:
            report.ratio("one lane at 1/3 speed / equal lanes (wall)", med("slowed") / med("lanes"), TARGET_SLOW,
                         higher_is_better=False, note=f"{med('slowed'):.1f}s vs {med('lanes'):.1f}s")
        if "one_per_lane_slowed" in runs:
            report.ratio("same, one shard per lane / equal lanes (wall)",
                         med("one_per_lane_slowed") / med("lanes"), None,
                         note=f"{med('one_per_lane_slowed'):.1f}s: nothing left to take over")
        if "killed" in runs:
            report.ratio("lane 0 killed, never restarted / equal lanes (wall)", med("killed") / med("lanes"), None,
                         note=f"{med('killed'):.1f}s, lease {args.lease_seconds}s; taken over: "
                              f"{runs['killed'][0]['taken_over']}")
            if not all(any("lane 0 failed" in line for line in r["bij_said"]) for r in runs["killed"]):
                report.note("lane 0 finished before it was to be killed: lower --kill-after-shards")
            ok = all(r["exactly_once"] for r in runs["killed"])
            report.ratio("killed run: every row exactly once (1 = yes)", float(ok), 1.0)
    finally:
        harness.cleanup(work, args.keep)
    report.write(args.out)
    return 0


def _count(values: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[str(v)] = out.get(str(v), 0) + 1
    return dict(sorted(out.items()))


if __name__ == "__main__":
    sys.exit(main())
