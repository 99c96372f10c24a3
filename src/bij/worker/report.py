"""Small results and progress from a bij's pods to its operator, through the Kubernetes API only.

The operator never reads storage: what it needs to know from storage (a round's plan, a round's
statistics, the publish plan, the manifest's counts) is worked out by a pod of the bij's namespace
(`bij-worker step ...`), and running lanes say how far they got:

- a step pod writes its `StepReport` into the bij's own status subresource, a JSON merge patch of its
  own key only (``status.reports.steps.<step Job name>``): a handful a round, so the operator, which
  reads the bij on every step anyway, gets it without a request, and a merge patch of one key never
  touches another pod's key or the operator's fields;
- a lane's pod writes its `LaneReport` into a `coordination.k8s.io/v1` Lease of its own, named after the
  pod, labelled with the bij and the round, owned by the round's Job (`lane_report`): the bij object
  then stays the same size for 10 lanes and 10,000, and a report rewrites ~1 KB instead of the whole
  bij, read by every watcher. Lanes report every ``BIJ_REPORT_INTERVAL`` seconds, which the Job sets
  from its lane count so the writes of a round stay flat, the first one at a random point of the
  interval so that lanes started together do not report together.

A lane of several pods whose group is replaced says why in its last report (``groupLost``).

`bij run` has no API server: its Jobs run as local processes that write the same reports as files
under a folder (``BIJ_REPORT_TO=dir:<folder>``) which the local driver reads. Where a report goes is set
by the Job (``BIJ_REPORT_TO``); without it nothing is reported (a worker run by hand).
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import logging
import os
import random
import ssl
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from bij.contract.codes import (
    API_GROUP,
    JOB_LABEL,
    JOB_NAME_ENV,
    JOB_UID_ENV,
    PLURAL,
    POD_NAME_ENV,
    REPORT_ENV,
    REPORT_INTERVAL_ENV,
    ROUND_LABEL,
)
from bij.contract.lane_report import REPORT_ANNOTATION, REPORT_SECONDS, LaneReport
from bij.contract.records import now_stamp
from bij.contract.spec import API_VERSION

__all__ = ["JOB_UID_ENV", "POD_NAME_ENV", "REPORT_ENV"]  # and what is defined below

log = logging.getLogger("bij.report")

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
LANES = "lanes"  # the section of a lane's report


class ReportError(Exception):
    """A report could not be delivered; `permanent`: the API server refused it (a 4xx), the same on a retry;
    `status`: its HTTP status, if it answered."""

    def __init__(self, message: str, permanent: bool = False, status: int | None = None):
        super().__init__(message)
        self.permanent = permanent
        self.status = status


class Sink(Protocol):
    def put(self, section: str, key: str, value: Mapping[str, Any] | None) -> None:
        """Set ``status.reports.<section>.<key>`` to `value` (None removes it)."""


@functools.lru_cache(maxsize=4)
def _tls(cafile: str) -> ssl.SSLContext:
    """One TLS context per CA file: many reporters in one process (lanes of a bench, a step and its lane)
    share it instead of each loading the CA again."""
    return ssl.create_default_context(cafile=cafile)


class _KubeApi:
    """Requests to the API server with the pod's service account token."""

    def __init__(self, sa_dir: Path = SA_DIR, timeout: float = 15.0):
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        port = os.environ.get("KUBERNETES_SERVICE_PORT")
        if not host or not port:
            raise ReportError(f"{REPORT_ENV} asks for the Kubernetes API, but KUBERNETES_SERVICE_HOST/PORT are unset")
        if ":" in host:
            host = f"[{host}]"
        self.server = f"https://{host}:{port}"
        self.sa_dir = sa_dir
        self.timeout = timeout
        self.context = _tls(str(sa_dir / "ca.crt"))

    def request(self, method: str, url: str, body: Mapping[str, Any] | None = None,
                content_type: str = "application/json") -> None:
        """Send one request; an HTTP error is a `ReportError` (`permanent` for what a retry cannot change)
        with its `status`."""
        data = json.dumps(body).encode() if body is not None else None
        # Read each time: a projected token is rotated while the pod runs.
        token = (self.sa_dir / "token").read_text().strip()
        headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = content_type
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, context=self.context, timeout=self.timeout) as resp:
                resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read()[:4000].decode(errors="replace")
            try:
                # The API server's Status says what was refused (a 403 names the verb and resource missing).
                detail = str(json.loads(detail).get("message") or detail)
            except (ValueError, AttributeError):
                pass
            # Forbidden, not found, invalid: asked again, the API server answers the same.
            refused = 400 <= e.code < 500 and e.code not in (408, 409, 429)
            raise ReportError(f"{method} {url}: HTTP {e.code}: {detail[:600]}", permanent=refused,
                              status=e.code) from None
        except (urllib.error.URLError, OSError) as e:
            raise ReportError(f"{method} {url}: {e}") from None


