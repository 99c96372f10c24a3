"""Azure Blob Storage: ``az://<container>/<path>``, through the Blob service's REST API (no SDK).

The account and its credentials come from the standard Azure environment, as the Azure CLI reads it (a
worker pod gets them from spec.storage.credentialsSecret):

- ``AZURE_STORAGE_CONNECTION_STRING`` (``AccountName=...;AccountKey=...`` or ``SharedAccessSignature=...``,
  with ``BlobEndpoint=`` or ``EndpointSuffix=``), or
- ``AZURE_STORAGE_ACCOUNT`` with ``AZURE_STORAGE_KEY`` (Shared Key) or ``AZURE_STORAGE_SAS_TOKEN``, and
  ``AZURE_STORAGE_BLOB_ENDPOINT`` for another endpoint than ``https://<account>.blob.core.windows.net``
  (Azurite, a private endpoint).

Objects are block blobs. A whole write is one Put Blob (visible whole or not at all); a streamed write
stages blocks and commits them with one Put Block List, so a write that fails midway leaves no blob. A
conditional create is a Put Blob with ``If-None-Match: *``; a read of a planned version sends its ETag
as ``If-Match``. Like s3://, blobs are never appended to: durable logs are written as segments.
"""

from __future__ import annotations

import base64
import datetime as dt
import functools
import hashlib
import hmac
import http.client
import io
import os
import threading
import time
import urllib.parse
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
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

API_VERSION = "2021-12-02"
_TRANSIENT = {408, 429, 500, 502, 503, 504}
_TIMEOUT = 60.0


def split_az(uri: str) -> tuple[str, str]:
    """(container, blob path) of ``az://container/path``."""
    rest = uri.removeprefix("az://")
    container, _, path = rest.partition("/")
    if not uri.startswith("az://") or not container:
        raise StorageError(f"{uri!r} is not an Azure Blob URI: use az://container/path", permanent=True)
    return container, path


@dataclass(frozen=True)
class Account:
    """Where the Blob service is and how requests are signed: a Shared Key, or a SAS appended to each URL."""

    name: str
    endpoint: str  # scheme://host[:port][/path], no trailing slash
    key: bytes | None = None
    sas: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Account:
        parts: dict[str, str] = {}
        conn = env.get("AZURE_STORAGE_CONNECTION_STRING")
        if conn:
            for item in conn.split(";"):
                k, sep, v = item.partition("=")
                if sep:
                    parts[k.strip()] = v.strip()
        name = parts.get("AccountName") or env.get("AZURE_STORAGE_ACCOUNT") or ""
        key = parts.get("AccountKey") or env.get("AZURE_STORAGE_KEY")
        sas = (parts.get("SharedAccessSignature") or env.get("AZURE_STORAGE_SAS_TOKEN") or "").lstrip("?") or None
        endpoint = parts.get("BlobEndpoint") or env.get("AZURE_STORAGE_BLOB_ENDPOINT")
        if not endpoint and name:
            protocol = parts.get("DefaultEndpointsProtocol", "https")
            endpoint = f"{protocol}://{name}.blob.{parts.get('EndpointSuffix', 'core.windows.net')}"
        if not name or not endpoint or not (key or sas):
            raise StorageRefused("az:// needs an Azure storage account and credentials: set "
                                 "AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT with AZURE_STORAGE_KEY or "
                                 "AZURE_STORAGE_SAS_TOKEN (in a pod: through spec.storage.credentialsSecret)")
        try:
            secret = base64.b64decode(key, validate=True) if key else None
        except ValueError:
            raise StorageRefused(f"the Azure storage key of account {name} is not base64") from None
        return cls(name, endpoint.rstrip("/"), secret, sas)

    def sign(self, method: str, path: str, query: Mapping[str, str], headers: Mapping[str, str]) -> str:
        """The Shared Key Authorization header of a request (the Blob service's string-to-sign)."""
        assert self.key is not None
        h = {k.lower(): v for k, v in headers.items()}
        length = h.get("content-length", "")
        fields = [method, h.get("content-encoding", ""), h.get("content-language", ""),
                  "" if length == "0" else length, h.get("content-md5", ""), h.get("content-type", ""), "",
                  h.get("if-modified-since", ""), h.get("if-match", ""), h.get("if-none-match", ""),
                  h.get("if-unmodified-since", ""), h.get("range", "")]
        canonical_headers = "".join(f"{k}:{h[k].strip()}\n" for k in sorted(h) if k.startswith("x-ms-"))
        resource = f"/{self.name}{path}" + "".join(f"\n{k.lower()}:{query[k]}" for k in sorted(query))
        to_sign = "\n".join(fields) + "\n" + canonical_headers + resource
        digest = hmac.new(self.key, to_sign.encode(), hashlib.sha256).digest()
        return f"SharedKey {self.name}:{base64.b64encode(digest).decode()}"


