"""Structured answers, checked after decoding: a structured answer is valid, or an error row.

Constrained decoding is not proof: grammar backends leave some JSON-Schema keywords out
(`uniqueItems`, `not`, `if`/`then`/`else`, ...) and have defects of their own (xgrammar emits
raw control characters inside length-bounded strings, xgrammar#800). So every answer of a row
with `structuredOutput` (finished, or cut by its token cap) is checked here with a real
validator, whichever engine made it (the transformers engine first retries a broken answer
once on its second grammar backend, llguidance):

- ``json_schema``: strict JSON (no NaN, no raw control characters), then the `jsonschema`
  library's validator for the schema's own draft;
- ``json_object``: strict JSON whose value is an object;
- ``regex``: the pattern matches the whole answer (`re.fullmatch`);
- ``choice``: the answer is one of the choices;
- ``grammar`` (EBNF): no validator here; counted as unchecked.

An answer that breaks its structured output becomes a ``schema_violation`` error row carrying
the answer, never a success; so does an answer cut by its token cap (finish_reason ``length``)
that breaks it (half a JSON object), the message saying so. A cut answer that still keeps to its
structured output (a pattern that a prefix satisfies) is a success with finish_reason ``length``.

`grammar_schema` tightens a schema before it reaches the grammar backend where a known
defect can be avoided: a string bounded by minLength/maxLength (and without a pattern of its
own, bounds up to `MAX_TIGHTENED_LENGTH`) is given as a pattern of that length over characters
other than U+0000 to U+001F, so no raw control character can be generated inside it. The
validator still checks the schema as the row gave it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from bij.engines.base import Request, Result

SCHEMA_VIOLATION = "schema_violation"
# An answer carried by its error row is cut to this many characters.
MAX_CARRIED = 8192
# A bound up to which a string is tightened: xgrammar's compile time for a counted pattern grows with
# its bound (about 2 s at 1,000, 30 s at 5,000 on one core); a longer bound is left to the validator
# and the second grammar backend.
MAX_TIGHTENED_LENGTH = 256
# Characters a JSON string may hold without escaping: anything but U+0000 to U+001F.
_NO_CONTROL = "[^\\x00-\\x1f]"
# JSON-Schema keywords xgrammar (the transformers engine's and vLLM's default grammar backend)
# does not enforce while decoding: only the validator catches an answer that breaks them.
UNENFORCED_KEYWORDS = ("uniqueItems", "not", "if", "then", "else", "dependentSchemas", "dependentRequired",
                       "patternProperties", "propertyNames", "contains", "minContains", "maxContains",
                       "multipleOf", "format", "unevaluatedProperties", "unevaluatedItems")


def grammar_schema(text: str) -> str:
    """The schema (JSON text) to give the grammar backend: `text` with its length-bounded strings
    made patterns that exclude raw control characters (see the module doc)."""
    schema = json.loads(text)
    tightened = _tighten(schema)
    return text if tightened == schema else json.dumps(tightened, separators=(",", ":"), ensure_ascii=False)


def _tighten(node: Any) -> Any:
    if isinstance(node, list):
        return [_tighten(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: (v if k in ("enum", "const", "default", "examples") else _tighten(v)) for k, v in node.items()}
    bounded = "minLength" in out or "maxLength" in out
    if (out.get("type") == "string" and bounded and "pattern" not in out and "format" not in out
            and "enum" not in out and "const" not in out):
        lo, hi = out.get("minLength", 0), out.get("maxLength")
        if isinstance(lo, int) and isinstance(hi, int | None) and max(lo, hi or 0) <= MAX_TIGHTENED_LENGTH:
            out.pop("minLength", None)
            out.pop("maxLength", None)
            out["pattern"] = f"^{_NO_CONTROL}{{{lo},{'' if hi is None else hi}}}$"
    return out


def _strict_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _strict_json(text: str) -> Any:
    """The JSON value of `text`, refusing what Python's parser allows beyond JSON (NaN, Infinity)
    and raw control characters inside strings (json.loads refuses them with strict=True, its default)."""
    return json.loads(text, parse_constant=_strict_constant)


@dataclass
class Checked:
    """What checking a batch of answers found: rows whose answers all validated, rows that
    broke their structured output (now error rows), and rows with nothing to check them by."""

    validated: int = 0
    violations: int = 0
    unchecked: int = 0
    repaired: int = 0  # validated only on a second grammar backend's try (among `validated`)


class Validator:
    """Checks structured answers; the validators of schemas and patterns seen are kept (bounded)."""

    def __init__(self, most: int = 1024):
        self.most = most
        self._schemas: dict[str, Any] = {}
        self._patterns: dict[str, re.Pattern[str]] = {}

    def problem(self, structured: tuple[str, str], output: str) -> str | None:
        """Why `output` breaks `structured`; None when it keeps to it (or it cannot be checked)."""
        kind, text = structured
        if kind in ("json_schema", "json_object"):
            try:
                value = _strict_json(output)
            except ValueError as e:
                return f"not valid JSON: {e}"
            if kind == "json_object":
                return None if isinstance(value, dict) else f"a JSON {type(value).__name__}, not an object"
            error = next(iter(self._schema(text).iter_errors(value)), None)
            if error is None:
                return None
            where = "/".join(map(str, error.absolute_path)) or "(the value)"
            return f"at {where}: {error.message} (keyword {error.validator})"
        if kind == "regex":
            pattern = self._pattern(text)
            if pattern is None:
                return None
            return None if pattern.fullmatch(output) else f"does not match the pattern {text!r}"
        if kind == "choice":
            choices = json.loads(text)
            return None if output in choices else f"not one of the choices {choices!r}"
        return None

    def checkable(self, structured: tuple[str, str]) -> bool:
        kind, text = structured
        if kind == "regex":
            return self._pattern(text) is not None
        return kind in ("json_schema", "json_object", "choice")

    def check(self, requests: list[Request], results: list[Result]) -> Checked:
        """Check every structured answer; a row that breaks its structured output becomes
        a `schema_violation` error result (in place). What was found, counted by row."""
        found = Checked()
        for i, (req, res) in enumerate(zip(requests, results, strict=True)):
            structured = req.sampling.structured_output
            if structured is None or res.error is not None:
                continue
            if not self.checkable(structured):
                found.unchecked += 1
                continue
            answers = ([(c.output, c.finish_reason) for c in res.choices] if res.choices
                       else [(res.output or "", res.extra.get("finish_reason", "stop"))])
            bad = None
            for k, (output, finish) in enumerate(answers):
                why = self.problem(structured, output)
                if why is not None:
                    if finish == "length":  # cut by its token cap: a half-written answer is no success either
                        why += f" (cut at its token cap: {res.completion_tokens} tokens; raise maxTokens)"
                    bad = (k, output, why)
                    break
            if bad is None:
                found.validated += 1
                found.repaired += bool(res.extra.pop("repaired", False))
                continue
            k, output, why = bad
            which = f"answer {k} " if len(answers) > 1 else "the answer "
            found.violations += 1
            results[i] = Result(
                output=output[:MAX_CARRIED], prompt_tokens=res.prompt_tokens, completion_tokens=res.completion_tokens,
                error=f"{which}breaks its structured output ({structured[0]}): {why}",
                extra={"code": SCHEMA_VIOLATION})
        return found

    def _schema(self, text: str) -> Any:
        v = self._schemas.get(text)
        if v is None:
            import jsonschema

            schema = json.loads(text)
            v = jsonschema.validators.validator_for(schema)(schema)
            if len(self._schemas) >= self.most:
                self._schemas.clear()
            self._schemas[text] = v
        return v

    def _pattern(self, text: str) -> re.Pattern[str] | None:
        """The regex compiled by Python's `re`; None when `re` cannot read it (a syntax only the
        grammar backend has): such an answer is unchecked, never refused for the validator's sake."""
        if text not in self._patterns:
            try:
                compiled: re.Pattern[str] | None = re.compile(text)
            except re.error:
                compiled = None
            if len(self._patterns) >= self.most:
                self._patterns.clear()
            self._patterns[text] = compiled  # type: ignore[assignment]
        return self._patterns[text]
