"""An OpenAI batch is a BatchInferenceJob: how one becomes the other (pure functions).

The bij of batch ``batch_<hex>`` is named ``batch-<hex>``, labelled `LABEL`, and keeps what the
Batch object needs that its spec does not say (endpoint, input file, window, metadata, model,
input lines) in the annotation `ANNOTATION`. Its status is read live: the phase decides the
batch's status, ``status.rows`` its request counts, the completion time its end.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from bij.api.errors import BadRequest
from bij.contract.codes import OPENAI_BATCH_LABEL
from bij.contract.manifest import Manifest
from bij.contract.spec import MAX_DEADLINE_SECONDS, NotifyTarget
from bij.contract.status import JobStatus, Rows

LABEL = OPENAI_BATCH_LABEL
ANNOTATION = "batchinference.io/openai-batch"
CANCELLING_AT = "batchinference.io/cancelling-at"
MAX_METADATA = 16
_WINDOW = re.compile(r"^([1-9][0-9]{0,6})([smhd])$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}


# OpenAI's batch webhook events, and the spec.notify events each stands for (a canary that failed is a failed
# batch); bij-api's webhooks name the OpenAI ones, as an OpenAI project's webhook endpoint does.
OPENAI_WEBHOOK_EVENTS: dict[str, tuple[str, ...]] = {
    "batch.completed": ("succeeded",), "batch.failed": ("failed", "canaryFailed"),
    "batch.cancelled": ("cancelled",), "batch.expired": ("expired",)}


def webhook_notify(doc: Any, source: str) -> list[dict[str, Any]]:
    """bij-api's webhooks (a YAML list of ``{url, secretRef: {name, key}, events: [batch.completed, ...]}``, events
    default all four) as the spec.notify every batch's bij gets; ValueError naming the entry and field."""
    if doc is None:
        return []
    if not isinstance(doc, list):
        raise ValueError(f"{source}: must be a list of webhooks {{url, secretRef: {{name, key}}, events}}")
    out = []
    for i, entry in enumerate(doc):
        if not isinstance(entry, Mapping):
            raise ValueError(f"{source}[{i}]: must be a mapping with url, secretRef and events")
        events = entry.get("events", list(OPENAI_WEBHOOK_EVENTS))
        unknown = [e for e in events if e not in OPENAI_WEBHOOK_EVENTS] if isinstance(events, list) else [events]
        if unknown or not events:
            raise ValueError(f"{source}[{i}].events: must be a non-empty list of {', '.join(OPENAI_WEBHOOK_EVENTS)}, "
                             f"got {events!r}")
        target = {**entry, "events": [n for e in OPENAI_WEBHOOK_EVENTS if e in events
                                      for n in OPENAI_WEBHOOK_EVENTS[e]]}
        try:
            NotifyTarget.model_validate(target)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            raise ValueError(f"{source}[{i}].{where}: {err['msg'].removeprefix('Value error, ')}") from None
        out.append(target)
    return out


def window_seconds(window: Any) -> int:
    """``completion_window`` ("24h", "30m", "90s", "2d") in seconds: the bij's deadlineSeconds."""
    m = _WINDOW.match(window) if isinstance(window, str) else None
    if m is None:
        raise BadRequest(f"completion_window must be a duration such as 24h, 30m or 90s, got {window!r}",
                         "completion_window")
    seconds = int(m.group(1)) * _UNIT[m.group(2)]
    if not 1 <= seconds <= MAX_DEADLINE_SECONDS:
        raise BadRequest(f"completion_window must be between 1s and {MAX_DEADLINE_SECONDS // 86400}d, got {window!r}",
                         "completion_window")
    return seconds


def check_metadata(metadata: Any) -> dict[str, str]:
    """At most 16 pairs, keys up to 64 characters, values up to 512, all strings (as OpenAI's)."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping) or len(metadata) > MAX_METADATA:
        raise BadRequest(f"metadata must be an object of at most {MAX_METADATA} string pairs", "metadata")
    for k, v in metadata.items():
        if not isinstance(k, str) or not isinstance(v, str) or len(k) > 64 or len(v) > 512:
            raise BadRequest(f"metadata: {k!r} must be a string key (<= 64 characters) with a string value "
                             "(<= 512 characters)", "metadata")
    return dict(metadata)


def bij_name(batch_id: str) -> str | None:
    """The bij of a batch id, or None when the string is no batch id of ours."""
    if not batch_id.startswith("batch_") or not batch_id[6:].isalnum() or len(batch_id) > 46:
        return None
    return "batch-" + batch_id[6:]


def output_file_id(batch_id: str, kind: str) -> str:
    """The id of a batch's output ("output") or error ("errors") file."""
    return f"file-{batch_id[6:]}-{kind}"


def batch_of_file(file_id: str) -> tuple[str, str] | None:
    """(batch id, "output" | "errors") of a batch's output or error file id, else None."""
    m = re.match(r"^file-([0-9a-f]+)-(output|errors)$", file_id)
    return (f"batch_{m.group(1)}", m.group(2)) if m else None


