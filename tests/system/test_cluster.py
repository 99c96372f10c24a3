"""bij on a real control plane: etcd, kube-apiserver, kube-controller-manager and kube-scheduler
built from Kubernetes' own modules (tests/cluster), the operator installed from charts/bij-operator
with real Helm and running as a pod under the chart's ServiceAccount and RBAC, worker pods run by
the process kubelet as local processes. Jobs, pods, garbage collection, evictions and scheduling
are the real controllers' doing.

Each test works in a namespace of its own; the cluster and the operator are shared by the module.
Worker pods get test hooks through `spec.workers.env` (tests/cluster/podhooks): a file holds a
shard at its n-th batch or makes its first pods exit with a code, so states are driven, not raced.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml
from cluster import build_or_skip
from cluster.harness import (
    OPERATOR_NAMESPACE,
    WORKER_RULES,
    LocalCluster,
    add_worker_account,
    remove_worker_account,
    wait_for,
)
from kubernetes.client import ApiException

from bij.control.observe import parse_ranges

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
HOOKS = ROOT / "tests" / "cluster" / "podhooks"
GROUP, VERSION, PLURAL = "batchinference.io", "v1alpha1", "batchinferencejobs"
ROWS = 120


# One cluster for this module, stopped when it ends so the rest of the suite runs without it.
@pytest.fixture(scope="module")
def local_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    build_or_skip()
    state = tmp_path_factory.mktemp("cluster")
    cluster = LocalCluster(state)
    try:
        cluster.start()
        # Status writes every 0.3 s instead of 5 s, so tests see progress without waiting.
        cluster.install_operator(values={"extraArgs": ["--status-interval", "0.3"]})
        yield cluster
    finally:
        cluster.stop()


@dataclass
class Env:
    """One test's namespace on the shared cluster, with its files and API clients."""

    cluster: LocalCluster
    ns: str
    tmp: Path
    gates: Path
    # The operator's log must show no RBAC refusal while this test runs.
    check_forbidden: bool = True

    @property
    def api(self) -> kubernetes.client.ApiClient:
        assert self.cluster.api is not None
        return self.cluster.api

    @property
    def core(self) -> kubernetes.client.CoreV1Api:
        return kubernetes.client.CoreV1Api(self.api)

    @property
    def batch(self) -> kubernetes.client.BatchV1Api:
        return kubernetes.client.BatchV1Api(self.api)

    @property
    def custom(self) -> kubernetes.client.CustomObjectsApi:
        return kubernetes.client.CustomObjectsApi(self.api)

    def doc(self, name: str, **spec: Any) -> dict[str, Any]:
        """A small echo job over this test's input, with the pod hooks switched on."""
        pythonpath = os.pathsep.join(p for p in (str(HOOKS), os.environ.get("PYTHONPATH", "")) if p)
        body: dict[str, Any] = {
            "input": {"uri": f"file://{self.tmp}/in"},
            "output": {"uri": f"file://{self.tmp}/out-{name}", "compression": "none"},
            "model": {"engine": "echo", "task": "generate"},
            "sharding": {"targetShardBytes": 1024, "chunkRows": 8},
            "workers": {"parallelism": 2, "backoffLimitPerIndex": 1, "terminationGracePeriodSeconds": 10,
                        "env": {"PYTHONPATH": pythonpath, "BIJ_TEST_GATES": str(self.gates)}},
        }
        for key, value in spec.items():
            if isinstance(value, dict) and isinstance(body.get(key), dict):
                body[key] = {**body[key], **value}
            else:
                body[key] = value
        return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "BatchInferenceJob", "metadata": {"name": name},
                "spec": body}

    def create(self, doc: dict[str, Any]) -> dict[str, Any]:
        return dict(self.custom.create_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, doc))

    def bij(self, name: str) -> dict[str, Any]:
        return dict(self.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name))

    def status(self, name: str) -> dict[str, Any]:
        return dict(self.bij(name).get("status") or {})

    def wait_phase(self, name: str, phase: str, timeout: float = 120) -> dict[str, Any]:
        def reached() -> dict[str, Any] | None:
            st = self.status(name)
            if st.get("phase") == phase:
                return st
            if st.get("phase") in ("Succeeded", "Failed") and phase not in ("Succeeded", "Failed"):
                raise AssertionError(f"{name} ended {st.get('phase')} while waiting for {phase}: {st.get('message')}")
            return None

        try:
            return wait_for(reached, timeout, f"bij {name} phase {phase}")
        except (TimeoutError, AssertionError):
            print(json.dumps(self.status(name), indent=1)[-4000:])
            raise

    def jobs(self) -> list[dict[str, Any]]:
        return [self.api.sanitize_for_serialization(j) for j in self.batch.list_namespaced_job(self.ns).items]

    def foreign_job(self, name: str) -> None:
        """Someone else's (suspended) Job, named as a round Job would be."""
        container = {"name": "x", "image": "busybox", "command": ["true"]}
        self.batch.create_namespaced_job(self.ns, {"metadata": {"name": name}, "spec": {
            "suspend": True, "template": {"spec": {"restartPolicy": "Never", "containers": [container]}}}})

    def round_jobs(self) -> list[str]:
        """The names of the round Jobs (not the publish passes or the storage steps), sorted."""
        return sorted(j["metadata"]["name"] for j in self.jobs()
                      if "batchinference.io/round" in (j["metadata"].get("labels") or {}))

    def jobs_named(self, name: str) -> list[dict[str, Any]]:
        return [j for j in self.jobs() if j["metadata"]["name"] == name]

    def job(self, name: str) -> dict[str, Any]:
        return dict(self.api.sanitize_for_serialization(self.batch.read_namespaced_job(name, self.ns)))

    def pods(self, job: str | None = None) -> list[dict[str, Any]]:
        sel = f"batch.kubernetes.io/job-name={job}" if job else None
        return [self.api.sanitize_for_serialization(p)
                for p in self.core.list_namespaced_pod(self.ns, label_selector=sel).items]

    def running_pod(self, job: str, index: int) -> dict[str, Any] | None:
        for p in self.pods(job):
            ann = p["metadata"].get("annotations") or {}
            if (ann.get("batch.kubernetes.io/job-completion-index") == str(index)
                    and p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")):
                return p
        return None

    def describe(self, name: str, job: str) -> str:
        """The bij's status, its round Job's status, each pod's state and what the pods printed: for a
        test that timed out waiting on them."""
        lines = [f"status: {json.dumps(self.status(name))}", f"job: {json.dumps(self.job(job).get('status'))}"]
        for p in self.pods(job):
            lines.append(f"pod {p['metadata']['name']}: {p['status'].get('phase')} "
                         f"{json.dumps(p['status'].get('containerStatuses'), default=str)}")
        lines.append(self.cluster.pod_logs(self.ns, job)[-20000:])
        return "\n".join(lines)

    def events(self, name: str) -> list[dict[str, Any]]:
        evs = self.core.list_namespaced_event(self.ns, field_selector=f"involvedObject.name={name}").items
        return [self.api.sanitize_for_serialization(e) for e in evs]

    def reasons(self, name: str) -> list[str]:
        return [e["reason"] for e in sorted(self.events(name), key=lambda e: e.get("firstTimestamp") or "")]

    def gate(self, kind: str, job: str, index: int, value: str) -> Path:
        path = self.gates / f"{kind}-{job}-{index}"
        path.write_text(value)
        return path

    def computed(self, job: str) -> list[str]:
        """Every row text the engine computed for `job`'s shards, recomputations included."""
        return [line for p in sorted(self.gates.glob(f"computed-{job}-*")) for line in p.read_text().splitlines()]

    def kubectl(self, *args: str) -> str:
        return self.cluster.kubectl("-n", self.ns, *args).stdout


def write_rows(folder: Path, n: int) -> list[Any]:
    folder.mkdir(parents=True, exist_ok=True)
    ids: list[Any] = [i if i % 3 else f"row-{i}" for i in range(n)]
    with open(folder / "rows.jsonl", "w") as f:
        for i, rid in enumerate(ids):
            f.write(json.dumps({"id": rid, "text": f"row {i}: " + "lorem ipsum " * 3}) + "\n")
    return ids


def published(manifest: Path) -> list[dict[str, Any]]:
    doc = json.loads(manifest.read_text())
    rows: list[dict[str, Any]] = []
    for f in doc["files"]:
        with open(manifest.parent / f["path"]) as fh:
            rows.extend(json.loads(line) for line in fh if line.strip())
    return rows


def assert_every_row_once(manifest: Path, ids: list[Any]) -> None:
    rows = published(manifest)
    got = [json.dumps(r["id"]) for r in rows]
    assert sorted(got) == sorted(json.dumps(i) for i in ids)
    assert all(r["output"].startswith("row ") for r in rows)


def hold_row(env: Env, job: str) -> None:
    """Row 0's shard waits at its engine call until the gate is removed, whichever lane works it."""
    (env.gates / f"holdrow-{job}").write_text("row 0:")


def all_but_one_shard_done(env: Env, name: str) -> bool:
    shards = env.status(name).get("shards") or {}
    return bool(shards.get("total")) and shards["done"] == shards["total"] - 1


def operator_log(cluster: LocalCluster) -> str:
    return cluster.pod_logs(OPERATOR_NAMESPACE, "bij-")


@pytest.fixture()
def env(local_cluster: LocalCluster, tmp_path: Path) -> Iterator[Env]:
    ns = f"t-{uuid.uuid4().hex[:8]}"
    core = kubernetes.client.CoreV1Api(local_cluster.api)
    core.create_namespace({"metadata": {"name": ns}})
    # A bij's pods run as bij-worker; with watch.allNamespaces the chart creates it (and its Role) only where told.
    wait_for(lambda: core.read_namespaced_service_account("default", ns), 30, "the namespace's default SA")
    add_worker_account(local_cluster.api, ns)
    gates = tmp_path / "gates"
    gates.mkdir()
    log_before = len(operator_log(local_cluster))
    e = Env(local_cluster, ns, tmp_path, gates)
    yield e
    new_log = operator_log(local_cluster)[log_before:]
    for gate in gates.glob("hold*"):
        gate.unlink()
    try:
        core.delete_namespace(ns)
    except ApiException:
        pass
    # RBAC is what the API server enforces: the operator must never be refused anything.
    forbidden = [line for line in new_log.splitlines() if "403" in line and "Forbidden" in line and " cannot " in line]
    assert not (e.check_forbidden and forbidden), "the operator met a 403:\n" + "\n".join(forbidden[:5])


def job_ids(env: Env, n: int = ROWS) -> list[Any]:
    return write_rows(env.tmp / "in", n)


# --- the chart, the CRD and admission -------------------------------------------------------------


def test_the_chart_installs_and_the_operator_runs_as_a_pod_under_its_service_account(
        local_cluster: LocalCluster) -> None:
    ext = kubernetes.client.ApiextensionsV1Api(local_cluster.api)
    crd = ext.read_custom_resource_definition("batchinferencejobs.batchinference.io")
    conditions = {c.type: c.status for c in crd.status.conditions}
    assert conditions["Established"] == "True" and conditions["NamesAccepted"] == "True"
    pod = local_cluster.operator_pod()
    sa = pod["spec"]["serviceAccountName"]
    kubernetes.client.CoreV1Api(local_cluster.api).read_namespaced_service_account(sa, OPERATOR_NAMESPACE)
    assert pod["spec"]["nodeName"] == "ondemand-cpu-0"  # spot GPU nodes are tainted
    owner = pod["metadata"]["ownerReferences"][0]
    assert owner["kind"] == "ReplicaSet"  # the real Deployment and ReplicaSet controllers made it
    # The endpoint the chart's liveness probe calls (pods share the host's network here); kopf
    # serves it once it has started, a moment after the pod is Running.
    def healthz() -> dict[str, Any] | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{local_cluster.liveness_port}/healthz", timeout=5) as r:
                return dict(json.loads(r.read())) if r.status == 200 else None
        except OSError:
            return None

    assert "trackedJobs" in wait_for(healthz, 60, "the liveness endpoint")
    nodes = local_cluster.kubectl("get", "nodes", "-o", "name").stdout.split()
    assert sorted(nodes) == ["node/gke-spot-gpu-0", "node/karpenter-spot-gpu-0", "node/ondemand-cpu-0"]


def test_every_example_is_accepted_by_the_real_api_server(env: Env) -> None:
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc.get("kind") != "BatchInferenceJob":
                continue
            doc["spec"]["input"]["uri"] = f"file://{env.tmp}/in/"
            doc["spec"]["output"]["uri"] = f"file://{env.tmp}/out/{path.stem}/"
            doc["metadata"].pop("namespace", None)
            stored = env.custom.create_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, doc, dry_run="All",
                                                                field_validation="Strict")
            assert stored["spec"]["workers"]["parallelism"] >= 1, path.name  # defaulted by the server