class KubeStatus(_KubeApi):
    """Merge patches of the bij's status subresource (a step's report)."""

    def __init__(self, namespace: str, name: str, sa_dir: Path = SA_DIR, timeout: float = 15.0):
        super().__init__(sa_dir, timeout)
        self.url = f"{self.server}/apis/{API_GROUP}/{API_VERSION}/namespaces/{namespace}/{PLURAL}/{name}/status"

    def put(self, section: str, key: str, value: Mapping[str, Any] | None) -> None:
        self.request("PATCH", self.url, {"status": {"reports": {section: {key: value}}}},
                     "application/merge-patch+json")


class KubeLeases(_KubeApi):
    """A lane's report in a Lease of its own, named `key` (the pod's name): created on the first report,
    merge-patched after; owned by the round's Job where the pod knows it (``BIJ_JOB_NAME``/``BIJ_JOB_UID``)."""

    def __init__(self, namespace: str, bij: str, sa_dir: Path = SA_DIR, timeout: float = 15.0,
                 lease_seconds: int | None = None, job: tuple[str, str] | None = None):
        super().__init__(sa_dir, timeout)
        self.bij = bij
        self.url = f"{self.server}/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
        self.lease_seconds = lease_seconds
        self.job = job  # (name, uid) of the round's Job
        self.made: set[str] = set()

    def body(self, key: str, value: Mapping[str, Any]) -> dict[str, Any]:
        meta: dict[str, Any] = {"annotations": {REPORT_ANNOTATION: json.dumps(value, separators=(",", ":"))}}
        spec: dict[str, Any] = {"holderIdentity": key, "renewTime": _micro_time()}
        if self.lease_seconds:
            spec["leaseDurationSeconds"] = self.lease_seconds
        if key not in self.made:
            meta.update(name=key, labels={JOB_LABEL: self.bij, ROUND_LABEL: str(value.get("round", ""))})
            if self.job is not None:
                meta["ownerReferences"] = [{"apiVersion": "batch/v1", "kind": "Job", "name": self.job[0],
                                            "uid": self.job[1]}]
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": spec}

    def put(self, section: str, key: str, value: Mapping[str, Any] | None) -> None:
        if value is None:
            try:
                self.request("DELETE", f"{self.url}/{key}")
            except ReportError as e:
                if e.status != 404:
                    raise
            self.made.discard(key)
            return
        if key in self.made:
            try:
                self.request("PATCH", f"{self.url}/{key}", self.body(key, value), "application/merge-patch+json")
                return
            except ReportError as e:
                if e.status != 404:
                    raise
                self.made.discard(key)  # deleted under us (its Job was): made again below
        try:
            self.request("POST", self.url, self.body(key, value))
        except ReportError as e:
            if e.status != 409:
                raise
            # Made by an earlier try of this pod whose answer was lost: patch it.
            self.made.add(key)
            self.request("PATCH", f"{self.url}/{key}", self.body(key, value), "application/merge-patch+json")
            return
        self.made.add(key)


class KubeReports:
    """A pod's reports on Kubernetes: a step's into the bij's status, a lane's into its Lease."""

    def __init__(self, namespace: str, name: str, sa_dir: Path = SA_DIR, lease_seconds: int | None = None,
                 job: tuple[str, str] | None = None):
        self.status = KubeStatus(namespace, name, sa_dir)
        self.leases = KubeLeases(namespace, name, sa_dir, lease_seconds=lease_seconds, job=job)

    def put(self, section: str, key: str, value: Mapping[str, Any] | None) -> None:
        (self.leases if section == LANES else self.status).put(section, key, value)


def _micro_time() -> str:
    """Now as a Kubernetes MicroTime (a Lease's renewTime)."""
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class FolderSink:
    """`bij run`: one JSON file per report, ``<folder>/<section>/<key>.json``, replaced atomically."""

    def __init__(self, folder: str):
        self.folder = Path(folder)

    def put(self, section: str, key: str, value: Mapping[str, Any] | None) -> None:
        path = self.folder / section / f"{key}.json"
        if value is None:
            path.unlink(missing_ok=True)
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(value))
        os.replace(tmp, path)


def read_folder(folder: str | Path) -> dict[str, dict[str, Any]]:
    """The reports a `FolderSink` wrote, as ``status.reports`` holds them."""
    out: dict[str, dict[str, Any]] = {}
    root = Path(folder)
    if not root.is_dir():
        return out
    for section in sorted(p for p in root.iterdir() if p.is_dir()):
        for f in sorted(section.glob("*.json")):
            try:
                out.setdefault(section.name, {})[f.name[:-len(".json")]] = json.loads(f.read_text())
            except (OSError, ValueError):
                continue  # replaced under us; the next look finds the new one
    return out


