"""The BatchInferenceJob CustomResourceDefinition, generated from the contract's models.

`crd()` builds the whole object: names, printer columns, and the OpenAPI v3 schema of the spec
(`spec.JobSpec`) and of the status (`status.JobStatus`), converted from pydantic's JSON schema to
the structural schema the API server demands: references inlined, `Optional` as `nullable` only
where the default is not null (elsewhere a null is pruned and the default applies), numeric
exclusive bounds in OpenAPI 3.0 form, free-form objects kept as given, no titles. Descriptions are
the fields' docstrings (read from the source here, so that importing a model costs nothing for
them); CEL rules and other extras are declared on the models (`bij.contract.schema`).

`make sync-crd` writes it to crds/batchinferencejobs.yaml and the Helm chart's crds/ folder;
tests/contract/test_crd.py fails when a written copy differs from what `crd()` gives.
"""

from __future__ import annotations

import ast
import copy
import functools
import inspect
import textwrap
import typing
from typing import Any

import yaml
from pydantic import BaseModel

from bij.contract.codes import API_GROUP, PLURAL
from bij.contract.schema import FREE_FORM, cel
from bij.contract.spec import API_VERSION, KIND, MAX_NAME_LEN, JobSpec
from bij.contract.status import JobStatus

NAME = f"{PLURAL}.{API_GROUP}"

# `kubectl get bij` (priority 1: `-o wide`).
PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Round", "type": "integer", "jsonPath": ".status.round"},
    {"name": "Shards", "type": "string", "description": "shards done / shards in the current round",
     "jsonPath": ".status.shardsSummary"},
    {"name": "Rows", "type": "integer", "description": "rows done so far, all rounds", "jsonPath": ".status.rows.done"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    {"name": "Lanes", "type": "string", "description": "lanes (worker pods) done / lanes in the current round",
     "jsonPath": ".status.lanesSummary", "priority": 1},
    {"name": "Pools", "type": "string", "description": "spec.workers.pools: lanes running / lanes per pool",
     "jsonPath": ".status.poolsSummary", "priority": 1},
    {"name": "Throughput", "type": "number", "description": "rows per second over the last progress interval",
     "jsonPath": ".status.rowsPerSecond", "priority": 1},
    {"name": "ETA", "type": "string", "description": "time left in the current round at the rate so far",
     "jsonPath": ".status.eta", "priority": 1},
    {"name": "Cost", "type": "number", "description": "worker pod hours so far x spec.workers.pricePerHour",
     "jsonPath": ".status.cost.total", "priority": 1},
    {"name": "Output", "type": "string", "jsonPath": ".spec.output.uri", "priority": 1},
    {"name": "Message", "type": "string",
     "description": "what the job is doing or waiting for (a missing grant, a step's retry), or why it failed",
     "jsonPath": ".status.message", "priority": 1},
]

# The round Job `<name>-r<round>` and its pods are named after the bij, so the name must be a DNS
# label with room for the suffixes (spec.Metadata checks the same).
NAME_RULES = [
    cel("self.metadata.name.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$')",
        "metadata.name must be lowercase letters, digits and '-', starting and ending alphanumeric (no dots)"),
    cel(f"size(self.metadata.name) <= {MAX_NAME_LEN}",
        f"metadata.name must be at most {MAX_NAME_LEN} characters so that round Jobs <name>-r<round> and their "
        "pods get valid names"),
]

_NUMERIC_BOUNDS = {"exclusiveMinimum": "minimum", "exclusiveMaximum": "maximum"}
_DROP = {"title", "additionalProperties", "$defs", "discriminator"}


def openapi(model: type[BaseModel], *, defaults: bool = True) -> dict[str, Any]:
    """The structural OpenAPI v3 schema of `model`, as the CRD holds it. `defaults=False` leaves the
    defaults out (the status: the API server would fill them into every status it returns)."""
    schema = model.model_json_schema(by_alias=True, mode="validation", ref_template="{model}")
    defs = {name: _described(sub, name, model) for name, sub in schema.pop("$defs", {}).items()}
    return _node(_described(schema, model.__name__, model), defs, defaults)


def _models(model: type[BaseModel]) -> dict[str, type[BaseModel]]:
    """`model` and every model its fields hold, by class name (the names of pydantic's `$defs`)."""
    found: dict[str, type[BaseModel]] = {}

    def visit(annotation: Any) -> None:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            if found.setdefault(annotation.__name__, annotation) is not annotation:
                raise ValueError(f"two models named {annotation.__name__}")
            for field in annotation.model_fields.values():
                visit(field.annotation)
        for arg in typing.get_args(annotation):
            visit(arg)

    visit(model)
    return found


