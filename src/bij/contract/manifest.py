"""The published manifest's file lists, in one document or in parts (docs/output.md, "Manifest parts").

`manifest.json` is the one object whose presence means published. It lists the published files in
`files`, `errorFiles` and `cappedFiles` (each entry {"path", "rows", "bytes", "sha256", ...}). Where it
would list more than `PART_FILES` files, the publish step writes those lists as parts first,
`manifest-parts/<publish>/<k>.json` under the output (each {"kind": "BatchInferenceJobManifestPart",
"files": [...], "errorFiles": [...], "cappedFiles": [...]}, at most `PART_FILES` entries in all), and
`manifest.json` then has no lists but

    "parts": [{"path": "manifest-parts/<publish>/00000.json", "bytes": N, "sha256": ..., "files": n,
               "errorFiles": n, "cappedFiles": n}, ...],
    "fileCounts": {"files": n, "errorFiles": n, "cappedFiles": n}

beside every total it always has. A part is trusted through the manifest: its checksum is checked on
reading. The lists are the parts' lists joined in part order. Readers use `listed` / `iter_listed`,
never the keys themselves.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from bij.contract.errors import BijError

# A manifest listing more files than this lists them in parts of at most this many; BIJ_MANIFEST_PART_FILES
# sets another number (tests: a few files in parts, in the step processes too).
PART_FILES = 10_000
LISTS = ("files", "errorFiles", "cappedFiles")
PART_KIND = "BatchInferenceJobManifestPart"
PARTS_FOLDER = "manifest-parts"

Read = Callable[[str], bytes]  # a path relative to the output folder -> its bytes


class BadManifestPart(BijError):
    """A manifest part that is missing its checksum or its lists: the manifest cannot be read whole."""

    permanent = True


def part_files() -> int:
    """How many files a manifest part lists at most (and a manifest without parts)."""
    return max(1, int(os.environ.get("BIJ_MANIFEST_PART_FILES") or PART_FILES))


def file_count(manifest: Mapping[str, Any], key: str = "files") -> int:
    """How many files a list of the manifest has, without reading its parts (a summary's count as it is)."""
    if isinstance(manifest.get(key), int):
        return int(manifest[key])
    counts = manifest.get("fileCounts")
    if isinstance(counts, Mapping) and key in counts:
        return int(counts[key])
    return len(manifest.get(key) or [])


def iter_listed(manifest: Mapping[str, Any], key: str, read: Read) -> Iterator[dict[str, Any]]:
    """The entries of one list (`files`, `errorFiles`, `cappedFiles`) in order, from the manifest itself or
    from its parts, one part in memory at a time."""
    if key not in LISTS:
        raise ValueError(f"{key!r} is not a manifest file list ({', '.join(LISTS)})")
    parts = manifest.get("parts")
    if not parts:
        yield from manifest.get(key) or []
        return
    for part in parts:
        if not part.get(key):
            continue  # the part lists none of these: not read
        yield from read_part(part, read)[key]


def listed(manifest: Mapping[str, Any], key: str, read: Read) -> list[dict[str, Any]]:
    """One list of the manifest, whole (see `iter_listed`)."""
    return list(iter_listed(manifest, key, read))


def whole(manifest: Mapping[str, Any], read: Read) -> dict[str, Any]:
    """The manifest in one-document form: its lists read from its parts, `parts` and `fileCounts` dropped."""
    if not manifest.get("parts"):
        return dict(manifest)
    out = {k: v for k, v in manifest.items() if k not in ("parts", "fileCounts")}
    out.update({key: [] for key in LISTS})
    for part in manifest["parts"]:
        doc = read_part(part, read)
        for key in LISTS:
            out[key] += doc[key]
    return out


def read_part(part: Mapping[str, Any], read: Read) -> dict[str, Any]:
    """A manifest part's document, checked against the checksum the manifest holds for it."""
    path = str(part.get("path"))
    data = read(path)
    if hashlib.sha256(data).hexdigest() != part.get("sha256"):
        raise BadManifestPart(f"manifest part {path} does not match the sha256 manifest.json lists for it: "
                              "it was changed or replaced after publishing")
    try:
        doc = json.loads(data)
    except ValueError as e:
        raise BadManifestPart(f"manifest part {path} is not JSON: {e}") from None
    if not isinstance(doc, dict) or any(not isinstance(doc.get(key), list) for key in LISTS):
        raise BadManifestPart(f"manifest part {path} lacks one of its lists ({', '.join(LISTS)})")
    return doc


class PartWriter:
    """Collects a manifest's file entries as they are read, writing a part each time `size` are held once
    the manifest is sure to list more than `size` (`write(path, bytes)`, a path under the output);
    `finish` gives the manifest's list fields: the lists themselves, or `parts` and `fileCounts`."""

    def __init__(self, write: Callable[[str, bytes], None], folder: str, size: int | None = None):
        self.write, self.folder, self.size = write, folder.strip("/"), size or part_files()
        self.held: dict[str, list[dict[str, Any]]] = {key: [] for key in LISTS}
        self.n_held = 0
        self.parts: list[dict[str, Any]] = []
        self.counts = dict.fromkeys(LISTS, 0)

    def add(self, key: str, entries: list[dict[str, Any]]) -> None:
        for entry in entries:
            if self.n_held >= self.size:  # one more than a part holds: the manifest lists them in parts
                self._flush()
            self.held[key].append(entry)
            self.counts[key] += 1
            self.n_held += 1

    def _flush(self) -> None:
        path = f"{PARTS_FOLDER}/{self.folder}/{len(self.parts):05d}.json"
        body = json.dumps({"kind": PART_KIND, **self.held}, separators=(",", ":")).encode()
        self.write(path, body)
        self.parts.append({"path": path, "bytes": len(body), "sha256": hashlib.sha256(body).hexdigest(),
                           **{key: len(v) for key, v in self.held.items()}})
        self.held, self.n_held = {key: [] for key in LISTS}, 0

    def finish(self) -> dict[str, Any]:
        """The manifest's list fields; the last part is written first where there are parts."""
        if not self.parts:
            return dict(self.held)
        if self.n_held:
            self._flush()
        return {"parts": self.parts, "fileCounts": dict(self.counts)}


def part_paths(manifest: Mapping[str, Any]) -> list[str]:
    """The paths of a manifest's parts (none for one document)."""
    return [str(p.get("path")) for p in manifest.get("parts") or []]
