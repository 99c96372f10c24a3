"""Rows computed twice after kill -9: SIGKILL a worker at a random moment, rerun it, count repeats.

The worker runs the echo engine slowed down (a sleep per row), so that kills land
mid-work, and every row the engine computes is appended to a side file. The
slowing and the counting live in this file only: a child process replaces
`create_engine` in `bij.engines` and `bij.worker.main`, then calls the real
`bij.worker.main.main` — no hooks in the worker's code.

Per trial: a fresh one-shard job; the worker is killed with SIGKILL at a uniformly
random time between its "resume" event and its expected end; a second worker
finishes the shard. Rows computed twice = side-file lines − distinct rows. The
durable log must end with every row exactly once. A kill that came after the worker
had finished does not count. Target: the most recomputed over all kills <= inFlightRows +
commitQueueChunks x chunkRows (the worker commits whole chunks in input order, so at most
the in-flight window and the chunks waiting for storage are lost).

    python bench/kill_recompute.py [--rows 10000] [--kills 10] [--chunk-rows 512] [--in-flight-rows 1024]
"""

from __future__ import annotations

import os
import random
import sys
import time
from typing import Any

import harness


def slow_worker(side_file: str, seconds_per_row: float, worker_argv: list[str]) -> int:
    """The child: the real worker main, with an echo engine that is slow and logs what it computes."""
    import bij.engines as engines
    import bij.worker.main as worker_main
    from bij.engines.base import EngineConfig, Request, Result, request_text
    from bij.engines.echo import EchoEngine

    fd = os.open(side_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    class CountingSlowEcho(EchoEngine):
        def run(self, requests: list[Request]) -> list[Result]:
            time.sleep(seconds_per_row * len(requests))
            out = super().run(requests)
            # Each text starts with its row id; one write per batch, so a kill loses none it reported.
            os.write(fd, "".join(request_text(r).split(" ", 1)[0] + "\n" for r in requests).encode())
            return out

    def create_engine(name: str, config: EngineConfig) -> Any:
        return CountingSlowEcho(config)

    engines.create_engine = create_engine  # type: ignore[assignment]
    worker_main.create_engine = create_engine  # type: ignore[assignment]
    return worker_main.main(worker_argv)


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--slow-worker":
        return slow_worker(sys.argv[2], float(sys.argv[3]), sys.argv[4:])
    p = harness.parser(__doc__, rows=10_000, repeats=1)
    p.add_argument("--kills", type=int, default=10, help="kill trials (default 10)")
    p.add_argument("--chunk-rows", type=int, default=512, help="spec.sharding.chunkRows")
    p.add_argument("--in-flight-rows", type=int, default=1024, help="spec.batching.inFlightRows")
    p.add_argument("--commit-queue", type=int, default=2, help="spec.batching.commitQueueChunks")
    p.add_argument("--seconds-per-row", type=float, default=0.0001, help="the slowed engine's cost per row")
    p.add_argument("--seed", type=int, default=None, help="random seed for kill times (default: random)")
    args = harness.parse(p, argv)
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)

    report = harness.Report("kill_recompute")
    work = harness.work_dir("kill", args.keep)
    try:
        input_path = work / "input" / "rows.jsonl"
        texts = harness.cycle(harness.corpus_texts(work), args.rows)
        # Every text starts with its own row id, so the side file names each computed row.
        harness.write_rows(input_path, [f"row{i:07d} {t}" for i, t in enumerate(texts)])
        model = {"engine": "echo", "task": "generate"}

        def trial(name: str, kill: bool) -> dict[str, Any]:
            out = work / f"out-{name}"
            side = work / f"computed-{name}.txt"
            spec = harness.write_spec(work / f"spec-{name}.yaml", "bench-kill", input_path, out, model,
                                      args.chunk_rows, batching={"inFlightRows": args.in_flight_rows,
                                                                 "commitQueueChunks": args.commit_queue})
            manifest, shards = harness.plan(spec)
            assert shards == 1, shards
            cmd = [sys.executable, __file__, "--slow-worker", str(side), str(args.seconds_per_row)]
            delay: list[float] = []

            def when() -> float | None:
                if not kill:
                    return None
                delay.append(rng.uniform(0.0, expected_s))
                return delay[0]

            first = harness.run_worker(manifest, command=cmd, kill_after=when)
            t_first = (first.at("done") or first.wall_s) - (first.at("resume") or 0.0)
            second = harness.run_worker(manifest, command=cmd) if first.rc != 0 else None
            if second is not None and second.rc != 0:
                raise RuntimeError(f"{name}: the rerun after the kill exited {second.rc}")
            computed = [x for x in side.read_text().splitlines() if x]
            records, places = harness.log_places(out)
            (rec,) = harness.done_records(out)
            r = {"killed": first.rc == -9, "kill_after_s": delay[0] if delay else None, "first_rc": first.rc,
                 "first_s": t_first, "computed": len(computed), "distinct": len(set(computed)),
                 "recomputed": len(computed) - len(set(computed)), "log_records": records, "log_rows": places,
                 "done_rows": rec["rows"]}
            if len(set(computed)) != args.rows or places != args.rows or records != args.rows \
                    or rec["rows"] != args.rows:
                raise RuntimeError(f"{name}: rows lost or repeated in the log: {r}")
            harness.cleanup(out, False)
            side.unlink()
            return r

        # Calibration: an uncut run says how long the work takes (kills are drawn within it).
        base = trial("calibration", kill=False)
        expected_s = base["first_s"]
        print(f"kill_recompute: {args.rows} rows, chunkRows {args.chunk_rows}, uncut run {expected_s:.1f}s "
              f"(recomputed {base['recomputed']}), seed {seed}", flush=True)
        results = []
        for k in range(args.kills):
            r = trial(f"kill-{k}", kill=True)
            results.append(r)
            what = f"killed at {r['kill_after_s']:.2f}s" if r["killed"] else "finished before the kill"
            print(f"  trial {k}: {what:26} recomputed {r['recomputed']:5} rows", flush=True)
        killed = [r for r in results if r["killed"]]
        worst = max((r["recomputed"] for r in killed), default=0)
        report.details.update(rows=args.rows, chunk_rows=args.chunk_rows, seed=seed, calibration=base,
                              trials=results, max_recomputed=worst)
        print(f"kills that landed: {len(killed)}/{len(results)}; recomputed rows per kill: "
              f"{[r['recomputed'] for r in killed]}; max {worst}", flush=True)
        if not killed:
            report.note("no kill landed mid-work; raise --seconds-per-row")
        bound = args.in_flight_rows + args.commit_queue * args.chunk_rows
        report.ratio("max rows recomputed per kill / (window + commit queue)", worst / bound, 1.0,
                     higher_is_better=False, note=f"max {worst} rows over {len(killed)} kills; inFlightRows "
                     f"{args.in_flight_rows} + commitQueueChunks {args.commit_queue} x chunkRows {args.chunk_rows}")
        report.ratio("max rows recomputed per kill / chunkRows", worst / args.chunk_rows, None)
    finally:
        harness.cleanup(work, args.keep)
    report.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
