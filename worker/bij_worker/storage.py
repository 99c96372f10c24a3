"""One storage interface for `file://` and `s3://`.

Everything bij reads or writes goes through `Storage`: listing with sizes,
ranged streaming reads, atomic whole-object writes, and (file:// only) durable
appends. S3 errors that can pass (throttling, 5xx, dropped connections) are
retried with exponential backoff, a broken read stream resumes from the byte it
reached; anything else stops with a `StorageError` that names the URI.
"""

from __future__ import annotations

import functools
import io
import os
import random
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol, TypeVar

T = TypeVar("T")


class StorageError(RuntimeError):
    """A storage operation that failed for good (after retries, or not worth retrying)."""


class NotFound(StorageError):
    """The object does not exist."""


@dataclass(frozen=True)
class ObjectInfo:
    uri: str
    size: int


class Storage(Protocol):
    # file:// can append to an object in place (with fsync); s3:// cannot, so
    # durable logs there are written as immutable segment objects instead.
    supports_append: bool

    def list(self, uri: str) -> list[ObjectInfo]:
        """Objects at `uri` (one object) or under it (a prefix), sorted by URI."""
        ...

    def open_read(self, uri: str, start: int = 0) -> BinaryIO:
        """A stream of the object's bytes from `start` to its end."""
        ...

    def read_bytes(self, uri: str) -> bytes: ...

    def write_bytes(self, uri: str, data: bytes) -> None:
        """Write a whole object atomically: readers see the old object, or the new one, never a part."""
        ...

    def exists(self, uri: str) -> bool: ...

    def delete(self, uri: str) -> None: ...

    def append_durable(self, uri: str, data: bytes) -> None:
        """Append and fsync (file:// only)."""
        ...

    def truncate(self, uri: str, size: int) -> None:
        """Cut an object to `size` bytes (file:// only: a torn last line after a crash)."""
        ...


def open_storage(uri: str, s3: Any = None) -> Storage:
    """The storage for a URI's scheme. `s3` is spec.storage.s3 (object or dict) or None."""
    if uri.startswith("file://"):
        return FileStorage()
    if uri.startswith("s3://"):
        if s3 is None:
            endpoint, region = None, None
        elif isinstance(s3, dict):
            endpoint, region = s3.get("endpointUrl"), s3.get("region")
        else:
            endpoint, region = s3.endpoint_url, s3.region
        # Keyed by what the client will use, so "from the environment" and the same value given
        # in the spec share one client.
        endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL") or None
        region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or None
        return _shared_s3(endpoint, region)
    raise StorageError(f"unsupported URI {uri!r}: use file:// or s3://")


@functools.lru_cache(maxsize=16)
def _shared_s3(endpoint: str | None, region: str | None) -> S3Storage:
    # A boto3 client costs about half a CPU second to build and is thread-safe: one per endpoint.
    return S3Storage(endpoint_url=endpoint, region=region)


def _local_path(uri: str) -> Path:
    if not uri.startswith("file://"):
        raise StorageError(f"not a file:// URI: {uri!r}")
    return Path(uri[len("file://") :])