def _server_verdict(env: Env, doc: dict[str, Any]) -> str | None:
    try:
        env.custom.create_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, doc, dry_run="All",
                                                   field_validation="Strict")
    except ApiException as e:
        return str(json.loads(e.body).get("message"))
    return None


def test_every_bad_spec_is_refused_by_the_real_api_server_as_bij_validate_says(env: Env) -> None:
    from crd_cases import BAD

    from bij.cli import validate

    mismatches = []
    for case, doc, expected in BAD:
        server = _server_verdict(env, json.loads(json.dumps(doc)))
        ours = validate.validate_document(doc)
        if server is None:
            mismatches.append(f"{case}: the API server accepted it; bij validate says {ours}")
            continue
        if expected not in server:
            mismatches.append(f"{case}: the table expects {expected!r}; the API server says {server!r}")
        for problem in ours:
            if problem == validate.RULES_SKIPPED or problem.endswith("the BatchInferenceJob model does not)"):
                continue
            field = problem.split(": ", 1)[0]
            if field not in server:
                mismatches.append(f"{case}: bij validate names {field!r}, the API server does not: {server!r}")
    assert not mismatches, "\n".join(mismatches)


# --- a job, start to finish -----------------------------------------------------------------------


def test_a_job_runs_to_succeeded_through_the_operator_pod(env: Env) -> None:
    ids = job_ids(env)
    hold_row(env, "emb-r0")  # the shard of row 0 waits, whichever lane works it: the running state can be seen
    env.create(env.doc("emb"))
    running = wait_for(lambda: (lambda s: s if s.get("phase") == "Running" and s.get("shards", {}).get("total")
                                and s["shards"]["done"] == s["shards"]["total"] - 1 else None)(env.status("emb")),
                       120, "every shard but the held one done")
    total = running["shards"]["total"]
    assert total >= 3
    line = env.kubectl("get", "bij", "emb", "--no-headers").split()
    assert line[:4] == ["emb", "Running", "0", f"{total - 1}/{total}"]
    assert 0 < int(line[4]) < ROWS
    # The round was planned by a Job of its own in the bij's namespace, then its one round Job made.
    assert sorted(j["metadata"]["name"] for j in env.jobs()) == ["emb-plan-r0", "emb-r0"]
    job = env.job("emb-r0")
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["metadata"]["ownerReferences"][0]["name"] == "emb"
    plan = env.job("emb-plan-r0")
    assert plan["spec"]["template"]["spec"]["serviceAccountName"] == "bij-worker"
    assert plan["spec"]["template"]["spec"]["containers"][0]["args"][:2] == ["step", "plan"]

    (env.gates / "holdrow-emb-r0").unlink()
    done = env.wait_phase("emb", "Succeeded")
    line = env.kubectl("get", "bij", "emb", "--no-headers").split()
    assert line[:5] == ["emb", "Succeeded", "0", f"{total}/{total}", str(ROWS)]
    wide = env.kubectl("get", "bij", "emb", "-o", "wide", "--no-headers")
    assert f"file://{env.tmp}/out-emb" in wide
    assert done["manifestUri"] == f"file://{env.tmp}/out-emb/manifest.json"
    assert_every_row_once(env.tmp / "out-emb" / "manifest.json", ids)
    wait_for(lambda: "Published" in env.reasons("emb"), 30, "the Published event")
    described = env.kubectl("describe", "bij", "emb")
    for reason in ("RoundStarted", "RoundFinished", "Published"):
        assert reason in described
    # The Job controller itself said the round is complete.
    assert any(c["type"] == "Complete" and c["status"] == "True" for c in env.job("emb-r0")["status"]["conditions"])
    # Publishing ran as one Job per pass, its pods reading and writing the rows; its plan, the round's
    # statistics and the manifest were steps of their own: the operator read and wrote no storage.
    # A step's report is taken as it lands: its Job may complete a moment after the bij moved on.
    for step in ("emb-finish-r0", "emb-publish-plan", "emb-manifest"):
        wait_for(lambda step=step: any(c["type"] == "Complete" and c["status"] == "True"
                                       for c in env.job(step)["status"].get("conditions") or []) or None,
                 30, f"step Job {step} Complete")
    for pass_name in ("ids", "dedupe", "write"):
        publish_job = env.job(f"emb-publish-{pass_name}")
        assert any(c["type"] == "Complete" and c["status"] == "True" for c in publish_job["status"]["conditions"])
        pods = env.pods(f"emb-publish-{pass_name}")
        assert pods and all(p["spec"]["containers"][0]["args"][:2] == ["publish", "--plan"] for p in pods)
    assert "PublishPassStarted" in env.reasons("emb")


def test_many_shards_run_in_lanes_with_one_model_load_per_lane_pod(env: Env) -> None:
    ids = job_ids(env, 1000)
    model = {"engine": "simulated", "task": "generate", "maxTokens": 4,
             "simulated": {"maxNumSeqs": 64, "stepSeconds": 0.0, "loadSeconds": 0.3}}
    env.create(env.doc("lanes", model=model, sharding={"targetShardBytes": 1024, "chunkRows": 16},
                       workers={"parallelism": 4}))
    done = env.wait_phase("lanes", "Succeeded", timeout=180)
    (round0,) = done["rounds"]
    assert round0["shards"] >= 64 and round0["lanes"] == 4
    assert done["shards"] == {"done": round0["shards"], "total": round0["shards"]}
    assert done["lanes"]["done"] == done["lanes"]["total"] == 4
    job = env.job("lanes-r0")
    assert job["spec"]["completions"] == 4 and job["spec"]["parallelism"] == 4
    assert len(env.pods("lanes-r0")) == 4  # one pod per lane, none per shard
    manifest = json.loads((env.tmp / "out-lanes" / "manifest.json").read_text())
    assert manifest["efficiency"]["modelLoads"] == 4  # not one per shard
    published_ids = [r["id"] for r in published(env.tmp / "out-lanes" / "manifest.json")]
    assert sorted(map(json.dumps, published_ids)) == sorted(map(json.dumps, ids))
    wide = env.kubectl("get", "bij", "lanes", "-o", "wide", "--no-headers").split()
    assert "4/4" in wide
    # Each lane's pod reported into a Lease of its own, owned by the round's Job; the bij holds totals only.
    assert "lanes" not in (done.get("reports") or {})
    leases = json.loads(env.kubectl("get", "leases", "-l", "batchinference.io/job=lanes,batchinference.io/round=0",
                                    "-o", "json"))["items"]
    assert sorted(lease["metadata"]["name"] for lease in leases) == sorted(p["metadata"]["name"]
                                                                           for p in env.pods("lanes-r0"))
    assert all(lease["metadata"]["ownerReferences"][0]["name"] == "lanes-r0" for lease in leases)
    reports = [json.loads(lease["metadata"]["annotations"]["batchinference.io/lane-report"]) for lease in leases]
    assert sum(r["rows"] + r["errors"] for r in reports) == 1000  # every row once, in its lane's last report
    assert sum(r["shardsDone"] for r in reports) == round0["shards"]


