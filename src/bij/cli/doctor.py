"""`bij doctor [-n NAMESPACE] [JOB.yaml]`: is a namespace ready for bijs, before the first one goes quiet?

Checks, each answered ok, warn (cannot tell, or may resolve itself) or fail, with the command that
fixes a failure:

- the namespace and the worker service account exist;
- the worker identity holds every grant its pods use (`permissions.WORKER_GRANTS`, the chart's worker
  Role), asked with a LocalSubjectAccessReview for that service account (`access_review.check_grants`, the
  operator's own check before a bij's first pod);
- with a job: its credentials Secret exists and holds S3 keys; some node can take its worker pods
  (node selector, required node affinity, taints, GPUs), judged on the pod the operator would create;
- with a job: a short-lived pod of the namespace, under the worker identity, with the job's image and
  storage settings, lists the input and writes, reads back and deletes one object under the output
  (`bij.steps.probe`). The answer comes from where the job's pods run, never with the operator's
  identity or the caller's; an image that cannot be pulled shows there too.

Pure parts (`node_fits`, `pod_findings`, `format_report`) are plain functions over dicts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

from bij.contract.spec import BatchInferenceJob, SpecError, job_to_dict, load_job
from bij.control.access_review import check_grants
from bij.control.file_volume import FILE_STORAGE_ENV, FileVolume
from bij.control.jobs import render_job as _render_job
from bij.control.jobs import worker_image_default
from bij.control.permissions import DEFAULT_SERVICE_ACCOUNT
from bij.control.step_jobs import render_step_job

Level = Literal["ok", "warn", "fail"]
# Image problems a pod shows while waiting: it will never start as it is.
IMAGE_WAITING = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull")
CONFIG_WAITING = ("CreateContainerConfigError", "CreateContainerError")
PROBE_TIMEOUT = 300.0


@dataclasses.dataclass(frozen=True)
class Finding:
    check: str
    level: Level
    detail: str
    fix: str = ""


# --- nodes: could the scheduler place the worker pod? --------------------------------------------


def _tolerates(tolerations: Iterable[Mapping[str, Any]], taint: Mapping[str, Any]) -> bool:
    for t in tolerations:
        if t.get("effect") and t.get("effect") != taint.get("effect"):
            continue
        if t.get("operator") == "Exists":
            if not t.get("key") or t.get("key") == taint.get("key"):
                return True
        elif t.get("key") == taint.get("key") and (t.get("value") or "") == (taint.get("value") or ""):
            return True
    return False


def _matches(expr: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    key, op, values = expr.get("key", ""), expr.get("operator"), list(expr.get("values") or [])
    if op == "In":
        return labels.get(key) in values
    if op == "NotIn":
        return labels.get(key) not in values
    if op == "Exists":
        return key in labels
    if op == "DoesNotExist":
        return key not in labels
    if op in ("Gt", "Lt") and key in labels and values:
        try:
            have, want = int(labels[key]), int(values[0])
        except ValueError:
            return False
        return have > want if op == "Gt" else have < want
    return False


def node_fits(pod: Mapping[str, Any], node: Mapping[str, Any]) -> str | None:
    """None when `node` could take `pod` (a pod spec), else why not, in a few words."""
    meta, spec, status = node.get("metadata") or {}, node.get("spec") or {}, node.get("status") or {}
    labels = meta.get("labels") or {}
    if spec.get("unschedulable"):
        return "cordoned"
    for key, value in (pod.get("nodeSelector") or {}).items():
        if labels.get(key) != value:
            return f"lacks label {key}={value}"
    required = (((pod.get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution") or {})
    terms = required.get("nodeSelectorTerms") or []
    if terms and not any(all(_matches(e, labels) for e in term.get("matchExpressions") or []) for term in terms):
        return "outside the required node affinity"
    for taint in spec.get("taints") or []:
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not _tolerates(pod.get("tolerations") or [], taint):
            return f"taint {taint.get('key')}={taint.get('value') or ''}:{taint.get('effect')} not tolerated"
    allocatable = status.get("allocatable") or {}
    for c in pod.get("containers") or []:
        for name, want in ((c.get("resources") or {}).get("limits") or {}).items():
            if "/" in name and int(str(allocatable.get(name, "0")) or 0) < int(want):
                return f"has {allocatable.get(name, '0')} {name}, the pod needs {want}"
    return None


def nodes_finding(pod: Mapping[str, Any], nodes: Sequence[Mapping[str, Any]]) -> Finding:
    why: dict[str, list[str]] = {}
    fit = []
    for node in nodes:
        name = (node.get("metadata") or {}).get("name", "?")
        reason = node_fits(pod, node)
        if reason is None:
            fit.append(name)
        else:
            why.setdefault(reason, []).append(name)
    if fit:
        return Finding("nodes", "ok", f"{len(fit)} of {len(nodes)} node(s) can take a worker pod: {', '.join(fit[:5])}")
    reasons = "; ".join(f"{len(names)} {reason}" for reason, names in sorted(why.items())) or "the cluster has no nodes"
    return Finding("nodes", "warn", f"no node can take a worker pod now ({reasons}); pods stay Pending unless a "
                   "cluster autoscaler or Karpenter adds a node that fits",
                   "check spec.workers.nodeSelector / tolerations / spot / gpus against the node pool's labels "
                   "and taints")


# --- the probe pod ------------------------------------------------------------------------------


def probe_pod(job: BatchInferenceJob, image: str, file_volume: FileVolume | None, name: str,
              timeout: float) -> dict[str, Any]:
    """A one-container Pod: the job's step pod (its identity, image, env, Secret, volumes), without the
    workers' GPU placement or a report to deliver, running `bij-worker probe`."""
    body = render_step_job(job, "plan", image=image, file_volume=file_volume)
    template = body["spec"]["template"]
    spec = template["spec"]
    for key in ("nodeSelector", "tolerations", "affinity", "priorityClassName"):
        spec.pop(key, None)
    spec["restartPolicy"] = "Never"
    spec["activeDeadlineSeconds"] = int(timeout)
    (container,) = spec["containers"]
    container["args"] = ["probe", "--job-spec", json.dumps(job_to_dict(job), separators=(",", ":"))]
    container["terminationMessagePolicy"] = "FallbackToLogsOnError"
    container.pop("resources", None)
    container.pop("ports", None)
    labels = dict(template["metadata"].get("labels") or {})
    labels["app.kubernetes.io/component"] = "doctor"
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": job.metadata.namespace, "labels": labels}, "spec": spec}


