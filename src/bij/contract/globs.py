"""Input URIs with a glob: `s3://bucket/logs/2026-*/part-*.jsonl`, `file:///data/**/*.jsonl.zst`.

The part before the first wildcard's folder is listed once (sizes only, as for a plain prefix); the
rest is matched against each listed object's path below it: `*` and `?` within one folder name,
`[abc]` one character of a set, `**` any number of folders (none included).
"""

from __future__ import annotations

import functools
import re

WILDCARDS = "*?["


def has_glob(uri: str) -> bool:
    return any(c in uri for c in WILDCARDS)


def split_glob(uri: str) -> tuple[str, str | None]:
    """(the folder to list, the pattern below it); a URI without wildcards is (itself, None), and so is an
    http(s) URI (one object; its `?` starts a query string)."""
    if uri.startswith(("https://", "http://")):
        return uri, None
    first = min((i for i in (uri.find(c) for c in WILDCARDS) if i >= 0), default=-1)
    if first < 0:
        return uri, None
    cut = uri.rfind("/", 0, first) + 1
    return uri[:cut], uri[cut:]


@functools.lru_cache(maxsize=64)
def _compile(pattern: str) -> re.Pattern[str]:
    out = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:[^/]*/)*")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[":
            end = pattern.find("]", i + 2)
            if end < 0:
                raise ValueError(f"glob {pattern!r}: '[' at {i} has no closing ']'")
            body = pattern[i + 1:end]
            negate = body.startswith("!")
            body = body[1:] if negate else body
            out.append("[" + ("^" if negate else "") + body.replace("\\", "\\\\") + "]")
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out))


def check_glob(uri: str) -> None:
    """ValueError naming what is wrong with the glob of `uri`, if anything."""
    base, pattern = split_glob(uri)
    if pattern is None:
        return
    scheme = uri.partition("://")[0]
    if scheme in ("s3", "gs") and base.count("/") < 3:
        raise ValueError(f"a glob may not be in the bucket name: {uri!r} (use {scheme}://bucket/prefix/*.jsonl)")
    if any("**" in part and part != "**" for part in pattern.split("/")):
        raise ValueError(f"'**' must be a whole folder name (a/**/b.jsonl), got {uri!r}")
    _compile(pattern)


def glob_matches(pattern: str, relative: str) -> bool:
    """Whether `relative` (an object's path below the listed folder) matches `pattern`."""
    return _compile(pattern).fullmatch(relative) is not None
