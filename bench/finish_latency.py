"""From a small job's last row to its manifest, on the real control plane (tests/cluster).

The steps after a round's last row (counting the round, the publish plan, the publish passes, the
manifest) are each a one-pod Job whose pod reports into the bij's status. Measured here: the time
from the last completion record written (the round's last row durable; the file's mtime) to
manifest.json written (its mtime), for --jobs small echo jobs run one after another through the
operator pod, and how long each step's Job ran. Run it with the operator under test on PYTHONPATH
(the operator pod and the step pods import bij from there).

    python bench/finish_latency.py [--jobs 3] [--rows 60]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=3)
    p.add_argument("--rows", type=int, default=60)
    args = p.parse_args(argv)

    import kubernetes
    from cluster import build_or_skip
    from cluster.harness import LocalCluster, add_worker_account, wait_for

    build_or_skip()
    work = Path(tempfile.mkdtemp(prefix="bij-finish-"))
    cluster = LocalCluster(work / "cluster")
    gaps: list[float] = []
    try:
        cluster.start()
        cluster.install_operator(values={"extraArgs": ["--status-interval", "0.3"]})
        custom = kubernetes.client.CustomObjectsApi(cluster.api)
        batch = kubernetes.client.BatchV1Api(cluster.api)
        ns = f"finish-{uuid.uuid4().hex[:6]}"
        kubernetes.client.CoreV1Api(cluster.api).create_namespace({"metadata": {"name": ns}})
        wait_for(lambda: kubernetes.client.CoreV1Api(cluster.api).read_namespaced_service_account("default", ns),
                 30, "the default SA")
        add_worker_account(cluster.api, ns)
        (work / "in").mkdir()
        with open(work / "in" / "rows.jsonl", "w") as f:
            for i in range(args.rows):
                f.write(json.dumps({"id": i, "text": f"row {i}"}) + "\n")
        for n in range(args.jobs):
            name = f"small-{n}"
            out = work / f"out-{n}"
            spec = {"input": {"uri": f"file://{work}/in"}, "output": {"uri": f"file://{out}", "compression": "none"},
                    "model": {"engine": "echo", "task": "generate"},
                    "sharding": {"targetShardBytes": 1024, "chunkRows": 8},
                    "workers": {"parallelism": 2, "env": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}}}
            custom.create_namespaced_custom_object("batchinference.io", "v1alpha1", ns, "batchinferencejobs", {
                "apiVersion": "batchinference.io/v1alpha1", "kind": "BatchInferenceJob", "metadata": {"name": name},
                "spec": spec})
            def succeeded(name: str = name) -> bool | None:
                bij = custom.get_namespaced_custom_object("batchinference.io", "v1alpha1", ns, "batchinferencejobs",
                                                          name)
                return (bij.get("status") or {}).get("phase") == "Succeeded" or None

            wait_for(succeeded, 300, f"{name} Succeeded", interval=0.5)
            last_row = max(p.stat().st_mtime for p in out.glob("_bij/*/round-0/done/*.json"))
            manifest = (out / "manifest.json").stat().st_mtime
            gaps.append(manifest - last_row)
            steps = {}
            for j in batch.list_namespaced_job(ns).items:
                if j.metadata.name.startswith(name + "-") and j.status.completion_time and j.status.start_time:
                    steps[j.metadata.name[len(name) + 1:]] = (j.status.completion_time - j.status.start_time)\
                        .total_seconds()
            print(f"{name}: last row -> manifest {gaps[-1]:.1f} s; Jobs (start to completion, s): "
                  + ", ".join(f"{k} {v:.0f}" for k, v in sorted(steps.items())), flush=True)
    finally:
        cluster.stop()
    print(json.dumps({"jobs": len(gaps), "lastRowToManifestSeconds": [round(g, 1) for g in gaps],
                      "median": round(statistics.median(gaps), 1) if gaps else None}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
