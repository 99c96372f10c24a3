"""One storage interface for `file://`, `s3://` and `gs://`.

Everything bij reads or writes goes through `Storage`: listing with sizes,
ranged streaming reads, atomic whole-object writes, and (file:// only) durable
appends. `gs://` is Google Cloud Storage through its S3-compatible XML API (HMAC keys,
the same client as `s3://`; see `GCS_ENDPOINT`). S3 errors that can pass (throttling, 5xx, dropped connections) are
retried with exponential backoff, a broken read stream resumes from the byte it
reached; anything else stops with a `StorageError` that names the URI.
"""

from __future__ import annotations

import errno
import functools
import io
import os
import random
import re
import secrets
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO, Protocol, TypeVar

from bij.storage.objects import (
    NotFound,
    ObjectChanged,
    ObjectInfo,
    ObjectPage,
    ReopeningBody,
    StorageError,
    StorageRefused,
)

T = TypeVar("T")


MULTIPART_BYTES = 8 << 20  # the S3 part size of `write_stream` (S3 needs at least 5 MiB but for the last)
# Objects in one page of `list_pages` and one request of `delete_many` (S3's ListObjectsV2 and
# DeleteObjects take at most 1,000).
PAGE = 1000


class Storage(Protocol):
    # file:// can append to an object in place (with fsync); s3:// cannot, so
    # durable logs there are written as immutable segment objects instead.
    supports_append: bool

    def list(self, uri: str) -> list[ObjectInfo]:
        """Objects at `uri` (one object) or under it (a prefix), sorted by URI."""
        ...

    def list_pages(self, uri: str) -> Iterator[ObjectPage]:
        """Objects under `uri` as `list` finds them, a page of at most `PAGE` at a time, in no set order:
        memory holds one page however many there are (for what walks millions of objects)."""
        ...

    def delete_many(self, uris: Iterable[str]) -> dict[str, str]:
        """Delete objects, `PAGE` to a request where the store takes batches; one missing is no error.
        Returns what could not be deleted: URI -> why (a request that fails whole raises `StorageError`)."""
        ...

    def open_read(self, uri: str, start: int = 0, version: str | None = None) -> BinaryIO:
        """A stream of the object's bytes from `start` to its end; with `version`, only of that
        version of the object (`ObjectChanged` otherwise)."""
        ...

    def read_bytes(self, uri: str) -> bytes: ...

    def read_range(self, uri: str, start: int, length: int) -> bytes:
        """`length` bytes of the object from `start` (fewer where it ends sooner), in one request: a
        slice of a large object read without the rest (S3 and GCS: a GET with a Range header)."""
        ...

    def write_bytes(self, uri: str, data: bytes) -> None:
        """Write a whole object atomically: readers see the old object, or the new one, never a part."""
        ...

    def create(self, uri: str, data: bytes) -> bool:
        """Write a whole object only if none exists there; False (and nothing written) if one does."""
        ...

    def write_stream(self, uri: str, parts: Iterable[bytes]) -> int:
        """Write a whole object from `parts` as they come, holding one part (or one S3 part of
        `MULTIPART_BYTES`) at a time, atomically as `write_bytes`. Returns its size."""
        ...

    def exists(self, uri: str) -> bool: ...

    def delete(self, uri: str) -> None: ...

    def append_durable(self, uri: str, data: bytes) -> None:
        """Append and fsync (file:// only)."""
        ...

    def remove_stale_temp(self, uri: str, older_than_s: float) -> int:
        """Delete temp files of atomic writes killed midway under `uri` (file:// only); returns how many."""
        ...


