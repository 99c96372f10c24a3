"""bij in real containers: the images `make images` built from the Dockerfile, run by containerd and
runc under a kubelet of the control plane's own release (tests/node), the chart installed with
real Helm, S3 served by versitygw on the pod network's host address.

What only a container runtime can show: the images' entry points and users, the chart's and the
round Jobs' securityContext as runc applies it (read-only root, no capabilities, no new
privileges, seccomp), SIGTERM delivered to the container's PID 1 on eviction and drained within
the grace period, the metrics port on the pod's own address, the model cache volume where the
spec mounts it, and where uid 1000 can and cannot write.

Needs root, `make images` and the node's tools (tests/node.missing() names what is absent);
without them every test here is skipped, saying why.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
GROUP, VERSION, PLURAL = "batchinference.io", "v1alpha1", "batchinferencejobs"
OPERATOR_IMAGE = os.environ.get("BIJ_OPERATOR_IMAGE", "localhost/bij-operator:dev")
WORKER_IMAGE = os.environ.get("BIJ_WORKER_IMAGE", "localhost/bij-worker:cpu")
# One node, labelled as a GKE spot node (round pods select it by that label) but not tainted: the
# operator and the publish Jobs, which tolerate no spot taint, run on it too. The process kubelet's
# cluster (tests/system/test_cluster.py) has the tainted spot nodes beside a CPU node.
SPOT_LABEL = "cloud.google.com/gke-spot"
BUCKET = "bij-e2e"
EMBED_DIM = 384  # all-MiniLM-L6-v2


def _missing() -> str | None:
    from node import missing

    why = missing()
    if why:
        return why
    for tool in ("buildah", "skopeo"):
        if shutil.which(tool) is None:
            return f"missing {tool}: `make images` builds the images with it"
    for image in (OPERATOR_IMAGE, WORKER_IMAGE):
        if subprocess.run(["buildah", "inspect", "--type", "image", image], capture_output=True).returncode != 0:
            return f"no image {image}: run `make images` first"
    return None


def load_image(node: Any, image: str, folder: Path) -> None:
    """`image` from buildah's storage into the node's containerd, through an OCI layout folder with
    its layers uncompressed (no gzip of GBs). containerd keeps its images between runs: while
    buildah's image is the same (its ID in a stamp) and containerd has it, nothing is copied."""
    image_id = subprocess.run(["buildah", "inspect", "--type", "image", "--format", "{{.FromImageID}}", image],
                              capture_output=True, text=True, check=True).stdout.strip()
    name = image.replace("/", "_").replace(":", "_")
    stamp = folder / f"{name}.imported"
    if stamp.exists():
        was_id, digest = stamp.read_text().split()
        if was_id == image_id and node.has_image(image, digest):
            return
    layout = folder / name
    shutil.rmtree(layout, ignore_errors=True)
    subprocess.run(["skopeo", "copy", "--quiet", "--dest-oci-accept-uncompressed-layers",
                    f"containers-storage:{image}", f"oci:{layout}:{image}"], check=True, capture_output=True)
    try:
        node.import_image(layout)
        (manifest,) = json.loads((layout / "index.json").read_text())["manifests"]
        stamp.write_text(f"{image_id} {manifest['digest']}")
    finally:
        shutil.rmtree(layout, ignore_errors=True)


def s3_secret(s3: Any) -> dict[str, Any]:
    return {"metadata": {"name": "s3-credentials"}, "stringData": {
        "AWS_ACCESS_KEY_ID": s3.root.access_key, "AWS_SECRET_ACCESS_KEY": s3.root.secret_key}}


