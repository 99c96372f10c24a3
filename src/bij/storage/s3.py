"""`s3://` and `gs://`: S3 and S3-compatible stores through boto3, and Google Cloud Storage through its
S3-compatible XML API (HMAC keys; see `GCS_ENDPOINT`). Errors that can pass (throttling, 5xx, dropped
connections) are retried with exponential backoff, a broken read stream resumes from the byte it reached;
anything else stops with a `StorageError` that names the URI."""

from __future__ import annotations

import functools
import io
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, BinaryIO, TypeVar

from bij.storage import base
from bij.storage.objects import (
    NotFound,
    ObjectChanged,
    ObjectInfo,
    ObjectPage,
    ReopeningBody,
    StorageError,
    StorageRefused,
    retrying,
)

T = TypeVar("T")

def open_s3(uri: str, s3: Any) -> S3Storage:
    """The storage of an s3:// URI, with the job's spec.storage.s3 (see `open_storage`)."""
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


def open_gcs(uri: str, s3: Any = None) -> S3Storage:
    """The storage of a gs:// URI: GCS has one endpoint of its own, spec.storage.s3 (another S3 store)
    never applies to it."""
    split_s3(uri)
    endpoint = os.environ.get("BIJ_GCS_ENDPOINT_URL") or GCS_ENDPOINT
    region = os.environ.get("BIJ_GCS_REGION") or "auto"
    return _shared_gcs(endpoint, region, tuple(os.environ.get(k) for k in _CREDENTIAL_VARIABLES))


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

        def fatal(e: BaseException) -> StorageError | None:
            if isinstance(e, ClientError):
                code = str(e.response.get("Error", {}).get("Code", ""))
                if code in {"NoSuchKey", "404", "NotFound"}:
                    return NotFound(f"{uri}: no such object")
                if code == "PreconditionFailed":  # IfMatch / IfNoneMatch
                    return ObjectChanged(f"{uri} was replaced after the job was planned (ETag differs)")
            if _is_refused(e):
                return StorageRefused(f"{what} {uri}{self._as_whom()}: {_describe(e)}")
            if not _is_transient(e):
                return StorageError(f"{what} {uri}: {_describe(e)}", permanent=True)
            return None
        return retrying(what, uri, fn, catch=_client_errors(), fatal=fatal, attempts=self.max_attempts,
                        base_delay=self.base_delay, describe=_describe)

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
            kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": key, "MaxKeys": base.PAGE}
            if token:
                kwargs["ContinuationToken"] = token
            elif start_after:
                kwargs["StartAfter"] = start_after
            page = self._call("list", uri, functools.partial(self.client.list_objects_v2, **kwargs))
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
        return io.BufferedReader(_ResumingS3Stream(self, uri, start, version),
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
                if len(buf) >= base.MULTIPART_BYTES:
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
            if len(batch) == base.PAGE:
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
                                functools.partial(self.client.delete_objects, Bucket=bucket, Delete=body))
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



