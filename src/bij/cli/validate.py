"""Check a BatchInferenceJob offline the way the API server would, then with the operator's model.

The API server's verdict comes from the CRD (`bij.contract.crd`, generated from the models: the
object `make sync-crd` writes to crds/batchinferencejobs.yaml): unknown fields, pruning of nulls,
defaults, the openAPI schema and the CEL rules (x-kubernetes-validations, evaluated with
cel-python). Messages have the API server's shape, e.g. ``spec.judge: Invalid value: judge.type
regex needs judge.pattern`` (checked against a real kube-apiserver by tests/system/test_cluster.py).

The operator parses what the API server stored (the defaulted object) with ``spec.parse_job``;
anything the CRD lets through but the model rejects is reported too, since such a job would be
accepted by ``kubectl apply`` and then fail in the operator.
"""

from __future__ import annotations

import argparse
import copy
import functools
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import yaml
import zstandard

from bij.contract.codes import API_GROUP
from bij.contract.crd import crd
from bij.contract.globs import glob_matches, split_glob
from bij.contract.spec import API_VERSION, CANARY_MAX_ROWS, CANARY_SHARE, KIND, BatchInferenceJob, SpecError, parse_job
from bij.control.notify import secret_env

# Schema violations after which the API server does not run the CEL rules (a rule could not
# rely on the fields it reads), and what it says instead.
BLOCKING_FOR_RULES = frozenset({"type", "required", "enum", "maxLength", "maxItems", "maxProperties"})
RULES_SKIPPED = (
    '<nil>: Invalid value: "null": some validation rules were not checked because the object was '
    "invalid; correct the existing errors to complete validation"
)


@functools.cache
def load_crd() -> dict[str, Any]:
    """The BatchInferenceJob CRD, as generated from the models."""
    return crd()


def crd_schema(version: str = API_VERSION) -> dict[str, Any]:
    """The openAPIV3Schema of one served version of the CRD."""
    for v in load_crd()["spec"]["versions"]:
        if v["name"] == version:
            schema: dict[str, Any] = v["schema"]["openAPIV3Schema"]
            return schema
    raise KeyError(f"the CRD has no version {version}")


@dataclass
class Verdicts:
    """The independent verdicts on one document."""

    schema: list[str] = field(default_factory=list)  # API server: openAPI schema + CEL rules
    model: list[str] = field(default_factory=list)  # the pydantic model on the document as written (bij run)
    model_stored: list[str] = field(default_factory=list)  # ... on the object the API server stores (operator)
    stored: dict[str, Any] | None = None  # the object as the API server would store it


def _model_problems(doc: dict[str, Any]) -> list[str]:
    try:
        parse_job(doc)
    except SpecError as e:
        return list(e.problems)
    return []


def check_document(doc: Any) -> Verdicts:
    """Every verdict on a BatchInferenceJob document, for callers that want to compare them."""
    if not isinstance(doc, dict):
        problem = "(document): must be a mapping with apiVersion, kind, metadata and spec"
        return Verdicts(schema=[problem], model=[problem])
    verdicts = Verdicts(model=_model_problems(doc))
    verdicts.schema, verdicts.stored = api_server_problems(doc)
    if verdicts.stored is not None:
        verdicts.model_stored = _model_problems(verdicts.stored)
    return verdicts


def validate_document(doc: Any) -> list[str]:
    """Problems with a BatchInferenceJob document; empty when the API server and the model accept it.

    The API server's problems come first and alone: nothing else ever sees a rejected object.
    For an accepted object, the model's problems follow (ideally there are none), both on the
    document as written (what `bij run` reads) and as stored (what the operator reads).
    """
    verdicts = check_document(doc)
    if verdicts.schema:
        return verdicts.schema
    problems = dict.fromkeys(verdicts.model + verdicts.model_stored)  # ordered, without repeats
    return [f"{p} (the CRD accepts this, the BatchInferenceJob model does not)" for p in problems]