class _Failed(Exception):
    """A request the service answered with an error status (its code from x-ms-error-code)."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(f"{status} {code}: {message}" if message else f"{status} {code}")
        self.status, self.code = status, code


class AzureStorage:
    """Block blobs of one storage account (see the module's docstring)."""

    supports_append = False

    def __init__(self, account: Account, max_attempts: int = 8, base_delay: float = 0.2):
        self.account = account
        self.max_attempts = max_attempts
        self.base_delay = base_delay
        parsed = urllib.parse.urlsplit(account.endpoint)
        self._https = parsed.scheme == "https"
        self._host = parsed.netloc
        self._base_path = parsed.path.rstrip("/")
        self._local = threading.local()  # one kept-alive connection a thread

    # --- requests -------------------------------------------------------------------------------------

    def _connection(self, fresh: bool = False) -> http.client.HTTPConnection:
        if fresh:
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            return cls(self._host, timeout=_TIMEOUT)
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = self._connection(fresh=True)
        return conn

    def _drop_connection(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def _send(self, method: str, uri: str, query: Mapping[str, str] | None = None,
              headers: Mapping[str, str] | None = None, body: bytes = b"", stream: bool = False,
              container_only: bool = False) -> http.client.HTTPResponse:
        """One request, signed; the response on success (its body read by the caller), `_Failed` otherwise.
        `stream`: on a connection of its own, which closing the response closes."""
        container, path = split_az(uri)
        target = f"{self._base_path}/{container}" + ("" if container_only else "/" + urllib.parse.quote(path))
        query = dict(query or {})
        h = {"x-ms-version": API_VERSION, "x-ms-date": _http_date(), "Content-Length": str(len(body)),
             **(headers or {})}
        if self.account.key is not None:
            h["Authorization"] = self.account.sign(method, target, query, h)
        url = target + ("?" + urllib.parse.urlencode(query) if query else "")
        if self.account.sas and self.account.key is None:
            url += ("&" if query else "?") + self.account.sas
        conn = self._connection(fresh=stream)
        try:
            conn.request(method, url, body=body, headers=h)
            response = conn.getresponse()
        except BaseException:
            conn.close() if stream else self._drop_connection()
            raise
        if response.status >= 300:
            text = response.read()
            if stream:
                conn.close()
            code = response.getheader("x-ms-error-code") or ""
            message = ""
            if text:
                try:
                    message = (ET.fromstring(text).findtext("Message") or "").split("\n")[0]
                except ET.ParseError:
                    message = text[:200].decode("utf-8", "replace")
            raise _Failed(response.status, code or response.reason, message)
        return response

    def _call(self, what: str, uri: str, fn: Callable[[], T]) -> T:
        """Run `fn` with retries of what can pass; every failure names the URI (and the account, never its
        key)."""
        def fatal(e: BaseException) -> StorageError | None:
            if not isinstance(e, _Failed):  # the connection broke: a new one for the next try
                self._drop_connection()
                return None
            missing_blob = e.status == 404 and not e.code.endswith("ContainerNotFound")
            if missing_blob or e.code in {"BlobNotFound", "ResourceNotFound"}:
                return NotFound(f"{uri}: no such object")
            if e.status == 412 or e.code == "ConditionNotMet":
                return ObjectChanged(f"{uri} was replaced after the job was planned (ETag differs)")
            if e.status == 403 or e.code in {"AuthenticationFailed", "AuthorizationFailure"}:
                return StorageRefused(f"{what} {uri} as account {self.account.name}: {e}")
            if e.status not in _TRANSIENT:
                return StorageError(f"{what} {uri}: {e}", permanent=True)
            return None
        return retrying(what, uri, fn, catch=(_Failed, OSError, http.client.HTTPException), fatal=fatal,
                        attempts=self.max_attempts, base_delay=self.base_delay)

    def _request(self, what: str, method: str, uri: str, **kw: Any) -> tuple[bytes, http.client.HTTPResponse]:
        def go() -> tuple[bytes, http.client.HTTPResponse]:
            response = self._send(method, uri, **kw)
            return response.read(), response
        result: tuple[bytes, http.client.HTTPResponse] = self._call(what, uri, go)
        return result

    # --- listing -------------------------------------------------------------------------------------

    def list(self, uri: str) -> list[ObjectInfo]:
        out = [obj for page in self.list_pages(uri) for obj in page]
        out.sort(key=lambda o: o.uri)
        return out

    def list_pages(self, uri: str) -> Iterator[ObjectPage]:
        container, prefix = split_az(uri)
        marker = ""
        while True:
            query = {"restype": "container", "comp": "list", "prefix": prefix, "maxresults": str(base.PAGE)}
            if marker:
                query["marker"] = marker
            text, _ = self._request("list", "GET", uri, query=query, container_only=True)
            root = ET.fromstring(text)
            out: list[ObjectInfo] = []
            for blob in root.iter("Blob"):
                name = blob.findtext("Name") or ""
                # A prefix without a trailing slash must not match "docs-old/" for "docs".
                if prefix and not prefix.endswith("/") and name != prefix and not name.startswith(prefix + "/"):
                    continue
                if name.endswith("/"):
                    continue
                props = blob.find("Properties")
                size = int(props.findtext("Content-Length") or 0) if props is not None else 0
                etag = props.findtext("Etag") if props is not None else None
                out.append(ObjectInfo(f"az://{container}/{name}", size, etag))
            if out:
                yield out
            marker = root.findtext("NextMarker") or ""
            if not marker:
                break

    # --- reads ---------------------------------------------------------------------------------------

    def _get(self, uri: str, start: int, version: str | None = None) -> http.client.HTTPResponse:
        headers = {"x-ms-range": f"bytes={start}-"} if start else {}
        if version is not None:
            headers["If-Match"] = version  # a replaced blob answers 412, never its new bytes
        response: http.client.HTTPResponse = self._call(
            "read", uri, functools.partial(self._send, "GET", uri, headers=headers, stream=True))
        return response

    def open_read(self, uri: str, start: int = 0, version: str | None = None) -> BinaryIO:
        return io.BufferedReader(_ResumingBlobStream(self, uri, start, version), buffer_size=1 << 20)

    def read_bytes(self, uri: str) -> bytes:
        data, _ = self._request("read", "GET", uri)
        return data

    def read_range(self, uri: str, start: int, length: int) -> bytes:
        if length <= 0:
            return b""
        try:
            data, _ = self._request("read", "GET", uri, headers={"x-ms-range": f"bytes={start}-{start + length - 1}"})
        except StorageError as e:  # a range that starts past the end: nothing there
            if "InvalidRange" in str(e):
                return b""
            raise
        return data

    def exists(self, uri: str) -> bool:
        try:
            self._request("stat", "HEAD", uri)
            return True
        except NotFound:
            return False

    # --- writes --------------------------------------------------------------------------------------

    def write_bytes(self, uri: str, data: bytes) -> None:
        self._request("write", "PUT", uri, headers={"x-ms-blob-type": "BlockBlob"}, body=data)

    def create(self, uri: str, data: bytes) -> bool:
        try:
            self._request("write", "PUT", uri, headers={"x-ms-blob-type": "BlockBlob", "If-None-Match": "*"},
                          body=data)
            return True
        except ObjectChanged:  # 412
            return False
        except StorageError as e:  # 409 BlobAlreadyExists
            if "BlobAlreadyExists" in str(e):
                return False
            raise

    def write_stream(self, uri: str, parts: Iterable[bytes]) -> int:
        buf = bytearray()
        size = 0
        blocks: list[str] = []

        def stage(data: bytes) -> None:
            block = base64.b64encode(f"{len(blocks):08d}".encode()).decode()
            self._request("write", "PUT", uri, query={"comp": "block", "blockid": block}, body=data)
            blocks.append(block)

        for chunk in parts:
            buf += chunk
            size += len(chunk)
            if len(buf) >= base.MULTIPART_BYTES:
                stage(bytes(buf))
                buf = bytearray()
        if not blocks:  # small: one Put Blob, as write_bytes
            self.write_bytes(uri, bytes(buf))
            return size
        if buf:
            stage(bytes(buf))
        # The blob appears whole when its block list is committed; staged blocks of a write that fails before
        # are never seen, and the service discards them.
        listing = "".join(f"<Latest>{b}</Latest>" for b in blocks)
        body = f'<?xml version="1.0" encoding="utf-8"?><BlockList>{listing}</BlockList>'.encode()
        self._request("write", "PUT", uri, query={"comp": "blocklist"}, body=body)
        return size

    def delete(self, uri: str) -> None:
        try:
            self._request("delete", "DELETE", uri)
        except NotFound:
            pass

    def delete_many(self, uris: Iterable[str]) -> dict[str, str]:
        """One DELETE a blob (the Blob Batch API is not used): one missing is no error."""
        failed: dict[str, str] = {}
        for uri in uris:
            try:
                self.delete(uri)
            except StorageRefused as e:
                failed[uri] = str(e)
        return failed

    def append_durable(self, uri: str, data: bytes) -> None:
        raise StorageError("az:// blobs are written whole: write segments instead of appending")

    def remove_stale_temp(self, uri: str, older_than_s: float) -> int:
        return 0  # a Put Blob is atomic and staged blocks are never visible: nothing is left behind


class _ResumingBlobStream(ReopeningBody):
    """A GET body that re-opens at the current offset when the connection breaks. A read without a planned
    version keeps the first response's ETag, so a reopened stream never continues with another version's
    bytes; a body cut short is a break, never the blob's end."""

    def __init__(self, storage: AzureStorage, uri: str, start: int, version: str | None = None):
        self.storage, self.uri, self.pos, self.version = storage, uri, start, version
        self.body: Any = None
        self.end: int | None = None  # where the blob ends, as the response said
        self.failures = 0

    def readinto(self, b: Any) -> int:
        while True:
            try:
                if self.body is None:
                    self.body = self.storage._get(self.uri, self.pos, self.version)
                    self.version = self.version or self.body.getheader("ETag")
                    length = self.body.getheader("Content-Length")
                    self.end = self.pos + int(length) if length is not None else None
                n: int = self.body.readinto(b)
                if not n and len(b) and self.end is not None and self.pos < self.end:
                    # http.client ends a body cut short with a plain EOF: never take it for the blob's end.
                    raise http.client.IncompleteRead(b"", self.end - self.pos)
                self.pos += n
                self.failures = 0
                return n
            except StorageError:
                raise
            except (OSError, http.client.HTTPException) as e:
                self.failures += 1
                if self.failures >= self.storage.max_attempts:
                    raise StorageError(f"read {self.uri}: stream broke {self.failures} times: {e}") from None
                self._close_body()
                time.sleep(min(10.0, self.storage.base_delay * 2 ** (self.failures - 1)))


def _http_date() -> str:
    return dt.datetime.now(dt.UTC).strftime("%a, %d %b %Y %H:%M:%S GMT")


_VARIABLES = ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT", "AZURE_STORAGE_KEY",
              "AZURE_STORAGE_SAS_TOKEN", "AZURE_STORAGE_BLOB_ENDPOINT")


def open_azure(uri: str, s3: Any = None) -> AzureStorage:
    """The storage of an az:// URI; spec.storage.s3 never applies to it (the account comes from the
    environment). One per account and credentials, shared by the process's threads."""
    split_az(uri)
    return _shared(tuple(os.environ.get(k) for k in _VARIABLES))


@functools.lru_cache(maxsize=8)
def _shared(variables: tuple[str | None, ...]) -> AzureStorage:
    return AzureStorage(Account.from_env({k: v for k, v in zip(_VARIABLES, variables, strict=True) if v}))
