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


def parse_label_selector(text: str | None) -> Callable[[Mapping[str, str]], bool]:
    """A predicate over a labels map."""
    reqs: list[Callable[[Mapping[str, str]], bool]] = []
    for part in _split(text or ""):
        m = _SET_RE.match(part)
        if m:
            key, op, values = m.group(1), m.group(2), {v.strip() for v in m.group(3).split(",")}
            if op == "in":
                reqs.append(lambda ls, k=key, vs=values: ls.get(k) in vs)
            else:
                reqs.append(lambda ls, k=key, vs=values: ls.get(k) not in vs)
        elif "!=" in part:
            key, value = (s.strip() for s in part.split("!=", 1))
            reqs.append(lambda ls, k=key, v=value: ls.get(k) != v)
        elif "==" in part or "=" in part:
            key, value = (s.strip() for s in re.split("==?", part, maxsplit=1))
            reqs.append(lambda ls, k=key, v=value: ls.get(k) == v)
        elif part.startswith("!"):
            absent = part[1:].strip()
            reqs.append(lambda ls, k=absent: k not in ls)
        elif re.fullmatch(r"[A-Za-z0-9./_-]+", part):
            reqs.append(lambda ls, k=part: k in ls)
        else:
            raise SelectorError(f"unable to parse requirement: {part!r}")
    return lambda labels: all(r(labels) for r in reqs)


_FIELDS: dict[str, Callable[[Mapping[str, Any]], Any]] = {
    "metadata.name": lambda o: (o.get("metadata") or {}).get("name"),
    "metadata.namespace": lambda o: (o.get("metadata") or {}).get("namespace"),
}


def parse_field_selector(text: str | None) -> Matcher:
    """A predicate over an object; only the fields every resource supports."""
    reqs: list[Matcher] = []
    for part in _split(text or ""):
        neg = "!=" in part
        key, value = (s.strip() for s in re.split("!=|==?", part, maxsplit=1))
        if key not in _FIELDS:
            raise SelectorError(f'field label not supported: "{key}"')
        get = _FIELDS[key]
        reqs.append((lambda o, g=get, v=value: g(o) != v) if neg else (lambda o, g=get, v=value: g(o) == v))
    return lambda obj: all(r(obj) for r in reqs)