def pod_findings(pod: Mapping[str, Any]) -> list[Finding] | None:
    """What a probe pod says so far: None while it may still finish."""
    status = pod.get("status") or {}
    statuses = status.get("containerStatuses") or []
    state = (statuses[0].get("state") or {}) if statuses else {}
    waiting = state.get("waiting") or {}
    image = ((pod.get("spec") or {}).get("containers") or [{}])[0].get("image", "")
    if waiting.get("reason") in IMAGE_WAITING:
        return [Finding("image", "fail", f"{image} cannot be pulled: {waiting.get('reason')}: "
                        f"{waiting.get('message', '')}".strip(),
                        "set spec.workers.image (or the chart's workerImage) to an image the nodes can pull")]
    if waiting.get("reason") in CONFIG_WAITING:
        return [Finding("pod", "fail", f"the worker container cannot be created: {waiting.get('reason')}: "
                        f"{waiting.get('message', '')}".strip(),
                        "check spec.storage.credentialsSecret and the volumes the job names")]
    terminated = state.get("terminated")
    if status.get("phase") not in ("Succeeded", "Failed") or terminated is None:
        if status.get("phase") == "Failed":  # e.g. activeDeadlineSeconds before the container ran
            return [Finding("storage", "fail", f"the probe pod failed: {status.get('reason', '')} "
                            f"{status.get('message', '')}".strip())]
        return None
    found = [Finding("image", "ok", f"{image} ran")]
    lines = [ln for ln in (terminated.get("message") or "").splitlines() if ln.startswith("{")]
    checks = []
    for line in lines:
        try:
            checks.append(json.loads(line))
        except ValueError:
            continue
    if terminated.get("exitCode") == 0:
        return found + [Finding("storage", "ok", "input listed; output written, read back and deleted")]
    named = [c for c in checks if "check" in c]
    if not named:
        tail = (terminated.get("message") or "").strip()[-600:]
        return found + [Finding("storage", "fail", f"the probe exited {terminated.get('exitCode')}: {tail}")]
    return found + [Finding(f"storage.{c['check']}", "ok" if c.get("ok") else "fail", str(c.get("detail", "")),
                            "" if c.get("ok") else "check spec.storage (endpointUrl, credentialsSecret) and the "
                            "bucket policy of this identity") for c in named]


