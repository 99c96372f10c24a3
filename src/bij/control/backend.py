"""`KubeBackend`: the driver's steps for one bij as Kubernetes API calls, its Jobs read from kopf's index;
and what it reads of a Job and its pods (`job_essence`, `pods_failed`, `slow_to_start`)."""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Iterable, Mapping
from typing import Any, cast

import kopf

from bij.contract.codes import (
    LANE_OFFSET_ANNOTATION,
    NODES_PER_LANE_ANNOTATION,
    POOL_LABEL,
    PUBLISH_LABEL,
    ROUND_LABEL,
    STEP_LABEL,
)
from bij.contract.lane_report import LaneTally, tally, tally_interval
from bij.contract.spec import SpecError, parse_job
from bij.contract.spec_base import SecretKeyRef
from bij.control.access_review import check_grants
from bij.control.driver_types import Created, Observed
from bij.control.file_volume import FileVolume, file_uri_problems
from bij.control.kube_api import Api
from bij.control.observe import owns
from bij.control.permissions import GrantCheck


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