def api_server_problems(doc: dict[str, Any]) -> tuple[list[str], dict[str, Any] | None]:
    """What the API server would say about creating ``doc``, and the object it would store.

    The stored object is None when the request would not even reach validation (wrong kind).
    """
    api_version, kind = doc.get("apiVersion"), doc.get("kind")
    if api_version != f"{API_GROUP}/{API_VERSION}" or kind != KIND:
        return [
            f'no matches for kind "{kind}" in version "{api_version}": '
            f"expected apiVersion {API_GROUP}/{API_VERSION}, kind {KIND}"
        ], None
    schema = crd_schema()
    obj = copy.deepcopy(doc)
    # The status subresource: status in a create request is dropped, not validated.
    obj.pop("status", None)
    problems = [f'unknown field "{p}"' for p in _prune(obj, schema, [])]
    metadata = obj.get("metadata")
    if not isinstance(metadata, dict) or not (metadata.get("name") or metadata.get("generateName")):
        problems.append("metadata.name: Required value: name or generateName is required")
        return problems, None
    _apply_defaults(obj, schema)
    # The API server decodes an integer beyond int64 as a float: a type error for an integer field.
    schema_errors = [("type", _huge_int_error(p, schema)) for p in _drop_huge_ints(obj, [])]
    schema_errors += _schema_errors(obj, schema)
    problems += [msg for _, msg in schema_errors]
    if any(kind in BLOCKING_FOR_RULES for kind, _ in schema_errors):
        problems.append(RULES_SKIPPED)
    else:
        problems += _cel_errors(obj, schema, [], root=True)
    return problems, obj


# --- what the API server does before validating ---------------------------------------------


def _prune(value: Any, schema: dict[str, Any], path: list[str | int]) -> list[str]:
    """Drop unknown fields (returning their paths, as strict field validation reports them) and
    nulls where the schema is not nullable, in place."""
    unknown: list[str] = []
    if isinstance(value, dict) and schema.get("type") == "object":
        props: dict[str, Any] = schema.get("properties", {})
        addl = schema.get("additionalProperties")
        for key in list(value):
            sub = props.get(key) if key in props else addl if isinstance(addl, dict) else None
            if path == [] and key == "metadata":
                continue  # ObjectMeta is validated by the API machinery, not the CRD schema
            if sub is None:
                if not schema.get("x-kubernetes-preserve-unknown-fields"):
                    unknown.append(_dotted(path + [key]))
                    del value[key]
                continue
            if value[key] is None and not sub.get("nullable"):
                del value[key]
                continue
            unknown += _prune(value[key], sub, path + [key])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            unknown += _prune(item, schema["items"], path + [i])
    return unknown


def _apply_defaults(value: Any, schema: dict[str, Any]) -> None:
    """Fill in the schema's defaults in place, recursing into defaults just added (as the API
    server does: `model: {}` by default, then `model.engine: echo`)."""
    if isinstance(value, dict):
        props: dict[str, Any] = schema.get("properties", {})
        for key, sub in props.items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                _apply_defaults(value[key], sub)
        addl = schema.get("additionalProperties")
        if isinstance(addl, dict):
            for key in value:
                if key not in props:
                    _apply_defaults(value[key], addl)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            _apply_defaults(item, schema["items"])


INT64 = (-(1 << 63), (1 << 63) - 1)


def _huge_int_error(parts: list[str | int], schema: dict[str, Any]) -> str:
    """The API server's words for an integer beyond int64: a float where an integer (of format int64,
    when the field has that format) was expected."""
    node: dict[str, Any] | None = schema
    for part in parts:
        if node is None:
            break
        if isinstance(part, int):
            node = node.get("items")
        else:
            props = node.get("properties", {})
            extra = node.get("additionalProperties")
            node = props[part] if part in props else extra if isinstance(extra, dict) else None
    path = _field_path(parts, schema)
    if node is not None and node.get("format") == "int64":
        return f'{path}: Invalid value: "float64": {path} in body must be of type int64: "float64"'
    return f'{path}: Invalid value: "number": {path} in body must be of type integer: "number"'


def _drop_huge_ints(value: Any, path: list[str | int]) -> list[list[str | int]]:
    """Remove integers that do not fit in int64 (in place), returning their paths."""
    found: list[list[str | int]] = []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else []
    for key, sub in list(items):
        if isinstance(sub, int) and not isinstance(sub, bool) and not INT64[0] <= sub <= INT64[1]:
            found.append(path + [key])
            if isinstance(value, dict):
                del value[key]
            else:
                value[key] = 0
        else:
            found += _drop_huge_ints(sub, path + [key])
    return found


