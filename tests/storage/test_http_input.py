"""An https:// input: one object read with range requests, as from a web server or a presigned URL.

The server here is a plain HTTP/1.1 static-file server on 127.0.0.1 (Python's own, with the range and
conditional-request handling of a CDN or an object store's signed URLs: `Range`, `206`, `ETag`,
`If-Match` -> `412`); switches make it refuse HEAD, break a response midway, or answer 403."""

from __future__ import annotations

import functools
import hashlib
import http.server
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import zstandard
from input_rows import numbered

from bij.storage import NotFound, ObjectChanged, StorageError, StorageRefused, open_storage
from bij.storage.http import HttpStorage, RedirectRefused, redirect_refusal


@dataclass
class Server:
    root: Path
    port: int = 0
    no_head: bool = False
    forbidden: bool = False
    break_after: int = 0  # cut the next response body after this many bytes (once)
    after_break: Callable[[], object] | None = None  # what happens to the object once that cut is made
    redirects: dict[str, str] = field(default_factory=dict)  # path -> Location
    ignore_range: bool = False  # answer 200 and the whole object to a Range request
    ignore_if_match: bool = False  # answer whatever the object is now, If-Match or not
    no_validator: bool = False  # send no ETag (and, as here always, no Last-Modified)
    last_modified: str | None = None  # send this Last-Modified instead of an ETag (If-Unmodified-Since is ignored)
    trickle_body: float = 0.0  # seconds between the body's bytes
    trickle_headers: float = 0.0  # seconds between the bytes of the status line and headers
    before_range: Callable[[str], None] | None = None  # called with the Range of each ranged GET, before answering
    requests: list[tuple[str, str, str]] = field(default_factory=list)  # (method, path, range)

    def url(self, name: str, query: str = "") -> str:
        return f"http://127.0.0.1:{self.port}/{name}" + (f"?{query}" if query else "")


def _handler(server: Server) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def _object(self) -> tuple[bytes, str] | None:
            path = server.root / self.path.split("?", 1)[0].lstrip("/")
            if not path.is_file():
                return None
            data = path.read_bytes()
            return data, '"' + hashlib.md5(data).hexdigest() + '"'  # noqa: S324 - an ETag, as S3's

        def _answer(self, body: bool) -> None:
            server.requests.append((self.command, self.path, self.headers.get("Range", "")))
            # Whether to cut this body is read as the request arrives: a handler still answering a request the
            # client gave up on must not take a cut a later part of the test set up for the next request.
            break_after = server.break_after
            target = server.redirects.get(self.path.split("?", 1)[0])
            if target is not None:
                self.send_response(302)
                self.send_header("Location", target)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if server.before_range and self.command == "GET" and self.headers.get("Range"):
                server.before_range(self.headers["Range"])
            if server.forbidden:
                self.send_response(403)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            found = self._object()
            if found is None:
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            data, etag = found
            if self.headers.get("If-Match") not in (None, etag) and not server.ignore_if_match:
                self.send_response(412)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            start, status = 0, 200
            wanted = self.headers.get("Range")
            if wanted and wanted.startswith("bytes=") and not server.ignore_range:
                first, _, last = wanted[len("bytes="):].partition("-")
                start = int(first)
                end = int(last) + 1 if last else len(data)
                status = 206
                data_out = data[start:end]
            else:
                data_out = data
            if server.trickle_headers:
                self._trickle(f"HTTP/1.1 {status} OK\r\nContent-Length: {len(data_out)}\r\n\r\n".encode(),
                              server.trickle_headers)
                return
            self.send_response(status)
            if server.last_modified:
                self.send_header("Last-Modified", server.last_modified)
            elif not server.no_validator:
                self.send_header("ETag", etag)
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(len(data_out)))
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{start + len(data_out) - 1}/{len(data)}")
            self.end_headers()
            if not body:
                return
            if server.trickle_body:
                self._trickle(data_out, server.trickle_body)
                return
            if break_after and len(data_out) > break_after:
                cut, server.break_after = break_after, 0
                self.wfile.write(data_out[:cut])
                self.wfile.flush()
                if server.after_break:  # before the cut: the reopened read must find it done
                    server.after_break()
                self.close_connection = True
                self.connection.shutdown(2)
                return
            self.wfile.write(data_out)

        def _trickle(self, data: bytes, pause: float) -> None:
            """One byte at a time, each in time for any socket timeout; until the client hangs up."""
            self.close_connection = True
            try:
                for i in range(len(data)):
                    self.wfile.write(data[i:i + 1])
                    self.wfile.flush()
                    time.sleep(pause)
            except OSError:
                pass

        def do_GET(self) -> None:  # noqa: N802 - the handler's API
            self._answer(body=True)

        def do_HEAD(self) -> None:  # noqa: N802
            if server.no_head:
                server.requests.append(("HEAD", self.path, ""))
                self.send_response(405)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self._answer(body=False)

    return Handler


