"""Input rows the tests share: numbered, of mixed lengths."""

from __future__ import annotations

from typing import Any


def numbered(n: int, *, filler: str = "lorem ipsum ", period: int = 5) -> list[dict[str, Any]]:
    """`n` rows ``{"id": i, "text": "row i " + filler x (i % period)}``: ids 0..n-1, lengths that cycle."""
    return [{"id": i, "text": f"row {i} " + filler * (i % period)} for i in range(n)]
