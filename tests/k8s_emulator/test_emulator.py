"""The emulator behaves like the API server and Job controller where the operator can tell."""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from k8s_emulator import ApiError, Emulator, JobController
from k8s_emulator.patching import JSON_PATCH

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "batchinferencejobs.yaml"
BIJ = "batchinference.io/v1alpha1"
PLURAL = "batchinferencejobs"


def bij(name: str = "a", **spec: Any) -> dict[str, Any]:
    body = {"input": {"uri": "file:///in"}, "output": {"uri": "file:///out"}}
    body.update(spec)
    return {"apiVersion": BIJ, "kind": "BatchInferenceJob", "metadata": {"name": name}, "spec": body}


def http(api: Emulator, method: str, path: str, body: Any = None, ctype: str = "application/json") -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(api.url + path, data=data, method=method, headers={"Content-Type": ctype})
    try:
        with urllib.request.urlopen(req) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return json.loads(e.read())


@pytest.fixture(scope="module")
def api() -> Any:
    with Emulator(crds=[CRD], bookmark_interval=0.5) as emu:
        yield emu


# --- API server ----------------------------------------------------------------------------------


def test_discovery_serves_the_crd_with_its_status_subresource(api: Emulator) -> None:
    groups = http(api, "GET", "/apis")
    assert "batchinference.io" in [g["name"] for g in groups["groups"]]
    names = [r["name"] for r in http(api, "GET", "/apis/batchinference.io/v1alpha1")["resources"]]
    assert names == ["batchinferencejobs", "batchinferencejobs/status"]
    assert "jobs/status" in [r["name"] for r in http(api, "GET", "/apis/batch/v1")["resources"]]


def test_create_applies_the_schema_defaults(api: Emulator) -> None:
    obj = api.create(BIJ, PLURAL, bij("defaults"), "default")
    assert obj["spec"]["workers"]["parallelism"] == 4
    assert obj["spec"]["model"]["engine"] == "echo"
    assert obj["metadata"]["generation"] == 1 and obj["metadata"]["uid"]


def test_an_invalid_object_is_rejected_naming_each_field(api: Emulator) -> None:
    with pytest.raises(ApiError) as e:
        api.create(BIJ, PLURAL, bij("bad", workers={"parallelism": 0}, model={"engine": "nope"}), "default")
    assert e.value.code == 422
    assert "spec.workers.parallelism: Invalid value: 0" in e.value.message
    assert 'spec.model.engine: Unsupported value: "nope"' in e.value.message
    assert api.get(BIJ, PLURAL, "bad", "default") is None


def test_cel_rules_of_the_crd_are_enforced(api: Emulator) -> None:
    with pytest.raises(ApiError) as e:
        api.create(BIJ, PLURAL, bij("cel", output={"uri": "http://x"}), "default")
    assert "spec.output.uri" in e.value.message and "must start with file:// or s3://" in e.value.message


def test_unknown_fields_are_pruned(api: Emulator) -> None:
    obj = api.create(BIJ, PLURAL, bij("pruned", madeUp=1), "default")
    assert "madeUp" not in obj["spec"]


def test_duplicate_names_conflict_and_unknown_namespaces_are_not_found(api: Emulator) -> None:
    api.create(BIJ, PLURAL, bij("dup"), "default")
    with pytest.raises(ApiError) as e:
        api.create(BIJ, PLURAL, bij("dup"), "default")
    assert (e.value.code, e.value.reason) == (409, "AlreadyExists")
    with pytest.raises(ApiError) as e:
        api.create(BIJ, PLURAL, bij("x"), "nowhere")
    assert e.value.code == 404


def test_the_status_subresource_and_the_main_resource_only_change_their_half(api: Emulator) -> None:
    api.create(BIJ, PLURAL, bij("halves"), "default")
    out = api.patch(BIJ, PLURAL, "halves", {"status": {"phase": "Running"}, "spec": {"suspend": True}},
                    "default", subresource="status")
    assert out["status"]["phase"] == "Running" and out["spec"]["suspend"] is False
    assert out["metadata"]["generation"] == 1
    out = api.patch(BIJ, PLURAL, "halves", {"status": {"phase": "Failed"}, "spec": {"suspend": True}}, "default")
    assert out["status"]["phase"] == "Running" and out["spec"]["suspend"] is True
    assert out["metadata"]["generation"] == 2


def test_a_noop_patch_keeps_the_resource_version(api: Emulator) -> None:
    obj = api.create(BIJ, PLURAL, bij("noop"), "default")
    again = api.patch(BIJ, PLURAL, "noop", {"spec": {"suspend": False}}, "default")
    assert again["metadata"]["resourceVersion"] == obj["metadata"]["resourceVersion"]