@dataclass
class RealCluster:
    cluster: Any  # cluster.harness.LocalCluster, on the real control plane
    node: Any  # node.Node
    s3: Any  # s3server.S3Server
    values: dict[str, Any]  # the chart values the operator was installed with

    @property
    def api(self) -> Any:
        return self.cluster.api

    @contextmanager
    def operator_with(self, **values: Any) -> Iterator[None]:
        """The operator upgraded with these chart values on top of the fixture's (`helm upgrade`), and back after."""
        old = self.cluster.operator_pod()["metadata"]["uid"]
        self.cluster.install_operator(values={**self.values, **values}, timeout=300)
        changed = self.cluster.operator_pod(timeout=180, not_uid=old)["metadata"]["uid"]
        try:
            yield
        finally:
            self.cluster.install_operator(values=self.values, timeout=300)
            self.cluster.operator_pod(timeout=180, not_uid=changed)

    def kubectl(self, *args: str, check: bool = True) -> str:
        return str(self.cluster.kubectl(*args, check=check).stdout)

    def exec(self, ns: str, pod: str, code: str) -> dict[str, Any]:
        """Run Python `code` (printing one JSON document) in `pod`'s container through the API server,
        the kubelet and containerd, as `kubectl exec` does."""
        proc = self.cluster.kubectl("-n", ns, "exec", pod, "--", "python3", "-c", code, check=False)
        assert proc.returncode == 0, f"kubectl exec {pod}: {proc.stderr}"
        return dict(json.loads(proc.stdout))


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealCluster]:
    why = _missing()
    if why:
        pytest.skip(f"real-node e2e: {why}")
    import s3server
    from cluster.controlplane import ControlPlane
    from cluster.harness import LocalCluster, wait_for
    from node import GATEWAY, Node, pod_network

    exe = s3server.binary()
    if exe is None:
        pytest.skip("real-node e2e: no versitygw (make s3-bin)")

    state = tmp_path_factory.mktemp("real")
    pod_network()
    s3 = s3server.S3Server(exe, state / "s3", host=GATEWAY)
    plane = ControlPlane(state / "plane", address=GATEWAY)
    node = Node(plane, ROOT / ".node" / "state", labels={SPOT_LABEL: "true"})
    try:
        s3.start()
        plane.start()
        node.start(kubelet=False)
        for image in (OPERATOR_IMAGE, WORKER_IMAGE):
            load_image(node, image, node.state)
        node.start_kubelet()
        Ns(RealCluster(None, node, s3, {}), "").s3().create_bucket(Bucket=BUCKET)
        cluster = LocalCluster(state / "plane")
        cluster.plane = plane
        cluster.connect()
        import kubernetes

        core = kubernetes.client.CoreV1Api(cluster.api)
        wait_for(lambda: any(c.type == "Ready" and c.status == "True"
                             for n in core.list_node().items for c in n.status.conditions or []),
                 120, "the node Ready")
        # The operator has no storage identity: a bij's pods reach S3 with the bij's own credentials.
        repo, tag = OPERATOR_IMAGE.rsplit(":", 1)
        wrepo, wtag = WORKER_IMAGE.rsplit(":", 1)
        values = {
            "image": {"repository": repo, "tag": tag, "pullPolicy": "Never"},
            "workerImage": {"repository": wrepo, "tag": wtag},
            "extraArgs": ["--status-interval", "0.5"],
            # Pods in containers share no folder with this machine: S3 only, as on a real cluster.
            "fileStorage": {"mountPath": "", "volume": {}},
        }
        cluster.install_operator(values=values, timeout=300)
        yield RealCluster(cluster, node, s3, values)
    finally:
        node.stop()
        plane.stop()
        s3.stop()


