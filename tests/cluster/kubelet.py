"""A process kubelet: registers Nodes with the real API server, keeps their leases fresh, and runs
each Pod bound to them as local processes, reporting status the way a kubelet does.

What it does as a kubelet would:
- one identity per node (`system:node:<name>`), so the Node authorizer and NodeRestriction
  admission judge every request as they judge a real kubelet's;
- containers run the pod's `command`/`args` (`$(VAR)` expanded) with the pod's env: values,
  `valueFrom.fieldRef` (how Indexed Jobs pass `JOB_COMPLETION_INDEX`), `secretKeyRef`,
  `configMapKeyRef`, `envFrom` Secrets and ConfigMaps, plus `KUBERNETES_SERVICE_HOST/PORT`;
- projected service-account volumes: a token from the TokenRequest API bound to the pod, the
  cluster CA and the namespace, mounted at their mountPath in a private mount namespace, so
  in-cluster configuration works unchanged;
- status: Running with a started container, then terminated with exit code and reason, phase
  Succeeded or Failed; `restartPolicy` Always/OnFailure restarts with a back-off;
- deletion: SIGTERM, then SIGKILL after the grace period, then the final status and the
  kubelet's own delete with grace 0 — so the Eviction API and drains behave as on a node.

What differs from a node: no images (the command comes from this project's virtualenv), one
network (every pod shares the host's), other volumes are host folders whose paths replace the
mountPath in env values (a `/tmp` volume sets TMPDIR), no resource isolation.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes
from kubernetes.client import ApiException

from .controlplane import ControlPlane, die_with_parent

log = logging.getLogger("bij.kubelet")

SA_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
LEASE_SECONDS = 40
HEARTBEAT_SECONDS = 5.0
RESTART_BACKOFF = (1.0, 2.0, 4.0, 8.0)


@dataclass(frozen=True)
class NodeSpec:
    """One node: its labels, taints and capacity."""

    name: str
    labels: dict[str, str] = field(default_factory=dict)
    taints: list[dict[str, str]] = field(default_factory=list)
    cpu: str = "16"
    memory: str = "64Gi"
    gpus: int = 0


GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}

# What the tests and `make cluster-up` run: two spot GPU nodes, each as its provider labels and
# taints them, and one on-demand CPU node where the operator lands.
DEFAULT_NODES = [
    NodeSpec("gke-spot-gpu-0", {"cloud.google.com/gke-spot": "true", "cloud.google.com/gke-accelerator": "nvidia-h100"},
             [{"key": "cloud.google.com/gke-spot", "value": "true", "effect": "NoSchedule"}, GPU_TAINT], gpus=2),
    NodeSpec("karpenter-spot-gpu-0", {"karpenter.sh/capacity-type": "spot", "eks.amazonaws.com/capacityType": "SPOT"},
             [GPU_TAINT], gpus=2),
    NodeSpec("ondemand-cpu-0", {"node.kubernetes.io/instance-type": "cpu-16"}),
]


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _client(kubeconfig: Path) -> kubernetes.client.ApiClient:
    cfg = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)
    return kubernetes.client.ApiClient(cfg)


def exit_code(returncode: int) -> int:
    """A container runtime's exit code: 128 + N for a process ended by signal N."""
    return 128 - returncode if returncode < 0 else returncode


