"""Storage: one interface for file:// and s3://; S3 errors that can pass are retried, others name the URI."""

from __future__ import annotations

import io
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    EndpointConnectionError,
    IncompleteReadError,
    ReadTimeoutError,
    ResponseStreamingError,
)
from s3server import Identity

from bij import storage
from bij.storage import (
    FileStorage,
    NotFound,
    S3Storage,
    StorageError,
    StorageRefused,
    open_storage,
    split_lines,
    split_s3,
)

# --- file:// ---------------------------------------------------------------------------------------


def test_file_list_gives_sizes_in_uri_order_and_nothing_for_a_missing_path(tmp_path: Path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x.jsonl").write_bytes(b"12345")
    (tmp_path / "a.jsonl").write_bytes(b"1")
    fs = FileStorage()
    assert [(o.uri, o.size) for o in fs.list(f"file://{tmp_path}")] == [
        (f"file://{tmp_path}/a.jsonl", 1), (f"file://{tmp_path}/b/x.jsonl", 5)]
    assert [o.size for o in fs.list(f"file://{tmp_path}/b/x.jsonl")] == [5]
    assert fs.list(f"file://{tmp_path}/nothing") == []


def test_file_reads_from_an_offset_and_a_missing_file_is_not_found(tmp_path: Path):
    (tmp_path / "f").write_bytes(b"0123456789")
    fs = FileStorage()
    with fs.open_read(f"file://{tmp_path}/f", 4) as f:
        assert f.read() == b"456789"
    with pytest.raises(NotFound, match="nope"):
        fs.read_bytes(f"file://{tmp_path}/nope")


def test_file_write_replaces_atomically_and_a_failed_write_keeps_the_old_object(tmp_path: Path, monkeypatch):
    fs = FileStorage()
    uri = f"file://{tmp_path}/deep/dir/obj.json"
    fs.write_bytes(uri, b"old")
    fs.write_bytes(uri, b"new")
    assert fs.read_bytes(uri) == b"new"

    def broken_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(storage.file.os, "fsync", broken_fsync)
    # One line that names the object and says what to do, not a traceback.
    with pytest.raises(StorageError, match=r"cannot write file://.*obj.json: No space left on device: free some space"):
        fs.write_bytes(uri, b"half")
    assert fs.read_bytes(uri) == b"new"
    assert os.listdir(tmp_path / "deep" / "dir") == ["obj.json"]  # no temp file left behind


def test_file_append_is_durable(tmp_path: Path):
    fs = FileStorage()
    uri = f"file://{tmp_path}/new/log.jsonl"
    fs.append_durable(uri, b"a\n")
    fs.append_durable(uri, b"b\n")
    assert fs.read_bytes(uri) == b"a\nb\n"


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_files_follow_the_umask_like_any_data_file(tmp_path: Path, umask: int):
    fs = FileStorage()
    old = os.umask(umask)
    try:
        fs.write_bytes(f"file://{tmp_path}/manifest.json", b"{}")
        fs.append_durable(f"file://{tmp_path}/log.jsonl", b"a\n")
        assert fs.create(f"file://{tmp_path}/owner.json", b"{}")
    finally:
        os.umask(old)
    for name in ("manifest.json", "log.jsonl", "owner.json"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o666 & ~umask, name


def test_create_writes_only_where_nothing_is(place):
    uri = place.uri("claims/owner.json")
    assert place.storage.create(uri, b"first")
    assert not place.storage.create(uri, b"second")
    assert place.storage.read_bytes(uri) == b"first"


def test_a_streamed_write_holds_one_part_at_a_time_and_appears_whole(place, monkeypatch):
    import bij.storage.base as storage_base

    monkeypatch.setattr(storage_base, "MULTIPART_BYTES", 5 << 20)  # S3's smallest part but the last
    uri = place.uri("files/big.jsonl")
    parts = [bytes([65 + i % 26]) * (1 << 20) for i in range(12)] + [b"tail\n"]
    assert place.storage.write_stream(uri, iter(parts)) == sum(map(len, parts))
    assert place.storage.read_bytes(uri) == b"".join(parts)
    small = place.uri("files/small.jsonl")
    assert place.storage.write_stream(small, iter([b"a\n", b"b\n"])) == 4
    assert place.storage.read_bytes(small) == b"a\nb\n"


def test_a_streamed_write_that_fails_midway_leaves_nothing(place):
    uri = place.uri("files/broken.jsonl")

    def parts():
        yield b"x" * (9 << 20)  # past one S3 part: a multipart upload is under way
        raise ConnectionAbortedError("the client went away")

    with pytest.raises(ConnectionAbortedError):
        place.storage.write_stream(uri, parts())
    assert not place.storage.exists(uri)
    assert [o.uri for o in place.storage.list(place.uri("files/"))] == []


def test_temp_files_of_killed_writes_are_removed_once_stale(tmp_path: Path):
    fs = FileStorage()
    fs.write_bytes(f"file://{tmp_path}/results/r0-00000.jsonl", b"x\n")
    stale = tmp_path / "results" / ".r0-00001.jsonl.0123456789abcdef.tmp"  # what a kill mid-write leaves
    fresh = tmp_path / ".manifest.json.fedcba9876543210.tmp"  # a write under way right now
    data = tmp_path / ".hidden-data.tmp"  # not ours: never touched
    for f in (stale, fresh, data):
        f.write_bytes(b"partial")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    os.utime(data, (time.time() - 3600, time.time() - 3600))
    assert fs.remove_stale_temp(f"file://{tmp_path}", older_than_s=600) == 1
    assert not stale.exists() and fresh.exists() and data.exists()
    assert (tmp_path / "results" / "r0-00000.jsonl").exists()


def test_split_lines_gives_each_line_with_the_offset_of_its_first_byte():
    rnd = random.Random(3)
    for _ in range(200):
        lines = [bytes(rnd.choice(b"ab\r{}") for _ in range(rnd.randint(0, 9))) for _ in range(rnd.randint(0, 8))]
        data = b"\n".join(lines) + rnd.choice([b"", b"\n"])
        base = rnd.randint(0, 100)
        got = [(off, line) for off, line, _ in split_lines(io.BytesIO(data), base, block=rnd.randint(1, 7))]
        want, off = [], base
        for part in data.split(b"\n")[: data.count(b"\n")]:
            want.append((off, part))
            off += len(part) + 1
        if not data.endswith(b"\n") and data:
            want.append((off, data.rsplit(b"\n", 1)[-1]))
        assert got == want


def test_open_storage_shares_one_s3_client_per_endpoint(monkeypatch):
    a = open_storage("s3://b/k", {"endpointUrl": "http://127.0.0.1:9"})
    assert open_storage("s3://other/x", {"endpointUrl": "http://127.0.0.1:9"}) is a
    assert open_storage("s3://b/k", {"endpointUrl": "http://127.0.0.1:10"}) is not a
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # as the Job gives it to a worker
    assert open_storage("s3://b/k", None) is a


def test_open_storage_picks_by_scheme_and_rejects_others():
    assert isinstance(open_storage("file:///x", None), FileStorage)
    assert isinstance(open_storage("s3://b/k", {"endpointUrl": "http://127.0.0.1:9"}), S3Storage)
    with pytest.raises(StorageError, match="wasbs://b/k.*use file://, s3://, gs:// or az://"):
        open_storage("wasbs://b/k", None)
    with pytest.raises(StorageError, match="no bucket"):
        split_s3("s3:///k")


@pytest.mark.parametrize("uri, s3, message", [
    ("s3:///", None, "has no bucket: use s3://bucket/prefix"),
    ("gs:///k", None, "has no bucket: use gs://bucket/prefix"),
    ("file://", None, "has no path: use file:///absolute/path"),
    ("s3://b/k", {"endpointUrl": "not a url::"}, "endpointUrl .* is not a usable endpoint"),
])
def test_a_uri_or_endpoint_that_can_never_work_is_one_permanent_error(uri, s3, message):
    with pytest.raises(StorageError, match=message) as e:
        open_storage(uri, s3)
    assert e.value.permanent and "\n" not in str(e.value)


# --- s3:// on the S3 server -----------------------------------------------------------------------


class Spy:
    """A boto3 client wrapper that records calls and can inject failures or broken bodies."""

    def __init__(self, client: Any):
        self.client = client
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.fail: dict[str, list[BaseException]] = {}
        self.break_bodies: list[tuple[int, BaseException]] = []  # (bytes delivered, then this error)

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.client, name)

        def call(**kwargs: Any) -> Any:
            self.calls.append((name, kwargs))
            if self.fail.get(name):
                raise self.fail[name].pop(0)
            out = method(**kwargs)
            if name == "get_object" and self.break_bodies:
                after, exc = self.break_bodies.pop(0)
                out = {**out, "Body": BreakingBody(out["Body"], after, exc)}
            return out

        return call


class BreakingBody:
    def __init__(self, body: Any, after: int, exc: BaseException):
        self.body, self.left, self.exc = body, after, exc

    def read(self, n: int = -1) -> bytes:
        if self.left <= 0:
            raise self.exc
        data = self.body.read(min(n, self.left) if n and n > 0 else self.left)
        self.left -= len(data)
        return data

    def close(self) -> None:
        self.body.close()


@pytest.fixture
def s3(s3_place: Any) -> tuple[S3Storage, Spy, str]:
    spy = Spy(s3_place.storage.client)
    return S3Storage(client=spy, base_delay=0.001), spy, s3_place.base


def test_s3_list_pages_past_1000_keys_with_sizes(s3):
    st, spy, base = s3
    sizes = {f"{base}many/k{i:05d}.jsonl": i % 17 + 1 for i in range(1005)}
    with ThreadPoolExecutor(8) as pool:  # 1005 PUTs, a few at a time
        list(pool.map(lambda item: spy.client.put_object(Bucket=split_s3(item[0])[0], Key=split_s3(item[0])[1],
                                                         Body=b"x" * item[1]), sizes.items()))
    got = st.list(base + "many/")
    assert [(o.uri, o.size) for o in got] == sorted(sizes.items())
    assert sum(1 for name, _ in spy.calls if name == "list_objects_v2") == 2


def test_s3_list_of_a_prefix_does_not_take_sibling_names(s3):
    st, _, base = s3
    # (A key that is both an object and a folder, "docs" beside "docs/a.jsonl", exists on AWS S3 but not on a
    # file-system backed server such as versitygw's posix backend: the object named alone is "one".)
    for key in ("docs/a.jsonl", "docs/sub/b.jsonl", "docs-old/c.jsonl", "docsx.jsonl", "one", "one-more", "onex/y"):
        st.write_bytes(base + key, b"1")
    assert [o.uri[len(base):] for o in st.list(base + "docs")] == ["docs/a.jsonl", "docs/sub/b.jsonl"]
    assert [o.uri[len(base):] for o in st.list(base + "docs/")] == ["docs/a.jsonl", "docs/sub/b.jsonl"]
    assert [o.uri[len(base):] for o in st.list(base + "one")] == ["one"]


def test_a_conditional_create_is_won_by_exactly_one_of_racing_writers(place):
    # What a shard's claim rests on: O_EXCL on file://, If-None-Match: * on S3 (the server's, not ours).
    uri = place.uri("claims/00003-0.json")
    barrier = threading.Barrier(8)

    def race(i: int) -> bool:
        barrier.wait()
        return bool(place.storage.create(uri, f"writer {i}".encode()))

    with ThreadPoolExecutor(8) as pool:
        won = list(pool.map(race, range(8)))
    assert won.count(True) == 1
    assert place.storage.read_bytes(uri) == f"writer {won.index(True)}".encode()
    assert not place.storage.create(uri, b"late")


def test_s3_ranged_reads_start_at_the_byte(s3):
    st, _, base = s3
    data = bytes(range(256)) * 40
    st.write_bytes(base + "r.bin", data)
    for start in (0, 1, 255, 5000, len(data) - 1):
        with st.open_read(base + "r.bin", start) as f:
            assert f.read() == data[start:]


@pytest.mark.parametrize("scheme", ["file", "s3", "gs"])
def test_a_ranged_read_gives_exactly_the_slice_asked_for_in_one_request(scheme, request):
    place = request.getfixturevalue(f"{scheme}_place")
    st = place.storage
    data = bytes(range(256)) * 40
    st.write_bytes(place.uri("r.bin"), data)
    for start, length in ((0, 16), (1, 1), (255, 3000), (len(data) - 5, 5), (len(data) - 5, 100), (7, 0)):
        assert st.read_range(place.uri("r.bin"), start, length) == data[start:start + length], (start, length)
    if scheme != "file":  # one GET with the bytes asked for, never the rest of the object
        spy = Spy(st.client)
        ranged = S3Storage(client=spy, base_delay=0.001)
        assert ranged.read_range(place.uri("r.bin"), 100, 10) == data[100:110]
        calls = [kw for name, kw in spy.calls if name == "get_object"]
        assert [kw["Range"] for kw in calls] == ["bytes=100-109"]
    with pytest.raises(NotFound):
        st.read_range(place.uri("none.bin"), 0, 16)


def test_s3_write_replaces_the_whole_object_and_a_missing_key_is_not_found(s3):
    st, _, base = s3
    st.write_bytes(base + "o.json", b"first version")
    st.write_bytes(base + "o.json", b"2nd")
    assert st.read_bytes(base + "o.json") == b"2nd"
    assert st.exists(base + "o.json") and not st.exists(base + "none.json")
    st.delete(base + "o.json")
    with pytest.raises(NotFound, match="none.json"):
        st.read_bytes(base + "none.json")
    with pytest.raises(StorageError, match="append"):
        st.append_durable(base + "x", b"1")


def test_s3_a_missing_bucket_fails_at_once_naming_the_uri(s3_endpoint):
    st = S3Storage(endpoint_url=s3_endpoint, base_delay=0.001)
    with pytest.raises(StorageError, match=r"s3://no-such-bucket-here/k.*NoSuchBucket") as e:
        st.write_bytes("s3://no-such-bucket-here/k", b"1")
    assert not isinstance(e.value, NotFound)


def test_a_refusal_by_the_server_names_the_uri_and_the_access_key_id_never_the_secret(s3_tenant, s3_service,
                                                                                      monkeypatch):
    uri = s3_tenant.place.write_jsonl("in/a.jsonl", [{"id": 1, "text": "a"}])
    owner = s3_tenant.identity
    cases = [
        (s3_service.add_user(f"other-{os.urandom(4).hex()}"), uri, "AccessDenied"),  # a bucket not its own
        (Identity(owner.access_key, "0" * 32), uri, "SignatureDoesNotMatch"),  # a wrong secret
        (Identity(f"unknown-{os.urandom(4).hex()}", owner.secret_key), uri, "InvalidAccessKeyId"),
        (owner, "s3://bij-no-such-bucket-here/in/", "NoSuchBucket"),
    ]
    for who, target, code in cases:
        for k, v in who.env().items():
            monkeypatch.setenv(k, v)
        st = open_storage(target, {"endpointUrl": s3_tenant.place.endpoint})
        with pytest.raises(StorageRefused) as e:
            st.list(target)
        message = str(e.value)
        assert e.value.permanent and code in message and target in message, message
        assert f"as access key id {who.access_key}:" in message and who.secret_key not in message
    for k, v in owner.env().items():
        monkeypatch.setenv(k, v)
    assert open_storage(uri, {"endpointUrl": s3_tenant.place.endpoint}).read_bytes(uri) == b'{"id": 1, "text": "a"}\n'


@pytest.mark.parametrize("exc", [
    ResponseStreamingError(error=ConnectionResetError("reset")),
    IncompleteReadError(actual_bytes=10, expected_bytes=20),
    ConnectionResetError("Connection reset by peer"),
], ids=["streaming-error", "incomplete-read", "connection-reset"])
def test_s3_a_broken_stream_resumes_from_the_byte_it_reached(s3, exc):
    st, spy, base = s3
    data = os.urandom(100_000)
    st.write_bytes(base + "big.bin", data)
    spy.break_bodies = [(30_000, exc), (1, exc)]
    with st.open_read(base + "big.bin", 7) as f:
        assert f.read() == data[7:]
    ranges = [kw.get("Range") for name, kw in spy.calls if name == "get_object"]
    assert ranges == ["bytes=7-", "bytes=30007-", "bytes=30008-"]


def test_s3_a_read_resumes_through_a_proxy_that_drops_connections_mid_body(s3_place):
    from s3server.faults import FaultProxy

    data = os.urandom(3 << 20)
    uri = s3_place.uri("big.bin")
    s3_place.storage.write_bytes(uri, data)
    with FaultProxy(int(s3_place.endpoint.rsplit(":", 1)[1])) as proxy:
        st = S3Storage(endpoint_url=proxy.url, base_delay=0.01)
        proxy.cut_gets(after_bytes=300_000, times=2)
        with st.open_read(uri, 5) as f:
            assert f.read() == data[5:]
    assert proxy.cut == 2 and len(proxy.ranges) == 3 and proxy.ranges[0] == "bytes=5-"
    starts = [int(r.split("=")[1].rstrip("-")) for r in proxy.ranges if r]
    assert starts == sorted(starts) and 5 < starts[1] < starts[2] < len(data)  # each resumes where it broke


# --- retries, with a scripted client --------------------------------------------------------------


def client_error(code: str, status: int) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": f"{code} happened"},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")