@dataclass
class Ns:
    real: RealCluster
    name: str

    @property
    def core(self) -> Any:
        import kubernetes

        return kubernetes.client.CoreV1Api(self.real.api)

    @property
    def custom(self) -> Any:
        import kubernetes

        return kubernetes.client.CustomObjectsApi(self.real.api)

    def s3(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.real.s3.endpoint, region_name="us-east-1",
                            aws_access_key_id=self.real.s3.root.access_key,
                            aws_secret_access_key=self.real.s3.root.secret_key)

    def create(self, name: str, spec: dict[str, Any]) -> None:
        doc = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "BatchInferenceJob", "metadata": {"name": name},
               "spec": spec}
        self.custom.create_namespaced_custom_object(GROUP, VERSION, self.name, PLURAL, doc)

    def status(self, name: str) -> dict[str, Any]:
        return dict(self.custom.get_namespaced_custom_object(GROUP, VERSION, self.name, PLURAL, name).get("status")
                    or {})

    def wait_phase(self, name: str, phase: str, timeout: float) -> dict[str, Any]:
        from cluster.harness import wait_for

        def reached() -> dict[str, Any] | None:
            st = self.status(name)
            if st.get("phase") == phase:
                return st
            if st.get("phase") in ("Succeeded", "Failed"):
                raise AssertionError(f"{name} ended {st.get('phase')}: {st.get('message')}")
            return None

        try:
            return wait_for(reached, timeout, f"bij {name} {phase}", interval=0.5)
        except (TimeoutError, AssertionError):
            print(json.dumps(self.status(name), indent=1)[-3000:])
            print(self.real.kubectl("-n", self.name, "get", "pods,jobs", "-o", "wide", check=False))
            print(self.real.kubectl("-n", self.name, "logs", "--all-containers", "--prefix", "--tail=40",
                                    "-l", "batch.kubernetes.io/job-name", check=False))
            raise

    def put_rows(self, key: str, n: int) -> list[str]:
        ids = [f"row-{i}" for i in range(n)]
        body = "".join(json.dumps({"id": rid, "text": f"row {i}: the quick brown fox jumps over the lazy dog"}) + "\n"
                       for i, rid in enumerate(ids))
        self.s3().put_object(Bucket=BUCKET, Key=key, Body=body.encode())
        return ids

    def published(self, manifest_key: str) -> list[dict[str, Any]]:
        s3 = self.s3()
        manifest = json.loads(s3.get_object(Bucket=BUCKET, Key=manifest_key)["Body"].read())
        folder = manifest_key.rsplit("/", 1)[0]
        rows: list[dict[str, Any]] = []
        for f in manifest["files"]:
            body = s3.get_object(Bucket=BUCKET, Key=f"{folder}/{f['path']}")["Body"].read().decode()
            rows.extend(json.loads(line) for line in body.splitlines() if line.strip())
        return rows

    def spec(self, prefix: str, **over: Any) -> dict[str, Any]:
        body: dict[str, Any] = {
            "input": {"uri": f"s3://{BUCKET}/{self.name}/{prefix}-in/rows.jsonl"},
            "output": {"uri": f"s3://{BUCKET}/{self.name}/{prefix}-out/", "format": "jsonl", "compression": "none"},
            "storage": {"s3": {"endpointUrl": self.real.s3.endpoint, "region": "us-east-1"},
                        "credentialsSecret": "s3-credentials"},
            "workers": {"parallelism": 1, "spot": True, "spotProvider": "gke", "backoffLimitPerIndex": 2,
                        "terminationGracePeriodSeconds": 30, "shmSize": "64Mi"},
        }
        for key, value in over.items():
            body[key] = {**body[key], **value} if isinstance(value, dict) and isinstance(body.get(key), dict) else value
        return body

    def pods(self, job: str) -> list[Any]:
        selector = f"batch.kubernetes.io/job-name={job}"
        return list(self.core.list_namespaced_pod(self.name, label_selector=selector).items)

    def events(self, name: str) -> list[Any]:
        """The Events about bij `name`, oldest first."""
        evs = self.core.list_namespaced_event(self.name, field_selector=f"involvedObject.name={name}").items
        return sorted(evs, key=lambda e: str(e.first_timestamp or e.event_time or ""))

    def running_with_progress(self, job: str, rows: int) -> tuple[Any, str] | None:
        """A Running worker pod of Job `job` once its metrics, scraped over the pod network at the pod's own
        address, count `rows` rows done."""
        pod = next((p for p in self.pods(job) if p.status.phase == "Running" and p.status.pod_ip), None)
        if pod is None:
            return None
        try:
            with urllib.request.urlopen(f"http://{pod.status.pod_ip}:9400/metrics", timeout=5) as r:
                metrics = r.read().decode()
        except OSError:
            return None
        return (pod, metrics) if rows_ok(metrics) >= rows else None

    def no_manifest(self, prefix: str) -> bool:
        listed = self.s3().list_objects_v2(Bucket=BUCKET, Prefix=f"{self.name}/{prefix}-out/")
        return not any(o["Key"].endswith("manifest.json") for o in listed.get("Contents") or [])


