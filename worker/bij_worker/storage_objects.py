"""What every storage lists and raises (`bij_worker.storage` and the read-only inputs beside it, `storage_http`
and `storage_hf`, share them without importing each other): an object's place, size and version, and the
errors a storage operation ends in."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import BinaryIO

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


class ReadOnlyInputs:
    """What an input-only storage (https://, hf://) answers beyond `list` and `open_read`: whole reads, and a
    refusal naming the URI and `WHAT` for every write."""

    supports_append = False
    WHAT = "these URIs"

    def list(self, uri: str) -> list[ObjectInfo]:
        raise NotImplementedError

    def open_read(self, uri: str, start: int = 0, version: str | None = None) -> BinaryIO:
        raise NotImplementedError

    def read_bytes(self, uri: str) -> bytes:
        with self.open_read(uri) as f:
            return f.read()

    def exists(self, uri: str) -> bool:
        return bool(self.list(uri))

    def _read_only(self, uri: str) -> StorageError:
        return StorageRefused(f"{uri}: {self.WHAT} are read-only (inputs only); write to file:// or s3://")

    def write_bytes(self, uri: str, data: bytes) -> None:
        raise self._read_only(uri)

    def create(self, uri: str, data: bytes) -> bool:
        raise self._read_only(uri)

    def write_stream(self, uri: str, parts: Iterable[bytes]) -> int:
        raise self._read_only(uri)

    def delete(self, uri: str) -> None:
        raise self._read_only(uri)

    def append_durable(self, uri: str, data: bytes) -> None:
        raise self._read_only(uri)

    def remove_stale_temp(self, uri: str, older_than_s: float) -> int:
        return 0  # nothing is written here, so no temp file is left
