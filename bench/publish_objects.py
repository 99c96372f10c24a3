"""Objects publishing writes grow with shards and output parts, never shards x buckets.

For each shard count (--shards, default 1,000 and 10,000 tiny shards of --rows-per-shard echo
results each, a few ids repeated across shards), the durable logs and a publish plan of
buckets of --bucket-rows ids are written on file:// directly (no `bij run`); then the three
publish passes run in this process against a storage that counts its requests:

- candidate: this tree's passes (one ids file per shard, dedupe by ranged reads);
- before: the passes of ANCHOR_COMMIT (one ids file per shard and bucket), taken from git and
  run on the same logs, where shards x buckets <= --before-limit; beyond it, its objects are
  the formula shards x (buckets + 1) + buckets + what the write pass writes (its layout's
  count, checked against the measured run at the smaller sizes).

Target: objects the passes write <= 2 x shards + output parts + 16 (the buckets with losers,
at most the repeated ids). Reported: requests of each kind, wall time of each pass, and
objects written before / after.

    python bench/publish_objects.py [--shards 1000,10000] [--rows-per-shard 10] [--bucket-rows 1000]
"""

from __future__ import annotations

import subprocess
import sys
import time
import types
from collections import Counter
from typing import Any

import harness

from bij.contract import layout
from bij.contract.publish_plan import PublishPlan
from bij.steps import publish_rows
from bij.storage import FileStorage
from bij.storage.segments import ShardLog

ANCHOR_COMMIT = "a4b6d68"  # the last commit whose ids pass wrote one file per shard and bucket
CONSTANT = 16
REPEATED = 5  # ids that appear again in a later shard: losers in at most this many buckets
WRITES = ("write_bytes", "write_stream", "create")
READS = ("read_bytes", "read_range", "open_read")


class CountingStorage:
    """file:// storage that counts its requests by kind (writes, reads, listings, deletes)."""

    def __init__(self) -> None:
        self.inner = FileStorage()
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.inner, name)
        if not callable(method):
            return method

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return method(*args, **kwargs)

        return counted

    def written(self) -> int:
        return sum(self.calls[k] for k in WRITES)


def before_module() -> types.ModuleType | None:
    """ANCHOR_COMMIT's publish_rows, its paths from today's layout module (its ids files by bucket)."""
    source = subprocess.run(["git", "-C", str(harness.REPO), "show", f"{ANCHOR_COMMIT}:src/bij/steps/publish_rows.py"],
                            capture_output=True, text=True)
    if source.returncode != 0:
        return None
    mod = types.ModuleType("publish_rows_before")
    exec(compile(source.stdout, f"{ANCHOR_COMMIT}:publish_rows.py", "exec"), mod.__dict__)  # noqa: S102
    mod.layout = types.SimpleNamespace(  # type: ignore[attr-defined]
        **{**vars(layout), "publish_ids_uri": layout.publish_bucket_ids_uri})
    return mod


