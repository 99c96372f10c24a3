"""The base of the errors bij raises on purpose.

A `BijError` is an expected failure with a message for the user: a bad spec, an input that
cannot be planned, storage that failed after its retries. Anything else (a KeyError, a
TypeError) is a bug and must not be caught as "try again later". `permanent` says whether a
retry can help: a permanent error is the same on every retry (the worker exits 42, `bij run`
stops at once).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError


class BijError(Exception):
    """An expected failure; `permanent`: no retry can help."""

    permanent: bool = False

    def __init__(self, message: str = "", *, permanent: bool | None = None):
        super().__init__(message)
        if permanent is not None:
            self.permanent = permanent


class StorageError(BijError):
    """A storage operation that failed for good (after retries, or not worth retrying).

    `permanent`: no retry can help (a missing bucket, denied access, no credentials, a bad
    endpoint): the worker exits 42 and `bij run` stops at once. Otherwise (an outage that
    outlasted the retries, a full disk) a later retry may succeed.
    """

    def __init__(self, message: str, permanent: bool = False):
        super().__init__(message, permanent=permanent)


class NotFound(StorageError):
    """The object does not exist."""

    def __init__(self, message: str):
        super().__init__(message, permanent=True)


class StorageRefused(StorageError):
    """The store refused this identity: access denied, no such bucket, unknown or wrong credentials, none
    at all. Permanent; the message names the URI and the access key id asked with (never the secret).
    A job fails on it (no retry helps until the bucket, the grants or the credentials change)."""

    def __init__(self, message: str):
        super().__init__(message, permanent=True)


class ObjectChanged(StorageError):
    """The object is not the version that was planned (its ETag or mtime differs)."""

    def __init__(self, message: str):
        super().__init__(message, permanent=True)


def json_object(data: bytes, source: str, error: type[BijError]) -> dict[str, Any]:
    """`data` as one JSON object; `error`, naming `source`, when it is not one."""
    try:
        doc = json.loads(data)
    except ValueError as e:
        raise error(f"{source} is not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise error(f"{source} is not a JSON object")
    return doc


def validation_problems(e: ValidationError, most: int = 5) -> str:
    """A pydantic validation error as "field.path: message; ..." (the first `most`)."""
    return "; ".join(f"{'.'.join(map(str, p['loc']))}: {p['msg']}" for p in e.errors()[:most])