# --- spot: preemption is not a failure ------------------------------------------------------------


# One shard of every row, in 8-row chunks and 8-row batches: a hold at batch n leaves n batches done.
SMALL_STEPS = {"sharding": {"targetShardBytes": 1 << 20, "chunkRows": 8}, "batching": {"maxBatchSize": 8}}


def _gone_or_terminal(env: Env, pod: dict[str, Any]) -> bool:
    try:
        p = env.core.read_namespaced_pod(pod["metadata"]["name"], env.ns)
    except ApiException as e:
        return e.status == 404
    return p.status.phase in ("Succeeded", "Failed")


def _hold_then_wait_running(env: Env, name: str, index: int, after: int) -> dict[str, Any]:
    return wait_for(lambda: env.running_pod(f"{name}-r0", index) if len(
        (env.gates / f"computed-{name}-r0-{index}").read_text().splitlines()
        if (env.gates / f"computed-{name}-r0-{index}").exists() else []) >= after else None,
        120, f"{name} shard {index} running with {after} rows computed")


def test_an_evicted_worker_pod_is_not_a_failure_and_its_shard_resumes(env: Env) -> None:
    ids = job_ids(env)
    # One shard of all rows in 8-row chunks and batches: held at its third batch, so two are done.
    env.gate("hold", "evict-r0", 0, "2")
    env.create(env.doc("evict", **SMALL_STEPS))
    pod = _hold_then_wait_running(env, "evict", 0, after=16)
    body = kubernetes.client.V1Eviction(metadata=kubernetes.client.V1ObjectMeta(name=pod["metadata"]["name"],
                                                                                 namespace=env.ns))
    env.core.create_namespaced_pod_eviction(pod["metadata"]["name"], env.ns, body)
    # Still held, the pod drains and exits on SIGTERM; only then may the rows go on.
    wait_for(lambda: _gone_or_terminal(env, pod), 60, "the evicted pod to stop")
    (env.gates / "hold-evict-r0-0").unlink()
    done = env.wait_phase("evict", "Succeeded")
    assert done["rows"]["done"] == ROWS
    job = env.job("evict-r0")
    assert job["status"].get("failed", 0) == 0  # DisruptionTarget: Ignore, not counted
    assert sorted(j["metadata"]["name"] for j in env.jobs()) == [
        "evict-finish-r0", "evict-manifest", "evict-plan-r0", "evict-publish-dedupe", "evict-publish-ids",
        "evict-publish-plan", "evict-publish-write", "evict-r0"]
    started = (env.gates / "started-evict-r0-0").read_text().splitlines()
    assert len(started) == 2  # the evicted pod and its replacement
    assert_every_row_once(env.tmp / "out-evict" / "manifest.json", ids)
    computed = env.computed("evict-r0")
    assert len(computed) - ROWS <= 2 * 8, "the eviction cost more than the chunk in flight"


@pytest.mark.slow
def test_a_node_deleted_under_running_pods_costs_only_its_chunks(env: Env) -> None:
    ids = job_ids(env)
    spec = {**SMALL_STEPS, "workers": {
        **env.doc("x")["spec"]["workers"], "gpus": 1, "spot": True, "spotProvider": "gke", "parallelism": 1}}
    env.gate("hold", "node-r0", 0, "2")
    env.create(env.doc("node", **spec))
    pod = _hold_then_wait_running(env, "node", 0, after=16)
    assert pod["spec"]["nodeName"] == "gke-spot-gpu-0"
    assert env.cluster.kubelet is not None
    env.cluster.kubelet.kill_node("gke-spot-gpu-0")
    env.core.delete_node("gke-spot-gpu-0")
    (env.gates / "hold-node-r0-0").unlink()

    def collected() -> bool:
        # The pod garbage collector fails a pod whose node is gone (DisruptionTarget), after a
        # 40 s quarantine, and deletes it.
        try:
            p = env.core.read_namespaced_pod(pod["metadata"]["name"], env.ns)
        except ApiException as e:
            return e.status == 404
        return any(c.type == "DisruptionTarget" for c in p.status.conditions or [])

    try:
        wait_for(collected, 180, "the pod garbage collector to fail the orphaned pod")
    finally:
        # The node comes back (a new spot VM of the same pool); the replacement pod lands there.
        env.cluster.kubelet.revive_node("gke-spot-gpu-0")
    done = env.wait_phase("node", "Succeeded", timeout=180)
    assert env.job("node-r0")["status"].get("failed", 0) == 0
    assert done["rows"]["done"] == ROWS
    assert_every_row_once(env.tmp / "out-node" / "manifest.json", ids)
    assert len(env.computed("node-r0")) - ROWS <= 2 * 8


# --- failures -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_exit_42_fails_the_job_through_its_pod_failure_policy_and_the_bij_says_why(env: Env) -> None:
    job_ids(env)
    env.gate("exit", "cfg-r0", 1, "42 1")
    env.create(env.doc("cfg"))
    failed = env.wait_phase("cfg", "Failed")
    # The bij fails on the Job's FailureTarget; the Job's own Failed condition follows once its
    # other pods have terminated.
    cond = wait_for(lambda: {c["type"]: c for c in env.job("cfg-r0")["status"].get("conditions") or []
                             if c["type"] == "Failed"} or None, 60, "the Job's Failed condition")
    assert cond["Failed"]["reason"] == "PodFailurePolicy"
    bij_failed = {c["type"]: c for c in failed["conditions"]}["Failed"]
    assert bij_failed["status"] == "True" and bij_failed["reason"] == "PodFailurePolicy"
    assert "lane 1" in bij_failed["message"]
    assert len((env.gates / "started-cfg-r0-1").read_text().splitlines()) == 1  # no retry can help
    assert not (env.tmp / "out-cfg" / "manifest.json").exists()


def test_a_canary_whose_rows_all_fail_ends_the_bij_canary_failed_before_the_round_job(env: Env) -> None:
    job_ids(env)
    env.create(env.doc("cny", prompt={"template": "Summarise {{ row.title }}"},
                       canary={"rows": 10, "maxErrorShare": 0.1}))
    st = env.wait_phase("cny", "CanaryFailed")
    assert env.round_jobs() == ["cny-r0-canary"]  # round 0's own Job was never made
    canary = {c["type"]: c for c in st["conditions"]}["Canary"]
    assert canary["status"] == "False" and canary["reason"] == "CanaryFailed"
    assert "above spec.canary.maxErrorShare 10.0%" in st["message"] and "template_error" in st["message"]
    assert st["canary"]["verdict"] == "Failed" and st["canary"]["examples"]
    wait_for(lambda: "CanaryFailed" in env.reasons("cny") or None, 30, "the CanaryFailed event")
    assert not (env.tmp / "out-cny" / "manifest.json").exists()


def test_a_canary_that_passes_shows_its_estimate_and_its_rows_are_published_once(env: Env) -> None:
    ids = job_ids(env)
    env.create(env.doc("cnp", canary={"rows": 10, "maxErrorShare": 0.1},
                       workers={"pricePerHour": 2.0}))
    done = env.wait_phase("cnp", "Succeeded")
    assert env.round_jobs() == ["cnp-r0", "cnp-r0-canary"]
    assert done["canary"]["verdict"] == "Passed" and done["canary"]["estimate"]["rows"] > 0
    assert "cost" in done["canary"]["estimate"]
    assert {c["type"]: c for c in done["conditions"]}["Canary"]["status"] == "True"
    # Events carry times to the second: the round's start is not before the canary's verdict.
    first = {}
    for e in env.events("cnp"):
        first.setdefault(e["reason"], e.get("firstTimestamp") or e.get("eventTime"))
    assert first["CanaryStarted"] <= first["CanaryPassed"] <= first["RoundStarted"], first
    assert_every_row_once(env.tmp / "out-cnp" / "manifest.json", ids)


def test_a_lane_that_uses_up_its_retries_costs_nothing_when_the_others_finish_its_shards(env: Env) -> None:
    ids = job_ids(env)
    env.gate("exit", "flaky-r0", 0, "1 5")
    env.gate("exit", "flaky-r0", 2, "1 1")  # fails once, then succeeds on its retry
    env.create(env.doc("flaky", workers={"parallelism": 3}))
    done = env.wait_phase("flaky", "Succeeded", timeout=180)
    job = env.job("flaky-r0")
    # The Job controller failed lane 0 for good (backoffLimitPerIndex 1: two starts) ...
    assert parse_ranges(job["status"]["failedIndexes"]) == {0}
    assert parse_ranges(job["status"]["completedIndexes"]) == {1, 2}
    assert any(c["type"] == "Failed" and c["status"] == "True" for c in job["status"]["conditions"])
    assert len((env.gates / "started-flaky-r0-0").read_text().splitlines()) == 2
    assert len((env.gates / "started-flaky-r0-2").read_text().splitlines()) == 2
    # ... and lanes 1 and 2 worked every shard, so the round was whole and published.
    assert done["shards"]["done"] == done["shards"]["total"] >= 3
    assert_every_row_once(env.tmp / "out-flaky" / "manifest.json", ids)
    assert "lane 0 failed, the other lanes finished their shards" in env.kubectl("describe", "bij", "flaky")


