"""Images of chat rows: `image_url` content parts, checked when a row is parsed and fetched
before the engine sees them.

An image comes as a ``data:`` URL (its bytes inline, base64) or as a ``file://`` / ``s3://`` / ``gs://``
URI, which the worker reads through the same storage as its input. Other schemes (``http``,
``https``, ...) are refused: worker pods need not reach the internet, and a web URL may answer
differently when a resumed shard runs the row again. Each image is bounded by
``input.maxImageBytes``; a larger one is an ``image_too_large`` error row, read no further.

A ``file://`` image is read only from under ``input.imageRoot`` (a ``file://`` folder; by default
the folder of a ``file://`` input), and never from ``/proc``, ``/sys``, ``/dev``, ``/etc`` or a
service-account token folder, whatever the root; symbolic links are resolved before the check.
It must be a regular file: it is opened without blocking (``O_NONBLOCK``, so a FIFO cannot hang
the worker) and checked with ``fstat`` before a byte is read, its size checked against the cap
first, and the read given `FILE_TIMEOUT_S` (a file on a hung network mount is an error row,
never a hung lane). Anything else is an ``image_not_found`` error row naming why.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import stat
import threading
from collections.abc import Callable
from typing import Any

from bij.contract.schemes import WRITABLE
from bij.engines.base import Image
from bij.storage import NotFound, Storage, StorageError

FETCHED_SCHEMES = WRITABLE  # where bij stores its own objects
# Folders no image is ever read from, whatever input.imageRoot says (kernel and device files, the
# host's configuration, a pod's service-account token).
FORBIDDEN_DIRS = ("/proc", "/sys", "/dev", "/etc", "/run/secrets", "/var/run/secrets")
FILE_TIMEOUT_S = 30.0
# OpenAI's image_url.detail: only "auto" leaves the resolution to the model, as every engine here does.
DETAILS = ("auto", "low", "high")


class ImageProblem(ValueError):
    """An image a row cannot have: `code` is its error row's code, the message names the part."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def parse_image(part: dict[str, Any], where: str, limit: int) -> Image:
    """The image of one `image_url` content part at `where` (``body.messages[0].content[1]``).

    A data URL is decoded here (its size checked before decoding); a file:// or s3:// image
    is fetched later (`fetch_images`). Raises ImageProblem.
    """
    spec = part.get("image_url")
    if not isinstance(spec, dict) or not isinstance(spec.get("url"), str):
        raise ImageProblem("invalid_request", f"{where}.image_url must be an object with a string url")
    unknown = sorted(set(spec) - {"url", "detail"})
    if unknown:
        raise ImageProblem("invalid_request", f"{where}.image_url: unknown field {unknown[0]!r} (known: detail, url)")
    detail = spec.get("detail")
    if detail is not None and detail != "auto":
        if detail not in DETAILS:
            raise ImageProblem("invalid_request", f"{where}.image_url.detail must be one of {', '.join(DETAILS)}, "
                               f"got {json.dumps(detail)[:40]}")
        raise ImageProblem("unsupported", f"{where}.image_url.detail {detail!r} is not honoured: the model's own "
                           "image processor sets the resolution (leave detail out, or auto)")
    url: str = spec["url"]
    if url.startswith("data:"):
        return Image(url.split(",", 1)[0], _data_url(url, f"{where}.image_url.url", limit))
    if url.startswith(FETCHED_SCHEMES) and len(url) > len(url.split("://", 1)[0]) + 3:
        return Image(url)
    scheme = url.split(":", 1)[0] if ":" in url else url[:20]
    fetched = ", ".join(FETCHED_SCHEMES[:-1]) + " and " + FETCHED_SCHEMES[-1]
    raise ImageProblem("unsupported", f"{where}.image_url.url: {json.dumps(scheme)[:40]} images are not fetched "
                       f"(data: URLs, {fetched} are; a worker need not reach the internet, and a web URL "
                       "may answer differently when the row runs again)")


