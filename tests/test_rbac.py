"""The chart's RBAC is exactly what the operator uses: every request allowed, no grant unused.

For each way the chart can run the operator, render it with Helm, start `bij operator` with
the rendered Deployment's own arguments against the API emulator, and drive one session
through everything the operator does: a job with suspend, resume, a scale change and an
operator restart in the middle, a failing job, a spec only the operator can reject, a
Job name taken by someone else, a deletion. The emulator logs each request as RBAC sees it (verb, group, resource,
subresource, namespace); the test checks that log against the rendered Roles and
ClusterRoles bound to the operator's ServiceAccount, in both directions.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml
from k8s_emulator import Emulator, JobController, RequestRecord
from k8s_emulator.harness import BIJ, CRD, PLURAL, ROOT, OperatorProcess, bij_doc, write_rows

CHART = ROOT / "charts" / "bij-operator"
RELEASE_NS = "bij-system"
NS = "team-a"

# Grants the operator's own requests never exercise, each with the reason it must stay.
JUSTIFIED = {
    ("batchinference.io", "batchinferencejobs/finalizers", "update"):
        "round Jobs carry an ownerReference with blockOwnerDeletion; clusters running the "
        "OwnerReferencesPermissionEnforcement admission plugin require this to create them",
}

MODES = {
    "all-namespaces": {},
    "namespaced": {"watch": {"allNamespaces": False, "namespaces": [NS]}},
    "peering": {"peering": {"enabled": True, "name": "bij-operator"}},
    "namespaced-peering": {"watch": {"allNamespaces": False, "namespaces": [NS]},
                           "peering": {"enabled": True, "name": "bij-operator"}},
}


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def render(chart: helm.Chart, values: dict[str, Any]) -> list[dict[str, Any]]:
    manifests = chart.render(values, name="bij", namespace=RELEASE_NS, is_install=True)
    objects: list[dict[str, Any]] = []
    for path, text in sorted(manifests.items()):
        if not path.endswith("NOTES.txt"):
            objects += [d for d in yaml.safe_load_all(text) if d]
    return objects


def operator_args(objects: list[dict[str, Any]]) -> list[str]:
    """`bij operator` flags exactly as the chart's Deployment passes them (liveness on a free port)."""
    (deploy,) = [o for o in objects if o["kind"] == "Deployment"]
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["bij", "operator"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [f"--liveness=http://127.0.0.1:{port}/healthz" if a.startswith("--liveness=") else a
            for a in container.get("args") or []]


# --- RBAC evaluation -----------------------------------------------------------------------------


def bound_rules(objects: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, list[dict[str, Any]]]]:
    """Rules granted to the operator's ServiceAccount: (cluster-wide, per namespace)."""
    (deploy,) = [o for o in objects if o["kind"] == "Deployment"]
    sa = deploy["spec"]["template"]["spec"]["serviceAccountName"]

    def binds(binding: dict[str, Any]) -> bool:
        return any(s.get("kind") == "ServiceAccount" and s.get("name") == sa
                   and s.get("namespace") == RELEASE_NS for s in binding.get("subjects") or [])

    roles = {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o for o in objects
             if o["kind"] in ("Role", "ClusterRole")}
    cluster: list[dict[str, Any]] = []
    namespaced: dict[str, list[dict[str, Any]]] = {}
    for b in objects:
        if b["kind"] not in ("RoleBinding", "ClusterRoleBinding") or not binds(b):
            continue
        ref = b["roleRef"]
        role_ns = b["metadata"].get("namespace") if ref["kind"] == "Role" else None
        role = roles.get((ref["kind"], role_ns, ref["name"]))
        assert role is not None, f"{b['kind']} {b['metadata']['name']} refers to a missing {ref['kind']}"
        if b["kind"] == "ClusterRoleBinding":
            cluster += role.get("rules") or []
        else:
            namespaced.setdefault(b["metadata"]["namespace"], []).extend(role.get("rules") or [])
    return cluster, namespaced


def resource_of(r: RequestRecord) -> str:
    return f"{r.resource}/{r.subresource}" if r.subresource else str(r.resource)


def allows(rule: dict[str, Any], r: RequestRecord) -> bool:
    names = rule.get("resourceNames")
    return ((r.group in rule.get("apiGroups", []) or "*" in rule.get("apiGroups", []))
            and (resource_of(r) in rule.get("resources", []) or "*" in rule.get("resources", []))
            and (r.verb in rule.get("verbs", []) or "*" in rule.get("verbs", []))
            and (not names or r.name in names))


