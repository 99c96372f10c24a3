"""`bij operator`: kopf wiring that translates between the Kubernetes API and `driver.Driver`.

One kopf daemon per BatchInferenceJob runs its driver: observe (the bij from the API, its Jobs
from an index kopf keeps current from its watch), `reconcile.decide()`, apply the one step
through `KubeBackend`, repeat until the answer is to wait; then the daemon sleeps until one of
the bij's Jobs or its spec changes, or until the driver asked to be woken (a retry, the next
progress refresh). Every decision lives in the driver and the pure core, shared with `bij run`.

API calls go through the official client in a worker thread; kopf watches, indexes, runs the
daemons (a failed API call is a `kopf.TemporaryError`: kopf restarts the daemon after the
delay), posts Events and serves the liveness probe. Deleting a bij deletes its Jobs by owner
reference and keeps the results; kopf puts a finalizer on each bij to stop its daemon, so a bij
is only deleted while an operator runs.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import dataclasses
import datetime as dt
import json
import logging
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, cast

import kopf
import urllib3
from kubernetes.client import ApiException

from bij.contract.codes import (
    JOB_LABEL,
    LANE_OFFSET_ANNOTATION,
    NODES_PER_LANE_ANNOTATION,
    PLURAL,
    POOL_LABEL,
    PUBLISH_LABEL,
    ROUND_LABEL,
    STEP_LABEL,
)
from bij.contract.lane_report import REPORT_ANNOTATION, LaneTally, tally, tally_interval
from bij.contract.spec import API_GROUP, API_VERSION, SecretKeyRef, SpecError, parse_job
from bij.control.access_review import check_grants
from bij.control.decisions import Decision
from bij.control.driver import PROGRESS_INTERVAL, STATUS_INTERVAL, Created, Driver, Observed
from bij.control.jobs import (
    FileVolume,
    file_uri_problems,
    step_resources_default,
    steps_image_default,
    worker_image_default,
)
from bij.control.observe import owns
from bij.control.permissions import GrantCheck

# A waiting daemon wakes when one of its bij's Jobs changes; it looks for spec edits (and whether it
# is to stop) this often, in memory, without an API call.
SPEC_POLL = 1.0
# How long a woken daemon lets kopf finish indexing the Job it was woken for.
INDEX_SETTLE = 0.02
# A running round's lane Leases are listed this many a request (summed every `lane_report.tally_interval`).
LEASE_PAGE = 500

log = logging.getLogger("bij.operator")


# --- configuration -------------------------------------------------------------------------------


@dataclasses.dataclass
class OperatorConfig:
    """What `main()` parsed; handed to the handlers in kopf's memo."""

    namespaces: list[str] = dataclasses.field(default_factory=list)
    clusterwide: bool = False
    liveness: str | None = None
    peering: str | None = None
    standalone: bool = True
    verbose: bool = False
    worker_image: str = dataclasses.field(default_factory=worker_image_default)
    steps_image: str = dataclasses.field(default_factory=steps_image_default)
    # The chart's fileStorage (env BIJ_FILE_STORAGE): without it, a bij with a file:// URI is refused.
    file_volume: FileVolume | None = dataclasses.field(default_factory=FileVolume.from_env)
    status_interval: float = STATUS_INTERVAL
    progress_interval: float = PROGRESS_INTERVAL
    # Watch requests end server-side after this long and are reopened; the client gives up a
    # little later, so a silently dead connection cannot stall the operator.
    watch_server_timeout: int = 300
    watch_client_timeout: int = 330
    watch_connect_timeout: int = 10


# --- the Kubernetes API, through the official client -----------------------------------------------


