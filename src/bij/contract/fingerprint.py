"""A plan is a promise: what decides a job's rows, recorded when a round is planned and checked
on every later run, so rows made from one spec and one input are never mixed with another's.

What decides the rows: the spec fields in `ROW_FIELDS` (the input's place and shape, the model
and its sampling, the prompt template, the judge) and, for round 0, the input objects themselves (URI, size, and the
ETag on s3:// or the mtime on file://). The plan already carries both: the job's spec and its
objects. Everything else (sharding, batching, workers, storage, maxErrorRatio, suspend) only says
how the work is done, and may change between runs.

Checking costs a listing of the input (O(objects)); no row is read.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from bij.contract.errors import BijError
from bij.contract.plan import PlanObject
from bij.contract.sampling import DEFAULT_MAX_TOKENS, DEFAULT_SEED, DEFAULT_TEMPERATURE
from bij.contract.schemes import scheme_of
from bij.contract.spec import BatchInferenceJob, job_to_dict
from bij.contract.spec_io import DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_LINE_BYTES


class Listed(Protocol):
    """An input object as a listing shows it (storage's ObjectInfo): the contract does not import storage."""

    @property
    def uri(self) -> str: ...
    @property
    def size(self) -> int: ...
    @property
    def version(self) -> str | None: ...

ROW_FIELDS = (
    "input.uri", "input.format", "input.idField", "input.textField", "input.messagesField", "input.maxLineBytes",
    "input.samplingField", "input.adapterField", "input.maxImageBytes", "input.passThrough",
    "output.uri", "output.partitionBy",
    "model.engine", "model.name", "model.task", "model.maxTokens", "model.temperature", "model.seed",
    "model.sampling", "model.structuredOutput", "model.chatTemplate", "model.chatTemplateKwargs", "model.adapters",
    "model.maxInputTokens", "model.truncate", "model.vllm.maxModelLen", "model.vllm.quantization", "model.vllm.dtype",
    "model.vllm.engineArgs",
    "judge", "prompt",
)
# Fields younger than some plans: a plan without them ran with these values.
_ADDED_LATER: dict[str, Any] = {"input.maxLineBytes": DEFAULT_MAX_LINE_BYTES, "input.samplingField": "sampling",
                                "model.sampling": {}, "input.adapterField": "adapter", "model.adapters": [],
                                "model.vllm.engineArgs": {}, "input.maxImageBytes": DEFAULT_MAX_IMAGE_BYTES,
                                "output.partitionBy": "shard"}
# Fields a spec leaves unset (None) for a default applied elsewhere (sampling.SPEC_DEFAULTS): unset reads as
# that value, as plans written when the spec itself defaulted them recorded it, so those plans still match.
_UNSET_MEANS: dict[str, Any] = {"model.maxTokens": DEFAULT_MAX_TOKENS, "model.temperature": DEFAULT_TEMPERATURE,
                                "model.seed": DEFAULT_SEED}


class PlanRefused(BijError):
    """The job must not run as it stands: it does not match its plan, its output belongs to another
    job, its URIs overlap, or its inputs cannot each be published (output.partitionBy input). No retry
    helps; the message says what changed and what to do."""

    permanent = True


def _get(spec: Mapping[str, Any], path: str) -> Any:
    value: Any = spec
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return _UNSET_MEANS[path] if path in _UNSET_MEANS else _ADDED_LATER.get(path)
        value = value[part]
    return value


def row_fields(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The spec fields that decide the rows, by path, from a camelCase spec dict."""
    return {f"spec.{path}": _get(spec, path) for path in ROW_FIELDS}


def field_digests(job: BatchInferenceJob) -> dict[str, str]:
    """A short digest of each row-deciding field: small enough for the bij's status."""
    fields = row_fields(job_to_dict(job)["spec"])
    return {path: hashlib.sha256(json.dumps(v, sort_keys=True).encode()).hexdigest()[:12]
            for path, v in fields.items()}


def spec_changes(planned: BatchInferenceJob, job: BatchInferenceJob) -> list[str]:
    """How the job's row-deciding fields differ from the job a plan was made with."""
    old, new = row_fields(job_to_dict(planned)["spec"]), row_fields(job_to_dict(job)["spec"])
    return [f"{path} changed from {_show(old[path])} to {_show(new[path])}"
            for path in old if old[path] != new[path]]


def _show(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if isinstance(value, str) or len(text) <= 80 else text[:77] + "..."


def input_changes(planned: Sequence[PlanObject], current: Sequence[Listed]) -> list[str]:
    """How the input objects differ from the ones a plan was made with (URI, size, version)."""
    before = {o.uri: o for o in planned}
    now = {o.uri: o for o in current}
    out: list[str] = []
    added = [u for u in now if u not in before]
    removed = [u for u in before if u not in now]
    if added:
        out.append(f"{len(added)} input object(s) added ({_first(added)})")
    if removed:
        out.append(f"{len(removed)} input object(s) gone ({_first(removed)})")
    changed = []
    for uri, o in now.items():
        b = before.get(uri)
        if b is None:
            continue
        if b.size != o.size:
            changed.append(f"{uri} (size {b.size} -> {o.size})")
        elif b.version is not None and o.version is not None and b.version != o.version:
            scheme = scheme_of(uri)
            what = scheme.version if scheme is not None else "version"
            changed.append(f"{uri} (rewritten: {what} differs)")
    if changed:
        out.append(f"{len(changed)} input object(s) changed: {_first(changed)}")
    return out


def _first(items: list[str], n: int = 3) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


def digest(values: Any) -> str:
    """A stable digest of JSON-able values (recorded in the plan)."""
    return hashlib.sha256(json.dumps(values, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]