def grants(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {(g, res, v)
            for rule in rules for g in rule["apiGroups"] for res in rule["resources"] for v in rule["verbs"]}


# --- the session ---------------------------------------------------------------------------------


def run_session(tmp: Path, objects: list[dict[str, Any]], args: list[str]) -> list[RequestRecord]:
    """Everything the operator does, once; returns the requests it made.

    With peering, the restart is a clean stop: a SIGKILLed peer stays in the peering object
    until its lifetime (60 s) expires, and the new operator rightly pauses until then.
    """
    peering = any(a.startswith("--peering") for a in args)
    write_rows(tmp / "in", 60)
    crds = [CRD] + [p for p in sorted((CHART / "crds").glob("kopf-*.yaml"))]
    with Emulator(crds=crds) as api, JobController(api, log_dir=tmp / "pods", workdir=tmp) as jobs:
        for ns in (RELEASE_NS, NS):
            api.create("v1", "namespaces", {"metadata": {"name": ns}})
        for o in objects:
            if o["kind"] in ("ClusterKopfPeering", "KopfPeering"):
                api.apply(o)
        op = OperatorProcess(api, tmp, args=args)
        try:
            op.start()

            def phase(name: str) -> str | None:
                return ((api.get(BIJ, PLURAL, name, NS) or {}).get("status") or {}).get("phase")

            def wait_phase(name: str, want: str) -> None:
                api.wait_for(lambda: phase(name) == want, 60, message=f"{name} {want}")

            jobs.hold("ok-r0", 0)
            api.create(BIJ, PLURAL, bij_doc("ok", tmp), NS)
            api.wait_for(lambda: jobs.running("ok-r0") or False, 30, message="ok running")
            api.patch(BIJ, PLURAL, "ok", {"spec": {"workers": {"parallelism": 3}}}, NS)
            api.patch(BIJ, PLURAL, "ok", {"spec": {"suspend": True}}, NS)
            wait_phase("ok", "Suspended")
            if peering:
                op.stop()
            else:
                op.kill()
            op.start()
            api.patch(BIJ, PLURAL, "ok", {"spec": {"suspend": False}}, NS)
            jobs.release("ok-r0")
            wait_phase("ok", "Succeeded")

            jobs.inject_exit("bad-r0", 0, 42)
            api.create(BIJ, PLURAL, bij_doc("bad", tmp), NS)
            wait_phase("bad", "Failed")

            api.create(BIJ, PLURAL, bij_doc("invalid", tmp, judge={"type": "regex", "pattern": "("}), NS)
            wait_phase("invalid", "Failed")

            # Someone else's Job holds the round's name: the operator looks at it and leaves it be.
            api.create("batch/v1", "jobs", {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "clash-r0"},
                                            "spec": {"suspend": True, "template": {"spec": {
                                                "restartPolicy": "Never",
                                                "containers": [{"name": "x", "image": "busybox"}]}}}}, NS)
            api.create(BIJ, PLURAL, bij_doc("clash", tmp), NS)
            api.wait_for(lambda: "JobNameConflict" in str(api.get(BIJ, PLURAL, "clash", NS)), 30,
                         message="the name conflict")

            api.delete(BIJ, PLURAL, "ok", NS)
            api.wait_for(lambda: len([e for e in api.list("v1", "events", NS) if e["reason"] == "InvalidSpec"]),
                         10, message="the last Event posted")
        finally:
            op.stop()
            print("---- operator log (tail) ----\n" + op.logs()[-4000:])
        return api.requests


@pytest.mark.parametrize("mode", list(MODES))
def test_the_chart_rbac_is_exactly_what_the_operator_uses(chart: helm.Chart, tmp_path: Path, mode: str) -> None:
    objects = render(chart, MODES[mode])
    cluster, namespaced = bound_rules(objects)
    requests = run_session(tmp_path, objects, operator_args(objects))
    resource_requests = [r for r in requests if r.resource is not None]
    # Discovery (/api, /apis, /version) is granted to every authenticated user by system:discovery.
    assert {r.path for r in requests if r.resource is None} <= {"/api", "/apis", "/version"} | {
        r.path for r in requests if r.path.startswith(("/api/", "/apis/"))}

    denied = sorted({(r.verb, r.group, resource_of(r), r.namespace or "<cluster>") for r in resource_requests
                     if not any(allows(rule, r) for rule in cluster + namespaced.get(r.namespace or "", []))})
    assert not denied, f"{mode}: the chart's RBAC denies requests the operator makes: {denied}"

    used = {(r.group, resource_of(r), r.verb) for r in resource_requests}
    print(f"{mode}: the operator used {sorted(used)}")
    granted = grants(cluster) | {g for rules in namespaced.values() for g in grants(rules)}
    unused = sorted(g for g in granted - used if g not in JUSTIFIED)
    assert not unused, f"{mode}: the chart grants what the operator never uses: {unused}"


def test_the_justified_grants_are_still_granted(chart: helm.Chart) -> None:
    """An allow-list entry the chart no longer grants is stale: drop it."""
    for values in MODES.values():
        cluster, namespaced = bound_rules(render(chart, values))
        granted = grants(cluster) | {g for rules in namespaced.values() for g in grants(rules)}
        assert set(JUSTIFIED) <= granted
