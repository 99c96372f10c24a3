"""A real node for the local control plane: containerd, runc and the CNI bridge plugin run the
pods from images, under a kubelet built from the control plane's own Kubernetes release.

`tests/node/build.sh` builds the kubelet, containerd and the pause image (from Kubernetes'
build/pause source); runc and the CNI plugins are the distribution's. `missing()` says what is
not there. `Node(plane, state).start()` then:

- makes the pod network: a bridge with the node's pod subnet, the CNI bridge plugin's
  configuration (host-local addresses, masquerade out), the API server's address on the bridge so
  pods reach it, and the `kubernetes` Service's address forwarded to it (there is no kube-proxy:
  one DNAT rule stands for it, for that one Service);
- starts containerd with its own root, state and socket, imports the pause image and the images
  it is given (no registry: the kubelet never pulls);
- starts the kubelet with the node's identity (`system:node:<name>`), its labels and taints, and
  waits for the Node to be Ready.

Facts of the machines this runs on, found by trying: no systemd and cgroup v1 (the kubelet needs
`failCgroupV1: false` and `cgroupDriver: cgroupfs`); root without CAP_SYS_RESOURCE (containerd
needs `restrict_oom_score_adj`, or it fails to lower a container's OOM score below its own).

Must run as root. `stop()` ends the kubelet, every container, the shims and containerd, and
unmounts what they left mounted under the state folder.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import yaml
from cluster.controlplane import ROOT, ControlPlane, die_with_parent, free_port

log = logging.getLogger("bij.node")

HERE = Path(__file__).resolve().parent
BIN = Path(os.environ.get("BIJ_NODE_BIN") or ROOT / ".node" / "bin")
CNI_BIN_DIRS = [Path("/usr/lib/cni"), Path("/opt/cni/bin")]
RUNC = "runc"
BRIDGE = "bij0"
POD_SUBNET = ipaddress.ip_network("10.244.0.0/24")
GATEWAY = str(next(POD_SUBNET.hosts()))  # the node's own address on the pod network
KUBERNETES_SERVICE_IP = "10.96.0.1"  # the first address of controlplane.SERVICE_CIDR


class NodeError(RuntimeError):
    """The node could not be built or started; the message says why."""


def cni_bin_dir() -> Path | None:
    for d in CNI_BIN_DIRS:
        if (d / "bridge").exists() and (d / "host-local").exists() and (d / "loopback").exists():
            return d
    return None


def missing() -> str | None:
    """Why a real node cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "a real node runs as root (containerd, runc and the kubelet need it)"
    tools = [t for t in ("go", "gcc", "umoci", RUNC, "iptables", "ip") if shutil.which(t) is None]
    if cni_bin_dir() is None:
        tools.append("containernetworking-plugins")
    if tools:
        return (f"missing {', '.join(tools)}: on Debian or Ubuntu, apt-get install golang gcc umoci runc iptables "
                "iproute2 containernetworking-plugins (Go >= 1.26 with the Go module proxy)")
    return None