@pytest.fixture()
def ns(real: RealCluster) -> Iterator[Ns]:
    from cluster.harness import add_worker_account, wait_for

    name = f"e2e-{uuid.uuid4().hex[:6]}"
    n = Ns(real, name)
    n.core.create_namespace({"metadata": {"name": name}})
    wait_for(lambda: n.core.read_namespaced_service_account("default", name), 30, "the default service account")
    add_worker_account(real.api, name)  # a bij's pods run as bij-worker and report into its status
    n.core.create_namespaced_secret(name, s3_secret(real.s3))
    yield n
    n.core.delete_namespace(name)


# --- the operator pod -----------------------------------------------------------------------------

PROBE = r"""
import json, os
def writable(path):
    try:
        with open(os.path.join(path, ".bij-probe"), "w"):
            pass
        os.unlink(os.path.join(path, ".bij-probe"))
        return True
    except OSError:
        return False
status = dict(line.split(":\t", 1) for line in open("/proc/self/status").read().splitlines() if ":\t" in line)
paths = json.loads(os.environ.get("PROBE_PATHS", "[]")) or %s
print(json.dumps({
    "uid": os.getuid(), "gid": os.getgid(), "groups": sorted(os.getgroups()),
    "pid1": open("/proc/1/cmdline").read().split("\0"),
    "no_new_privs": status["NoNewPrivs"].strip(), "seccomp": status["Seccomp"].strip(),
    "cap_eff": status["CapEff"].strip(),
    "writable": {p: writable(p) for p in paths},
    "mounts": [line.split()[1] for line in open("/proc/self/mounts")],
    "env": {k: v for k, v in os.environ.items() if k in ("HOME", "HF_HOME", "BIJ_DRAIN_SECONDS")},
}))
"""


def rows_ok(metrics: str) -> float:
    """bij_rows_total{status="ok"} in a /metrics page (0 before the first row)."""
    for line in metrics.splitlines():
        if line.startswith('bij_rows_total{status="ok"}'):
            return float(line.split()[-1])
    return 0.0


def probe(real: RealCluster, ns: str, pod: str, paths: list[str]) -> dict[str, Any]:
    return real.exec(ns, pod, PROBE % json.dumps(paths))


def test_the_operator_runs_from_its_image_under_the_charts_security_context(real: RealCluster) -> None:
    pod = real.cluster.operator_pod()
    (status,) = pod["status"]["containerStatuses"]
    assert status["image"].endswith(OPERATOR_IMAGE.split("/", 1)[1]) and status["ready"]
    assert status["restartCount"] == 0
    assert pod["spec"]["nodeName"] == real.node.name
    seen = probe(real, "bij-system", pod["metadata"]["name"], ["/", "/tmp", "/etc", "/usr/lib"])
    # The chart's command is PID 1 (through the console script's interpreter line), as uid 1000.
    assert seen["pid1"][1:3] == ["/usr/local/bin/bij", "operator"], seen["pid1"]
    assert (seen["uid"], seen["gid"]) == (1000, 1000)
    # readOnlyRootFilesystem, with the chart's emptyDir at /tmp the only place to write.
    assert seen["writable"] == {"/": False, "/tmp": True, "/etc": False, "/usr/lib": False}
    # allowPrivilegeEscalation: false, drop ALL, seccomp RuntimeDefault: as runc applied them.
    assert seen["no_new_privs"] == "1"
    assert int(seen["cap_eff"], 16) == 0
    assert seen["seccomp"] == "2"  # filter mode


