"""Publish memory is flat in rows: peak RSS of every process taking part, at N/10 and N echo rows.

Two echo jobs (task generate) with the default shard size (64 MiB), of --rows / 10 and
--rows rows, are run with `bij run`; each is then published again, timed, twice:

- candidate: `bij publish` (the row-level passes as `bij-worker publish` processes,
  --parallelism at a time); peak RSS of the `bij publish` process and of each pass
  process (wait4 `ru_maxrss`, each its own);
- anchor ("before"): the in-process publish of commit ANCHOR_COMMIT (every id of
  the job in one set, each shard's log loaded whole), loaded from git, in one process.

Targets: the largest peak RSS of any candidate process, big / small <= 1.3, and under
300 MB at the big size. Reported: the anchor's peak RSS and both wall times, the size
of `_bij/` beside the published files.

    python bench/publish_scale.py [--rows 2500000] [--parallelism 2]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import harness
import yaml

TARGET = 1.3
LIMIT_MIB = 300
ANCHOR_COMMIT = "89d9e62"  # the last commit whose publish ran in the operator process

# Run in a fresh interpreter: the anchor publish, loaded from git as a module of bij_operator.
ANCHOR = """
import importlib.util, inspect, json, sys, time
import bij_worker.segments as segments
from bij_worker.contract.spec import load_job
src = open(sys.argv[1]).read()
if "repair" not in inspect.signature(segments.ShardLog.read).parameters:
    src = src.replace(".read(repair=False)", ".read()")
