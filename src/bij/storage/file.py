"""`file://`: a local or mounted file system, with atomic writes (a temp file renamed into place),
fsynced appends for durable logs, and conditional creates."""

from __future__ import annotations

import errno
import os
import re
import secrets
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from bij.storage import base
from bij.storage.objects import (
    NotFound,
    ObjectChanged,
    ObjectInfo,
    ObjectPage,
    StorageError,
)


def open_file(uri: str, s3: Any = None) -> FileStorage:
    """The storage of a file:// URI (there are no settings: `s3` is for the table's other rows)."""
    if len(uri) == len("file://"):
        raise StorageError(f"{uri!r} has no path: use file:///absolute/path or file://relative/path",
                           permanent=True)
    return FileStorage()


def _local_path(uri: str) -> Path:
    if not uri.startswith("file://"):
        raise StorageError(f"not a file:// URI: {uri!r}", permanent=True)
    return Path(uri[len("file://") :])


def _os_error(what: str, uri: str, e: OSError) -> StorageError:
    """One line that names the URI; a full disk or a read-only file system says what to do."""
    hint = ""
    if e.errno == errno.ENOSPC:
        hint = ": free some space and run again (what is durable is kept)"
    elif e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        hint = ": make it writable for this user, or choose another location"
    return StorageError(f"cannot {what} {uri}: {e.strerror or e}{hint}",
                        permanent=e.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR))


def _version(st: os.stat_result) -> str:
    return str(st.st_mtime_ns)


# Temp files of atomic writes: ".<name>.<random>.tmp" beside the object (8 characters: mkstemp's, before).
_TEMP_RE = re.compile(r"^\..+\.[A-Za-z0-9_]{8,16}\.tmp$")