# --- an embedding job --------------------------------------------------------------------------------


def test_an_embedding_job_runs_to_succeeded_in_the_worker_image_with_every_row_once(ns: Ns) -> None:
    ids = ns.put_rows(f"{ns.name}/emb-in/rows.jsonl", 300)
    ns.create("emb", ns.spec("emb", model={"engine": "sentence-transformers", "task": "embed"},
                             sharding={"targetShardBytes": 8192, "chunkRows": 32}))
    done = ns.wait_phase("emb", "Succeeded", timeout=900)
    assert done["rows"]["done"] == len(ids)
    rows = ns.published(f"{ns.name}/emb-out/manifest.json")
    assert sorted(r["id"] for r in rows) == sorted(ids)  # every row exactly once
    for r in rows:
        assert len(r["embedding"]) == EMBED_DIM and all(isinstance(x, float) for x in r["embedding"])
    # Rows with the same text but their number embed differently: the model ran on each.
    assert rows[0]["embedding"] != rows[1]["embedding"]
    worker_pods = ns.pods("emb-r0")
    assert worker_pods
    for p in worker_pods:
        (st,) = p.status.container_statuses
        assert st.image.endswith(WORKER_IMAGE.split("/", 1)[1])
        assert st.state.terminated is not None and st.state.terminated.exit_code == 0
    # Its steps ran on the steps image (by default the operator's: bij without an engine), not the worker's.
    for step in ("emb-plan-r0", "emb-finish-r0", "emb-publish-plan", "emb-manifest"):
        step_pods = ns.pods(step)
        assert step_pods, step
        for p in step_pods:
            (st,) = p.status.container_statuses
            assert st.image.endswith(OPERATOR_IMAGE.split("/", 1)[1]), (step, st.image)


def test_a_pool_whose_pods_find_no_node_gives_its_lanes_to_the_next_and_every_row_runs_once(ns: Ns) -> None:
    ids = ns.put_rows(f"{ns.name}/pools-in/rows.jsonl", 200)
    pools = [
        # Preferred, but no node has its label: its pods stay Pending (Unschedulable) until it gives up.
        {"name": "absent", "nodeSelector": {"bij.test/pool": "absent"}, "startTimeoutSeconds": 10},
        {"name": "spot"},  # the workers' spot placement: the node
    ]
    ns.create("pools", ns.spec("pools", model={"engine": "echo", "task": "embed"},
                               workers={"parallelism": 2, "pools": pools},
                               sharding={"targetShardBytes": 4096, "chunkRows": 16}))
    done = ns.wait_phase("pools", "Succeeded", timeout=600)
    rows = ns.published(f"{ns.name}/pools-out/manifest.json")
    assert sorted(r["id"] for r in rows) == sorted(ids)  # every row exactly once
    assert [(p["name"], p["lanes"]) for p in done["pools"]] == [("absent", 0), ("spot", 2)]
    assert "PoolGaveUp" in [e.reason for e in ns.events("pools")]
    moved = [p for p in ns.pods("pools-r0-p1f0")]
    assert moved and all(p.status.container_statuses[0].state.terminated.exit_code == 0 for p in moved)


# --- eviction: SIGTERM to PID 1, drained, resumed ------------------------------------------------------


