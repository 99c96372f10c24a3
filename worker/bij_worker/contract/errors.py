"""The base of the errors bij raises on purpose.

A `BijError` is an expected failure with a message for the user: a bad spec, an input that
cannot be planned, storage that failed after its retries. Anything else (a KeyError, a
TypeError) is a bug and must not be caught as "try again later". `permanent` says whether a
retry can help: a permanent error is the same on every retry (the worker exits 42, `bij run`
stops at once).
"""

from __future__ import annotations


class BijError(Exception):
    """An expected failure; `permanent`: no retry can help."""

    permanent: bool = False

    def __init__(self, message: str = "", *, permanent: bool | None = None):
        super().__init__(message)
        if permanent is not None:
            self.permanent = permanent
