"""Reading a published result row, in either output shape (plain, or an OpenAI batch line): its input id,
its token usage, and a set key for ids. Workers write the rows; the publish passes read them back."""

from __future__ import annotations

from typing import Any


def id_key(value: Any) -> str:
    """A set key that keeps 1 and "1" apart: ids come back exactly as given."""
    return ("s:" + value) if isinstance(value, str) else ("i:" + str(value))


def row_id(row: dict[str, Any]) -> Any:
    """The input id a published row carries: `custom_id` in OpenAI batch shape, else `id`."""
    return row["custom_id"] if "custom_id" in row else row.get("id")


def row_usage(row: dict[str, Any]) -> dict[str, int]:
    """The token usage a published result row carries, in either output shape."""
    usage = row.get("usage")
    if usage is None and isinstance(row.get("response"), dict):
        usage = row["response"].get("body", {}).get("usage")
    return usage or {}
