"""az:// (Azure Blob Storage) against Azurite: the storage contract every writable scheme keeps, Shared Key
and SAS signing, and errors that name the blob and the account, never the key."""

from __future__ import annotations

import io
import threading
from concurrent.futures import ThreadPoolExecutor

import azureserver
import pytest

from bij.storage import NotFound, ObjectChanged, StorageError, StorageRefused, open_storage
from bij.storage.azure import Account, AzureStorage, split_az


def test_a_blob_round_trips_and_lists_with_its_size_and_etag(az_place):
    st = az_place.storage
    uri = az_place.uri("in/a.jsonl")
    st.write_bytes(uri, b'{"id": 1}\n')
    st.write_bytes(az_place.uri("in/b/c.jsonl"), b"xyz")
    st.write_bytes(az_place.uri("in-old/x.jsonl"), b"sibling")  # a sibling prefix is never taken
    listed = st.list(az_place.uri("in"))
    assert [(o.uri, o.size) for o in listed] == [(uri, 10), (az_place.uri("in/b/c.jsonl"), 3)]
    assert all(o.version for o in listed)
    assert st.read_bytes(uri) == b'{"id": 1}\n'
    assert st.exists(uri) and not st.exists(az_place.uri("in/nope"))
    with pytest.raises(NotFound, match="nope"):
        st.read_bytes(az_place.uri("in/nope"))
    st.delete(uri)
    st.delete(uri)  # gone already: no error
    assert not st.exists(uri)


def test_reads_start_at_a_byte_and_a_range_is_exactly_the_slice(az_place):
    st = az_place.storage
    uri = az_place.uri("f")
    st.write_bytes(uri, b"0123456789")
    with st.open_read(uri, 4) as f:
        assert f.read() == b"456789"
    assert st.read_range(uri, 2, 3) == b"234"
    assert st.read_range(uri, 8, 100) == b"89"
    assert st.read_range(uri, 0, 0) == b""


def test_a_replaced_blob_is_never_read_as_the_planned_version(az_place):
    st = az_place.storage
    uri = az_place.uri("in/a.jsonl")
    st.write_bytes(uri, b"old\n")
    planned = st.list(uri)[0].version
    with st.open_read(uri, 0, planned) as f:
        assert f.read() == b"old\n"
    st.write_bytes(uri, b"new\n")
    with pytest.raises(ObjectChanged, match="replaced"):
        st.open_read(uri, 0, planned).read()


def test_a_conditional_create_is_won_by_exactly_one_of_racing_writers(az_place):
    st = az_place.storage
    uri = az_place.uri("claims/owner.json")
    barrier = threading.Barrier(8)

    def claim(i: int) -> bool:
        barrier.wait()
        return bool(st.create(uri, f"writer {i}".encode()))

    with ThreadPoolExecutor(8) as pool:
        won = list(pool.map(claim, range(8)))
    assert won.count(True) == 1
    assert st.read_bytes(uri) == f"writer {won.index(True)}".encode()


def test_a_streamed_write_commits_its_blocks_whole_and_a_failed_one_leaves_nothing(az_place, monkeypatch):
    import bij.storage.base as storage_base

    monkeypatch.setattr(storage_base, "MULTIPART_BYTES", 1 << 20)
    st = az_place.storage
    uri = az_place.uri("files/big.jsonl")
    parts = [bytes([65 + i % 26]) * (600 << 10) for i in range(7)] + [b"tail\n"]
    assert st.write_stream(uri, iter(parts)) == sum(map(len, parts))
    assert st.read_bytes(uri) == b"".join(parts)

    def broken():
        yield b"x" * (2 << 20)
        raise OSError("the producer failed")

    half = az_place.uri("files/half.jsonl")
    with pytest.raises(OSError, match="producer"):
        st.write_stream(half, broken())
    assert not st.exists(half)  # staged blocks are never a blob


