"""Images of chat rows: `image_url` content parts, checked when a row is parsed and fetched
before the engine sees them.

An image comes as a ``data:`` URL (its bytes inline, base64) or as a ``file://`` / ``s3://``
URI, which the worker reads through the same storage as its input. Other schemes (``http``,
``https``, ...) are refused: worker pods need not reach the internet, and a web URL may answer
differently when a resumed shard runs the row again. Each image is bounded by
``input.maxImageBytes``; a larger one is an ``image_too_large`` error row, read no further.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable
from typing import Any

from .engines.base import Image
from .storage import NotFound, Storage, StorageError

FETCHED_SCHEMES = ("file://", "s3://")
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
    raise ImageProblem("unsupported", f"{where}.image_url.url: {json.dumps(scheme)[:40]} images are not fetched "
                       "(data: URLs, file:// and s3:// are; a worker need not reach the internet, and a web URL "
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


def fetch_images(images: tuple[Image, ...], storage_for: Callable[[str], Storage], limit: int) -> tuple[Image, ...]:
    """The images with the bytes of every file:// and s3:// one read (at most `limit` + 1 bytes each).

    A missing or refused object, or one over `limit`, raises ImageProblem naming its URI; an
    outage that may pass (StorageError not permanent) propagates, as any storage read's does.
    """
    if all(im.data is not None for im in images):
        return images
    out = []
    for im in images:
        if im.data is None:
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