_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)|\$\$")


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion in command, args and env values; `$$` is a literal `$`."""
    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _VAR.sub(sub, value)


class PodRunner:
    """One pod on one node: its volumes, env, processes and status, in its own thread."""

    def __init__(self, node: Node, pod: dict[str, Any]):
        self.node = node
        self.kubelet = node.kubelet
        self.pod = pod
        meta = pod["metadata"]
        self.ns, self.name, self.uid = meta["namespace"], meta["name"], meta["uid"]
        self.dir = self.kubelet.workdir / "pods" / f"{self.ns}_{self.name}_{self.uid[:8]}"
        self.deleting = threading.Event()
        self.gone = threading.Event()  # the pod object no longer exists (force-deleted)
        self.grace = 30.0
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name=f"pod-{self.ns}/{self.name}", daemon=True)
        self.started_at = now()

    # --- status ----------------------------------------------------------------------------

    def _patch_status(self, status: dict[str, Any]) -> None:
        try:
            self.node.core.patch_namespaced_pod_status(self.name, self.ns, {"status": status}, _request_timeout=10)
        except ApiException as e:
            if e.status != 404:
                log.warning("pod %s/%s: status update failed: %s %s", self.ns, self.name, e.reason,
                            (e.body or "")[:500] if isinstance(e.body, str) else e.body)

    def _conditions(self, ready: bool) -> list[dict[str, Any]]:
        t = now()
        st = "True" if ready else "False"
        return [{"type": "PodReadyToStartContainers", "status": "True", "lastTransitionTime": t},
                {"type": "Initialized", "status": "True", "lastTransitionTime": t},
                {"type": "ContainersReady", "status": st, "lastTransitionTime": t},
                {"type": "Ready", "status": st, "lastTransitionTime": t}]

    def _container_status(self, c: dict[str, Any], state: dict[str, Any], restarts: int,
                          last: dict[str, Any] | None = None) -> dict[str, Any]:
        out = {"name": c["name"], "image": c.get("image", ""), "imageID": "", "started": "running" in state,
               "containerID": f"process://{self.uid}/{c['name']}", "ready": "running" in state,
               "restartCount": restarts, "state": state, "lastState": last or {}}
        return out

    # --- set-up ------------------------------------------------------------------------------

    def _mount_volumes(self, attempts: int = 20) -> dict[str, Path]:
        """Set the volumes up, retrying as a kubelet does: the Node authorizer learns of a pod's
        binding from its own watch, so a token asked for at once may be refused for a moment."""
        for attempt in range(attempts):
            try:
                return self._volumes()
            except ApiException as e:
                if e.status not in (403, 404) or attempt == attempts - 1 or self.deleting.is_set():
                    raise
                log.info("pod %s/%s: volume set-up failed (%s), retrying", self.ns, self.name, e.reason)
                self.deleting.wait(min(0.2 * 2**attempt, 2.0))
        raise AssertionError("unreachable")

    def _volumes(self) -> dict[str, Path]:
        """A host folder for each of the pod's volumes, filled as the kubelet fills them."""
        spec = self.pod["spec"]
        paths: dict[str, Path] = {}
        for vol in spec.get("volumes") or []:
            name = vol["name"]
            if "hostPath" in vol:
                path = Path(vol["hostPath"]["path"])
                path.mkdir(parents=True, exist_ok=True)
            elif "persistentVolumeClaim" in vol:
                path = self.kubelet.workdir / "pvc" / self.ns / vol["persistentVolumeClaim"]["claimName"]
                path.mkdir(parents=True, exist_ok=True)
            else:
                path = self.dir / "volumes" / name
                path.mkdir(parents=True, exist_ok=True)
                if "projected" in vol:
                    self._fill_projected(vol["projected"], path)
                elif "secret" in vol:
                    self._fill_keys(self._read("secret", vol["secret"]["secretName"]), path, vol["secret"].get("items"))
                elif "configMap" in vol:
                    self._fill_keys(self._read("configmap", vol["configMap"]["name"]), path,
                                    vol["configMap"].get("items"))
            paths[name] = path
        return paths

    def _read(self, kind: str, name: str) -> dict[str, str]:
        import base64

        if kind == "secret":
            obj = self.node.core.read_namespaced_secret(name, self.ns)
            return {k: base64.b64decode(v).decode() for k, v in (obj.data or {}).items()}
        cm = self.node.core.read_namespaced_config_map(name, self.ns)
        return dict(cm.data or {})

    @staticmethod
    def _fill_keys(data: dict[str, str], path: Path, items: list[dict[str, str]] | None) -> None:
        pairs = [(i["key"], i["path"]) for i in items] if items else [(k, k) for k in data]
        for key, rel in pairs:
            (path / rel).parent.mkdir(parents=True, exist_ok=True)
            (path / rel).write_text(data[key])

    def _fill_projected(self, projected: dict[str, Any], path: Path) -> None:
        for src in projected.get("sources") or []:
            if "serviceAccountToken" in src:
                sat = src["serviceAccountToken"]
                body = {"spec": {"audiences": [sat["audience"]] if sat.get("audience") else None,
                                 "expirationSeconds": sat.get("expirationSeconds", 3607),
                                 "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": self.name,
                                                    "uid": self.uid}}}
                sa = self.pod["spec"].get("serviceAccountName") or "default"
                tr = self.node.core.create_namespaced_service_account_token(sa, self.ns, body)
                (path / sat["path"]).write_text(tr.status.token)
            elif "configMap" in src:
                self._fill_keys(self._read("configmap", src["configMap"]["name"]), path, src["configMap"].get("items"))
            elif "secret" in src:
                self._fill_keys(self._read("secret", src["secret"]["name"]), path, src["secret"].get("items"))
            elif "downwardAPI" in src:
                for item in src["downwardAPI"].get("items") or []:
                    (path / item["path"]).write_text(str(self._field(item["fieldRef"]["fieldPath"])))

    def _field(self, path: str) -> str:
        meta, spec = self.pod["metadata"], self.pod["spec"]
        m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
        if m:
            return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
        simple = {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"], "metadata.uid": meta["uid"],
                  "spec.nodeName": spec.get("nodeName", ""),
                  "spec.serviceAccountName": spec.get("serviceAccountName", ""),
                  "status.hostIP": "127.0.0.1", "status.podIP": "127.0.0.1", "status.hostIPs": "127.0.0.1",
                  "status.podIPs": "127.0.0.1"}
        if path not in simple:
            raise ValueError(f"unsupported fieldRef {path}")
        return simple[path]

    def _env(self, c: dict[str, Any], volumes: dict[str, Path]) -> dict[str, str]:
        env: dict[str, str] = dict(self.kubelet.base_env)
        env.update({"HOSTNAME": self.name, "KUBERNETES_SERVICE_HOST": "127.0.0.1",
                    "KUBERNETES_SERVICE_PORT": str(self.kubelet.plane.port),
                    "KUBERNETES_SERVICE_PORT_HTTPS": str(self.kubelet.plane.port)})
        own = {e["name"] for e in c.get("env") or []}
        for src in c.get("envFrom") or []:
            prefix = src.get("prefix", "")
            if "secretRef" in src:
                data = self._read("secret", src["secretRef"]["name"])
            else:
                data = self._read("configmap", src["configMapRef"]["name"])
            env.update({prefix + k: v for k, v in data.items()})
            own.update(prefix + k for k in data)
        for e in c.get("env") or []:
            if "value" in e:
                env[e["name"]] = expand(e["value"], env)
            elif "valueFrom" in e:
                vf = e["valueFrom"]
                if "fieldRef" in vf:
                    env[e["name"]] = self._field(vf["fieldRef"]["fieldPath"])
                elif "secretKeyRef" in vf:
                    env[e["name"]] = self._read("secret", vf["secretKeyRef"]["name"])[vf["secretKeyRef"]["key"]]
                elif "configMapKeyRef" in vf:
                    ref = vf["configMapKeyRef"]
                    env[e["name"]] = self._read("configmap", ref["name"])[ref["key"]]
            else:
                env[e["name"]] = ""
        # A volume's folder stands in for its mountPath wherever the pod's own env names it (never
        # in what this kubelet provides: PATH may well lie under /tmp).
        # Each value once, from what the pod said: a folder that itself lies under another mountPath
        # (a state folder under /tmp) is not rewritten again.
        given = dict(env)
        for m in c.get("volumeMounts") or []:
            mount, host = m["mountPath"].rstrip("/"), str(volumes[m["name"]])
            for k, v in given.items():
                if k in own and (v == mount or v.startswith(mount + "/")):
                    env[k] = host + v[len(mount):]
            if mount == "/tmp":
                env["TMPDIR"] = host
        return env

    def _argv(self, c: dict[str, Any], env: dict[str, str], volumes: dict[str, Path]) -> list[str]:
        cmd = [expand(a, env) for a in (c.get("command") or [])] + [expand(a, env) for a in (c.get("args") or [])]
        if not c.get("command"):
            raise ValueError(f"container {c['name']} has no command: a process kubelet cannot read an image's "
                             "entrypoint")
        exe = cmd[0]
        if "/" not in exe:
            found = shutil.which(exe, path=env.get("PATH"))
            if found is None:
                raise ValueError(f"container {c['name']}: {exe} not found on PATH {env.get('PATH')}")
            cmd[0] = found
        binds = [(volumes[m["name"]], m["mountPath"]) for m in c.get("volumeMounts") or []
                 if m["mountPath"].startswith(("/var/run/secrets/", "/run/secrets/"))]
        if not binds:
            return cmd
        # A private mount namespace so that this process, and only it, finds its token where
        # in-cluster clients look for it.
        script = " && ".join(f"mkdir -p {shlex.quote(dst)} && mount --bind {shlex.quote(str(src))} {shlex.quote(dst)}"
                             for src, dst in binds)
        return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
                f'{script} && exec "$@"', "sh", *cmd]

    # --- the pod's life ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._live()
        except Exception as e:  # a pod we cannot start fails like a pod whose container cannot start
            log.exception("pod %s/%s failed to start", self.ns, self.name)
            c = self.pod["spec"]["containers"][0]
            self._patch_status({"phase": "Failed", "reason": "StartError", "message": str(e)[:1000],
                                "conditions": self._conditions(False),
                                "containerStatuses": [self._container_status(c, {"terminated": {
                                    "exitCode": 128, "reason": "StartError", "message": str(e)[:1000],
                                    "startedAt": self.started_at, "finishedAt": now()}}, 0)]})
        finally:
            self._finish()

    def _live(self) -> None:
        spec = self.pod["spec"]
        self.grace = float(spec.get("terminationGracePeriodSeconds", 30))
        self.dir.mkdir(parents=True, exist_ok=True)
        volumes = self._mount_volumes()
        containers = spec["containers"]
        for init in spec.get("initContainers") or []:
            code = self._run_once(init, volumes, 0)
            if code != 0 or self.deleting.is_set():
                self._terminal(containers, {init["name"]: code}, {})
                return
        policy = spec.get("restartPolicy", "Always")
        codes: dict[str, int] = {}
        restarts = {c["name"]: 0 for c in containers}
        last: dict[str, dict[str, Any]] = {}
        pending = list(containers)
        while pending:
            threads = {c["name"]: self._start(c, volumes) for c in pending}
            self._patch_status({"phase": "Running", "hostIP": "127.0.0.1", "podIP": "127.0.0.1",
                                "podIPs": [{"ip": "127.0.0.1"}], "hostIPs": [{"ip": "127.0.0.1"}],
                                "startTime": self.started_at, "conditions": self._conditions(True),
                                "containerStatuses": [self._container_status(c, {"running": {"startedAt": now()}},
                                                                             restarts[c["name"]], last.get(c["name"]))
                                                      for c in containers]})
            for name, proc in threads.items():
                codes[name] = exit_code(proc.wait())
            again = [c for c in pending if not self.deleting.is_set() and not self.kubelet.stopping.is_set()
                     and (policy == "Always" or (policy == "OnFailure" and codes[c["name"]] != 0))]
            if not again:
                break
            for c in again:
                n = restarts[c["name"]]
                last[c["name"]] = {"terminated": {"exitCode": codes[c["name"]], "finishedAt": now()}}
                restarts[c["name"]] = n + 1
                self.deleting.wait(RESTART_BACKOFF[min(n, len(RESTART_BACKOFF) - 1)])
            pending = [c for c in again if not self.deleting.is_set()]
        self._terminal(containers, codes, restarts)

    def _start(self, c: dict[str, Any], volumes: dict[str, Path]) -> subprocess.Popen[bytes]:
        env = self._env(c, volumes)
        argv = self._argv(c, env, volumes)
        cwd = c.get("workingDir") or str(self.dir)
        Path(cwd).mkdir(parents=True, exist_ok=True)
        with open(self.dir / f"{c['name']}.log", "ab") as out:
            out.write(f"--- {now()} {shlex.join(argv)}\n".encode())
            out.flush()
            proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
        with self.lock:
            self.procs[c["name"]] = proc
        if self.deleting.is_set():
            self._signal(signal.SIGTERM)
        return proc

    def _run_once(self, c: dict[str, Any], volumes: dict[str, Path], restarts: int) -> int:
        return exit_code(self._start(c, volumes).wait())

    def _terminal(self, containers: list[dict[str, Any]], codes: dict[str, int], restarts: dict[str, int]) -> None:
        if self.gone.is_set():
            return  # a dead node reports nothing; the pod object may be gone too
        statuses = []
        for c in containers:
            code = codes.get(c["name"], 137)
            reason = "Completed" if code == 0 else "Error"
            ended = {"exitCode": code, "reason": reason, "startedAt": self.started_at, "finishedAt": now(),
                     "containerID": f"process://{self.uid}/{c['name']}"}
            if code != 0 and c.get("terminationMessagePolicy") == "FallbackToLogsOnError":
                # No termination-log file here: the kubelet's fallback, the end of the container's log.
                ended["message"] = self._log_tail(c["name"])
            statuses.append(self._container_status(c, {"terminated": ended}, restarts.get(c["name"], 0)))
        phase = "Succeeded" if all(codes.get(c["name"], 137) == 0 for c in containers) else "Failed"
        self._patch_status({"phase": phase, "conditions": self._conditions(False), "containerStatuses": statuses})

    def _log_tail(self, container: str, most_lines: int = 80, most_bytes: int = 2048) -> str:
        """What a kubelet puts in a failed container's message under FallbackToLogsOnError."""
        try:
            data = (self.dir / f"{container}.log").read_bytes()
        except OSError:
            return ""
        lines = [ln for ln in data.decode(errors="replace").splitlines() if not ln.startswith("--- ")]
        return "\n".join(lines[-most_lines:])[-most_bytes:]

    def _finish(self) -> None:
        with self.lock:
            self.procs.clear()
        if self.deleting.is_set() and not self.gone.is_set():
            # The kubelet's last word on a pod being deleted: remove it, now that it is terminal.
            try:
                self.node.core.delete_namespaced_pod(
                    self.name, self.ns, body=kubernetes.client.V1DeleteOptions(
                        grace_period_seconds=0, preconditions=kubernetes.client.V1Preconditions(uid=self.uid)))
            except ApiException as e:
                if e.status not in (404, 409):
                    log.warning("pod %s/%s: final delete failed: %s", self.ns, self.name, e.reason)
        self.node.forget(self.uid)

    def _signal(self, sig: int) -> None:
        with self.lock:
            procs = list(self.procs.values())
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass

    def delete(self, grace: float | None) -> None:
        """The pod got a deletionTimestamp: SIGTERM now, SIGKILL when the grace period is over."""
        if self.deleting.is_set():
            return
        self.deleting.set()
        grace = self.grace if grace is None else grace
        self._signal(signal.SIGTERM if grace > 0 else signal.SIGKILL)
        if grace > 0:
            timer = threading.Timer(grace, self._signal, args=(signal.SIGKILL,))
            timer.daemon = True
            timer.start()

    def kill(self) -> None:
        """The node died: every process goes at once, nobody reports anything."""
        self.gone.set()
        self.deleting.set()
        self._signal(signal.SIGKILL)