class Scripted:
    """A fake S3 client: each call pops the next outcome (an exception to raise, or a value to return)."""

    def __init__(self, *outcomes: Any):
        self.outcomes = list(outcomes)
        self.calls = 0

    def put_object(self, **kwargs: Any) -> Any:
        return self._next()

    def list_objects_v2(self, **kwargs: Any) -> Any:
        return self._next()

    def _next(self) -> Any:
        self.calls += 1
        out = self.outcomes.pop(0)
        if isinstance(out, BaseException):
            raise out
        return out


@pytest.fixture
def delays(monkeypatch) -> list[float]:
    slept: list[float] = []
    # The retries' backoff (storage.objects.retrying) and a broken read's (the resuming stream in storage.s3).
    monkeypatch.setattr(storage.objects, "time", SimpleNamespace(sleep=slept.append))
    monkeypatch.setattr(storage.s3, "time", SimpleNamespace(sleep=slept.append))
    return slept


@pytest.mark.parametrize("exc", [
    client_error("SlowDown", 503), client_error("InternalError", 500), client_error("ServiceUnavailable", 503),
    client_error("Throttling", 400), client_error("TooManyRequests", 429), client_error("RequestTimeout", 400),
    EndpointConnectionError(endpoint_url="http://s3"), ConnectionClosedError(endpoint_url="http://s3"),
    ReadTimeoutError(endpoint_url="http://s3"), ConnectionResetError("reset"),
], ids=lambda e: type(e).__name__ + ("-" + e.response["Error"]["Code"] if isinstance(e, ClientError) else ""))
def test_errors_that_can_pass_are_retried_with_growing_backoff(exc, delays):
    client = Scripted(exc, exc, exc, {})
    S3Storage(client=client, base_delay=1.0).write_bytes("s3://b/k", b"x")
    assert client.calls == 4
    # base * 2^(n-1), jittered by 0.5 to 1.5
    for n, d in enumerate(delays, start=1):
        assert 0.5 * 2 ** (n - 1) <= d <= 1.5 * 2 ** (n - 1)