def open_storage(uri: str, s3: Any) -> Storage:
    """The storage for a URI's scheme, with the S3 settings of the job it belongs to.

    `s3` is the job's spec.storage.s3 (the spec's object, or its camelCase dict as a publish plan
    carries it): every caller says whose settings it uses. None only where no spec can be known yet
    and the standard AWS environment is the setting: a worker reading its plan (the Job sets
    AWS_ENDPOINT_URL and AWS_REGION from the spec), or a bare URI given on the command line.
    What the spec sets wins over the environment.
    """
    if uri.startswith("file://"):
        if len(uri) == len("file://"):
            raise StorageError(f"{uri!r} has no path: use file:///absolute/path or file://relative/path",
                               permanent=True)
        return FileStorage()
    if uri.startswith("s3://"):
        split_s3(uri)
        if s3 is None:
            endpoint, region = None, None
        elif isinstance(s3, dict):
            endpoint, region = s3.get("endpointUrl"), s3.get("region")
        else:
            endpoint, region = s3.endpoint_url, s3.region
        # Keyed by what the client will use, so "from the environment" and the same value given
        # in the spec share one client; and by the credentials in the environment, which the
        # client reads once (a process that changes them gets a client that signs with the new).
        endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL") or None
        region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or None
        return _shared_s3(endpoint, region, tuple(os.environ.get(k) for k in _CREDENTIAL_VARIABLES))
    if uri.startswith("gs://"):
        split_s3(uri)
        # GCS has one endpoint of its own: spec.storage.s3 (another S3 store) never applies to it.
        endpoint = os.environ.get("BIJ_GCS_ENDPOINT_URL") or GCS_ENDPOINT
        region = os.environ.get("BIJ_GCS_REGION") or "auto"
        return _shared_gcs(endpoint, region, tuple(os.environ.get(k) for k in _CREDENTIAL_VARIABLES))
    if uri.startswith(("https://", "http://")):
        from bij.storage.http import HttpStorage

        return HttpStorage()
    if uri.startswith("hf://"):
        from bij.storage.hf import HfStorage

        return HfStorage()
    raise StorageError(f"unsupported URI {uri!r}: use file://, s3:// or gs:// (or https:// or hf:// for an input)",
                       permanent=True)


_CREDENTIAL_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE")


@functools.lru_cache(maxsize=16)
def _shared_s3(endpoint: str | None, region: str | None, credentials: tuple[str | None, ...]) -> S3Storage:
    # A boto3 client costs about half a CPU second to build and is thread-safe: one per endpoint.
    try:
        return S3Storage(endpoint_url=endpoint, region=region)
    except ValueError as e:  # botocore: "Invalid endpoint: ..."
        raise StorageError(f"spec.storage.s3.endpointUrl (or AWS_ENDPOINT_URL) {endpoint!r} is not a usable "
                           f"endpoint ({e}): give a URL such as https://s3.example.com:9000", permanent=True) from None


# Google Cloud Storage's XML API, which speaks S3 to an HMAC key (Cloud Storage > Settings > Interoperability).
# It signs V4 with the region "auto" (BIJ_GCS_REGION: another, for an endpoint that checks it).
GCS_ENDPOINT = "https://storage.googleapis.com"


@functools.lru_cache(maxsize=4)
def _shared_gcs(endpoint: str, region: str, credentials: tuple[str | None, ...]) -> S3Storage:
    try:
        return S3Storage(endpoint_url=endpoint, region=region, scheme="gs")
    except ValueError as e:
        raise StorageError(f"BIJ_GCS_ENDPOINT_URL {endpoint!r} is not a usable endpoint ({e}): give a URL such as "
                           f"{GCS_ENDPOINT}", permanent=True) from None


def _add_generation_precondition(request: Any, **_: Any) -> None:
    """GCS applies If-None-Match to reads only (a PUT carrying it overwrites); its own precondition for
    "only if no object exists" is x-goog-if-generation-match: 0, added to every conditional create."""
    if request.headers.get("If-None-Match") == "*":
        request.headers["x-goog-if-generation-match"] = "0"


def _local_path(uri: str) -> Path:
    if not uri.startswith("file://"):
        raise StorageError(f"not a file:// URI: {uri!r}", permanent=True)
    return Path(uri[len("file://") :])


def _os_error(what: str, uri: str, e: OSError) -> StorageError:
    """One line that names the URI; a full disk or a read-only file system says what to do."""
    hint = ""
    if e.errno == errno.ENOSPC:
        hint = ": free some space and run again (what is durable is kept)"
    elif e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        hint = ": make it writable for this user, or choose another location"
    return StorageError(f"cannot {what} {uri}: {e.strerror or e}{hint}",
                        permanent=e.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR))