def _data_url(url: str, where: str, limit: int) -> bytes:
    """The bytes of ``data:image/<type>;base64,<payload>``, refused when over `limit` bytes."""
    head, sep, payload = url.partition(",")
    media, _, encoding = head[len("data:"):].partition(";")
    if not sep or encoding != "base64" or not media.startswith("image/"):
        raise ImageProblem("invalid_request", f"{where} must be data:image/<type>;base64,<data>, got "
                           f"{json.dumps(head[:40])}")
    # Checked before decoding: an oversized image is never held twice.
    size = len(payload) * 3 // 4 - payload[-2:].count("=")
    if size > limit:
        raise ImageProblem("image_too_large", f"{where}: the image is {size} bytes, over input.maxImageBytes "
                           f"({limit})")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageProblem("invalid_request", f"{where}: not valid base64 ({e})") from None


def fetch_images(images: tuple[Image, ...], storage_for: Callable[[str], Storage], limit: int,
                 root: str | None = None) -> tuple[Image, ...]:
    """The images with the bytes of every file://, s3:// and gs:// one read (at most `limit` + 1 bytes each).

    A missing or refused object, or one over `limit`, raises ImageProblem naming its URI; an
    outage that may pass (StorageError not permanent) propagates, as any storage read's does.
    `root`: the folder (a path) file:// images may come from; None: none may.
    """
    if all(im.data is not None for im in images):
        return images
    out = []
    for im in images:
        if im.data is None and im.source.startswith("file://"):
            im = Image(im.source, read_local_image(im.source, root, limit))
        elif im.data is None:
            try:
                with storage_for(im.source).open_read(im.source) as f:
                    data = f.read(limit + 1)
            except NotFound:
                raise ImageProblem("image_not_found", f"image {im.source}: no such object") from None
            except StorageError as e:
                if not e.permanent:
                    raise
                raise ImageProblem("image_not_found", f"image {im.source}: {e}") from None
            if len(data) > limit:
                raise ImageProblem("image_too_large", f"image {im.source} is over input.maxImageBytes ({limit})")
            im = Image(im.source, data)
        out.append(im)
    return tuple(out)


def read_local_image(uri: str, root: str | None, limit: int, timeout: float = FILE_TIMEOUT_S) -> bytes:
    """The bytes of a file:// image under `root`: a regular file, at most `limit` bytes, read
    within `timeout` seconds; ImageProblem otherwise (see the module doc)."""
    path = os.path.realpath(uri.removeprefix("file://"))
    forbidden = next((d for d in FORBIDDEN_DIRS if path == d or path.startswith(d + "/")), None)
    if forbidden is not None or "/serviceaccount/" in path:
        raise ImageProblem("image_not_found", f"image {uri}: images are never read from {forbidden or path}")
    if root is None:
        raise ImageProblem("image_not_found", f"image {uri}: file:// images are read only under input.imageRoot, "
                           "which this job does not set (and its input is not file://)")
    base = os.path.realpath(root)
    if not (path == base or path.startswith(base.rstrip("/") + "/")):
        raise ImageProblem("image_not_found", f"image {uri}: outside input.imageRoot (file://{base})")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        raise ImageProblem("image_not_found", f"image {uri}: no such file") from None
    except OSError as e:
        raise ImageProblem("image_not_found", f"image {uri}: cannot open it ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ImageProblem("image_not_found", f"image {uri}: not a regular file")
        if st.st_size > limit:
            raise ImageProblem("image_too_large", f"image {uri} is over input.maxImageBytes ({limit})")
        return _read_within(fd, uri, limit, timeout)
    finally:
        os.close(fd)


def _read_within(fd: int, uri: str, limit: int, timeout: float) -> bytes:
    """Up to `limit` + 1 bytes of `fd`, in a helper thread given `timeout` seconds (a read on a hung
    network mount cannot be interrupted: the row fails, the thread is left to finish on its own)."""
    got: list[bytes] = []
    failed: list[OSError] = []
    dup = os.dup(fd)  # the helper's own descriptor: the caller closes `fd` whatever happens here

    def read() -> None:
        try:
            with os.fdopen(dup, "rb") as f:
                got.append(f.read(limit + 1))
        except OSError as e:
            failed.append(e)

    helper = threading.Thread(target=read, name="bij-image-read", daemon=True)
    helper.start()
    helper.join(timeout)
    if helper.is_alive():
        raise ImageProblem("image_not_found", f"image {uri}: not read within {timeout:g} s")
    if failed:
        raise ImageProblem("image_not_found", f"image {uri}: cannot read it ({failed[0].strerror})")
    data = got[0] if got else b""
    if len(data) > limit:
        raise ImageProblem("image_too_large", f"image {uri} is over input.maxImageBytes ({limit})")
    return data
