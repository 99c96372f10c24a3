"""hf:// inputs: files of a Hugging Face Hub dataset, through `huggingface_hub` and its cache.

Nothing here reaches the Hub: the dataset is put into a cache folder in the Hub's own layout (blobs,
refs, snapshots per commit), as an air-gapped cluster pre-fills its cache, and `HF_HUB_OFFLINE=1` makes
`huggingface_hub` resolve revisions and files from it alone. (Listing a dataset on the Hub itself goes
through `HfApi.list_repo_tree` and is not exercised here: no network.)"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from bij.storage import NotFound, StorageError, StorageRefused, open_storage
from bij.storage.hf import HfStorage, split_hf

REPO = "acme/prompts"


def put_commit(cache: Path, files: dict[str, bytes], branch: str = "main") -> str:
    """One commit of dataset `REPO` in the Hub cache's layout; `branch` points at it. Returns its sha."""
    folder = cache / ("datasets--" + REPO.replace("/", "--"))
    sha = hashlib.sha1(json.dumps(sorted((k, v.hex()) for k, v in files.items())).encode()).hexdigest()  # noqa: S324
    for name, data in files.items():
        blob = folder / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = folder / "snapshots" / sha / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(Path("../" * (name.count("/") + 2)) / "blobs" / blob.name)
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / branch).write_text(sha)
    return sha


def lines(rows: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "hub"
    folder.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(folder))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    return folder


def test_an_hf_uri_names_a_dataset_its_revision_and_a_path() -> None:
    assert split_hf("hf://datasets/acme/prompts@v1/data/train.jsonl") == ("acme/prompts", "v1", "data/train.jsonl")
    assert split_hf("hf://datasets/acme/prompts") == ("acme/prompts", None, "")
    with pytest.raises(StorageError, match="is a dataset"):
        split_hf("hf://models/acme/llama")


def test_listing_pins_every_object_to_the_commit_the_revision_had(cache: Path) -> None:
    first = put_commit(cache, {"data/a.jsonl": lines([{"id": 1, "text": "one"}]), "README.md": b"# x\n"})
    store = open_storage("hf://datasets/acme/prompts/data/", None)
    (obj,) = store.list("hf://datasets/acme/prompts/data/")
    assert (obj.uri, obj.size, obj.version) == ("hf://datasets/acme/prompts/data/a.jsonl", 25, first)
    # The branch moves on; a plan made before still reads the commit it recorded.
    second = put_commit(cache, {"data/a.jsonl": lines([{"id": 2, "text": "two"}])})
    assert store.list(obj.uri)[0].version == second != first
    with store.open_read(obj.uri, 0, first) as f:
        assert json.loads(f.read())["text"] == "one"
    assert json.loads(store.read_bytes(obj.uri))["text"] == "two"
    assert json.loads(store.read_bytes(f"hf://datasets/acme/prompts@{first}/data/a.jsonl"))["text"] == "one"


def test_what_is_not_there_is_named(cache: Path) -> None:
    store = HfStorage()
    with pytest.raises(StorageError, match="not in the local Hugging Face cache .* HF_HUB_OFFLINE"):
        store.list("hf://datasets/nobody/nothing/")
    put_commit(cache, {"a.jsonl": b'{"id": 1, "text": "x"}\n'})
    assert store.list("hf://datasets/acme/prompts/missing/") == []
    with pytest.raises((NotFound, StorageError)):
        store.read_bytes("hf://datasets/acme/prompts/missing.jsonl")
    with pytest.raises(StorageRefused, match="read-only"):
        store.write_bytes("hf://datasets/acme/prompts/out.jsonl", b"x")


def test_bij_run_answers_every_row_of_an_hf_dataset_glob(cache: Path, file_place: Any, make_job: Any,
                                                        read_output: Any, worker_env: Any, bij_bin: Any) -> None:
    train = [{"id": f"t{i}", "text": f"train {i} " + "y" * (i % 11)} for i in range(300)]
    test = [{"id": f"e{i}", "text": f"test {i}"} for i in range(20)]
    put_commit(cache, {"data/train-00000.jsonl": lines(train[:150]), "data/train-00001.jsonl": lines(train[150:]),
                       "data/test-00000.jsonl": lines(test)})
    spec, job = make_job(file_place, "hf://datasets/acme/prompts/data/train-*.jsonl",
                         sharding={"targetShardBytes": 2048, "minShardBytes": 1024})
    p = subprocess.run([bij_bin("bij"), "run", str(spec)], env=worker_env(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1"),
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    out = read_output(job)
    assert [(r["id"], r["output"]) for r in out.results] == [(r["id"], r["text"]) for r in train]
    assert len(out.manifest["files"]) >= 3
