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

`Manifest` is the document as a model: publishing builds one and writes it (`Manifest.to_json`), and
`bij results`, bij-api, `bij run` and the manifest step read one (`Manifest.parse`), by its attributes.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from bij.contract.errors import BijError

# A manifest listing more files than this lists them in parts of at most this many; BIJ_MANIFEST_PART_FILES
# sets another number (tests: a few files in parts, in the step processes too).
PART_FILES = 10_000
LISTS = ("files", "errorFiles", "cappedFiles")
_FIELDS = {"files": "files", "errorFiles": "error_files", "cappedFiles": "capped_files"}  # each list's field
PART_KIND = "BatchInferenceJobManifestPart"
PARTS_FOLDER = "manifest-parts"

# A figure as it was written: an int stays an int and a float a float, so that a document read and
# written back is the same text (a price of 2 is not rewritten 2.0).
Number = int | float

Read = Callable[[str], bytes]  # a path relative to the output folder -> its bytes


class BadManifest(BijError):
    """A document that is not a manifest (not JSON, or a field of the wrong shape)."""

    permanent = True


class _Doc(BaseModel):
    """A part of the manifest: camelCase JSON, read leniently (a field this version does not know is kept,
    so that a manifest read and written back loses nothing), dumped with exactly the keys it was made with
    (`as_json`: a field left unset is never written, a field set to None is written as null)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="allow", frozen=True)

    def as_json(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_unset=True, mode="json")


class ManifestJob(_Doc):
    name: str = ""
    namespace: str | None = None
    id: str = ""


class ManifestModel(_Doc):
    engine: str = ""
    name: str | None = None  # none for an engine that needs no model (echo, simulated)
    task: str = ""


class StructuredCounts(_Doc):
    """Structured answers checked after decoding (bij.engines.structured)."""

    validated: int = 0
    repaired: int = 0  # valid only on the second grammar backend's try
    violations: int = 0  # published as schema_violation error rows


class ManifestCounts(_Doc):
    rows: int = 0
    errors: int = 0
    capped: int = 0
    duplicates: int = 0
    truncated: int = 0
    input_rows: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    reasoning_tokens: int = 0
    not_run: int | None = None  # a partial manifest only
    error_codes: dict[str, int] = {}
    structured: StructuredCounts = StructuredCounts()


class PartialCounts(_Doc):
    completed: int = 0
    failed: int = 0
    not_run: int = 0


class Partial(_Doc):
    """What marks a manifest partial: the phase the job stopped in (Cancelled or Expired) and why."""

    phase: Literal["Cancelled", "Expired"]
    reason: str = ""
    counts: PartialCounts = PartialCounts()


class DamagedObject(_Doc):
    """input.onDamagedObject errorRow: an object published without what lay behind its break."""

    round: int = 0
    shard: int = 0
    object: str = ""
    offset: int = 0
    reason: str = ""
    message: str = ""


class ManifestRound(_Doc):
    """One round: its shards, then its result and error rows (with a judge, its verdicts first: `RoundStats`),
    kept as written and in that order (extra fields, read with `count`)."""

    round: int = 0
    shards: int = 0

    def count(self, key: str) -> int:
        """`rows`, `errors`, or with a judge `approved`, `rejected`, `capped`, ...: 0 where absent."""
        return int((self.model_extra or {}).get(key) or 0)


class EngineFigures(_Doc):
    """How busy the engine was and what its prefix cache could reuse, from the shards' completion records."""

    busy_seconds: Number = 0.0
    steps: int = 0
    mean_occupancy: Number | None = None
    prefix_share: Number | None = None
    cached_tokens: int = 0


class EfficiencyFigures(_Doc):
    """`contract.efficiency.efficiency`: what the workers spent and how busy their engines were."""

    worker_seconds: Number = 0.0
    model_loads: int = 0
    model_load_seconds: Number = 0.0
    slowest_model_load_seconds: Number = 0.0
    weights_bytes: int = 0
    engine_busy_seconds: Number = 0.0
    engine_busy_fraction: Number = 0.0
    rows_per_second_per_worker: Number = 0.0
    tokens_per_second_per_worker: Number = 0.0
    worker_seconds_by_pool: dict[str, Number] | None = None  # spec.workers.pools