# --- the cluster side ---------------------------------------------------------------------------


class Doctor:
    """The checks against one API server, as the caller's kubeconfig identity."""

    def __init__(self, api: Any, *, operator_namespace: str = "bij-system", log: Callable[[str], None] | None = None):
        import kubernetes

        self.api = api
        self.core = kubernetes.client.CoreV1Api(api)
        self.authz = kubernetes.client.AuthorizationV1Api(api)
        self.apps = kubernetes.client.AppsV1Api(api)
        self.operator_namespace = operator_namespace
        self.log = log or (lambda _msg: None)

    def run(self, namespace: str, job: BatchInferenceJob | None, *, probe: bool = True,
            image: str | None = None, timeout: float = PROBE_TIMEOUT) -> list[Finding]:
        from kubernetes.client import ApiException

        sa = (job.spec.workers.service_account_name if job else None) or DEFAULT_SERVICE_ACCOUNT
        out: list[Finding] = []
        try:
            self.core.read_namespace(namespace)
            out.append(Finding("namespace", "ok", f"{namespace} exists"))
        except ApiException as e:
            if e.status == 404:
                return [Finding("namespace", "fail", f"namespace {namespace} does not exist",
                                f"kubectl create namespace {namespace}, then list it in the chart's "
                                "workerServiceAccount.namespaces")]
            out.append(Finding("namespace", "warn", f"cannot read namespace {namespace}: {e.status} {e.reason}"))
        out.append(self.service_account(namespace, sa))
        out.append(self.grants(namespace, sa))
        if job is None:
            return out
        secret = job.spec.storage.credentials_secret
        if secret:
            out.append(self.secret(namespace, secret, job))
            probe = probe and out[-1].level != "fail"  # a pod naming a missing Secret never starts
        settings = self.operator_settings()
        chosen = image or job.spec.workers.image or settings.get("BIJ_WORKER_IMAGE") or worker_image_default()
        file_volume = FileVolume.from_env({FILE_STORAGE_ENV: settings[FILE_STORAGE_ENV]}) \
            if settings.get(FILE_STORAGE_ENV) else None
        uses_files = any(u.startswith("file://") for u in (job.spec.input.uri, job.spec.output.uri))
        if uses_files and file_volume is None:
            out.append(Finding("storage", "fail", "the job reads or writes file:// URIs, which a cluster serves only "
                               "under the chart value fileStorage (not set on the operator found)",
                               "use s3:// or gs:// URIs, or install the chart with fileStorage.mountPath and .volume"))
            probe = False
        out.append(self.nodes(job, chosen, file_volume))
        if probe:
            out += self.probe(job, chosen, file_volume, timeout)
        return out

    def service_account(self, namespace: str, sa: str) -> Finding:
        from kubernetes.client import ApiException

        try:
            self.core.read_namespaced_service_account(sa, namespace)
            return Finding("serviceAccount", "ok", f"{namespace}/{sa} exists")
        except ApiException as e:
            if e.status == 404:
                return Finding("serviceAccount", "fail", f"service account {namespace}/{sa} does not exist",
                               f"kubectl -n {namespace} create serviceaccount {sa}  (or list {namespace} in the "
                               "chart's workerServiceAccount.namespaces)")
            return Finding("serviceAccount", "warn", f"cannot read service account {namespace}/{sa}: "
                           f"{e.status} {e.reason}")

    def grants(self, namespace: str, sa: str) -> Finding:
        check = check_grants(self.authz, namespace, sa)
        if check.result == "Unknown":
            return Finding("rbac", "warn", check.describe())
        if check.result == "Missing":
            return Finding("rbac", "fail", check.describe(), check.fix)
        return Finding("rbac", "ok", check.describe())

    def secret(self, namespace: str, name: str, job: BatchInferenceJob) -> Finding:
        from kubernetes.client import ApiException

        try:
            secret = self.core.read_namespaced_secret(name, namespace)
        except ApiException as e:
            if e.status == 404:
                return Finding("secret", "fail", f"spec.storage.credentialsSecret: Secret {namespace}/{name} "
                               "does not exist",
                               f"kubectl -n {namespace} create secret generic {name} "
                               "--from-literal=AWS_ACCESS_KEY_ID=... --from-literal=AWS_SECRET_ACCESS_KEY=...")
            return Finding("secret", "warn", f"cannot read Secret {namespace}/{name}: {e.status} {e.reason} "
                           "(the probe pod still tells whether storage answers)")
        keys = set((secret.data or {}).keys()) | set((secret.string_data or {}).keys())
        uris = (job.spec.input.uri, job.spec.output.uri)
        lacking = [k for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY") if k not in keys]
        if any(u.startswith("gs://") for u in uris) and lacking:
            # gs:// goes through GCS's XML API, which takes an HMAC key only: a pod's own identity cannot sign.
            return Finding("secret", "fail", f"Secret {namespace}/{name} has no {' or '.join(lacking)}: gs:// needs "
                           "a Cloud Storage HMAC key (its access id and secret) under these names",
                           f"gcloud storage hmac create SERVICE_ACCOUNT_EMAIL, then kubectl -n {namespace} create "
                           f"secret generic {name} --from-literal=AWS_ACCESS_KEY_ID=ACCESS_ID "
                           "--from-literal=AWS_SECRET_ACCESS_KEY=SECRET")
        signs_azure = "AZURE_STORAGE_CONNECTION_STRING" in keys or (
            "AZURE_STORAGE_ACCOUNT" in keys and ({"AZURE_STORAGE_KEY", "AZURE_STORAGE_SAS_TOKEN"} & keys))
        if any(u.startswith("az://") for u in uris) and not signs_azure:
            # az:// signs with the account's key or a SAS: the Blob service takes no other credential from bij.
            return Finding("secret", "fail", f"Secret {namespace}/{name} has no Azure storage credentials: az:// "
                           "needs AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT with AZURE_STORAGE_KEY or "
                           "AZURE_STORAGE_SAS_TOKEN",
                           f"kubectl -n {namespace} create secret generic {name} "
                           "--from-literal=AZURE_STORAGE_CONNECTION_STRING=\"$(az storage account "
                           "show-connection-string -n ACCOUNT -o tsv)\"")
        if any(u.startswith("s3://") for u in uris) and lacking:
            return Finding("secret", "warn", f"Secret {namespace}/{name} has no {' or '.join(lacking)}; its pods "
                           "sign S3 requests with whatever identity the pod has (IRSA, workload identity)")
        return Finding("secret", "ok", f"Secret {namespace}/{name} exists ({len(keys)} key(s))")

    def operator_settings(self) -> dict[str, str]:
        """The operator Deployment's worker image and file storage, where the caller may read it."""
        from kubernetes.client import ApiException

        try:
            deps = self.apps.list_namespaced_deployment(
                self.operator_namespace, label_selector="app.kubernetes.io/name=bij-operator").items
        except ApiException:
            return {}
        for dep in deps:
            for c in dep.spec.template.spec.containers:
                return {e.name: e.value for e in c.env or [] if e.value is not None}
        return {}

    def nodes(self, job: BatchInferenceJob, image: str, file_volume: FileVolume | None) -> Finding:
        from kubernetes.client import ApiException

        pod = _render_job(job, 0, 1, "", image=image, file_volume=file_volume)["spec"]["template"]["spec"]
        try:
            nodes = self.api.sanitize_for_serialization(self.core.list_node())["items"]
        except ApiException as e:
            return Finding("nodes", "warn", f"cannot list nodes: {e.status} {e.reason}")
        return nodes_finding(pod, nodes)

    def probe(self, job: BatchInferenceJob, image: str, file_volume: FileVolume | None,
              timeout: float) -> list[Finding]:
        from kubernetes.client import ApiException

        namespace = job.metadata.namespace
        name = f"{job.metadata.name[:40]}-doctor-{uuid.uuid4().hex[:6]}"
        body = probe_pod(job, image, file_volume, name, timeout)
        try:
            self.core.create_namespaced_pod(namespace, body)
        except ApiException as e:
            return [Finding("storage", "warn", f"cannot create the probe pod in {namespace}: {e.status} {e.reason}",
                            "run bij doctor as someone who may create pods there, or pass --no-probe")]
        self.log(f"probe pod {namespace}/{name} started (image {image})")
        try:
            deadline = time.monotonic() + timeout + 30
            pod: dict[str, Any] = {}
            while time.monotonic() < deadline:
                try:
                    pod = self.api.sanitize_for_serialization(self.core.read_namespaced_pod(name, namespace))
                except ApiException as e:
                    return [Finding("storage", "warn", f"probe pod {name} cannot be read: {e.status} {e.reason}")]
                found = pod_findings(pod)
                if found is not None:
                    return found
                time.sleep(0.5)
            return [Finding("storage", "fail", f"the probe pod did not finish within {timeout:.0f} s "
                            f"(phase {pod.get('status', {}).get('phase')}): no node takes it, or its image is slow "
                            "to pull", f"kubectl -n {namespace} describe pod {name}")]
        finally:
            try:
                self.core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
            except ApiException:
                pass


def format_report(findings: Sequence[Finding]) -> str:
    width = max((len(f.check) for f in findings), default=5)
    lines = []
    for f in findings:
        lines.append(f"{f.level.upper():4}  {f.check:{width}}  {f.detail}")
        if f.fix and f.level != "ok":
            lines.append(f"{'':4}  {'':{width}}  fix: {f.fix}")
    failed = sum(f.level == "fail" for f in findings)
    warned = sum(f.level == "warn" for f in findings)
    lines.append("ready" if not failed else f"not ready: {failed} check(s) failed" +
                 (f", {warned} warning(s)" if warned else ""))
    return "\n".join(lines)


def cli_doctor(args: argparse.Namespace) -> int:
    """`bij doctor [-n NS] [JOB.yaml] [--no-probe] [--image IMG] [--kubeconfig F]`: exit 0 when ready."""
    import kubernetes

    job = None
    if args.spec:
        try:
            job = load_job(args.spec)
        except SpecError as e:
            print(e, file=sys.stderr)
            return 2
    namespace = args.namespace or (job.metadata.namespace if job else None) or "default"
    if job is not None and job.metadata.namespace != namespace:
        job = job.model_copy(update={"metadata": job.metadata.model_copy(update={"namespace": namespace})})
    try:
        if args.kubeconfig:
            api = kubernetes.config.new_client_from_config(config_file=args.kubeconfig)
        else:
            try:
                kubernetes.config.load_incluster_config()
            except kubernetes.config.ConfigException:
                kubernetes.config.load_kube_config()
            api = kubernetes.client.ApiClient()
    except Exception as e:  # noqa: BLE001 - no cluster to ask is the whole answer
        print(f"bij doctor: no cluster to check: {e}", file=sys.stderr)
        return 2
    doctor = Doctor(api, operator_namespace=args.operator_namespace,
                    log=lambda m: print(f"bij doctor: {m}", file=sys.stderr))
    findings = doctor.run(namespace, job, probe=not args.no_probe, image=args.image, timeout=args.timeout)
    print(format_report(findings))
    return 1 if any(f.level == "fail" for f in findings) else 0