def test_an_evicted_worker_drains_on_sigterm_and_its_replacement_resumes(ns: Ns) -> None:
    import kubernetes
    from cluster.harness import wait_for

    ids = ns.put_rows(f"{ns.name}/ev-in/rows.jsonl", 400)
    grace = 20
    # One shard of 8-row chunks, each chunk ~1 s on the simulated engine's clock: long enough to be
    # caught mid-round, and a chunk in flight finishes well within the drain time.
    ns.create("ev", ns.spec(
        "ev", model={"engine": "simulated", "task": "generate", "maxTokens": 4,
                     "simulated": {"maxNumSeqs": 8, "stepSeconds": 0.25}},
        sharding={"targetShardBytes": 1 << 20, "chunkRows": 8},
        workers={"terminationGracePeriodSeconds": grace,
                 "modelCache": {"type": "emptyDir", "mountPath": "/var/cache/bij-models"}}))

    pod, metrics = wait_for(lambda: ns.running_with_progress("ev-r0", 16), 600,
                            "the worker pod running with two chunks done", interval=0.3)
    name = pod.metadata.name
    assert "# TYPE bij_rows_total counter" in metrics and rows_ok(metrics) < len(ids)

    # The worker image as the round Job runs it: uid 1000, the model cache where the spec mounts it.
    seen = probe(ns.real, ns.name, name, ["/", "/etc", "/usr/local/lib", "/usr/lib/python3", "/home/bij", "/tmp",
                                          "/var/cache/bij-models", "/models"])
    assert (seen["uid"], seen["gid"]) == (1000, 1000) and 1000 in seen["groups"]
    assert seen["pid1"][1] == "/usr/local/bin/bij-worker", seen["pid1"]  # PID 1 is the worker itself
    assert "/var/cache/bij-models" in seen["mounts"]
    assert seen["env"]["HF_HOME"] == "/var/cache/bij-models/huggingface"
    assert seen["writable"] == {
        "/": False, "/etc": False, "/usr/local/lib": False, "/usr/lib/python3": False,  # the image's own files
        "/home/bij": True,  # HOME: engines' caches
        "/tmp": True,
        "/var/cache/bij-models": True,  # the model cache volume, through fsGroup
        "/models": True,  # the image's default cache folder, owned by uid 1000
    }
    assert seen["no_new_privs"] == "1" and int(seen["cap_eff"], 16) == 0 and seen["seccomp"] == "2"

    core = ns.core
    before = core.read_namespaced_pod(name, ns.name)
    core.create_namespaced_pod_eviction(name, ns.name, kubernetes.client.V1Eviction(
        metadata=kubernetes.client.V1ObjectMeta(name=name, namespace=ns.name)))
    evicted_at = time.monotonic()

    # Every update of the pod from the eviction on, until its container has terminated.
    terminated = None
    watch = kubernetes.watch.Watch()
    for event in watch.stream(core.list_namespaced_pod, ns.name, field_selector=f"metadata.name={name}",
                              resource_version=before.metadata.resource_version, timeout_seconds=grace + 60):
        statuses = event["object"].status.container_statuses or []
        if statuses and statuses[0].state.terminated is not None:
            terminated = statuses[0].state.terminated
            watch.stop()
    assert terminated is not None, "the evicted pod's container never terminated"
    took = time.monotonic() - evicted_at
    # 143: the worker caught SIGTERM as PID 1 and exited after draining; 137 would be the kubelet's SIGKILL.
    assert terminated.exit_code == 143, f"exit {terminated.exit_code} ({terminated.reason})"
    assert took < grace, f"the drain took {took:.0f} s of a {grace} s grace period"

    done = ns.wait_phase("ev", "Succeeded", timeout=600)
    assert done["rows"]["done"] == len(ids)
    rows = ns.published(f"{ns.name}/ev-out/manifest.json")
    assert sorted(r["id"] for r in rows) == sorted(ids)  # every row once: nothing lost, nothing twice
    job = kubernetes.client.BatchV1Api(ns.real.api).read_namespaced_job("ev-r0", ns.name)
    assert not job.status.failed  # an eviction is a disruption, not a failure
    replacements = [p for p in ns.pods("ev-r0") if p.metadata.name != name]
    assert replacements and any(p.status.phase == "Succeeded" for p in replacements)