class Node:
    """One node's registration, heartbeat and pod watch."""

    def __init__(self, kubelet: ProcessKubelet, spec: NodeSpec):
        self.kubelet = kubelet
        self.spec = spec
        self.api = _client(kubelet.plane.node_kubeconfig(spec.name))
        self.core = kubernetes.client.CoreV1Api(self.api)
        self.coord = kubernetes.client.CoordinationV1Api(self.api)
        self.pods: dict[str, PodRunner] = {}
        # Pods that ran here and ended: a watch event that still shows one as Running (sent before
        # its terminal status) must not start it again, as a kubelet never runs a pod twice.
        self.ended: set[str] = set()
        self.lock = threading.Lock()
        self.dead = threading.Event()
        self.threads: list[threading.Thread] = []

    def _status(self) -> dict[str, Any]:
        capacity = {"cpu": self.spec.cpu, "memory": self.spec.memory, "pods": "110", "ephemeral-storage": "100Gi"}
        if self.spec.gpus:
            capacity["nvidia.com/gpu"] = str(self.spec.gpus)
        t = now()
        ready = {"type": "Ready", "status": "True", "reason": "KubeletReady",
                 "message": "process kubelet is posting ready status",
                 "lastHeartbeatTime": t, "lastTransitionTime": t}
        pressure = [{"type": k, "status": "False", "reason": f"KubeletHas{r}", "lastHeartbeatTime": t,
                     "lastTransitionTime": t}
                    for k, r in (("MemoryPressure", "SufficientMemory"), ("DiskPressure", "NoDiskPressure"),
                                 ("PIDPressure", "SufficientPID"))]
        return {"capacity": capacity, "allocatable": capacity, "conditions": [*pressure, ready],
                "addresses": [{"type": "InternalIP", "address": "127.0.0.1"},
                              {"type": "Hostname", "address": self.spec.name}],
                "nodeInfo": {"architecture": "amd64", "operatingSystem": "linux", "kubeletVersion": "v1.36.3",
                             "kubeProxyVersion": "", "containerRuntimeVersion": "process://bij", "kernelVersion": "",
                             "osImage": "bij process kubelet", "machineID": self.spec.name,
                             "systemUUID": self.spec.name,
                             "bootID": self.spec.name}}

    def register(self) -> None:
        labels = {"kubernetes.io/hostname": self.spec.name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
                  **self.spec.labels}
        body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": self.spec.name, "labels": labels},
                "spec": {"taints": self.spec.taints} if self.spec.taints else {}}
        try:
            self.core.create_node(body)
        except ApiException as e:
            if e.status != 409:
                raise
        self.core.patch_node_status(self.spec.name, {"status": self._status()})
        self._renew_lease()

    def _renew_lease(self) -> None:
        t = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        body = {"metadata": {"name": self.spec.name, "namespace": "kube-node-lease"},
                "spec": {"holderIdentity": self.spec.name, "leaseDurationSeconds": LEASE_SECONDS, "renewTime": t}}
        try:
            self.coord.patch_namespaced_lease(self.spec.name, "kube-node-lease", body)
        except ApiException as e:
            if e.status != 404:
                raise
            self.coord.create_namespaced_lease("kube-node-lease", body)

    def start(self) -> None:
        self.register()
        for target in (self._heartbeat, self._watch):
            t = threading.Thread(target=target, name=f"{target.__name__}-{self.spec.name}", daemon=True)
            t.start()
            self.threads.append(t)

    def _alive(self) -> bool:
        return not (self.dead.is_set() or self.kubelet.stopping.is_set())

    def _heartbeat(self) -> None:
        beats = 0
        while self._alive():
            self.kubelet.stopping.wait(HEARTBEAT_SECONDS)
            if not self._alive():
                return
            try:
                self._renew_lease()
                beats += 1
                if beats % 6 == 0:
                    self.core.patch_node_status(self.spec.name, {"status": self._status()})
            except Exception as e:  # the API server may be restarting; try again next beat
                log.warning("node %s: heartbeat failed: %s", self.spec.name, e)

    def _watch(self) -> None:
        selector = f"spec.nodeName={self.spec.name}"
        while self._alive():
            try:
                listed = self.api.sanitize_for_serialization(
                    self.core.list_pod_for_all_namespaces(field_selector=selector))
                for pod in listed.get("items") or []:
                    self._seen(pod)
                w = kubernetes.watch.Watch()
                for ev in w.stream(self.core.list_pod_for_all_namespaces, field_selector=selector,
                                   resource_version=listed["metadata"]["resourceVersion"], timeout_seconds=30,
                                   _request_timeout=40):
                    if not self._alive():
                        w.stop()
                        return
                    pod = self.api.sanitize_for_serialization(ev["object"])
                    if ev["type"] == "DELETED":
                        self._deleted(pod)
                    else:
                        self._seen(pod)
            except Exception as e:
                if self._alive():
                    log.debug("node %s: pod watch restarts: %s", self.spec.name, e)
                    time.sleep(0.5)

    def _seen(self, pod: dict[str, Any]) -> None:
        uid = pod["metadata"]["uid"]
        deleting = bool(pod["metadata"].get("deletionTimestamp"))
        with self.lock:
            runner = self.pods.get(uid)
            fresh = runner is None
            if fresh:
                if pod.get("status", {}).get("phase") in ("Succeeded", "Failed") or uid in self.ended:
                    return
                runner = PodRunner(self, pod)
                if not deleting:
                    self.pods[uid] = runner
        if fresh and deleting:
            # Never started here: nothing to stop, only the final delete to send.
            runner.deleting.set()
            runner._finish()
        elif fresh:
            runner.thread.start()
        elif deleting:
            runner.delete(pod["metadata"].get("deletionGracePeriodSeconds"))

    def _deleted(self, pod: dict[str, Any]) -> None:
        with self.lock:
            runner = self.pods.get(pod["metadata"]["uid"])
        if runner is not None:
            runner.gone.set()
            runner.delete(0)

    def forget(self, uid: str) -> None:
        with self.lock:
            self.pods.pop(uid, None)
            self.ended.add(uid)

    def running(self) -> list[PodRunner]:
        with self.lock:
            return list(self.pods.values())

    def kill(self) -> None:
        """The node is gone: heartbeats stop and every process on it dies at once."""
        self.dead.set()
        for runner in self.running():
            runner.kill()