class CostFigures(_Doc):
    """`contract.efficiency.cost`: what the worker pods cost at spec.workers.pricePerHour."""

    pods_per_lane: int | None = None
    pools: dict[str, Number] | None = None
    price_per_hour: Number = 0.0
    total: Number = 0.0
    per_million_rows: Number | None = None
    per_million_tokens: Number | None = None


class CanaryCheck(_Doc):
    """spec.canary: its estimate of round 0 against round 0 as it ran (`contract.canary.accuracy`)."""

    shards: int = 0
    estimate: dict[str, Number] = {}
    actual: dict[str, Number] = {}
    error: dict[str, Number] = {}


class ManifestPart(_Doc):
    """A manifest part as `manifest.json` lists it: its path, size, checksum and how many of each list it holds."""

    path: str = ""
    bytes: int = 0
    sha256: str = ""
    files: int = 0
    error_files: int = 0
    capped_files: int = 0


class RemovalFailed(_Doc):
    """Removing work files failed after the manifest was written (output.keepIntermediate false): how far
    it got and what is left where. Never part of manifest.json: a publish's answer beside it."""

    removed: int = 0
    bytes: int = 0
    left: str = ""
    error: str | None = None


class ManifestFile(_Doc):
    """A published file: its path under the output, rows, bytes and sha256 (`bij results` checks it), the
    input object it holds the rows of (output.partitionBy input), and where it came from (kept as written)."""

    path: str
    rows: int = 0
    bytes: int = 0
    sha256: str = ""
    input: str | None = None  # output.partitionBy input: the input object, relative to the input's folder


class Manifest(_Doc):
    """`manifest.json` (docs/output.md), field by field in the order publishing writes them. Read with
    `Manifest.parse`, written with `to_json`; `file_count`, `iter_listed` and `listed` read its file lists,
    from its parts where it has them."""

    api_version: str = ""
    kind: str = "BatchInferenceJobManifest"
    job: ManifestJob = ManifestJob()
    output_uri: str = ""
    format: str = "jsonl"
    compression: str | None = None
    model: ManifestModel = ManifestModel()
    judge: str | None = None
    # Either the lists themselves, or (more than `PART_FILES` files) `parts` and `fileCounts`.
    files: list[ManifestFile] | None = None
    error_files: list[ManifestFile] | None = None
    capped_files: list[ManifestFile] | None = None
    parts: list[ManifestPart] | None = None
    file_counts: dict[str, int] | None = None
    counts: ManifestCounts = ManifestCounts()
    notes: list[str] = []  # what the engine could not serve at all, once each
    rounds: list[ManifestRound] = []
    partial: Partial | None = None  # Cancelled or Expired
    damaged_objects: list[DamagedObject] = []
    engine: EngineFigures | None = None
    efficiency: EfficiencyFigures | None = None
    published_at: str = ""
    cost: CostFigures | None = None  # with spec.workers.pricePerHour
    canary: CanaryCheck | None = None  # with spec.canary
    # Beside the manifest, never in it: removing work files failed after it was written (`finish_publish`).
    work_files_removal: RemovalFailed | None = Field(None, exclude=True)

    @classmethod
    def parse(cls, doc: Any, where: str = "manifest") -> Manifest:
        """A manifest from its JSON (bytes or text) or its parsed document; `BadManifest` when it is not one."""
        try:
            if isinstance(doc, (bytes, str)):
                doc = json.loads(doc)
            return cls.model_validate(doc)
        except ValueError as e:  # ValidationError is one
            raise BadManifest(f"{where} is not a manifest: {_first(e)}") from None

    def to_json(self) -> bytes:
        """`manifest.json`'s bytes."""
        return json.dumps(self.as_json(), indent=2).encode()

    def file_count(self, key: str = "files") -> int:
        """How many files a list of the manifest has, without reading its parts."""
        if self.file_counts is not None and key in self.file_counts:
            return int(self.file_counts[key])
        return len(self.listed_here(key) or [])

    def listed_here(self, key: str) -> list[ManifestFile] | None:
        """One list as the manifest itself holds it (None where it is in parts, or absent)."""
        if key not in LISTS:
            raise ValueError(f"{key!r} is not a manifest file list ({', '.join(LISTS)})")
        here: list[ManifestFile] | None = getattr(self, _FIELDS[key])
        return here

    def part_paths(self) -> list[str]:
        """The paths of its parts (none for one document)."""
        return [p.path for p in self.parts or []]


