"""Small results and progress from a bij's pods to its operator, through the Kubernetes API only.

The operator never reads storage: what it needs to know from storage (a round's plan, a round's
statistics, the publish plan, the manifest's counts) is worked out by a pod of the bij's namespace
(`bij-worker step ...`), and running lanes say how far they got. Each pod writes its report into
the bij's own status subresource with a JSON merge patch of its own key only::

    status.reports.steps.<step Job name> = {"jobUid": ..., "result": {...}}
    status.reports.lanes.<pod name>      = {"round": 0, "lane": 1, "shardsDone": 3, "rows": ..., ...}

A lane of several pods whose group is replaced says why in its last report (``groupLost``).

Why the status subresource, and not a ConfigMap or the container's termination message: the
operator already reads the bij on every step, so a report costs it no request at all; the worker
service account needs one permission (`patch` on `batchinferencejobs/status` in its namespace) and
no read; a report is deleted with the bij; and running lanes can report (a termination message
only exists once the container ended). A merge patch of one key never touches another pod's key or
the operator's fields, so the writers need no coordination.

`bij run` has no API server: its Jobs run as local processes that write the same reports as files
under a folder (``BIJ_REPORT_TO=dir:<folder>``) which the local driver reads into the status it
keeps in memory. Where a report goes is set by the Job (``BIJ_REPORT_TO``); without it nothing is
reported (a worker run by hand).
"""

from __future__ import annotations

import json
import logging
import os
import ssl
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from bij.contract.codes import JOB_UID_ENV, POD_NAME_ENV, REPORT_ENV
from bij.contract.lane_report import LaneReport
from bij.contract.records import now_stamp
from bij.contract.spec import API_GROUP, API_VERSION

__all__ = ["JOB_UID_ENV", "POD_NAME_ENV", "REPORT_ENV"]  # and what is defined below

log = logging.getLogger("bij.report")

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
PLURAL = "batchinferencejobs"


class ReportError(Exception):
    """A report could not be delivered; `permanent`: the API server refused it (a 4xx), the same on a retry."""

    def __init__(self, message: str, permanent: bool = False):
        super().__init__(message)
        self.permanent = permanent


class Sink(Protocol):
    def put(self, section: str, key: str, value: Mapping[str, Any] | None) -> None:
        """Set ``status.reports.<section>.<key>`` to `value` (None removes it)."""


class KubeStatus:
    """Merge patches of the bij's status subresource with the pod's service account token."""

    def __init__(self, namespace: str, name: str, sa_dir: Path = SA_DIR, timeout: float = 15.0):
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        port = os.environ.get("KUBERNETES_SERVICE_PORT")
        if not host or not port:
            raise ReportError(f"{REPORT_ENV} asks for the Kubernetes API, but KUBERNETES_SERVICE_HOST/PORT are unset")
        if ":" in host:
            host = f"[{host}]"
        self.url = (f"https://{host}:{port}/apis/{API_GROUP}/{API_VERSION}/namespaces/{namespace}/{PLURAL}/"
                    f"{name}/status")
        self.sa_dir = sa_dir
        self.timeout = timeout
        self.context = ssl.create_default_context(cafile=str(sa_dir / "ca.crt"))

    def put(self, section: str, key: str, value: Mapping[str, Any] | None) -> None:
        body = json.dumps({"status": {"reports": {section: {key: value}}}}).encode()
        # Read each time: a projected token is rotated while the pod runs.
        token = (self.sa_dir / "token").read_text().strip()
        req = urllib.request.Request(self.url, data=body, method="PATCH", headers={
            "Content-Type": "application/merge-patch+json", "Authorization": f"Bearer {token}",
            "Accept": "application/json"})
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
            raise ReportError(f"PATCH {self.url}: HTTP {e.code}: {detail[:600]}", permanent=refused) from None
        except (urllib.error.URLError, OSError) as e:
            raise ReportError(f"PATCH {self.url}: {e}") from None


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


def sink_from_env(env: Mapping[str, str] | None = None) -> Sink | None:
    """Where this pod's reports go (``BIJ_REPORT_TO``: ``kube:<namespace>/<bij>`` or ``dir:<folder>``)."""
    where = (env if env is not None else os.environ).get(REPORT_ENV, "")
    if not where:
        return None
    kind, _, rest = where.partition(":")
    if kind == "kube" and "/" in rest:
        namespace, name = rest.split("/", 1)
        return KubeStatus(namespace, name)
    if kind == "dir" and rest:
        return FolderSink(rest)
    raise ReportError(f"{REPORT_ENV}={where!r}: expected kube:<namespace>/<name> or dir:<folder>")


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

    def __init__(self, sink: Sink, round_no: int, lane: int, interval: float = 5.0, key: str | None = None):
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
        while not self.closed.wait(self.interval):
            self.send()

    def send(self) -> None:
        with self.lock:
            if self.version == self.sent:
                return
            version = self.version
            value = self.state.model_copy(update={"at": now_stamp()}).as_status()
        try:
            self.sink.put("lanes", self.key, value)
            self.sent = version
        except (ReportError, OSError) as e:
            log.warning("cannot report progress: %s", e)

    def close(self) -> None:
        """The last report, as the lane ends."""
        self.closed.set()
        self.thread.join(timeout=self.interval + 20)
        self.send()