def test_lanes_that_all_use_up_their_retries_fail_the_bij_naming_them(env: Env) -> None:
    job_ids(env)
    env.gate("exit", "down-r0", 0, "1 5")
    env.gate("exit", "down-r0", 1, "1 5")
    env.create(env.doc("down"))
    failed = env.wait_phase("down", "Failed", timeout=180)
    assert parse_ranges(env.job("down-r0")["status"]["failedIndexes"]) == {0, 1}
    cond = {c["type"]: c for c in failed["conditions"]}["Failed"]
    total = failed["shards"]["total"]
    assert cond["reason"] == "FailedIndexes"
    assert f"lanes 0-1 failed with {total} of {total} shards undone" in cond["message"]


def test_a_damaged_input_object_fails_the_bij_naming_the_object_and_where_it_breaks(env: Env) -> None:
    import zstandard

    job_ids(env)
    rows = b"".join(json.dumps({"id": f"z{i}", "text": f"zst row {i} " + "q" * (i % 40)}).encode() + b"\n"
                    for i in range(12000))
    whole = zstandard.ZstdCompressor(level=1).compress(rows)
    (env.tmp / "in" / "cut.jsonl.zst").write_bytes(whole[: len(whole) * 2 // 3])  # an upload that died
    env.create(env.doc("cut"))
    failed = env.wait_phase("cut", "Failed", timeout=180)
    cond = {c["type"]: c for c in failed["conditions"]}["Failed"]
    assert cond["reason"] == "DamagedInput", cond
    assert "cut.jsonl.zst is damaged after uncompressed byte" in cond["message"]
    assert "cut.jsonl.zst is damaged" in env.kubectl("get", "bij", "cut", "-o", "jsonpath={.status.message}")
    assert "DamagedInput" in env.kubectl("describe", "bij", "cut")
    assert not (env.tmp / "out-cut" / "manifest.json").exists()


# --- the operator itself ----------------------------------------------------------------------------


def test_the_operator_pod_deleted_mid_round_is_replaced_and_finishes_with_one_job(env: Env) -> None:
    ids = job_ids(env)
    hold_row(env, "opk-r0")
    env.create(env.doc("opk"))
    wait_for(lambda: all_but_one_shard_done(env, "opk"), 120, "every shard but the held one done")
    old = env.cluster.operator_pod()
    env.core.delete_namespaced_pod(old["metadata"]["name"], OPERATOR_NAMESPACE)
    new = env.cluster.operator_pod(timeout=120, not_uid=old["metadata"]["uid"])
    assert new["metadata"]["name"] != old["metadata"]["name"]
    (env.gates / "holdrow-opk-r0").unlink()
    env.wait_phase("opk", "Succeeded")
    assert env.round_jobs() == ["opk-r0"]
    assert_every_row_once(env.tmp / "out-opk" / "manifest.json", ids)


def test_judge_rounds_run_one_job_per_round(env: Env) -> None:
    job_ids(env)
    judge = {"type": "regex", "pattern": r"^row \d*[02468]:", "strategy": "rounds", "maxRounds": 2}
    env.create(env.doc("judged", model={"engine": "echo", "task": "generate"}, judge=judge))
    done = env.wait_phase("judged", "Succeeded", timeout=180)
    assert env.round_jobs() == ["judged-r0", "judged-r1"]
    r0, r1 = done["rounds"]
    assert (r0["rowsIn"], r0["approved"], r0["rejected"]) == (ROWS, ROWS // 2, ROWS // 2)
    assert (r1["rowsIn"], r1["capped"]) == (ROWS // 2, ROWS // 2)


def test_spot_pods_land_only_on_the_providers_spot_nodes_and_gpu_requests_fit(env: Env) -> None:
    job_ids(env)
    workers = {**env.doc("x")["spec"]["workers"], "gpus": 1, "spot": True, "spotProvider": "gke", "parallelism": 4}
    for lane in range(4):  # every lane holds at its first batch: whichever two get the GPUs keep them
        env.gate("hold", "spot-r0", lane, "0")
    env.create(env.doc("spot", workers=workers))
    wait_for(lambda: sum(1 for lane in range(4) if env.running_pod("spot-r0", lane)) == 2 or None, 120,
             "two spot pods running")
    pods = [p for p in env.pods("spot-r0") if p["status"].get("phase") in ("Pending", "Running")]
    placed = [p for p in pods if p["spec"].get("nodeName")]
    assert {p["spec"]["nodeName"] for p in placed} == {"gke-spot-gpu-0"}
    # The node has 2 GPUs: with both held pods on it, the scheduler keeps the other two pending.
    pending = wait_for(lambda: [p for p in env.pods("spot-r0") if p["status"].get("phase") == "Pending"
                                and any(c.get("reason") == "Unschedulable"
                                        for c in p["status"].get("conditions") or [])] or None,
                       60, "pods the scheduler could not place")
    message = next(c["message"] for c in pending[0]["status"]["conditions"] if c.get("reason") == "Unschedulable")
    assert "nvidia.com/gpu" in message
    for lane in range(4):
        (env.gates / f"hold-spot-r0-{lane}").unlink()
    env.wait_phase("spot", "Succeeded", timeout=180)
    nodes = {p["spec"]["nodeName"] for p in env.pods("spot-r0")}
    assert nodes == {"gke-spot-gpu-0"}


def test_a_pool_with_no_schedulable_node_gives_its_lanes_to_the_next_and_every_row_runs_once(env: Env) -> None:
    ids = job_ids(env)
    pools = [
        # The preferred pool: no node has its label, so its pods stay Pending (Unschedulable).
        {"name": "spot", "nodeSelector": {"bij.test/pool": "absent"}, "startTimeoutSeconds": 5, "pricePerHour": 1.0},
        {"name": "cpu", "nodeSelector": {"node.kubernetes.io/instance-type": "cpu-16"}, "pricePerHour": 3.0},
    ]
    env.create(env.doc("pools", workers={"parallelism": 2, "pools": pools}))
    env.wait_phase("pools", "Succeeded", timeout=240)
    assert_every_row_once(env.tmp / "out-pools" / "manifest.json", ids)
    # Each row was computed once, by the lanes that moved to the cpu pool: the spot pool's pods never ran.
    computed = [line for p in sorted(env.gates.glob("computed-pools-r0-*")) for line in p.read_text().splitlines()]
    assert len(computed) == len(ids)
    assert {p.name.rsplit("-", 1)[0] for p in env.gates.glob("computed-pools-r0-*")} == {"computed-pools-r0-p1f0"}
    assert {p["spec"]["nodeName"] for p in env.pods("pools-r0-p1f0")} == {"ondemand-cpu-0"}
    assert not env.jobs_named("pools-r0-p0")  # the spot pool's Job was deleted
    st = env.status("pools")
    assert [(p["name"], p["lanes"], p.get("gaveUpRound")) for p in st["pools"]] == [("spot", 0, 0), ("cpu", 2, None)]
    assert "no node took its pods" in st["pools"][0]["message"]
    assert "PoolGaveUp" in env.reasons("pools")
    assert set(st["cost"]["pools"]) == {"cpu"}  # only the cpu pool's pods worked, at its price
    assert "spot 0/0 (gave up)" in env.kubectl("get", "bij", "pools", "-o", "wide", "--no-headers")


def test_deleting_the_bij_removes_its_jobs_and_pods_through_the_garbage_collector(env: Env) -> None:
    ids = job_ids(env)
    env.create(env.doc("gone"))
    env.wait_phase("gone", "Succeeded")
    assert env.jobs() and env.pods()
    env.custom.delete_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, "gone")
    wait_for(lambda: not env.jobs() and not env.pods() or None, 60, "the Job and its pods collected")
    assert_every_row_once(env.tmp / "out-gone" / "manifest.json", ids)
    time.sleep(1)
    assert env.jobs() == []  # and the operator does not bring anything back


def test_a_spec_only_the_operator_can_judge_invalid_fails_without_a_job_until_fixed(env: Env) -> None:
    job_ids(env)
    # CEL cannot tell whether a regular expression compiles; the operator's spec model can.
    env.create(env.doc("regex", model={"engine": "echo", "task": "generate"},
                       judge={"type": "regex", "pattern": "(unclosed"}))
    failed = env.wait_phase("regex", "Failed")
    cond = {c["type"]: c for c in failed["conditions"]}["Failed"]
    assert cond["reason"] == "InvalidSpec" and "not a valid regular expression" in cond["message"]
    assert env.jobs() == []
    env.custom.patch_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, "regex", {"spec": {"judge": None}})
    done = env.wait_phase("regex", "Succeeded")
    assert done["observedGeneration"] == 2


def test_a_file_uri_outside_the_shared_volume_is_refused_naming_the_chart_value(env: Env) -> None:
    job_ids(env)
    env.create(env.doc("elsewhere", output={"uri": "file:///var/lib/bij-not-shared/out/"}))
    failed = env.wait_phase("elsewhere", "Failed")
    cond = {c["type"]: c for c in failed["conditions"]}["Failed"]
    assert cond["reason"] == "InvalidSpec" and "fileStorage.mountPath" in cond["message"]
    assert "spec.output.uri: file:///var/lib/bij-not-shared/out/ is outside the shared volume" in cond["message"]
    assert env.jobs() == []  # not even a plan Job


def test_suspend_stops_the_round_and_resume_finishes_it_keeping_progress(env: Env) -> None:
    ids = job_ids(env)
    hold_row(env, "sus-r0")
    env.create(env.doc("sus"))
    wait_for(lambda: all_but_one_shard_done(env, "sus"), 120, "every shard but the held one done")
    env.custom.patch_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, "sus", {"spec": {"suspend": True}})
    suspended = env.wait_phase("sus", "Suspended")
    total = suspended["shards"]["total"]
    assert suspended["shardsSummary"] == f"{total - 1}/{total}"
    # The Job controller deletes the running pod of a suspended Job; it is not a failure.
    wait_for(lambda: not [p for p in env.pods("sus-r0") if p["status"].get("phase") == "Running"] or None, 60,
             "the held pod stopped")
    job = env.job("sus-r0")
    assert job["spec"]["suspend"] is True and job["status"].get("failed", 0) == 0
    (env.gates / "holdrow-sus-r0").unlink()
    env.custom.patch_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, "sus", {"spec": {"suspend": False}})
    done = env.wait_phase("sus", "Succeeded")
    assert done["observedGeneration"] == 3
    # Both lanes' pods were stopped (one held, the other waiting for the held shard) and started again ...
    assert sorted(len(p.read_text().splitlines()) for p in env.gates.glob("started-sus-r0-*")) == [2, 2]
    # ... yet finished shards never ran again: only rows of the held shard not yet durable were recomputed.
    assert len(env.computed("sus-r0")) - ROWS <= 4 * 8
    assert_every_row_once(env.tmp / "out-sus" / "manifest.json", ids)