@pytest.fixture()
def web(tmp_path: Path) -> Iterator[Server]:
    root = tmp_path / "www"
    root.mkdir()
    server = Server(root)
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(server))
    server.port = httpd.server_address[1]
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        httpd.shutdown()
        httpd.server_close()


rows = functools.partial(numbered, filler="x", period=37)


def jsonl(items: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in items)


@pytest.mark.parametrize("zst", [False, True])
def test_bij_run_reads_an_https_input_in_range_requested_shards(web: Server, zst: bool, file_place: Any,
                                                                 make_job: Any, read_output: Any, worker_env: Any,
                                                                 bij_bin: Any) -> None:
    import subprocess

    inputs = rows(600)
    data = jsonl(inputs)
    name = "data.jsonl.zst" if zst else "data.jsonl"
    (web.root / name).write_bytes(zstandard.ZstdCompressor().compress(data) if zst else data)
    # A presigned URL's query string is part of the URI, never of the object's name or suffix.
    spec, job = make_job(file_place, web.url(name, "X-Amz-Signature=abc&X-Amz-Expires=600"),
                         sharding={"targetShardBytes": 4096, "minShardBytes": 1024})
    p = subprocess.run([bij_bin("bij"), "run", str(spec)], env=worker_env(), capture_output=True, text=True,
                       timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    out = read_output(job)
    assert [(r["id"], r["output"]) for r in out.results] == [(r["id"], r["text"]) for r in inputs]
    ranges = [r for m, _, r in web.requests if m == "GET" and r]
    if zst:
        assert ranges == []  # a .zst object is one shard, read whole
    else:
        assert len(out.manifest["files"]) >= 3 and len(ranges) >= 2  # shards after the first start mid-object
    assert all("X-Amz-Signature=abc" in path for _, path, _ in web.requests)


def test_bij_run_fails_when_the_object_changes_between_its_shards_and_publishes_nothing(
        web: Server, file_place: Any, make_job: Any, worker_env: Any, bij_bin: Any) -> None:
    import subprocess

    (web.root / "data.jsonl").write_bytes(jsonl(rows(600)))
    web.ignore_if_match = True  # as a server that does not honour conditional requests

    def replace(wanted: str) -> None:
        if wanted != "bytes=0-0":  # the first shard read mid-object finds a new version
            (web.root / "data.jsonl").write_bytes(jsonl(rows(601)))

    web.before_range = replace
    spec, job = make_job(file_place, web.url("data.jsonl"), sharding={"targetShardBytes": 4096, "minShardBytes": 1024})
    p = subprocess.run([bij_bin("bij"), "run", str(spec)], env=worker_env(), capture_output=True, text=True,
                       timeout=180)
    assert p.returncode == 42, p.stderr[-3000:]  # a permanent error: failed at once, not retried
    assert f"{web.url('data.jsonl')} changed since it was planned" in p.stderr
    assert not file_place.storage.exists(file_place.uri("out/manifest.json"))


def test_an_object_replaced_after_planning_is_never_read_as_the_planned_one(web: Server) -> None:
    (web.root / "a.jsonl").write_bytes(jsonl(rows(50)))
    store = HttpStorage()
    (info,) = store.list(web.url("a.jsonl"))
    assert info.size == len(jsonl(rows(50))) and info.version
    with store.open_read(info.uri, 10, info.version) as f:
        assert f.read() == jsonl(rows(50))[10:]
    (web.root / "a.jsonl").write_bytes(jsonl(rows(51)))
    with pytest.raises(ObjectChanged, match="replaced after the job was planned"):
        store.open_read(info.uri, 0, info.version).read()


def test_a_stream_cut_midway_is_reopened_where_it_stopped(web: Server) -> None:
    data = jsonl(rows(3000))
    (web.root / "big.jsonl").write_bytes(data)
    web.break_after = 10_000
    store = HttpStorage(base_delay=0.01)
    (info,) = store.list(web.url("big.jsonl"))
    with store.open_read(info.uri, 5, info.version) as f:
        assert f.read() == data[5:]
    gets = [r for m, _, r in web.requests if m == "GET"]
    assert len(gets) == 2 and gets[0] == "bytes=5-" and gets[1] == f"bytes={5 + 10_000}-"


def test_a_server_that_refuses_head_is_sized_by_a_one_byte_range(web: Server) -> None:
    (web.root / "a.jsonl").write_bytes(b'{"id": 1, "text": "x"}\n')
    web.no_head = True
    (info,) = HttpStorage().list(web.url("a.jsonl"))
    assert info.size == 23
    assert ("GET", "/a.jsonl", "bytes=0-0") in web.requests


def test_missing_forbidden_and_writes_are_named(web: Server) -> None:
    store = open_storage(web.url("none.jsonl"), None)
    assert store.list(web.url("none.jsonl")) == []
    with pytest.raises(NotFound):
        store.read_bytes(web.url("none.jsonl"))
    web.forbidden = True
    with pytest.raises(StorageRefused, match=r"HTTP 403 .*expired or wrong signature"):
        store.list(web.url("a.jsonl"))
    with pytest.raises(StorageRefused, match="read-only"):
        store.write_bytes(web.url("out.jsonl"), b"x")


def test_a_redirect_to_ftp_is_refused_naming_the_url_and_the_target(web: Server) -> None:
    (web.root / "a.jsonl").write_bytes(jsonl(rows(5)))
    web.redirects["/moved.jsonl"] = "/a.jsonl"
    web.redirects["/away.jsonl"] = "ftp://127.0.0.1/a.jsonl"
    store = HttpStorage(base_delay=0.01)
    (info,) = store.list(web.url("moved.jsonl"))  # a redirect to http(s) is followed, as HEAD
    assert info.size == len(jsonl(rows(5))) and ("HEAD", "/a.jsonl", "") in web.requests
    refused = rf"read {web.url('away.jsonl')}: refused its redirect \(HTTP 302\) to ftp://127.0.0.1/a.jsonl"
    with pytest.raises(RedirectRefused, match=refused):
        store.list(web.url("away.jsonl"))
    with pytest.raises(RedirectRefused, match=refused):
        store.read_bytes(web.url("away.jsonl"))
    assert RedirectRefused("x").permanent  # the worker exits 42: no retry follows it


@pytest.mark.parametrize(("source", "target", "refused"), [
    ("https://a.example/x", "https://b.example/y", None),
    ("http://a.example/x", "https://b.example/y", None),
    ("http://a.example/x", "http://b.example/y", None),
    ("https://a.example/x", "http://a.example/x", "never read over plain http://"),
    ("https://a.example/x", "ftp://a.example/x", "only http(s)"),
    ("http://a.example/x", "file:///etc/passwd", "only http(s)"),
    ("http://a.example/x", "data:,hello", "only http(s)"),
])
def test_redirects_go_to_http_s_only_and_never_down_from_https(source: str, target: str,
                                                                refused: str | None) -> None:
    why = redirect_refusal(source, target)
    assert why is None if refused is None else refused in (why or "")


def test_an_object_whose_etag_changes_between_ranged_reads_is_refused(web: Server) -> None:
    first, second = jsonl(rows(50)), jsonl(rows(60))
    (web.root / "a.jsonl").write_bytes(first)
    web.ignore_if_match = True  # the server sends whatever it has now, with its new ETag
    store = HttpStorage(base_delay=0.01)
    (info,) = store.list(web.url("a.jsonl"))
    with store.open_read(info.uri, 0, info.version) as f:
        assert f.read(100) == first[:100]
    (web.root / "a.jsonl").write_bytes(second)
    with pytest.raises(ObjectChanged, match=rf"{info.uri} changed since it was planned: .*ETag {info.version}"):
        store.open_read(info.uri, 100, info.version).read()


def test_an_object_versioned_by_last_modified_is_refused_when_that_date_moves(web: Server) -> None:
    data = jsonl(rows(50))
    (web.root / "a.jsonl").write_bytes(data)
    web.last_modified = "Sun, 06 Dec 2026 01:00:00 GMT"
    store = HttpStorage(base_delay=0.01)
    (info,) = store.list(web.url("a.jsonl"))
    assert info.version == "last-modified:Sun, 06 Dec 2026 01:00:00 GMT"
    with store.open_read(info.uri, 100, info.version) as f:
        assert f.read() == data[100:]
    web.last_modified = "Sun, 06 Dec 2026 01:00:05 GMT"
    with pytest.raises(ObjectChanged, match=r"changed since it was planned: the plan read Last-Modified Sun, 06 Dec "
                                            r"2026 01:00:00 GMT, this response carries Last-Modified .*01:00:05"):
        store.open_read(info.uri, 100, info.version).read()


def test_a_stream_reopened_after_a_break_never_continues_with_another_version(web: Server) -> None:
    first = jsonl(rows(3000))
    (web.root / "big.jsonl").write_bytes(first)
    web.ignore_if_match = True
    web.break_after = 10_000
    web.after_break = lambda: (web.root / "big.jsonl").write_bytes(jsonl(rows(3001)))
    store = HttpStorage(base_delay=0.01)
    (info,) = store.list(web.url("big.jsonl"))
    with pytest.raises(ObjectChanged, match="changed since it was planned"), store.open_read(info.uri) as f:
        f.read()  # no planned version: the stream keeps the first response's
    (web.root / "big.jsonl").write_bytes(first)
    web.break_after = 10_000
    got = b""
    with pytest.raises(ObjectChanged, match="changed since it was planned"), \
            store.open_read(info.uri, 0, info.version) as f:
        while part := f.read(1000):
            got += part
    assert got and first.startswith(got)  # every byte handed out is of the planned version


def test_a_server_that_ignores_range_and_if_match_and_sends_another_version_is_refused(web: Server) -> None:
    data = jsonl(rows(50))
    (web.root / "a.jsonl").write_bytes(data)
    web.ignore_range = web.ignore_if_match = True
    store = HttpStorage(base_delay=0.01)
    (info,) = store.list(web.url("a.jsonl"))
    with store.open_read(info.uri, 100, info.version) as f:  # the same version: its start is skipped
        assert f.read() == data[100:]
    (web.root / "a.jsonl").write_bytes(jsonl(rows(49)))
    with pytest.raises(ObjectChanged, match=rf"{info.uri} changed since it was planned"):
        store.open_read(info.uri, 100, info.version).read()


def test_an_object_without_a_validator_is_refused_by_the_planner(web: Server, file_place: Any,
                                                                 make_job: Any) -> None:
    from bij.steps.plan_input import PlanError
    from bij.steps.planner import plan_round

    (web.root / "a.jsonl").write_bytes(jsonl(rows(50)))
    web.no_validator = True
    _, job = make_job(file_place, web.url("a.jsonl"))
    with pytest.raises(PlanError, match=rf"{web.url('a.jsonl')} has no version to plan against") as e:
        plan_round(job)
    assert e.value.permanent


def test_a_read_without_a_validator_is_not_reopened_midway(web: Server) -> None:
    (web.root / "big.jsonl").write_bytes(jsonl(rows(3000)))
    web.no_validator = True
    web.break_after = 10_000
    with pytest.raises(StorageError, match="broke at byte 10000 and cannot be reopened there"):
        HttpStorage(base_delay=0.01).read_bytes(web.url("big.jsonl"))
    assert [r for m, _, r in web.requests if m == "GET"] == [""]


def test_a_trickling_body_fails_within_the_speed_limit(web: Server) -> None:
    (web.root / "a.jsonl").write_bytes(jsonl(rows(3)))  # ~120 bytes: 12 s at a byte every 0.1 s
    store = HttpStorage(base_delay=0.01)
    (info,) = store.list(web.url("a.jsonl"))
    web.trickle_body = 0.1
    slow = HttpStorage(base_delay=0.01, attempts=2, min_bytes_per_second=1000, speed_window=0.5)
    began = time.monotonic()
    with pytest.raises(StorageError, match=r"stream broke 2 times: the body came at \d+ bytes/s over .* below the "
                                           r"minimum 1000 bytes/s"):
        slow.open_read(info.uri, 0, info.version).read()
    assert time.monotonic() - began < 4
    assert len([r for m, _, r in web.requests if m == "GET"]) == 2  # reopened once, then failed


# At a byte every 0.1 s the status line ("HTTP/1.1 200 OK") takes 1.7 s: the deadline falls inside it, or
# inside the headers after it (which http.client, its socket shut, would take for complete ones).
@pytest.mark.parametrize("deadline", [0.5, 2.5])
def test_a_response_whose_headers_trickle_fails_within_the_response_deadline(web: Server, deadline: float) -> None:
    (web.root / "a.jsonl").write_bytes(jsonl(rows(3)))
    web.trickle_headers = 0.1  # ~40 header bytes: 4 s
    store = HttpStorage(base_delay=0.01, attempts=1, response_deadline=deadline)
    began = time.monotonic()
    with pytest.raises(StorageError, match=f"still failing after 1 attempts: no response within {deadline:g} s"):
        store.read_bytes(web.url("a.jsonl"))
    assert time.monotonic() - began < deadline + 1
