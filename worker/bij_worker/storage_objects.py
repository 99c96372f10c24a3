"""What every storage lists and raises (`bij_worker.storage` and the read-only inputs beside it, `storage_http`
and `storage_hf`, share them without importing each other): an object's place, size and version, and the
errors a storage operation ends in."""

from __future__ import annotations

from dataclasses import dataclass

from .contract.errors import BijError


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


@dataclass(frozen=True)
class ObjectInfo:
    uri: str
    size: int
    # Which version of the object this is: the ETag on s3://, the mtime in ns on file://.
    # A plan records it; reading another version of the object is refused.
    version: str | None = None