def _version(st: os.stat_result) -> str:
    return str(st.st_mtime_ns)


# Temp files of atomic writes: ".<name>.<random>.tmp" beside the object (8 characters: mkstemp's, before).
_TEMP_RE = re.compile(r"^\..+\.[A-Za-z0-9_]{8,16}\.tmp$")


class FileStorage:
    """Local files. Atomic writes are write-temp + fsync + rename; appends are fsynced."""

    supports_append = True

    def list(self, uri: str) -> list[ObjectInfo]:
        p = _local_path(uri)
        try:
            if p.is_file():
                st = p.stat()
                return [ObjectInfo(uri, st.st_size, _version(st))]
            if not p.is_dir():
                return []
            out = []
            for root, dirs, files in os.walk(p):
                dirs.sort()
                for f in files:
                    fp = Path(root) / f
                    try:
                        st = fp.stat()
                    except FileNotFoundError:  # removed while listing (a temp file renamed)
                        continue
                    out.append(ObjectInfo("file://" + str(fp), st.st_size, _version(st)))
        except OSError as e:
            raise _os_error("list", uri, e) from None
        out.sort(key=lambda o: o.uri)
        return out

    def list_pages(self, uri: str) -> Iterator[ObjectPage]:
        p = _local_path(uri)
        if p.is_file():
            yield self.list(uri)
            return
        # scandir reads a folder as it goes (os.walk holds each folder's names): only the folders
        # still to visit and one page are held.
        folders = [p] if p.is_dir() else []
        page: list[ObjectInfo] = []
        while folders:
            folder = folders.pop()
            try:
                with os.scandir(folder) as entries:
                    for entry in entries:
                        if entry.is_dir(follow_symlinks=False):
                            folders.append(Path(entry.path))
                            continue
                        try:
                            st = entry.stat()
                        except FileNotFoundError:  # removed while listing
                            continue
                        page.append(ObjectInfo("file://" + entry.path, st.st_size, _version(st)))
                        if len(page) >= PAGE:
                            yield page
                            page = []
            except FileNotFoundError:
                continue  # removed while listing
            except OSError as e:
                raise _os_error("list", "file://" + str(folder), e) from None
        if page:
            yield page

    def delete_many(self, uris: Iterable[str]) -> dict[str, str]:
        failed: dict[str, str] = {}
        for uri in uris:
            try:
                _local_path(uri).unlink()
            except FileNotFoundError:
                pass
            except OSError as e:
                failed[uri] = str(_os_error("delete", uri, e))
        return failed

    def open_read(self, uri: str, start: int = 0, version: str | None = None) -> BinaryIO:
        try:
            f = open(_local_path(uri), "rb", buffering=1 << 20)  # noqa: SIM115 - caller closes
        except FileNotFoundError:
            raise NotFound(f"{uri}: no such file") from None
        except OSError as e:
            raise _os_error("open", uri, e) from None
        if version is not None and _version(os.fstat(f.fileno())) != version:
            f.close()
            raise ObjectChanged(f"{uri} was modified after the job was planned (mtime differs)")
        if start:
            f.seek(start)
        return f

    def read_bytes(self, uri: str) -> bytes:
        # Read whole, without open_read's 1 MiB buffer: steps read records 16 at a time, and a
        # few-KB record must not cost a MiB of memory while it is in flight.
        try:
            with open(_local_path(uri), "rb", buffering=0) as f:
                return f.read()
        except FileNotFoundError:
            raise NotFound(f"{uri}: no such file") from None
        except OSError as e:
            raise _os_error("open", uri, e) from None

    def read_range(self, uri: str, start: int, length: int) -> bytes:
        with self.open_read(uri, start) as f:
            return f.read(length)

    def write_bytes(self, uri: str, data: bytes) -> None:
        p = _local_path(uri)
        try:
            tmp = _durable_temp(p, data)
            try:
                os.replace(tmp, p)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
        except OSError as e:
            raise _os_error("write", uri, e) from None
        _fsync_dir(p.parent)

    def create(self, uri: str, data: bytes) -> bool:
        p = _local_path(uri)
        try:
            tmp = _durable_temp(p, data)
            try:
                os.link(tmp, p)  # fails if the name exists: whole and exclusive at once
            except FileExistsError:
                return False
            finally:
                tmp.unlink()
        except OSError as e:
            raise _os_error("write", uri, e) from None
        _fsync_dir(p.parent)
        return True

    def write_stream(self, uri: str, parts: Iterable[bytes]) -> int:
        p = _local_path(uri)
        size = 0
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            tmp = p.parent / f".{p.name}.{secrets.token_hex(8)}.tmp"  # as _durable_temp names it
            f = open(tmp, "xb")  # noqa: SIM115 - closed below, whatever the parts do
        except OSError as e:
            raise _os_error("write", uri, e) from None
        try:
            with f:
                # An error of the parts' source is its own; only the file's are storage errors.
                for part in parts:
                    try:
                        f.write(part)
                    except OSError as e:
                        raise _os_error("write", uri, e) from None
                    size += len(part)
                try:
                    f.flush()
                    os.fsync(f.fileno())
                except OSError as e:
                    raise _os_error("write", uri, e) from None
            try:
                os.replace(tmp, p)
            except OSError as e:
                raise _os_error("write", uri, e) from None
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(p.parent)
        return size

    def remove_stale_temp(self, uri: str, older_than_s: float) -> int:
        # A temp file still being written is younger: its writer touches it as it writes.
        root = _local_path(uri)
        cutoff = time.time() - older_than_s
        removed = 0
        for folder, _, files in os.walk(root):
            for f in files:
                if not _TEMP_RE.match(f):
                    continue
                fp = os.path.join(folder, f)
                try:
                    if os.stat(fp).st_mtime < cutoff:
                        os.unlink(fp)
                        removed += 1
                except FileNotFoundError:
                    pass
        return removed

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
        try:
            if new:
                p.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(p, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
            try:
                view = memoryview(data)
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            raise _os_error("append to", uri, e) from None
        if new:
            _fsync_dir(p.parent)


def _durable_temp(p: Path, data: bytes) -> Path:
    """`data` in a new, fsynced temp file beside `p` (removed again if anything fails)."""
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.parent / f".{p.name}.{secrets.token_hex(8)}.tmp"
    # 0666 less the umask, like any file a program writes (mkstemp would make it 0600).
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


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
    """`s3://bucket/key` (or `gs://bucket/key`) → (bucket, key)."""
    scheme, sep, rest = uri.partition("://")
    if not sep or scheme not in ("s3", "gs"):
        raise StorageError(f"not an s3:// or gs:// URI: {uri!r}", permanent=True)
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise StorageError(f"{uri!r} has no bucket: use {scheme}://bucket/prefix", permanent=True)
    return bucket, key


# Error codes that mean "this will not get better by waiting".
_PERMANENT_CODES = {
    "NoSuchBucket", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
    "AllAccessDisabled", "InvalidBucketName", "InvalidObjectState", "NoSuchKey", "404", "403",
    "InvalidRange", "416", "MethodNotAllowed", "ExpiredToken", "InvalidToken",
}


def _client_errors() -> tuple[type[BaseException], ...]:
    """What boto3 and the HTTP stack under it raise: classified into StorageError. Anything else
    (a KeyError, a TypeError) is a bug and propagates as itself."""
    from botocore.exceptions import BotoCoreError, ClientError
    from urllib3.exceptions import HTTPError

    return (BotoCoreError, ClientError, HTTPError, OSError)


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


# Codes that say the store refused who is asking (or where): a job fails on them at once.
_REFUSED_CODES = {
    "NoSuchBucket", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled",
    "ExpiredToken", "InvalidToken", "403",
}


# What to do about an error that no retry fixes, by S3 error code.
_HINTS = {
    "NoSuchBucket": "create the bucket or fix the URI",
    "AccessDenied": "grant this identity access, or check spec.storage.credentialsSecret / the AWS_* environment",
    "403": "grant this identity access, or check spec.storage.credentialsSecret / the AWS_* environment",
    "AllAccessDisabled": "grant this identity access, or check spec.storage.credentialsSecret / the AWS_* environment",
    "InvalidAccessKeyId": "check the credentials (AWS_ACCESS_KEY_ID, spec.storage.credentialsSecret)",
    "SignatureDoesNotMatch": "check the credentials (AWS_SECRET_ACCESS_KEY, spec.storage.credentialsSecret)",
    "ExpiredToken": "renew the credentials",
    "InvalidBucketName": "fix the bucket name in the URI",
}


def _describe(exc: BaseException) -> str:
    from botocore.exceptions import ClientError, NoCredentialsError

    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", "?"))
        hint = f"; {_HINTS[code]}" if code in _HINTS else ""
        if code == "403":
            # A HEAD's answer has no body, so no S3 error code: say what a GET would have said.
            return f"AccessDenied: 403 {err.get('Message', '') or 'Forbidden'}{hint}"
        return f"{code}: {err.get('Message', '') or exc}{hint}"
    if isinstance(exc, NoCredentialsError):
        return ("no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), "
                "or spec.storage.credentialsSecret on a cluster")
    if _is_unreachable(exc):
        return f"{type(exc).__name__}: {exc}; check spec.storage.s3.endpointUrl and that the endpoint is up"
    return f"{type(exc).__name__}: {exc}"


def _is_refused(exc: BaseException) -> bool:
    """The store said no to who is asking or where (`_REFUSED_CODES`), or there is nobody to ask as."""
    from botocore.exceptions import ClientError, NoCredentialsError

    if isinstance(exc, NoCredentialsError):
        return True
    return isinstance(exc, ClientError) and str(exc.response.get("Error", {}).get("Code", "")) in _REFUSED_CODES


def _is_unreachable(exc: BaseException) -> bool:
    from botocore.exceptions import ConnectTimeoutError, EndpointConnectionError

    return isinstance(exc, (EndpointConnectionError, ConnectTimeoutError))


class S3Storage:
    """S3 and S3-compatible stores (MinIO, moto) through boto3; credentials: the standard AWS chain.

    With `scheme="gs"`, Google Cloud Storage through its XML API: the same calls, signed with an HMAC key
    (in AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY), with what that API lacks left out: no checksum
    headers unless an operation requires them (botocore's default CRC32 headers are not part of it), and
    conditional creates also as GCS's own generation precondition."""

    supports_append = False

    def __init__(
        self,
        endpoint_url: str | None = None,
        region: str | None = None,
        max_attempts: int = 8,
        base_delay: float = 0.2,
        client: Any = None,
        scheme: str = "s3",
    ):
        self.max_attempts = max_attempts
        self.base_delay = base_delay
        self.scheme = scheme
        self._session: Any = None  # where the client's credentials come from (None: a client given)
        if client is None:
            import boto3
            from botocore.config import Config

            # botocore retries too; ours wraps whole operations (streams included)
            # and gives a message that names the URI when it gives up.
            settings: dict[str, Any] = {"retries": {"max_attempts": 3, "mode": "standard"}, "connect_timeout": 10,
                                        "read_timeout": 60}
            if scheme == "gs":
                # endpoint_url is GCS's (or BIJ_GCS_ENDPOINT_URL): never AWS_ENDPOINT_URL, another store's.
                region = region or "auto"
                settings.update(request_checksum_calculation="when_required",
                                response_checksum_validation="when_required")
            else:
                endpoint_url = endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or None
                region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
            self._session = boto3.session.Session()
            client = self._session.client("s3", endpoint_url=endpoint_url, region_name=region,
                                          config=Config(**settings))
            if scheme == "gs":
                client.meta.events.register("before-sign.s3.PutObject", _add_generation_precondition)
        self.client = client

    def _call(self, what: str, uri: str, fn: Callable[[], T]) -> T:
        from botocore.exceptions import ClientError

        errors = _client_errors()
        for attempt in range(1, self.max_attempts + 1):
            try:
                return fn()
            except errors as e:  # classified below
                if isinstance(e, ClientError):
                    code = str(e.response.get("Error", {}).get("Code", ""))
                    if code in {"NoSuchKey", "404", "NotFound"}:
                        raise NotFound(f"{uri}: no such object") from None
                    if code == "PreconditionFailed":  # IfMatch / IfNoneMatch
                        raise ObjectChanged(f"{uri} was replaced after the job was planned (ETag differs)") from None
                if _is_refused(e):
                    raise StorageRefused(f"{what} {uri}{self._as_whom()}: {_describe(e)}") from None
                if not _is_transient(e):
                    raise StorageError(f"{what} {uri}: {_describe(e)}", permanent=True) from None
                if attempt == self.max_attempts:
                    raise StorageError(f"{what} {uri}: still failing after {attempt} attempts: {_describe(e)}") \
                        from None
                time.sleep(min(10.0, self.base_delay * 2 ** (attempt - 1)) * (0.5 + random.random()))
        raise AssertionError("unreachable")

    def access_key_id(self) -> str | None:
        """The access key id this client signs with (never the secret); None without credentials, or
        when the client was given rather than made here."""
        if self._session is None:
            return None
        try:
            credentials = self._session.get_credentials()
        except Exception:  # noqa: BLE001 - only for a message: a chain that fails to resolve has no key to name
            return None
        return str(credentials.access_key) if credentials is not None else None

    def _as_whom(self) -> str:
        key = self.access_key_id()
        return f" as access key id {key}" if key else ""

    def list(self, uri: str) -> list[ObjectInfo]:
        out = [obj for page in self.list_pages(uri) for obj in page]
        out.sort(key=lambda o: o.uri)
        return out

    def list_pages(self, uri: str) -> Iterator[ObjectPage]:
        bucket, key = split_s3(uri)
        token: str | None = None
        start_after: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": key, "MaxKeys": PAGE}
            if token:
                kwargs["ContinuationToken"] = token
            elif start_after:
                kwargs["StartAfter"] = start_after
            page = self._call("list", uri, lambda kw=kwargs: self.client.list_objects_v2(**kw))  # type: ignore[misc]
            out: list[ObjectInfo] = []
            for obj in page.get("Contents", []):
                k = obj["Key"]
                # A prefix without a trailing slash must not match "docs-old/" for "docs".
                if key and not key.endswith("/") and k != key and not k.startswith(key + "/"):
                    continue
                if k.endswith("/"):
                    continue
                out.append(ObjectInfo(f"{self.scheme}://{bucket}/{k}", int(obj["Size"]), obj.get("ETag")))
            if out:
                yield out
            if not page.get("IsTruncated"):
                break
            token = page.get("NextContinuationToken")
            if not token:  # a store that pages without a token: go on after the last key it gave
                contents = page.get("Contents") or []
                if not contents:
                    raise StorageError(f"list {uri}: the store says there is more but gives no way on",
                                       permanent=True)
                start_after = contents[-1]["Key"]

    def _get(self, uri: str, start: int, version: str | None = None) -> Any:
        bucket, key = split_s3(uri)
        kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key}
        if start:
            kwargs["Range"] = f"bytes={start}-"
        if version is not None:
            kwargs["IfMatch"] = version  # a replaced object answers 412, never its new bytes
        return self._call("read", uri, lambda: self.client.get_object(**kwargs)["Body"])

    def open_read(self, uri: str, start: int = 0, version: str | None = None) -> BinaryIO:
        return io.BufferedReader(_ResumingS3Stream(self, uri, start, version),  # type: ignore[return-value]
                                 buffer_size=1 << 20)

    def read_bytes(self, uri: str) -> bytes:
        with self.open_read(uri) as f:
            return f.read()

    def read_range(self, uri: str, start: int, length: int) -> bytes:
        if length <= 0:
            return b""  # S3 has no empty range (bytes=5-4 is the whole object)
        bucket, key = split_s3(uri)

        def get() -> bytes:
            # The body is read inside the retried call: a connection broken midway is one more attempt.
            body = self.client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{start + length - 1}")["Body"]
            try:
                return bytes(body.read())
            finally:
                body.close()

        return self._call("read", uri, get)

    def write_bytes(self, uri: str, data: bytes) -> None:
        bucket, key = split_s3(uri)
        # One PUT: S3 makes the object visible whole or not at all.
        self._call("write", uri, lambda: self.client.put_object(Bucket=bucket, Key=key, Body=data))

    def write_stream(self, uri: str, parts: Iterable[bytes]) -> int:
        bucket, key = split_s3(uri)
        buf = bytearray()
        size = 0
        upload: str | None = None
        done: list[dict[str, Any]] = []

        def send(data: bytes) -> None:
            n = len(done) + 1
            part = self._call("write", uri, lambda: self.client.upload_part(
                Bucket=bucket, Key=key, UploadId=upload, PartNumber=n, Body=data))
            done.append({"PartNumber": n, "ETag": part["ETag"]})

        try:
            for chunk in parts:
                buf += chunk
                size += len(chunk)
                if len(buf) >= MULTIPART_BYTES:
                    if upload is None:
                        upload = self._call("write", uri, lambda: self.client.create_multipart_upload(
                            Bucket=bucket, Key=key))["UploadId"]
                    send(bytes(buf))
                    buf = bytearray()
            if upload is None:  # small: one PUT, as write_bytes
                self.write_bytes(uri, bytes(buf))
                return size
            if buf:
                send(bytes(buf))
            # The object appears whole when the upload completes, never a part of it.
            self._call("write", uri, lambda: self.client.complete_multipart_upload(
                Bucket=bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": done}))
            return size
        except BaseException:
            if upload is not None:
                try:
                    self.client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload)
                except Exception:  # noqa: BLE001 - the first error is the one to report; S3 expires the rest
                    pass
            raise

    def create(self, uri: str, data: bytes) -> bool:
        bucket, key = split_s3(uri)
        try:
            self._call("write", uri, lambda: self.client.put_object(Bucket=bucket, Key=key, Body=data, IfNoneMatch="*"))
            return True
        except ObjectChanged:  # 412: the object exists
            return False
        except StorageError as e:
            # A store without conditional writes says NotImplemented; GCS, where it refuses its precondition
            # header on a request signed the S3 way, says so with a 400 naming the header.
            refused = ("NotImplemented",) + (("ExcessHeaderValues", "InvalidArgument") if self.scheme == "gs" else ())
            if not any(code in str(e) for code in refused):
                raise
        # A store without conditional writes: check, then write (a narrow race, and the best it allows).
        if self.exists(uri):
            return False
        self.write_bytes(uri, data)
        return True

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

    def delete_many(self, uris: Iterable[str]) -> dict[str, str]:
        failed: dict[str, str] = {}
        if self.scheme == "gs":  # GCS's XML API has no multi-object delete
            for uri in uris:
                self.delete(uri)
            return failed
        batch: list[str] = []
        for uri in uris:
            batch.append(uri)
            if len(batch) == PAGE:
                failed.update(self._delete_batch(batch))
                batch = []
        if batch:
            failed.update(self._delete_batch(batch))
        return failed

    def _delete_batch(self, uris: Sequence[str]) -> dict[str, str]:
        """One DeleteObjects request (quiet: only the keys it could not delete come back)."""
        by_bucket: dict[str, list[str]] = {}
        for uri in uris:
            bucket, key = split_s3(uri)
            by_bucket.setdefault(bucket, []).append(key)
        failed: dict[str, str] = {}
        for bucket, keys in by_bucket.items():
            where = f"{self.scheme}://{bucket}/{keys[0]}" + (f" and {len(keys) - 1} more" if len(keys) > 1 else "")
            body = {"Objects": [{"Key": k} for k in keys], "Quiet": True}
            answer = self._call("delete", where,
                                lambda b=bucket, d=body: self.client.delete_objects(Bucket=b, Delete=d))  # type: ignore[misc]
            for err in answer.get("Errors") or []:
                if err.get("Code") == "NoSuchKey":
                    continue  # gone already: what a delete wants
                failed[f"{self.scheme}://{bucket}/{err.get('Key')}"] = f"{err.get('Code')}: {err.get('Message')}"
        return failed

    def append_durable(self, uri: str, data: bytes) -> None:
        raise StorageError(f"{self.scheme}:// objects are immutable: write segments instead of appending")

    def remove_stale_temp(self, uri: str, older_than_s: float) -> int:
        return 0  # a PUT is atomic: nothing is left behind


class _ResumingS3Stream(ReopeningBody):
    """A GET body that re-opens at the current offset when the connection breaks."""

    def __init__(self, storage: S3Storage, uri: str, start: int, version: str | None = None):
        self.storage, self.uri, self.pos, self.version = storage, uri, start, version
        self.body: Any = None
        self.failures = 0

    def readinto(self, b: Any) -> int:
        while True:
            try:
                if self.body is None:
                    self.body = self.storage._get(self.uri, self.pos, self.version)
                data = self.body.read(len(b))
                n = len(data)
                b[:n] = data
                self.pos += n
                self.failures = 0
                return n
            except StorageError:
                raise
            except _client_errors() as e:
                if not _is_transient(e):
                    raise StorageError(f"read {self.uri}: {_describe(e)}", permanent=True) from None
                self.failures += 1
                if self.failures >= self.storage.max_attempts:
                    raise StorageError(f"read {self.uri}: stream broke {self.failures} times: {_describe(e)}") \
                        from None
                self._close_body()
                time.sleep(min(10.0, self.storage.base_delay * 2 ** (self.failures - 1)))



def split_lines(stream: Any, base_offset: int, block: int = 1 << 20,
                max_line: int | None = None) -> Iterator[tuple[int, bytes | None, int]]:
    """Yield (offset of the line's first byte, line without its newline, its length) from a byte stream.

    Linear in the bytes read, however long a line: each block is searched once, and a line
    that spans blocks is joined once. A line longer than `max_line` bytes is not kept: it
    comes as (offset, None, length), with its bytes dropped as they are read. A last line
    without a trailing newline is yielded too.
    """
    for pos, lines, lengths in split_blocks(stream, base_offset, block, max_line):
        for line, n in zip(lines, lengths, strict=True):
            yield pos, line, n
            pos += n + 1


def split_blocks(stream: Any, base_offset: int, block: int = 1 << 20,
                 max_line: int | None = None) -> Iterator[tuple[int, list[bytes | None], list[int]]]:
    """`split_lines` a block at a time: (offset of the first line, lines, their lengths).

    The lines of one item follow each other in the stream, each followed by its newline
    (but perhaps the stream's last line). A line over `max_line` bytes is None, its
    length still given. One split and one length pass per block, in C: no Python work
    per line here.
    """
    limit = -1 if max_line is None else max_line
    parts: list[bytes] = []  # pieces of the line not ended yet (none once it is over the limit)
    size = 0  # its length so far
    pos = base_offset  # offset of its first byte
    while True:
        data = stream.read(block)
        if not data:
            break
        lines: list[bytes | None] = data.split(b"\n")  # type: ignore[assignment]
        tail: bytes = lines.pop()  # type: ignore[assignment]
        if size and lines:  # the line left open by the last block ends in this one
            head: bytes = lines[0]  # type: ignore[assignment]
            n = size + len(head)
            if limit < 0 or n <= limit:
                parts.append(head)
                yield pos, [b"".join(parts)], [n]
            else:
                yield pos, [None], [n]
            parts, size = [], 0
            pos += n + 1
            lines = lines[1:]
        if lines:
            lengths: list[int] = list(map(len, lines))  # type: ignore[arg-type]
            if 0 <= limit < len(data):  # a line inside this block may be over the limit
                lines = [line if n <= limit else None for line, n in zip(lines, lengths, strict=True)]
            yield pos, lines, lengths
            pos += sum(lengths) + len(lengths)
        if tail:
            size += len(tail)
            if limit < 0 or size <= limit:
                parts.append(tail)
            else:
                parts = []
    if size:
        yield pos, [b"".join(parts) if limit < 0 or size <= limit else None], [size]