# --- openAPI schema ---------------------------------------------------------------------------


def _to_json_schema(node: Any) -> Any:
    """Translate the CRD's OpenAPI v3.0 dialect to JSON Schema 2020-12 (nullable, boolean
    exclusiveMinimum, x-kubernetes-list-type set as uniqueItems); other x-kubernetes-* keys are left
    for jsonschema to ignore."""
    if isinstance(node, list):
        return [_to_json_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _to_json_schema(v) for k, v in node.items() if k not in ("nullable", "default")}
    if node.get("nullable") and "type" in node:
        out["type"] = [node["type"], "null"]
    if node.get("x-kubernetes-list-type") == "set":
        out["uniqueItems"] = True
    for bound, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        if node.get(exclusive) is True:
            out[exclusive] = out.pop(bound)
        elif exclusive in node and isinstance(node[exclusive], bool):
            del out[exclusive]
    return out


@functools.cache
def _validator() -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(_to_json_schema(crd_schema()))


def _schema_errors(obj: dict[str, Any], schema: dict[str, Any]) -> list[tuple[str, str]]:
    """(validator keyword, API-server-style message) for each openAPI schema violation."""
    out: list[tuple[str, str]] = []
    for err in sorted(_validator().iter_errors(obj), key=lambda e: [str(p) for p in e.absolute_path]):
        parts = list(err.absolute_path)
        where = _field_path(parts, schema)
        kw, limit, value = err.validator, err.validator_value, err.instance
        if kw == "required":
            for name in limit:
                if isinstance(value, dict) and name not in value:
                    out.append((kw, f"{_field_path(parts + [name], schema)}: Required value"))
            continue
        if kw == "uniqueItems":  # a listType set: each repeated item, where it repeats
            for i, item in enumerate(value):
                if item in value[:i]:
                    out.append((kw, f"{_field_path(parts + [i], schema)}: Duplicate value: {_go(item)}"))
            continue
        if kw == "type":
            got = _json_type(value)
            want = limit[0] if isinstance(limit, list) else limit
            msg = f'Invalid value: "{got}": {where} in body must be of type {want}: "{got}"'
        elif kw == "enum":
            supported = ", ".join(json.dumps(v) for v in limit)
            msg = f"Unsupported value: {_go(value)}: supported values: {supported}"
        elif kw == "minimum":
            msg = f"Invalid value: {_go(value)}: {where} in body should be greater than or equal to {limit}"
        elif kw == "exclusiveMinimum":
            msg = f"Invalid value: {_go(value)}: {where} in body should be greater than {limit}"
        elif kw == "maximum":
            msg = f"Invalid value: {_go(value)}: {where} in body should be less than or equal to {limit}"
        elif kw == "exclusiveMaximum":
            msg = f"Invalid value: {_go(value)}: {where} in body should be less than {limit}"
        elif kw == "pattern":
            msg = f"Invalid value: {_go(value)}: {where} in body should match '{limit}'"
        elif kw == "minLength":
            msg = f"Invalid value: {_go(value)}: {where} in body should be at least {limit} chars long"
        elif kw == "maxLength":
            msg = f"Too long: may not be longer than {limit}"
        elif kw == "maxItems":
            msg = f"Too many: {len(value)}: must have at most {limit} items"
        else:
            msg = f"Invalid value: {_go(value)}: {err.message}"
        out.append((kw, f"{where}: {msg}"))
    return out


# --- CEL rules --------------------------------------------------------------------------------


@functools.cache
def _cel_program(rule: str) -> celpy.Runner:
    env = celpy.Environment()
    return env.program(env.compile(rule))