def test_lanes_of_two_pods_get_a_headless_service_and_a_job_of_two_indexes_a_lane(env: Env) -> None:
    """The objects of a bij whose lanes span two pods, as the operator (under the chart's RBAC) creates them
    and the real API server and Job controller take them; suspended, so no pod needs Ray here (the group
    itself runs in tests/worker/test_group.py)."""
    job_ids(env)
    env.create(env.doc("two", model={"engine": "simulated", "task": "generate"}, suspend=True,
                       workers={"parallelism": 2, "nodesPerLane": 2, "backoffLimitPerIndex": 1}))
    wait_for(lambda: env.jobs_named("two-r0") or None, 120, "the round's Job")
    job = env.job("two-r0")
    lanes = env.status("two")["rounds"][0]["lanes"]
    spec = job["spec"]
    assert spec["suspend"] is True and spec["completions"] == 2 * lanes and spec["parallelism"] == 2 * min(2, lanes)
    assert spec["template"]["spec"]["subdomain"] == "two-lanes"
    assert job["metadata"]["annotations"]["batchinference.io/nodes-per-lane"] == "2"
    assert {"action": "Ignore", "onExitCodes": {"containerName": "worker", "operator": "In", "values": [44]}} \
        in spec["podFailurePolicy"]["rules"]
    core = env.core
    svc = core.read_namespaced_service("two-lanes", env.ns)
    assert svc.spec.cluster_ip == "None" and svc.spec.publish_not_ready_addresses is True
    assert [o.uid for o in svc.metadata.owner_references] == [env.bij("two")["metadata"]["uid"]]
    # Deleted with its bij, as the Jobs are.
    env.custom.delete_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, "two")

    def service_gone() -> bool:
        try:
            core.read_namespaced_service("two-lanes", env.ns)
        except ApiException as e:
            return e.status == 404
        return False

    wait_for(service_gone, 60, "the Service collected with its bij")


@pytest.mark.slow
def test_a_lane_of_two_pods_forms_over_ray_and_a_member_evicted_mid_round_replaces_the_group_uncounted(
        env: Env) -> None:
    """A lane of two pods run by the Job controller: the leader (index 0) forms a Ray cluster with its
    member (index 1), the member is evicted mid-round, the leader drains and exits 44, both are replaced
    without a retry counted, and the round finishes with every row once. The local cluster's pods share
    one host and have no DNS names: workers.env points the member at 127.0.0.1 (a setting the user's env
    may override); the simulated engine stands for vLLM, whose CPU build has no Ray executor."""
    pytest.importorskip("ray")
    import socket

    ids = job_ids(env)
    ports = []
    for _ in range(2):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
    base = env.doc("grp")["spec"]["workers"]["env"]
    env.create(env.doc("grp", model={"engine": "simulated", "task": "generate", "maxTokens": 4,
                                     "simulated": {"maxNumSeqs": 2, "stepSeconds": 0.1}},
                       sharding={"targetShardBytes": 4096, "chunkRows": 8},
                       workers={"parallelism": 1, "nodesPerLane": 2, "backoffLimitPerIndex": 0,
                                "terminationGracePeriodSeconds": 20,
                                "env": {**base, "BIJ_GROUP_LEADER": "127.0.0.1", "BIJ_RAY_PORT": str(ports[0]),
                                        "BIJ_GROUP_PORT": str(ports[1]), "BIJ_REPORT_INTERVAL": "0.5"}}))
    # The leader's engine stops stepping after 40 steps (about 16 rows) until the member is evicted: the
    # round cannot end first, however fast or slow this machine is.
    gate = env.gate("hold", "grp-r0", 0, "40")
    # The group formed and the leader works: rows are reported done, and the member's pod runs.
    try:
        wait_for(lambda: (env.status("grp").get("rows") or {}).get("done", 0) >= 8 or None, 240, "rows done")
        member = wait_for(lambda: env.running_pod("grp-r0", 1), 30, "the member's pod running")
    except TimeoutError as e:
        raise TimeoutError(f"{e}\n{env.describe('grp', 'grp-r0')}") from None
    leader = env.running_pod("grp-r0", 0)
    assert leader is not None
    body = kubernetes.client.V1Eviction(metadata=kubernetes.client.V1ObjectMeta(
        name=member["metadata"]["name"], namespace=env.ns))
    env.core.create_namespaced_pod_eviction(member["metadata"]["name"], env.ns, body)
    # The member says it leaves at once (its SIGTERM); the leader drains its in-flight rows once its engine
    # steps again.
    wait_for(lambda: env.running_pod("grp-r0", 1) is None or None, 60, "the member's pod stopping")
    time.sleep(2)
    gate.unlink()
    done = env.wait_phase("grp", "Succeeded", timeout=400)
    assert done["rows"]["done"] == ROWS
    assert_every_row_once(env.tmp / "out-grp" / "manifest.json", ids)
    job = env.job("grp-r0")
    # backoffLimitPerIndex 0, yet the round succeeded: neither the evicted member (DisruptionTarget) nor the
    # leader it left (exit 44) was counted, and both indexes ran again as a new group.
    assert job["status"].get("failed", 0) == 0 and not job["status"].get("failedIndexes")
    first = env.core.read_namespaced_pod(leader["metadata"]["name"], env.ns)
    (state,) = first.status.container_statuses
    assert state.state.terminated.exit_code == 44
    # Not silent: the leader reported why, the operator said it once as a Warning, and the round's record
    # and its RoundFinished message count it.
    warned = [e for e in env.events("grp") if e["reason"] == "LaneGroupReplaced"]
    assert len(warned) == 1 and "lane 0: member 1 is stopping (SIGTERM)" in warned[0]["message"], warned
    (rec,) = done["rounds"]
    assert rec["groupsReplaced"] == 1
    assert any("lane groups replaced: 1" in e["message"] for e in env.events("grp") if e["reason"] == "RoundFinished")


def assert_partial(env: Env, name: str, ids: list[Any], phase: str) -> dict[str, Any]:
    """The partial manifest of a stopped bij: every finished row once, and the rest counted as not run."""
    manifest = env.tmp / f"out-{name}" / "manifest.json"
    doc = json.loads(manifest.read_text())
    assert doc["partial"]["phase"] == phase
    counts = doc["partial"]["counts"]
    rows = published(manifest)
    got = [json.dumps(r["id"]) for r in rows]
    assert len(got) == len(set(got)) == counts["completed"] and set(got) <= {json.dumps(i) for i in ids}
    assert counts["completed"] + counts["failed"] + counts["notRun"] == len(ids)
    assert counts["notRun"] >= 1  # the held row never ran
    st = env.status(name)
    assert st["rows"] == {"done": counts["completed"], "failed": counts["failed"], "notRun": counts["notRun"]}
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_cancel_or_a_deadline_drains_the_round_and_publishes_the_finished_rows_once(env: Env, how: str) -> None:
    ids = job_ids(env)
    name = f"stop-{how}"
    hold_row(env, f"{name}-r0")
    # The held row keeps its shard from finishing: the deadline always finds the job unfinished, with
    # however many rows this machine managed by then.
    spec: dict[str, Any] = {"deadlineSeconds": 20} if how == "deadline" else {}
    env.create(env.doc(name, **spec))
    if how == "cancel":
        wait_for(lambda: all_but_one_shard_done(env, name), 120, "every shard but the held one done")
        env.kubectl("patch", "bij", name, "--type=merge", "-p", '{"spec": {"cancel": true}}')
    phase = "Cancelled" if how == "cancel" else "Expired"
    env.wait_phase(name, phase, timeout=180)
    counts = assert_partial(env, name, ids, phase)
    # kopf posts an Event from its own task, after the status patch that set the phase has landed.
    reasons = wait_for(lambda: (lambda r: r if phase in r else None)(env.reasons(name)), 30, f"the {phase} Event")
    assert "Published" not in reasons
    # Drained, not failed: the held pod was stopped through the suspended Job.
    job = env.job(f"{name}-r0")
    assert job["spec"]["suspend"] is True and job["status"].get("failed", 0) == 0
    assert not [p for p in env.pods(f"{name}-r0") if p["status"].get("phase") == "Running"]
    # Never again: taking cancel back or releasing the held row publishes nothing new.
    (env.gates / f"holdrow-{name}-r0").unlink()
    env.custom.patch_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, name,
                                              {"spec": {"cancel": False, "deadlineSeconds": None}})
    wait_for(lambda: env.status(name).get("observedGeneration") == env.bij(name)["metadata"]["generation"] or None,
             60, "the operator saw the edit")
    assert env.status(name)["phase"] == phase and env.job(f"{name}-r0")["spec"]["suspend"] is True
    assert assert_partial(env, name, ids, phase) == counts


