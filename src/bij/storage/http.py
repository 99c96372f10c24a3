"""`https://` (and `http://`) inputs: one object per URI, read with HTTP range requests.

For data published on a web server, a CDN, or shared as a presigned / signed URL of S3 or GCS (the
query string carries the signature, so no credentials are needed here). Read-only: an output or any
write through it is refused. A URI names one object (HTTP has no listing, so no prefix or glob).

The size comes from HEAD (or, where a server does not answer HEAD, from a one-byte range GET); the
version from the ETag (a strong one) or Last-Modified. A shard opened at an offset asks for
`Range: bytes=N-` and `If-Match` / `If-Unmodified-Since` the planned version, and every response's own
validator is compared with it too (a server may ignore both headers), so an object replaced after
planning is refused (`ObjectChanged`) and its new bytes are never mixed in; a stream that breaks midway
is reopened where it stopped, at the same version.

A hostile or broken server cannot hold a shard: redirects are followed only to http(s) (never from
https:// down to http://); a response must begin within `RESPONSE_DEADLINE`; a body slower than
`MIN_BYTES_PER_SECOND` over `SPEED_WINDOW` seconds of waiting for it fails that read, which is reopened
like a broken stream (`ATTEMPTS` in a row at most).
"""

from __future__ import annotations

import http.client
import io
import socket
import threading
import time
import urllib.error
import urllib.request
from email.utils import parsedate_to_datetime
from typing import Any, BinaryIO
from urllib.parse import urlsplit

from bij.storage.objects import (
    NotFound,
    ObjectChanged,
    ObjectInfo,
    ReadOnlyInputs,
    ReopeningBody,
    StorageError,
    StorageRefused,
)

TIMEOUT = 60.0  # one socket operation (connect, one receive)
ATTEMPTS = 6
# From sending a request to its response's headers, redirects included: a server that trickles its
# headers (each byte inside TIMEOUT) is cut off here.
RESPONSE_DEADLINE = 120.0
# A body must arrive at this speed at least, measured over SPEED_WINDOW seconds spent waiting for it.
# Only time spent in reads counts: a reader that pauses (its queue full while the engine works) is not
# the server's fault. A body read for hours at a sane speed is fine, hence no total limit on it.
MIN_BYTES_PER_SECOND = 16 << 10
SPEED_WINDOW = 30.0
# Last-Modified as a version: marked so it is never sent as an ETag.
LAST_MODIFIED = "last-modified:"


def _transient(status: int) -> bool:
    return status in (408, 425, 429, 500, 502, 503, 504)


class RedirectRefused(StorageError):
    """A redirect to a scheme other than http(s), or from https:// down to http://. Permanent."""

    def __init__(self, message: str):
        super().__init__(message, permanent=True)


class TooSlow(TimeoutError):
    """A response that did not begin within its deadline, or a body below the minimum speed; an OSError,
    so a read retries it as it does a broken connection."""


def open_http(uri: str, s3: object = None) -> HttpStorage:
    """The storage of an https:// or http:// input: read-only, no settings."""
    return HttpStorage()


