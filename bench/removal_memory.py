"""Peak memory of removing a published job's work files, at 20,000 and 200,000 objects: flat, or not.

For each N, writes N small work objects (1,000 a folder, as shard logs lie) under a job's
`_bij/<id>/round-0/shards/` on file://, then in a fresh process runs the removal
(`bij.steps.removal.remove_work_files`) and reports its peak RSS (VmHWM) and its growth over the RSS
before the removal started. Target (issue 38): the peak at the largest N within 1.3x of the smallest.
With --old, the removal before issue 38 (list everything, delete one at a time) is measured beside it.

    python bench/removal_memory.py [--objects 20000,200000] [--old]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, time
from bij.contract import layout
from bij.contract.spec import parse_job
from bij.storage import FileStorage

def rss(field):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(field + ":"))

out, old = sys.argv[1], sys.argv[2] == "old"
job = parse_job({"apiVersion": "batchinference.io/v1alpha1", "kind": "BatchInferenceJob",
                 "metadata": {"name": "big", "uid": "u"},
                 "spec": {"input": {"uri": "file:///in/"}, "output": {"uri": out},
                          "model": {"engine": "echo", "task": "embed"}}})
store = FileStorage()
folder = layout.join(layout.state_prefix(job), "round-0", "shards") + "/"
from bij.steps.removal import remove_work_files
before = rss("VmRSS")
t0 = time.monotonic()
if old:
    objects = store.list(folder)
    for o in objects:
        store.delete(o.uri)
    removed = len(objects)
else:
    removal = remove_work_files(store, job, [folder])
    assert removal.error is None, removal.error
    removed = removal.record["objects"]
print(json.dumps({"removed": removed, "rssBeforeKiB": before, "peakKiB": rss("VmHWM"),
                  "seconds": round(time.monotonic() - t0, 1)}))
"""


def make_objects(out: Path, n: int) -> None:
    from bij.contract import layout
    from bij.contract.spec import parse_job

    job = parse_job({"apiVersion": "batchinference.io/v1alpha1", "kind": "BatchInferenceJob",
                     "metadata": {"name": "big", "uid": "u"},
                     "spec": {"input": {"uri": "file:///in/"}, "output": {"uri": f"file://{out}/"},
                              "model": {"engine": "echo", "task": "embed"}}})
    root = Path(layout.join(layout.state_prefix(job), "round-0", "shards")[len("file://"):])
    for i in range(n):
        folder = root / f"{i // 1000:06d}"
        if i % 1000 == 0:
            folder.mkdir(parents=True, exist_ok=True)
        (folder / f"seg-{i:08d}.jsonl").write_bytes(b"{}\n")


def measure(n: int, old: bool) -> dict[str, int]:
    with tempfile.TemporaryDirectory() as tmp:
        make_objects(Path(tmp), n)
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
        got = subprocess.run([sys.executable, "-c", CHILD, f"file://{tmp}/", "old" if old else "new"],
                             capture_output=True, text=True, check=True, env=env).stdout
        result: dict[str, int] = json.loads(got)
        assert result["removed"] == n, result
        return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--objects", default="20000,200000")
    p.add_argument("--old", action="store_true", help="also measure the removal before issue 38")
    args = p.parse_args()
    sizes = [int(x) for x in args.objects.split(",")]
    for kind in (["new", "old"] if args.old else ["new"]):
        rows = {n: measure(n, kind == "old") for n in sizes}
        for n, r in rows.items():
            print(f"{kind}: {n:>9,} objects: peak {r['peakKiB'] / 1024:.1f} MiB, "
                  f"growth {(r['peakKiB'] - r['rssBeforeKiB']) / 1024:.1f} MiB, {r['seconds']} s")
        lo, hi = rows[sizes[0]], rows[sizes[-1]]
        print(f"{kind}: peak ratio {sizes[-1]:,} / {sizes[0]:,} objects: {hi['peakKiB'] / lo['peakKiB']:.2f}x")


if __name__ == "__main__":
    main()