@pytest.mark.parametrize("code,status", [("AccessDenied", 403), ("NoSuchBucket", 404), ("InvalidAccessKeyId", 403),
                                         ("SignatureDoesNotMatch", 403)])
def test_permanent_errors_fail_at_once_with_a_message_naming_the_uri(code, status, delays):
    client = Scripted(client_error(code, status), {})
    with pytest.raises(StorageError) as e:
        S3Storage(client=client).write_bytes("s3://bucket/some/key.jsonl", b"x")
    assert "s3://bucket/some/key.jsonl" in str(e.value) and code in str(e.value)
    assert client.calls == 1 and delays == []


def test_a_missing_key_is_not_found_without_retries(delays):
    client = Scripted(client_error("NoSuchKey", 404))
    with pytest.raises(NotFound, match="s3://b/k"):
        S3Storage(client=client).write_bytes("s3://b/k", b"x")
    assert client.calls == 1


def test_retries_give_up_after_max_attempts_naming_the_uri(delays):
    client = Scripted(*[client_error("SlowDown", 503)] * 4)
    with pytest.raises(StorageError, match=r"s3://b/p.*still failing after 4 attempts.*SlowDown"):
        S3Storage(client=client, max_attempts=4).list("s3://b/p")
    assert client.calls == 4 and len(delays) == 3


