"""A bij's bookkeeping at 10 to 10,000 lanes, on the real control plane: flat in lanes, or not.

Brings up the local control plane of tests/cluster (etcd, kube-apiserver, controller-manager and
scheduler built from Kubernetes' own modules; no kubelet: no pod runs) with the CRD, a namespace
and the chart's worker Role, and for each N runs N simulated lanes: `bij.worker.report.LaneReporter`,
the lanes' own reporting code, each fed a committed chunk every second, sending through the real
sink (`sink_from_env`, a service account token of the worker identity) at the interval the round's
Job would give them (`lane_report.report_interval(N)`), in a few processes of threads. Beside them,
this process plays the operator's part: it watches the bij (kopf decodes every event of it) and,
for the Lease design, sums the round's Leases (`handlers.Api.lane_reports`, `lane_report.tally`)
every `lane_report.tally_interval(N)` seconds and writes the totals into the status, as the driver does.

Two designs, measured in the same run on the same API server:

- leases: each pod's report in a Lease of its own (this version);
- status (the anchor): each pod's report under status.reports.lanes.<pod> of the bij, every 5 s
  (the design before it), at N <= --max-status-lanes.

For each N, over --seconds (or one sum's interval, if longer) after one report interval: the bij
object's size (its JSON, as etcd holds it with managedFields), the API server's write requests a second
for the bij and the Leases (apiserver_request_total; refused ones by code), the bytes etcd took in a
second (etcd_debugging_mvcc_total_put_size_in_bytes, the size of every key and value put), and the CPU
seconds a second of the operator's part. Targets
(principle 12): the object <= 64 KiB at every N; writes, bytes and operator CPU within 2x from N = 100 to
N = 10,000. With --repeats R each N runs R times; the median counts and the spread is printed.

    python bench/scale.py [--lanes 10,100,1000,10000] [--seconds 30] [--repeats 1] [--max-status-lanes 1000]
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import harness

sys.path.insert(0, str(harness.REPO / "tests"))

OBJECT_KIB_TARGET = 64.0
FLAT_TARGET = 2.0
PROCESSES = 4  # lane processes; each runs N / PROCESSES reporter threads
STATUS_INTERVAL = 5.0  # the previous design's report interval, whatever the lane count


# ---------------------------------------------------------------- the lanes (a child process)


def lanes_child(argv: list[str]) -> int:
    """`scale.py --child DESIGN FIRST COUNT INTERVAL BIJ`: COUNT reporters, keys FIRST.., until stdin closes."""
    design, first, count, interval, bij = argv[0], int(argv[1]), int(argv[2]), float(argv[3]), argv[4]
    threading.stack_size(256 * 1024)  # thousands of reporter threads, each waiting
    from bij.worker import report

    sink = report.sink_from_env(sa_dir=Path(os.environ["BENCH_SA_DIR"]))
    assert isinstance(sink, report.KubeReports)
    # The previous design: a lane's report is a merge patch of its key in the bij's status.
    chosen: report.Sink = sink.status if design == "status" else sink
    reporters = [report.LaneReporter(chosen, round_no=0, lane=i, interval=interval, key=f"{bij}-{i:05d}")
                 for i in range(first, first + count)]
    print("ready", flush=True)
    stop = threading.Event()

    def feed() -> None:
        while not stop.wait(1.0):
            for r in reporters:
                r.on_event({"event": "chunk", "rows": 8, "errors": 0, "bytes": 4096})

    threading.Thread(target=feed, daemon=True).start()
    sys.stdin.read()  # the parent closes it when the window is over
    stop.set()
    os._exit(0)  # no last reports: what happens at the end is not the steady state being measured


# ---------------------------------------------------------------- measuring


def prom(text: str, name: str, **labels: str) -> float:
    """The sum of metric `name`'s samples whose labels include `labels` (labels' values are regexes)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)", line)
        if not m or m.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(3) or ""))
        if all(re.fullmatch(v, have.get(k, "")) for k, v in labels.items()):
            total += float(m.group(4))
    return total


