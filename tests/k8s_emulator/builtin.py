"""Admission for the built-in kinds the operator writes: Job defaults, validation, immutability.

A subset of the real ``batch/v1`` validation, chosen for what an operator can get wrong:
names and label values, Indexed-mode requirements, the per-index backoff fields, the
pod failure policy, and fields that may not change after creation.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the store imports this module; only the type names are needed here
    from .store import Obj, Resource

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
MAX_INT32 = 2**31 - 1
# Fields of a Job's spec that the server refuses to change after creation.
IMMUTABLE = ("completionMode", "template", "podFailurePolicy", "backoffLimitPerIndex", "selector")


def _labels(meta: dict[str, Any], path: str) -> list[str]:
    problems = []
    for key, value in (meta.get("labels") or {}).items():
        if not isinstance(value, str) or len(value) > 63 or not LABEL_VALUE.match(value):
            problems.append(f'{path}.labels: Invalid value: "{value}": a valid label must be an empty string or '
                            "consist of alphanumeric characters, '-', '_' or '.', and must start and end with an "
                            "alphanumeric character (at most 63 characters)")
        if len(key.rsplit("/", 1)[-1]) > 63:
            problems.append(f'{path}.labels: Invalid value: "{key}": name part must be no more than 63 characters')
    return problems


def job_admission(res: Resource, obj: Obj, old: Obj | None) -> list[str]:
    """Default and validate a Job in place; returns the problems in the server's words."""
    meta = obj.setdefault("metadata", {})
    spec = obj.setdefault("spec", {})
    problems: list[str] = []
    name = meta.get("name", "")
    if not DNS_LABEL.match(name) or len(name) > 63:
        problems.append(f'metadata.name: Invalid value: "{name}": a Job name must be a DNS-1123 label of at most '
                        "63 characters (it becomes a label value)")
    problems += _labels(meta, "metadata")
    for i, ref in enumerate(meta.get("ownerReferences") or []):
        for key in ("apiVersion", "kind", "name", "uid"):
            if not ref.get(key):
                problems.append(f"metadata.ownerReferences[{i}].{key}: Required value")

    indexed = spec.get("completionMode") == "Indexed"
    spec.setdefault("completionMode", "NonIndexed")
    spec.setdefault("suspend", False)
    spec.setdefault("parallelism", 1)
    spec.setdefault("backoffLimit", MAX_INT32 if spec.get("backoffLimitPerIndex") is not None else 6)
    spec.setdefault("podReplacementPolicy", "Failed" if spec.get("podFailurePolicy") else "TerminatingOrFailed")
    template = spec.get("template") or {}
    pod = template.get("spec") or {}
    if indexed:
        if spec.get("completions") is None:
            problems.append("spec.completions: Required value: when completion mode is Indexed")
        elif not 0 <= spec["completions"] <= 100_000:
            problems.append(f"spec.completions: Invalid value: {spec['completions']}: must be between 0 and 100000")
    if spec.get("parallelism", 1) < 0:
        problems.append(f"spec.parallelism: Invalid value: {spec['parallelism']}: must be greater than or equal to 0")
    if spec.get("backoffLimitPerIndex") is not None and not indexed:
        problems.append("spec.backoffLimitPerIndex: Forbidden: requires indexed completion mode")
    if spec.get("maxFailedIndexes") is not None:
        if spec.get("backoffLimitPerIndex") is None:
            problems.append("spec.maxFailedIndexes: Forbidden: cannot set maxFailedIndexes when "
                            "backoffLimitPerIndex is not set")
        elif spec["maxFailedIndexes"] > (spec.get("completions") or 0):
            problems.append(f"spec.maxFailedIndexes: Invalid value: {spec['maxFailedIndexes']}: must be less than "
                            "or equal to completions")
    containers = pod.get("containers") or []
    if not containers:
        problems.append("spec.template.spec.containers: Required value")
    for i, c in enumerate(containers):
        for key in ("name", "image"):
            if not c.get(key):
                problems.append(f"spec.template.spec.containers[{i}].{key}: Required value")
    restart = pod.get("restartPolicy")
    if restart not in ("Never", "OnFailure"):
        problems.append(f'spec.template.spec.restartPolicy: Unsupported value: "{restart}": supported values: '
                        '"OnFailure", "Never"')
    problems += _labels(template.get("metadata") or {}, "spec.template.metadata")
    policy = spec.get("podFailurePolicy")
    if policy is not None:
        if restart != "Never":
            problems.append("spec.podFailurePolicy: Invalid value: only allowed when restartPolicy is Never")
        for i, rule in enumerate(policy.get("rules") or []):
            path = f"spec.podFailurePolicy.rules[{i}]"
            action = rule.get("action")
            if action not in ("FailJob", "FailIndex", "Ignore", "Count"):
                problems.append(f'{path}.action: Unsupported value: "{action}"')
            if action == "FailIndex" and spec.get("backoffLimitPerIndex") is None:
                problems.append(f"{path}.action: Forbidden: requires the backoffLimitPerIndex to be set")
            codes = rule.get("onExitCodes")
            conds = rule.get("onPodConditions")
            if (codes is None) == (conds is None):
                problems.append(f"{path}: Invalid value: specify one of onExitCodes and onPodConditions")
            if codes is not None:
                if codes.get("operator") not in ("In", "NotIn"):
                    problems.append(f'{path}.onExitCodes.operator: Unsupported value: "{codes.get("operator")}"')
                values = codes.get("values") or []
                if not values:
                    problems.append(f"{path}.onExitCodes.values: Required value")
                if codes.get("operator") == "In" and 0 in values:
                    problems.append(f"{path}.onExitCodes.values: Invalid value: 0: must not be 0 for the In operator")
    if old is not None:
        old_spec = old.get("spec") or {}
        for key in IMMUTABLE:
            if key in old_spec and spec.get(key) != old_spec.get(key):
                problems.append(f"spec.{key}: Invalid value: field is immutable")
        if indexed and spec.get("completions") != old_spec.get("completions") and \
                spec.get("completions") != spec.get("parallelism"):
            problems.append("spec.completions: Invalid value: can only be modified in tandem with spec.parallelism")
    return problems
