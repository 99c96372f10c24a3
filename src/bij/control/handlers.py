"""The kopf handlers of `bij operator`: they translate between the Kubernetes API and `driver.Driver`.

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

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any, cast

import kopf
import urllib3
from kubernetes.client import ApiException

from bij.contract.codes import API_GROUP, JOB_LABEL, PLURAL
from bij.contract.spec import API_VERSION
from bij.control.backend import KubeBackend, job_essence
from bij.control.driver import Driver
from bij.control.kube_api import Api
from bij.control.operator_config import OperatorConfig
from bij.control.operator_metrics import OperatorMetrics

# A waiting daemon wakes when one of its bij's Jobs changes; it looks for spec edits (and whether it
# is to stop) this often, in memory, without an API call.
SPEC_POLL = 1.0
# How long a woken daemon lets kopf finish indexing the Job it was woken for.
INDEX_SETTLE = 0.02


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