class HttpStorage(ReadOnlyInputs):
    """Read-only objects at http(s) URLs."""

    WHAT = "http(s) URIs"

    def __init__(self, timeout: float = TIMEOUT, attempts: int = ATTEMPTS, base_delay: float = 0.2,
                 response_deadline: float = RESPONSE_DEADLINE, min_bytes_per_second: float = MIN_BYTES_PER_SECOND,
                 speed_window: float = SPEED_WINDOW):
        self.timeout, self.attempts, self.base_delay = timeout, attempts, base_delay
        self.response_deadline = response_deadline
        self.min_bytes_per_second, self.speed_window = min_bytes_per_second, speed_window

    def _open(self, what: str, uri: str, method: str = "GET", headers: dict[str, str] | None = None) -> Any:
        for attempt in range(1, self.attempts + 1):
            request = urllib.request.Request(uri, method=method, headers={"User-Agent": "bij", **(headers or {})})
            deadline = _Deadline(self.response_deadline)
            request.deadline = deadline  # type: ignore[attr-defined]  # read by _connection, kept on redirects
            try:
                with deadline:
                    response = _OPENER.open(request, timeout=self.timeout)
                if deadline.expired:
                    # http.client takes headers cut short by the shutdown for complete ones: never use them.
                    response.close()
                    raise TooSlow()
                return response
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
                if deadline.expired:
                    reason = f"no response within {self.response_deadline:g} s"
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
            if isinstance(e, (StorageRefused, ObjectChanged, RedirectRefused)):
                raise
            # Some servers refuse HEAD (or send no length): one byte of a range GET says the size.
            try:
                with self._open("read", uri, headers={"Range": "bytes=0-0"}) as r:
                    headers = r.headers
                    end = _end(r, 0)
                    length = end if end is not None else self._count(uri, r)
            except NotFound:
                return []
        return [ObjectInfo(uri, length, _version(headers))]

    def _count(self, uri: str, response: Any) -> int:
        """The bytes of a body that says no length (a server that ignored the range), at the minimum speed."""
        body, n = _Body(response, self.min_bytes_per_second, self.speed_window), 0
        try:
            while data := body.read(1 << 20):
                n += len(data)
        except TooSlow as e:
            raise StorageError(f"read {uri}: {e}") from None
        return n

    def open_read(self, uri: str, start: int = 0, version: str | None = None) -> BinaryIO:
        return io.BufferedReader(_ResumingHttpStream(self, uri, start, version),
                                 buffer_size=1 << 20)

    def get(self, uri: str, start: int, version: str | None) -> _Body:
        """The object's bytes from `start` on, of `version` when given (`ObjectChanged` otherwise)."""
        headers: dict[str, str] = {}
        if start:
            headers["Range"] = f"bytes={start}-"
        if version and version.startswith(LAST_MODIFIED):
            headers["If-Unmodified-Since"] = version[len(LAST_MODIFIED):]
        elif version:
            headers["If-Match"] = version
        body = _Body(self._open("read", uri, headers=headers), self.min_bytes_per_second, self.speed_window)
        try:
            if version:
                check_version(uri, version, body.response.headers)
            if start and body.response.status == 206:
                first = _range_start(body.response.headers)
                if first != start:
                    raise StorageError(f"read {uri}: asked for bytes {start}- and the server answered "
                                       f"{body.response.headers.get('Content-Range')!r}", permanent=True)
            elif start:
                # The server sent the whole object: skip to where this read begins.
                skipped = 0
                while skipped < start:
                    data = body.read(min(1 << 20, start - skipped))
                    if not data:
                        break
                    skipped += len(data)
        except BaseException:
            body.close()
            raise
        return body


def check_version(uri: str, planned: str, headers: Any) -> None:
    """`ObjectChanged` unless a response's validator (ETag, or Last-Modified where the plan recorded that)
    is the planned one: a server that ignores If-Match / If-Unmodified-Since still says which version it sent."""
    if planned.startswith(LAST_MODIFIED):
        got, field = headers.get("Last-Modified"), "Last-Modified"
        same = got is not None and _same_date(got, planned[len(LAST_MODIFIED):])
        want = planned[len(LAST_MODIFIED):]
    else:
        got, field, want = headers.get("ETag"), "ETag", planned
        same = got == planned
    if not same:
        sent = f"{field} {got}" if got else f"no {field}"
        raise ObjectChanged(f"{uri} changed since it was planned: the plan read {field} {want}, this response "
                            f"carries {sent}; its bytes are not read, so rows of two versions are never mixed. "
                            "Put the planned version back, or start over: bij run --restart")


def _same_date(a: str, b: str) -> bool:
    try:
        return parsedate_to_datetime(a) == parsedate_to_datetime(b)
    except (TypeError, ValueError):
        return a == b


def _range_start(headers: Any) -> int | None:
    """The first byte a 206 response carries, from its Content-Range ("bytes 10-99/100")."""
    value = (headers.get("Content-Range") or "").strip()
    unit, _, spec = value.partition(" ")
    first = spec.partition("-")[0]
    return int(first) if unit == "bytes" and first.isdigit() else None


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


class _Deadline:
    """Shuts a request's connections down when its response has not begun within `seconds`: a socket
    timeout bounds one receive only, and a server can send a byte just before each."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.expired = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def __enter__(self) -> _Deadline:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()
        with self._lock:
            self._sockets.clear()

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)
            if not self.expired:
                return
        _shut(sock)

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            sockets = list(self._sockets)
        for sock in sockets:
            _shut(sock)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)  # a receive blocked in another thread returns at once
    except OSError:
        pass


def _connection(http_class: Any, req: urllib.request.Request) -> Any:
    """`http_class`, its connections watched by the request's deadline once connected."""
    deadline: _Deadline | None = getattr(req, "deadline", None)
    if deadline is None:
        return http_class

    def connect(host: str, **kwargs: Any) -> http.client.HTTPConnection:
        conn = http_class(host, **kwargs)
        plain_connect = conn.connect

        def watched_connect() -> None:
            plain_connect()
            deadline.watch(conn.sock)

        conn.connect = watched_connect
        return conn

    return connect


class _HTTPHandler(urllib.request.HTTPHandler):
    def do_open(self, http_class: Any, req: Any, **kwargs: Any) -> Any:
        return super().do_open(_connection(http_class, req), req, **kwargs)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def do_open(self, http_class: Any, req: Any, **kwargs: Any) -> Any:
        return super().do_open(_connection(http_class, req), req, **kwargs)


