"""Every failure of `bij-api` in OpenAI's error shape, with the status the `openai` SDK maps to its
exception classes: ``{"error": {"message", "type", "param", "code"}}``.

An `ApiError` is a refusal the server means (a bad field, no such batch). `classify` turns what
else escapes a handler into one: a storage or Kubernetes API outage is a 503 the SDK retries, an
object gone from storage a 404, the API server refusing the bij a batch would become a 400 with
its own message; anything else is a bug, a 500. Pure: no aiohttp, so `batches` can raise these.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from pydantic import ValidationError

from bij.contract.errors import NotFound, StorageError, StorageRefused

# What the `openai` SDK obeys over its own retry rule (it retries 409, 429 and 5xx by default).
NO_RETRY = {"x-should-retry": "false"}
RETRY_AFTER_SECONDS = 5


class ApiError(Exception):
    """A failure the server answers with `status` and OpenAI's error object."""

    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.param = param
        if code is not None:
            self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


class BadRequest(ApiError, ValueError):
    """A request the API refuses (HTTP 400); `param` names the field."""

    status, type = 400, "invalid_request_error"


class Unauthenticated(ApiError):
    """No token, or one the API server does not accept (HTTP 401)."""

    status, type, code = 401, "invalid_request_error", "invalid_api_key"


class Forbidden(ApiError):
    """A valid token whose identity may not create batchinferencejobs in its namespace (HTTP 403)."""

    status, type, code = 403, "permission_error", "forbidden"


class NotFoundError(ApiError):
    """No such batch, file, model or route in the caller's namespace (HTTP 404)."""

    status, type, code = 404, "invalid_request_error", "not_found"


class MethodNotAllowed(ApiError):
    """A route that exists, asked with a method it does not take (HTTP 405)."""

    status, type, code = 405, "invalid_request_error", "method_not_allowed"


class Conflict(ApiError):
    """The batch is in a state that refuses the request (HTTP 409); asking again changes nothing, so
    the SDK is told not to retry."""

    status, type, code = 409, "invalid_request_error", "conflict"

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message, param, code, headers=NO_RETRY)


class TooLarge(ApiError):
    """A request body over the server's limit (HTTP 413)."""

    status, type, code = 413, "invalid_request_error", "request_too_large"


class RateLimited(ApiError):
    """The Kubernetes API server throttles `bij-api` (HTTP 429, retried by the SDK)."""

    status, type, code = 429, "rate_limit_error", "rate_limit_exceeded"


class Unavailable(ApiError):
    """Storage or the Kubernetes API cannot serve the request now (HTTP 503, retried by the SDK);
    `retry=False` when no retry can help until an operator fixes the server's own access."""

    status, type, code = 503, "service_unavailable_error", "service_unavailable"

    def __init__(self, message: str, code: str | None = None, retry: bool = True):
        super().__init__(message, None, code,
                         headers={"Retry-After": str(RETRY_AFTER_SECONDS)} if retry else NO_RETRY)


class ServerError(ApiError):
    """A bug (HTTP 500): the cause is in the server's log, never in the answer."""


def from_validation(e: ValidationError, what: str, fields: Iterable[str] = ()) -> BadRequest:
    """A request model's first problem as a 400 naming its field: OpenAI's codes for a missing, unknown
    or invalid parameter; a validator's own message as it wrote it. `fields`: what an unknown field's
    message lists as taken instead."""
    problem = e.errors()[0]
    param = ".".join(str(p) for p in problem["loc"]) or None
    kind = problem["type"]
    if kind == "missing":
        return BadRequest(f"{what}: {param} is missing", param, "missing_required_parameter")
    if kind == "extra_forbidden":
        takes = f": it takes {', '.join(fields)}" if fields else ""
        return BadRequest(f"{what}: unknown field {param}{takes}", param, "unknown_parameter")
    if kind == "value_error":
        err = (problem.get("ctx") or {}).get("error")
        return BadRequest(str(err) if err is not None else problem["msg"], param, "invalid_value")
    return BadRequest(f"{what}: {param}: {problem['msg']}, got {problem.get('input')!r}", param, "invalid_value")


def classify(e: Exception) -> ApiError | None:
    """The answer to a storage or Kubernetes failure that escaped a handler; None for anything else
    (a bug)."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, NotFound):
        return NotFoundError(f"gone from storage: {e}")
    if isinstance(e, StorageRefused):
        return Unavailable(f"storage refused bij-api: {e}", "storage_refused", retry=False)
    if isinstance(e, StorageError):
        return Unavailable(f"storage is unavailable: {e}", "storage_unavailable", retry=not e.permanent)
    return _kube(e)


def _kube(e: Exception) -> ApiError | None:
    from kubernetes.client import ApiException
    from urllib3.exceptions import HTTPError

    if isinstance(e, HTTPError):  # no answer at all: refused, reset, timed out
        return Unavailable(f"the Kubernetes API server cannot be reached: {e}", "kubernetes_unavailable")
    if not isinstance(e, ApiException):
        return None
    status = e.status or 0
    message = kube_message(e)
    if status == 404:
        return NotFoundError(message)
    if status == 409:
        return Conflict(message)
    if status == 429:
        after = (e.headers or {}).get("Retry-After") if e.headers else None
        return RateLimited(message, headers={"Retry-After": str(after or RETRY_AFTER_SECONDS)})
    if status in (401, 403):  # bij-api's own ServiceAccount or its RBAC: the chart's to fix, not the caller's
        return Unavailable(f"the Kubernetes API server refused bij-api: {message}", "kubernetes_refused",
                           retry=False)
    if 400 <= status < 500:
        return BadRequest(message, None, "invalid_request")
    return Unavailable(f"the Kubernetes API server is unavailable: {message}", "kubernetes_unavailable")


def kube_message(e: Any) -> str:
    """What the API server said (its Status object's message), else the reason and status."""
    try:
        status = json.loads(e.body)
    except (TypeError, ValueError):
        status = None
    if isinstance(status, dict) and status.get("message"):
        return str(status["message"])
    return f"{e.status} {e.reason}"