def test_listing_pages_past_1000_blobs_and_delete_many_takes_them_all(az_place):
    st = az_place.storage
    uris = [az_place.uri(f"many/{i:05d}") for i in range(1003)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda u: st.write_bytes(u, b"."), uris))
    pages = list(st.list_pages(az_place.uri("many/")))
    assert len(pages) == 2 and sorted(o.uri for p in pages for o in p) == uris
    assert st.delete_many(uris + [az_place.uri("many/missing")]) == {}
    assert st.list(az_place.uri("many/")) == []


def test_blobs_are_never_appended_to(az_place):
    assert not az_place.storage.supports_append
    with pytest.raises(StorageError, match="segments"):
        az_place.storage.append_durable(az_place.uri("log"), b"a\n")


def test_a_wrong_key_is_refused_naming_the_blob_and_the_account_never_the_key(az_place, az_service, monkeypatch):
    wrong = "A" * 86 + "=="
    monkeypatch.setenv("AZURE_STORAGE_KEY", wrong)
    st = open_storage(az_place.base, None)
    with pytest.raises(StorageRefused) as e:
        st.read_bytes(az_place.uri("x"))
    assert az_place.uri("x") in str(e.value) and azureserver.ACCOUNT in str(e.value)
    assert wrong not in str(e.value) and azureserver.KEY not in str(e.value)


def test_a_missing_container_fails_at_once_naming_it(az_service, monkeypatch):
    for k, v in az_service.env().items():
        monkeypatch.setenv(k, v)
    st = AzureStorage(Account.from_env(az_service.env()), base_delay=0.01)
    with pytest.raises(StorageError, match="no-such-container") as e:
        st.write_bytes("az://no-such-container/x", b".")
    assert e.value.permanent


def test_no_account_in_the_environment_says_which_variables_to_set(monkeypatch):
    for k in ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT", "AZURE_STORAGE_KEY",
              "AZURE_STORAGE_SAS_TOKEN", "AZURE_STORAGE_BLOB_ENDPOINT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(StorageRefused, match="AZURE_STORAGE_CONNECTION_STRING"):
        open_storage("az://c/x", None)
    with pytest.raises(StorageError, match="az://container/path"):
        split_az("az:///x")


def test_a_connection_string_names_the_account_and_its_endpoint():
    conn = (f"DefaultEndpointsProtocol=http;AccountName={azureserver.ACCOUNT};AccountKey={azureserver.KEY};"
            "BlobEndpoint=http://127.0.0.1:10000/devstoreaccount1;")
    account = Account.from_env({"AZURE_STORAGE_CONNECTION_STRING": conn})
    assert (account.name, account.endpoint) == (azureserver.ACCOUNT, "http://127.0.0.1:10000/devstoreaccount1")
    cloud = Account.from_env({"AZURE_STORAGE_CONNECTION_STRING": "AccountName=acme;SharedAccessSignature=sv=x&sig=y"})
    assert (cloud.endpoint, cloud.key, cloud.sas) == ("https://acme.blob.core.windows.net", None, "sv=x&sig=y")


@pytest.mark.parametrize("cut", ["reset", "eof"])
def test_a_broken_read_resumes_from_the_byte_it_reached(az_place, monkeypatch, cut):
    """A connection reset, or a body that ends early as a plain EOF (what http.client gives for a cut
    body), is reopened at the byte reached, of the same version."""
    st = az_place.storage
    uri = az_place.uri("big")
    data = bytes(range(256)) * 4096
    st.write_bytes(uri, data)
    opened: list[int] = []
    real_get = st._get

    class Breaking(io.RawIOBase):
        def __init__(self, body):
            self.body, self.sent = body, 0

        def getheader(self, name):
            return self.body.getheader(name)

        def readinto(self, b):
            if self.sent > 100_000 and len(opened) == 1:
                if cut == "eof":
                    return 0
                raise ConnectionResetError("reset by peer")
            n = self.body.readinto(b)
            self.sent += n
            return n

        def close(self):
            self.body.close()

    def get(u, start, version=None):
        opened.append(start)
        assert version is not None or not opened[:-1]  # a reopened read keeps the first response's ETag
        return Breaking(real_get(u, start, version))

    monkeypatch.setattr(st, "_get", get)
    with st.open_read(uri) as f:
        assert f.read() == data
    assert len(opened) == 2 and opened[1] > 100_000
