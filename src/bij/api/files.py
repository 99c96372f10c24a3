"""Files under the files prefix, streamed: an upload goes to storage as it arrives, a download
leaves storage as it is sent; neither is ever whole in memory.

Layout, per namespace (the caller's)::

    <prefix>/<namespace>/files/<file id>/content.jsonl   the uploaded bytes, as sent
    <prefix>/<namespace>/files/<file id>/file.json       its OpenAI File object, and what the upload saw
    <prefix>/<namespace>/batches/<batch id>/             the batch's bij output (manifest.json, results/, errors/)

A batch's output and error files are not copies: their ids name the batch, and their content is
the bij manifest's result or error files, one after the other.
"""

from __future__ import annotations

import asyncio
import json
import queue
import re
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from bij.contract.layout import join
from bij.storage import NotFound, Storage, open_storage

READ_BYTES = 1 << 20  # one read of a download
QUEUE_PARTS = 4  # upload chunks between the request and the storage writer
MAX_MODELS = 128  # distinct body.model values an upload records (a batch runs one model and its adapters)


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


@dataclass
class LineStats:
    """What an upload's OpenAI batch lines say, counted as they stream past: lines, the models and
    endpoints they name."""

    lines: int = 0
    models: set[str] = field(default_factory=set)
    model_lines: dict[str, int] = field(default_factory=dict)  # the first line (1-based) of each model
    more_models: int = 0  # the first line of a model past MAX_MODELS (0: none), which the batch refuses
    urls: set[str] = field(default_factory=set)
    url_lines: dict[str, int] = field(default_factory=dict)  # the first line (1-based) of each url
    tail: bytearray = field(default_factory=bytearray)

    def feed(self, data: bytes) -> None:
        self.tail += data
        start = 0
        while True:
            end = self.tail.find(b"\n", start)
            if end < 0:
                break
            self._line(bytes(self.tail[start:end]))
            start = end + 1
        del self.tail[:start]

    def close(self) -> None:
        if self.tail.strip():
            self._line(bytes(self.tail))
        self.tail = bytearray()

    def _line(self, line: bytes) -> None:
        if not line.strip():
            return
        self.lines += 1
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError:
            return  # the worker makes it an error row, with its place
        if not isinstance(obj, dict):
            return
        body = obj.get("body")
        model = body.get("model") if isinstance(body, dict) else None
        if isinstance(model, str) and model not in self.models:
            if len(self.models) < MAX_MODELS:
                self.models.add(model)
                self.model_lines[model] = self.lines
            elif not self.more_models:
                self.more_models = self.lines
        url = obj.get("url")
        if isinstance(url, str) and len(self.urls) < MAX_MODELS:
            self.urls.add(url)
            self.url_lines.setdefault(url, self.lines)