class FileStorage:
    """Local files. Atomic writes are write-temp + fsync + rename; appends are fsynced."""

    supports_append = True

    def list(self, uri: str) -> list[ObjectInfo]:
        p = _local_path(uri)
        if p.is_file():
            return [ObjectInfo(uri, p.stat().st_size)]
        if not p.is_dir():
            return []
        out = []
        for root, dirs, files in os.walk(p):
            dirs.sort()
            for f in files:
                fp = Path(root) / f
                out.append(ObjectInfo("file://" + str(fp), fp.stat().st_size))
        out.sort(key=lambda o: o.uri)
        return out

    def open_read(self, uri: str, start: int = 0) -> BinaryIO:
        try:
            f = open(_local_path(uri), "rb", buffering=1 << 20)  # noqa: SIM115 - caller closes
        except FileNotFoundError:
            raise NotFound(f"{uri}: no such file") from None
        except OSError as e:
            raise StorageError(f"{uri}: cannot open: {e.strerror}") from None
        if start:
            f.seek(start)
        return f

    def read_bytes(self, uri: str) -> bytes:
        with self.open_read(uri) as f:
            return f.read()

    def write_bytes(self, uri: str, data: bytes) -> None:
        p = _local_path(uri)
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, p)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        _fsync_dir(p.parent)

    def exists(self, uri: str) -> bool:
        return _local_path(uri).is_file()

    def delete(self, uri: str) -> None:
        try:
            _local_path(uri).unlink()
        except FileNotFoundError:
            pass

    def append_durable(self, uri: str, data: bytes) -> None:
        p = _local_path(uri)
        new = not p.exists()
        if new:
            p.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(p, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
        if new:
            _fsync_dir(p.parent)

    def truncate(self, uri: str, size: int) -> None:
        p = _local_path(uri)
        with open(p, "r+b") as f:
            f.truncate(size)
            f.flush()
            os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    # A rename or a new file is durable only once its directory entry is.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def split_s3(uri: str) -> tuple[str, str]:
    """`s3://bucket/key` → (bucket, key)."""
    rest = uri[len("s3://") :]
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise StorageError(f"{uri!r} has no bucket")
    return bucket, key


# Error codes that mean "this will not get better by waiting".
_PERMANENT_CODES = {
    "NoSuchBucket", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
    "AllAccessDisabled", "InvalidBucketName", "InvalidObjectState", "NoSuchKey", "404", "403",
    "InvalidRange", "416", "MethodNotAllowed", "ExpiredToken", "InvalidToken",
}


def _is_transient(exc: BaseException) -> bool:
    from botocore.exceptions import (
        ClientError,
        ConnectionClosedError,
        ConnectTimeoutError,
        EndpointConnectionError,
        IncompleteReadError,
        ReadTimeoutError,
        ResponseStreamingError,
    )

    if isinstance(
        exc,
        (EndpointConnectionError, ConnectionClosedError, ReadTimeoutError, ConnectTimeoutError,
         IncompleteReadError, ResponseStreamingError, ConnectionError, TimeoutError),
    ):
        return True
    if isinstance(exc, ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0
        if code in _PERMANENT_CODES:
            return False
        return status >= 500 or status == 429 or code in {
            "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
            "InternalError", "ServiceUnavailable",
        }
    return False


def _describe(exc: BaseException) -> str:
    from botocore.exceptions import ClientError

    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        return f"{err.get('Code', '?')}: {err.get('Message', '') or exc}"
    return f"{type(exc).__name__}: {exc}"


class S3Storage:
    """S3 and S3-compatible stores (MinIO, moto) through boto3; credentials: the standard AWS chain."""

    supports_append = False

    def __init__(
        self,
        endpoint_url: str | None = None,
        region: str | None = None,
        max_attempts: int = 8,
        base_delay: float = 0.2,
        client: Any = None,
    ):
        self.max_attempts = max_attempts
        self.base_delay = base_delay
        if client is None:
            import boto3
            from botocore.config import Config

            # botocore retries too; ours wraps whole operations (streams included)
            # and gives a message that names the URI when it gives up.
            cfg = Config(retries={"max_attempts": 3, "mode": "standard"}, connect_timeout=10, read_timeout=60)
            client = boto3.session.Session().client(
                "s3",
                endpoint_url=endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or None,
                region_name=region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
                or "us-east-1",
                config=cfg,
            )
        self.client = client

    def _call(self, what: str, uri: str, fn: Callable[[], T]) -> T:
        from botocore.exceptions import ClientError

        for attempt in range(1, self.max_attempts + 1):
            try:
                return fn()
            except Exception as e:  # noqa: BLE001 - classified below
                if isinstance(e, ClientError):
                    code = str(e.response.get("Error", {}).get("Code", ""))
                    if code in {"NoSuchKey", "404", "NotFound"}:
                        raise NotFound(f"{uri}: no such object") from None
                if not _is_transient(e):
                    raise StorageError(f"{what} {uri}: {_describe(e)}") from None
                if attempt == self.max_attempts:
                    raise StorageError(f"{what} {uri}: still failing after {attempt} attempts: {_describe(e)}") \
                        from None
                time.sleep(min(10.0, self.base_delay * 2 ** (attempt - 1)) * (0.5 + random.random()))
        raise AssertionError("unreachable")

    def list(self, uri: str) -> list[ObjectInfo]:
        bucket, key = split_s3(uri)
        out: list[ObjectInfo] = []
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": key}
            if token:
                kwargs["ContinuationToken"] = token
            page = self._call("list", uri, lambda kw=kwargs: self.client.list_objects_v2(**kw))  # type: ignore[misc]
            for obj in page.get("Contents", []):
                k = obj["Key"]
                # A prefix without a trailing slash must not match "docs-old/" for "docs".
                if key and not key.endswith("/") and k != key and not k.startswith(key + "/"):
                    continue
                if k.endswith("/"):
                    continue
                out.append(ObjectInfo(f"s3://{bucket}/{k}", int(obj["Size"])))
            if not page.get("IsTruncated"):
                break
            token = page.get("NextContinuationToken")
        out.sort(key=lambda o: o.uri)
        return out

    def _get(self, uri: str, start: int) -> Any:
        bucket, key = split_s3(uri)
        kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key}
        if start:
            kwargs["Range"] = f"bytes={start}-"
        return self._call("read", uri, lambda: self.client.get_object(**kwargs)["Body"])

    def open_read(self, uri: str, start: int = 0) -> BinaryIO:
        return io.BufferedReader(_ResumingS3Stream(self, uri, start), buffer_size=1 << 20)  # type: ignore[return-value]

    def read_bytes(self, uri: str) -> bytes:
        with self.open_read(uri) as f:
            return f.read()

    def write_bytes(self, uri: str, data: bytes) -> None:
        bucket, key = split_s3(uri)
        # One PUT: S3 makes the object visible whole or not at all.
        self._call("write", uri, lambda: self.client.put_object(Bucket=bucket, Key=key, Body=data))

    def exists(self, uri: str) -> bool:
        bucket, key = split_s3(uri)
        try:
            self._call("stat", uri, lambda: self.client.head_object(Bucket=bucket, Key=key))
            return True
        except NotFound:
            return False

    def delete(self, uri: str) -> None:
        bucket, key = split_s3(uri)
        self._call("delete", uri, lambda: self.client.delete_object(Bucket=bucket, Key=key))

    def append_durable(self, uri: str, data: bytes) -> None:
        raise StorageError("s3:// objects are immutable: write segments instead of appending")

    def truncate(self, uri: str, size: int) -> None:
        raise StorageError("s3:// objects are immutable: cannot truncate")


class _ResumingS3Stream(io.RawIOBase):
    """A GET body that re-opens at the current offset when the connection breaks."""

    def __init__(self, storage: S3Storage, uri: str, start: int):
        self.storage, self.uri, self.pos = storage, uri, start
        self.body: Any = None
        self.failures = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while True:
            try:
                if self.body is None:
                    self.body = self.storage._get(self.uri, self.pos)
                data = self.body.read(len(b))
                n = len(data)
                b[:n] = data
                self.pos += n
                self.failures = 0
                return n
            except StorageError:
                raise
            except Exception as e:  # noqa: BLE001
                if not _is_transient(e):
                    raise StorageError(f"read {self.uri}: {_describe(e)}") from None
                self.failures += 1
                if self.failures >= self.storage.max_attempts:
                    raise StorageError(f"read {self.uri}: stream broke {self.failures} times: {_describe(e)}") \
                        from None
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


def iter_lines(stream: BinaryIO, base_offset: int, block: int = 1 << 20) -> Iterator[tuple[int, bytes]]:
    """Yield (offset of the line's first byte, line without its newline) from a byte stream.

    A last line without a trailing newline is yielded too.
    """
    buf = b""
    pos = base_offset  # offset of buf[0]
    while True:
        data = stream.read(block)
        if not data:
            break
        buf = buf + data if buf else data
        # One split per block (C), not one find and slice per line.
        lines = buf.split(b"\n")
        buf = lines.pop()  # the part after the last newline: the start of a line still to come
        for line in lines:
            yield pos, line
            pos += len(line) + 1
    if buf:
        yield pos, buf