class Api:
    """The few calls the operator makes, as plain dicts (blocking: called from the driver's thread)."""

    def __init__(self) -> None:
        import kubernetes

        try:
            kubernetes.config.load_incluster_config()
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config()
        self._client = kubernetes.client.ApiClient()
        self.custom = kubernetes.client.CustomObjectsApi(self._client)
        self.batch = kubernetes.client.BatchV1Api(self._client)
        self.core = kubernetes.client.CoreV1Api(self._client)
        self.authz = kubernetes.client.AuthorizationV1Api(self._client)
        self.coordination = kubernetes.client.CoordinationV1Api(self._client)

    def get_bij(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return cast(dict[str, Any], self.custom.get_namespaced_custom_object(
                API_GROUP, API_VERSION, namespace, PLURAL, name))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def secret_value(self, namespace: str, name: str, key: str) -> bytes:
        """One key of a Secret (spec.notify's signing key); LookupError naming what is missing or refused."""
        try:
            secret = self.core.read_namespaced_secret(name, namespace)
        except ApiException as e:
            if e.status in (403, 404):
                raise LookupError(f"Secret {namespace}/{name}: "
                                  + ("not found" if e.status == 404 else "the operator may not read it")) from None
            raise
        data = secret.data or {}
        if key not in data:
            raise LookupError(f"Secret {namespace}/{name} has no key {key}")
        return base64.b64decode(data[key])

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object_status(API_GROUP, API_VERSION, namespace, PLURAL, name,
                                                          {"status": status},
                                                          _content_type="application/merge-patch+json")

    def create_job(self, namespace: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """Create the Job and return it; None when it already exists (an earlier attempt got there first)."""
        try:
            resp = self.batch.create_namespaced_job(namespace, body, _preload_content=False)
        except ApiException as e:
            if e.status == 409:
                return None
            raise
        return dict(json.loads(resp.data))

    def create_service(self, namespace: str, body: dict[str, Any]) -> None:
        """Create the Service; one that exists already (an earlier round's) is fine."""
        try:
            self.core.create_namespaced_service(namespace, body, _preload_content=False)
        except ApiException as e:
            if e.status != 409:
                raise

    def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            resp = self.batch.read_namespaced_job(name, namespace, _preload_content=False)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return dict(json.loads(resp.data))

    def patch_job(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        self.batch.patch_namespaced_job(name, namespace, patch, _content_type="application/merge-patch+json",
                                        _preload_content=False)

    def step_pods(self, namespace: str, bij: str, *, workers: bool = False) -> list[dict[str, Any]]:
        """The pods of a bij's step Jobs, as `observe.failed_pods` and `stuck_pods` read them (name, labels,
        phase, conditions, container states); none where this operator may not list pods (an older chart's
        Role). `workers`: its worker pods too (a pool's pods that may not find a node, `pools.gives_up`)."""
        selector = f"{JOB_LABEL}={bij}" if workers else f"{JOB_LABEL}={bij},{STEP_LABEL}"
        try:
            resp = self.core.list_namespaced_pod(namespace, label_selector=selector, _preload_content=False)
        except ApiException as e:
            if e.status in (401, 403, 404):
                log.warning("cannot list the pods of %s/%s's steps (%s): failures say less", namespace, bij, e.reason)
                return []
            raise
        out = []
        for pod in json.loads(resp.data).get("items") or []:
            meta, status = pod.get("metadata") or {}, pod.get("status") or {}
            out.append({"metadata": {k: meta[k] for k in ("name", "labels", "creationTimestamp") if k in meta},
                        "status": {k: status[k] for k in ("phase", "reason", "message", "conditions",
                                                          "containerStatuses")
                                   if k in status}})
        return out

    def lane_reports(self, namespace: str, bij: str, round_no: int) -> Iterator[object]:
        """The lane reports of round `round_no` of a bij, one Lease a pod (bij.worker.report), read a page at
        a time so that the operator's memory does not grow with the lanes; none where this operator may not
        list Leases (an older chart's Role)."""
        selector = f"{JOB_LABEL}={bij},{ROUND_LABEL}={round_no}"
        token: str | None = None
        while True:
            try:
                resp = self.coordination.list_namespaced_lease(namespace, label_selector=selector,
                                                               limit=LEASE_PAGE, _continue=token,
                                                               _preload_content=False)
            except ApiException as e:
                if e.status in (401, 403, 404):
                    log.warning("cannot list the lane Leases of %s/%s (%s): no progress until the round ends",
                                namespace, bij, e.reason)
                    return
                raise
            page = json.loads(resp.data)
            for lease in page.get("items") or []:
                raw = ((lease.get("metadata") or {}).get("annotations") or {}).get(REPORT_ANNOTATION)
                try:
                    yield json.loads(raw) if raw else None
                except ValueError:
                    yield None  # not a report: tally() leaves it out
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return

    def delete_job(self, namespace: str, name: str) -> None:
        """Delete a Job and, in the background, its pods; one already gone is fine."""
        try:
            self.batch.delete_namespaced_job(name, namespace, propagation_policy="Background",
                                             _preload_content=False)
        except ApiException as e:
            if e.status != 404:
                raise


def job_essence(body: Mapping[str, Any]) -> dict[str, Any]:
    """What decisions read of a Job (`observe.JobView`), without its pod template."""
    meta = body.get("metadata") or {}
    spec = body.get("spec") or {}
    annotations = meta.get("annotations") or {}
    kept = {k: annotations[k] for k in (NODES_PER_LANE_ANNOTATION, LANE_OFFSET_ANNOTATION) if k in annotations}
    return json.loads(json.dumps({
        "metadata": {k: meta[k] for k in ("name", "uid", "resourceVersion", "labels", "ownerReferences",
                                           "deletionTimestamp") if k in meta}
        | ({"annotations": kept} if kept else {}),
        "spec": {k: spec[k] for k in ("completions", "parallelism", "suspend") if k in spec},
        "status": body.get("status") or {},
    }))


class KubeBackend:
    """The driver's steps as Kubernetes API calls for one bij; its Jobs come from kopf's index."""

    def __init__(self, api: Api, namespace: str, name: str, jobs: Any, worker_image: str,
                 file_volume: FileVolume | None = None, steps_image: str | None = None):
        self.api = api
        self.namespace = namespace
        self.name = name
        self.index = jobs  # kopf.Index: (namespace, bij name) -> the essences of its Jobs
        self.worker_image = worker_image
        self.steps_image = steps_image or worker_image
        self.file_volume = file_volume
        self.raw: dict[str, Any] = {}
        # Jobs this backend created or read that the index has not shown yet (a watch event is on its way).
        self.recent: dict[str, tuple[float, dict[str, Any]]] = {}
        # The current round's lane reports, summed at most once per `tally_interval` (monotonic time).
        self.tallied: tuple[float, LaneTally] | None = None

    def jobs(self) -> list[dict[str, Any]]:
        indexed = [dict(j) for j in self.index.get((self.namespace, self.name), ())]
        names = {j["metadata"].get("name") for j in indexed}
        now = time.monotonic()
        for name, (at, job) in list(self.recent.items()):
            if name in names or now - at > 60:
                del self.recent[name]
            else:
                indexed.append(job)
        return indexed

    def observe(self) -> Observed | None:
        raw = self.api.get_bij(self.namespace, self.name)
        if raw is None or raw["metadata"].get("deletionTimestamp"):
            return None
        self.raw = raw
        status = raw.get("status") or {}
        generation = raw["metadata"].get("generation")
        output_uri = str(((raw.get("spec") or {}).get("output") or {}).get("uri") or "")
        try:
            job = parse_job(raw)
            problems = file_uri_problems(job, self.file_volume)
            if problems:
                # Valid for `bij run`, but on this cluster no pod would see the other pods' files.
                raise SpecError(problems)
        except SpecError as e:
            return Observed(job=None, spec_error=e, status=status, generation=generation, output_uri=output_uri,
                            jobs=[])
        jobs = self.jobs()
        # A step's failed pods say why it is retried or failed; looked for only where one failed.
        failing = any(STEP_LABEL in (j["metadata"].get("labels") or {}) and (pods_failed(j) or slow_to_start(j))
                      for j in jobs)
        # A pool's pods that may find no node (or are preempted) decide whether it gives its lanes up.
        pool_waiting = any(POOL_LABEL in (j["metadata"].get("labels") or {}) and (pods_failed(j) or slow_to_start(j))
                           for j in jobs)
        pods = self.api.step_pods(self.namespace, self.name, workers=pool_waiting) if failing or pool_waiting else []
        return Observed(job=job, spec_error=None, status=status, generation=generation, output_uri=output_uri,
                        jobs=jobs, pods=pods, lanes=self.lane_tally(status, jobs))

    def lane_tally(self, status: Mapping[str, Any], jobs: Iterable[Mapping[str, Any]]) -> LaneTally | None:
        """The current round's lane reports, summed from its pods' Leases while its Job exists; listed at most
        once per `tally_interval` of its pods, which grows with them as their report interval does, so
        reading them costs the API server and this operator the same per second at 10 lanes and 10,000."""
        round_no = status.get("round")
        running = [j for j in jobs if isinstance(round_no, int) and is_round_job(j, round_no)]
        if not running or not isinstance(round_no, int):
            return None
        pods = max(int((j.get("spec") or {}).get("parallelism") or 1) for j in running)
        now = time.monotonic()
        if self.tallied is not None:
            at, last = self.tallied
            if last.round == round_no and now - at < tally_interval(pods):
                return last
        self.tallied = (now, tally(self.api.lane_reports(self.namespace, self.name, round_no), round_no))
        return self.tallied[1]

    def check_worker_grants(self, service_account: str) -> GrantCheck:
        """Whether `service_account` of this bij's namespace holds every grant its pods use, asked as the
        operator (a LocalSubjectAccessReview each; the chart grants the create)."""
        return check_grants(self.api.authz, self.namespace, service_account)

    def create_job(self, body: dict[str, Any]) -> Created:
        kopf.adopt(body, owner=as_body(self.raw))
        name = body["metadata"]["name"]
        made = self.api.create_job(self.namespace, body)
        if made is not None:
            self.recent[name] = (time.monotonic(), job_essence(made))
            return "created"
        existing = self.api.get_job(self.namespace, name)
        if existing is None:
            return "exists"  # deleted since: the next observation decides again
        if owns(parse_job(self.raw), existing):
            self.recent[name] = (time.monotonic(), job_essence(existing))
            return "exists"
        return "foreign"

    def create_service(self, body: dict[str, Any]) -> None:
        kopf.adopt(body, owner=as_body(self.raw))
        self.api.create_service(self.namespace, body)

    def patch_job(self, name: str, spec: dict[str, Any]) -> None:
        self.api.patch_job(self.namespace, name, {"spec": spec})

    def delete_job(self, name: str) -> None:
        self.api.delete_job(self.namespace, name)
        self.recent.pop(name, None)

    def write_status(self, patch: dict[str, Any]) -> None:
        self.api.patch_status(self.namespace, self.name, patch)

    def notify_key(self, ref: SecretKeyRef) -> bytes:
        return self.api.secret_value(self.namespace, ref.name, ref.key)

    def event(self, type_: str, reason: str, message: str) -> None:
        # kopf posts Events from its own task; this is safe from the driver's thread.
        kopf.event(as_body(self.raw), type=type_, reason=reason, message=message)


def is_round_job(job: Mapping[str, Any], round_no: int) -> bool:
    """Whether `job` is the Job of round `round_no`'s lanes (not one of its steps or publish passes)."""
    labels = job["metadata"].get("labels") or {}
    return labels.get(ROUND_LABEL) == str(round_no) and STEP_LABEL not in labels and PUBLISH_LABEL not in labels


def pods_failed(job: Mapping[str, Any]) -> bool:
    """Whether a pod of `job` may have failed: counted, being counted, the Job gave up, or a started Job
    has no pod running and is not finished (its pod failed, the next one not made yet: the Job controller
    may count the failure only then)."""
    status = job.get("status") or {}
    ended = [c.get("type") for c in status.get("conditions") or [] if str(c.get("status")) == "True"]
    return bool(status.get("failed") or (status.get("uncountedTerminatedPods") or {}).get("failed")
                or {"Failed", "FailureTarget"} & set(ended)
                or (status.get("startTime") and not status.get("active")
                    and not {"Complete", "SuccessCriteriaMet"} & set(ended)))


# A step pod not ready this long after its Job started may be stuck (an image that cannot be pulled).
SLOW_START_SECONDS = 20.0


def slow_to_start(job: Mapping[str, Any], now: float | None = None) -> bool:
    """Whether `job` has a pod that is not ready SLOW_START_SECONDS after the Job started."""
    status = job.get("status") or {}
    if not status.get("active") or status.get("ready"):
        return False
    try:
        started = dt.datetime.fromisoformat(str(status.get("startTime")).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return False
    return (time.time() if now is None else now) - started > SLOW_START_SECONDS


def as_body(raw: dict[str, Any]) -> kopf.Body:
    """The API's dict as kopf's Body (for Events and owner references)."""
    return kopf.Body(cast(kopf.RawBody, raw))


# --- kopf wiring -----------------------------------------------------------------------------------


@dataclasses.dataclass
class Operator:
    """What every handler shares, handed over in kopf's memo (no module state)."""

    config: OperatorConfig
    metrics: OperatorMetrics
    api: Api | None = None
    # The bijs this process drives, each with the event that wakes its daemon when one of its Jobs changes.
    driven: dict[tuple[str, str], asyncio.Event] = dataclasses.field(default_factory=dict)


def shared(memo: Any) -> Operator:
    return cast(Operator, memo.bij)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Timeouts, our own annotation prefix, Event identity; peering as the CLI asked."""
    if "bij" not in memo:  # run by kopf without main(): the defaults
        memo.bij = Operator(config=OperatorConfig(), metrics=OperatorMetrics())
    op = shared(memo)
    config = op.config
    settings.watching.server_timeout = config.watch_server_timeout
    settings.watching.client_timeout = config.watch_client_timeout
    settings.watching.connect_timeout = config.watch_connect_timeout
    settings.networking.request_timeout = 60
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=API_GROUP)
    settings.persistence.finalizer = f"{API_GROUP}/finalizer"
    settings.posting.reporting_component = "bij-operator"
    settings.posting.event_name_prefix = "bij-"
    settings.posting.level = logging.INFO
    if not config.clusterwide and not any(ch in ns for ns in config.namespaces for ch in "*?[]!,"):
        # Exact namespace names: no need to list and watch namespaces (and CRDs) cluster-wide, so
        # a namespaced install runs on Roles alone. The CRD must exist before the operator starts.
        settings.scanning.disabled = True
    settings.peering.standalone = config.standalone
    if config.peering:
        settings.peering.name = config.peering
        settings.peering.mandatory = True
    op.api = Api()  # log in now: a broken kubeconfig fails the start, not the first bij
    op.metrics.tracked.set_function(lambda: len(op.driven))


@kopf.on.probe(id="trackedJobs")
def tracked_jobs(memo: kopf.Memo, **_: Any) -> int:
    """For the liveness endpoint: how many BatchInferenceJobs this process is driving."""
    return len(shared(memo).driven)


@kopf.index("batch", "v1", "jobs", labels={JOB_LABEL: kopf.PRESENT})
async def bij_jobs(namespace: str | None, labels: Mapping[str, str], body: kopf.Body, memo: Any,
                   **_: Any) -> dict[Any, Any]:
    """The round and publish Jobs of each bij, by (namespace, bij name), as decisions read them; a
    change wakes the bij's daemon."""
    bij = labels[JOB_LABEL]
    key = (namespace, bij)
    # `driven` holds only namespaced bijs (drive asserts a namespace): a Job of none wakes no daemon.
    wake = shared(memo).driven.get((namespace, bij)) if namespace is not None else None
    if wake is not None:
        wake.set()
    return {key: job_essence(body)}


def _versions(jobs: Iterable[Mapping[str, Any]]) -> frozenset[tuple[str, str]]:
    return frozenset((str(j["metadata"].get("name")), str(j["metadata"].get("resourceVersion"))) for j in jobs)


@kopf.on.event(API_GROUP, API_VERSION, PLURAL)
async def step_reported(namespace: str | None, name: str | None, body: kopf.Body, memo: Any, **_: Any) -> None:
    """A change of the bij (a step's report into its status among them) wakes its daemon at once, which
    decides again if a step reported; no API call, nothing stored."""
    # `driven` holds only named, namespaced bijs: an event without either wakes no daemon.
    wake = shared(memo).driven.get((namespace, name)) if namespace is not None and name is not None else None
    if wake is not None:
        wake.set()


def _step_reports(body: kopf.Body) -> Any:
    """The steps' reports in the bij kopf keeps current from its watch (a new one wakes the daemon)."""
    return json.dumps(((body.get("status") or {}).get("reports") or {}).get("steps"), sort_keys=True)


@kopf.daemon(API_GROUP, API_VERSION, PLURAL, cancellation_timeout=30.0)
async def drive(*, namespace: str | None, name: str, stopped: kopf.DaemonStopped, body: kopf.Body, memo: Any,
                **kwargs: Any) -> None:
    """Drive one bij for as long as it exists: reconcile, then sleep until one of its Jobs changes
    (the index wakes it), its spec changes, or the driver's own recheck time comes."""
    assert namespace is not None  # the CRD is namespaced
    bij_jobs: kopf.Index[Any, dict[str, Any]] = kwargs["bij_jobs"]
    op = shared(memo)
    assert op.api is not None
    key = (namespace, name)
    backend = KubeBackend(op.api, namespace, name, bij_jobs, op.config.worker_image, op.config.file_volume,
                          steps_image=op.config.steps_image)
    driver = Driver(backend, status_interval=op.config.status_interval,
                    progress_interval=op.config.progress_interval, on_decision=op.metrics.decided,
                    worker_grants=backend.check_worker_grants)
    wake = op.driven[key] = asyncio.Event()
    try:
        while not stopped:
            jobs_seen = _versions(bij_jobs.get(key, ()))
            generation = body.metadata.get("generation")
            reports = _step_reports(body)
            wake.clear()
            try:
                idle = await asyncio.to_thread(driver.reconcile)
            except (ApiException, urllib3.exceptions.HTTPError) as e:
                code = getattr(e, "status", None)
                raise kopf.TemporaryError(f"Kubernetes API error {code or ''}: {e}".strip(), delay=10) from e
            if idle.gone:
                return
            deadline = None if idle.recheck is None else time.monotonic() + idle.recheck
            while not stopped:
                if (_versions(bij_jobs.get(key, ())) != jobs_seen or body.metadata.get("generation") != generation
                        or _step_reports(body) != reports):
                    break  # a Job changed, the spec was edited, or a step reported: decide at once
                left = SPEC_POLL if deadline is None else min(SPEC_POLL, deadline - time.monotonic())
                if left <= 0:
                    break
                try:
                    await asyncio.wait_for(wake.wait(), left)
                except asyncio.TimeoutError:
                    continue
                wake.clear()
                # Woken as kopf indexes a Job: let it store the Job before looking.
                await asyncio.sleep(INDEX_SETTLE)
    finally:
        op.driven.pop(key, None)


# --- `bij operator` --------------------------------------------------------------------------------


class OperatorMetrics:
    """What the operator did, for Prometheus (served with --metrics-port or env BIJ_METRICS_PORT)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = CollectorRegistry()
        self.decisions = Counter("bij_operator_decisions", "Reconcile decisions applied, by kind",
                                 ["decision"], registry=self.registry)
        self.tracked = Gauge("bij_operator_tracked_jobs", "BatchInferenceJobs this process follows",
                             registry=self.registry)

    def decided(self, d: Decision) -> None:
        self.decisions.labels(type(d).__name__).inc()

    def serve(self, port: int) -> None:
        from prometheus_client import start_http_server

        start_http_server(port, registry=self.registry)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bij operator", description="Run the BatchInferenceJob operator (kopf).")
    p.add_argument("--namespace", "-n", action="append", default=[], metavar="NS",
                   help="serve this namespace (repeatable; globs allowed); default: all namespaces")
    p.add_argument("--all-namespaces", "-A", action="store_true", help="serve every namespace")
    p.add_argument("--liveness", metavar="URL", default=None,
                   help="serve a liveness probe, e.g. http://0.0.0.0:8080/healthz")
    peering = p.add_mutually_exclusive_group()
    peering.add_argument("--peering", metavar="NAME", default=None,
                         help="coordinate with other operator replicas via this kopf peering object")
    peering.add_argument("--standalone", action="store_true", help="no peering (the default)")
    p.add_argument("--worker-image", default=None,
                   help="worker image when a spec names none (default: env BIJ_WORKER_IMAGE)")
    p.add_argument("--steps-image", default=None,
                   help="image of the step Jobs (planning, counting, publish plan, manifest): bij without an "
                        "engine (default: env BIJ_STEPS_IMAGE, else the worker image)")
    p.add_argument("--status-interval", type=float, default=STATUS_INTERVAL, metavar="SECONDS",
                   help=f"least time between progress-only status writes per job (default {STATUS_INTERVAL:g})")
    p.add_argument("--metrics-port", type=int, default=int(os.environ.get("BIJ_METRICS_PORT") or 0) or None,
                   help="serve Prometheus metrics on this port (default: env BIJ_METRICS_PORT, else none)")
    p.add_argument("--verbose", "-v", action="store_true", help="debug logging")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the operator until SIGTERM/SIGINT. Uses in-cluster credentials or the kubeconfig."""
    import sys

    args = parse_args(sys.argv[1:] if argv is None else argv)
    config = OperatorConfig(namespaces=list(args.namespace), clusterwide=args.all_namespaces or not args.namespace,
                            liveness=args.liveness, peering=args.peering, standalone=args.peering is None,
                            verbose=args.verbose, status_interval=args.status_interval)
    if args.worker_image:
        config.worker_image = args.worker_image
    if args.steps_image:
        config.steps_image = args.steps_image
    try:
        step_resources_default()  # a bad chart value stops the operator at start, not at a bij's first step
    except ValueError as e:
        print(f"bij operator: {e}", file=sys.stderr)
        return 2
    metrics = OperatorMetrics()
    if args.metrics_port:
        metrics.serve(args.metrics_port)
    kopf.configure(verbose=args.verbose)
    # The API client's debug log prints every response body: too much even for --verbose.
    logging.getLogger("kubernetes.client.rest").setLevel(logging.INFO)
    kopf.run(
        standalone=config.standalone,
        peering_name=config.peering,
        clusterwide=config.clusterwide,
        namespaces=[] if config.clusterwide else config.namespaces,
        liveness_endpoint=config.liveness,
        memo=kopf.Memo(bij=Operator(config=config, metrics=metrics)),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