spec = importlib.util.spec_from_loader("bij_operator._publish_anchor", loader=None)
mod = importlib.util.module_from_spec(spec)
mod.__package__ = "bij_operator"
sys.modules[spec.name] = mod
exec(compile(src, "publish_anchor.py", "exec"), mod.__dict__)
m = mod.publish(load_job(sys.argv[2]), rounds=1)
print(json.dumps(m["counts"]))
"""


def run_rss(cmd: list[str]) -> tuple[float, int, str]:
    """Run a command; (wall seconds, its own peak RSS in KiB from wait4, stdout). Fails loudly."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
        _, status, usage = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[:5])} failed ({p.returncode}):\n{err.read().decode()[-3000:]}")
        return wall, int(usage.ru_maxrss), out.read().decode()


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__, rows=2_500_000, repeats=1)
    p.add_argument("--parallelism", type=int, default=2, help="publish processes at a time (default 2)")
    args = harness.parse(p, argv)
    anchor_src = subprocess.run(["git", "-C", str(harness.REPO), "show",
                                 f"{ANCHOR_COMMIT}:operator/bij_operator/publish.py"],
                                capture_output=True, text=True)
    report = harness.Report("publish_scale")
    work = harness.work_dir("publish-scale", args.keep)
    try:
        anchor_file = None
        if anchor_src.returncode == 0:
            anchor_file = work / "publish_anchor.py"
            anchor_file.write_text(anchor_src.stdout)
        else:
            report.note(f"no anchor: commit {ANCHOR_COMMIT} is not in this checkout")
        texts = harness.corpus_texts(work)
        sizes = {"small": max(1, args.rows // 10), "big": args.rows}
        specs, outs = {}, {}
        for name, rows in sizes.items():
            src = work / name / "rows.jsonl"
            size = harness.write_rows(src, harness.cycle(texts, rows))
            outs[name] = work / f"out-{name}"
            specs[name] = harness.write_spec(work / f"spec-{name}.yaml", f"bench-publish-{name}", src, outs[name],
                                             {"engine": "echo", "task": "generate"}, shard_bytes=64 << 20)
            # Publishing is measured again after `bij run`: its work files must stay.
            doc = yaml.safe_load(specs[name].read_text())
            doc["spec"]["output"]["keepIntermediate"] = True
            specs[name].write_text(yaml.safe_dump(doc, sort_keys=False))
            wall = harness.run_bij(specs[name])
            shards = len(harness.done_records(outs[name]))
            print(f"publish_scale: {name:5} {rows:>10,} rows {size:>13,} bytes, {shards} shards, "
                  f"bij run {wall:.1f}s", flush=True)

        def candidate(name: str) -> dict[str, Any]:
            stats_file = work / f"stats-{name}.json"
            cmd = [sys.executable, "-m", "bij_operator.cli", "publish", str(specs[name]),
                   "--parallelism", str(args.parallelism), "--process-stats", str(stats_file)]
            wall, rss, out = run_rss(cmd)
            stats = json.loads(stats_file.read_text())
            per_pass = {k: max((s["maxRssKiB"] for s in stats if s["pass"] == k), default=0)
                        for k in ("driver", "ids", "dedupe", "write")}
            peak = max([rss, *per_pass.values()])  # rss: wait4 counts the children it waited for too
            print(f"  candidate {name:5}: {wall:6.1f}s; peak RSS MiB: bij publish with its children "
                  f"{rss / 1024:.1f}, "
                  + ", ".join(f"{k} {v / 1024:.1f}" for k, v in per_pass.items())
                  + f" ({len(stats) - 1} pass processes)", flush=True)
            return {"wall_s": wall, "with_children_kib": rss, "passes_kib": per_pass, "peak_kib": peak,
                    "processes": len(stats) - 1, "counts": json.loads(out)}

        def anchor(name: str) -> dict[str, Any]:
            assert anchor_file is not None
            wall, rss, out = run_rss([sys.executable, "-c", ANCHOR, str(anchor_file), str(specs[name])])
            print(f"  anchor    {name:5}: {wall:6.1f}s; peak RSS MiB: in-process publish {rss / 1024:.1f}",
                  flush=True)
            return {"wall_s": wall, "peak_kib": rss, "counts": json.loads(out.strip().splitlines()[-1])}

        results: dict[str, dict[str, Any]] = {}
        for name in sizes:
            results[name] = {}
            if anchor_file is not None:
                try:
                    results[name]["anchor"] = anchor(name)
                except RuntimeError as e:
                    # The anchor is old code loaded into today's packages; once the modules it imports
                    # move, it cannot run here. The candidate's figures stand on their own.
                    last = str(e).strip().splitlines()[-1]
                    report.note(f"no anchor: commit {ANCHOR_COMMIT}'s publish does not load here ({last})")
                    print(f"  anchor    {name:5}: does not load in this checkout: {last}", flush=True)
                    anchor_file = None
            results[name]["candidate"] = candidate(name)  # last, so the manifest left is the candidate's
            if "anchor" in results[name]:
                assert results[name]["anchor"]["counts"] == results[name]["candidate"]["counts"], results[name]
            results[name]["bij_bytes"] = du(outs[name] / "_bij")
            results[name]["published_bytes"] = du(outs[name] / "results") + du(outs[name] / "errors")
        small, big = results["small"]["candidate"], results["big"]["candidate"]
        report.ratio("bij publish's own peak RSS big / small (the operator's share)",
                     big["passes_kib"]["driver"] / small["passes_kib"]["driver"], None,
                     note=f"{small['passes_kib']['driver'] / 1024:.0f} vs {big['passes_kib']['driver'] / 1024:.0f} MiB")
        report.details.update(rows=sizes, parallelism=args.parallelism, results=results)
        report.ratio(f"publish peak RSS (any process) {sizes['big']:,} rows / {sizes['small']:,} rows",
                     big["peak_kib"] / small["peak_kib"], TARGET, higher_is_better=False,
                     note=f"{small['peak_kib'] / 1024:.0f} vs {big['peak_kib'] / 1024:.0f} MiB")
        report.ratio(f"publish peak RSS at {sizes['big']:,} rows / {LIMIT_MIB} MiB",
                     big["peak_kib"] / 1024 / LIMIT_MIB, 1.0, higher_is_better=False)
        if "anchor" in results["big"]:
            a_small, a_big = results["small"]["anchor"], results["big"]["anchor"]
            report.ratio("before: in-operator publish peak RSS big / small", a_big["peak_kib"] / a_small["peak_kib"],
                         None, note=f"{a_small['peak_kib'] / 1024:.0f} vs {a_big['peak_kib'] / 1024:.0f} MiB")
            report.ratio(f"peak RSS at {sizes['big']:,} rows: after / before", big["peak_kib"] / a_big["peak_kib"],
                         None)
            report.ratio(f"publish wall time at {sizes['big']:,} rows: after / before",
                         big["wall_s"] / a_big["wall_s"], None,
                         note=f"{a_big['wall_s']:.1f}s before, {big['wall_s']:.1f}s after, "
                              f"{args.parallelism} processes")
        b = results["big"]
        report.ratio(f"_bij/ bytes / published bytes at {sizes['big']:,} rows",
                     b["bij_bytes"] / max(1, b["published_bytes"]), None,
                     note=f"{b['bij_bytes'] / 1e6:.1f} MB of work files beside {b['published_bytes'] / 1e6:.1f} MB")
    finally:
        harness.cleanup(work, args.keep)
    report.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