def test_a_failed_json_patch_test_is_unprocessable(api: Emulator) -> None:
    api.create(BIJ, PLURAL, bij("jp"), "default")
    ops = [{"op": "test", "path": "/metadata/resourceVersion", "value": "1"},
           {"op": "add", "path": "/metadata/finalizers", "value": ["x"]}]
    with pytest.raises(ApiError) as e:
        api.patch(BIJ, PLURAL, "jp", ops, "default", content_type=JSON_PATCH)
    assert e.value.code == 422


def test_a_stale_resource_version_conflicts(api: Emulator) -> None:
    api.create(BIJ, PLURAL, bij("stale"), "default")
    with pytest.raises(ApiError) as e:
        api.patch(BIJ, PLURAL, "stale", {"metadata": {"resourceVersion": "1"}, "spec": {"suspend": True}}, "default")
    assert e.value.code == 409


def test_list_filters_by_label_selector(api: Emulator) -> None:
    api.create("v1", "namespaces", {"metadata": {"name": "labels"}})
    for name, labels in [("l1", {"team": "a"}), ("l2", {"team": "b"}), ("l3", {})]:
        doc = bij(name)
        doc["metadata"]["labels"] = labels
        api.create(BIJ, PLURAL, doc, "labels")

    def names(selector: str) -> list[str]:
        return [o["metadata"]["name"] for o in api.list(BIJ, PLURAL, "labels", selector)]

    assert names("team") == ["l1", "l2"]
    assert names("team=a") == ["l1"]
    assert names("team!=a") == ["l2", "l3"]
    assert names("team in (a,b),!missing") == ["l1", "l2"]
    assert names("!team") == ["l3"]


def test_watch_continues_from_a_resource_version_and_sends_bookmarks(api: Emulator) -> None:
    api.create("v1", "namespaces", {"metadata": {"name": "watched"}})
    first = api.create(BIJ, PLURAL, bij("w1"), "watched")
    api.patch(BIJ, PLURAL, "w1", {"spec": {"suspend": True}}, "watched")
    api.delete(BIJ, PLURAL, "w1", "watched")
    url = (f"{api.url}/apis/batchinference.io/v1alpha1/namespaces/watched/batchinferencejobs?watch=true"
           f"&resourceVersion={first['metadata']['resourceVersion']}&allowWatchBookmarks=true&timeoutSeconds=2")
    started = time.monotonic()
    with urllib.request.urlopen(url) as r:
        events = [json.loads(line) for line in r if line.strip()]
    assert [e["type"] for e in events[:2]] == ["MODIFIED", "DELETED"]
    assert "BOOKMARK" in [e["type"] for e in events[2:]]
    assert 1.5 < time.monotonic() - started < 5


def test_a_watch_without_version_starts_with_the_current_objects(api: Emulator) -> None:
    api.create("v1", "namespaces", {"metadata": {"name": "initial"}})
    api.create(BIJ, PLURAL, bij("i1"), "initial")
    url = f"{api.url}/apis/batchinference.io/v1alpha1/namespaces/initial/batchinferencejobs?watch=1&timeoutSeconds=1"
    with urllib.request.urlopen(url) as r:
        events = [json.loads(line) for line in r if line.strip()]
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "i1")]


def test_deleting_the_owner_collects_its_jobs(api: Emulator) -> None:
    owner = api.create(BIJ, PLURAL, bij("owner"), "default")
    api.create("batch/v1", "jobs", job("owner-r0", owner_uid=owner["metadata"]["uid"]), "default")
    api.create("batch/v1", "jobs", job("unowned"), "default")
    api.delete(BIJ, PLURAL, "owner", "default")
    assert api.get("batch/v1", "jobs", "owner-r0", "default") is None
    assert api.get("batch/v1", "jobs", "unowned", "default") is not None


def test_job_fields_that_are_immutable_stay_so(api: Emulator) -> None:
    api.create("batch/v1", "jobs", job("immutable"), "default")
    api.patch("batch/v1", "jobs", "immutable", {"spec": {"suspend": True, "parallelism": 3}}, "default")
    with pytest.raises(ApiError) as e:
        api.patch("batch/v1", "jobs", "immutable", {"spec": {"template": {"spec": {"restartPolicy": "OnFailure"}}}},
                  "default")
    assert "spec.template: Invalid value: field is immutable" in e.value.message


