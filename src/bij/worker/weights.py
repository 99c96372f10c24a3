"""Model weights named by an object-store prefix (`spec.model.name: s3://bucket/models/llama/`, or gs://):
listed when the lane starts, copied into the model cache once per node before the model loads
(`fetch.fetch_folder`: one process on a node copies, the others wait for it and use its copy), and loaded
from there by the engine as a local folder.

The folder is named by a digest of the prefix and of its listing (each object's path, size and version),
so weights rewritten under the same prefix are copied again into a folder of their own and never mixed
with an older copy.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bij.contract.errors import BijError
from bij.contract.schemes import REMOTE
from bij.storage import ObjectInfo, Storage, open_storage
from bij.worker.fetch import Fetched, fetch_folder


class WeightsError(BijError):
    """Weights that cannot be had: nothing under the prefix. No retry helps until the spec or the bucket changes."""

    permanent = True


def is_remote(name: str | None) -> bool:
    return bool(name) and str(name).startswith(REMOTE)


def cache_root() -> Path:
    """Beside the Hugging Face cache: the model cache volume in a pod (`workers.modelCache`)."""
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return Path(home) / "bij-weights"


@dataclass(frozen=True)
class Weights:
    """The weights under `folder` as listed, and the local folder they are (or will be) copied to."""

    store: Storage
    folder: str
    objects: list[ObjectInfo]
    path: Path

    def whole(self, path: Path) -> bool:
        """Every listed object is in `path`, at its size."""
        for o in self.objects:
            local = path / o.uri[len(self.folder):]
            if not local.is_file() or local.stat().st_size != o.size:
                return False
        return True

    def fetch(self) -> Fetched:
        return fetch_folder(self.store, self.folder, self.objects, self.path, self.whole)


def list_weights(uri: str, s3: Any) -> Weights:
    """The weights under prefix `uri`, from one listing; WeightsError where there are none."""
    folder = uri if uri.endswith("/") else uri + "/"
    store = open_storage(folder, s3)
    objects = sorted((o for o in store.list(folder) if not o.uri.endswith("/")), key=lambda o: o.uri)
    if not objects:
        raise WeightsError(f"spec.model.name {uri}: no objects under it; give the prefix the model's files "
                           "(config.json, the weights, the tokenizer) are under")
    digest = hashlib.sha256(folder.encode())
    for o in objects:
        digest.update(f"\0{o.uri[len(folder):]}\0{o.size}\0{o.version or ''}".encode())
    return Weights(store, folder, objects, cache_root() / digest.hexdigest()[:16])