class FileStorage:
    """Local files. Atomic writes are write-temp + fsync + rename; appends are fsynced."""

    supports_append = True

    def list(self, uri: str) -> list[ObjectInfo]:
        p = _local_path(uri)
        try:
            if p.is_file():
                st = p.stat()
                return [ObjectInfo(uri, st.st_size, _version(st))]
            if not p.is_dir():
                return []
            out = []
            for root, dirs, files in os.walk(p):
                dirs.sort()
                for f in files:
                    fp = Path(root) / f
                    try:
                        st = fp.stat()
                    except FileNotFoundError:  # removed while listing (a temp file renamed)
                        continue
                    out.append(ObjectInfo("file://" + str(fp), st.st_size, _version(st)))
        except OSError as e:
            raise _os_error("list", uri, e) from None
        out.sort(key=lambda o: o.uri)
        return out

    def list_pages(self, uri: str) -> Iterator[ObjectPage]:
        p = _local_path(uri)
        if p.is_file():
            yield self.list(uri)
            return
        # scandir reads a folder as it goes (os.walk holds each folder's names): only the folders
        # still to visit and one page are held.
        folders = [p] if p.is_dir() else []
        page: list[ObjectInfo] = []
        while folders:
            folder = folders.pop()
            try:
                with os.scandir(folder) as entries:
                    for entry in entries:
                        if entry.is_dir(follow_symlinks=False):
                            folders.append(Path(entry.path))
                            continue
                        try:
                            st = entry.stat()
                        except FileNotFoundError:  # removed while listing
                            continue
                        page.append(ObjectInfo("file://" + entry.path, st.st_size, _version(st)))
                        if len(page) >= base.PAGE:
                            yield page
                            page = []
            except FileNotFoundError:
                continue  # removed while listing
            except OSError as e:
                raise _os_error("list", "file://" + str(folder), e) from None
        if page:
            yield page

    def delete_many(self, uris: Iterable[str]) -> dict[str, str]:
        failed: dict[str, str] = {}
        for uri in uris:
            try:
                _local_path(uri).unlink()
            except FileNotFoundError:
                pass
            except OSError as e:
                failed[uri] = str(_os_error("delete", uri, e))
        return failed

    def open_read(self, uri: str, start: int = 0, version: str | None = None) -> BinaryIO:
        try:
            f = open(_local_path(uri), "rb", buffering=1 << 20)  # noqa: SIM115 - caller closes
        except FileNotFoundError:
            raise NotFound(f"{uri}: no such file") from None
        except OSError as e:
            raise _os_error("open", uri, e) from None
        if version is not None and _version(os.fstat(f.fileno())) != version:
            f.close()
            raise ObjectChanged(f"{uri} was modified after the job was planned (mtime differs)")
        if start:
            f.seek(start)
        return f

    def read_bytes(self, uri: str) -> bytes:
        # Read whole, without open_read's 1 MiB buffer: steps read records 16 at a time, and a
        # few-KB record must not cost a MiB of memory while it is in flight.
        try:
            with open(_local_path(uri), "rb", buffering=0) as f:
                return f.read()
        except FileNotFoundError:
            raise NotFound(f"{uri}: no such file") from None
        except OSError as e:
            raise _os_error("open", uri, e) from None

    def read_range(self, uri: str, start: int, length: int) -> bytes:
        with self.open_read(uri, start) as f:
            return f.read(length)

    def write_bytes(self, uri: str, data: bytes) -> None:
        p = _local_path(uri)
        try:
            tmp = _durable_temp(p, data)
            try:
                os.replace(tmp, p)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
        except OSError as e:
            raise _os_error("write", uri, e) from None
        _fsync_dir(p.parent)

    def create(self, uri: str, data: bytes) -> bool:
        p = _local_path(uri)
        try:
            tmp = _durable_temp(p, data)
            try:
                os.link(tmp, p)  # fails if the name exists: whole and exclusive at once
            except FileExistsError:
                return False
            finally:
                tmp.unlink()
        except OSError as e:
            raise _os_error("write", uri, e) from None
        _fsync_dir(p.parent)
        return True

    def write_stream(self, uri: str, parts: Iterable[bytes]) -> int:
        p = _local_path(uri)
        size = 0
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            tmp = p.parent / f".{p.name}.{secrets.token_hex(8)}.tmp"  # as _durable_temp names it
            f = open(tmp, "xb")  # noqa: SIM115 - closed below, whatever the parts do
        except OSError as e:
            raise _os_error("write", uri, e) from None
        try:
            with f:
                # An error of the parts' source is its own; only the file's are storage errors.
                for part in parts:
                    try:
                        f.write(part)
                    except OSError as e:
                        raise _os_error("write", uri, e) from None
                    size += len(part)
                try:
                    f.flush()
                    os.fsync(f.fileno())
                except OSError as e:
                    raise _os_error("write", uri, e) from None
            try:
                os.replace(tmp, p)
            except OSError as e:
                raise _os_error("write", uri, e) from None
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(p.parent)
        return size

    def remove_stale_temp(self, uri: str, older_than_s: float) -> int:
        # A temp file still being written is younger: its writer touches it as it writes.
        root = _local_path(uri)
        cutoff = time.time() - older_than_s
        removed = 0
        for folder, _, files in os.walk(root):
            for f in files:
                if not _TEMP_RE.match(f):
                    continue
                fp = os.path.join(folder, f)
                try:
                    if os.stat(fp).st_mtime < cutoff:
                        os.unlink(fp)
                        removed += 1
                except FileNotFoundError:
                    pass
        return removed

    def exists(self, uri: str) -> bool:
        return _local_path(uri).is_file()

    def delete(self, uri: str) -> None:
        try:
            _local_path(uri).unlink()
        except FileNotFoundError:
            pass

    def append_durable(self, uri: str, data: bytes) -> None:
        p = _local_path(uri)
        new = not p.exists()
        try:
            if new:
                p.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(p, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
            try:
                view = memoryview(data)
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            raise _os_error("append to", uri, e) from None
        if new:
            _fsync_dir(p.parent)


def _durable_temp(p: Path, data: bytes) -> Path:
    """`data` in a new, fsynced temp file beside `p` (removed again if anything fails)."""
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.parent / f".{p.name}.{secrets.token_hex(8)}.tmp"
    # 0666 less the umask, like any file a program writes (mkstemp would make it 0600).
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def _fsync_dir(path: Path) -> None:
    # A rename or a new file is durable only once its directory entry is.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


