"""Hot pods on the real control plane: one model load per lane pod, not one per shard.

Brings up the local Kubernetes control plane of tests/cluster (etcd, kube-apiserver,
kube-controller-manager, kube-scheduler built from Kubernetes' own modules, pods as local
processes) with the operator installed by Helm, and runs the same round of --shards shards
with the simulated engine (`loadSeconds` slept once per process, as a model load) two ways:

- before: the contract bij had until lanes, an Indexed Job of one index per shard (the
  round plan without its "lanes" key makes each pod work exactly its own shard), created
  from `bij render`'s Job with completions = shards and parallelism = --lanes, run by the
  real Job controller without the operator;
- lanes: a BatchInferenceJob applied to the cluster, run by the operator pod: a Job of
  --lanes indexes, each pod loading the model once and working many shards.

Reported: model loads (from the completion records), pods, the round Job's run time (its
status.startTime to completionTime, as the Job controller records them: whole seconds) and
the lanes round ÷ the ideal — one load plus the engine's work (the simulated engine driven
bare in this process, every row at once, at full occupancy) divided over the lanes — target
<= 1.25; also the whole bij, apply to Succeeded (planning and the publish Jobs included).

    python bench/lanes_cluster.py [--shards 64] [--lanes 4] [--load-seconds 3] [--rows 6400]
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from typing import Any

import harness

sys.path.insert(0, str(harness.REPO / "tests"))

TARGET = 1.25


def job_seconds(batch: Any, ns: str, name: str) -> float:
    """A finished Job's run time as the Job controller recorded it (startTime to completionTime)."""
    st = batch.read_namespaced_job(name, ns).status
    return float((st.completion_time - st.start_time).total_seconds())


