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
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import zstandard
from input_rows import numbered

from bij.storage import NotFound, ObjectChanged, StorageRefused, open_storage
from bij.storage.http import HttpStorage


@dataclass
class Server:
    root: Path
    port: int = 0
    no_head: bool = False
    forbidden: bool = False
    break_after: int = 0  # cut the next response body after this many bytes (once)
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
            if self.headers.get("If-Match") not in (None, etag):
                self.send_response(412)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            start, status = 0, 200
            wanted = self.headers.get("Range")
            if wanted and wanted.startswith("bytes="):
                first, _, last = wanted[len("bytes="):].partition("-")
                start = int(first)
                end = int(last) + 1 if last else len(data)
                status = 206
                data_out = data[start:end]
            else:
                data_out = data
            self.send_response(status)
            self.send_header("ETag", etag)
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(len(data_out)))
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{start + len(data_out) - 1}/{len(data)}")
            self.end_headers()
            if not body:
                return
            if server.break_after and len(data_out) > server.break_after:
                cut, server.break_after = server.break_after, 0
                self.wfile.write(data_out[:cut])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(2)
                return
            self.wfile.write(data_out)

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