def _cel_errors(value: Any, schema: dict[str, Any], path: list[str | int], *, root: bool = False) -> list[str]:
    """Evaluate every x-kubernetes-validations rule whose value is present, depth first."""
    problems: list[str] = []
    rules = schema.get("x-kubernetes-validations", [])
    if rules:
        self_value = value
        if root and isinstance(value, dict):
            # Root rules may read only metadata.name and metadata.generateName.
            meta = value.get("metadata") or {}
            self_value = {**value, "metadata": {k: meta[k] for k in ("name", "generateName") if k in meta}}
        activation = {"self": celpy.json_to_cel(self_value)}  # integers beyond int64 were dropped before
        for rule in rules:
            try:
                result: object = _cel_program(rule["rule"]).evaluate(activation)
            except (celpy.CELEvalError, ValueError, OverflowError) as e:  # cel-python: ValueError("overflow")
                result = e
            rule_path = path + [p for p in rule.get("fieldPath", "").split(".") if p]
            where = _field_path(rule_path, crd_schema()) if rule_path else "<nil>"
            if isinstance(result, celpy.celtypes.BoolType) and bool(result):
                continue
            if isinstance(result, celpy.celtypes.BoolType):
                detail = rule.get("message") or f"failed rule: {rule['rule']}"
            else:  # an evaluation error: the API server reports it, never lets it pass
                detail = f"rule {rule['rule']!r} could not be evaluated: {result!s}"
            # The API server's wording: the value itself for a scalar, nothing for an object or list.
            shown = "" if isinstance(value, (dict, list)) else f"{json.dumps(value)}: "
            problems.append(f"{where}: Invalid value: {shown}{detail}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        addl = schema.get("additionalProperties")
        for key, sub_value in value.items():
            sub = props.get(key) if key in props else addl if isinstance(addl, dict) else None
            if sub is not None:
                problems += _cel_errors(sub_value, sub, path + [key])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            problems += _cel_errors(item, schema["items"], path + [i])
    return problems


# --- formatting -------------------------------------------------------------------------------


def _field_path(parts: list[str | int], schema: dict[str, Any]) -> str:
    """`spec.workers.tolerations[0].key`, `spec.workers.nodeSelector[cloud.google.com/gke-spot]`."""
    out = ""
    node: dict[str, Any] | None = schema
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
            node = node.get("items") if node else None
        elif node and part in node.get("properties", {}):
            out += f".{part}" if out else part
            node = node["properties"][part]
        else:  # a map key
            out += f"[{part}]"
            addl = node.get("additionalProperties") if node else None
            node = addl if isinstance(addl, dict) else None
    return out


def _dotted(parts: list[str | int]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else p) for i, p in enumerate(parts))


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return "null"


def _go(value: Any) -> str:
    """A value as the API server prints it in a field error (strings quoted)."""
    if isinstance(value, (dict, list)):
        return f'"{_json_type(value)}"'
    return json.dumps(value)


# --- CLI ----------------------------------------------------------------------------------------


def cli_validate(args: argparse.Namespace) -> int:
    """`bij validate SPEC`: print "valid", or each problem of each BatchInferenceJob in the file."""
    path = Path(args.spec)
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except OSError as e:
        print(f"{path}: cannot read file: {e.strerror}")
        return 1
    except yaml.YAMLError as e:
        print(f"{path}: not valid YAML: {e}")
        return 1
    jobs = [d for d in docs if isinstance(d, dict) and d.get("kind") == KIND]
    if not jobs:
        print(f"{path}: no {KIND} document found")
        return 1
    failed = False
    for doc in jobs:
        problems = validate_document(doc)
        if problems:
            failed = True
            name = (doc.get("metadata") or {}).get("name", "")
            print(f'{path}: {KIND} "{name}" is invalid:')
            for p in problems:
                print(f"  * {p}")
    if not failed:
        print("valid")
        for doc in jobs:
            job = parse_job(doc)
            for line in canary_summary(job):
                print(line)
            for line in notify_summary(job):
                print(line)
            for line in prompt_preview(job):
                print(line)
    return 1 if failed else 0


def canary_summary(job: BatchInferenceJob) -> list[str]:
    """What spec.canary will do, its defaults filled in: how many rows run first, and what stops the job."""
    c = job.spec.canary
    if c is None:
        return []
    rows = f"{c.rows:,} rows" if c.rows is not None else \
        f"{CANARY_SHARE:.1%} of the input's rows, at most {CANARY_MAX_ROWS:,}"
    limits = [f"error rows above {c.max_error_share:.1%}" if c.max_error_share is not None else "",
              f"answers cut at maxTokens above {c.max_length_cut_share:.1%}"
              if c.max_length_cut_share is not None else "",
              f"schema violations above {c.max_schema_violation_share:.1%}"
              if c.max_schema_violation_share is not None else "",
              f"fewer than {c.min_tokens_per_second_per_lane:g} output tokens/s per lane"
              if c.min_tokens_per_second_per_lane is not None else ""]
    stops = "; ".join(x for x in limits if x) or "no threshold set: it only measures, and estimates the job"
    return [f"canary: shards of round 0 spread over the input holding about {rows} run alone first "
            "(whole shards); "
            f"the job stops there (CanaryFailed) on: {stops}"]