def operator_requests(audit_log: Any, since: float) -> dict[str, int]:
    """The operator's API requests since `since` (epoch seconds) from the API server's audit log,
    by "verb resource" (long-running watches counted as they end, if they do)."""
    import datetime as dt

    counts: dict[str, int] = {}
    for line in audit_log.read_text().splitlines():
        e = json.loads(line)
        user = (e.get("user") or {}).get("username", "")
        if not user.startswith("system:serviceaccount:bij-system:") or e.get("stage") != "ResponseComplete":
            continue
        at = dt.datetime.fromisoformat(e["requestReceivedTimestamp"].replace("Z", "+00:00")).timestamp()
        if at < since:
            continue
        ref = e.get("objectRef") or {}
        sub = f"/{ref['subresource']}" if ref.get("subresource") else ""
        key = f"{e.get('verb')} {ref.get('resource', '?')}{sub}"
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__, rows=6400, repeats=1)
    p.add_argument("--shards", type=int, default=64)
    p.add_argument("--lanes", type=int, default=4)
    p.add_argument("--load-seconds", type=float, default=3.0)
    p.add_argument("--step-seconds", type=float, default=0.02)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-words", type=int, default=32)
    args = harness.parse(p, argv)

    import kubernetes
    from cluster import build
    from cluster.harness import LocalCluster, add_worker_account, wait_for
    from simulated import bare_engine_seconds, mixed_rows

    from bij.contract import layout
    from bij.contract.spec import load_job
    from bij.control.jobs import render_job
    from bij.steps.planner import plan_round
    from bij.storage import open_storage

    report = harness.Report("lanes_cluster")
    work = harness.work_dir("lanes-cluster", args.keep)
    build()
    cluster = LocalCluster(work / "cluster")
    try:
        cluster.start()
        cluster.install_operator(values={"extraArgs": ["--status-interval", "0.5"]})
        core = kubernetes.client.CoreV1Api(cluster.api)
        batch = kubernetes.client.BatchV1Api(cluster.api)
        custom = kubernetes.client.CustomObjectsApi(cluster.api)
        ns = f"bench-{uuid.uuid4().hex[:6]}"
        core.create_namespace({"metadata": {"name": ns}})
        wait_for(lambda: core.read_namespaced_service_account("default", ns), 30, "the default service account")
        add_worker_account(cluster.api, ns)

        texts = mixed_rows(args.rows, args.max_words)
        input_path = work / "input" / "rows.jsonl"
        size = harness.write_rows(input_path, texts)
        model = {"engine": "simulated", "task": "generate", "maxTokens": args.max_words,
                 "simulated": {"maxNumSeqs": args.max_num_seqs, "stepSeconds": args.step_seconds,
                               "loadSeconds": args.load_seconds}}
        sharding = {"targetShardBytes": max(1024, -(-size // args.shards)), "minShardBytes": 1024,
                    "shardsPerLane": max(1, args.shards // args.lanes), "chunkRows": 64}
        env = {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}

        def doc(name: str) -> dict[str, Any]:
            return {"apiVersion": "batchinference.io/v1alpha1", "kind": "BatchInferenceJob",
                    "metadata": {"name": name, "namespace": ns},
                    "spec": {"input": {"uri": input_path.resolve().as_uri()},
                             "output": {"uri": (work / f"out-{name}").resolve().as_uri() + "/",
                                        "compression": "none"},
                             "model": model, "sharding": sharding,
                             "workers": {"parallelism": args.lanes, "env": env, "backoffLimitPerIndex": 0,
                                         "terminationGracePeriodSeconds": 10}}}

        def loads(name: str) -> tuple[int, float, int]:
            folder = (work / f"out-{name}").resolve().as_uri() + "/_bij/"
            store = open_storage(folder, None)  # file://: no S3 settings
            recs = [json.loads(store.read_bytes(o.uri)) for o in store.list(folder) if "/done/" in o.uri]
            return (sum(int(r.get("modelLoads") or 0) for r in recs),
                    sum(float(r.get("modelLoadSeconds") or 0) for r in recs), len(recs))

        # Before: one index per shard, by the Job controller alone.
        spec_path = work / "before.yaml"
        import yaml

        spec_path.write_text(yaml.safe_dump(doc("before")))
        job = load_job(spec_path)
        plan = plan_round(job, 0)
        uri = layout.round_manifest_uri(job, 0)
        store = open_storage(uri, job.spec.storage.s3)
        legacy = json.loads(store.read_bytes(uri))
        legacy.pop("lanes")
        store.write_bytes(uri, json.dumps(legacy).encode())
        body = render_job(job, 0, plan.shard_count, uri, image="local")
        batch.create_namespaced_job(ns, body)
        wait_for(lambda: any(c.type == "Complete" and c.status == "True"
                             for c in (batch.read_namespaced_job(body["metadata"]["name"], ns).status.conditions
                                       or [])) or None, 1800, "the one-index-per-shard Job to complete")
        before_round = job_seconds(batch, ns, body["metadata"]["name"])
        before_pods = len(core.list_namespaced_pod(ns, label_selector=f"batch.kubernetes.io/job-name="
                                                                        f"{body['metadata']['name']}").items)
        before_loads, before_load_s, before_done = loads("before")

        # Lanes: the operator's round Job.
        t0 = time.monotonic()
        t0_wall = time.time()
        custom.create_namespaced_custom_object("batchinference.io", "v1alpha1", ns, "batchinferencejobs",
                                               doc("lanes"))

        def succeeded() -> dict[str, Any] | None:
            st = custom.get_namespaced_custom_object("batchinference.io", "v1alpha1", ns, "batchinferencejobs",
                                                     "lanes").get("status") or {}
            if st.get("phase") == "Failed":
                raise RuntimeError(f"the bij failed: {st.get('message')}")
            return st if st.get("phase") == "Succeeded" else None

        status = wait_for(succeeded, 1800, "the bij to succeed")
        lanes_wall = time.monotonic() - t0
        lanes_round = job_seconds(batch, ns, "lanes-r0")
        lanes_pods = len(core.list_namespaced_pod(ns, label_selector="batch.kubernetes.io/job-name=lanes-r0").items)
        lanes_loads, lanes_load_s, lanes_done = loads("lanes")
        manifest = json.loads((work / "out-lanes" / "manifest.json").read_text())
        assert manifest["counts"]["rows"] == len(texts), manifest["counts"]

        # Apply to the round's Job: planning (a Job of its own, or in the operator before it had no storage).
        created = custom.get_namespaced_custom_object("batchinference.io", "v1alpha1", ns, "batchinferencejobs",
                                                      "lanes")["metadata"]["creationTimestamp"]
        import datetime as dt

        applied = dt.datetime.fromisoformat(created.replace("Z", "+00:00"))
        to_round = (batch.read_namespaced_job("lanes-r0", ns).metadata.creation_timestamp - applied).total_seconds()
        print(f"  apply to the round Job's creation (planning): {to_round:.0f} s", flush=True)
        report.note(f"apply to round Job created: {to_round:.0f} s")
        requests = operator_requests(cluster.plane.audit_log, t0_wall)
        print(f"  the operator's API requests for the lanes bij (apply to Succeeded): {sum(requests.values())}: "
              + ", ".join(f"{k} {v}" for k, v in requests.items()), flush=True)
        report.note(f"operator API requests, apply to Succeeded: {sum(requests.values())} {requests}")
        # The storage steps (planning, the round's statistics, the publish plan, the manifest) run as Jobs of
        # their own in the bij's namespace: what each adds, as the Job controller timed it.
        names = ("plan-r0", "finish-r0", "publish-plan", "manifest")
        # The bij may succeed on the manifest's report a moment before its Job is marked complete.
        wait_for(lambda: all(batch.read_namespaced_job(f"lanes-{n}", ns).status.completion_time for n in names),
                 120, "the step Jobs complete")
        steps = {name: job_seconds(batch, ns, f"lanes-{name}") for name in names}
        print("  storage step Jobs (start to completion, whole seconds): "
              + ", ".join(f"{k} {v:.0f} s" for k, v in steps.items()), flush=True)
        report.note(f"step Jobs: {steps}")
        engine_s = bare_engine_seconds(texts, args.max_num_seqs, args.step_seconds, args.max_words)
        ideal = args.load_seconds + engine_s / args.lanes
        print(f"lanes_cluster: {len(texts)} rows in {plan.shard_count} shards, {args.lanes} lanes, "
              f"loadSeconds {args.load_seconds}: bare engine {engine_s:.1f} s, ideal {ideal:.1f} s", flush=True)
        print(f"  before (one pod per shard): {before_pods} pods, {before_loads} model loads "
              f"({before_load_s:.1f} s), {before_done} shards, round Job {before_round:.0f} s", flush=True)
        print(f"  lanes (operator, {status['lanesSummary']} lanes): {lanes_pods} pods, {lanes_loads} model loads "
              f"({lanes_load_s:.1f} s), {lanes_done} shards, round Job {lanes_round:.0f} s, whole bij "
              f"{lanes_wall:.1f} s (apply to Succeeded, publish Jobs included)", flush=True)
        report.ratio("lanes round / ideal (one load + work over the lanes)", lanes_round / ideal, TARGET,
                     higher_is_better=False)
        report.ratio("lanes round / before round", lanes_round / before_round, None, higher_is_better=False)
        report.ratio("lanes whole bij / ideal", lanes_wall / ideal, None, higher_is_better=False)
        report.ratio("model loads, lanes / lanes", lanes_loads / args.lanes, 1.0, higher_is_better=False)
        report.note(f"before: {before_pods} pods, {before_loads} loads, round {before_round:.0f} s; lanes: "
                    f"{lanes_pods} pods, {lanes_loads} loads, round {lanes_round:.0f} s, bij {lanes_wall:.1f} s; "
                    f"ideal {ideal:.1f} s; shards {plan.shard_count}")
        report.write(args.out)
    finally:
        cluster.stop()
        harness.cleanup(work, args.keep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