def build() -> Path:
    """Build the kubelet, containerd and the pause image (seconds when already built)."""
    why = missing()
    if why:
        raise NodeError(why)
    proc = subprocess.run(["bash", str(HERE / "build.sh")], env={**os.environ, "BIJ_NODE_BIN": str(BIN)},
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise NodeError(f"building the node failed (tests/node/build.sh):\n{proc.stderr[-4000:]}")
    return BIN


def _run(*argv: str, check: bool = True, input: bytes | None = None, timeout: float = 600) -> str:
    proc = subprocess.run(list(argv), capture_output=True, input=input, timeout=timeout)
    if check and proc.returncode != 0:
        raise NodeError(f"{' '.join(argv)} exited with {proc.returncode}: "
                        f"{proc.stderr.decode(errors='replace')[-2000:]}")
    return proc.stdout.decode(errors="replace")


def pod_network() -> None:
    """The bridge with the node's address on the pod network (where the API server and the S3
    server then listen), and forwarding on. Idempotent: other runs may have made it already."""
    if _run("ip", "link", "show", BRIDGE, check=False) == "":
        _run("ip", "link", "add", BRIDGE, "type", "bridge")
    addr = f"{GATEWAY}/{POD_SUBNET.prefixlen}"
    if addr not in _run("ip", "-o", "addr", "show", "dev", BRIDGE):
        _run("ip", "addr", "add", addr, "dev", BRIDGE)
    _run("ip", "link", "set", BRIDGE, "up")
    Path("/proc/sys/net/ipv4/ip_forward").write_text("1")


def forward_kubernetes_service(port: int) -> list[list[str]]:
    """DNAT the `kubernetes` Service (10.96.0.1:443) to the API server on the bridge; returns the
    rules, to be deleted by `unforward`."""
    rules = [["-t", "nat", "-I", "PREROUTING", "-d", KUBERNETES_SERVICE_IP, "-p", "tcp", "--dport", "443",
              "-j", "DNAT", "--to-destination", f"{GATEWAY}:{port}", "-m", "comment", "--comment", "bij-node"]]
    for rule in rules:
        _run("iptables", *rule)
    return rules


def unforward(rules: list[list[str]]) -> None:
    for rule in rules:
        _run("iptables", *["-D" if a == "-I" else a for a in rule], check=False)


def _mounts_under(folder: Path) -> list[str]:
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].encode().decode("unicode_escape")
            if point == str(folder) or point.startswith(str(folder) + "/"):
                found.append(point)
    return found


def unmount_under(folder: Path) -> None:
    """Unmount everything mounted under `folder`, deepest first."""
    for point in sorted(_mounts_under(folder), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True)


def node_env() -> dict[str, str]:
    """The environment of containerd and the kubelet: the binaries built here first on the PATH, so that
    what they look up there (containerd's shims, ctr) is ours, not a distribution package's."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(BIN), env.get("PATH") or os.defpath])
    return env


class Node:
    """containerd + kubelet for one node of `plane`, state under `state`.

    `images` are OCI archives (paths) to import before the kubelet starts; pods refer to them by
    the names they were saved under."""

    def __init__(self, plane: ControlPlane, state: Path, name: str = "bij-node-0",
                 labels: dict[str, str] | None = None, taints: list[dict[str, str]] | None = None,
                 images: list[Path] | None = None):
        self.plane = plane
        self.state = state.resolve()
        self.name = name
        self.labels = labels or {}
        self.taints = taints or []
        self.images = images or []
        self.logs = self.state / "logs"
        # A unix socket's path is limited to 107 bytes: keep it short, whatever `state` is.
        self.run_dir = Path("/run/bij-node") / f"{os.getpid()}-{name}"
        self.socket = self.run_dir / "containerd.sock"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.rules: list[list[str]] = []

    # --- containerd ------------------------------------------------------------------------------

    def _containerd_config(self, cni_conf: Path, cni_bin: Path, pause: str) -> Path:
        root = self.state / "containerd"
        runtime = "io.containerd.cri.v1.runtime"
        config = f"""version = 3
root = "{root / 'root'}"
state = "{self.run_dir / 'state'}"

[grpc]
  address = "{self.socket}"

[ttrpc]
  address = "{self.socket}.ttrpc"

