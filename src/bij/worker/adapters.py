"""LoRA adapters (`spec.model.adapters`): fetched once per pod into the model cache.

An adapter is a folder as PEFT saves it (`adapter_config.json` and the weights). A
``file://`` folder is used where it is; an ``s3://`` folder is copied into
``$HF_HOME/bij-adapters/<digest of its URI>/`` (the pod's model cache volume) once per node
(`fetch.fetch_folder`): a pod killed mid-copy leaves no half adapter, and the next pod on the node
reuses a finished one.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from bij.contract.errors import BijError
from bij.storage import open_storage
from bij.worker.fetch import fetch_folder


class AdapterError(BijError):
    """An adapter that cannot be fetched or is no adapter: no retry helps until the spec or the folder changes."""

    permanent = True


def cache_root() -> Path:
    """Where fetched adapters live: beside the Hugging Face cache (the model cache volume in a pod)."""
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return Path(home) / "bij-adapters"


def adapter_folders(adapters: list[Any]) -> dict[str, str]:
    """The local folder of each of the spec's adapters, by name: where a file:// one is, where an
    s3:// one will be once fetched (`fetch_adapters`). Nothing is read."""
    return {a.name: adapter_folder(a.uri) for a in adapters}


def adapter_folder(uri: str) -> str:
    """The local folder of the adapter at `uri` (fetched or not)."""
    if uri.startswith("file://"):
        return uri[len("file://"):]
    folder = uri if uri.endswith("/") else uri + "/"
    return str(cache_root() / hashlib.sha256(folder.encode()).hexdigest()[:16])


def fetch_adapters(adapters: list[Any], s3: Any = None) -> dict[str, str]:
    """Local folders of the spec's adapters, by name (fetching s3:// ones into the cache)."""
    return {a.name: fetch_adapter(a.name, a.uri, s3) for a in adapters}


def fetch_adapter(name: str, uri: str, s3: Any = None) -> str:
    """The local folder of adapter `name` at `uri` (`adapter_folder`), fetched when it is not local."""
    if uri.startswith("file://"):
        path = Path(adapter_folder(uri))
        _check(name, uri, path)
        return str(path)
    folder = uri if uri.endswith("/") else uri + "/"
    dest = Path(adapter_folder(uri))
    if (dest / "adapter_config.json").is_file():
        return str(dest)
    store = open_storage(folder, s3)
    objects = store.list(folder)
    if not objects:
        raise AdapterError(f"spec.model.adapters {name}: nothing at {folder}")
    try:
        fetch_folder(store, folder, objects, dest, lambda p: (p / "adapter_config.json").is_file())
    except ValueError:
        _check(name, uri, dest)  # says what is missing
        raise
    return str(dest)


def _check(name: str, uri: str, path: Path) -> None:
    if not (path / "adapter_config.json").is_file():
        raise AdapterError(f"spec.model.adapters {name}: {uri} is not a LoRA adapter folder "
                           "(no adapter_config.json, as PEFT's save_pretrained writes)")