def test_a_foreign_job_with_the_rounds_name_is_reported_never_adopted(env: Env) -> None:
    job_ids(env)
    env.foreign_job("clash-r0")
    env.create(env.doc("clash"))
    st = wait_for(lambda: (lambda s: s if any(c["type"] == "Ready" and c.get("reason") == "JobNameConflict"
                                              for c in s.get("conditions") or []) else None)(env.status("clash")),
                  60, "the JobNameConflict condition")
    assert "a Job named clash-r0 already exists" in st["message"]
    assert "ownerReferences" not in env.job("clash-r0")["metadata"]


# --- tenants on one cluster ----------------------------------------------------------------------


def _tenant(s3: Any, name: str) -> tuple[Any, str]:
    """A new identity of the S3 server with a bucket of its own."""
    import boto3

    who = s3.add_user(f"{name}-{uuid.uuid4().hex[:6]}")
    bucket = f"bij-{name}-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=s3.endpoint).create_bucket(Bucket=bucket)
    s3.give_bucket(bucket, who)
    return who, bucket


def _s3_doc(env: Env, name: str, input_uri: str, output_uri: str, secret: str, endpoint: str) -> dict[str, Any]:
    doc = env.doc(name, input={"uri": input_uri}, output={"uri": output_uri, "compression": "none"})
    doc["spec"]["storage"] = {"s3": {"endpointUrl": endpoint, "region": "us-east-1"}, "credentialsSecret": secret}
    return doc


@pytest.mark.slow
def test_a_gs_bij_runs_through_with_an_hmac_key_in_its_secret(env: Env, s3_service: Any) -> None:
    """gs:// input and output on the cluster: the key in the credentials Secret signs every step, round and
    publish pod (the S3 server stands in for GCS's XML API, as BIJ_GCS_ENDPOINT_URL in spec.workers.env says)."""
    import boto3

    who, bucket = _tenant(s3_service, "gcs")
    root = boto3.client("s3", endpoint_url=s3_service.endpoint)
    rows = [json.dumps({"id": i, "text": f"row {i}"}) for i in range(ROWS)]
    root.put_object(Bucket=bucket, Key="in/rows.jsonl", Body=("\n".join(rows) + "\n").encode())
    env.core.create_namespaced_secret(env.ns, {"metadata": {"name": "gcs-hmac"}, "stringData": who.env()})
    doc = env.doc("gcs", input={"uri": f"gs://{bucket}/in/"},
                  output={"uri": f"gs://{bucket}/out/", "compression": "none"})
    doc["spec"]["storage"] = {"credentialsSecret": "gcs-hmac"}
    doc["spec"]["workers"]["env"].update(BIJ_GCS_ENDPOINT_URL=s3_service.endpoint, BIJ_GCS_REGION="us-east-1")
    env.create(doc)
    done = env.wait_phase("gcs", "Succeeded", timeout=300)
    assert done["manifestUri"] == f"gs://{bucket}/out/manifest.json" and done["rows"]["done"] == ROWS
    manifest = json.loads(root.get_object(Bucket=bucket, Key="out/manifest.json")["Body"].read())
    got = []
    for f in manifest["files"]:
        body = root.get_object(Bucket=bucket, Key=f"out/{f['path']}")["Body"].read().decode()
        got += [json.loads(line)["id"] for line in body.splitlines() if line.strip()]
    assert sorted(got) == list(range(ROWS))


def test_tenants_stay_apart_each_namespace_with_its_own_s3_identity(env: Env, s3_service: Any) -> None:
    """Two namespaces, each with its own S3 identity owning one bucket: B's bij cannot read A's input
    through the operator or write into A's bucket, and A's job, run meanwhile, publishes every row once."""
    import boto3

    a_who, a_bucket = _tenant(s3_service, "team-a")
    b_who, b_bucket = _tenant(s3_service, "team-b")
    server = s3_service.server
    log_from = server.access_log.stat().st_size if server.access_log.exists() else 0
    root = boto3.client("s3", endpoint_url=s3_service.endpoint)
    rows = [json.dumps({"id": i, "text": f"row {i}: secret of team a"}) for i in range(ROWS)]
    root.put_object(Bucket=a_bucket, Key="in/rows.jsonl", Body=("\n".join(rows) + "\n").encode())
    root.put_object(Bucket=b_bucket, Key="in/rows.jsonl", Body=b'{"id": 1, "text": "team b"}\n')

    ns_b = f"{env.ns}-b"
    env.core.create_namespace({"metadata": {"name": ns_b}})
    try:
        wait_for(lambda: env.core.read_namespaced_service_account("default", ns_b), 30, "B's default SA")
        add_worker_account(env.api, ns_b)
        for ns, who, secret in ((env.ns, a_who, "s3-a"), (ns_b, b_who, "s3-b")):
            env.core.create_namespaced_secret(ns, {"metadata": {"name": secret}, "stringData": who.env()})
        endpoint = s3_service.endpoint
        env.create(_s3_doc(env, "mine", f"s3://{a_bucket}/in/", f"s3://{a_bucket}/out/", "s3-a", endpoint))
        b = Env(env.cluster, ns_b, env.tmp, env.gates)
        b.create(_s3_doc(b, "snoop", f"s3://{a_bucket}/in/", f"s3://{b_bucket}/snoop/", "s3-b", endpoint))
        b.create(_s3_doc(b, "plant", f"s3://{b_bucket}/in/", f"s3://{a_bucket}/planted/", "s3-b", endpoint))

        for name in ("snoop", "plant"):
            failed = b.wait_phase(name, "Failed", timeout=180)
            cond = {c["type"]: c for c in failed["conditions"]}["Failed"]
            assert cond["reason"] == "StorageRefused" and "AccessDenied" in cond["message"], cond
            assert f"as access key id {b_who.access_key}" in cond["message"]
            assert b.jobs_named(f"{name}-r0") == []  # refused at planning: no round ran
        snoop = {c["type"]: c for c in b.status("snoop")["conditions"]}["Failed"]["message"]
        assert f"s3://{a_bucket}/in/" in snoop
        plant = {c["type"]: c for c in b.status("plant")["conditions"]}["Failed"]["message"]
        assert f"s3://{a_bucket}/planted/" in plant
        # B's output holds no plan and no listing of A's objects; A's bucket holds nothing B planted.
        for obj in root.list_objects_v2(Bucket=b_bucket, Prefix="snoop/").get("Contents", []):
            body = root.get_object(Bucket=b_bucket, Key=obj["Key"])["Body"].read().decode()
            assert not obj["Key"].endswith("shards.json") and "rows.jsonl" not in body and a_bucket not in body
        assert root.list_objects_v2(Bucket=a_bucket, Prefix="planted/").get("KeyCount", 0) == 0

        done = env.wait_phase("mine", "Succeeded", timeout=300)
        manifest = json.loads(root.get_object(Bucket=a_bucket, Key="out/manifest.json")["Body"].read())
        got = []
        for f in manifest["files"]:
            body = root.get_object(Bucket=a_bucket, Key=f"out/{f['path']}")["Body"].read().decode()
            got += [json.loads(line)["id"] for line in body.splitlines() if line.strip()]
        assert sorted(got) == list(range(ROWS)) and done["rows"]["done"] == ROWS
    finally:
        env.core.delete_namespace(ns_b)

    # The operator has nothing to sign with, and the S3 server saw no request but the tenants' own
    # (and this test's, as the server's root account): none unsigned, none from anyone else.
    op = env.cluster.operator_pod()
    (container,) = op["spec"]["containers"]
    assert "envFrom" not in container
    assert not [e["name"] for e in container.get("env") or []
                if e["name"].startswith("AWS_") and e["name"] != "AWS_EC2_METADATA_DISABLED"]
    with open(server.access_log) as log:
        log.seek(log_from)
        # bucket-owner bucket [time zone] remote-ip requester request-id operation ...
        requesters = {parts[5] for parts in map(str.split, log) if len(parts) > 6 and parts[2].startswith("[")}
    assert requesters <= {a_who.access_key, b_who.access_key, server.root.access_key}, requesters
    assert a_who.access_key in requesters and b_who.access_key in requesters


def _worker_role(env: Env, rules: list[dict[str, Any]]) -> kubernetes.client.RbacAuthorizationV1Api:
    """The namespace's worker account and Role set up by hand, with `rules`."""
    remove_worker_account(env.api, env.ns)
    rbac = kubernetes.client.RbacAuthorizationV1Api(env.api)
    env.core.create_namespaced_service_account(env.ns, {"metadata": {"name": "bij-worker"}})
    rbac.create_namespaced_role(env.ns, {"metadata": {"name": "bij-worker"}, "rules": rules})
    rbac.create_namespaced_role_binding(env.ns, {
        "metadata": {"name": "bij-worker"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "bij-worker"},
        "subjects": [{"kind": "ServiceAccount", "name": "bij-worker", "namespace": env.ns}]})
    return rbac


# The one verb a bij's pods need is not granted: patching their bij's status.
READ_ONLY = [{"apiGroups": ["batchinference.io"], "resources": ["batchinferencejobs"], "verbs": ["get"]}]


def _conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status.get("conditions") or []}


