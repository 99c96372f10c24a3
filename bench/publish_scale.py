"""Publish memory is flat in rows: peak RSS of every process taking part, at N/10 and N echo rows.

Two echo jobs (task generate) with the default shard size (64 MiB), of --rows / 10 and
--rows rows, are run with `bij run`; each is then published again, timed, twice:

- candidate: `bij publish` (the row-level passes as `bij-worker publish` processes,
  --parallelism at a time); peak RSS of the `bij publish` process and of each pass
  process (wait4 `ru_maxrss`, each its own);
- anchor ("before"): commit ANCHOR_COMMIT, the last whose publish ran in one process
  (every id of the job in one set, each shard's log loaded whole). Its operator and worker
  trees are taken from git and run whole: its own `bij run` of the same rows into its own
  output (its durable logs are plain JSONL), then its own `bij publish`, timed the same way.

Targets: the largest peak RSS of any candidate process, big / small <= 1.3, and under
300 MB at the big size; at the big size, publishing with --parallelism processes takes less
wall time than with one (published once more with one process, in the same run).
Reported: the anchor's peak RSS and both wall times, the size of `_bij/` beside the
published files.

    python bench/publish_scale.py [--rows 2500000] [--parallelism 2] [--no-anchor]
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


def run_rss(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, int, str]:
    """Run a command; (wall seconds, its own peak RSS in KiB from wait4, stdout). Fails loudly."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env)
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


