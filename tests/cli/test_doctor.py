"""`bij doctor`'s pure parts: which nodes can take a worker pod, what a probe pod says, the storage probe
itself on file://, and the one list of the worker identity's grants the chart's Role must equal.
(The whole command against the real control plane: tests/system/test_cluster.py; the chart's worker Role
against `WORKER_GRANTS`: tests/system/test_chart.py.)"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from bij.cli.doctor import (
    Doctor,
    Finding,
    format_report,
    node_fits,
    nodes_finding,
    pod_findings,
    probe_pod,
)
from bij.contract.spec import parse_job
from bij.control.jobs import render_job
from bij.control.permissions import WORKER_GRANTS, grant_fix
from bij.steps.probe import probe


def job(**spec: Any) -> Any:
    body: dict[str, Any] = {"input": {"uri": "s3://in/data/"}, "output": {"uri": "s3://out/run/"},
                            "model": {"engine": "echo", "task": "generate"}}
    body.update(spec)
    return parse_job({"apiVersion": "batchinference.io/v1alpha1", "kind": "BatchInferenceJob",
                      "metadata": {"name": "j", "namespace": "team"}, "spec": body})


def node(name: str, labels: dict[str, str] | None = None, taints: list[dict[str, str]] | None = None,
         gpus: int = 0, cordoned: bool = False) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels or {}},
            "spec": {"taints": taints or [], "unschedulable": cordoned},
            "status": {"allocatable": {"cpu": "8", **({"nvidia.com/gpu": str(gpus)} if gpus else {})}}}


def worker_pod(j: Any) -> dict[str, Any]:
    return render_job(j, 0, 1, "s3://out/run/_bij/x/round-0/shards.json")["spec"]["template"]["spec"]


GKE_SPOT_TAINT = {"key": "cloud.google.com/gke-spot", "value": "true", "effect": "NoSchedule"}
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


@pytest.mark.parametrize(("spec", "n", "why"), [
    ({}, node("cpu"), None),
    ({}, node("tainted", taints=[GPU_TAINT]), "taint nvidia.com/gpu=present:NoSchedule not tolerated"),
    ({"workers": {"gpus": 1}}, node("gpu", taints=[GPU_TAINT], gpus=1), None),
    ({"workers": {"gpus": 2}}, node("gpu", taints=[GPU_TAINT], gpus=1), "has 1 nvidia.com/gpu, the pod needs 2"),
    ({"workers": {"gpus": 1}}, node("cpu"), "has 0 nvidia.com/gpu, the pod needs 1"),
    ({"workers": {"spot": True, "spotProvider": "gke"}},
     node("spot", {"cloud.google.com/gke-spot": "true"}, [GKE_SPOT_TAINT]), None),
    ({"workers": {"spot": True, "spotProvider": "gke"}}, node("cpu"), "lacks label cloud.google.com/gke-spot=true"),
    ({"workers": {"nodeSelector": {"pool": "a100"}}}, node("other", {"pool": "h100"}), "lacks label pool=a100"),
    ({"workers": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a", "b"]}]}]}}}}},
     node("c", {"zone": "c"}), "outside the required node affinity"),
    ({}, node("off", cordoned=True), "cordoned"),
])
def test_a_node_fits_a_worker_pod_as_the_scheduler_would_judge_it(spec: dict[str, Any], n: dict[str, Any],
                                                                   why: str | None) -> None:
    assert node_fits(worker_pod(job(**spec)), n) == why


def test_no_fitting_node_is_a_warning_that_counts_each_reason() -> None:
    pod = worker_pod(job(workers={"gpus": 1}))
    found = nodes_finding(pod, [node("a"), node("b"), node("t", taints=[GPU_TAINT], gpus=1, cordoned=True)])
    assert found.level == "warn"
    assert "2 has 0 nvidia.com/gpu, the pod needs 1" in found.detail and "1 cordoned" in found.detail
    ok = nodes_finding(pod, [node("a"), node("g", taints=[GPU_TAINT], gpus=4)])
    assert ok.level == "ok" and "1 of 2" in ok.detail and "g" in ok.detail


def test_the_probe_pod_runs_the_probe_under_the_worker_identity_without_the_gpu_placement() -> None:
    j = job(workers={"gpus": 1, "spot": True, "spotProvider": "gke", "serviceAccountName": "mine"},
            storage={"credentialsSecret": "s3-keys"})
    pod = probe_pod(j, "registry/bij-worker:1", None, "j-doctor-abc", 60)
    spec = pod["spec"]
    (c,) = spec["containers"]
    assert pod["metadata"] == {"name": "j-doctor-abc", "namespace": "team", "labels": pod["metadata"]["labels"]}
    assert spec["serviceAccountName"] == "mine" and spec["restartPolicy"] == "Never"
    assert spec["activeDeadlineSeconds"] == 60
    assert "nodeSelector" not in spec and "tolerations" not in spec and "resources" not in c
    assert c["image"] == "registry/bij-worker:1" and c["envFrom"] == [{"secretRef": {"name": "s3-keys"}}]
    assert c["args"][0] == "probe" and json.loads(c["args"][2])["metadata"]["name"] == "j"
    assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"


def _pod(state: dict[str, Any], phase: str = "Pending") -> dict[str, Any]:
    return {"spec": {"containers": [{"image": "img:1"}]},
            "status": {"phase": phase, "containerStatuses": [{"state": state}]}}


def test_what_a_probe_pod_says_becomes_findings() -> None:
    assert pod_findings(_pod({"running": {}}, "Running")) is None
    assert pod_findings(_pod({"waiting": {"reason": "ContainerCreating"}})) is None
    (image,) = pod_findings(_pod({"waiting": {"reason": "ImagePullBackOff", "message": "not found"}})) or []
    assert image.level == "fail" and "img:1 cannot be pulled: ImagePullBackOff: not found" in image.detail
    done = pod_findings(_pod({"terminated": {"exitCode": 0}}, "Succeeded")) or []
    assert [(f.check, f.level) for f in done] == [("image", "ok"), ("storage", "ok")]
    lines = "\n".join([json.dumps({"check": "input", "ok": True, "detail": "3 object(s)"}),
                       json.dumps({"check": "output", "ok": False, "detail": "AccessDenied on s3://out/"}),
                       json.dumps({"summary": "failed"})])
    failed = pod_findings(_pod({"terminated": {"exitCode": 1, "message": lines}}, "Failed")) or []
    assert [(f.check, f.level) for f in failed] == [("image", "ok"), ("storage.input", "ok"),
                                                     ("storage.output", "fail")]
    assert "AccessDenied on s3://out/" in failed[2].detail and failed[2].fix
    crashed = pod_findings(_pod({"terminated": {"exitCode": 2, "message": "Traceback ...\nImportError: x"}},
                                "Failed")) or []
    assert crashed[-1].level == "fail" and "exited 2" in crashed[-1].detail and "ImportError" in crashed[-1].detail


def test_the_storage_probe_lists_the_input_and_writes_reads_and_deletes_under_the_output(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text('{"id": 1, "text": "x"}\n')
    doc = {"apiVersion": "batchinference.io/v1alpha1", "kind": "BatchInferenceJob", "metadata": {"name": "p"},
           "spec": {"input": {"uri": f"file://{tmp_path}/in/"}, "output": {"uri": f"file://{tmp_path}/out/"}}}
    results = probe(doc)
    assert [(r["check"], r["ok"]) for r in results] == [("input", True), ("output", True)], results
    leftovers = [p for p in (tmp_path / "out").rglob("*") if p.is_file()]
    assert leftovers == []

    doc["spec"]["input"]["uri"] = f"file://{tmp_path}/missing/"
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    doc["spec"]["output"]["uri"] = f"file://{locked}/out/"
    try:
        results = probe(doc)
    finally:
        locked.chmod(0o700)
    assert results[0]["check"] == "input" and not results[0]["ok"] and "missing" in results[0]["detail"]
    if os.geteuid() != 0:  # root writes through any mode bits
        assert results[1]["check"] == "output" and not results[1]["ok"] and str(locked) in results[1]["detail"]
    assert probe({"spec": {"input": {}}})[0]["check"] == "spec"


def test_a_missing_grant_names_the_verb_and_the_commands_that_grant_it() -> None:
    fix = grant_fix("team", "bij-worker", list(WORKER_GRANTS))
    role = ("kubectl -n team create role bij-worker --verb=create,patch "
            "--resource=batchinferencejobs.batchinference.io/status --resource=leases.coordination.k8s.io")
    assert role in fix
    assert "--serviceaccount=team:bij-worker" in fix
    report = format_report([Finding("rbac", "fail", "may not patch", fix), Finding("nodes", "warn", "none fit"),
                            Finding("namespace", "ok", "exists", "unused")])
    assert "FAIL  rbac" in report and f"fix: {fix}" in report and "unused" not in report
    assert report.splitlines()[-1] == "not ready: 1 check(s) failed, 1 warning(s)"
    assert format_report([Finding("namespace", "ok", "exists")]).splitlines()[-1] == "ready"


def test_the_storage_probe_reaches_gs_through_the_gcs_endpoint(gs_place: Any) -> None:
    gs_place.write_jsonl("in/a.jsonl", [{"id": 1, "text": "x"}])
    doc = {"apiVersion": "batchinference.io/v1alpha1", "kind": "BatchInferenceJob", "metadata": {"name": "p"},
           "spec": {"input": {"uri": gs_place.uri("in/")}, "output": {"uri": gs_place.uri("out/")}}}
    results = probe(doc)
    assert [(r["check"], r["ok"]) for r in results] == [("input", True), ("output", True)], results
    assert gs_place.storage.list(gs_place.uri("out/")) == []


@pytest.mark.parametrize(("uri", "keys", "level"), [
    ("gs://in/data/", {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}, "ok"),
    ("gs://in/data/", {"HF_TOKEN"}, "fail"),  # GCS's XML API signs with an HMAC key only
    ("s3://in/data/", {"HF_TOKEN"}, "warn"),  # S3 may sign with the pod's own identity (IRSA)
    ("az://in/data/", {"AZURE_STORAGE_CONNECTION_STRING"}, "ok"),
    ("az://in/data/", {"AZURE_STORAGE_ACCOUNT", "AZURE_STORAGE_SAS_TOKEN"}, "ok"),
    ("az://in/data/", {"AZURE_STORAGE_ACCOUNT"}, "fail"),  # an account without its key or a SAS cannot sign
])
def test_a_gs_or_az_job_needs_a_key_its_store_takes_in_its_secret(uri: str, keys: set[str], level: str) -> None:
    from types import SimpleNamespace

    doctor = Doctor.__new__(Doctor)
    doctor.core = SimpleNamespace(read_namespaced_secret=lambda name, ns: SimpleNamespace(
        data=dict.fromkeys(keys, "eA=="), string_data=None))
    finding = doctor.secret("team", "keys", job(input={"uri": uri}, output={"uri": uri.replace("data/", "out/")}))
    assert finding.level == level, finding
    if level == "fail" and uri.startswith("az://"):
        assert "az:// needs AZURE_STORAGE_CONNECTION_STRING" in finding.detail and "connection-string" in finding.fix
    elif level == "fail":
        assert "gs:// needs a Cloud Storage HMAC key" in finding.detail
        assert "gcloud storage hmac create" in finding.fix and "AWS_SECRET_ACCESS_KEY=SECRET" in finding.fix
