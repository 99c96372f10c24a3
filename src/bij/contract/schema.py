"""What the contract's models say to the Kubernetes API server, beside the models themselves.

The CRD's OpenAPI schema is generated from the models (`bij.contract.crd`, `make sync-crd`). A field's
docstring is its description; its pydantic constraints are the schema's bounds; what pydantic cannot
express (a CEL rule, a list's merge type, int64) is declared here and attached with `Field(
json_schema_extra=...)` on a field or `ConfigDict(json_schema_extra=...)` on a model. The models check
the same rules in Python (their validators), so that `bij run` and `bij validate` refuse what the API
server refuses; tests/contract/test_crd.py holds the two to the same verdicts.
"""

from __future__ import annotations

from typing import Any

# An integer the API server stores as int64 (byte counts, row counts, seconds).
INT64: dict[str, Any] = {"format": "int64"}
# A free-form object kept as given (engine arguments, a JSON schema, an affinity).
FREE_FORM: dict[str, Any] = {"x-kubernetes-preserve-unknown-fields": True}


def cel(rule: str, message: str, field_path: str | None = None) -> dict[str, str]:
    """One `x-kubernetes-validations` entry: a CEL rule over `self` and the message the API server gives."""
    out = {"rule": rule, "message": message}
    if field_path is not None:
        out["fieldPath"] = field_path
    return out


def cel_list(values: tuple[str, ...]) -> str:
    """A CEL list literal of these strings (`['a', 'b']`), for a rule's `in`."""
    return "[" + ", ".join(f"'{v}'" for v in values) + "]"


def k8s(*rules: dict[str, str], **extra: Any) -> dict[str, Any]:
    """A `json_schema_extra` with these CEL rules and other schema keys (`maxLength=4096`, ...).

    Keys are OpenAPI names; `x_kubernetes_list_type="set"` is written `x-kubernetes-list-type`."""
    out: dict[str, Any] = {k.replace("x_kubernetes_", "x-kubernetes-").replace("_", "-")
                           if k.startswith("x_kubernetes_") else k: v for k, v in extra.items()}
    if rules:
        out["x-kubernetes-validations"] = list(rules)
    return out