@functools.cache
def docstrings(model: type[BaseModel]) -> dict[str, str]:
    """Each field's docstring (the string right below it in the class body), by its JSON name."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(model)))
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    out = {}
    for field, doc in zip(body, body[1:], strict=False):
        if (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)
                and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                and isinstance(doc.value.value, str) and field.target.id in model.model_fields):
            info = model.model_fields[field.target.id]
            out[info.alias or field.target.id] = inspect.cleandoc(doc.value.value)
    return out


def _described(schema: dict[str, Any], name: str, root: type[BaseModel]) -> dict[str, Any]:
    """A model's schema with its fields' docstrings as their descriptions, and without its own (a model's
    docstring speaks to the code; the field that holds it describes it)."""
    schema = {k: v for k, v in schema.items() if k != "description"}
    model = _models(root).get(name)
    if model is not None and "properties" in schema:
        docs = docstrings(model)
        schema["properties"] = {key: {"description": docs[key], **sub} if key in docs else sub
                                for key, sub in schema["properties"].items()}
    return schema


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """`node` with its `$ref` replaced by the model it names; the field's own keys win."""
    if "$ref" not in node:
        return node
    merged = {**copy.deepcopy(defs[node["$ref"]]), **{k: v for k, v in node.items() if k != "$ref"}}
    return _resolve(merged, defs)


def _node(node: dict[str, Any], defs: dict[str, Any], defaults: bool) -> dict[str, Any]:
    node = _resolve(node, defs)
    default = node.get("default")
    if "anyOf" in node:  # Optional[X]: X; null stays allowed only where the default is not null
        kinds = [k for k in node["anyOf"] if k.get("type") != "null"]
        if len(kinds) != 1:
            raise ValueError(f"a union the CRD cannot express: {node['anyOf']}")
        nullable = len(kinds) < len(node["anyOf"]) and default is not None
        node = {**_resolve(kinds[0], defs), **{k: v for k, v in node.items() if k != "anyOf"}}
        if nullable:
            node["nullable"] = True
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP or key == "default":
            continue
        if key in _NUMERIC_BOUNDS and not isinstance(value, bool):  # JSON schema 2020 -> OpenAPI 3.0
            out[_NUMERIC_BOUNDS[key]] = value
            out[key] = True
        elif key == "description":  # a docstring's line breaks are not the text's
            out[key] = " ".join(value.split())
        elif key == "const":
            out["enum"] = [value]
        elif key == "properties":
            out[key] = {name: _node(sub, defs, defaults) for name, sub in value.items()}
        elif key == "items":
            out[key] = _node(value, defs, defaults)
        else:
            out[key] = value
    extra = node.get("additionalProperties")
    if out.get("type") == "object" and "properties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        if isinstance(extra, dict) and extra:
            out["additionalProperties"] = _node(extra, defs, defaults)
        else:  # dict[str, Any]: any object
            out.update(FREE_FORM)
    if defaults and default is not None and not (isinstance(default, (list, dict)) and not default):
        # An object field whose default is the model's own defaults: `{}`, which the API server fills in.
        out["default"] = {} if "properties" in out else default
    return out


def crd() -> dict[str, Any]:
    """The CustomResourceDefinition object."""
    root = {
        "description": "BatchInferenceJob runs a model over every row of a JSONL input and publishes the results "
                       "atomically under spec.output.uri, one Indexed Job per round.",
        "type": "object",
        "required": ["spec"],
        "x-kubernetes-validations": NAME_RULES,
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": openapi(JobSpec),
            "status": {"description": JobStatus.__doc__, **openapi(JobStatus, defaults=False)},
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": NAME, "labels": {"app.kubernetes.io/name": "bij-operator",
                                              "app.kubernetes.io/part-of": "bij"}},
        "spec": {
            "group": API_GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "listKind": f"{KIND}List", "plural": PLURAL, "singular": KIND.lower(),
                      "shortNames": ["bij"]},
            "versions": [{
                "name": API_VERSION, "served": True, "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": PRINTER_COLUMNS,
                "schema": {"openAPIV3Schema": root},
            }],
        },
    }


HEADER = ("# GENERATED by `make sync-crd` from the models in src/bij/contract (spec*.py, status.py, crd.py) and\n"
          "# its tables (engines.py, schemes.py, formats.py): edit those, not this file.\n")


def crd_yaml() -> str:
    """`crd()` as the YAML file the chart ships and `kubectl apply -f` takes."""
    return HEADER + yaml.safe_dump(crd(), sort_keys=False, width=110, allow_unicode=True)
