"""The user guide's "every field, with its default" listing says what the spec model says."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from bij.contract.spec import parse_job

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "user-guide.md"
LISTING = "Every field, with its default"
# Example values in the listing, not defaults.
EXAMPLES = {"spec.input.uri", "spec.output.uri"}


def listing() -> tuple[str, dict[str, Any]]:
    text = GUIDE.read_text()
    start = text.index("```yaml", text.index(LISTING)) + len("```yaml")
    block = text[start:text.index("```", start)]
    return block, yaml.safe_load(block)


def defaults(doc: dict[str, Any]) -> dict[str, Any]:
    minimal = {"apiVersion": doc["apiVersion"], "kind": doc["kind"], "metadata": doc["metadata"],
               "spec": {"input": {"uri": doc["spec"]["input"]["uri"]}, "output": {"uri": doc["spec"]["output"]["uri"]}}}
    dumped = parse_job(minimal).spec.model_dump(by_alias=True)
    assert isinstance(dumped, dict)
    return dumped


def differences(listed: Any, default: Any, path: str) -> list[str]:
    if path in EXAMPLES:
        return []
    if isinstance(listed, dict) and isinstance(default, dict):
        if not listed:  # `{}` for a section whose fields are all unset
            return [] if all(v in (None, {}, []) for v in default.values()) else [f"{path}: {{}} vs {default}"]
        return [d for key, value in listed.items()
                for d in differences(value, default.get(key, "<no such field>"), f"{path}.{key}")]
    return [] if listed == default else [f"{path}: listed {listed!r}, default {default!r}"]


def unlisted(listed: Any, default: Any, path: str, block: str) -> list[str]:
    """Fields of the model the listing neither shows nor names in a comment."""
    if not (isinstance(listed, dict) and isinstance(default, dict)) or not listed:
        return []
    out = []
    for key, value in default.items():
        if key in listed:
            out += unlisted(listed[key], value, f"{path}.{key}", block)
        elif not re.search(rf"\b{re.escape(key)}\b", block):
            out.append(f"{path}.{key}")
    return out


def test_user_guide_lists_every_spec_field_with_its_true_default() -> None:
    block, doc = listing()
    parse_job(doc)  # the listing itself is a valid spec
    default = defaults(doc)
    assert differences(doc["spec"], default, "spec") == []
    assert unlisted(doc["spec"], default, "spec", block) == []
