"""The Helm chart, rendered and linted by Helm itself (helm_python binds Helm's Go library)."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from bij.contract.spec import parse_job
from bij.control import jobs, step_jobs, worker_pod

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "bij-operator"
KUBE_VERSIONS = ["1.34", "1.36"]  # the chart's kubeVersion floor, and the version the tests run on
NAMESPACE = "bij-system"
# Kinds Kubernetes itself does not know: validated against their own CRD schema, or by shape.
CRD_KINDS = {"monitoring.coreos.com/v1": {"ServiceMonitor", "PodMonitor"}, "kopf.dev/v1": {"KopfPeering",
                                                                                         "ClusterKopfPeering"}}

NON_DEFAULT = {
    "watch": {"allNamespaces": False, "namespaces": ["team-a", "team-b"]},
    "peering": {"enabled": True, "name": "bij"},
    "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
    "podMonitor": {"enabled": True},
    "workerServiceAccount": {
        "namespaces": ["team-c", "team-a"], "annotations": {"iam.gke.io/gcp-service-account": "w"}
    },
    "serviceAccount": {"annotations": {"example.com/owner": "platform"}},
    "image": {"repository": "registry.local/bij-operator", "tag": "dev", "pullPolicy": "Always"},
    "workerImage": {"repository": "registry.local/bij-worker", "tag": "dev"},
    "stepsImage": {"repository": "registry.local/bij-steps", "tag": "dev"},
    "stepResources": {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "4Gi"}},
    "imagePullSecrets": [{"name": "registry"}],
    "logLevel": "DEBUG",
    "extraEnv": [{"name": "HTTPS_PROXY", "value": "http://proxy:3128"}],
    "nodeSelector": {"pool": "system"},
    "tolerations": [{"key": "system", "operator": "Exists", "effect": "NoSchedule"}],
    "priorityClassName": "system-cluster-critical",
}
CLUSTER_WIDE_PEERING = {"peering": {"enabled": True}, "podMonitor": {"enabled": True}}
MODELS = {"llama-8b": {"model": {"engine": "vllm", "name": "meta-llama/Llama-3.1-8B-Instruct"},
                       "workers": {"gpus": 1, "spot": True, "parallelism": 4}},
          "minilm": {"model": {"engine": "sentence-transformers"}}}
WITH_API = {"api": {"enabled": True, "filesPrefix": "s3://openai-files/prod/", "models": MODELS,
                    "s3": {"region": "eu-west-1"},
                    "serviceAccount": {"annotations": {"eks.amazonaws.com/role-arn": "r"}}}}


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def render(chart: helm.Chart, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    manifests = chart.render(values or {}, name="bij", namespace=NAMESPACE, is_install=True)
    objects = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        objects += [d for d in yaml.safe_load_all(text) if d]
    return objects


def of_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = of_kind(objects, kind)
    return found


def operator_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert isinstance(container, dict)
    return container


def grants(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


def chart_crds(chart: helm.Chart) -> list[dict[str, Any]]:
    return [d for c in chart.crds for d in yaml.safe_load_all(c["data"]) if d]


# --- Helm's own checks --------------------------------------------------------------------


@pytest.mark.parametrize("values", [{}, NON_DEFAULT, CLUSTER_WIDE_PEERING, WITH_API],
                         ids=["default", "namespaced", "peering", "api"])
def test_chart_lints_without_warnings(values: dict[str, Any]) -> None:
    report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE, kube_version="v1.34.0")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_values_schema_rejects_misspelled_keys(chart: helm.Chart) -> None:
    jsonschema.Draft7Validator.check_schema(chart.schema)
    with pytest.raises(helm.HelmError, match="allNamespace"):
        chart.render({"watch": {"allNamespace": False}}, name="bij", namespace=NAMESPACE)
    with pytest.raises(helm.HelmError, match="logLevel"):
        chart.render({"logLevel": "verbose"}, name="bij", namespace=NAMESPACE)


def test_every_documented_value_is_in_the_schema(chart: helm.Chart) -> None:
    chart.validate_schema(chart.values)
    assert set(chart.values) <= set(chart.schema["properties"])


# --- objects valid for Kubernetes ---------------------------------------------------------


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
@pytest.mark.parametrize("values", [{}, NON_DEFAULT, CLUSTER_WIDE_PEERING, WITH_API],
                         ids=["default", "namespaced", "peering", "api"])
def test_rendered_objects_are_valid_for_kubernetes(chart: helm.Chart, values: dict[str, Any], kube: str) -> None:
    objects = render(chart, values)
    crd_schemas = {
        (c["spec"]["group"], c["spec"]["names"]["kind"]): v["schema"]["openAPIV3Schema"]
        for c in chart_crds(chart) for v in c["spec"]["versions"]
    }
    for obj in objects:
        if obj["kind"] in CRD_KINDS.get(obj["apiVersion"], set()):
            group = obj["apiVersion"].split("/")[0]
            if (group, obj["kind"]) in crd_schemas:
                jsonschema.validate(obj, crd_schemas[(group, obj["kind"])])
            continue
        kubernetes_validate.validate(obj, kube, strict=True)


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
def test_chart_crds_are_valid_for_kubernetes(chart: helm.Chart, kube: str) -> None:
    crds = chart_crds(chart)
    assert {c["metadata"]["name"] for c in crds} == {
        "batchinferencejobs.batchinference.io", "kopfpeerings.kopf.dev", "clusterkopfpeerings.kopf.dev"
    }
    for crd in crds:
        kubernetes_validate.validate(crd, kube, strict=True)


def test_chart_kube_version_is_the_documented_minimum() -> None:
    # One minimum everywhere: the chart refuses older clusters, and README and operations.md say so.
    floor = yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"]
    assert floor == f">={KUBE_VERSIONS[0]}.0-0"
    assert f"Kubernetes ({KUBE_VERSIONS[0]} or newer)" in (ROOT / "README.md").read_text()
    assert f"bij needs Kubernetes {KUBE_VERSIONS[0]} or newer" in (ROOT / "docs" / "operations.md").read_text()


def test_chart_crd_is_the_generated_copy_of_the_source() -> None:
    spec = importlib.util.spec_from_file_location("sync_crd", ROOT / "tools" / "sync_crd.py")
    assert spec and spec.loader
    sync = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sync)
    copy = CHART / "crds" / "batchinferencejobs.yaml"
    assert copy not in sync.drifted(ROOT), "the chart's CRD drifted from crds/: run python tools/sync_crd.py"
    source = yaml.safe_load((ROOT / "crds" / "batchinferencejobs.yaml").read_text())
    assert yaml.safe_load(copy.read_text()) == source


# --- the operator Deployment --------------------------------------------------------------


def test_operator_deployment_defaults(chart: helm.Chart) -> None:
    objects = render(chart)
    deployment = one(objects, "Deployment")
    assert deployment["metadata"]["namespace"] == NAMESPACE
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    container = operator_container(objects)
    assert container["command"] == ["bij", "operator"]
    assert container["args"] == ["--liveness=http://0.0.0.0:8080/healthz", "--all-namespaces", "--standalone"]
    probe = container["livenessProbe"]["httpGet"]
    port = {p["name"]: p["containerPort"] for p in container["ports"]}[probe["port"]]
    assert (probe["path"], port) == ("/healthz", 8080)
    env = {e["name"]: e.get("value") for e in container["env"]}
    # The chart's default worker image is the one `bij render` and the operator fall back to.
    assert env["BIJ_WORKER_IMAGE"] == jobs.DEFAULT_WORKER_IMAGE
    assert container["image"] == "ghcr.io/bij-project/bij-operator:" + chart.metadata["appVersion"]
    # Step Jobs run bij without an engine: by default the operator's own image.
    assert env["BIJ_STEPS_IMAGE"] == container["image"]
    # Step pods get the same resources from the chart as the operator gives them without it.
    assert json.loads(env["BIJ_STEP_RESOURCES"]) == step_jobs.STEP_RESOURCES
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]


def test_operator_pod_meets_the_restricted_pod_security_standard(chart: helm.Chart) -> None:
    objects = render(chart)
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    ctx = operator_container(objects)["securityContext"]
    assert ctx["allowPrivilegeEscalation"] is False and ctx["capabilities"] == {"drop": ["ALL"]}
    assert ctx["readOnlyRootFilesystem"] is True


def test_operator_deployment_with_non_default_values(chart: helm.Chart) -> None:
    objects = render(chart, NON_DEFAULT)
    container = operator_container(objects)
    assert container["args"] == [
        "--liveness=http://0.0.0.0:8080/healthz", "--namespace=team-a", "--namespace=team-b", "--peering=bij"
    ]
    assert container["image"] == "registry.local/bij-operator:dev" and container["imagePullPolicy"] == "Always"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["BIJ_WORKER_IMAGE"] == "registry.local/bij-worker:dev"
    assert env["BIJ_STEPS_IMAGE"] == "registry.local/bij-steps:dev"
    assert json.loads(env["BIJ_STEP_RESOURCES"]) == NON_DEFAULT["stepResources"]
    assert env["BIJ_LOG_LEVEL"] == "DEBUG" and env["HTTPS_PROXY"] == "http://proxy:3128"
    assert env["BIJ_METRICS_PORT"] == "9401"
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "system"} and pod["tolerations"] == NON_DEFAULT["tolerations"]
    assert pod["priorityClassName"] == "system-cluster-critical"
    assert pod["imagePullSecrets"] == [{"name": "registry"}]


# --- service accounts ---------------------------------------------------------------------


def test_worker_service_account_exists_where_round_jobs_run(chart: helm.Chart) -> None:
    default_job = parse_job({"apiVersion": "batchinference.io/v1alpha1", "kind": "BatchInferenceJob",
                             "metadata": {"name": "j"}, "spec": {"input": {"uri": "file:///i"},
                                                                  "output": {"uri": "file:///o"}}})
    rendered = jobs.render_job(default_job, 0, 1, "file:///o/m.json")
    worker_sa = rendered["spec"]["template"]["spec"]["serviceAccountName"]

    accounts = of_kind(render(chart), "ServiceAccount")
    assert {(a["metadata"]["namespace"], a["metadata"]["name"]) for a in accounts} == {
        (NAMESPACE, "bij-bij-operator"), (NAMESPACE, worker_sa)
    }
    accounts = of_kind(render(chart, NON_DEFAULT), "ServiceAccount")
    workers = {a["metadata"]["namespace"] for a in accounts if a["metadata"]["name"] == worker_sa}
    assert workers == {"team-a", "team-b", "team-c"}
    for account in accounts:
        if account["metadata"]["name"] == worker_sa:
            assert account["automountServiceAccountToken"] is False
            assert account["metadata"]["annotations"] == {"iam.gke.io/gcp-service-account": "w"}
            assert account["imagePullSecrets"] == [{"name": "registry"}]
        else:
            assert account["metadata"]["annotations"] == {"example.com/owner": "platform"}


def test_the_worker_role_is_exactly_the_grants_bij_doctor_checks(chart: helm.Chart) -> None:
    from bij.control.permissions import worker_role_rules

    roles = [r for r in of_kind(render(chart, NON_DEFAULT), "Role") if r["metadata"]["name"] == "bij-worker"]
    assert {r["metadata"]["namespace"] for r in roles} == {"team-a", "team-b", "team-c"}
    assert all(r["rules"] == worker_role_rules() for r in roles)


# --- the operator has no storage identity ------------------------------------------------------


@pytest.mark.parametrize("values", [{}, NON_DEFAULT])
def test_the_operator_pod_has_nothing_to_sign_a_storage_request_with(chart: helm.Chart, values: Any) -> None:
    container = operator_container(render(chart, values))
    names = {e["name"] for e in container["env"]}
    assert "envFrom" not in container
    assert not {n for n in names if n.startswith(("AWS_", "AZURE_", "GOOGLE_"))} - {"AWS_EC2_METADATA_DISABLED"}
    assert {"name": "AWS_EC2_METADATA_DISABLED", "value": "true"} in container["env"]  # nor the node's role


def test_file_storage_is_off_by_default_and_names_its_volume_to_the_operator_when_on(chart: helm.Chart) -> None:
    assert "BIJ_FILE_STORAGE" not in {e["name"] for e in operator_container(render(chart))["env"]}
    on = {"fileStorage": {"mountPath": "/data", "volume": {"persistentVolumeClaim": {"claimName": "shared"}}}}
    env = {e["name"]: e.get("value") for e in operator_container(render(chart, on))["env"]}
    from bij.control.file_volume import FileVolume

    volume = FileVolume.from_env(env)
    assert volume == FileVolume("/data", {"persistentVolumeClaim": {"claimName": "shared"}})
    with pytest.raises(Exception, match="fileStorage: set both mountPath and volume"):
        render(chart, {"fileStorage": {"mountPath": "/data"}})


@pytest.mark.parametrize("values, says", [
    ({"extraEnv": [{"name": "AWS_ACCESS_KEY_ID", "value": "AKIA"}]}, "extraEnv: AWS_ACCESS_KEY_ID: the operator has "
                                                                      "no storage identity"),
    ({"extraEnv": [{"name": "GOOGLE_APPLICATION_CREDENTIALS", "value": "/k.json"}]}, "GOOGLE_APPLICATION_CREDENTIALS"),
    ({"serviceAccount": {"annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/bij"}}},
     "serviceAccount.annotations: eks.amazonaws.com/role-arn: the operator has no storage identity; a cloud "
     "identity belongs on workerServiceAccount.annotations"),
    ({"envFrom": [{"secretRef": {"name": "s3-credentials"}}]}, "envFrom"),
])
def test_storage_credentials_for_the_operator_are_refused_naming_the_value(chart: helm.Chart, values: Any,
                                                                           says: str) -> None:
    with pytest.raises(Exception) as refused:
        render(chart, values)
    assert says in str(refused.value)


# --- RBAC: exactly what the operator needs ------------------------------------------------

NAMESPACED_GRANTS = grants([
    {"apiGroups": ["batchinference.io"], "resources": ["batchinferencejobs"],
     "verbs": ["get", "list", "watch", "patch"]},
    {"apiGroups": ["batchinference.io"], "resources": ["batchinferencejobs/status"], "verbs": ["patch"]},
    {"apiGroups": ["batchinference.io"], "resources": ["batchinferencejobs/finalizers"], "verbs": ["update"]},
    {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
    {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["list"]},
    {"apiGroups": [""], "resources": ["services"], "verbs": ["create"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    {"apiGroups": ["authorization.k8s.io"], "resources": ["localsubjectaccessreviews"], "verbs": ["create"]},
    # spec.notify's signing key: get only, never list or watch.
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]},
])
CRD_GRANTS = grants([{"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"],
                      "verbs": ["list", "watch"]}])
PEERING_VERBS = ["list", "watch", "patch"]


WORKER_GRANTS = grants([{"apiGroups": ["batchinference.io"], "resources": ["batchinferencejobs/status"],
                         "verbs": ["patch"]},
                        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create", "patch"]}])


def operator_roles(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in of_kind(objects, kind) if o["metadata"]["name"] != "bij-worker"]


def test_the_worker_role_only_lets_pods_report_into_their_bijs_status_and_their_leases(chart: helm.Chart) -> None:
    for values, where in (({}, {NAMESPACE}), (NON_DEFAULT, {"team-a", "team-b", "team-c"})):
        objects = render(chart, values)
        roles = [r for r in of_kind(objects, "Role") if r["metadata"]["name"] == "bij-worker"]
        assert {r["metadata"]["namespace"] for r in roles} == where
        assert all(grants(r["rules"]) == WORKER_GRANTS for r in roles)
        bindings = [b for b in of_kind(objects, "RoleBinding") if b["metadata"]["name"] == "bij-worker"]
        assert {b["metadata"]["namespace"] for b in bindings} == where
        for b in bindings:
            assert b["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "bij-worker"}
            assert b["subjects"] == [{"kind": "ServiceAccount", "name": "bij-worker",
                                      "namespace": b["metadata"]["namespace"]}]


def bound_to_operator(binding: dict[str, Any], objects: list[dict[str, Any]]) -> bool:
    account = next(a for a in of_kind(objects, "ServiceAccount") if a["metadata"]["name"] != "bij-worker")
    return binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                    "namespace": account["metadata"]["namespace"]}]


def test_cluster_wide_rbac_is_one_cluster_role_with_exactly_the_needed_grants(chart: helm.Chart) -> None:
    objects = render(chart)
    role = one(objects, "ClusterRole")
    assert grants(role["rules"]) == NAMESPACED_GRANTS | CRD_GRANTS
    binding = one(objects, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"] and bound_to_operator(binding, objects)
    assert operator_roles(objects, "Role") == [] and operator_roles(objects, "RoleBinding") == []


def test_namespaced_rbac_grants_namespaced_objects_only_in_watched_namespaces(chart: helm.Chart) -> None:
    objects = render(chart, NON_DEFAULT)
    peering = {("kopf.dev", "kopfpeerings", v) for v in PEERING_VERBS}
    assert of_kind(objects, "ClusterRole") == [] and of_kind(objects, "ClusterRoleBinding") == []
    roles = operator_roles(objects, "Role")
    assert {r["metadata"]["namespace"] for r in roles} == {"team-a", "team-b"}
    for role in roles:
        assert grants(role["rules"]) == NAMESPACED_GRANTS | peering
    bindings = operator_roles(objects, "RoleBinding")
    assert {b["metadata"]["namespace"] for b in bindings} == {"team-a", "team-b"}
    assert all(b["roleRef"]["kind"] == "Role" and bound_to_operator(b, objects) for b in bindings)


def test_peering_adds_its_grants_and_its_peering_object(chart: helm.Chart) -> None:
    objects = render(chart, CLUSTER_WIDE_PEERING)
    peering = {("kopf.dev", "clusterkopfpeerings", v) for v in PEERING_VERBS}
    assert grants(one(objects, "ClusterRole")["rules"]) == NAMESPACED_GRANTS | CRD_GRANTS | peering
    assert one(objects, "ClusterKopfPeering")["metadata"]["name"] == "bij-operator"
    assert "--peering=bij-operator" in operator_container(objects)["args"]
    namespaced = render(chart, NON_DEFAULT)
    assert {(p["metadata"]["namespace"], p["metadata"]["name"]) for p in of_kind(namespaced, "KopfPeering")} == {
        ("team-a", "bij"), ("team-b", "bij")
    }
    assert not ({"KopfPeering", "ClusterKopfPeering"} & {o["kind"] for o in render(chart)})


def test_no_rbac_when_disabled(chart: helm.Chart) -> None:
    kinds = {o["kind"] for o in render(chart, {"rbac": {"create": False}})}
    assert not (kinds & {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"})


# --- monitoring ---------------------------------------------------------------------------


def test_monitors_are_off_by_default(chart: helm.Chart) -> None:
    kinds = {o["kind"] for o in render(chart)}
    assert not (kinds & {"ServiceMonitor", "PodMonitor", "Service"})


def test_pod_monitor_scrapes_the_pods_of_round_jobs(chart: helm.Chart) -> None:
    monitor = one(render(chart, NON_DEFAULT), "PodMonitor")
    job = parse_job({"apiVersion": "batchinference.io/v1alpha1", "kind": "BatchInferenceJob",
                     "metadata": {"name": "j", "namespace": "team-a"},
                     "spec": {"input": {"uri": "file:///i"}, "output": {"uri": "file:///o"}}})
    template = jobs.render_job(job, 0, 1, "file:///o/m.json")["spec"]["template"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= template["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    ports = {p["name"]: p["containerPort"] for p in template["spec"]["containers"][0]["ports"]}
    assert ports[endpoint["port"]] == worker_pod.WORKER_METRICS_PORT
    # The completion index of a round Job's pod is its lane (a lane works many shards).
    targets = {r["targetLabel"]: r["sourceLabels"] for r in endpoint["relabelings"]}
    assert targets == {"bij": ["__meta_kubernetes_pod_label_batchinference_io_job"],
                       "round": ["__meta_kubernetes_pod_label_batchinference_io_round"],
                       "lane": ["__meta_kubernetes_pod_annotation_batch_kubernetes_io_job_completion_index"]}
    assert {"batchinference.io/job", "batchinference.io/round"} <= template["metadata"]["labels"].keys()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    cluster_wide = one(render(chart, CLUSTER_WIDE_PEERING), "PodMonitor")
    assert cluster_wide["spec"]["namespaceSelector"] == {"any": True}


def test_service_monitor_scrapes_the_operator_metrics_port(chart: helm.Chart) -> None:
    objects = render(chart, NON_DEFAULT)
    monitor, service = one(objects, "ServiceMonitor"), one(objects, "Service")
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    (port,) = service["spec"]["ports"]
    assert endpoint["port"] == port["name"] == "metrics"
    pod_labels = one(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    container_ports = {p["name"]: p["containerPort"] for p in operator_container(objects)["ports"]}
    assert container_ports[port["targetPort"]] == port["port"] == 9401


def test_grafana_dashboard_is_off_by_default_and_a_labelled_configmap_when_on(chart: helm.Chart) -> None:
    import json
    import re

    from bij.worker.metrics import Metrics

    assert not [o for o in render(chart) if o["kind"] == "ConfigMap"]
    values = {"grafanaDashboard": {"enabled": True, "annotations": {"grafana_folder": "Batch"}}}
    cm = one(render(chart, values), "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == NAMESPACE and cm["metadata"]["annotations"] == {"grafana_folder": "Batch"}
    dashboard = json.loads(cm["data"]["bij.json"])
    titles = {p["title"] for p in dashboard["panels"]}
    assert titles == {"Rows per second", "Tokens per second", "Engine busy fraction", "Batch size (rows)",
                      "Prefetch queue depth", "Model load time", "Error rows by code"}
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert all("by (bij" in e and 'bij=~"$bij"' in e for e in exprs)
    # Every series the dashboard asks for is one the worker exports (names cannot drift apart).
    metrics = Metrics()
    metrics.row_errors.labels("invalid_json")  # a labelled series exists once it has a child
    exported = {s.name for m in metrics.registry.collect() for s in m.samples}
    asked = {name for e in exprs for name in re.findall(r"\b(bij_[a-z_]+)\{", e)}
    assert asked and asked <= exported, asked - exported
    other = one(render(chart, {"grafanaDashboard": {"enabled": True, "label": "dash", "labelValue": "yes",
                                                    "namespace": "monitoring"}}), "ConfigMap")
    assert other["metadata"]["labels"]["dash"] == "yes" and other["metadata"]["namespace"] == "monitoring"


def test_notes_name_the_worker_namespaces(chart: helm.Chart) -> None:
    notes = chart.render(NON_DEFAULT, name="bij", namespace=NAMESPACE)["bij-operator/templates/NOTES.txt"]
    assert "BatchInferenceJobs in: team-a, team-b." in notes
    assert "created in:\n  team-a, team-b, team-c\n" in notes
    assert '["' not in notes  # no raw JSON lists from the helpers


# --- bij-api ------------------------------------------------------------------------------


def api_objects(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if (o["metadata"].get("labels") or {}).get("app.kubernetes.io/component") == "api"]


def test_bij_api_is_off_by_default(chart: helm.Chart) -> None:
    assert api_objects(render(chart)) == []


def test_bij_api_runs_the_model_map_under_its_own_account_with_exactly_its_grants(chart: helm.Chart) -> None:
    from bij.api.models import ModelMap

    objects = api_objects(render(chart, WITH_API))
    assert sorted(o["kind"] for o in objects) == ["ClusterRole", "ClusterRoleBinding", "ConfigMap", "Deployment",
                                                   "Service", "ServiceAccount"]
    models = yaml.safe_load(one(objects, "ConfigMap")["data"]["models.yaml"])
    assert models == MODELS and ModelMap.parse(models, "models.yaml").names == ["llama-8b", "minilm"]
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["bij", "api"]
    assert {"--files-prefix=s3://openai-files/prod/", "--s3-region=eu-west-1"} <= set(container["args"])
    assert {"name": "BIJ_API_MODELS", "value": "/etc/bij-api/models.yaml"} in container["env"]
    sa = one(objects, "ServiceAccount")
    assert pod["serviceAccountName"] == sa["metadata"]["name"] != "bij-bij-operator"
    assert sa["metadata"]["annotations"] == {"eks.amazonaws.com/role-arn": "r"}
    binding = one(objects, "ClusterRoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": NAMESPACE}]
    assert grants(one(objects, "ClusterRole")["rules"]) == {
        ("authentication.k8s.io", "tokenreviews", "create"), ("authorization.k8s.io", "subjectaccessreviews", "create"),
        *{("batchinference.io", "batchinferencejobs", v) for v in ("get", "list", "create", "patch")}}
    service = one(objects, "Service")
    assert service["spec"]["selector"] == one(objects, "Deployment")["spec"]["selector"]["matchLabels"]


def test_bij_api_gets_its_webhooks_from_the_values_as_it_reads_them(chart: helm.Chart) -> None:
    from bij.api.batches import webhook_notify

    hooks = [{"url": "https://hooks.example.com/openai", "secretRef": {"name": "openai-webhook", "key": "secret"},
              "events": ["batch.completed", "batch.failed"]}]
    objects = api_objects(render(chart, {"api": {**WITH_API["api"], "webhooks": hooks}}))
    webhooks = yaml.safe_load(one(objects, "ConfigMap")["data"]["webhooks.yaml"])
    assert webhooks == hooks and webhook_notify(webhooks, "webhooks.yaml")[0]["events"] == \
        ["succeeded", "failed", "canaryFailed"]
    (container,) = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert {"name": "BIJ_API_WEBHOOKS", "value": "/etc/bij-api/webhooks.yaml"} in container["env"]
    # None set: bij-api is not told to read a file that is not there.
    (plain,) = one(api_objects(render(chart, WITH_API)), "Deployment")["spec"]["template"]["spec"]["containers"]
    assert all(e["name"] != "BIJ_API_WEBHOOKS" for e in plain["env"])


def test_bij_api_needs_a_files_prefix(chart: helm.Chart) -> None:
    with pytest.raises(helm.HelmError, match="api.filesPrefix is required"):
        chart.render({"api": {"enabled": True}}, name="bij", namespace=NAMESPACE)