[plugins."{runtime}"]
  # Root without CAP_SYS_RESOURCE cannot set a container's OOM score below its own.
  restrict_oom_score_adj = true
  [plugins."{runtime}".cni]
    bin_dirs = ["{cni_bin}"]
    conf_dir = "{cni_conf}"
  [plugins."{runtime}".containerd]
    default_runtime_name = "runc"
    [plugins."{runtime}".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      # The shim built with this containerd, never one of the distribution's found on the PATH
      # (Debian's containerd package: "failed to start shim ... not found" for every sandbox).
      runtime_path = "{BIN / 'containerd-shim-runc-v2'}"
      [plugins."{runtime}".containerd.runtimes.runc.options]
        BinaryName = "{shutil.which(RUNC)}"
        SystemdCgroup = false

[plugins."io.containerd.cri.v1.images"]
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "{pause}"

[plugins."io.containerd.grpc.v1.cri"]
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
"""
        path = self.state / "containerd.toml"
        path.write_text(config)
        return path

    def _cni_config(self) -> Path:
        folder = self.state / "cni"
        folder.mkdir(parents=True, exist_ok=True)
        conf = {
            "cniVersion": "1.0.0", "name": "bij-pods",
            "plugins": [
                {"type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": True, "hairpinMode": True,
                 "ipam": {"type": "host-local", "ranges": [[{"subnet": str(POD_SUBNET), "gateway": GATEWAY}]],
                          "routes": [{"dst": "0.0.0.0/0"}],
                          "dataDir": str(self.state / "cni-ipam")}},
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        }
        (folder / "10-bij.conflist").write_text(json.dumps(conf, indent=1))
        return folder

    def ctr(self, *args: str, input: bytes | None = None, timeout: float = 1800) -> str:
        return _run(str(BIN / "ctr"), "--address", str(self.socket), "--namespace", "k8s.io", *args, input=input,
                    timeout=timeout)

    def import_image(self, archive: Path) -> None:
        """Import an OCI archive (a tar file, or an OCI layout folder) into the node's image store."""
        started = time.monotonic()
        if archive.is_dir():
            # containerd keeps its images across runs (its root is under `state`): the same image
            # (name and manifest digest) is not imported again.
            index = json.loads((archive / "index.json").read_text())
            wanted = [(m.get("annotations", {}).get("org.opencontainers.image.ref.name"), m["digest"])
                      for m in index["manifests"]]
            if all(self.has_image(name, digest) for name, digest in wanted):
                log.info("%s: already imported", archive)
                return
            r, w = os.pipe()
            tar = subprocess.Popen(["tar", "-C", str(archive), "-cf", "-", "."], stdout=w)
            os.close(w)
            try:
                proc = subprocess.run([str(BIN / "ctr"), "--address", str(self.socket), "--namespace", "k8s.io",
                                       "images", "import", "-"], stdin=r, capture_output=True,
                                      timeout=3600)
            finally:
                os.close(r)
                tar.wait()
            if proc.returncode != 0 or tar.returncode != 0:
                raise NodeError(f"ctr images import of {archive} failed: {proc.stderr.decode(errors='replace')}")
            out = proc.stdout.decode()
        else:
            out = self.ctr("images", "import", str(archive))
        log.info("imported %s in %.0f s: %s", archive, time.monotonic() - started, out.strip())

    def has_image(self, name: str, digest: str) -> bool:
        """Whether the node's image store has `name` at manifest `digest`."""
        return any(line.split()[:3:2] == [name, digest] for line in self.ctr("images", "ls").splitlines()[1:])

    def _pause_image(self) -> str:
        """The sandbox image's name: build.sh's pause.tar, tagged with Kubernetes' pause version."""
        return f"localhost/bij/pause:{(BIN / 'pause.tag').read_text().strip()}"

    # --- kubelet ---------------------------------------------------------------------------------

    def _kubelet_config(self) -> Path:
        config: dict[str, Any] = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            # No systemd here, and cgroup v1: the kubelet refuses v1 unless told.
            "cgroupDriver": "cgroupfs", "failCgroupV1": False, "failSwapOn": False,
            "containerRuntimeEndpoint": f"unix://{self.socket}",
            "address": GATEWAY, "port": free_port(), "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1", "healthzPort": free_port(),
            # The API server reaches the kubelet (logs, exec) without a client certificate here.
            "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False},
                               "x509": {"clientCAFile": str(self.plane.pki.ca.cert)}},
            "authorization": {"mode": "AlwaysAllow"},
            "registerWithTaints": self.taints,
            "resolvConf": "/etc/resolv.conf",
            # The images cannot be pulled again: never collect them, never evict for a full disk
            # of someone else's files.
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                             "nodefs.inodesFree": "1%"},
            "serializeImagePulls": False,
            "nodeStatusUpdateFrequency": "2s", "nodeStatusReportFrequency": "10s",
            "syncFrequency": "5s", "fileCheckFrequency": "5s",
            "protectKernelDefaults": False,
        }
        path = self.state / "kubelet.yaml"
        path.write_text(yaml.safe_dump(config))
        return path

    def _spawn(self, name: str, argv: list[str]) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        with open(self.logs / f"{name}.log", "ab") as out:
            self.procs[name] = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=node_env(),
                                                stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)

    def _check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                tail = (self.logs / f"{name}.log").read_text(errors="replace")[-3000:]
                raise NodeError(f"{name} exited with {proc.returncode}; the end of its log:\n{tail}")

    def start(self, timeout: float = 120, kubelet: bool = True) -> Node:
        build()
        cni_bin = cni_bin_dir()
        assert cni_bin is not None
        self.state.mkdir(parents=True, exist_ok=True)
        # containerd's images stay between runs; the kubelet's pods and the addresses handed out
        # to them do not (a run killed outright leaves both behind).
        unmount_under(self.state)
        for folder in ("kubelet", "cni-ipam"):
            shutil.rmtree(self.state / folder, ignore_errors=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        pod_network()
        self.rules = forward_kubernetes_service(self.plane.port)
        pause = self._pause_image()
        config = self._containerd_config(self._cni_config(), cni_bin, pause)
        self._spawn("containerd", [str(BIN / "containerd"), "--config", str(config)])
        deadline = time.monotonic() + timeout
        while not self.socket.exists():
            self._check_alive()
            if time.monotonic() > deadline:
                raise NodeError(f"containerd did not open {self.socket} in time")
            time.sleep(0.2)
        self.ctr("version")
        # umoci names the image by its tag alone: the base name makes it the reference containerd pins.
        self.ctr("images", "import", "--base-name", pause.rsplit(":", 1)[0], str(BIN / "pause.tar"))
        for image in self.images:
            self.import_image(image)
        return self.start_kubelet() if kubelet else self

    def start_kubelet(self) -> Node:
        """The kubelet, once containerd runs (`start(kubelet=False)`) and has the pods' images."""
        kubeconfig = self.plane.node_kubeconfig(self.name)
        labels = ",".join(f"{k}={v}" for k, v in self.labels.items())
        self._spawn("kubelet", [
            str(BIN / "kubelet"), f"--config={self._kubelet_config()}", f"--kubeconfig={kubeconfig}",
            f"--root-dir={self.state / 'kubelet'}", f"--cert-dir={self.state / 'kubelet-pki'}",
            f"--hostname-override={self.name}", f"--node-ip={GATEWAY}",
            *([f"--node-labels={labels}"] if labels else []), "--v=1",
        ])
        return self

    def stop(self) -> None:
        kubelet = self.procs.pop("kubelet", None)
        if kubelet is not None and kubelet.poll() is None:
            os.killpg(kubelet.pid, signal.SIGTERM)
            try:
                kubelet.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(kubelet.pid, signal.SIGKILL)
                kubelet.wait()
        self._kill_containers()
        containerd = self.procs.pop("containerd", None)
        if containerd is not None and containerd.poll() is None:
            os.killpg(containerd.pid, signal.SIGTERM)
            try:
                containerd.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(containerd.pid, signal.SIGKILL)
                containerd.wait()
        self._kill_shims()
        unmount_under(self.state)
        unmount_under(self.run_dir)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        unforward(self.rules)
        self.rules = []

    def _kill_containers(self) -> None:
        """Every task of the node, SIGKILLed through containerd, so no container outlives the node."""
        if self.procs.get("containerd") is None or not self.socket.exists():
            return
        try:
            tasks = self.ctr("tasks", "ls", "--quiet", timeout=30).split()
            for task in tasks:
                self.ctr("tasks", "kill", "--signal", "SIGKILL", "--all", task, timeout=30)
        except (NodeError, subprocess.TimeoutExpired) as e:
            log.warning("killing the node's containers: %s", e)

    def _kill_shims(self) -> None:
        """The runc shims outlive containerd by design; ours are the ones that name our socket."""
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv and argv[0].endswith(b"containerd-shim-runc-v2") and str(self.socket).encode() in argv:
                try:
                    os.kill(int(proc.name), signal.SIGKILL)
                except ProcessLookupError:
                    pass


__all__ = ["BIN", "GATEWAY", "Node", "NodeError", "build", "missing"]
