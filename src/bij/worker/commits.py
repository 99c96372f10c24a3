"""The commit writer: finished chunks become durable in a background thread, in the order handed over.

Compute hands a chunk over and goes on; it waits for storage only when
`slots` chunks are already waiting (the queue is the bound on what a kill -9
can lose beyond the in-flight window). Chunks that wait together are committed
together (one append, one segment object: a group commit), so a slow store
costs one round trip per group, not per chunk. The first failure stops the writer:
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
    """One thread that calls `commit(items)` with the items put, in order, as many at once as wait."""

    def __init__(self, commit: Callable[[list[Any]], None], slots: int):
        self._commit = commit
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._slots = threading.Semaphore(max(1, slots))
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="bij-commit")
        self._thread.start()

    def _run(self) -> None:
        closing = False
        while not closing:
            items = [self._q.get()]
            while not self._q.empty():
                items.append(self._q.get())
            if items[-1] is _CLOSE:
                closing = True
                items.pop()
            if items and self.error is None:
                try:
                    self._commit(items)
                except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
                    self.error = e
            for _ in items:
                self._slots.release()

    def check(self) -> None:
        """Raise the writer's failure, if it had one."""
        if self.error is not None:
            raise self.error

    def put(self, item: Any, block: bool = True) -> bool:
        """Queue an item. Every slot holding a chunk not yet durable: wait for one, or (`block=False`)
        return False at once, so that the caller can compute meanwhile."""
        if block:
            while not self._slots.acquire(timeout=0.2):
                self.check()
        elif not self._slots.acquire(blocking=False):
            self.check()
            return False
        self.check()
        self._q.put(item)
        return True

    def close(self) -> None:
        """Write what was queued, stop the thread, and raise a failure if there was one."""
        self._q.put(_CLOSE)
        self._thread.join()
        self.check()
