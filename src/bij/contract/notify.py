"""What spec.notify's webhooks receive when a job ends: the event, the body and its signature.

Pure, and built only from the job's metadata and status (name, phase, message, row counts, the
manifest's URI), never from its rows: the operator, which reads no storage, sends it (`control.notify`),
and `bij run` sends the same bytes.

The body has the shape of OpenAI's webhook events (``{"id", "object": "event", "type": "batch.completed",
"created_at", "data": {"id"}}``, the batch id for a bij made by bij-api) so that a consumer of OpenAI's
batch webhooks understands it, and bij's own fields under ``bij``. Each POST is signed twice with the
same key: ``X-Bij-Signature: sha256=<hex HMAC-SHA256 of "<timestamp>.<body>">`` with ``X-Bij-Timestamp``,
and the Standard Webhooks headers OpenAI uses (``webhook-id``, ``webhook-timestamp``, ``webhook-signature``),
which OpenAI's SDKs verify with the secret ``whsec_<base64 of the key>``.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import hmac
import json
from collections.abc import Mapping

from bij.contract.codes import OPENAI_BATCH_LABEL
from bij.contract.spec import BatchInferenceJob
from bij.contract.status import JobStatus

# The event of each final phase (spec.notify[].events).
PHASE_EVENTS: dict[str, str] = {"Succeeded": "succeeded", "Failed": "failed", "Cancelled": "cancelled",
                                "Expired": "expired", "CanaryFailed": "canaryFailed"}
# OpenAI's batch webhook event types: a canary that failed is a failed batch.
OPENAI_TYPES: dict[str, str] = {"succeeded": "batch.completed", "failed": "batch.failed",
                                "canaryFailed": "batch.failed", "cancelled": "batch.cancelled",
                                "expired": "batch.expired"}

SIGNATURE_HEADER = "X-Bij-Signature"
TIMESTAMP_HEADER = "X-Bij-Timestamp"
DELIVERY_HEADER = "X-Bij-Delivery"
EVENT_HEADER = "X-Bij-Event"
# A receiver refuses a timestamp further than this from its clock (a replayed POST).
TOLERANCE_SECONDS = 300


def event_of(phase: str | None) -> str | None:
    """The notify event of a final phase; None for a phase that is not final."""
    return PHASE_EVENTS.get(phase or "")


def delivery_id(job: BatchInferenceJob, event: str) -> str:
    """The same for every attempt (and after an operator restart): a receiver drops a POST it has seen."""
    digest = hashlib.sha256(f"{job.metadata.namespace}/{job.metadata.name}/{job.job_id}/{event}".encode())
    return "evt_" + digest.hexdigest()[:32]


def subject_id(job: BatchInferenceJob) -> str:
    """``data.id``: the OpenAI batch id of a bij made by bij-api (``batch-<hex>`` is ``batch_<hex>``), else the
    bij's name."""
    name = job.metadata.name
    if job.metadata.labels.get(OPENAI_BATCH_LABEL) and name.startswith("batch-"):
        return "batch_" + name[len("batch-"):]
    return name


def _epoch(text: str | None) -> int | None:
    if not text:
        return None
    try:
        return int(dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp())
    except ValueError:
        return None


def body(job: BatchInferenceJob, status: JobStatus, event: str, now: dt.datetime) -> bytes:
    """The POST's body for `event` (the same bytes on every attempt once the job has ended)."""
    rows = status.rows.model_dump(by_alias=True, exclude_none=True) if status.rows is not None else {}
    failed = next((c for c in status.conditions if c.type == "Failed" and c.status == "True"), None)
    doc = {
        "id": delivery_id(job, event),
        "object": "event",
        "type": OPENAI_TYPES[event],
        "created_at": _epoch(status.completion_time) or int(now.timestamp()),
        "data": {"id": subject_id(job)},
        "bij": {
            "event": event,
            "name": job.metadata.name,
            "namespace": job.metadata.namespace,
            "uid": job.metadata.uid,
            "phase": status.phase,
            "reason": failed.reason if failed is not None and event in ("failed", "canaryFailed") else None,
            "message": status.message,
            "rows": rows,
            "manifestUri": status.manifest_uri,
            "outputUri": job.spec.output.uri,
            "completionTime": status.completion_time,
        },
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def signature(key: bytes, payload: bytes, timestamp: int) -> str:
    """``X-Bij-Signature``'s value: ``sha256=`` and the hex HMAC-SHA256 of ``<timestamp>.<body>``."""
    return "sha256=" + hmac.new(key, f"{timestamp}.".encode() + payload, hashlib.sha256).hexdigest()


def headers(key: bytes, payload: bytes, event: str, delivery: str, timestamp: int) -> dict[str, str]:
    """Every header of one POST: bij's signature and the Standard Webhooks ones (OpenAI's)."""
    standard = hmac.new(key, f"{delivery}.{timestamp}.".encode() + payload, hashlib.sha256).digest()
    return {
        "Content-Type": "application/json",
        "User-Agent": "bij-notify",
        SIGNATURE_HEADER: signature(key, payload, timestamp),
        TIMESTAMP_HEADER: str(timestamp),
        DELIVERY_HEADER: delivery,
        EVENT_HEADER: event,
        "webhook-id": delivery,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": "v1," + base64.b64encode(standard).decode(),
    }


def verify(key: bytes, payload: bytes, received: Mapping[str, str], now: float,
           tolerance: int = TOLERANCE_SECONDS) -> bool:
    """What a receiver checks (the user guide shows the same): the signature over the timestamp and the body,
    compared in constant time, and a timestamp within `tolerance` seconds of `now`."""
    lower = {k.lower(): v for k, v in received.items()}
    try:
        timestamp = int(lower.get(TIMESTAMP_HEADER.lower(), ""))
    except ValueError:
        return False
    if abs(now - timestamp) > tolerance:
        return False
    return hmac.compare_digest(signature(key, payload, timestamp), lower.get(SIGNATURE_HEADER.lower(), ""))
