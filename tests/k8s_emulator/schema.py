"""What the API server does with a custom resource's structural schema on every write.

In the server's order: apply ``default``s, prune fields the schema does not know (unless
``x-kubernetes-preserve-unknown-fields``), then validate (OpenAPI keywords and the CEL
rules in ``x-kubernetes-validations``). Error messages copy the server's wording, so a
test that checks "a clear message" checks what ``kubectl apply`` would print.
"""

from __future__ import annotations

import copy
import json
import re
from functools import lru_cache
from typing import Any

import celpy

Schema = dict[str, Any]

# Fields the server owns at the root of every object: never pruned, not in the schema's terms.
_ROOT_KEEP = ("apiVersion", "kind", "metadata")


def apply_defaults(value: Any, schema: Schema) -> Any:
    """`value` with the schema's defaults filled in, depth first (a defaulted ``{}`` gets its own)."""
    if isinstance(value, dict) and schema.get("type", "object") == "object":
        props = schema.get("properties") or {}
        for key, sub in props.items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
        for key, item in list(value.items()):
            if key in props:
                value[key] = apply_defaults(item, props[key])
            elif isinstance(schema.get("additionalProperties"), dict):
                value[key] = apply_defaults(item, schema["additionalProperties"])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [apply_defaults(v, schema["items"]) for v in value]
    return value


def prune(value: Any, schema: Schema, *, root: bool = False) -> Any:
    """`value` without the fields the schema does not declare."""
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        keep_unknown = bool(schema.get("x-kubernetes-preserve-unknown-fields")) or extra is True
        out: dict[str, Any] = {}
        for key, item in value.items():
            if root and key in _ROOT_KEEP:
                out[key] = item
            elif key in props:
                out[key] = prune(item, props[key])
            elif isinstance(extra, dict):
                out[key] = prune(item, extra)
            elif keep_unknown:
                out[key] = item
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [prune(v, schema["items"]) for v in value]
    return value


def _show(value: Any) -> str:
    if isinstance(value, dict):
        return '"object"'
    if isinstance(value, list):
        return '"array"'
    return json.dumps(value)


def _type_ok(value: Any, type_: str) -> bool:
    if type_ == "object":
        return isinstance(value, dict)
    if type_ == "array":
        return isinstance(value, list)
    if type_ == "string":
        return isinstance(value, str)
    if type_ == "boolean":
        return isinstance(value, bool)
    if type_ == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if type_ == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return True


@lru_cache(maxsize=256)
def _cel_program(rule: str) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(rule))


def _cel_ok(rule: str, value: Any) -> bool:
    try:
        result = _cel_program(rule).evaluate({"self": celpy.json_to_cel(value)})
    except Exception:  # noqa: BLE001 - an erroring rule is a failed rule, as in the server
        return False
    return bool(result) and not isinstance(result, celpy.CELEvalError)


def validate(value: Any, schema: Schema, path: str = "") -> list[str]:
    """Problems in the server's words, e.g. ``spec.workers.parallelism: Invalid value: 0: ...``."""
    where = path or "<root>"
    if value is None:
        if schema.get("nullable"):
            return []
        type_name = schema.get("type", "object")
        return [f'{where}: Invalid value: "null": {where} in body must be of type {type_name}: "null"']
    errors: list[str] = []
    type_ = schema.get("type")
    if schema.get("x-kubernetes-int-or-string"):
        if not (_type_ok(value, "integer") or _type_ok(value, "string")):
            return [f"{where}: Invalid value: {_show(value)}: {where} in body must be of type integer or string"]
    elif type_ and not _type_ok(value, type_):
        actual = {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer",
                  float: "number"}.get(type(value), "unknown")
        return [f"{where}: Invalid value: {_show(value)}: {where} in body must be of type {type_}: \"{actual}\""]

    if "enum" in schema and value not in schema["enum"]:
        allowed = ", ".join(json.dumps(v) for v in schema["enum"])
        errors.append(f"{where}: Unsupported value: {_show(value)}: supported values: {allowed}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and (value < schema["minimum"] or
                                    (schema.get("exclusiveMinimum") and value == schema["minimum"])):
            op = "greater than" if schema.get("exclusiveMinimum") else "greater than or equal to"
            errors.append(f"{where}: Invalid value: {_show(value)}: {where} in body should be {op} "
                          f"{schema['minimum']}")
        if "maximum" in schema and (value > schema["maximum"] or
                                    (schema.get("exclusiveMaximum") and value == schema["maximum"])):
            op = "less than" if schema.get("exclusiveMaximum") else "less than or equal to"
            errors.append(f"{where}: Invalid value: {_show(value)}: {where} in body should be {op} "
                          f"{schema['maximum']}")
    if isinstance(value, str):
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append(f"{where}: Too long: may not be longer than {schema['maxLength']}")
        if "minLength" in schema and len(value) < schema["minLength"]:
            errors.append(f"{where}: Invalid value: {_show(value)}: {where} in body should be at least "
                          f"{schema['minLength']} chars long")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(f"{where}: Invalid value: {_show(value)}: {where} in body should match "
                          f"'{schema['pattern']}'")
    if isinstance(value, list):
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errors.append(f"{where}: Too many: {len(value)}: must have at most {schema['maxItems']} items")
        if "minItems" in schema and len(value) < schema["minItems"]:
            errors.append(f"{where}: Invalid value: {len(value)}: {where} in body should have at least "
                          f"{schema['minItems']} items")
        if isinstance(schema.get("items"), dict):
            for i, item in enumerate(value):
                errors += validate(item, schema["items"], f"{path}[{i}]")
    if isinstance(value, dict):
        for key in schema.get("required") or []:
            if key not in value:
                errors.append(f"{_join(path, key)}: Required value")
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            if key in props:
                if not path and key == "metadata":
                    continue  # ObjectMeta is validated by the server itself, not the CRD schema
                errors += validate(item, props[key], _join(path, key))
            elif isinstance(extra, dict):
                errors += validate(item, extra, _join(path, key))
    for sub in schema.get("allOf") or []:
        errors += validate(value, sub, path)
    if schema.get("anyOf") and not any(not validate(value, s, path) for s in schema["anyOf"]):
        errors.append(f"{where}: Invalid value: {_show(value)}: {where} in body must match at least one schema")

    if not errors:
        # CEL rules run only on values that passed the OpenAPI checks, as in the server.
        for rule in schema.get("x-kubernetes-validations") or []:
            if not _cel_ok(rule["rule"], value):
                field = _join(path, rule["fieldPath"].lstrip(".")) if rule.get("fieldPath") else where
                message = rule.get("message") or f"failed rule: {rule['rule']}"
                errors.append(f"{field}: Invalid value: {_show(value)}: {message}")
    return errors


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def admit(obj: dict[str, Any], schema: Schema) -> tuple[dict[str, Any], list[str]]:
    """Default, prune and validate `obj`; returns the stored form and the problems."""
    out = apply_defaults(copy.deepcopy(obj), schema)
    out = prune(out, schema, root=True)
    return out, validate(out, schema)
