"""What every storage lists and raises (`bij.storage` and the read-only inputs beside it, `storage_http`
and `storage_hf`, share them without importing each other): an object's place, size and version, and the
errors a storage operation ends in."""

from __future__ import annotations

import io
import random
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO, TypeVar

# The errors live in the contract, so that a record's decoder can raise one without importing storage.
from bij.contract.errors import NotFound, ObjectChanged, StorageError, StorageRefused

T = TypeVar("T")

__all__ = [
    "NotFound", "ObjectChanged", "ObjectInfo", "ObjectPage", "ReadOnlyInputs", "StorageError", "StorageRefused",
    "retrying",
]


@dataclass(frozen=True)
class ObjectInfo:
    uri: str
    size: int
    # Which version of the object this is: the ETag on s3://, the mtime in ns on file://.
    # A plan records it; reading another version of the object is refused.
    version: str | None = None


# One page of a streamed listing (`Storage.list_pages`): at most `bij.storage.base.PAGE` objects.
ObjectPage = list[ObjectInfo]


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

    def read_range(self, uri: str, start: int, length: int) -> bytes:
        with self.open_read(uri, start) as f:
            return f.read(length)

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

    def list_pages(self, uri: str) -> Iterator[ObjectPage]:
        yield self.list(uri)

    def delete_many(self, uris: Iterable[str]) -> dict[str, str]:
        for uri in uris:
            raise self._read_only(uri)
        return {}

    def append_durable(self, uri: str, data: bytes) -> None:
        raise self._read_only(uri)

    def remove_stale_temp(self, uri: str, older_than_s: float) -> int:
        return 0  # nothing is written here, so no temp file is left


class ReopeningBody(io.RawIOBase):
    """What a GET body that is reopened at its offset after a break holds: the open response body
    (`body`, None between opens) and how closing it lets go of a broken one."""

    body: Any = None

    def readable(self) -> bool:
        return True

    def _close_body(self) -> None:
        if self.body is not None:
            try:
                self.body.close()
            except Exception:  # noqa: BLE001 - closing a broken stream
                pass
            self.body = None

    def close(self) -> None:
        self._close_body()
        super().close()


def retrying(what: str, uri: str, fn: Callable[[], T], *, catch: tuple[type[BaseException], ...],
             fatal: Callable[[BaseException], StorageError | None], attempts: int, base_delay: float,
             describe: Callable[[BaseException], str] = str) -> T:
    """`fn()`, retried while it fails in a way that can pass. `fatal(e)` says what an error in `catch` ends
    in now (NotFound, ObjectChanged, a refusal, a permanent StorageError), or None when it may pass: then it
    is tried again after an exponential backoff with jitter (at most 10 s), and the last of `attempts` ends
    in a StorageError naming the operation, the URI, the attempts and `describe(e)`."""
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except catch as e:  # classified by `fatal`
            now = fatal(e)
            if now is not None:
                raise now from None
            if attempt == attempts:
                raise StorageError(f"{what} {uri}: still failing after {attempt} attempts: {describe(e)}") from None
        time.sleep(min(10.0, base_delay * 2 ** (attempt - 1)) * (0.5 + random.random()))
    raise AssertionError("unreachable")
