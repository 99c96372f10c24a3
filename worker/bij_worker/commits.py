"""The commit writer: finished chunks become durable in a background thread, in the order handed over.

Compute hands a chunk over and goes on; it waits for storage only when
`slots` chunks are already waiting (the queue is the bound on what a kill -9
can lose beyond the in-flight window). The first failure stops the writer:
no later chunk is written after one that failed, so the durable part of a
shard stays a prefix, and the failure is raised to the caller on its next
hand-over or at close.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

_CLOSE = object()


class CommitWriter:
    """One thread that calls `commit(item)` for each item put, in order."""

    def __init__(self, commit: Callable[[Any], None], slots: int):
        self._commit = commit
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._slots = threading.Semaphore(max(1, slots))
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="bij-commit")
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is _CLOSE:
                return
            if self.error is None:
                try:
                    self._commit(item)
                except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
                    self.error = e
            self._slots.release()

    def check(self) -> None:
        """Raise the writer's failure, if it had one."""
        if self.error is not None:
            raise self.error

    def put(self, item: Any) -> None:
        """Queue an item; blocks while every slot holds a chunk not yet durable."""
        while not self._slots.acquire(timeout=0.2):
            self.check()
        self.check()
        self._q.put(item)

    def close(self) -> None:
        """Write what was queued, stop the thread, and raise a failure if there was one."""
        self._q.put(_CLOSE)
        self._thread.join()
        self.check()
