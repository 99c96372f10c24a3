"""The stop request a lane honours: set by SIGTERM/SIGINT or a lost claim, read by the schedulers."""

from __future__ import annotations

import threading
import time


class StopFlag:
    """Set by SIGTERM/SIGINT: take no new chunk; finish the in-flight one if there is time."""

    def __init__(self, drain_seconds: float = 15.0):
        self.drain_seconds = drain_seconds
        self._at: float | None = None
        self.event = threading.Event()

    def request(self, drain_seconds: float | None = None) -> None:
        """Stop; with `drain_seconds`, allow at most that long for the in-flight rows (0: none)."""
        if drain_seconds is not None:
            self.drain_seconds = min(self.drain_seconds, drain_seconds)
        if self._at is None:
            self._at = time.monotonic()
        self.event.set()

    @property
    def requested(self) -> bool:
        return self._at is not None

    def drain_expired(self) -> bool:
        return self._at is not None and time.monotonic() - self._at > self.drain_seconds