def test_list_follows_continuation_tokens_after_a_retry(delays):
    client = Scripted(
        {"Contents": [{"Key": "p/a.jsonl", "Size": 3}], "IsTruncated": True, "NextContinuationToken": "t1"},
        client_error("InternalError", 500),
        {"Contents": [{"Key": "p/b.jsonl", "Size": 4}, {"Key": "p/dir/", "Size": 0}], "IsTruncated": False},
    )
    got = S3Storage(client=client).list("s3://b/p/")
    assert [(o.uri, o.size) for o in got] == [("s3://b/p/a.jsonl", 3), ("s3://b/p/b.jsonl", 4)]


def test_a_long_line_is_split_in_linear_time():
    # The same 16 MiB, once as short lines and once as one line, read in small blocks: a splitter that
    # re-joins and re-searches its buffer on every read takes thousands of times longer on the long line.
    n, block = 16 << 20, 4096
    short_lines = (b"x" * 99 + b"\n") * (n // 100)
    one_line = b"y" * n + b"\n"
    t = time.perf_counter()
    assert sum(1 for _ in split_lines(io.BytesIO(short_lines), 0, block)) == n // 100
    anchor = time.perf_counter() - t
    t = time.perf_counter()
    assert list(split_lines(io.BytesIO(one_line), 7, block)) == [(7, one_line[:-1], n)]
    assert time.perf_counter() - t < 5 * anchor + 0.5


def test_a_line_over_the_limit_is_reported_by_length_and_never_held():
    import tracemalloc

    data = b"a\n" + b"z" * (32 << 20) + b"\nb\n" + b"tail-without-newline" * 100
    tracemalloc.start()
    try:
        got = [(off, line if line is None or len(line) < 10 else len(line), n)
               for off, line, n in split_lines(io.BytesIO(data), 0, 1 << 16, max_line=1 << 20)]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got == [(0, b"a", 1), (2, None, 32 << 20), (3 + (32 << 20), b"b", 1), (5 + (32 << 20), 2000, 2000)]
    assert peak < 4 << 20  # the 32 MiB line was dropped as it was read


def test_reading_a_version_that_was_replaced_is_refused(place):
    from bij.storage import ObjectChanged

    uri = place.uri("in/a.jsonl")
    place.storage.write_bytes(uri, b'{"id": 1}\n')
    (info,) = place.storage.list(uri)
    with place.storage.open_read(uri, 0, info.version) as f:
        assert f.read() == b'{"id": 1}\n'
    time.sleep(0.05)  # past a tick of the kernel's coarse clock, which stamps mtimes
    place.storage.write_bytes(uri, b'{"id": 2}\n')
    with pytest.raises(ObjectChanged, match="after the job was planned"):
        with place.storage.open_read(uri, 3, info.version) as f:
            f.read()


def test_split_lines_with_a_limit_agrees_with_a_plain_split():
    rnd = random.Random(5)
    for _ in range(500):
        lines = [bytes(rnd.choice(b"ab{}") for _ in range(rnd.randint(0, 12))) for _ in range(rnd.randint(0, 8))]
        data = b"\n".join(lines) + rnd.choice([b"", b"\n"])
        limit = rnd.choice([None, 0, 1, 3, 6, 20])
        got = list(split_lines(io.BytesIO(data), 10, block=rnd.randint(1, 9), max_line=limit))
        parts = data.split(b"\n")
        if data.endswith(b"\n") or not data:
            parts = parts[:-1]
        want, off = [], 10
        for part in parts:
            want.append((off, part if limit is None or len(part) <= limit else None, len(part)))
            off += len(part) + 1
        assert got == want, (data, limit)


def test_lines_split_a_block_at_a_time_are_the_lines_split_one_by_one():
    from bij.worker.reader import split_blocks

    rnd = random.Random(5)
    for _ in range(2000):
        parts = [rnd.choice([b"", b" ", b"ab", b"x" * rnd.randint(0, 30), b"\r", b"a\r", "é".encode()])
                 for _ in range(rnd.randint(0, 12))]
        data = b"\n".join(parts) + rnd.choice([b"", b"\n", b"tail"])
        base, block, limit = rnd.randint(0, 5), rnd.randint(1, 9), rnd.choice([None, 3, 10])
        got = []
        for pos, lines, lengths in split_blocks(io.BytesIO(data), base, block, max_line=limit):
            for line, n in zip(lines, lengths, strict=True):
                got.append((pos, line, n))
                pos += n + 1
        assert got == list(split_lines(io.BytesIO(data), base, block, max_line=limit)), (data, block, limit)


def test_a_shard_read_in_blocks_keeps_every_line_at_its_place_and_leaves_blank_lines_out(tmp_path):
    from bij.contract.plan import PlanObject
    from bij.worker.reader import InputProblem, iter_shard, iter_shard_blocks

    lines = [b'{"id": 1}', b"", b"  ", b"crlf\r", b"x" * 40, "é".encode(), b"\t", b"last"]
    data = b"\n".join(lines)
    path = tmp_path / "in.jsonl"
    path.write_bytes(data)
    objects = [PlanObject(uri=path.as_uri(), size=len(data))]
    fs = FileStorage()
    want, off = [], 0
    for line in lines:
        if line.strip():
            kept = InputProblem("line_too_long", "") if len(line) > 20 else line.removesuffix(b"\r")
            want.append(((0, off, off + len(line) + 1), kept))
        off += len(line) + 1
    for cut in range(len(data) + 1):  # two pieces, cut anywhere: each line read once, at its place
        pieces = [[0, 0, cut], [0, cut, len(data)]]
        got = list(iter_shard(lambda uri: fs, objects, pieces, max_line=20))
        assert [(at, line if isinstance(line, bytes) else InputProblem("line_too_long", ""))
                for at, line in got] == want
        blocks = list(iter_shard_blocks(lambda uri: fs, objects, pieces, max_line=20))
        assert [size for _, _, sizes in blocks for size in sizes] == [at[2] - at[1] for at, _ in want]


# --- gs:// : Google Cloud Storage's XML API (the S3 server stands in for storage.googleapis.com) --------------


def test_gs_goes_to_the_gcs_endpoint_whatever_the_s3_settings_say(monkeypatch):
    monkeypatch.delenv("BIJ_GCS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("BIJ_GCS_REGION", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # another S3 store's: never GCS's
    st = open_storage("gs://b/k", {"endpointUrl": "http://127.0.0.1:10", "region": "eu-west-3"})
    assert isinstance(st, S3Storage) and st.scheme == "gs"
    assert st.client.meta.endpoint_url == "https://storage.googleapis.com"
    assert st.client.meta.region_name == "auto"
    assert open_storage("gs://other/x", None) is st
    monkeypatch.setenv("BIJ_GCS_ENDPOINT_URL", "http://127.0.0.1:11")  # a private or stand-in endpoint
    assert open_storage("gs://b/k", None).client.meta.endpoint_url == "http://127.0.0.1:11"
    monkeypatch.setenv("BIJ_GCS_ENDPOINT_URL", "not a url::")
    with pytest.raises(StorageError, match="BIJ_GCS_ENDPOINT_URL 'not a url::' is not a usable endpoint") as e:
        open_storage("gs://b/k", None)
    assert e.value.permanent


def test_gs_round_trip_sends_only_what_the_gcs_xml_api_takes(gs_place, monkeypatch):
    import bij.storage.base as storage_base

    st = S3Storage(endpoint_url=gs_place.endpoint, region="us-east-1", scheme="gs", base_delay=0.001)
    sent: list[tuple[str, str, dict[str, str]]] = []
    st.client.meta.events.register("before-send.s3", lambda request, **_: sent.append(
        (request.method, request.url, {k.lower(): v for k, v in request.headers.items()})))
    claim = gs_place.uri("claims/00001-0.json")
    assert st.create(claim, b"first")
    assert not st.create(claim, b"second")
    assert st.read_bytes(claim) == b"first"
    # "Only if none exists" as GCS says it (its XML API applies If-None-Match to reads only) and as S3 does.
    creates = [h for m, url, h in sent if m == "PUT" and url.endswith(claim.rsplit("/", 1)[1])]
    assert len(creates) >= 2  # one per create, or more where botocore sent one again
    assert all(h["if-none-match"] == b"*" and h["x-goog-if-generation-match"] == b"0" for h in creates)
    monkeypatch.setattr(storage_base, "MULTIPART_BYTES", 5 << 20)
    big = gs_place.uri("out/big.jsonl")
    parts = [bytes([65 + i]) * (1 << 20) for i in range(11)]
    assert st.write_stream(big, iter(parts)) == 11 << 20  # a multipart upload: GCS's XML API has it
    assert st.read_bytes(big) == b"".join(parts)
    with st.open_read(big, start=(11 << 20) - 3, version=st.list(big)[0].version) as f:
        assert f.read() == b"KKK"
    assert [o.uri for o in st.list(gs_place.base)] == [claim, big]
    assert any("uploadId=" in url for _, url, _ in sent)
    assert all(url.startswith(gs_place.endpoint) for _, url, _ in sent)
    # botocore's default CRC32 checksums are no part of GCS's XML API: sent only where an operation needs one.
    assert not [h for _, _, h in sent if any(k.startswith(("x-amz-checksum-", "x-amz-sdk-checksum")) for k in h)]
    st.delete(claim)
    assert not st.exists(claim)


def test_gs_create_falls_back_to_check_then_write_where_gcs_refuses_its_precondition_header(gs_place):
    from botocore.exceptions import ClientError

    real = gs_place.storage.client

    class Refusing:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def put_object(self, **kw: Any) -> Any:
            if "IfNoneMatch" in kw:
                raise ClientError({"Error": {"Code": "ExcessHeaderValues", "Message": "x-goog-if-generation-match"},
                                   "ResponseMetadata": {"HTTPStatusCode": 400}}, "PutObject")
            return real.put_object(**kw)

    st = S3Storage(client=Refusing(), scheme="gs", base_delay=0.001)
    uri = gs_place.uri("claims/owner.json")
    assert st.create(uri, b"first")
    assert not st.create(uri, b"second")
    assert st.read_bytes(uri) == b"first"
    plain_s3 = S3Storage(client=Refusing(), base_delay=0.001)  # on s3:// that code is an error like any other
    with pytest.raises(StorageError, match="ExcessHeaderValues"):
        plain_s3.create(gs_place.uri("claims/other.json"), b"x")


def test_a_listing_that_pages_without_a_token_goes_on_after_the_last_key():
    pages = {None: {"IsTruncated": True, "Contents": [{"Key": "p/a", "Size": 1}, {"Key": "p/b", "Size": 2}]},
             "p/b": {"IsTruncated": False, "Contents": [{"Key": "p/c", "Size": 3}]}}
    asked: list[dict[str, Any]] = []

    class Client:
        def list_objects_v2(self, **kw: Any) -> dict[str, Any]:
            asked.append(kw)
            return pages[kw.get("StartAfter")]

    st = S3Storage(client=Client(), scheme="gs")
    assert [(o.uri, o.size) for o in st.list("gs://b/p/")] == [("gs://b/p/a", 1), ("gs://b/p/b", 2), ("gs://b/p/c", 3)]
    assert [kw.get("StartAfter") for kw in asked] == [None, "p/b"]


def test_file_list_pages_stream_every_object_in_pages_and_delete_many_takes_them_all(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(storage.base, "PAGE", 4)
    for d in ("a", "a/deep", "b"):
        (tmp_path / d).mkdir()
        for i in range(5):
            (tmp_path / d / f"f{i}").write_bytes(b"x" * i)
    fs = FileStorage()
    pages = list(fs.list_pages(f"file://{tmp_path}"))
    assert all(len(p) <= 4 for p in pages) and len(pages) == 4
    found = sorted((o.uri, o.size) for p in pages for o in p)
    assert found == [(o.uri, o.size) for o in fs.list(f"file://{tmp_path}")]
    missing = f"file://{tmp_path}/never-there"  # gone already: no error
    assert fs.delete_many([uri for uri, _ in found] + [missing]) == {}
    assert fs.list(f"file://{tmp_path}") == [] and list(fs.list_pages(f"file://{tmp_path}/nothing")) == []


def test_s3_delete_many_sends_1000_keys_a_request_and_a_missing_key_is_no_error(s3):
    st, spy, base = s3
    uris = [f"{base}del/k{i:05d}" for i in range(2005)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda u: spy.client.put_object(Bucket=split_s3(u)[0], Key=split_s3(u)[1], Body=b"x"), uris))
    pages = list(st.list_pages(base + "del/"))
    assert [len(p) for p in pages] == [1000, 1000, 5]
    spy.calls.clear()
    assert st.delete_many([o.uri for p in pages for o in p] + [f"{base}del/never-there"]) == {}
    assert sum(1 for name, _ in spy.calls if name == "delete_objects") == 3  # ceil(2006 / 1000)
    assert st.list(base + "del/") == []


def test_s3_delete_many_reports_the_keys_the_store_would_not_delete(s3, monkeypatch):
    st, spy, base = s3
    _, key = split_s3(base + "kept")
    real = spy.client.delete_objects
    # (The client is shared by the session's tests: monkeypatch puts it back.)
    monkeypatch.setattr(spy.client, "delete_objects", lambda **kw: {**real(**kw), "Errors": [
        {"Key": key, "Code": "AccessDenied", "Message": "Access Denied"},
        {"Key": "gone", "Code": "NoSuchKey", "Message": "gone already"}]})
    assert st.delete_many([base + "kept"]) == {base + "kept": "AccessDenied: Access Denied"}