class ProcessKubelet:
    """The nodes of a local cluster, each running its pods as processes of this project's virtualenv."""

    def __init__(self, plane: ControlPlane, workdir: Path, nodes: list[NodeSpec] | None = None,
                 env: dict[str, str] | None = None):
        self.plane = plane
        self.workdir = workdir.resolve()
        self.stopping = threading.Event()
        venv_bin = Path(sys.executable).parent
        path = os.pathsep.join([str(venv_bin), os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin")])
        # What an image would provide: the project's virtualenv first on PATH, offline model hubs.
        self.base_env = {"PATH": path, "HOME": str(self.workdir / "home"), "LANG": "C.UTF-8",
                         "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        for key in ("PYTHONPATH", "BIJ_TEST_ENGINE_HOOK"):
            if os.environ.get(key):
                self.base_env[key] = os.environ[key]
        self.base_env.update(env or {})
        self.nodes = {spec.name: Node(self, spec) for spec in (nodes or DEFAULT_NODES)}

    def start(self) -> ProcessKubelet:
        (self.workdir / "home").mkdir(parents=True, exist_ok=True)
        if subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode != 0:
            log.warning("unshare --mount is not permitted here: pods that mount a service-account token "
                        "will fail to start")
        for node in self.nodes.values():
            node.start()
        return self

    def kill_node(self, name: str) -> None:
        """The machine behind `name` vanishes: its processes die and it stops heartbeating."""
        self.nodes[name].kill()

    def revive_node(self, name: str) -> None:
        """A new machine joins under the same name (a spot pool replacing its VM)."""
        self.nodes[name] = Node(self, self.nodes[name].spec)
        self.nodes[name].start()

    def pods(self) -> list[PodRunner]:
        return [r for n in self.nodes.values() for r in n.running()]

    def stop(self) -> None:
        self.stopping.set()
        for node in self.nodes.values():
            node.kill()
        deadline = time.monotonic() + 10
        for runner in self.pods():
            runner.thread.join(max(0.1, deadline - time.monotonic()))