class Meters:
    """The API server's and etcd's counters, read together."""

    def __init__(self, plane: Any, api: Any):
        self.api = api
        etcd_args = plane.procs["etcd"].args
        client = next(a.split("=", 1)[1] for a in etcd_args if a.startswith("--listen-client-urls="))
        self.etcd_url = f"{client}/metrics"

    def read(self) -> dict[str, float]:
        text = self.api.call_api("/metrics", "GET", auth_settings=["BearerToken"],
                                 _preload_content=False).data.decode()
        with urllib.request.urlopen(self.etcd_url, timeout=10) as resp:
            etcd = resp.read().decode()
        return {
            "writes": prom(text, "apiserver_request_total", verb="POST|PATCH|PUT|DELETE",
                           resource="leases|batchinferencejobs", code="2.."),
            **{f"refused_{code}": prom(text, "apiserver_request_total", verb="POST|PATCH|PUT|DELETE",
                                       resource="leases|batchinferencejobs", code=code)
               for code in ("409", "429", "5..")},
            "etcd_bytes": prom(etcd, "etcd_debugging_mvcc_total_put_size_in_bytes"),
        }


class OperatorPart(threading.Thread):
    """What the operator does for one bij while its round runs: decode every watch event of the bij and,
    with Leases, sum them every LANE_TALLY_INTERVAL and write the totals. CPU counted in `cpu`."""

    def __init__(self, kubeconfig: Path, ns: str, name: str, fold: bool, interval: float):
        super().__init__(daemon=True)
        assert os.environ.get("KUBECONFIG") == str(kubeconfig)  # read by the client when it is imported
        from bij.control.kube_api import Api

        self.api = Api()
        self.interval = interval
        self.ns, self.name, self.fold = ns, name, fold
        self.cpu = 0.0
        self.events = 0
        self.folds = 0
        self.stopped = threading.Event()
        self.watcher = threading.Thread(target=self.watch, daemon=True)

    def _cpu(self) -> float:
        return time.thread_time()

    def watch(self) -> None:
        from bij.contract.codes import API_GROUP
        from bij.contract.spec import API_VERSION

        path = f"/apis/{API_GROUP}/{API_VERSION}/namespaces/{self.ns}/batchinferencejobs"
        resp = self.api._client.call_api(path, "GET", query_params=[("watch", "true"),
                                                                    ("fieldSelector", f"metadata.name={self.name}")],
                                         auth_settings=["BearerToken"], _preload_content=False)
        try:
            for line in resp:
                if self.stopped.is_set():
                    return
                t0 = self._cpu()
                json.loads(line)  # kopf decodes each event of the bij, the whole object
                self.cpu += self._cpu() - t0
                self.events += 1
        except Exception:  # noqa: BLE001 - the watch ends with the run (or the control plane)
            if not self.stopped.is_set():
                raise

    def run(self) -> None:
        from bij.contract.lane_report import tally

        self.watcher.start()
        while self.fold and not self.stopped.wait(self.interval):
            t0 = self._cpu()
            summed = tally(self.api.lane_reports(self.ns, self.name, 0), 0)
            if self.stopped.is_set():
                return
            self.api.patch_status(self.ns, self.name, {"rows": {"done": summed.rows, "failed": summed.errors}})
            self.cpu += self._cpu() - t0
            self.folds += 1


