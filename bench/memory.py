"""Worker memory is bounded by the chunk, not the shard: peak RSS when the input grows 10x.

Two one-shard jobs with the echo engine (task generate), one of --rows / 10 rows and
one of --rows, each worked by a fresh `bij-worker` process; the peak resident set of
that process comes from wait4() (its own ru_maxrss, not its parent's or a sibling's).
Target: peak RSS big / small <= 1.2. Also printed: the RSS of a worker on a one-row
shard (what a worker costs before any data), the growth per extra row, and (reported,
no target) the peak RSS of a worker resuming each shard with every row already durable
but no completion record (as after a kill just before the end).

    python bench/memory.py [--rows 200000] [--repeats 2]
"""

from __future__ import annotations

import sys

import harness

TARGET = 1.2


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__, rows=200_000, repeats=2)
    p.add_argument("--chunk-rows", type=int, default=512, help="spec.sharding.chunkRows")
    args = harness.parse(p, argv)

    report = harness.Report("memory")
    work = harness.work_dir("memory", args.keep)
    try:
        texts = harness.corpus_texts(work)
        sizes = {"one": 1, "small": max(1, args.rows // 10), "big": args.rows}
        inputs = {}
        for name, rows in sizes.items():
            inputs[name] = work / name / "rows.jsonl"
            size = harness.write_rows(inputs[name], harness.cycle(texts, rows))
            print(f"memory: {name:5} {rows:>9,} rows {size:>13,} bytes", flush=True)
        model = {"engine": "echo", "task": "generate"}

        def side(name: str):  # type: ignore[no-untyped-def]
            def run(i: int) -> dict[str, int]:
                out = work / f"out-{name}-{i}"
                spec = harness.write_spec(work / f"spec-{name}-{i}.yaml", "bench-memory", inputs[name], out, model,
                                          args.chunk_rows)
                manifest, shards = harness.plan(spec)
                assert shards == 1, shards
                r = harness.run_worker(manifest)
                if r.rc != 0:
                    raise RuntimeError(f"worker on {name} exited {r.rc}")
                (rec,) = harness.done_records(out)
                assert rec["rows"] == sizes[name], rec
                # Resume: the same shard with every row durable but no completion record, as after a
                # kill just before the end; the worker reads its durable log back before it goes on.
                for done in out.glob("_bij/*/round-*/done/*.json"):
                    done.unlink()
                again = harness.run_worker(manifest)
                if again.rc != 0:
                    raise RuntimeError(f"resumed worker on {name} exited {again.rc}")
                harness.cleanup(out, False)
                print(f"  {name:5} peak RSS {r.max_rss_kib / 1024:7.1f} MiB  ({r.wall_s:.1f}s); "
                      f"resuming it {again.max_rss_kib / 1024:7.1f} MiB", flush=True)
                return {"fresh": r.max_rss_kib, "resume": again.max_rss_kib}
            return run

        runs = harness.interleave(args.repeats, one=side("one"), small=side("small"), big=side("big"))
        one, small, big = (harness.median(r["fresh"] for r in runs[k]) for k in ("one", "small", "big"))
        r_small, r_big = (harness.median(r["resume"] for r in runs[k]) for k in ("small", "big"))
        per_row = (big - small) * 1024 / (sizes["big"] - sizes["small"])
        print(f"median peak RSS: one row {one / 1024:.1f} MiB, {sizes['small']:,} rows {small / 1024:.1f} MiB, "
              f"{sizes['big']:,} rows {big / 1024:.1f} MiB; growth {per_row:.0f} bytes per extra row", flush=True)
        report.details.update(rows=sizes, chunk_rows=args.chunk_rows, peak_rss_kib=runs,
                              bytes_per_extra_row=per_row)
        report.ratio(f"peak RSS {sizes['big']:,} rows / {sizes['small']:,} rows", big / small, TARGET,
                     higher_is_better=False, note=f"{per_row:.0f} bytes per extra row")
        report.ratio("resume peak RSS big/small", r_big / r_small, None,
                     note=f"a worker resuming a fully logged shard: {r_small / 1024:.1f} vs {r_big / 1024:.1f} MiB")
    finally:
        harness.cleanup(work, args.keep)
    report.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