def _first(e: ValueError) -> str:
    if isinstance(e, ValidationError) and e.errors():
        err = e.errors()[0]
        return f"{'.'.join(str(p) for p in err['loc']) or 'the document'}: {err['msg']}"
    return str(e)


class BadManifestPart(BijError):
    """A manifest part that is missing its checksum or its lists: the manifest cannot be read whole."""

    permanent = True


def part_files() -> int:
    """How many files a manifest part lists at most (and a manifest without parts)."""
    return max(1, int(os.environ.get("BIJ_MANIFEST_PART_FILES") or PART_FILES))


def of(manifest: Manifest | Mapping[str, Any]) -> Manifest:
    """`manifest` as the model (a document read as JSON is parsed)."""
    return manifest if isinstance(manifest, Manifest) else Manifest.parse(manifest)


def iter_listed(manifest: Manifest | Mapping[str, Any], key: str, read: Read) -> Iterator[ManifestFile]:
    """The entries of one list (`files`, `errorFiles`, `cappedFiles`) in order, from the manifest itself or
    from its parts, one part in memory at a time."""
    m = of(manifest)
    here = m.listed_here(key)
    if not m.parts:
        yield from here or []
        return
    for part in m.parts:
        if not getattr(part, _FIELDS[key]):
            continue  # the part lists none of these: not read
        for entry in read_part(part, read)[key]:
            try:
                yield ManifestFile.model_validate(entry)
            except ValidationError as e:
                raise BadManifestPart(f"manifest part {part.path} lists a file that is not one: {_first(e)}") from None


def listed(manifest: Manifest | Mapping[str, Any], key: str, read: Read) -> list[ManifestFile]:
    """One list of the manifest, whole (see `iter_listed`)."""
    return list(iter_listed(manifest, key, read))


def whole(manifest: Manifest | Mapping[str, Any], read: Read) -> Manifest:
    """The manifest in one-document form: its lists read from its parts, `parts` and `fileCounts` dropped."""
    m = of(manifest)
    if not m.parts:
        return m
    doc = {k: v for k, v in m.as_json().items() if k not in ("parts", "fileCounts")}
    doc.update({key: [] for key in LISTS})
    for part in m.parts:
        got = read_part(part, read)
        for key in LISTS:
            doc[key] += got[key]
    return Manifest.parse(doc)


def read_part(part: ManifestPart, read: Read) -> dict[str, Any]:
    """A manifest part's document, checked against the checksum the manifest holds for it."""
    path = part.path
    data = read(path)
    if hashlib.sha256(data).hexdigest() != part.sha256:
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
        self.parts: list[ManifestPart] = []
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
        self.parts.append(ManifestPart.model_validate({
            "path": path, "bytes": len(body), "sha256": hashlib.sha256(body).hexdigest(),
            **{key: len(v) for key, v in self.held.items()}}))
        self.held, self.n_held = {key: [] for key in LISTS}, 0

    def finish(self) -> dict[str, Any]:
        """The manifest's list fields as its document names them (`Manifest(**finish())`): the lists, or
        `parts` and `fileCounts`; the last part is written first where there are parts."""
        if not self.parts:
            return dict(self.held)
        if self.n_held:
            self._flush()
        return {"parts": self.parts, "fileCounts": dict(self.counts)}