def sink_from_env(env: Mapping[str, str] | None = None, sa_dir: Path = SA_DIR) -> Sink | None:
    """Where this pod's reports go (``BIJ_REPORT_TO``: ``kube:<namespace>/<bij>`` or ``dir:<folder>``)."""
    where = (env if env is not None else os.environ).get(REPORT_ENV, "")
    if not where:
        return None
    kind, _, rest = where.partition(":")
    if kind == "kube" and "/" in rest:
        namespace, name = rest.split("/", 1)
        env = env if env is not None else os.environ
        interval = env.get(REPORT_INTERVAL_ENV, "")
        job_name, job_uid = env.get(JOB_NAME_ENV), env.get(JOB_UID_ENV)
        return KubeReports(namespace, name, sa_dir,
                           lease_seconds=int(3 * float(interval)) + 1 if _is_number(interval) else None,
                           job=(job_name, job_uid) if job_name and job_uid else None)
    if kind == "dir" and rest:
        return FolderSink(rest)
    raise ReportError(f"{REPORT_ENV}={where!r}: expected kube:<namespace>/<name> or dir:<folder>")


def _is_number(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False


def put_with_retries(sink: Sink, section: str, key: str, value: Mapping[str, Any] | None,
                     attempts: int = 6, delay: float = 0.5) -> None:
    """Deliver one report, retrying a failed request with back-off (not one the API server refused); the
    last error is raised."""
    for attempt in range(attempts):
        try:
            sink.put(section, key, value)
            return
        except (ReportError, OSError) as e:
            if attempt == attempts - 1 or getattr(e, "permanent", False):
                raise ReportError(str(e), permanent=bool(getattr(e, "permanent", False))) from None
            log.warning("report %s/%s: %s; retrying", section, key, e)
            time.sleep(min(delay * 2**attempt, 8.0))


class LaneReporter:
    """A lane's progress from its own progress events: shards it finished, rows and bytes it made
    durable. Sent from a thread of its own every `interval` seconds while it changes, and once at the
    end (`close`), best effort: a report that cannot be sent costs the lane nothing (its records in
    storage are what counts), and the lane never waits for the API server."""

    def __init__(self, sink: Sink, round_no: int, lane: int, interval: float = REPORT_SECONDS, key: str | None = None):
        self.sink = sink
        self.key = key or os.environ.get(POD_NAME_ENV) or f"lane-{round_no}-{lane}-{uuid.uuid4().hex[:8]}"
        self.state = LaneReport(round=round_no, lane=lane)
        self.worked: set[int] = set()  # shards this pod worked (a "resume" came first)
        self.interval = interval
        self.version = 0
        self.sent = -1
        self.lock = threading.Lock()
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="lane-report", daemon=True)
        self.thread.start()

    def on_event(self, event: Mapping[str, Any]) -> None:
        kind = event.get("event")
        with self.lock:
            s = self.state
            if kind == "resume":
                self.worked.add(int(event.get("index", -1)))
            elif kind == "chunk":
                self.state = s.model_copy(update={"rows": s.rows + int(event.get("rows") or 0),
                                                  "errors": s.errors + int(event.get("errors") or 0),
                                                  "bytes": s.bytes + int(event.get("bytes") or 0)})
            elif kind == "done" and int(event.get("index", -1)) in self.worked:
                # Only a shard this pod finished: one found finished was counted by its finisher.
                self.state = s.model_copy(update={"shards_done": s.shards_done + 1})
            else:
                return
            self.version += 1

    def group_lost(self, reason: str) -> None:
        """The lane's group of pods is replaced (bij.worker.group): said in the last report, which the
        operator turns into a Warning Event and the count in status.lanes.replaced."""
        with self.lock:
            self.state = self.state.model_copy(update={"group_lost": reason})
            self.version += 1

    def _loop(self) -> None:
        # The first report at a random point of the interval: lanes that start together spread out.
        wait = random.uniform(0, self.interval)
        while not self.closed.wait(wait):
            self.send()
            wait = self.interval

    def send(self) -> None:
        with self.lock:
            if self.version == self.sent:
                return
            version = self.version
            value = self.state.model_copy(update={"at": now_stamp()}).as_status()
        try:
            self.sink.put(LANES, self.key, value)
            self.sent = version
        except (ReportError, OSError) as e:
            log.warning("cannot report progress: %s", e)

    def close(self) -> None:
        """The last report, as the lane ends."""
        self.closed.set()
        self.thread.join(timeout=self.interval + 20)
        self.send()
