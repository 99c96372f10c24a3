"""Storage that records its writes, for tests of the order in which publishing writes objects."""

from __future__ import annotations

from typing import Any


class RecordingStorage:
    """The real storage, with every whole-object write recorded in order."""

    def __init__(self, inner: Any, writes: list[str]):
        self.inner, self.writes = inner, writes

    def write_bytes(self, uri: str, data: bytes) -> None:
        self.writes.append(uri)
        self.inner.write_bytes(uri, data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
