"""The two patch formats the API server applies for us: JSON merge patch and JSON patch.

Strategic merge patch (kubectl's default for built-in kinds) is accepted and applied as a
merge patch: for the maps this project patches (``spec.suspend``, labels, status) the two
agree; list merging by key is not emulated.
"""

from __future__ import annotations

import copy
from typing import Any

MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"


class PatchError(ValueError):
    """A patch that cannot be applied; `code` is the HTTP status the API server answers."""

    def __init__(self, message: str, code: int = 422):
        super().__init__(message)
        self.code = code


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: maps merge recursively, ``null`` deletes a key, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f"invalid JSON pointer {path!r}", 400)
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _walk(doc: Any, parts: list[str], path: str) -> Any:
    for part in parts:
        if isinstance(doc, dict):
            if part not in doc:
                raise PatchError(f"path {path!r} not found")
            doc = doc[part]
        elif isinstance(doc, list):
            try:
                doc = doc[int(part)]
            except (ValueError, IndexError):
                raise PatchError(f"path {path!r} not found") from None
        else:
            raise PatchError(f"path {path!r} not found")
    return doc


def _get(doc: Any, path: str) -> Any:
    return _walk(doc, _pointer(path), path)


def _add(doc: Any, path: str, value: Any) -> Any:
    parts = _pointer(path)
    if not parts:
        return copy.deepcopy(value)
    parent = _walk(doc, parts[:-1], path)
    last = parts[-1]
    if isinstance(parent, dict):
        parent[last] = copy.deepcopy(value)
    elif isinstance(parent, list):
        idx = len(parent) if last == "-" else int(last)
        if not 0 <= idx <= len(parent):
            raise PatchError(f"index out of range in {path!r}")
        parent.insert(idx, copy.deepcopy(value))
    else:
        raise PatchError(f"cannot add at {path!r}")
    return doc


def _remove(doc: Any, path: str) -> Any:
    parts = _pointer(path)
    if not parts:
        raise PatchError("cannot remove the whole document")
    parent = _walk(doc, parts[:-1], path)
    last = parts[-1]
    try:
        if isinstance(parent, dict):
            del parent[last]
        elif isinstance(parent, list):
            del parent[int(last)]
        else:
            raise PatchError(f"cannot remove {path!r}")
    except (KeyError, ValueError, IndexError):
        raise PatchError(f"path {path!r} not found") from None
    return doc


def json_patch(target: Any, ops: Any) -> Any:
    """RFC 6902 on a copy of `target`; a failed ``test`` raises (the server answers 422)."""
    if not isinstance(ops, list):
        raise PatchError("a JSON patch must be a list of operations", 400)
    doc = copy.deepcopy(target)
    for op in ops:
        kind = op.get("op")
        path = op.get("path", "")
        if kind == "add":
            doc = _add(doc, path, op.get("value"))
        elif kind == "remove":
            doc = _remove(doc, path)
        elif kind == "replace":
            _get(doc, path)  # must exist
            doc = _remove(doc, path) if _pointer(path) else doc
            doc = _add(doc, path, op.get("value"))
        elif kind == "move":
            value = _get(doc, op["from"])
            doc = _remove(doc, op["from"])
            doc = _add(doc, path, value)
        elif kind == "copy":
            doc = _add(doc, path, _get(doc, op["from"]))
        elif kind == "test":
            try:
                actual = _get(doc, path)
            except PatchError:
                actual = None
            if actual != op.get("value"):
                raise PatchError(f"the test operation failed at {path!r}: {actual!r} != {op.get('value')!r}")
        else:
            raise PatchError(f"unknown JSON patch operation {kind!r}", 400)
    return doc


def apply_patch(target: dict[str, Any], content_type: str, body: Any) -> dict[str, Any]:
    """Apply a PATCH body of the given content type to `target` (not modified)."""
    content_type = content_type.split(";")[0].strip().lower()
    if content_type in (MERGE_PATCH, STRATEGIC_MERGE_PATCH):
        if not isinstance(body, dict):
            raise PatchError("a merge patch must be a JSON object", 400)
        return merge_patch(copy.deepcopy(target), body)
    if content_type == JSON_PATCH:
        return json_patch(target, body)
    raise PatchError(f"the patch content type {content_type!r} is not supported", 415)
