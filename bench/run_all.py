"""Run every benchmark, then print one table of ratio vs target. `make bench` runs this.

Each benchmark runs in its own process with the flags given here passed through
(--scale, --repeats, --keep, ...; a flag only some benchmarks know, such as --kills,
is ignored by the others) and writes its JSON summary into one folder
(--out, default a new temporary folder). A missed target is reported in the table,
not turned into a failure: the exit code is 0 unless a benchmark itself crashed.

bench/vllm_overhead.py needs one CUDA GPU and vllm; it runs only with --vllm-model.
bench/gpu_check.py runs here with --cpu (its comparisons on the CPU; `make gpu-check` runs it on a GPU).

    python bench/run_all.py [--only embed,memory] [--scale 2] [--repeats 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHES = ["embed", "sorting", "echo_overhead", "memory", "kill_recompute", "simulated", "prefix", "lanes",
           "many_shards", "publish_objects", "scale", "steps_scale", "claims_scale", "vllm_peers", "http_engine",
           "gpu_check"]
# Flags a benchmark always gets here: gpu_check's comparisons on the CPU at a small shape (a few minutes).
FLAGS = {"gpu_check": ["--cpu"]}


def run_vllm(model: str, extra: list[str]) -> dict[str, object]:
    """vllm_overhead.py prints its ratio line; turn it into the same summary shape as the others."""
    proc = subprocess.run([sys.executable, str(HERE / "vllm_overhead.py"), "--model", model, *extra],
                          stdout=subprocess.PIPE, text=True)
    sys.stdout.write(proc.stdout)
    m = re.search(r"ratio worker/raw rows/s = ([0-9.]+)\s+\(target >= ([0-9.]+)\)", proc.stdout)
    if proc.returncode != 0 or not m:
        raise RuntimeError(f"vllm_overhead exited {proc.returncode} without a ratio line")
    value, target = float(m.group(1)), float(m.group(2))
    return {"bench": "vllm_overhead", "ratios": [{"name": "worker/raw vLLM rows/s", "value": value,
                                                  "target": target, "op": ">=", "met": value >= target}]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(BENCHES)},vllm_overhead")
    p.add_argument("--out", default=None, help="folder for the JSON summaries (default: a new temporary folder)")
    p.add_argument("--vllm-model", default=None, help="also run vllm_overhead.py with this model (needs a GPU)")
    args, passthrough = p.parse_known_args(argv)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bij-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    chosen = args.only.split(",") if args.only else [*BENCHES, "vllm_overhead"]
    unknown = set(chosen) - {*BENCHES, "vllm_overhead"}
    if unknown:
        p.error(f"unknown benchmarks: {', '.join(sorted(unknown))}")

    summaries: list[dict[str, object]] = []
    problems: list[str] = []
    for name in chosen:
        print(f"\n=== {name} ===", flush=True)
        t0 = time.perf_counter()
        if name == "vllm_overhead":
            if not args.vllm_model:
                print("skipped: needs --vllm-model (and one CUDA GPU with vllm installed)", flush=True)
                summaries.append({"bench": name, "skipped": "needs --vllm-model and a CUDA GPU"})
                continue
            try:
                doc = run_vllm(args.vllm_model, passthrough)
            except (RuntimeError, OSError) as e:
                problems.append(f"{name}: {e}")
                summaries.append({"bench": name, "crashed": str(e)})
                continue
            (out / f"{name}.json").write_text(json.dumps(doc, indent=2) + "\n")
            summaries.append(doc)
            continue
        python = sys.executable
        if name == "vllm_peers":
            # vLLM lives in its own environment (make vllm-env here; the worker image has it in its own).
            python = next((p for p in (sys.executable, str(HERE.parent / ".venv-vllm" / "bin" / "python"))
                           if subprocess.run([p, "-c", "import vllm"], capture_output=True).returncode == 0), "")
            if not python:
                print("skipped: vLLM is not installed (make vllm-env)", flush=True)
                summaries.append({"bench": name, "skipped": "vLLM is not installed (make vllm-env)"})
                continue
        rc = subprocess.run([python, str(HERE / f"{name}.py"), "--out", str(out), *FLAGS.get(name, []), *passthrough],
                            env={**os.environ, "BIJ_BENCH_PASSTHROUGH": "1"}).returncode
        print(f"({name}: {time.perf_counter() - t0:.0f}s)", flush=True)
        path = out / f"{name}.json"
        if rc != 0 or not path.exists():
            problems.append(f"{name}: exited {rc}")
            summaries.append({"bench": name, "crashed": f"exit {rc}"})
            continue
        summaries.append(json.loads(path.read_text()))

    print("\n" + "=" * 100)
    print(f"{'benchmark':15} {'ratio':52} {'value':>8} {'target':>9}  result")
    print("-" * 100)
    for doc in summaries:
        bench = str(doc["bench"])
        if "skipped" in doc or "crashed" in doc:
            print(f"{bench:15} {'-':52} {'':>8} {'':>9}  "
                  f"{'skipped: ' + str(doc['skipped']) if 'skipped' in doc else 'CRASHED: ' + str(doc['crashed'])}")
            continue
        for r in doc["ratios"]:  # type: ignore[attr-defined]
            verdict = "ok" if r["met"] else "MISSED"
            print(f"{bench:15} {r['name'][:52]:52} {r['value']:8.3f} {r['op'] + ' ' + format(r['target'], 'g'):>9}  "
                  f"{verdict}")
    print("=" * 100)
    print(f"summaries: {out}")
    if problems:
        print("benchmarks that did not finish: " + "; ".join(problems), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