# --- a step pod that cannot start, a step pod killed by its memory limit ------------------------------


def test_a_step_pod_whose_image_cannot_be_pulled_is_shown_and_the_bij_can_still_be_cancelled(ns: Ns) -> None:
    from cluster.harness import wait_for

    ns.put_rows(f"{ns.name}/pull-in/rows.jsonl", 20)
    with ns.real.operator_with(stepsImage={"repository": "localhost/bij-no-such-steps", "tag": "none"}):
        ns.create("pull", ns.spec("pull", model={"engine": "echo", "task": "embed"}))
        st = wait_for(lambda: (s if "step plan-r0 cannot start" in (s := ns.status("pull")).get("message", "")
                               else None), 300, "the plan step said to be stuck", interval=0.5)
        # The phase, a Condition and a Warning Event each name the Job, the pod and the kubelet's reason.
        assert st["phase"] == "Planning"
        assert any(r in st["message"] for r in ("ErrImagePull", "ImagePullBackOff")), st["message"]
        assert "Job pull-plan-r0, pod pull-plan-r0-0-" in st["message"]
        ready = next(c for c in st["conditions"] if c["type"] == "Ready")
        assert ready["status"] == "False" and ready["reason"] == "StepCannotStart", ready
        # kopf posts the Event from its own task, after the status patch.
        stuck = wait_for(lambda: [e for e in ns.events("pull") if e.reason == "StepCannotStart"] or None, 30,
                         "the StepCannotStart Event")
        assert stuck[0].type == "Warning" and "localhost/bij-no-such-steps" in stuck[0].message

        # Cancelling it cannot wait for a plan step that will never start: it ends now, nothing ran.
        ns.custom.patch_namespaced_custom_object(GROUP, VERSION, ns.name, PLURAL, "pull", {"spec": {"cancel": True}})
        done = ns.wait_phase("pull", "Cancelled", timeout=120)
        assert "could not be planned" in done["message"] and "nothing was published" in done["message"]
        assert next(c for c in done["conditions"] if c["type"] == "Ready")["status"] == "False"
        wait_for(lambda: not ns.pods("pull-plan-r0") or None, 120, "the stuck plan step's pod gone")
        assert ns.no_manifest("pull")


def test_a_step_pod_killed_by_its_memory_limit_is_retried_then_fails_the_bij_naming_oomkilled(ns: Ns) -> None:
    ns.put_rows(f"{ns.name}/oom-in/rows.jsonl", 20)
    # Below what the step's Python needs to import bij: the kernel kills it as it starts.
    tiny = {"requests": {"cpu": "100m", "memory": "24Mi"}, "limits": {"memory": "24Mi"}}
    with ns.real.operator_with(stepResources=tiny):
        ns.create("oom", ns.spec("oom", model={"engine": "echo", "task": "embed"},
                                 workers={"backoffLimitPerIndex": 1}))
        failed = ns.wait_phase("oom", "Failed", timeout=600)
    message = failed["message"]
    assert "step plan-r0 failed 2 time(s), giving up" in message, message
    assert "exit code 137 (OOMKilled)" in message, message
    cond = next(c for c in failed["conditions"] if c["type"] == "Failed")
    assert cond["status"] == "True" and "OOMKilled" in cond["message"]
    from cluster.harness import wait_for

    # kopf posts the StepFailed Event from its own task, after the status patch that set the phase.
    reasons = wait_for(lambda: (lambda r: r if "StepFailed" in r else None)([e.reason for e in ns.events("oom")]),
                       30, "the StepFailed Event")
    assert "StepRetrying" in reasons, reasons
    retry = next(e for e in ns.events("oom") if e.reason == "StepRetrying")
    assert retry.type == "Warning" and "OOMKilled" in retry.message
    assert ns.no_manifest("oom")


# --- a worker killed by the kernel's OOM killer mid-shard --------------------------------------------

