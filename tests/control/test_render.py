"""The round Job (`bij.control.jobs.render_job`, `bij render`): valid for Kubernetes, and with the
failure, spot and security settings a preemptible batch round depends on."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from bij.cli.main import main as bij_main
from bij.contract import layout
from bij.contract.codes import JOB_LABEL, PUBLISH_LABEL, ROUND_LABEL
from bij.contract.spec import BatchInferenceJob, load_job, parse_job
from bij.control import file_volume, jobs, step_jobs, worker_pod
from bij.control.jobs import render_job

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
KUBE_VERSIONS = ["1.34", "1.36"]  # bij's minimum (every Job feature used is GA), and the tested version
MANIFEST = "s3://bucket/out/_bij/uid-1/round-0/shards.json"


def make_job(**spec: Any) -> BatchInferenceJob:
    doc: dict[str, Any] = {
        "apiVersion": "batchinference.io/v1alpha1",
        "kind": "BatchInferenceJob",
        "metadata": {"name": "summaries", "namespace": "team-a", "uid": "uid-1"},
        "spec": {"input": {"uri": "s3://bucket/in/"}, "output": {"uri": "s3://bucket/out/"}},
    }
    doc["spec"].update(copy.deepcopy(spec))
    return parse_job(doc)


def render(job: BatchInferenceJob, completions: int = 10, **kw: Any) -> dict[str, Any]:
    return render_job(job, 0, completions, MANIFEST, **kw)


def pod(rendered: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = rendered["spec"]["template"]["spec"]
    return spec


def container(rendered: dict[str, Any]) -> dict[str, Any]:
    (worker,) = pod(rendered)["containers"]
    assert isinstance(worker, dict)
    return worker


def env(rendered: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value") or e["valueFrom"]["fieldRef"]["fieldPath"] for e in container(rendered)["env"]}


# --- valid for the API server ---------------------------------------------------------------

VARIANTS = {
    "minimal": {},
    "everything": {
        "model": {"engine": "vllm", "name": "m", "task": "generate"},
        "judge": {"type": "regex", "pattern": "ok"},
        "suspend": True,
        "storage": {"s3": {"endpointUrl": "http://minio:9000", "region": "eu-west-1"}, "credentialsSecret": "s3"},
        "workers": {
            "gpus": 2, "cpu": "8", "memory": "64Gi", "spot": True, "spotProvider": "all",
            "nodeSelector": {"pool": "gpu"}, "priorityClassName": "batch-low", "queueName": "gpu-queue",
            "serviceAccountName": "inference", "maxFailedIndexes": 2, "ttlSecondsAfterFinished": None,
            "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}],
            "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
                "weight": 10, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                                  "labelSelector": {"matchLabels": {"batchinference.io/job": "x"}}}}]}},
            "modelCache": {"type": "pvc", "claimName": "models"}, "env": {"VLLM_LOGGING_LEVEL": "DEBUG"},
        },
    },
    "hostpath-cache-no-shm": {"workers": {"modelCache": {"type": "hostPath", "path": "/mnt/m"}, "shmSize": None}},
    "gke-spot": {"workers": {"spot": True, "spotProvider": "gke", "gpus": 1}},
}


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
@pytest.mark.parametrize("name", list(VARIANTS))
def test_rendered_job_is_valid_for_kubernetes(name: str, kube: str) -> None:
    kubernetes_validate.validate(render(make_job(**VARIANTS[name]), owner_uid="uid-1"), kube, strict=True)


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_renders_a_valid_job(path: Path, kube: str) -> None:
    job = load_job(path)
    rendered = render_job(job, 0, 7, layout.round_manifest_uri(job, 0), owner_uid="0000-1111")
    kubernetes_validate.validate(rendered, kube, strict=True)


def test_longest_name_and_last_round_still_give_a_valid_job_name() -> None:
    job = parse_job({**make_job().model_dump(by_alias=True), "metadata": {"name": "a" * 52}})
    rendered = render_job(job, 20, 1, MANIFEST)
    assert len(rendered["metadata"]["name"]) <= 63
    kubernetes_validate.validate(rendered, "1.34", strict=True)


# --- identity -------------------------------------------------------------------------------


def test_name_namespace_labels_and_owner() -> None:
    rendered = render_job(make_job(), 2, 5, MANIFEST, owner_uid="uid-1")
    meta = rendered["metadata"]
    assert meta["name"] == "summaries-r2" and meta["namespace"] == "team-a"
    assert meta["labels"]["batchinference.io/job"] == "summaries"
    assert meta["labels"]["batchinference.io/round"] == "2"
    assert meta["labels"]["app.kubernetes.io/managed-by"] == "bij-operator"
    assert rendered["spec"]["template"]["metadata"]["labels"] == {
        k: v for k, v in meta["labels"].items() if not k.startswith("kueue.")
    }
    assert meta["ownerReferences"] == [{
        "apiVersion": "batchinference.io/v1alpha1", "kind": "BatchInferenceJob", "name": "summaries",
        "uid": "uid-1", "controller": True, "blockOwnerDeletion": True,
    }]


def test_no_owner_reference_without_an_owner_uid() -> None:
    assert "ownerReferences" not in render(make_job())["metadata"]


# --- failure policy -------------------------------------------------------------------------


def test_indexed_job_with_per_index_retries_and_preemption_ignored() -> None:
    spec = render(make_job(workers={"backoffLimitPerIndex": 5}), completions=12)["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == 12
    assert spec["backoffLimitPerIndex"] == 5
    assert spec["podReplacementPolicy"] == "Failed"
    ignore, fail = spec["podFailurePolicy"]["rules"]
    assert ignore == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    assert fail == {"action": "FailJob",
                    "onExitCodes": {"containerName": "worker", "operator": "In", "values": [42]}}
    assert container(render(make_job()))["name"] == fail["onExitCodes"]["containerName"]


@pytest.mark.parametrize("given, completions, expected", [(None, 12, 12), (3, 12, 3), (50, 12, 12), (0, 4, 0)])
def test_max_failed_indexes_defaults_to_every_shard_and_never_exceeds_completions(
    given: int | None, completions: int, expected: int
) -> None:
    job = make_job(workers={"maxFailedIndexes": given})
    assert render(job, completions=completions)["spec"]["maxFailedIndexes"] == expected


@pytest.mark.parametrize("parallelism, completions, expected", [(4, 10, 4), (16, 3, 3)])
def test_parallelism_never_exceeds_the_shard_count(parallelism: int, completions: int, expected: int) -> None:
    job = make_job(workers={"parallelism": parallelism})
    assert render(job, completions=completions)["spec"]["parallelism"] == expected
    assert jobs.desired_parallelism(job, completions) == expected


@pytest.mark.parametrize("completions", [0, 100_001])
def test_lane_counts_kubernetes_cannot_run_are_refused(completions: int) -> None:
    with pytest.raises(ValueError, match="lanes"):
        render(make_job(), completions=completions)


def test_suspend_ttl_and_grace_period_come_from_the_spec() -> None:
    rendered = render(make_job(suspend=True, workers={"ttlSecondsAfterFinished": 600,
                                                      "terminationGracePeriodSeconds": 90}))
    assert rendered["spec"]["suspend"] is True
    assert rendered["spec"]["ttlSecondsAfterFinished"] == 600
    assert pod(rendered)["terminationGracePeriodSeconds"] == 90
    assert pod(rendered)["restartPolicy"] == "Never"
    # The worker's drain after SIGTERM fits inside the grace period.
    assert 0 < int(env(rendered)["BIJ_DRAIN_SECONDS"]) < 90
    assert "ttlSecondsAfterFinished" not in render(make_job(workers={"ttlSecondsAfterFinished": None}))["spec"]


def test_kueue_queue_label_and_the_job_starts_suspended_for_kueue_to_admit() -> None:
    rendered = render(make_job(workers={"queueName": "gpu-queue"}))
    assert rendered["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue"
    assert rendered["spec"]["suspend"] is True
    assert "kueue.x-k8s.io/queue-name" not in render(make_job())["metadata"]["labels"]


# --- the worker container -------------------------------------------------------------------


def test_worker_command_manifest_metrics_and_image() -> None:
    rendered = render(make_job(), image="registry.local/bij-worker:dev")
    worker = container(rendered)
    assert worker["image"] == "registry.local/bij-worker:dev"
    assert worker["command"] == ["bij-worker"]
    assert worker["args"] == ["--manifest", MANIFEST, "--metrics-port", "9400"]
    assert worker["ports"] == [{"name": "metrics", "containerPort": 9400, "protocol": "TCP"}]
    assert env(rendered)["BIJ_MANIFEST"] == MANIFEST
    assert container(render(make_job(workers={"image": "mine:1"}), image="default:1"))["image"] == "mine:1"


def test_user_env_overrides_defaults_but_not_the_manifest() -> None:
    job = make_job(workers={"env": {"HF_HOME": "/elsewhere", "BIJ_MANIFEST": "s3://x/y", "FOO": "1"}})
    values = env(render(job))
    assert values["HF_HOME"] == "/elsewhere" and values["FOO"] == "1"
    assert values["BIJ_MANIFEST"] == MANIFEST


def test_s3_settings_as_env_and_credentials_only_by_secret_reference() -> None:
    job = make_job(storage={"s3": {"endpointUrl": "http://minio:9000", "region": "eu-west-1"},
                            "credentialsSecret": "s3-creds"})
    rendered = render(job)
    values = env(rendered)
    assert values["AWS_ENDPOINT_URL"] == "http://minio:9000" and values["AWS_REGION"] == "eu-west-1"
    assert container(rendered)["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]
    assert not any(name.startswith("AWS_SECRET") or name == "AWS_ACCESS_KEY_ID" for name in values)
    plain = render(make_job())
    assert "envFrom" not in container(plain) and "AWS_ENDPOINT_URL" not in env(plain)


def test_engine_http_gets_its_authorization_by_secret_reference_and_no_gpu() -> None:
    job = make_job(model={"engine": "http", "task": "chat", "name": "m",
                          "http": {"baseUrl": "http://vllm:8000", "headersSecret": {"name": "fleet", "key": "token"}}})
    rendered = render(job)
    [auth] = [e for e in container(rendered)["env"] if e["name"] == "BIJ_HTTP_AUTHORIZATION"]
    assert auth["valueFrom"] == {"secretKeyRef": {"name": "fleet", "key": "token"}}
    assert "nvidia.com/gpu" not in json.dumps(container(rendered).get("resources", {}))
    plain = make_job(model={"engine": "http", "task": "chat", "name": "m", "http": {"baseUrl": "http://vllm:8000"}})
    assert all(e["name"] != "BIJ_HTTP_AUTHORIZATION" for e in container(render(plain))["env"])


def test_pods_report_into_their_bijs_status_under_their_pod_name_and_their_jobs_uid() -> None:
    values = env(render(make_job()))
    job = make_job()
    assert values["BIJ_REPORT_TO"] == f"kube:{job.metadata.namespace}/{job.metadata.name}"
    assert values["POD_NAME"] == "metadata.name"
    assert values["BIJ_JOB_UID"] == "metadata.labels['batch.kubernetes.io/controller-uid']"


def test_a_step_job_is_one_pod_of_the_workers_identity_with_the_spec_and_no_gpu() -> None:
    from bij.steps import main as steps

    job = make_job(workers={"gpus": 1, "serviceAccountName": "team-a-worker", "backoffLimitPerIndex": 5,
                                    "image": "vllm-worker:big", "nodeSelector": {"pool": "h100"},
                                    "tolerations": [{"key": "gpu", "operator": "Exists"}], "spot": True,
                                    "cpu": "8", "memory": "64Gi", "priorityClassName": "gpu-batch"},
                   storage={"credentialsSecret": "team-a-s3"})
    body = step_jobs.render_step_job(job, "plan", 2, image="steps:1", owner_uid="u-1")
    assert body["metadata"]["name"] == f"{job.metadata.name}-plan-r2"
    assert body["metadata"]["labels"]["batchinference.io/step"] == "plan-r2"
    assert "batchinference.io/round" not in body["metadata"]["labels"]  # never taken for the round's Job
    spec = body["spec"]
    # One retry policy for steps and rounds: the spec's backoffLimitPerIndex (what the local controller reads).
    assert spec["completions"] == spec["parallelism"] == 1 and spec["backoffLimitPerIndex"] == 5
    assert spec["maxFailedIndexes"] == 0 and "backoffLimit" not in spec
    assert spec["podFailurePolicy"]["rules"] == [
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]
    assert pod(body)["serviceAccountName"] == "team-a-worker"
    assert container(body)["envFrom"] == [{"secretRef": {"name": "team-a-s3"}}]
    # A small pod anywhere on the steps image: none of the GPU pool's placement, size or image.
    assert container(body)["image"] == "steps:1"
    assert container(body)["resources"] == {"requests": {"cpu": "100m", "memory": "256Mi"},
                                            "limits": {"memory": "1Gi"}}
    for key in ("nodeSelector", "tolerations", "affinity", "priorityClassName"):
        assert key not in pod(body), key
    assert not any(v["name"] == "model-cache" for v in pod(body)["volumes"])
    assert container(body)["terminationMessagePolicy"] == "FallbackToLogsOnError"
    # Asked for, the steps go where the workers go (a cluster whose every node is tainted for GPUs).
    there = make_job(workers={"gpus": 1, "nodeSelector": {"pool": "h100"}, "stepsOnWorkerNodes": True,
                              "tolerations": [{"key": "gpu", "operator": "Exists"}]})
    placed = pod(step_jobs.render_step_job(there, "plan", 0, image="steps:1"))
    assert placed["nodeSelector"] == {"pool": "h100"}
    assert {"key": "gpu", "operator": "Exists"} in placed["tolerations"]
    assert worker_pod.GPU_TOLERATION in placed["tolerations"] and "nvidia.com/gpu" not in str(placed["containers"])
    args = steps.parse_args(container(body)["args"][1:])
    assert container(body)["args"][0] == "step" and args.kind == "plan" and args.round == 2
    assert args.key == body["metadata"]["name"]
    assert json.loads(args.job_spec)["metadata"]["name"] == job.metadata.name


def test_step_pods_take_the_charts_step_resources_and_a_bad_value_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    job = make_job()
    big = {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "4Gi"}}
    monkeypatch.setenv("BIJ_STEP_RESOURCES", json.dumps(big))
    assert container(step_jobs.render_step_job(job, "finish", 0, image="steps:1"))["resources"] == big
    for bad in ("{not json", '{"limits": 4}', '{"memory": "1Gi"}'):
        monkeypatch.setenv("BIJ_STEP_RESOURCES", bad)
        with pytest.raises(ValueError, match="BIJ_STEP_RESOURCES"):
            step_jobs.render_step_job(job, "finish", 0, image="steps:1")


def test_the_shared_file_volume_is_mounted_into_every_kind_of_pod_of_a_bij() -> None:
    volume = file_volume.FileVolume.from_env({file_volume.FILE_STORAGE_ENV: json.dumps(
        {"mountPath": "/data/", "volume": {"persistentVolumeClaim": {"claimName": "shared"}}})})
    assert volume is not None and volume.mount_path == "/data"
    job = make_job(input={"uri": "file:///data/in/"}, output={"uri": "file:///data/out/"})
    for body in (render(job, file_volume=volume),
                 step_jobs.render_publish_job(job, "ids", 2, "file:///data/out/p.json", file_volume=volume),
                 step_jobs.render_step_job(job, "plan", 0, file_volume=volume)):
        assert {"name": "bij-files", "persistentVolumeClaim": {"claimName": "shared"}} in pod(body)["volumes"]
        assert {"name": "bij-files", "mountPath": "/data"} in container(body)["volumeMounts"]
    assert not any(v["name"] == "bij-files" for v in pod(render(job))["volumes"])


def test_file_uris_on_a_cluster_need_the_shared_volume_and_must_lie_under_it() -> None:
    volume = file_volume.FileVolume("/data", {"hostPath": {"path": "/data"}})
    job = make_job(input={"uri": "file:///data/in/"}, output={"uri": "file:///elsewhere/out/"},
                   model={"engine": "vllm", "name": "m", "adapters": [{"name": "a", "uri": "file:///data/a/"}]})
    (outside,) = file_volume.file_uri_problems(job, volume)
    assert outside.startswith("spec.output.uri: file:///elsewhere/out/ is outside the shared volume at /data")
    assert "fileStorage.mountPath" in outside
    none = file_volume.file_uri_problems(job, None)
    assert [p.split(":")[0] for p in none] == ["spec.input.uri", "spec.output.uri", "spec.model.adapters[0].uri"]
    assert all("set the chart value fileStorage" in p for p in none)
    assert file_volume.file_uri_problems(make_job(), None) == []  # s3:// needs no volume
    assert not file_volume.file_uri_problems(make_job(input={"uri": "file:///data"}, output={"uri": "s3://b/o"}),
                                      volume)
    # a prefix, not a folder
    assert file_volume.file_uri_problems(make_job(input={"uri": "file:///database/in"}), volume)
    with pytest.raises(ValueError, match="BIJ_FILE_STORAGE"):
        file_volume.FileVolume.from_env({file_volume.FILE_STORAGE_ENV: '{"mountPath": "data", "volume": {}}'})


def test_gpus_cpu_and_memory() -> None:
    rendered = render(make_job(workers={"gpus": 2, "cpu": "8", "memory": "64Gi"}))
    assert container(rendered)["resources"] == {
        "requests": {"cpu": "8", "memory": "64Gi"},
        "limits": {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "2"},
    }
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod(rendered)["tolerations"]
    cpu_only = render(make_job())
    assert "resources" not in container(cpu_only) and "tolerations" not in pod(cpu_only)


def test_vllm_without_gpus_gets_tensor_x_pipeline_parallel_gpus() -> None:
    vllm = {"engine": "vllm", "name": "m", "task": "generate"}
    one = render(make_job(model=vllm))
    assert container(one)["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod(one)["tolerations"]
    four = render(make_job(model={**vllm, "vllm": {"tensorParallelSize": 2, "pipelineParallelSize": 2}}))
    assert container(four)["resources"]["limits"] == {"nvidia.com/gpu": "4"}
    eight = render(make_job(model=vllm, workers={"gpus": 8}))  # more than the engine needs: the user's call
    assert container(eight)["resources"]["limits"] == {"nvidia.com/gpu": "8"}
    echo = render(make_job(workers={"gpus": 0}))
    assert "resources" not in container(echo)


def test_vllm_with_too_few_gpus_is_refused_naming_both_fields() -> None:
    from bij.contract.spec import SpecError

    for workers, vllm in (({"gpus": 0}, {}), ({"gpus": 1}, {"tensorParallelSize": 2})):
        with pytest.raises(SpecError) as e:
            make_job(model={"engine": "vllm", "name": "m", "task": "generate", "vllm": vllm}, workers=workers)
        assert "workers.gpus" in str(e.value) and "model.engine vllm" in str(e.value)


def test_shm_and_model_cache_volumes() -> None:
    rendered = render(make_job(workers={"shmSize": "16Gi", "modelCache": {"sizeLimit": "50Gi", "mountPath": "/cache"}}))
    volumes = {v["name"]: v for v in pod(rendered)["volumes"]}
    assert volumes["dshm"] == {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}}
    assert volumes["model-cache"] == {"name": "model-cache", "emptyDir": {"sizeLimit": "50Gi"}}
    mounts = {m["name"]: m["mountPath"] for m in container(rendered)["volumeMounts"]}
    assert mounts == {"dshm": "/dev/shm", "model-cache": "/cache"}
    assert env(rendered)["HF_HOME"] == "/cache/huggingface"

    host = pod(render(make_job(workers={"modelCache": {"type": "hostPath", "path": "/mnt/models"}, "shmSize": None})))
    assert host["volumes"] == [
        {"name": "model-cache", "hostPath": {"path": "/mnt/models", "type": "DirectoryOrCreate"}}
    ]
    pvc = pod(render(make_job(workers={"modelCache": {"type": "pvc", "claimName": "weights"}})))
    assert pvc["volumes"][0] == {"name": "model-cache", "persistentVolumeClaim": {"claimName": "weights"}}


def test_pod_meets_the_restricted_pod_security_standard() -> None:
    rendered = render(make_job(workers={"gpus": 1}))
    pod_ctx = pod(rendered)["securityContext"]
    ctx = container(rendered)["securityContext"]
    assert pod_ctx["runAsNonRoot"] is True and pod_ctx["runAsUser"] == 1000
    assert pod_ctx["seccompProfile"] == {"type": "RuntimeDefault"}
    assert ctx["allowPrivilegeEscalation"] is False and ctx["capabilities"] == {"drop": ["ALL"]}
    assert ctx["runAsNonRoot"] is True and ctx["runAsUser"] == 1000
    assert pod(rendered)["serviceAccountName"] == "bij-worker"
    # Its one use of the API: reporting into its bij's status (the worker Role grants only that).
    assert pod(rendered)["automountServiceAccountToken"] is True
    assert pod(render(make_job(workers={"serviceAccountName": "mine"})))["serviceAccountName"] == "mine"


# --- spot scheduling ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "provider, label, value, taint",
    [
        ("gke", "cloud.google.com/gke-spot", "true", True),
        ("eks", "eks.amazonaws.com/capacityType", "SPOT", False),
        ("karpenter", "karpenter.sh/capacity-type", "spot", False),
        ("aks", "kubernetes.azure.com/scalesetpriority", "spot", True),
    ],
)
def test_spot_provider_selects_its_spot_nodes(provider: str, label: str, value: str, taint: bool) -> None:
    spec = pod(render(make_job(workers={"spot": True, "spotProvider": provider})))
    assert spec["nodeSelector"] == {label: value}
    expected = [{"key": label, "operator": "Equal", "value": value, "effect": "NoSchedule"}] if taint else []
    assert spec.get("tolerations", []) == expected
    assert "affinity" not in spec


def test_spot_on_all_providers_tolerates_every_taint_and_prefers_any_spot_label() -> None:
    spec = pod(render(make_job(workers={"spot": True, "spotProvider": "all"})))
    assert "nodeSelector" not in spec
    assert {t["key"] for t in spec["tolerations"]} == {
        "cloud.google.com/gke-spot", "kubernetes.azure.com/scalesetpriority"
    }
    node_affinity = spec["affinity"]["nodeAffinity"]
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in node_affinity
    preferred = node_affinity["preferredDuringSchedulingIgnoredDuringExecution"]
    terms = {(e["key"], e["values"][0]) for p in preferred for e in p["preference"]["matchExpressions"]}
    assert terms == set(worker_pod.SPOT_NODE_LABELS.values())


def test_spot_placement_merges_with_the_users_placement() -> None:
    user_affinity = {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}]},
        "preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 5, "preference": {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}}],
    }}
    user_toleration = {"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true", "effect": "NoSchedule"}
    job = make_job(workers={"spot": True, "spotProvider": "all", "affinity": user_affinity,
                            "nodeSelector": {"pool": "batch"}, "tolerations": [user_toleration]})
    spec = pod(render(job))
    assert spec["nodeSelector"] == {"pool": "batch"}
    node_affinity = spec["affinity"]["nodeAffinity"]
    assert node_affinity["requiredDuringSchedulingIgnoredDuringExecution"] == \
        user_affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert len(node_affinity["preferredDuringSchedulingIgnoredDuringExecution"]) == 1 + len(worker_pod.SPOT_NODE_LABELS)
    assert spec["tolerations"].count(user_toleration) == 1  # no duplicates
    assert job.spec.workers.affinity == user_affinity  # the spec itself is left alone

    gke = pod(render(make_job(workers={"spot": True, "spotProvider": "gke",
                                       "nodeSelector": {"cloud.google.com/gke-spot": "true", "pool": "x"}})))
    assert gke["nodeSelector"] == {"cloud.google.com/gke-spot": "true", "pool": "x"}


def test_no_spot_placement_when_spot_is_off() -> None:
    spec = pod(render(make_job(workers={"spotProvider": "gke"})))
    assert not ({"nodeSelector", "tolerations", "affinity"} & spec.keys())


# --- bij render -----------------------------------------------------------------------------


def test_cli_render_with_shards_prints_the_job(capsys: pytest.CaptureFixture[str]) -> None:
    path = ROOT / "examples" / "vllm-generate-spot.yaml"
    assert bij_main(["render", str(path), "--shards", "3", "--round", "1", "--image", "img:1"]) == 0
    rendered = yaml.safe_load(capsys.readouterr().out)
    job = load_job(path)
    assert rendered["metadata"]["name"] == "vllm-generate-spot-r1"
    assert rendered["spec"]["completions"] == 3
    assert container(rendered)["image"] == "img:1"
    assert container(rendered)["args"][1] == layout.round_manifest_uri(job, 1)
    assert container(rendered)["args"][1].endswith("/_bij/vllm-generate-spot/round-1/shards.json")


def test_cli_render_plans_the_input_when_no_shard_count_is_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from bij.steps.planner import plan_shards_for

    data = tmp_path / "in"
    data.mkdir()
    for i in range(3):
        (data / f"part-{i}.jsonl").write_text("".join(f'{{"id": {n}, "text": "{"x" * 900}"}}\n' for n in range(3)))
    spec = {
        "apiVersion": "batchinference.io/v1alpha1", "kind": "BatchInferenceJob", "metadata": {"name": "planned"},
        "spec": {"input": {"uri": f"file://{data}"}, "output": {"uri": f"file://{tmp_path}/out"},
                 "sharding": {"targetShardBytes": 2048}},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    monkeypatch.setenv("BIJ_WORKER_IMAGE", "from-env:2")
    assert bij_main(["render", str(path)]) == 0
    rendered = yaml.safe_load(capsys.readouterr().out)
    shards = plan_shards_for(load_job(path), 0)
    # One index per lane: workers.parallelism (4 by default), never more than there are shards.
    assert shards > 1 and rendered["spec"]["completions"] == min(4, shards)
    assert container(rendered)["image"] == "from-env:2"


def test_cli_render_without_input_asks_for_a_shard_count(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = {
        "apiVersion": "batchinference.io/v1alpha1", "kind": "BatchInferenceJob", "metadata": {"name": "missing"},
        "spec": {"input": {"uri": f"file://{tmp_path}/nothing-here"}, "output": {"uri": f"file://{tmp_path}/out"}},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert bij_main(["render", str(path)]) == 1
    assert "--shards" in capsys.readouterr().err


def test_cli_render_reports_an_invalid_spec(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("apiVersion: batchinference.io/v1alpha1\nkind: BatchInferenceJob\nmetadata: {name: x}\n"
                    "spec: {input: {uri: 'http://x'}, output: {uri: 'file:///o'}}\n")
    assert bij_main(["render", str(path), "--shards", "2"]) == 1
    assert "spec.input.uri" in capsys.readouterr().err


def test_a_publish_pass_job_runs_every_nth_index_of_the_pass_without_gpu_or_spot_placement() -> None:
    job = make_job(model={"engine": "vllm", "task": "generate", "name": "m"},
                   workers={"spot": True, "spotProvider": "gke", "nodeSelector": {"pool": "batch"},
                            "cpu": "2", "memory": "8Gi"})
    body = step_jobs.render_publish_job(job, "dedupe", 3, "s3://b/out/_bij/t/publish/plan.json", image="img:1",
                                   owner_uid="u-1")
    assert body["metadata"]["name"] == f"{job.metadata.name}-publish-dedupe"
    labels = body["metadata"]["labels"]
    assert labels[PUBLISH_LABEL] == "dedupe" and ROUND_LABEL not in labels
    assert labels[JOB_LABEL] == job.metadata.name
    assert body["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    spec = body["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 3, 3)
    assert spec["podFailurePolicy"] == render(job)["spec"]["podFailurePolicy"]  # exit 42 fails it at once
    c = container(body)
    assert c["command"] == ["bij-worker"]
    assert c["args"] == ["publish", "--plan", "s3://b/out/_bij/t/publish/plan.json", "--pass", "dedupe",
                         "--stride", "3"]
    assert c["resources"] == {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"cpu": "2", "memory": "8Gi"}}
    p = pod(body)
    assert p["nodeSelector"] == {"pool": "batch"}  # the user's placement, not the spot/GPU one
    assert "tolerations" not in p and "affinity" not in p


def test_a_publish_pass_job_runs_all_its_pods_at_once_whatever_the_rounds_parallelism() -> None:
    # `bij publish --parallelism 2` of a job whose workers.parallelism is 1: two stride pods, both at once.
    job = make_job(workers={"parallelism": 1})
    spec = step_jobs.render_publish_job(job, "write", 2, "file:///o/_bij/t/publish/plan.json")["spec"]
    assert (spec["completions"], spec["parallelism"]) == (2, 2)


# --- lanes of several pods (spec.workers.nodesPerLane) -----------------------------------------------

TWO_NODE_VLLM = {"model": {"engine": "vllm", "name": "m", "task": "generate", "vllm": {"tensorParallelSize": 8}},
                 "workers": {"nodesPerLane": 2, "parallelism": 4}}


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
def test_a_round_of_two_pod_lanes_and_its_headless_service_are_valid_for_kubernetes(kube: str) -> None:
    job = make_job(**{**TWO_NODE_VLLM, "workers": {**TWO_NODE_VLLM["workers"], "queueName": "gpus"}})
    kubernetes_validate.validate(render(job, completions=3, owner_uid="uid-1"), kube, strict=True)
    kubernetes_validate.validate(jobs.render_lane_service(job, owner_uid="uid-1"), kube, strict=True)


def test_a_lane_of_n_pods_is_n_consecutive_indexes_whose_first_is_the_leader_reached_by_name() -> None:
    from bij.worker.group import leader_host, role_of

    job = make_job(**TWO_NODE_VLLM)
    rendered = render(job, completions=3)
    spec = rendered["spec"]
    assert spec["completions"] == 6 and spec["parallelism"] == 6  # 3 lanes (fewer than parallelism 4) of 2
    assert rendered["metadata"]["annotations"]["batchinference.io/nodes-per-lane"] == "2"
    assert pod(rendered)["subdomain"] == "summaries-lanes" == jobs.render_lane_service(job)["metadata"]["name"]
    e = env(rendered)
    assert e["BIJ_NODES_PER_LANE"] == "2"
    assert e["BIJ_GROUP_LEADER"] == "summaries-r0-{index}.summaries-lanes"
    own = make_job(**{**TWO_NODE_VLLM, "workers": {"nodesPerLane": 2, "env": {"BIJ_GROUP_LEADER": "{index}.lanes.x"}}})
    assert [v for k, v in ((x["name"], x.get("value")) for x in container(render(own))["env"])
            if k == "BIJ_GROUP_LEADER"] == ["{index}.lanes.x"]
    roles = [role_of(i, e) for i in range(spec["completions"])]
    assert [(r.lane, r.rank, r.leader) for r in roles] == [
        (0, 0, True), (0, 1, False), (1, 0, True), (1, 1, False), (2, 0, True), (2, 1, False)]
    # Every pod of lane 1 reaches the same leader: index 2, named <job>-<index> under the Service.
    assert {leader_host(r, e) for r in roles if r.lane == 1} == {"summaries-r0-2.summaries-lanes"}
    # One pipeline stage a pod: each pod gets the GPUs of tensor parallel, not tensor x pipeline.
    assert container(rendered)["resources"]["limits"] == {"nvidia.com/gpu": "8"}
    ports = {p["name"]: p["containerPort"] for p in container(rendered)["ports"]}
    assert ports == {"metrics": 9400, "ray": 6379, "group": 6390}
    # Fewer lanes at once than there are: whole groups at once.
    fewer = make_job(**{**TWO_NODE_VLLM, "workers": {"nodesPerLane": 3, "parallelism": 2}})
    assert render(fewer, completions=5)["spec"]["parallelism"] == 6
    assert jobs.desired_parallelism(fewer, 5) == 6


def test_a_headless_service_selects_the_bijs_worker_pods_and_publishes_them_before_they_are_ready() -> None:
    job = make_job(**TWO_NODE_VLLM)
    svc = jobs.render_lane_service(job, owner_uid="uid-1")
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    labels = render(job)["spec"]["template"]["metadata"]["labels"]
    assert all(labels[k] == v for k, v in svc["spec"]["selector"].items())
    assert svc["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert svc["metadata"]["namespace"] == "team-a"


def test_a_member_lost_is_not_counted_against_the_indexes_of_its_group_but_bad_config_still_fails_the_job() -> None:
    rules = render(make_job(**TWO_NODE_VLLM))["spec"]["podFailurePolicy"]["rules"]
    assert [r["action"] for r in rules] == ["Ignore", "Ignore", "FailJob"]
    assert rules[0]["onPodConditions"] == [{"type": "DisruptionTarget", "status": "True"}]
    assert rules[1]["onExitCodes"] == {"containerName": "worker", "operator": "In", "values": [44]}
    # A lane of one pod has no group to lose.
    one = render(make_job())["spec"]["podFailurePolicy"]["rules"]
    assert all(44 not in (r.get("onExitCodes") or {}).get("values", []) for r in one)
    assert "subdomain" not in pod(render(make_job()))
    assert "batchinference.io/nodes-per-lane" not in render(make_job())["metadata"]["annotations"]


def test_publish_and_step_jobs_of_a_bij_with_lanes_of_several_pods_are_plain_pods() -> None:
    job = make_job(**TWO_NODE_VLLM)
    for body in (step_jobs.render_publish_job(job, "ids", 3, "s3://b/p.json"),
                 step_jobs.render_step_job(job, "plan", 0)):
        assert body["spec"]["completions"] in (1, 3)
        assert "subdomain" not in pod(body)
        assert "BIJ_NODES_PER_LANE" not in env(body)
        assert "batchinference.io/nodes-per-lane" not in body["metadata"]["annotations"]


def test_lanes_of_several_pods_need_an_engine_that_spans_them() -> None:
    from bij.contract.spec import SpecError

    with pytest.raises(SpecError, match="nodesPerLane above 1 needs model.engine vllm"):
        make_job(workers={"nodesPerLane": 2})  # echo
    with pytest.raises(SpecError, match="pipelineParallelSize"):
        make_job(model={"engine": "vllm", "name": "m", "vllm": {"pipelineParallelSize": 3}},
                 workers={"nodesPerLane": 2})
    assert make_job(model={"engine": "vllm", "name": "m", "vllm": {"pipelineParallelSize": 2}},
                    workers={"nodesPerLane": 2}).spec.gpus == 1
    assert make_job(model={"engine": "simulated"}, workers={"nodesPerLane": 4}).spec.workers.nodes_per_lane == 4


def test_the_leaders_vllm_runs_rays_executor_one_pipeline_stage_a_pod() -> None:
    from bij.engines.vllm_llm import llm_kwargs
    from bij.worker.main import engine_config

    job = make_job(**TWO_NODE_VLLM)
    kwargs = llm_kwargs(engine_config(job.spec))
    assert kwargs["distributed_executor_backend"] == "ray"
    assert kwargs["pipeline_parallel_size"] == 2 and kwargs["tensor_parallel_size"] == 8
    single = llm_kwargs(engine_config(make_job(model=TWO_NODE_VLLM["model"]).spec))
    assert "distributed_executor_backend" not in single and single["pipeline_parallel_size"] == 1


def test_the_operator_counts_a_lane_done_when_its_leader_is_and_failed_when_any_of_its_pods_is() -> None:
    from bij.control.observe import JobView

    job = make_job(**TWO_NODE_VLLM)
    body = render(job, completions=3)
    body["status"] = {"completedIndexes": "0-1,3", "failedIndexes": "5", "active": 1}
    view = JobView.of(body)
    assert view.nodes_per_lane == 2
    assert view.completed == frozenset({0}) and view.failed == frozenset({2})  # index 3 is lane 1's member
    lanes = view.lanes
    assert (lanes.done, lanes.failed, lanes.active, lanes.total) == (1, 1, 1, 3)
    plain = render(make_job(), completions=3)
    plain["status"] = {"completedIndexes": "0,2"}
    assert JobView.of(plain).completed == frozenset({0, 2}) and JobView.of(plain).lanes.total == 3


def test_bij_run_refuses_lanes_of_several_pods_saying_why(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bij.local.run import LocalRunner

    job = make_job(model={"engine": "simulated"}, workers={"nodesPerLane": 2})
    with pytest.raises(ValueError, match="nodesPerLane is 2: .* runs on Kubernetes only"):
        LocalRunner(job)
    doc = job.model_dump(by_alias=True, exclude_none=True)
    doc["spec"]["input"]["uri"], doc["spec"]["output"]["uri"] = f"file://{tmp_path}/in/", f"file://{tmp_path}/out/"
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert bij_main(["run", str(path)]) == 42
    assert "runs on Kubernetes only" in capsys.readouterr().err


def test_cli_render_of_lanes_of_several_pods_prints_their_service_then_the_job(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = make_job(**TWO_NODE_VLLM).model_dump(by_alias=True, exclude_none=True)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert bij_main(["render", str(path), "--shards", "3"]) == 0
    service, job = yaml.safe_load_all(capsys.readouterr().out)
    assert (service["kind"], service["metadata"]["name"]) == ("Service", "summaries-lanes")
    assert job["kind"] == "Job" and job["spec"]["completions"] == 6
    assert pod(job)["subdomain"] == "summaries-lanes"
