"""Copy a folder of objects (model weights, a LoRA adapter) into a local cache once per node.

The copy is made in a temporary folder beside its place and renamed into place whole, so a pod killed
mid-copy leaves no half folder. While one process copies, the others on the node (the same hostPath
`workers.modelCache`) wait on a lock file beside it and then use its copy: 1,000 lanes on 125 nodes read
the weights 125 times, not 1,000. Objects are read `in_flight` at a time.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from bij.storage import ObjectInfo, Storage

IN_FLIGHT = 8


@dataclass(frozen=True)
class Fetched:
    path: Path
    bytes: int  # read from storage by this process: 0 where the folder was there already
    seconds: float  # waiting for another process's copy included


def fetch_folder(store: Storage, folder: str, objects: Sequence[ObjectInfo], dest: Path,
                 ready: Callable[[Path], bool], *, in_flight: int = IN_FLIGHT) -> Fetched:
    """`objects` (a listing of `folder`, which ends in "/") copied to `dest`, keeping their paths under
    `folder`; `ready(path)` says whether a folder at `path` is whole. A `dest` that is ready is used as is."""
    t = time.monotonic()
    if ready(dest):
        return Fetched(dest, 0, time.monotonic() - t)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{dest.name}.lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        try:
            if ready(dest):  # another process on this node finished it while we waited
                return Fetched(dest, 0, time.monotonic() - t)
            if dest.exists():  # not whole: a copy of another version, or damaged by hand
                shutil.rmtree(dest)
            tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
            try:
                with ThreadPoolExecutor(max_workers=max(1, in_flight)) as pool:
                    total = sum(pool.map(lambda o: _copy(store, folder, o, tmp), objects))
                if not ready(tmp):
                    raise ValueError(f"{folder} copied to {dest} is not whole")
                os.rename(tmp, dest)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return Fetched(dest, total, time.monotonic() - t)


def _copy(store: Storage, folder: str, obj: ObjectInfo, into: Path) -> int:
    rel = obj.uri[len(folder):]
    if not rel or rel.endswith("/"):
        return 0
    target = into / rel
    target.parent.mkdir(parents=True, exist_ok=True)
    with store.open_read(obj.uri, version=obj.version) as src, open(target, "wb") as out:
        shutil.copyfileobj(src, out, 1 << 20)
    return obj.size