def make_job(root: str, shards: int, rows_per_shard: int, bucket_rows: int) -> PublishPlan:
    """Durable logs of `shards` finished shards and the publish plan for them, under `root`."""
    store = FileStorage()
    out = f"file://{root}/out"
    round_prefix = layout.join(out, "_bij", "bench", "round-0")
    units = []
    for s in range(shards):
        prefix = layout.shard_prefix(round_prefix, s)
        units.append((0, s, prefix))
        records = []
        for i in range(rows_per_shard):
            # The first REPEATED shards' first id again, in the last shard: a duplicate across shards.
            rid = f"s{i}-0" if s == shards - 1 and i < REPEATED else f"s{i}-{s}"
            records.append({"kind": "result", "at": [0, s * 1000 + i * 10, s * 1000 + i * 10 + 10],
                            "row": {"id": rid, "output": f"text {s} {i}"}})
        ShardLog(store, prefix, writer_id="bench").append(records)
    rows = shards * rows_per_shard
    return PublishPlan(prefix=layout.join(out, "_bij", "bench", "publish"), output_uri=out, units=units,
                       object_names=[["in.jsonl"]], bucket_rows=bucket_rows, buckets=max(1, -(-rows // bucket_rows)),
                       compression="zstd", format="jsonl", task="generate", judge=False, id_kind=None)


def run_passes(module: Any, plan: PublishPlan) -> dict[str, Any]:
    """The three passes of `module` over `plan`, each index in turn; requests and wall time per pass."""
    out: dict[str, Any] = {"passes": {}}
    total: Counter[str] = Counter()
    for pass_name in ("ids", "dedupe", "write"):
        store = CountingStorage()
        fn = {"ids": module.run_ids, "dedupe": module.run_dedupe, "write": module.run_write}[pass_name]
        t0 = time.perf_counter()
        for i in range(plan.count(pass_name)):
            fn(plan, i, store)
        out["passes"][pass_name] = {"wall_s": round(time.perf_counter() - t0, 2), "written": store.written(),
                                    "requests": dict(store.calls)}
        total += store.calls
    out["written"] = sum(total[k] for k in WRITES)
    out["reads"] = sum(total[k] for k in READS)
    out["requests"] = dict(total)
    return out


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__, rows=0, repeats=1)
    p.add_argument("--shards", default="1000,10000", help="shard counts, comma-separated (default 1000,10000)")
    p.add_argument("--rows-per-shard", type=int, default=10)
    p.add_argument("--bucket-rows", type=int, default=1000, help="ids a bucket (default 1000, the least a spec takes)")
    p.add_argument("--before-limit", type=int, default=20_000,
                   help="run the previous passes where shards x buckets is at most this (default 20,000)")
    args = harness.parse(p, argv)
    report = harness.Report("publish_objects")
    before = before_module()
    if before is None:
        report.note(f"no previous passes: commit {ANCHOR_COMMIT} is not in this checkout; its formula stands in")
    work = harness.work_dir("publish-objects", args.keep)
    try:
        for shards in (int(n) for n in args.shards.split(",")):
            plan = make_job(str(work / f"s{shards}"), shards, args.rows_per_shard, args.bucket_rows)
            buckets = plan.buckets
            after = run_passes(publish_rows, plan)
            parts = after["passes"]["write"]["written"] - shards  # the write pass: output parts and a summary a shard
            losers = after["passes"]["dedupe"]["written"]
            # Before: ids pass shards x buckets files and an order.json a shard, dedupe a losers file a bucket.
            formula = shards * (buckets + 1) + buckets + parts + shards
            measured = None
            if before is not None and shards * buckets <= args.before_limit:
                # Its own copy of the logs: its passes leave files this tree's would not read.
                bplan = make_job(str(work / f"before-s{shards}"), shards, args.rows_per_shard, args.bucket_rows)
                measured = run_passes(before, bplan)
                assert measured["written"] == formula, (measured["written"], formula)
            old = measured["written"] if measured else formula
            how = "measured" if measured else "formula"
            print(f"publish_objects: {shards:,} shards x {buckets} buckets: written after {after['written']:,} "
                  f"({after['written'] / shards:.2f} a shard: ids {after['passes']['ids']['written']:,}, "
                  f"losers {losers}, write {after['passes']['write']['written']:,}), before {old:,} ({how}, "
                  f"{old / shards:.1f} a shard); reads after {after['reads']:,}"
                  + (f", before {measured['reads']:,}" if measured else "")
                  + "; wall s after " + ", ".join(f"{k} {v['wall_s']}" for k, v in after["passes"].items())
                  + ("; before " + ", ".join(f"{k} {v['wall_s']}" for k, v in measured["passes"].items())
                     if measured else ""), flush=True)
            report.details[str(shards)] = {"buckets": buckets, "parts": parts, "after": after, "before": measured,
                                           "before_formula": formula}
            limit = 2 * shards + parts + CONSTANT
            report.ratio(f"objects written at {shards:,} shards / (2 x shards + parts + {CONSTANT})",
                         after["written"] / limit, 1.0, higher_is_better=False,
                         note=f"{after['written']:,} of {limit:,}")
            report.ratio(f"objects written at {shards:,} shards x {buckets} buckets: after / before ({how})",
                         after["written"] / old, None, note=f"{after['written']:,} vs {old:,}")
    finally:
        harness.cleanup(work, args.keep)
    report.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
