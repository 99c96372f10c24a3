"""The real control plane as local processes: etcd, kube-apiserver, kube-controller-manager and
kube-scheduler, built by build.sh from one Kubernetes release, with the flags a cluster has
(client-certificate authentication, Node and RBAC authorization, service-account issuer and
keys, the admission plugins a cluster enables). Pods then run on the process kubelet."""

from __future__ import annotations

import os
import shutil
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml
from ports import free_port

from .pki import KeyPair, Pki

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
BIN = Path(os.environ.get("BIJ_CLUSTER_BIN") or ROOT / ".cluster" / "bin")
ISSUER = "https://kubernetes.default.svc.cluster.local"
SERVICE_CIDR = "10.96.0.0/16"
# What a kubeadm cluster enables beyond the API server's defaults.
ADMISSION = "NodeRestriction,OwnerReferencesPermissionEnforcement"
# Every request made by a service account of the operator's namespace, as RBAC saw it: the RBAC
# test compares what the operator did with what the chart grants.
AUDITED_GROUP = "system:serviceaccounts:bij-system"
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1", "kind": "Policy", "omitStages": ["RequestReceived"],
    "rules": [{"level": "Request", "userGroups": [AUDITED_GROUP], "verbs": ["create", "update", "patch"]},
              {"level": "Metadata", "userGroups": [AUDITED_GROUP]},
              # The pods of the bijs (their worker service accounts), audited as the operator is; not the
              # control plane's own controllers.
              {"level": "None", "userGroups": ["system:serviceaccounts:kube-system"]},
              {"level": "Metadata", "userGroups": ["system:serviceaccounts"]},
              {"level": "None"}],
}


def die_with_parent() -> None:
    """In a child before exec: its own process group, and SIGKILL when the process that started
    it dies, so a test run killed outright leaves no control plane or pod behind."""
    import ctypes

    os.setsid()
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


class ClusterError(RuntimeError):
    """The control plane could not be built or started; the message says why."""