def test_a_job_name_too_long_for_a_label_is_rejected(api: Emulator) -> None:
    with pytest.raises(ApiError) as e:
        api.create("batch/v1", "jobs", job("x" * 64), "default")
    assert "metadata.name" in e.value.message


def test_requests_are_logged_with_their_rbac_verb(api: Emulator) -> None:
    before = len(api.requests)
    http(api, "GET", "/apis/batch/v1/namespaces/default/jobs")
    http(api, "PATCH", "/apis/batchinference.io/v1alpha1/namespaces/default/batchinferencejobs/defaults/status",
         {"status": {"phase": "Pending"}}, "application/merge-patch+json")
    log = [r for r in api.requests[before:] if r.code is not None]
    assert [(r.verb, r.group, r.resource, r.subresource, r.namespace) for r in log] == [
        ("list", "batch", "jobs", None, "default"),
        ("patch", "batchinference.io", "batchinferencejobs", "status", "default"),
    ]


# --- Job controller ------------------------------------------------------------------------------

POD = """
import os, sys, time, pathlib
i = int(os.environ["JOB_COMPLETION_INDEX"])
out = pathlib.Path(os.environ["OUT"])
(out / f"start-{i}-{time.monotonic_ns()}").touch()
time.sleep(float(os.environ.get("SLEEP", "0.2")))
(out / f"end-{i}-{time.monotonic_ns()}").touch()
sys.exit(int(os.environ.get(f"EXIT_{i}", "0")))
"""


def job(name: str, *, completions: int = 3, parallelism: int = 2, env: dict[str, str] | None = None,
        owner_uid: str | None = None, suspend: bool = False, backoff_per_index: int | None = 1,
        ttl: int | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": {"app": "test"}}
    if owner_uid:
        meta["ownerReferences"] = [{"apiVersion": BIJ, "kind": "BatchInferenceJob", "name": "owner",
                                    "uid": owner_uid, "controller": True}]
    spec: dict[str, Any] = {
        "completionMode": "Indexed", "completions": completions, "parallelism": parallelism, "suspend": suspend,
        "podFailurePolicy": {"rules": [
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            {"action": "FailJob", "onExitCodes": {"containerName": "worker", "operator": "In", "values": [42]}},
        ]},
        "template": {"spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 5, "containers": [{
            "name": "worker", "image": "test", "command": [sys.executable, "-c", POD],
            "env": [{"name": k, "value": v} for k, v in (env or {}).items()]}]}},
    }
    if backoff_per_index is not None:
        spec["backoffLimitPerIndex"] = backoff_per_index
    if ttl is not None:
        spec["ttlSecondsAfterFinished"] = ttl
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": spec}


@pytest.fixture()
def cluster(tmp_path: Path) -> Any:
    with Emulator() as api, JobController(api, log_dir=tmp_path / "logs") as ctl:
        yield api, ctl


def job_status(api: Emulator, name: str) -> dict[str, Any]:
    return (api.get("batch/v1", "jobs", name, "default") or {}).get("status") or {}


def condition(api: Emulator, name: str, type_: str) -> dict[str, Any] | None:
    for c in job_status(api, name).get("conditions") or []:
        if c["type"] == type_ and c["status"] == "True":
            return c
    return None


def test_a_job_runs_every_index_at_most_parallelism_at_a_time(cluster: Any, tmp_path: Path) -> None:
    api, _ = cluster
    api.create("batch/v1", "jobs", job("ok", completions=5, parallelism=2, env={"OUT": str(tmp_path)}), "default")
    api.wait_for(lambda: condition(api, "ok", "Complete"), 20, message="Complete")
    st = job_status(api, "ok")
    assert (st["completedIndexes"], st["succeeded"], st["failed"], st["active"]) == ("0-4", 5, 0, 0)
    assert condition(api, "ok", "SuccessCriteriaMet")
    # At no moment were more than two pods alive.
    marks = sorted((int(p.name.split("-")[2]), p.name.split("-")[0]) for p in tmp_path.iterdir() if "-" in p.name)
    alive = peak = 0
    for _, kind in marks:
        alive += 1 if kind == "start" else -1
        peak = max(peak, alive)
    assert peak == 2


def test_an_index_that_keeps_failing_becomes_a_failed_index(cluster: Any, tmp_path: Path) -> None:
    api, _ = cluster
    api.create("batch/v1", "jobs", job("flaky", env={"OUT": str(tmp_path), "EXIT_1": "1", "SLEEP": "0"},
                                       backoff_per_index=1), "default")
    failed = api.wait_for(lambda: condition(api, "flaky", "Failed"), 20, message="Failed")
    st = job_status(api, "flaky")
    assert (st["completedIndexes"], st["failedIndexes"], st["failed"]) == ("0,2", "1", 2)
    assert failed["reason"] == "FailedIndexes"
    assert condition(api, "flaky", "FailureTarget")


