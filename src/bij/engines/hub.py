"""Where an engine's model comes from: a local directory, or a Hugging Face hub id.

A hub id loads where the environment allows it: from the model cache (``HF_HOME``, which
`workers.modelCache` points at) when it is there, else downloaded into it from the hub
(``HF_ENDPOINT``, huggingface.co by default). With ``HF_HUB_OFFLINE`` (or
``TRANSFORMERS_OFFLINE``) set nothing is downloaded: a model missing from the cache is then a
bad configuration that names the model, as is an id the hub does not have.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

_TRUE = {"1", "ON", "YES", "TRUE"}


class ModelUnavailable(ValueError):
    """The model cannot be had here, and no retry changes that (a ValueError: the worker exits 42)."""


def offline() -> bool:
    """Whether the environment forbids downloads (read as huggingface_hub and transformers read it)."""
    return any(os.environ.get(k, "").strip().upper() in _TRUE for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def is_local(name: str) -> bool:
    """A path on this machine rather than a hub id."""
    return name.startswith(("/", "./", "../", "~")) or os.path.isdir(name)


def cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def local_files_only(name: str) -> bool:
    """What to pass as ``local_files_only`` to load `name`: True for a local directory, and offline
    (ModelUnavailable, naming the model and the cache, when it is not in the cache); else False, so
    the loader downloads what it needs into the cache."""
    if is_local(name):
        return True
    if not offline():
        return False
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snapshot_download(name, local_files_only=True)
    except LocalEntryNotFoundError:
        raise ModelUnavailable(
            f"spec.model.name {name!r} is not a local directory and is not in the model cache ({cache_dir()}), "
            "and HF_HUB_OFFLINE forbids downloading it: put it in the cache (workers.modelCache), give a local "
            "path, or unset HF_HUB_OFFLINE") from None
    return True


@contextmanager
def loading(name: str) -> Iterator[None]:
    """Turn what the hub says no to for good (no such model, a gated one) into ModelUnavailable naming
    `name`; a network error stays an OSError, worth a retry."""
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        yield
    except OSError as e:
        cause: BaseException | None = e
        while cause is not None and not isinstance(cause, (RepositoryNotFoundError, GatedRepoError)):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        why = "is gated (it needs a token: HF_TOKEN)" if isinstance(cause, GatedRepoError) else "does not exist"
        raise ModelUnavailable(f"spec.model.name {name!r}: not a local directory, and the model {why} on the hub "
                               f"({os.environ.get('HF_ENDPOINT') or 'https://huggingface.co'})") from None
