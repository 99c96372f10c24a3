"""Weights named by an object-store prefix (spec.model.name s3://...): copied into the model cache once per
node, whole or not at all, into a folder of their own per version, and loaded from there."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from bij.engines.sentence_transformers import default_model_path
from bij.worker.weights import WeightsError, list_weights

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")


class Counting:
    """A storage whose reads are counted, slowed and, from the `fail_at`th on, broken."""

    def __init__(self, inner: Any, delay: float = 0.0, fail_at: int = 0):
        self.inner, self.delay, self.fail_at, self.reads = inner, delay, fail_at, 0
        self.lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def open_read(self, uri: str, start: int = 0, version: str | None = None) -> Any:
        with self.lock:
            self.reads += 1
            n = self.reads
        if self.fail_at and n >= self.fail_at:
            raise OSError(f"connection reset reading {uri}")
        time.sleep(self.delay)
        return self.inner.open_read(uri, start, version)


def upload(place: Any, prefix: str, files: dict[str, bytes]) -> str:
    for rel, data in files.items():
        place.storage.write_bytes(place.uri(prefix, rel), data)
    return place.uri(prefix) + "/"


FILES = {"config.json": b'{"a": 1}', "model.safetensors": b"w" * 300_000, "tok/vocab.txt": b"a\nb\n"}


def test_lanes_on_one_node_copy_the_weights_once_and_all_load_that_copy(file_place, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "node-cache"))
    uri = upload(file_place, "models/m", FILES)
    weights = [list_weights(uri, None) for _ in range(4)]
    store = Counting(weights[0].store, delay=0.2)
    got: list[Any] = []
    threads = [threading.Thread(target=lambda w=w: got.append(
        type(w)(store, w.folder, w.objects, w.path).fetch())) for w in weights]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.reads == len(FILES)  # one copy for the four
    assert sorted(g.bytes for g in got) == [0, 0, 0, sum(map(len, FILES.values()))]
    (path,) = {g.path for g in got}
    assert {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()} == FILES


def test_a_copy_that_breaks_leaves_no_folder_and_the_next_lane_copies_it_whole(file_place, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "node-cache"))
    w = list_weights(upload(file_place, "models/m", FILES), None)
    broken = type(w)(Counting(w.store, fail_at=2), w.folder, w.objects, w.path)
    with pytest.raises(OSError, match="connection reset"):
        broken.fetch()
    assert not w.path.exists() and [p.name for p in w.path.parent.iterdir() if not p.name.endswith(".lock")] == []
    assert w.fetch().bytes == sum(map(len, FILES.values())) and w.whole(w.path)


def test_weights_rewritten_under_the_same_prefix_get_a_folder_of_their_own(file_place, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "node-cache"))
    uri = upload(file_place, "models/m", FILES)
    first = list_weights(uri, None)
    first.fetch()
    upload(file_place, "models/m", {"model.safetensors": b"v" * 300_001})
    second = list_weights(uri, None)
    assert second.path != first.path and second.fetch().bytes > 0
    assert (second.path / "model.safetensors").read_bytes() == b"v" * 300_001
    assert (first.path / "model.safetensors").read_bytes() == b"w" * 300_000  # a lane loading it keeps it


def test_a_prefix_with_nothing_under_it_is_refused_naming_it(file_place):
    with pytest.raises(WeightsError, match=r"spec.model.name .*models/none/: no objects under it"):
        list_weights(file_place.uri("models", "none") + "/", None)


@pytest.mark.parametrize("spec,ok", [
    ({"engine": "sentence-transformers", "name": "s3://b/models/m/"}, True),
    ({"engine": "vllm", "name": "gs://b/models/m/"}, True),
    ({"engine": "echo", "name": "s3://b/models/m/"}, False),
    ({"engine": "transformers", "task": "generate", "name": "https://example.com/m"}, False),
])
def test_a_model_named_by_a_uri_must_be_an_object_store_prefix_for_an_engine_that_loads_weights(spec, ok):
    from bij.contract.spec_model import ModelSpec

    if ok:
        ModelSpec.model_validate(spec)
    else:
        with pytest.raises(ValueError, match="model.name as a URI is the object-store prefix"):
            ModelSpec.model_validate(spec)


def test_bij_run_loads_weights_from_s3_once_per_node_and_embeds_as_the_local_model(
        s3_place, make_job, worker_env, bij_bin, read_output, tmp_path):
    local = Path(default_model_path())
    files = {str(p.relative_to(local)): p.read_bytes() for p in local.rglob("*") if p.is_file()}
    uri = upload(s3_place, "models/minilm", files)
    rows = [{"id": i, "text": f"sentence number {i}"} for i in range(20)]
    env = worker_env(s3_place, HF_HOME=str(tmp_path / "node-cache"))
    outputs = []
    for name, model in (("from-s3", uri), ("again", uri), ("local", str(local))):
        spec, job = make_job(s3_place, s3_place.write_jsonl(f"{name}.jsonl", rows), name=name, out_dir=f"{name}/",
                             model={"engine": "sentence-transformers", "task": "embed", "name": model})
        p = subprocess.run([bij_bin("bij"), "run", "--no-progress", str(spec)], env=env, capture_output=True,
                           text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        outputs.append(read_output(job))
    copied = [o.manifest["efficiency"]["weightsBytes"] for o in outputs]
    assert copied == [sum(map(len, files.values())), 0, 0]  # the second job found the node's copy
    embeddings = [[r["embedding"] for r in o.results] for o in outputs]
    assert embeddings[0] == embeddings[1] == embeddings[2]
    assert json.dumps(outputs[0].manifest["efficiency"]["slowestModelLoadSeconds"]) != "0"
