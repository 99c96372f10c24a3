"""The few Kubernetes API calls the operator makes, through the official client, as plain dicts.

Blocking: the driver calls them from its worker thread (`handlers.drive`).
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Iterator
from typing import Any, cast

from kubernetes.client import ApiException

from bij.contract.codes import API_GROUP, JOB_LABEL, PLURAL, ROUND_LABEL, STEP_LABEL
from bij.contract.lane_report import REPORT_ANNOTATION
from bij.contract.spec import API_VERSION

# A running round's lane Leases are listed this many a request (summed every `lane_report.tally_interval`).
LEASE_PAGE = 500

log = logging.getLogger("bij.operator")


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
