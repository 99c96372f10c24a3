"""Judge strategies: `rounds` versus `inPlace` at high and low approval, same data, one run.

The engine is tests/coin_engine.py: deterministic outputs that a regex judge
approves with a known probability per attempt, and simulated costs a GPU
engine has: a model load per worker process (COIN_LOAD_S), a fixed cost per
batch (COIN_BATCH_S, kernel launches and padding) and a cost per row
(COIN_ROW_S). Both strategies see the same coin flips, so they approve the
same rows with the same number of engine calls; what differs is the time:
rounds pay a new set of worker start-ups (model loads) and a barrier per
round, inPlace pays for retries in ever smaller batches and for the shard
with the unluckiest rows.

    python bench/judge_strategies.py [--rows 2000] [--load-s 2] [--batch-s 0.05] [--row-s 0.002]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import coin_engine  # noqa: E402

from bij.contract.spec import load_job  # noqa: E402
from bij.local.run import LocalRunner  # noqa: E402


def run(tmp: Path, rows: int, strategy: str, approval: int, args: argparse.Namespace) -> dict[str, Any]:
    work = tmp / f"{strategy}-{approval}"
    (work / "in").mkdir(parents=True)
    with (work / "in" / "rows.jsonl").open("w") as f:
        for i in range(rows):
            f.write(json.dumps({"id": i, "text": f"row {i} " + "lorem " * (i % 17)}) + "\n")
    size = (work / "in" / "rows.jsonl").stat().st_size
    doc = {
        "apiVersion": "batchinference.io/v1alpha1", "kind": "BatchInferenceJob",
        "metadata": {"name": f"judge-{strategy.lower()}-{approval}"},
        "spec": {
            "input": {"uri": f"file://{work}/in/"}, "output": {"uri": f"file://{work}/out/"},
            "model": {"engine": "echo", "task": "generate"},
            # One shard per worker in round 0, as a real job sized by targetShardBytes would have;
            # later rounds are smaller and fit in as many shards or fewer.
            "sharding": {"targetShardBytes": max(4096, size // args.parallelism + 1), "chunkRows": 256},
            "batching": {"maxBatchSize": 64},
            "workers": {"parallelism": args.parallelism},
            "judge": {"type": "regex", "pattern": coin_engine.approve_pattern(approval), "strategy": strategy,
                      "maxRounds": args.cap, "maxAttempts": args.cap},
        },
    }
    (work / "job.yaml").write_text(yaml.safe_dump(doc))
    env = {"COIN_LOAD_S": str(args.load_s), "COIN_BATCH_S": str(args.batch_s), "COIN_ROW_S": str(args.row_s)}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        t = time.perf_counter()
        rc = LocalRunner(load_job(work / "job.yaml"), show_progress=False,
                         worker_cmd=coin_engine.worker_cmd()).run()
        wall = time.perf_counter() - t
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert rc == 0, f"{strategy} at {approval}% failed"
    m = json.loads((work / "out" / "manifest.json").read_text())
    return {"strategy": strategy, "approval": approval, "wall_s": round(wall, 2),
            "engine_calls": sum(r["engineCalls"] for r in m["rounds"]), "rounds": len(m["rounds"]),
            "approved": m["counts"]["rows"], "capped": m["counts"]["capped"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=2000)
    p.add_argument("--parallelism", type=int, default=4)
    p.add_argument("--cap", type=int, default=5, help="maxRounds and maxAttempts")
    p.add_argument("--load-s", type=float, default=2.0, help="simulated model load per worker process")
    p.add_argument("--batch-s", type=float, default=0.05, help="simulated fixed cost per engine batch")
    p.add_argument("--row-s", type=float, default=0.002, help="simulated cost per row")
    p.add_argument("--approvals", default="90,30")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    import logging

    logging.disable(logging.INFO)
    results = []
    with tempfile.TemporaryDirectory() as d:
        for approval in [int(a) for a in args.approvals.split(",")]:
            for strategy in ("rounds", "inPlace"):
                results.append(run(Path(d), args.rows, strategy, approval, args))
    print(f"\njudge strategies: {args.rows} rows, parallelism {args.parallelism}, cap {args.cap}, "
          f"load {args.load_s}s/process, {args.batch_s}s/batch, {args.row_s}s/row (simulated)")
    print(f"{'approval':>9} {'strategy':>8} {'rounds':>6} {'calls':>7} {'approved':>8} {'capped':>6} {'wall s':>7}")
    for r in results:
        print(f"{r['approval']:>8}% {r['strategy']:>8} {r['rounds']:>6} {r['engine_calls']:>7} "
              f"{r['approved']:>8} {r['capped']:>6} {r['wall_s']:>7}")
    for approval in sorted({r["approval"] for r in results}, reverse=True):
        a = {r["strategy"]: r for r in results if r["approval"] == approval}
        ratio = a["rounds"]["wall_s"] / a["inPlace"]["wall_s"]
        winner = "inPlace" if ratio > 1 else "rounds"
        print(f"at {approval}% approval: rounds/inPlace wall time = {ratio:.2f} -> {winner} wins; "
              f"engine calls {a['rounds']['engine_calls']} vs {a['inPlace']['engine_calls']}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
