"""Pipeline overhead with the echo engine: worker rows/s ÷ a bare read-parse-write-fsync loop.

The echo engine costs next to nothing, so this measures what the worker itself costs
per row: reading with prefetch, parsing, id checks, token estimates, batching, result
rows, the durable log. The anchor is the least any durable JSONL pipeline must do over
the same file, in a fresh process: read lines, `json.loads`, `json.dumps` a result row
(`{"id", "output"}`), write, flush + fsync every chunkRows rows.

The worker runs as `bij-worker` on a one-shard plan (engine echo, task generate), timed
from its "resume" progress event (start-up over, durable state read) to its "done"
event — target >= 0.9 — and as a whole process (interpreter start included), reported.

    python bench/echo_overhead.py [--rows 200000] [--repeats 3] [--chunk-rows 512]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import harness

TARGET = 0.9


def bare_loop(src: str, dst: str, chunk_rows: int) -> None:
    """The anchor, in a fresh process: prints one JSON line with its rows and seconds."""
    t0, c0 = time.perf_counter(), time.process_time()
    n = 0
    with open(src, "rb") as f, open(dst, "wb") as out:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            out.write((json.dumps({"id": row["id"], "output": row["text"]}) + "\n").encode())
            n += 1
            if n % chunk_rows == 0:
                out.flush()
                os.fsync(out.fileno())
        out.flush()
        os.fsync(out.fileno())
    print(json.dumps({"rows": n, "seconds": time.perf_counter() - t0, "cpu_s": time.process_time() - c0}))


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__, rows=200_000, repeats=3)
    p.add_argument("--chunk-rows", type=int, default=512, help="spec.sharding.chunkRows (and the anchor's fsync step)")
    p.add_argument("--anchor-child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = harness.parse(p, argv)
    if args.anchor_child:
        src, dst = args.anchor_child
        bare_loop(src, dst, args.chunk_rows)
        return 0

    report = harness.Report("echo_overhead")
    work = harness.work_dir("echo", args.keep)
    try:
        input_path = work / "input" / "rows.jsonl"
        size = harness.write_rows(input_path, harness.cycle(harness.corpus_texts(work), args.rows))
        print(f"echo_overhead: {args.rows} rows, {size:,} bytes, chunkRows {args.chunk_rows}", flush=True)
        model = {"engine": "echo", "task": "generate"}

        def worker(i: int) -> dict[str, float]:
            out = work / f"out-{i}"
            spec = harness.write_spec(work / f"spec-{i}.yaml", "bench-echo", input_path, out, model, args.chunk_rows)
            manifest, shards = harness.plan(spec)
            assert shards == 1, shards
            run = harness.run_worker(manifest)
            t_resume, t_done = run.at("resume"), run.at("done")
            if run.rc != 0 or t_resume is None or t_done is None:
                raise RuntimeError(f"worker exit {run.rc}, events {[e for _, _, e in run.events][-3:]}")
            (rec,) = harness.done_records(out)
            if rec["rows"] != args.rows:
                raise RuntimeError(f"worker did {rec['rows']} rows, expected {args.rows}")
            c_resume, c_done = run.cpu_at("resume"), run.cpu_at("done")
            cpu = c_done - c_resume if c_resume is not None and c_done is not None else float("nan")
            r = {"worker_s": t_done - t_resume, "wall_s": run.wall_s, "cpu_s": cpu, "record_s": float(rec["seconds"])}
            print(f"  worker     {args.rows / r['worker_s']:9.0f} rows/s  (resume->done {r['worker_s']:.2f}s, "
                  f"cpu {cpu:.2f}s, process {r['wall_s']:.2f}s)", flush=True)
            harness.cleanup(out, False)
            return r

        def anchor(i: int) -> dict[str, float]:
            dst = work / f"bare-{i}.jsonl"
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, __file__, "--anchor-child", str(input_path), str(dst),
                                   "--chunk-rows", str(args.chunk_rows)], stdout=subprocess.PIPE, text=True,
                                  check=True)
            wall = time.perf_counter() - t0
            doc = json.loads(proc.stdout.strip().splitlines()[-1])
            assert doc["rows"] == args.rows, doc
            dst.unlink()
            print(f"  bare loop  {args.rows / doc['seconds']:9.0f} rows/s  (loop {doc['seconds']:.2f}s, "
                  f"cpu {doc['cpu_s']:.2f}s, process {wall:.2f}s)", flush=True)
            return {"loop_s": float(doc["seconds"]), "cpu_s": float(doc["cpu_s"]), "wall_s": wall}

        runs = harness.interleave(args.repeats, anchor=anchor, worker=worker)
        loop_s = harness.median(r["loop_s"] for r in runs["anchor"])
        worker_s = harness.median(r["worker_s"] for r in runs["worker"])
        wall_s = harness.median(r["wall_s"] for r in runs["worker"])
        report.details.update(rows=args.rows, bytes=size, chunk_rows=args.chunk_rows, runs=runs,
                              anchor_rows_s=args.rows / loop_s, worker_rows_s=args.rows / worker_s)
        report.ratio("worker/bare-loop rows/s", loop_s / worker_s, TARGET,
                     note="worker timed from its resume to its done event")
        report.ratio("worker/bare-loop rows per CPU second",
                     harness.median(r["cpu_s"] for r in runs["anchor"])
                     / harness.median(r["cpu_s"] for r in runs["worker"]), None,
                     note="CPU time instead of wall time: less sensitive to other load on the machine")
        report.ratio("worker process/bare-loop rows/s", loop_s / wall_s, None,
                     note="whole worker process, interpreter start and imports included")
    finally:
        harness.cleanup(work, args.keep)
    report.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