def redirect_refusal(source: str, target: str) -> str | None:
    """Why a redirect from `source` to `target` is not followed; None when it is."""
    came, goes = urlsplit(source).scheme.lower(), urlsplit(target).scheme.lower()
    if goes not in ("http", "https"):
        return "only http(s) targets are followed"
    if came == "https" and goes == "http":
        return "an https:// object is never read over plain http://"
    return None


class _Redirects(urllib.request.HTTPRedirectHandler):
    """Follows redirects to http(s) only, and never from https:// down to http:// (urllib's own handler
    follows ftp:// too, and downgrades); keeps the request's method and deadline."""

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str) -> Any:
        why = redirect_refusal(req.full_url, newurl)
        if why:
            fp.close()
            raise RedirectRefused(f"read {req.full_url}: refused its redirect (HTTP {code}) to {newurl}: {why}")
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None:
            new.method = req.get_method()  # urllib turns a redirected HEAD into a GET
            new.deadline = getattr(req, "deadline", None)  # type: ignore[attr-defined]
        return new


# Only what an http(s) input needs: no ftp://, file:// or data: handlers for a redirect to reach.
_OPENER = urllib.request.OpenerDirector()
for _handler in (urllib.request.ProxyHandler(), urllib.request.UnknownHandler(), _HTTPHandler(), _HTTPSHandler(),
                 urllib.request.HTTPDefaultErrorHandler(), _Redirects(), urllib.request.HTTPErrorProcessor()):
    _OPENER.add_handler(_handler)


class _Body:
    """A response body read at the minimum speed or failed with `TooSlow`."""

    def __init__(self, response: Any, min_bytes_per_second: float, window: float):
        self.response = response
        self.min_bytes_per_second, self.window = min_bytes_per_second, window
        self.waited = 0.0  # seconds spent in reads, in this window
        self.got = 0  # bytes they returned

    def read(self, n: int) -> bytes:
        began = time.monotonic()
        data: bytes = self.response.read1(n)  # one receive at most, so a trickle comes back to be timed
        self.waited += time.monotonic() - began
        self.got += len(data)
        if self.waited >= self.window:
            if self.got < self.min_bytes_per_second * self.waited:
                raise TooSlow(f"the body came at {self.got / self.waited:.0f} bytes/s over {self.waited:.1f} s, "
                              f"below the minimum {self.min_bytes_per_second:g} bytes/s")
            self.waited, self.got = 0.0, 0
        return data

    def close(self) -> None:
        self.response.close()


class _ResumingHttpStream(ReopeningBody):
    """A GET body that is reopened at the current offset when the connection breaks or stalls.

    A read without a planned version keeps the first response's, so a reopened stream never continues
    with another version's bytes; where the server sends none, it cannot be reopened safely and fails.
    """

    def __init__(self, storage: HttpStorage, uri: str, start: int, version: str | None):
        self.storage, self.uri, self.pos, self.version = storage, uri, start, version
        self.body: _Body | None = None
        self.end: int | None = None  # where the object ends, as the response said
        self.failures = 0
        self.opened = False
        # Failures in a row: progress resets the count only after a window's worth of bytes at the minimum
        # speed, so a trickle that returns a byte now and then still runs out of attempts.
        self.since_failure = 0

    def readinto(self, b: Any) -> int:
        while True:
            try:
                if self.body is None:
                    if self.opened and self.version is None:
                        raise StorageError(f"read {self.uri}: the stream broke at byte {self.pos} and cannot be "
                                           "reopened there: the server sends no ETag or Last-Modified, so the rest "
                                           "could be of another version")
                    self.body = self.storage.get(self.uri, self.pos, self.version)
                    self.opened = True
                    self.version = self.version or _version(self.body.response.headers)
                    self.end = _end(self.body.response, self.pos)
                data = self.body.read(len(b))
                n = len(data)
                if not n and self.end is not None and self.pos < self.end:
                    # http.client ends a body cut short with a plain EOF: never take it for the object's end.
                    raise http.client.IncompleteRead(b"", self.end - self.pos)
                b[:n] = data
                self.pos += n
                self.since_failure += n
                if self.since_failure >= self.storage.min_bytes_per_second * self.storage.speed_window:
                    self.failures = 0
                return n
            except (OSError, urllib.error.URLError, http.client.HTTPException) as e:
                self.failures += 1
                self.since_failure = 0
                if self.failures >= self.storage.attempts:
                    raise StorageError(f"read {self.uri}: stream broke {self.failures} times: {e}") from None
                self._close_body()
                time.sleep(min(10.0, self.storage.base_delay * 2 ** (self.failures - 1)))

