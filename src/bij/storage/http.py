"""`https://` (and `http://`) inputs: one object per URI, read with HTTP range requests.

For data published on a web server, a CDN, or shared as a presigned / signed URL of S3 or GCS (the
query string carries the signature, so no credentials are needed here). Read-only: an output or any
write through it is refused. A URI names one object (HTTP has no listing, so no prefix or glob).

The size comes from HEAD (or, where a server does not answer HEAD, from a one-byte range GET); the
version from the ETag (a strong one) or Last-Modified. A shard opened at an offset asks for
`Range: bytes=N-` and `If-Match` / `If-Unmodified-Since` the planned version, so an object replaced
after planning answers 412 and its new bytes are never mixed in; a stream that breaks midway is
reopened where it stopped.
"""

from __future__ import annotations

import http.client
import io
import time
import urllib.error
import urllib.request
from email.utils import parsedate_to_datetime
from typing import Any, BinaryIO

from bij.storage.objects import NotFound, ObjectChanged, ObjectInfo, ReadOnlyInputs, StorageError, StorageRefused

TIMEOUT = 60.0
ATTEMPTS = 6
# Last-Modified as a version: marked so it is never sent as an ETag.
LAST_MODIFIED = "last-modified:"


def _transient(status: int) -> bool:
    return status in (408, 425, 429, 500, 502, 503, 504)


class HttpStorage(ReadOnlyInputs):
    """Read-only objects at http(s) URLs."""

    WHAT = "http(s) URIs"

    def __init__(self, timeout: float = TIMEOUT, attempts: int = ATTEMPTS, base_delay: float = 0.2):
        self.timeout, self.attempts, self.base_delay = timeout, attempts, base_delay

    def _open(self, what: str, uri: str, method: str = "GET", headers: dict[str, str] | None = None) -> Any:
        request = urllib.request.Request(uri, method=method, headers={"User-Agent": "bij", **(headers or {})})
        for attempt in range(1, self.attempts + 1):
            try:
                return urllib.request.urlopen(request, timeout=self.timeout)  # noqa: S310 - http(s) only
            except urllib.error.HTTPError as e:
                e.close()
                if e.code == 404 or e.code == 410:
                    raise NotFound(f"{uri}: no such object (HTTP {e.code})") from None
                if e.code == 412:
                    raise ObjectChanged(f"{uri} was replaced after the job was planned (HTTP 412)") from None
                if e.code in (401, 403):
                    raise StorageRefused(f"{what} {uri}: HTTP {e.code} {e.reason} (an expired or wrong signature, "
                                         "or a URL that needs credentials)") from None
                if not _transient(e.code) or attempt == self.attempts:
                    raise StorageError(f"{what} {uri}: HTTP {e.code} {e.reason}", permanent=not _transient(e.code)) \
                        from None
            except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
                reason = getattr(e, "reason", e)
                if attempt == self.attempts:
                    raise StorageError(f"{what} {uri}: still failing after {attempt} attempts: {reason}") from None
            time.sleep(min(10.0, self.base_delay * 2 ** (attempt - 1)))
        raise AssertionError("unreachable")

    def list(self, uri: str) -> list[ObjectInfo]:
        """The one object at `uri` with its size and version; [] when there is none."""
        try:
            with self._open("read", uri, "HEAD") as r:
                size, headers = r.headers.get("Content-Length"), r.headers
            if size is None:
                raise ValueError("no Content-Length")
            length = int(size)
        except NotFound:
            return []
        except (StorageError, ValueError) as e:
            if isinstance(e, (StorageRefused, ObjectChanged)):
                raise
            # Some servers refuse HEAD (or send no length): one byte of a range GET says the size.
            try:
                with self._open("read", uri, headers={"Range": "bytes=0-0"}) as r:
                    headers = r.headers
                    total = (r.headers.get("Content-Range") or "").rpartition("/")[2]
                    length = int(total) if total.isdigit() else len(r.read())
            except NotFound:
                return []
        return [ObjectInfo(uri, length, _version(headers))]

    def open_read(self, uri: str, start: int = 0, version: str | None = None) -> BinaryIO:
        return io.BufferedReader(_ResumingHttpStream(self, uri, start, version),  # type: ignore[return-value]
                                 buffer_size=1 << 20)

    def get(self, uri: str, start: int, version: str | None) -> Any:
        headers: dict[str, str] = {}
        if start:
            headers["Range"] = f"bytes={start}-"
        if version and version.startswith(LAST_MODIFIED):
            headers["If-Unmodified-Since"] = version[len(LAST_MODIFIED):]
        elif version:
            headers["If-Match"] = version
        r = self._open("read", uri, headers=headers)
        if start and r.status != 206:
            # The server sent the whole object: skip to where this read begins.
            skipped = 0
            while skipped < start:
                data = r.read(min(1 << 20, start - skipped))
                if not data:
                    break
                skipped += len(data)
        return r


def _version(headers: Any) -> str | None:
    etag = headers.get("ETag")
    if etag and not etag.startswith("W/"):  # a weak ETag says nothing about bytes
        return str(etag)
    modified = headers.get("Last-Modified")
    if modified:
        try:
            parsedate_to_datetime(modified)
        except (TypeError, ValueError):
            return None
        return LAST_MODIFIED + modified
    return None


def _end(response: Any, pos: int) -> int | None:
    """The offset just past the object's last byte, from a response that starts at `pos`."""
    total = (response.headers.get("Content-Range") or "").rpartition("/")[2]
    if total.isdigit():
        return int(total)
    length = response.headers.get("Content-Length")
    if length is not None and length.isdigit():
        return int(length) if response.status == 200 else pos + int(length)
    return None


class _ResumingHttpStream(io.RawIOBase):
    """A GET body that is reopened at the current offset when the connection breaks."""

    def __init__(self, storage: HttpStorage, uri: str, start: int, version: str | None):
        self.storage, self.uri, self.pos, self.version = storage, uri, start, version
        self.body: Any = None
        self.end: int | None = None  # where the object ends, as the response said
        self.failures = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while True:
            try:
                if self.body is None:
                    self.body = self.storage.get(self.uri, self.pos, self.version)
                    self.end = _end(self.body, self.pos)
                data = self.body.read(len(b))
                n = len(data)
                if not n and self.end is not None and self.pos < self.end:
                    # http.client ends a body cut short with a plain EOF: never take it for the object's end.
                    raise http.client.IncompleteRead(b"", self.end - self.pos)
                b[:n] = data
                self.pos += n
                self.failures = 0
                return n
            except (OSError, urllib.error.URLError, http.client.HTTPException) as e:
                self.failures += 1
                if self.failures >= self.storage.attempts:
                    raise StorageError(f"read {self.uri}: stream broke {self.failures} times: {e}") from None
                self._close_body()
                time.sleep(min(10.0, self.storage.base_delay * 2 ** (self.failures - 1)))

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