def _epoch(text: Any) -> int | None:
    if not text:
        return None
    try:
        return int(dt.datetime.fromisoformat(str(text).replace("Z", "+00:00")).timestamp())
    except ValueError:
        return None


def record(bij: Mapping[str, Any]) -> dict[str, Any]:
    """What the batch's annotation keeps (endpoint, input file, window, metadata, model, lines)."""
    ann = (bij.get("metadata") or {}).get("annotations") or {}
    return dict(json.loads(ann.get(ANNOTATION) or "{}"))


def status_of(bij: Mapping[str, Any]) -> str:
    """The OpenAI status of a batch, from its bij's phase."""
    st = JobStatus.read(bij.get("status"))
    phase = st.phase
    cancel = bool((bij.get("spec") or {}).get("cancel"))
    if phase == "Cancelled":
        return "cancelled"
    if phase == "Expired":
        return "expired"
    if phase == "Succeeded":
        return "completed"
    if phase in ("Failed", "CanaryFailed"):
        return "failed"
    if phase == "Publishing":
        return "finalizing"  # every row is done (a cancel asked for now changes nothing): results being written
    if cancel:
        return "cancelling"
    if phase == "Cancelling":
        return "finalizing"  # the deadline passed: the finished part is being published
    # Planning round 0 is validating, and so is a canary (spec.canary) until it passed; planning a judge round
    # after round 0 is work in progress.
    if (bij.get("spec") or {}).get("canary") is not None and (st.canary is None or st.canary.verdict != "Passed"):
        return "validating"
    if phase in ("Running", "Suspended") or (phase in ("Pending", "Planning") and st.rounds):
        return "in_progress"
    return "validating"


def usage_of(manifest: Manifest | None) -> dict[str, Any] | None:
    """OpenAI's batch ``usage`` from what the published manifest counts: prompt and completion tokens
    of the result rows, the prompt tokens the engine's prefix cache served, and the reasoning tokens
    the result rows' usage names. None before there is a manifest."""
    if manifest is None:
        return None
    counts = manifest.counts
    cached = manifest.engine.cached_tokens if manifest.engine is not None else 0
    return {"input_tokens": counts.tokens_in,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": counts.tokens_out,
            "output_tokens_details": {"reasoning_tokens": counts.reasoning_tokens},
            "total_tokens": counts.tokens_in + counts.tokens_out}


def batch_object(bij: Mapping[str, Any], manifest: Manifest | None = None) -> dict[str, Any]:
    """The OpenAI Batch object of a bij made by `bij-api`; `manifest`, once published, gives its usage."""
    rec = record(bij)
    meta = bij.get("metadata") or {}
    st = JobStatus.read(bij.get("status"))
    status = status_of(bij)
    batch_id = rec["id"]
    created = _epoch(meta.get("creationTimestamp")) or 0
    expires = created + window_seconds(rec["completion_window"])
    ended = _epoch(st.completion_time)
    rows = st.rows or Rows()
    # A stopped batch's requests never run are failed ones, each with its line in the error file.
    done, failed = rows.done, rows.failed + (rows.not_run or 0)
    final = status in ("completed", "cancelled", "expired")
    # Finalizing began when publishing did; an expired batch's, at its deadline (it stops, then publishes).
    finalizing = _epoch(st.publish.started_at if st.publish is not None else None)
    if status == "expired" or (status == "finalizing" and st.phase == "Cancelling"):
        finalizing = expires
    obj: dict[str, Any] = {
        "id": batch_id, "object": "batch", "endpoint": rec["endpoint"], "model": rec.get("model"),
        "errors": None, "input_file_id": rec["input_file_id"], "completion_window": rec["completion_window"],
        "status": status,
        "output_file_id": output_file_id(batch_id, "output") if final and done else None,
        "error_file_id": output_file_id(batch_id, "errors") if final and failed else None,
        "created_at": created,
        "in_progress_at": _epoch(st.start_time) if status != "validating" else None,
        "expires_at": expires,
        "finalizing_at": finalizing if status in ("finalizing", "completed", "expired") else None,
        "completed_at": ended if status == "completed" else None,
        "failed_at": ended if status == "failed" else None,
        "expired_at": ended if status == "expired" else None,
        "cancelling_at": _epoch((meta.get("annotations") or {}).get(CANCELLING_AT)),
        "cancelled_at": ended if status == "cancelled" else None,
        "request_counts": {"total": int(rec.get("lines") or 0), "completed": done, "failed": failed},
        "metadata": rec.get("metadata") or None,
        "usage": usage_of(manifest) if final else None,
    }
    if status == "failed":
        reason = next((c.reason for c in st.conditions if c.type == "Failed" and c.status == "True"), None)
        obj["errors"] = {"object": "list", "data": [{"code": reason or "failed", "message": st.message,
                                                      "param": None, "line": None}]}
    return obj
