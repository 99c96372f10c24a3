"""Label and field selectors as the API server parses them (``a=b,c!=d,e in (f,g),!h``)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

Matcher = Callable[[Mapping[str, Any]], bool]

_SET_RE = re.compile(r"^\s*([^\s!=]+)\s+(in|notin)\s+\((.*)\)\s*$")


class SelectorError(ValueError):
    """An unparseable selector (the server answers 400)."""


def _split(text: str) -> list[str]:
    # Commas inside "in (a,b)" do not separate requirements.
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


def _requirement(part: str) -> tuple[str, str, frozenset[str]]:
    """One requirement as (key, operator, values); operators: in, notin, exists, absent."""
    m = _SET_RE.match(part)
    if m:
        return m.group(1), m.group(2), frozenset(v.strip() for v in m.group(3).split(","))
    if "!=" in part:
        key, value = (s.strip() for s in part.split("!=", 1))
        return key, "notin", frozenset([value])
    if "=" in part:
        key, value = (s.strip() for s in re.split("==?", part, maxsplit=1))
        return key, "in", frozenset([value])
    if part.startswith("!"):
        return part[1:].strip(), "absent", frozenset()
    if re.fullmatch(r"[A-Za-z0-9./_-]+", part):
        return part, "exists", frozenset()
    raise SelectorError(f"unable to parse requirement: {part!r}")


def _holds(req: tuple[str, str, frozenset[str]], labels: Mapping[str, str]) -> bool:
    key, op, values = req
    if op == "exists":
        return key in labels
    if op == "absent":
        return key not in labels
    if op == "in":
        return labels.get(key) in values
    return labels.get(key) not in values  # notin, != (a missing label matches, as in Kubernetes)


def parse_label_selector(text: str | None) -> Callable[[Mapping[str, str]], bool]:
    """A predicate over a labels map."""
    reqs = [_requirement(part) for part in _split(text or "")]
    return lambda labels: all(_holds(r, labels) for r in reqs)


def _field(obj: Mapping[str, Any], key: str) -> Any:
    return (obj.get("metadata") or {}).get(key.split(".", 1)[1])


def parse_field_selector(text: str | None) -> Matcher:
    """A predicate over an object; only the fields every resource supports."""
    reqs: list[tuple[str, bool, str]] = []
    for part in _split(text or ""):
        neg = "!=" in part
        key, value = (s.strip() for s in re.split("!=|==?", part, maxsplit=1))
        if key not in ("metadata.name", "metadata.namespace"):
            raise SelectorError(f'field label not supported: "{key}"')
        reqs.append((key, neg, value))
    return lambda obj: all((_field(obj, k) != v) if neg else (_field(obj, k) == v) for k, neg, v in reqs)