def notify_summary(job: BatchInferenceJob) -> list[str]:
    """What spec.notify will do: each webhook, the ends it is told of, and where its signing key comes from (the
    Secret on a cluster, an environment variable with `bij run`)."""
    out = []
    for t in job.spec.notify:
        ref = t.secret_ref
        line = (f"notify: {t.url} is told of {', '.join(t.events)} (a POST signed with Secret {ref.name}, key "
                f"{ref.key}; bij run: env {secret_env(ref)})")
        if t.url.startswith("http://"):
            line += "; http:// sends the body unencrypted (it is signed, not secret)"
        out.append(line)
    return out


# Rows `bij validate` renders spec.prompt.template for.
PREVIEW_ROWS = 3


def prompt_preview(job: BatchInferenceJob, rows: int = PREVIEW_ROWS) -> list[str]:
    """spec.prompt rendered for the first `rows` rows of a file:// input, as the worker renders them (the
    request each row becomes, or its error row); nothing when the job has no prompt or its input is elsewhere."""
    from bij.steps.plan_input import input_objects
    from bij.storage import StorageError, open_storage
    from bij.worker.input_row import InputOptions
    from bij.worker.inputs import parse_line

    spec = job.spec
    if spec.prompt is None:
        return []
    if not spec.input.uri.startswith("file://"):
        return [f"spec.prompt: not rendered here: the input {spec.input.uri} is not a file:// input"]
    parquet = spec.input.format == "parquet"
    base, pattern = split_glob(spec.input.uri)
    try:
        listed = open_storage(base, None).list(base)
    except StorageError as e:
        return [f"spec.prompt: not rendered here: cannot list {spec.input.uri}: {e}"]
    if pattern is not None:
        listed = [o for o in listed if glob_matches(pattern, o.uri[len(base):])]
    objects = input_objects(listed, base, parquet)
    if not objects:
        return [f"spec.prompt: not rendered here: no input rows at {spec.input.uri}"]
    uri = objects[0].uri
    opts = InputOptions.from_spec(spec)
    out = [f"spec.prompt rendered for the first rows of {uri}:"]
    offset = 0
    for line in _first_lines(uri.removeprefix("file://"), parquet, rows):
        row = parse_line(line, (0, offset, offset + len(line)), uri.rsplit("/", 1)[-1], opts)
        offset += len(line)
        label = f"  row {json.dumps(row.id, ensure_ascii=False)}"
        if row.request is None:
            out.append(f"{label}: {row.error_code}: {row.error}")
        elif row.request.messages is not None:
            out.append(f"{label}:")
            out += [f"    {m['role']}: {_indented(m['content'])}" for m in row.request.messages]
        else:
            out.append(f"{label}: {_indented(row.request.text)}")
    return out


def _indented(text: Any) -> str:
    return str(text).replace("\n", "\n      ")


def _first_lines(path: str, parquet: bool, n: int) -> list[bytes]:
    """The first `n` rows of a local input object as JSON lines (Parquet rows encoded as the worker reads them)."""
    if parquet:
        import pyarrow.parquet as pq

        batch = next(pq.ParquetFile(path).iter_batches(batch_size=n), None)
        return [] if batch is None else [json.dumps(r, default=str).encode() for r in batch.to_pylist()[:n]]
    lines: list[bytes] = []
    with open(path, "rb") as raw:
        stream = zstandard.ZstdDecompressor().stream_reader(raw) if path.endswith(".zst") else raw
        for line in io.BufferedReader(stream) if path.endswith(".zst") else stream:
            if line.strip():
                lines.append(line.rstrip(b"\n"))
            if len(lines) == n:
                break
    return lines