@pytest.mark.slow
def test_a_worker_role_missing_a_grant_holds_the_bij_before_any_pod_until_the_role_is_fixed(env: Env) -> None:
    rbac = _worker_role(env, READ_ONLY)
    ids = job_ids(env, 20)
    env.create(env.doc("held"))

    def checked_twice() -> dict[str, Any] | None:
        st = env.status("held")
        return st if (st.get("workerPermissions") or {}).get("checks", 0) >= 2 else None

    st = wait_for(checked_twice, 120, "the missing grant found twice")
    cond = _conditions(st)["WorkerPermissions"]
    print(cond["message"])
    assert (cond["status"], cond["reason"]) == ("False", "MissingPermissions")
    assert (f"system:serviceaccount:{env.ns}:bij-worker may not patch batchinferencejobs/status.batchinference.io"
            in cond["message"])
    assert f"Fix: kubectl -n {env.ns} create role bij-worker --verb=create,patch" in cond["message"]
    assert st["phase"] == "Pending" and st["message"] == cond["message"]
    assert env.jobs() == []  # no step, no round Job: their pods would be refused
    wide = env.kubectl("get", "bij", "held", "-o", "wide", "--no-headers")
    assert wide.split()[:2] == ["held", "Pending"] and "may not patch batchinferencejobs/status" in wide, wide
    wait_for(lambda: "MissingPermissions" in env.reasons("held") or None, 30, "the Warning Event")
    warned = [e for e in env.events("held") if e["reason"] == "MissingPermissions"]
    assert len(warned) == 1 and warned[0]["type"] == "Warning"  # said once, not on every check

    # The admin grants it; the next check sees it and the same bij runs through, not re-created.
    rbac.replace_namespaced_role("bij-worker", env.ns, {"metadata": {"name": "bij-worker"}, "rules": WORKER_RULES})
    fixed = time.monotonic()
    wait_for(lambda: _conditions(env.status("held"))["WorkerPermissions"]["status"] == "True" or None, 180,
             "the grant seen")
    print(f"the grant seen {time.monotonic() - fixed:.1f} s after the Role was fixed")
    st = env.wait_phase("held", "Succeeded", timeout=240)
    cond = _conditions(st)["WorkerPermissions"]
    assert (cond["status"], cond["reason"]) == ("True", "Granted"), cond
    assert_every_row_once(env.tmp / "out-held" / "manifest.json", ids)
    wait_for(lambda: "PermissionsGranted" in env.reasons("held") or None, 30, "the PermissionsGranted Event")


@pytest.mark.slow
def test_a_held_bij_that_is_cancelled_or_expires_ends_so_without_its_grants_or_a_pod(env: Env) -> None:
    _worker_role(env, READ_ONLY)
    job_ids(env, 10)
    env.create(env.doc("held-cancel"))
    env.create(env.doc("held-expire", deadlineSeconds=30))
    wait_for(lambda: (env.status("held-cancel").get("workerPermissions") or {}).get("result") == "Missing" or None,
             60, "the missing grant found")
    assert env.status("held-cancel")["phase"] == "Pending"
    env.kubectl("patch", "bij", "held-cancel", "--type=merge", "-p", '{"spec": {"cancel": true}}')
    for name, phase in (("held-cancel", "Cancelled"), ("held-expire", "Expired")):
        st = env.wait_phase(name, phase, timeout=120)
        print(st["message"])
        assert "while the bij was held before its first pod" in st["message"]
        assert st["message"].endswith("nothing ran and nothing was published")
        conditions = _conditions(st)
        assert (conditions["Ready"]["status"], conditions["Ready"]["reason"]) == ("False", phase)
        assert conditions["WorkerPermissions"]["status"] == "False"
        assert st.get("completionTime") and not st.get("manifestUri")
        wait_for(lambda name=name, phase=phase: phase in env.reasons(name) or None, 30, f"the {phase} Event")
        assert not (env.tmp / f"out-{name}").exists()
    assert env.jobs() == []  # no step, no round: their pods could not have reported


def test_a_grant_revoked_after_the_check_fails_the_step_saying_the_403_and_the_missing_verb(env: Env) -> None:
    # The worker identity holds its grant when the bij is created, so it passes the operator's check; the
    # input is not there yet, so its plan step reports that and is run again after the retry delay.
    rbac = _worker_role(env, WORKER_RULES)
    later = f"file://{env.tmp}/later/"
    log_before = len(operator_log(env.cluster))
    env.create(env.doc("denied", input={"uri": later}))
    wait_for(lambda: "PlanFailed" in env.reasons("denied") or None, 90, "the plan's first failure")
    assert _conditions(env.status("denied"))["WorkerPermissions"]["status"] == "True"
    # Then the grant is taken away: the step's next pods cannot report.
    rbac.replace_namespaced_role("bij-worker", env.ns, {"metadata": {"name": "bij-worker"}, "rules": READ_ONLY})
    write_rows(env.tmp / "later", 20)
    st = env.wait_phase("denied", "Failed", timeout=240)
    message = st["message"]
    print(message)
    assert message.startswith("step plan-r0 failed 2 time(s), giving up (spec.workers.backoffLimitPerIndex 1); "
                              "Job denied-plan-r0, last pod denied-plan-r0-0-"), message
    assert "exit code 1: " in message and "cannot report the result of step plan: PATCH" in message, message
    assert "HTTP 403" in message, message
    assert 'cannot patch resource "batchinferencejobs/status"' in message, message
    failed = [c for c in st["conditions"] if c["type"] == "Failed"]
    assert failed and failed[0]["status"] == "True" and failed[0]["reason"] == "StepFailed"
    assert failed[0]["message"] == message
    line = env.kubectl("get", "bij", "denied", "--no-headers").split()
    assert line[:2] == ["denied", "Failed"]
    wait_for(lambda: "StepFailed" in env.reasons("denied") or None, 30, "the StepFailed Event")
    events = {e["reason"]: e["message"] for e in env.events("denied")}
    # The Event says the same (kopf cuts a long Event message in its middle).
    assert events["StepFailed"][:300] == message[:300] and "HTTP 403" in events["StepFailed"]
    assert "StepRetrying" in events and "running it again" in events["StepRetrying"]
    assert "HTTP 403" in events["StepRetrying"]
    # Said in the bij, not raised: no traceback in the operator's log, and no step Job made again.
    new_log = operator_log(env.cluster)[log_before:]
    assert "Traceback" not in new_log, new_log[-3000:]
    assert [j["metadata"]["name"] for j in env.jobs()] == ["denied-plan-r0"]


# --- RBAC: what the chart grants is exactly what the operator uses -------------------------------------
#
# For each way the chart can run the operator, `helm upgrade` to it and drive one session through
# everything the operator does: a job with a scale change, suspend, an operator restart and resume,
# a failing job, a spec only the operator can reject, a Job name taken by someone else, a deletion.
# The API server enforces the chart's RBAC (any 403 fails) and its audit log records every request
# the operator's pods made; each grant must have been used. These run last: they change the install.

# Grants the operator's own requests never exercise, each with the reason it must stay.
JUSTIFIED = {
    ("batchinference.io", "batchinferencejobs/finalizers", "update"):
        "round Jobs carry an ownerReference with blockOwnerDeletion; the OwnerReferencesPermissionEnforcement "
        "admission plugin (on in this cluster) checks this permission when they are created",
    ("", "pods", "list"):
        "the failed pods of a step Job say why it is retried or failed; listed only once one failed "
        "(test_a_grant_revoked_after_the_check_fails_the_step_saying_the_403_and_the_missing_verb)",
    ("", "services", "create"):
        "the headless Service of a bij whose lanes span several pods (spec.workers.nodesPerLane > 1); created only "
        "for such a bij (tests/control/test_render.py and tests/worker/test_group.py test it)",
    ("", "secrets", "get"):
        "the key that signs spec.notify's POSTs, read from the one Secret a bij names, only once it ends with a "
        "webhook to tell (tests/control/test_notify.py::"
        "test_the_operator_reads_the_key_from_the_named_secret_and_names_one_it_cannot_read)",
}
MODES = {
    "all-namespaces": {},
    "namespaced": {"watch": {"allNamespaces": False, "namespaces": ["{ns}"]}},
    "peering": {"peering": {"enabled": True, "name": "bij-operator"}},
    "namespaced-peering": {"watch": {"allNamespaces": False, "namespaces": ["{ns}"]},
                           "peering": {"enabled": True, "name": "bij-operator"}},
}
POD_NAME = "authentication.kubernetes.io/pod-name"


def _grants(api: kubernetes.client.ApiClient, sa: str) -> set[tuple[str, str, str]]:
    """(group, resource, verb) granted to the operator's ServiceAccount by the installed RBAC objects."""
    rbac = kubernetes.client.RbacAuthorizationV1Api(api)

    def bound(b: Any) -> bool:
        return any(s.kind == "ServiceAccount" and s.name == sa and s.namespace == OPERATOR_NAMESPACE
                   for s in b.subjects or [])

    rules: list[Any] = []
    for b in rbac.list_cluster_role_binding().items:
        if bound(b):
            rules += rbac.read_cluster_role(b.role_ref.name).rules or []
    for b in rbac.list_role_binding_for_all_namespaces().items:
        if bound(b):
            role = (rbac.read_namespaced_role(b.role_ref.name, b.metadata.namespace) if b.role_ref.kind == "Role"
                    else rbac.read_cluster_role(b.role_ref.name))
            rules += role.rules or []
    return {(g, r, v) for rule in rules for g in rule.api_groups or [] for r in rule.resources or []
            for v in rule.verbs or []}