def test_exit_42_fails_the_job_at_once_by_the_pod_failure_policy(cluster: Any, tmp_path: Path) -> None:
    api, ctl = cluster
    ctl.inject_exit("bad", 0, 42)
    api.create("batch/v1", "jobs", job("bad", completions=4, parallelism=1, env={"OUT": str(tmp_path)}), "default")
    failed = api.wait_for(lambda: condition(api, "bad", "Failed"), 20, message="Failed")
    assert failed["reason"] == "PodFailurePolicy"
    assert "exit code 42" in failed["message"] and "default/bad-0-" in failed["message"]
    assert ctl.pods_started == [("bad", 0)]


def test_suspend_stops_pods_without_failures_and_resume_finishes(cluster: Any, tmp_path: Path) -> None:
    api, ctl = cluster
    api.create("batch/v1", "jobs", job("sus", completions=2, parallelism=2,
                                       env={"OUT": str(tmp_path), "SLEEP": "30"}), "default")
    api.wait_for(lambda: ctl.running("sus") == [0, 1], 10, message="two pods")
    api.patch("batch/v1", "jobs", "sus", {"spec": {"suspend": True}}, "default")
    api.wait_for(lambda: condition(api, "sus", "Suspended") and job_status(api, "sus")["active"] == 0
                 and not ctl.running("sus"), 10, message="suspended")
    assert job_status(api, "sus")["failed"] == 0
    api.patch("batch/v1", "jobs", "sus", {"spec": {"suspend": False}}, "default")
    api.wait_for(lambda: ctl.running("sus") == [0, 1], 10, message="resumed")
    assert any(c["type"] == "Suspended" and c["status"] == "False" for c in job_status(api, "sus")["conditions"])


def test_a_preempted_pod_is_replaced_without_counting_a_failure(cluster: Any, tmp_path: Path) -> None:
    api, ctl = cluster
    api.create("batch/v1", "jobs", job("spot", completions=1, parallelism=1,
                                       env={"OUT": str(tmp_path), "SLEEP": "1"}), "default")
    api.wait_for(lambda: ctl.running("spot") == [0], 10, message="a pod")
    assert ctl.preempt("spot", 0)
    api.wait_for(lambda: condition(api, "spot", "Complete"), 20, message="Complete")
    assert job_status(api, "spot")["failed"] == 0
    assert ctl.pods_started == [("spot", 0), ("spot", 0)]


def test_a_finished_job_is_deleted_after_its_ttl(cluster: Any, tmp_path: Path) -> None:
    api, _ = cluster
    api.create("batch/v1", "jobs", job("ttl", completions=1, env={"OUT": str(tmp_path), "SLEEP": "0"}, ttl=1),
               "default")
    api.wait_for(lambda: condition(api, "ttl", "Complete"), 10, message="Complete")
    api.wait_for(lambda: api.get("batch/v1", "jobs", "ttl", "default") is None, 5, message="TTL deletion")


def test_deleting_a_job_stops_its_pods(cluster: Any, tmp_path: Path) -> None:
    api, ctl = cluster
    api.create("batch/v1", "jobs", job("gone", completions=1, env={"OUT": str(tmp_path), "SLEEP": "30"}),
               "default")
    api.wait_for(lambda: ctl.running("gone") == [0], 10, message="a pod")
    api.delete("batch/v1", "jobs", "gone", "default")
    api.wait_for(lambda: not ctl.running("gone"), 10, message="pod stopped")


def test_watchers_in_threads_see_controller_writes(cluster: Any, tmp_path: Path) -> None:
    api, _ = cluster
    seen: list[str] = []
    url = f"{api.url}/apis/batch/v1/namespaces/default/jobs?watch=1&timeoutSeconds=5&labelSelector=app%3Dtest"

    def watch() -> None:
        with urllib.request.urlopen(url) as r:
            for line in r:
                ev = json.loads(line)
                seen.append(ev["type"])
                if any(c["type"] == "Complete" for c in (ev["object"].get("status") or {}).get("conditions") or []):
                    return

    t = threading.Thread(target=watch)
    t.start()
    time.sleep(0.2)
    api.create("batch/v1", "jobs", job("seen", completions=1, env={"OUT": str(tmp_path), "SLEEP": "0"}), "default")
    t.join(10)
    assert seen[0] == "ADDED" and seen[-1] == "MODIFIED"