class FileStore:
    """The OpenAI files of every namespace, under `prefix` (file:// or s3://), with `s3` settings."""

    def __init__(self, prefix: str, s3: Any = None):
        self.prefix = prefix.rstrip("/") + "/"
        self.s3 = s3
        self.store: Storage = open_storage(self.prefix, s3)

    # --- places ---------------------------------------------------------------------------------

    def files_folder(self, namespace: str) -> str:
        return join(self.prefix, namespace, "files")

    def content_uri(self, namespace: str, file_id: str) -> str:
        return join(self.files_folder(namespace), file_id, "content.jsonl")

    def meta_uri(self, namespace: str, file_id: str) -> str:
        return join(self.files_folder(namespace), file_id, "file.json")

    def batch_output(self, namespace: str, batch_id: str) -> str:
        return join(self.prefix, namespace, "batches", batch_id) + "/"

    # --- uploaded files -------------------------------------------------------------------------

    async def upload(self, namespace: str, filename: str, purpose: str, chunks: AsyncIterator[bytes]) -> dict[str, Any]:
        """Stream `chunks` to storage as one new file; returns its File object (with ``lines``,
        ``models`` and ``urls`` the upload saw, kept beside it)."""
        file_id = new_id("file-")
        stats = LineStats()
        size = await self._write_content(self.content_uri(namespace, file_id), file_id, chunks, stats)
        obj = {"id": file_id, "object": "file", "bytes": size, "created_at": int(time.time()), "filename": filename,
               "purpose": purpose, "status": "processed", "expires_at": None, "status_details": None}
        meta = {**obj, "lines": stats.lines, "models": sorted(stats.models), "model_lines": stats.model_lines,
                "more_models": stats.more_models, "urls": sorted(stats.urls), "url_lines": stats.url_lines,
                "created_ns": time.time_ns()}
        await asyncio.to_thread(self.store.write_bytes, self.meta_uri(namespace, file_id),
                                json.dumps(meta).encode())
        return obj

    async def _write_content(self, uri: str, file_id: str, chunks: AsyncIterator[bytes], stats: LineStats) -> int:
        """Stream `chunks` to `uri` through a writer thread (at most QUEUE_PARTS behind), feeding `stats`
        on the way; the bytes written. An upload that fails or is cut off leaves nothing at `uri`."""
        q: queue.Queue[bytes | BaseException | None] = queue.Queue(maxsize=QUEUE_PARTS)

        def parts() -> Iterator[bytes]:
            while True:
                item = q.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item

        loop = asyncio.get_running_loop()
        writer = loop.run_in_executor(None, self.store.write_stream, uri, parts())

        async def put(item: bytes | BaseException | None) -> None:
            # Waits while the writer is QUEUE_PARTS behind; gives up when the writer failed.
            while True:
                if writer.done():
                    writer.result()  # raises the writer's error
                    raise RuntimeError(f"the writer of {uri} stopped before the upload ended")
                try:
                    q.put_nowait(item)
                    return
                except queue.Full:
                    await asyncio.wait([writer], timeout=0.01)

        try:
            async for chunk in chunks:
                stats.feed(chunk)
                await put(chunk)
            stats.close()
            await put(None)
        except BaseException as e:
            await _abort_writer(q, writer, ConnectionAbortedError(f"upload of {file_id} stopped: {e!r}"))
            raise
        return await writer

    def meta(self, namespace: str, file_id: str) -> dict[str, Any] | None:
        """An uploaded file's record (its File object and what the upload saw), or None."""
        if not _plain_id(file_id):
            return None
        try:
            return dict(json.loads(self.store.read_bytes(self.meta_uri(namespace, file_id))))
        except NotFound:
            return None

    def records(self, namespace: str) -> list[dict[str, Any]]:
        """The namespace's uploaded files' records, newest first."""
        folder = self.files_folder(namespace) + "/"
        out = []
        for o in self.store.list(folder):
            if o.uri.endswith("/file.json"):
                try:
                    out.append(dict(json.loads(self.store.read_bytes(o.uri))))
                except NotFound:  # deleted since it was listed
                    continue
        out.sort(key=lambda m: (m.get("created_ns", 0), m.get("created_at", 0)), reverse=True)
        return out

    def delete(self, namespace: str, file_id: str) -> None:
        self.store.delete(self.meta_uri(namespace, file_id))  # first: a file without it is gone for readers
        self.store.delete(self.content_uri(namespace, file_id))

    # --- downloads ------------------------------------------------------------------------------

    async def stream(self, uris: list[str]) -> AsyncGenerator[bytes, None]:
        """The bytes of `uris`, one after the other, READ_BYTES at a time."""
        for uri in uris:
            f = await asyncio.to_thread(self.store.open_read, uri)
            try:
                while True:
                    data = await asyncio.to_thread(f.read, READ_BYTES)
                    if not data:
                        break
                    yield data
            finally:
                f.close()


async def _abort_writer(q: queue.Queue[bytes | BaseException | None], writer: asyncio.Future[int],
                        error: BaseException) -> None:
    """Tell a writer still running that the upload stopped (it drops what it wrote: temp file, multipart
    upload) and wait for it; its own error is retrieved, so the error to report stays the upload's."""
    if not writer.done():
        while True:
            try:
                q.put_nowait(error)
                break
            except queue.Full:
                await asyncio.wait([writer], timeout=0.01)
                if writer.done():
                    break
    await asyncio.wait([writer])
    writer.exception()


FILE_ID = re.compile(r"file-[0-9a-f]{24}")


def _plain_id(file_id: str) -> bool:
    """An id that can name a folder (no path tricks, no name too long for a file system): what `new_id`
    makes; any other id names no file."""
    return FILE_ID.fullmatch(file_id) is not None