def _operator_session(env: Env, restart: Any) -> None:
    write_rows(env.tmp / "in", 60)
    hold_row(env, "ok-r0")
    env.create(env.doc("ok"))
    wait_for(lambda: all_but_one_shard_done(env, "ok"), 120, "ok running")
    patch = env.custom.patch_namespaced_custom_object
    patch(GROUP, VERSION, env.ns, PLURAL, "ok", {"spec": {"workers": {"parallelism": 3}}})
    patch(GROUP, VERSION, env.ns, PLURAL, "ok", {"spec": {"suspend": True}})
    env.wait_phase("ok", "Suspended")
    restart()
    patch(GROUP, VERSION, env.ns, PLURAL, "ok", {"spec": {"suspend": False}})
    (env.gates / "holdrow-ok-r0").unlink()
    env.wait_phase("ok", "Succeeded")

    env.gate("exit", "bad-r0", 0, "42 1")
    env.create(env.doc("bad"))
    env.wait_phase("bad", "Failed")
    env.create(env.doc("invalid", model={"engine": "echo", "task": "generate"},
                       judge={"type": "regex", "pattern": "("}))
    env.wait_phase("invalid", "Failed")
    env.foreign_job("clash-r0")
    env.create(env.doc("clash"))
    wait_for(lambda: "JobNameConflict" in json.dumps(env.status("clash")), 60, "the name conflict")
    # Input not there yet: the plan Job reports it, and is deleted so that the next attempt plans anew
    # (a new Job of the same name may follow at once: the old one's uid is gone).
    env.create(env.doc("early", input={"uri": f"file://{env.tmp}/not-yet/"}))
    wait_for(lambda: "PlanFailed" in env.reasons("early") or None, 60, "the plan's failure")
    first = {j["metadata"]["uid"] for j in env.jobs_named("early-plan-r0")}
    wait_for(lambda: not first & {j["metadata"]["uid"] for j in env.jobs_named("early-plan-r0")} or None, 90,
             "the failed plan's Job deleted")
    env.custom.delete_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, "ok")
    wait_for(lambda: not env.jobs_named("ok-r0") or None, 60, "ok's Job collected")
    wait_for(lambda: "InvalidSpec" in env.reasons("invalid"), 30, "the last Event posted")


# These leave the operator installed in their last mode (namespaced, watching one test's namespace): tests that
# need the operator to serve a namespace of their own come before them.
@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_the_chart_rbac_is_exactly_what_the_operator_uses(env: Env, mode: str) -> None:
    cluster = env.cluster
    # Checked below from the audit log, for this mode's pods: the previous mode's operator loses
    # its grants while Helm upgrades, before the Deployment replaces it.
    env.check_forbidden = False
    values = json.loads(json.dumps(MODES[mode]).replace("{ns}", env.ns))
    if "watch" in values:  # namespaced installs create bij-worker in the watched namespaces themselves
        remove_worker_account(env.api, env.ns)
    before = cluster.operator_pod()
    cluster.install_operator(values={"extraArgs": ["--status-interval", "0.3"], **values})
    pods = {cluster.operator_pod(120, not_uid=before["metadata"]["uid"])["metadata"]["name"]}

    def restart() -> None:
        old = cluster.operator_pod()
        env.core.delete_namespaced_pod(old["metadata"]["name"], OPERATOR_NAMESPACE)
        pods.add(cluster.operator_pod(120, not_uid=old["metadata"]["uid"])["metadata"]["name"])

    _operator_session(env, restart)

    entries = [json.loads(line) for line in cluster.plane.audit_log.read_text().splitlines()]
    ours = [e for e in entries if set((e["user"].get("extra") or {}).get(POD_NAME) or []) & pods]
    assert ours, f"no audit entries carry the operator pods' names {pods}"
    # RBAC's refusals only ("User ... cannot ..."); a 403 for a namespace being deleted is admission's.
    denied = sorted({(e["verb"], e["requestURI"]) for e in ours if e.get("responseStatus", {}).get("code") == 403
                     and " cannot " in e["responseStatus"].get("message", "")})
    assert not denied, f"{mode}: the API server refused the operator: {denied}"
    used = set()
    for e in ours:
        ref = e.get("objectRef")
        if ref and ref.get("resource"):
            res = f"{ref['resource']}/{ref['subresource']}" if ref.get("subresource") else ref["resource"]
            used.add((ref.get("apiGroup", ""), res, e["verb"]))
    sa = before["spec"]["serviceAccountName"]
    unused = sorted(g for g in _grants(env.api, sa) - used if g not in JUSTIFIED)
    assert not unused, f"{mode}: the chart grants what the operator never uses: {unused}"
    assert set(JUSTIFIED) <= _grants(env.api, sa), "a justified grant is no longer granted: drop it"

    # The bij's pods, audited the same way: never refused, and every grant of their Role used.
    worker = f"system:serviceaccount:{env.ns}:bij-worker"
    theirs = [e for e in entries if e["user"].get("username") == worker]
    assert theirs, f"no audit entries from {worker}"
    denied = sorted({(e["verb"], e["requestURI"]) for e in theirs if e.get("responseStatus", {}).get("code") == 403})
    assert not denied, f"{mode}: the API server refused the bij's pods: {denied}"
    used = {(e["objectRef"].get("apiGroup", ""), f"{e['objectRef']['resource']}/{e['objectRef']['subresource']}"
             if e["objectRef"].get("subresource") else e["objectRef"]["resource"], e["verb"])
            for e in theirs if e.get("objectRef")}
    role = kubernetes.client.RbacAuthorizationV1Api(env.api).read_namespaced_role("bij-worker", env.ns)
    granted = {(g, r, v) for rule in role.rules for g in rule.api_groups or [] for r in rule.resources or []
               for v in rule.verbs or []}
    assert granted == {(g, r, v) for rule in WORKER_RULES for g in rule["apiGroups"] for r in rule["resources"]
                       for v in rule["verbs"]}, "the chart's worker Role and the tests' copy differ"
    assert granted <= used, f"{mode}: the worker Role grants what the bij's pods never use: {granted - used}"


def test_bij_doctor_names_a_missing_grant_with_its_fix_and_probes_storage_from_the_namespace(
        env: Env, s3_service: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`bij doctor`: the worker identity's grants asked of the API server (a namespace set up by hand misses
    one, the printed commands add it), and storage probed by a pod of the namespace under its Secret."""
    import shlex

    import boto3

    from bij.cli.main import main as bij

    kubeconfig = str(env.cluster.kubeconfig)

    def doctor(*args: str) -> tuple[int, str]:
        capsys.readouterr()
        code = bij(["doctor", "--kubeconfig", kubeconfig, "--timeout", "120", *args])
        return code, capsys.readouterr().out

    code, out = doctor("-n", env.ns)
    assert code == 0 and out.splitlines()[-1] == "ready", out
    assert f"system:serviceaccount:{env.ns}:bij-worker may patch batchinferencejobs/status" in out

    # A namespace set up by hand: the service account, no Role.
    bare = f"{env.ns}-bare"
    env.core.create_namespace({"metadata": {"name": bare}})
    try:
        wait_for(lambda: env.core.read_namespaced_service_account("default", bare), 30, "the default SA")
        code, out = doctor("-n", bare)
        assert code == 1 and f"service account {bare}/bij-worker does not exist" in out, out
        env.core.create_namespaced_service_account(bare, {"metadata": {"name": "bij-worker"}})
        code, out = doctor("-n", bare)
        assert code == 1 and "FAIL  rbac" in out and "may not patch batchinferencejobs/status" in out, out
        fix = next(line for line in out.splitlines() if "fix: kubectl" in line).split("fix: ", 1)[1]
        for command in fix.split("  (or", 1)[0].split(" && "):
            env.cluster.kubectl(*shlex.split(command)[1:])
        code, out = doctor("-n", bare)
        assert code == 0 and out.splitlines()[-1] == "ready", out
    finally:
        env.core.delete_namespace(bare)

    # Storage, as the job's pods see it: the tenant's own keys, then another identity's.
    owner, bucket = _tenant(s3_service, "doctor")
    stranger = s3_service.add_user(f"stranger-{uuid.uuid4().hex[:6]}")
    boto3.client("s3", endpoint_url=s3_service.endpoint).put_object(Bucket=bucket, Key="in/rows.jsonl",
                                                                     Body=b'{"id": 1, "text": "x"}\n')
    for secret, who in (("s3-owner", owner), ("s3-stranger", stranger)):
        env.core.create_namespaced_secret(env.ns, {"metadata": {"name": secret}, "stringData": who.env()})
    spec = tmp_path / "job.yaml"
    for secret, ready in (("s3-owner", True), ("s3-stranger", False), ("s3-missing", False)):
        doc = _s3_doc(env, "doc", f"s3://{bucket}/in/", f"s3://{bucket}/out/", secret, s3_service.endpoint)
        doc["metadata"]["namespace"] = env.ns
        spec.write_text(yaml.safe_dump(doc))
        code, out = doctor(str(spec))
        assert (code == 0) is ready, out
        if secret == "s3-owner":
            assert "OK    storage" in out and "OK    secret" in out and "OK    nodes" in out, out
        elif secret == "s3-stranger":
            lines = [ln for ln in out.splitlines() if ln.startswith("FAIL  storage.")]
            assert [ln.split()[1] for ln in lines] == ["storage.input", "storage.output"], out
            assert all("AccessDenied" in ln for ln in lines) and f"s3://{bucket}/in/" in lines[0], out
        else:
            assert f"Secret {env.ns}/s3-missing does not exist" in out, out
    # The probe pods are gone, and the probe left nothing under the output.
    wait_for(lambda: not [p for p in env.core.list_namespaced_pod(env.ns).items if "-doctor-" in p.metadata.name],
             60, "the probe pods to be gone")
    listed = boto3.client("s3", endpoint_url=s3_service.endpoint).list_objects_v2(Bucket=bucket, Prefix="out/")
    assert listed.get("KeyCount", 0) == 0