def build() -> Path:
    """Build the control-plane binaries (seconds when the Go build cache is warm)."""
    if shutil.which("go") is None:
        raise ClusterError("the Go toolchain is missing: install Go >= 1.26 (with access to the Go module proxy); "
                           "the control plane is built from Kubernetes' own modules by tests/cluster/build.sh")
    proc = subprocess.run(["bash", str(HERE / "build.sh")], env={**os.environ, "BIJ_CLUSTER_BIN": str(BIN)},
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise ClusterError(f"building the control plane failed (tests/cluster/build.sh):\n{proc.stderr[-4000:]}")
    return BIN


def kubeconfig(path: Path, server: str, ca: Path, client: KeyPair, user: str) -> Path:
    doc = {
        "apiVersion": "v1", "kind": "Config", "current-context": "bij-local",
        "clusters": [{"name": "bij-local", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": user, "user": {"client-certificate": str(client.cert), "client-key": str(client.key)}}],
        "contexts": [{"name": "bij-local", "context": {"cluster": "bij-local", "user": user}}],
    }
    path.write_text(yaml.safe_dump(doc))
    path.chmod(0o600)
    return path


class ControlPlane:
    """etcd, kube-apiserver, kube-controller-manager and kube-scheduler under `state`.

    `start()` waits until the API server is ready and the controllers have published the
    cluster's root CA into `default`; `stop()` ends every process it started."""

    def __init__(self, state: Path, address: str = "127.0.0.1"):
        """`address`: where the API server listens, and what it advertises as the `kubernetes`
        Service's endpoint (a real node's pods reach it there; the process kubelet's share loopback)."""
        self.state = state.resolve()
        self.address = address
        self.pki = Pki(self.state / "pki")
        self.logs = self.state / "logs"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.port = 0
        self.admin_kubeconfig = self.state / "kubeconfig"
        self.audit_log = self.state / "audit.log"

    @property
    def server(self) -> str:
        return f"https://{self.address}:{self.port}"

    def _spawn(self, name: str, argv: list[str]) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        with open(self.logs / f"{name}.log", "ab") as log:
            # Own process group: Ctrl-C in a terminal reaches our stop(), not the children directly.
            self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)

    def _component_kubeconfig(self, name: str, cn: str, orgs: tuple[str, ...] = ()) -> Path:
        return kubeconfig(self.state / f"{name}.kubeconfig", self.server, self.pki.ca.cert,
                          self.pki.issue(name, cn, orgs), cn)

    def start(self, timeout: float = 90) -> ControlPlane:
        bin_ = build()
        started = time.monotonic()
        etcd_port, peer_port = free_port(), free_port()
        self.port = free_port()
        data = self.state / "etcd"
        shutil.rmtree(data, ignore_errors=True)
        self._spawn("etcd", [
            str(bin_ / "etcd"), "--name=bij-local", f"--data-dir={data}",
            f"--listen-client-urls=http://127.0.0.1:{etcd_port}", f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
            f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
            f"--initial-cluster=bij-local=http://127.0.0.1:{peer_port}",
            # A test cluster: losing it on a power cut is fine, waiting on fsync is not.
            "--unsafe-no-fsync", "--log-level=warn",
        ])
        serving = self.pki.issue(f"apiserver-{self.address}", "kube-apiserver", server=True, ips=(self.address,))
        sa_key, sa_pub = self.pki.service_account_keys()
        policy = self.state / "audit-policy.yaml"
        policy.write_text(yaml.safe_dump(AUDIT_POLICY))
        self.audit_log.unlink(missing_ok=True)
        self._spawn("kube-apiserver", [
            str(bin_ / "kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            f"--bind-address={self.address}", f"--advertise-address={self.address}", f"--secure-port={self.port}",
            f"--tls-cert-file={serving.cert}", f"--tls-private-key-file={serving.key}",
            f"--client-ca-file={self.pki.ca.cert}",
            "--authorization-mode=Node,RBAC", f"--enable-admission-plugins={ADMISSION}",
            f"--service-account-issuer={ISSUER}", f"--api-audiences={ISSUER}",
            f"--service-account-key-file={sa_pub}", f"--service-account-signing-key-file={sa_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}", "--allow-privileged=true", "--profiling=false",
            f"--cert-dir={self.state / 'pki' / 'apiserver-generated'}",
            f"--audit-policy-file={policy}", f"--audit-log-path={self.audit_log}", "--audit-log-format=json",
            "--audit-log-mode=blocking",
            # Nodes are reached (logs, exec) at their address: their names are in no DNS here.
            "--kubelet-preferred-address-types=InternalIP,Hostname",
        ])
        self._wait_ready(started + timeout)
        admin = self.pki.issue("admin", "bij-admin", ("system:masters",))
        kubeconfig(self.admin_kubeconfig, self.server, self.pki.ca.cert, admin, "bij-admin")

        kcm = self._component_kubeconfig("kube-controller-manager", "system:kube-controller-manager")
        self._spawn("kube-controller-manager", [
            str(bin_ / "kube-controller-manager"),
            f"--kubeconfig={kcm}", f"--authentication-kubeconfig={kcm}", f"--authorization-kubeconfig={kcm}",
            "--bind-address=127.0.0.1", f"--secure-port={free_port()}", "--leader-elect=false",
            # Each controller acts under its own service account, as in a cluster.
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={sa_key}", f"--root-ca-file={self.pki.ca.cert}",
            f"--service-cluster-ip-range={SERVICE_CIDR}", "--profiling=false",
        ])
        sched = self._component_kubeconfig("kube-scheduler", "system:kube-scheduler")
        self._spawn("kube-scheduler", [
            str(bin_ / "kube-scheduler"),
            f"--kubeconfig={sched}", f"--authentication-kubeconfig={sched}", f"--authorization-kubeconfig={sched}",
            "--bind-address=127.0.0.1", f"--secure-port={free_port()}", "--leader-elect=false", "--profiling=false",
        ])
        self._wait_controllers(started + timeout)
        return self

    def node_kubeconfig(self, node: str) -> Path:
        """A kubeconfig for the kubelet of `node`: the identity the Node authorizer expects."""
        return self._component_kubeconfig(f"node-{node}", f"system:node:{node}", ("system:nodes",))

    def _check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                tail = (self.logs / f"{name}.log").read_text(errors="replace")[-3000:]
                raise ClusterError(f"{name} exited with {proc.returncode}; the end of its log:\n{tail}")

    def _get(self, path: str, client: KeyPair | None = None) -> tuple[int, bytes]:
        ctx = ssl.create_default_context(cafile=str(self.pki.ca.cert))
        if client is not None:
            ctx.load_cert_chain(str(client.cert), str(client.key))
        try:
            with urllib.request.urlopen(self.server + path, context=ctx, timeout=5) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def _wait_ready(self, deadline: float) -> None:
        admin = self.pki.issue("admin", "bij-admin", ("system:masters",))
        last = ""
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                code, body = self._get("/readyz", admin)
                if code == 200:
                    return
                last = body.decode(errors="replace")[-500:]
            except OSError as e:
                last = str(e)
            time.sleep(0.3)
        raise ClusterError(f"kube-apiserver was not ready in time: {last}")

    def _wait_controllers(self, deadline: float) -> None:
        """The controllers run once the root CA lands in `default` and its service account exists."""
        admin = self.pki.issue("admin", "bij-admin", ("system:masters",))
        while time.monotonic() < deadline:
            self._check_alive()
            ca, _ = self._get("/api/v1/namespaces/default/configmaps/kube-root-ca.crt", admin)
            sa, _ = self._get("/api/v1/namespaces/default/serviceaccounts/default", admin)
            if ca == sa == 200:
                return
            time.sleep(0.3)
        raise ClusterError("kube-controller-manager did not publish kube-root-ca.crt in time "
                           f"(see {self.logs / 'kube-controller-manager.log'})")

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs.clear()