def one_run(cluster: Any, meters: Meters, custom: Any, ns: str, sa_dir: Path, design: str, lanes: int,
            seconds: float) -> dict[str, Any]:
    """N lanes of one design for `seconds`; what they cost."""
    from bij.contract.codes import API_GROUP
    from bij.contract.lane_report import report_interval, tally_interval
    from bij.contract.spec import API_VERSION

    name = f"scale-{design[0]}{lanes}-{uuid.uuid4().hex[:4]}"
    custom.create_namespaced_custom_object(API_GROUP, API_VERSION, ns, "batchinferencejobs", {
        "apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": "BatchInferenceJob", "metadata": {"name": name},
        "spec": {"input": {"uri": "s3://bench/in/"}, "output": {"uri": f"s3://bench/out/{name}/"},
                 "model": {"engine": "echo", "task": "embed"}, "workers": {"parallelism": lanes}}})
    custom.patch_namespaced_custom_object_status(API_GROUP, API_VERSION, ns, "batchinferencejobs", name,
                                                 {"status": {"phase": "Running", "round": 0}},
                                                 _content_type="application/merge-patch+json")
    interval = report_interval(lanes) if design == "leases" else STATUS_INTERVAL
    env = {**os.environ, "BIJ_REPORT_TO": f"kube:{ns}/{name}", "BENCH_SA_DIR": str(sa_dir),
           "KUBERNETES_SERVICE_HOST": cluster.plane.address, "KUBERNETES_SERVICE_PORT": str(cluster.plane.port),
           "PYTHONPATH": str(harness.REPO / "src")}
    procs = min(PROCESSES, lanes)
    share = [lanes // procs + (1 if i < lanes % procs else 0) for i in range(procs)]
    every = tally_interval(lanes)
    operator = OperatorPart(cluster.kubeconfig, ns, name, fold=design == "leases", interval=every)
    operator.start()
    children = []
    first = 0
    for count in share:
        children.append(subprocess.Popen([sys.executable, __file__, "--child", design, str(first), str(count),
                                          str(interval), name], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                         text=True))
        first += count
    for child in children:
        assert child.stdout is not None
        if child.stdout.readline().strip() != "ready":
            raise RuntimeError(f"a lane process of {name} did not start (exit {child.wait()})")
    # Reporters start at a random point of their interval: count from one interval on (at most --seconds).
    time.sleep(min(interval, seconds))
    before, cpu0, t0 = meters.read(), operator.cpu, time.monotonic()
    # At least one sum of the Leases in the window, so that its cost is in the operator's CPU a second.
    time.sleep(max(seconds, every * 1.05) if design == "leases" else seconds)
    after, cpu1, t1 = meters.read(), operator.cpu, time.monotonic()
    obj = custom.get_namespaced_custom_object(API_GROUP, API_VERSION, ns, "batchinferencejobs", name)
    operator.stopped.set()
    for child in children:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=60)
    took = t1 - t0
    out = {"design": design, "lanes": lanes, "interval": interval, "seconds": round(took, 1),
           "object_kib": len(json.dumps(obj).encode()) / 1024,
           "writes_per_s": (after["writes"] - before["writes"]) / took,
           "refused": {k[len("refused_"):]: after[k] - before[k] for k in after if k.startswith("refused_")},
           "etcd_kib_per_s": (after["etcd_bytes"] - before["etcd_bytes"]) / 1024 / took,
           "operator_cpu_ms_per_s": (cpu1 - cpu0) * 1000 / took, "watch_events": operator.events}
    print(f"  {design:7} {lanes:>6} lanes (report every {interval:g} s): object {out['object_kib']:8.1f} KiB, "
          f"{out['writes_per_s']:7.1f} writes/s, etcd {out['etcd_kib_per_s']:9.1f} KiB/s, operator "
          f"{out['operator_cpu_ms_per_s']:6.1f} ms CPU/s, refused by code {out['refused']}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return lanes_child(argv[1:])
    p = harness.parser(__doc__, rows=0, repeats=1)
    p.add_argument("--lanes", default="10,100,1000,10000", help="lane counts, comma-separated")
    p.add_argument("--seconds", type=float, default=30.0, help="the measured window of each run")
    p.add_argument("--max-status-lanes", type=int, default=1000,
                   help="the previous design runs up to this many lanes (it slows the API server down)")
    args = harness.parse(p, argv)
    report = harness.Report("scale")
    work = harness.work_dir("scale", args.keep)
    # The operator's Api() reads the default kubeconfig, whose place the client takes when it is imported.
    os.environ["KUBECONFIG"] = str((work / "cluster").resolve() / "kubeconfig")
    import kubernetes
    from cluster.controlplane import ClusterError, ControlPlane, build
    from cluster.harness import add_worker_account

    try:
        build()
    except ClusterError as e:
        print(f"skipped: no local control plane ({e})", flush=True)
        folder = Path(args.out) if args.out else work
        (folder / "scale.json").write_text(json.dumps({"bench": "scale", "skipped": f"no control plane: {e}"[:300]}))
        return 0
    counts = [int(n) for n in args.lanes.split(",")]

    class Plane:  # the control plane alone: no kubelet, no operator pod
        def __init__(self, state: Path):
            self.plane = ControlPlane(state)
            self.kubeconfig = self.plane.admin_kubeconfig

    cluster = Plane(work / "cluster")
    try:
        cluster.plane.start()
        cfg = kubernetes.client.Configuration()
        kubernetes.config.load_kube_config(config_file=str(cluster.kubeconfig), client_configuration=cfg)
        api = kubernetes.client.ApiClient(cfg)
        kubectl = [str(build() / "kubectl"), f"--kubeconfig={cluster.kubeconfig}"]
        for step in (["apply", "--server-side", "-f", str(harness.REPO / "crds")],
                     ["wait", "--for=condition=Established", "crd/batchinferencejobs.batchinference.io",
                      "--timeout=60s"]):
            done = subprocess.run([*kubectl, *step], capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"kubectl {step[0]}: {done.stderr.strip()}")
        ns = "scale"
        kubernetes.client.CoreV1Api(api).create_namespace({"metadata": {"name": ns}})
        add_worker_account(api, ns)
        sa_dir = work / "sa"
        sa_dir.mkdir()
        token = subprocess.run([*kubectl, "-n", ns, "create", "token", "bij-worker", "--duration=2h"], check=True,
                               capture_output=True, text=True).stdout.strip()
        (sa_dir / "token").write_text(token)
        (sa_dir / "ca.crt").write_bytes(Path(cluster.plane.pki.ca.cert).read_bytes())
        meters = Meters(cluster.plane, api)
        custom = kubernetes.client.CustomObjectsApi(api)
        runs: list[dict[str, Any]] = []
        for _ in range(args.repeats):
            for n in counts:
                runs.append(one_run(cluster, meters, custom, ns, sa_dir, "leases", n, args.seconds))
                if n <= args.max_status_lanes:
                    runs.append(one_run(cluster, meters, custom, ns, sa_dir, "status", n, args.seconds))
        report.details["runs"] = runs
    finally:
        cluster.plane.stop()
        harness.cleanup(work, args.keep)

    def med(design: str, n: int, key: str) -> tuple[float, str]:
        values = [r[key] for r in runs if r["design"] == design and r["lanes"] == n]
        spread = f"{min(values):.1f}-{max(values):.1f} over {len(values)}" if len(values) > 1 else "1 run"
        return statistics.median(values), spread

    lo, hi = (100 if 100 in counts else min(counts)), max(counts)
    for n in counts:
        size, spread = med("leases", n, "object_kib")
        report.ratio(f"bij object at {n:,} lanes, KiB", size, OBJECT_KIB_TARGET, higher_is_better=False, note=spread)
    for key, what in (("writes_per_s", "API writes/s"), ("etcd_kib_per_s", "etcd bytes/s"),
                      ("operator_cpu_ms_per_s", "operator CPU/s")):
        a, sa = med("leases", lo, key)
        b, sb = med("leases", hi, key)
        report.ratio(f"{what} at {hi:,} lanes / at {lo:,}", b / a if a else float("inf"), FLAT_TARGET,
                     higher_is_better=False, note=f"{b:.1f} vs {a:.1f} ({sb}; {sa})")
    status_ns = sorted({r["lanes"] for r in runs if r["design"] == "status"})
    if status_ns:
        top = status_ns[-1]
        for key, what in (("object_kib", "bij object KiB"), ("writes_per_s", "API writes/s"),
                          ("etcd_kib_per_s", "etcd bytes/s"), ("operator_cpu_ms_per_s", "operator CPU/s")):
            new, _ = med("leases", top, key)
            old, _ = med("status", top, key)
            report.ratio(f"{what} at {top:,} lanes, status reports / leases", old / new if new else float("inf"),
                         None, note=f"previous design {old:.1f}, leases {new:.1f}")
    report.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