ALLOCATE = r"""
import os, sys, time
cgroup, pids, cap = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3])

def alive(pid):  # a killed worker stays a zombie until its shim reaps it
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False

with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
    f.write(str(os.getpid()))
held, deadline = [], time.monotonic() + 120
while any(alive(p) for p in pids) and time.monotonic() < deadline and len(held) * 32 < cap:
    held.append(bytearray(b"x") * (32 << 20))  # written, so the pages are charged to the cgroup
    time.sleep(0.02)
sys.exit(0 if not any(alive(p) for p in pids) else 3)
"""


def container_memory_cgroup(container_id: str) -> Path:
    """The cgroup v1 memory folder of a container (the kubelet's cgroupfs driver names it by the container's id)."""
    root = Path("/sys/fs/cgroup/memory")
    for folder, dirs, _ in os.walk(root):
        if container_id in dirs:
            return Path(folder) / container_id
    raise AssertionError(f"no memory cgroup for container {container_id} under {root}")


def test_a_worker_oom_killed_mid_shard_is_replaced_and_its_shard_resumes(ns: Ns) -> None:
    import kubernetes
    from cluster.harness import wait_for

    ids = ns.put_rows(f"{ns.name}/wo-in/rows.jsonl", 400)
    ns.create("wo", ns.spec(
        "wo", model={"engine": "simulated", "task": "generate", "maxTokens": 4,
                     "simulated": {"maxNumSeqs": 8, "stepSeconds": 0.25}},
        sharding={"targetShardBytes": 1 << 20, "chunkRows": 8}, workers={"memory": "1Gi"}))
    pod, _ = wait_for(lambda: ns.running_with_progress("wo-r0", 16), 600, "the worker with two chunks done",
                      interval=0.3)
    (status,) = pod.status.container_statuses
    cgroup = container_memory_cgroup(status.container_id.split("://", 1)[1])
    assert int((cgroup / "memory.limit_in_bytes").read_text()) == 1 << 30  # the spec's limit, as runc set it
    pids = (cgroup / "cgroup.procs").read_text().split()
    for pid in pids:  # the worker is the one the kernel picks in its cgroup
        Path(f"/proc/{pid}/oom_score_adj").write_text("1000")
    # Memory charged to the worker's cgroup until its limit is reached: the kernel's OOM killer, as a
    # worker that outgrows its limit meets it.
    alloc = subprocess.run(["python3", "-c", ALLOCATE, str(cgroup), ",".join(pids), str(2048)],
                           capture_output=True, text=True, timeout=180)
    # -9: the container's end came first, and its cgroup was emptied with this process in it (runc's
    # clean-up kills whatever is left there). Which of the two is killed by the OOM killer is read below.
    assert alloc.returncode in (0, -9), f"the worker outlived its limit: exit {alloc.returncode} {alloc.stderr}"

    def ended() -> Any:
        (st,) = ns.core.read_namespaced_pod(pod.metadata.name, ns.name).status.container_statuses
        return st.state.terminated

    terminated = wait_for(ended, 120, "the OOM-killed worker's container ended")
    assert (terminated.exit_code, terminated.reason) == (137, "OOMKilled"), terminated

    done = ns.wait_phase("wo", "Succeeded", timeout=600)
    assert done["rows"]["done"] == len(ids)
    rows = ns.published(f"{ns.name}/wo-out/manifest.json")
    assert sorted(r["id"] for r in rows) == sorted(ids)  # every row once: the shard resumed, nothing twice
    job = kubernetes.client.BatchV1Api(ns.real.api).read_namespaced_job("wo-r0", ns.name)
    assert job.status.failed == 1  # an OOM kill is a failure of the pod (counted), not a disruption
    replacements = [p for p in ns.pods("wo-r0") if p.metadata.name != pod.metadata.name]
    assert replacements and any(p.status.phase == "Succeeded" for p in replacements)
