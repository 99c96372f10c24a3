"""`hf://datasets/OWNER/NAME[@REVISION]/PATH` inputs: a dataset repository of the Hugging Face Hub.

Listing resolves the revision (a branch, a tag, or a commit) to its commit once and records that commit
as every object's version, so a plan reads exactly the files of one commit however the branch moves
later (`ObjectChanged` is never needed: a commit's files do not change). Objects are fetched through
`huggingface_hub` into its cache (`HF_HOME` / `HF_HUB_CACHE`: the job's model cache volume in a pod)
once per process and machine, then read like local files. With `HF_HUB_OFFLINE=1` nothing is asked of
the Hub: the revision and files come from the cache alone (a dataset put there beforehand, as air-gapped
clusters do). The token, where a dataset is gated or private, is `HF_TOKEN` (the credentials Secret may
carry it). Read-only.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

from bij.storage.objects import NotFound, ObjectInfo, ReadOnlyInputs, StorageError, StorageRefused

PREFIX = "hf://datasets/"


def split_hf(uri: str) -> tuple[str, str | None, str]:
    """`hf://datasets/owner/name@rev/path` -> ("owner/name", "rev", "path")."""
    if not uri.startswith(PREFIX):
        raise StorageError(f"{uri!r}: an hf:// input is a dataset: hf://datasets/OWNER/NAME[@REVISION]/PATH",
                           permanent=True)
    parts = uri[len(PREFIX):].split("/", 2)
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise StorageError(f"{uri!r}: name the repository: hf://datasets/OWNER/NAME[@REVISION]/PATH", permanent=True)
    name, _, revision = parts[1].partition("@")
    return f"{parts[0]}/{name}", revision or None, parts[2] if len(parts) > 2 else ""


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _cache_dir() -> str | None:
    """HF_HUB_CACHE as the environment says now (huggingface_hub reads it once, at import)."""
    return os.environ.get("HF_HUB_CACHE") or None


def _under(path: str, wanted: str) -> bool:
    """S3's prefix rule: `wanted` is the object, a folder ending in "/", or a folder without it."""
    if not wanted:
        return True
    return path == wanted or path.startswith(wanted if wanted.endswith("/") else wanted + "/")


def open_hf(uri: str, s3: object = None) -> HfStorage:
    """The storage of an hf:// input (a Hugging Face dataset): read-only, no settings."""
    return HfStorage()


class HfStorage(ReadOnlyInputs):
    """Read-only objects of Hub dataset repositories, through `huggingface_hub` and its cache."""

    WHAT = "hf:// datasets"

    def _error(self, what: str, uri: str, e: Exception) -> StorageError:
        from huggingface_hub.errors import (
            EntryNotFoundError,
            GatedRepoError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        if isinstance(e, GatedRepoError):
            return StorageRefused(f"{what} {uri}: the dataset is gated: accept its terms and give HF_TOKEN")
        if isinstance(e, RepositoryNotFoundError):
            return StorageRefused(f"{what} {uri}: no such dataset, or it is private and HF_TOKEN may not read it")
        if isinstance(e, LocalEntryNotFoundError):  # an EntryNotFoundError too: asked first
            from huggingface_hub import constants

            return StorageError(f"{what} {uri}: not in the local Hugging Face cache ({constants.HF_HUB_CACHE})"
                                " and HF_HUB_OFFLINE is set: put the dataset there first, or allow the Hub",
                                permanent=_offline())
        if isinstance(e, (RevisionNotFoundError, EntryNotFoundError)):
            return NotFound(f"{what} {uri}: {type(e).__name__}: {str(e).splitlines()[0]}")
        return StorageError(f"{what} {uri}: {type(e).__name__}: {e}")

    def list(self, uri: str) -> list[ObjectInfo]:
        repo, revision, path = split_hf(uri)
        base = uri[: len(uri) - len(path)] if path else uri.rstrip("/") + "/"
        try:
            if _offline():
                from huggingface_hub import snapshot_download

                folder = Path(snapshot_download(repo, repo_type="dataset", revision=revision, local_files_only=True,
                                                cache_dir=_cache_dir()))
                commit = folder.name
                files = [(str(p.relative_to(folder)), p.stat().st_size) for p in sorted(folder.rglob("*"))
                         if p.is_file()]
            else:
                from huggingface_hub import HfApi
                from huggingface_hub.hf_api import RepoFile

                api = HfApi()
                commit = str(api.dataset_info(repo, revision=revision).sha)
                files = [(e.path, int(e.size)) for e in api.list_repo_tree(repo, recursive=True, revision=commit,
                                                                              repo_type="dataset")
                         if isinstance(e, RepoFile)]
        except Exception as e:  # noqa: BLE001 - classified by _error
            err = self._error("list", uri, e)
            if isinstance(err, NotFound):
                return []
            raise err from None
        return [ObjectInfo(base + p, size, commit) for p, size in sorted(files) if _under(p, path)]

    def local_path(self, uri: str, version: str | None = None) -> Path:
        """The object in the cache (fetched there first unless offline), of commit `version` when given."""
        from huggingface_hub import hf_hub_download

        repo, revision, path = split_hf(uri)
        try:
            return Path(hf_hub_download(repo, path, repo_type="dataset", revision=version or revision,
                                        cache_dir=_cache_dir()))
        except Exception as e:  # noqa: BLE001 - classified by _error
            raise self._error("read", uri, e) from None

    def open_read(self, uri: str, start: int = 0, version: str | None = None) -> BinaryIO:
        f = open(self.local_path(uri, version), "rb", buffering=1 << 20)  # noqa: SIM115 - caller closes
        if start:
            f.seek(start)
        return f