def anchor_tree(work: Path) -> dict[str, str] | None:
    """ANCHOR_COMMIT's operator and worker packages under work/anchor, and the environment that runs
    them (its packages first on PYTHONPATH, for its worker processes too); None without that commit."""
    dest = work / "anchor"
    dest.mkdir()
    archive = subprocess.run(["git", "-C", str(harness.REPO), "archive", ANCHOR_COMMIT, "operator", "worker"],
                             capture_output=True)
    if archive.returncode != 0:
        return None
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(dest / "operator"), str(dest / "worker")])}


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__, rows=2_500_000, repeats=1)
    p.add_argument("--parallelism", type=int, default=2, help="publish processes at a time (default 2)")
    p.add_argument("--no-anchor", action="store_true",
                   help="skip the anchor (its in-process publish holds every id: about 1 GB per million rows)")
    args = harness.parse(p, argv)
    report = harness.Report("publish_scale")
    work = harness.work_dir("publish-scale", args.keep)
    try:
        anchor_env = None if args.no_anchor else anchor_tree(work)
        if anchor_env is None and not args.no_anchor:
            report.note(f"no anchor: commit {ANCHOR_COMMIT} is not in this checkout")
        texts = harness.corpus_texts(work)
        sizes = {"small": max(1, args.rows // 10), "big": args.rows}
        specs, outs, anchor_specs = {}, {}, {}
        for name, rows in sizes.items():
            src = work / name / "rows.jsonl"
            size = harness.write_rows(src, harness.cycle(texts, rows))
            outs[name] = work / f"out-{name}"
            specs[name] = harness.write_spec(work / f"spec-{name}.yaml", f"bench-publish-{name}", src, outs[name],
                                             {"engine": "echo", "task": "generate"}, shard_bytes=64 << 20)
            if anchor_env is not None:
                # The same shards without the fields that commit did not know (it had no lanes, and never
                # removed work files).
                anchor_specs[name] = harness.write_spec(
                    work / f"anchor-spec-{name}.yaml", f"bench-publish-{name}", src, work / f"anchor-out-{name}",
                    {"engine": "echo", "task": "generate"}, shard_bytes=64 << 20)
                doc = yaml.safe_load(anchor_specs[name].read_text())
                del doc["spec"]["sharding"]["shardsPerLane"]
                anchor_specs[name].write_text(yaml.safe_dump(doc, sort_keys=False))
                wall = harness.run_bij(anchor_specs[name], env=anchor_env)
                print(f"publish_scale: {name:5} anchor's bij run {wall:.1f}s", flush=True)
            # Publishing is measured again after `bij run`: its work files must stay.
            doc = yaml.safe_load(specs[name].read_text())
            doc["spec"]["output"]["keepIntermediate"] = True
            specs[name].write_text(yaml.safe_dump(doc, sort_keys=False))
            wall = harness.run_bij(specs[name])
            shards = len(harness.done_records(outs[name]))
            print(f"publish_scale: {name:5} {rows:>10,} rows {size:>13,} bytes, {shards} shards, "
                  f"bij run {wall:.1f}s", flush=True)

        def candidate(name: str, parallelism: int = args.parallelism) -> dict[str, Any]:
            stats_file = work / f"stats-{name}.json"
            cmd = [sys.executable, "-m", "bij.cli.main", "publish", str(specs[name]),
                   "--parallelism", str(parallelism), "--process-stats", str(stats_file)]
            wall, rss, out = run_rss(cmd)
            stats = json.loads(stats_file.read_text())
            per_pass = {k: max((s["maxRssKiB"] for s in stats if s["pass"] == k), default=0)
                        for k in ("driver", "ids", "dedupe", "write")}
            peak = max([rss, *per_pass.values()])  # rss: wait4 counts the children it waited for too
            print(f"  candidate {name:5} x{parallelism}: {wall:6.1f}s; peak RSS MiB: bij publish with its children "
                  f"{rss / 1024:.1f}, "
                  + ", ".join(f"{k} {v / 1024:.1f}" for k, v in per_pass.items())
                  + f" ({len(stats) - 1} pass processes)", flush=True)
            return {"wall_s": wall, "with_children_kib": rss, "passes_kib": per_pass, "peak_kib": peak,
                    "processes": len(stats) - 1, "counts": json.loads(out)}

        def anchor(name: str) -> dict[str, Any]:
            cmd = [sys.executable, "-m", "bij.cli.main", "publish", str(anchor_specs[name])]
            wall, rss, out = run_rss(cmd, env=anchor_env)
            print(f"  anchor    {name:5}: {wall:6.1f}s; peak RSS MiB: in-process publish {rss / 1024:.1f}",
                  flush=True)
            return {"wall_s": wall, "peak_kib": rss, "counts": json.loads(out.strip().splitlines()[-1])}

        results: dict[str, dict[str, Any]] = {}
        for name in sizes:
            results[name] = {}
            if anchor_env is not None:
                results[name]["anchor"] = anchor(name)
            if name == "big" and args.parallelism > 1:
                results[name]["one_process"] = candidate(name, parallelism=1)
            results[name]["candidate"] = candidate(name)
            if "anchor" in results[name]:
                assert results[name]["anchor"]["counts"] == results[name]["candidate"]["counts"], results[name]
            results[name]["bij_bytes"] = du(outs[name] / "_bij")
            results[name]["published_bytes"] = du(outs[name] / "results") + du(outs[name] / "errors")
            if anchor_env is not None:
                a_out = work / f"anchor-out-{name}"
                results[name]["anchor_bij_bytes"] = du(a_out / "_bij")
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
        if "one_process" in results["big"]:
            one = results["big"]["one_process"]
            report.ratio(f"publish wall time at {sizes['big']:,} rows: {args.parallelism} processes / 1",
                         big["wall_s"] / one["wall_s"], 1.0, higher_is_better=False,
                         note=f"{one['wall_s']:.1f}s with 1, {big['wall_s']:.1f}s with {args.parallelism} "
                              f"on {os.cpu_count()} CPUs")
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
        if "anchor_bij_bytes" in b:
            report.ratio(f"before: _bij/ bytes / published bytes at {sizes['big']:,} rows",
                         b["anchor_bij_bytes"] / max(1, b["published_bytes"]), None,
                         note=f"{b['anchor_bij_bytes'] / 1e6:.1f} MB of plain JSONL work files")
    finally:
        harness.cleanup(work, args.keep)
    report.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
