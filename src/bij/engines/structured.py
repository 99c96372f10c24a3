"""Structured answers, checked after decoding: a structured answer is valid, or an error row.

Constrained decoding is not proof: grammar backends leave some JSON-Schema keywords out
(`uniqueItems`, `not`, `if`/`then`/`else`, ...) and have defects of their own (xgrammar emits
raw control characters inside length-bounded strings, xgrammar#800). So every answer of a row
with `structuredOutput` (finished, or cut by its token cap) is checked here with a real
validator, whichever engine made it (the transformers engine first retries a broken answer
once on its second grammar backend, llguidance):

- ``json_schema``: strict JSON (no NaN, no raw control characters), then the `jsonschema`
  library's validator for the schema's own draft, its regexes (`pattern`, `patternProperties`) and
  `uniqueItems` checked in linear time and the whole check stopped after `CHECK_SECONDS`;
- ``json_object``: strict JSON whose value is an object;
- ``regex``: the pattern matches the whole answer, matched by RE2 (linear time);
- ``choice``: the answer is one of the choices;
- ``grammar`` (EBNF): no validator here; counted as unchecked.

An answer that breaks its structured output becomes a ``schema_violation`` error row carrying
the answer, never a success; so does an answer cut by its token cap (finish_reason ``length``)
that breaks it (half a JSON object), the message saying so. A cut answer that still keeps to its
structured output (a pattern that a prefix satisfies) is a success with finish_reason ``length``.

No answer may hold the worker for long: Python's `re` backtracks (``(a+)+b`` against forty ``a``s
runs for hours, holding the GIL, so the lane's lease and report threads starve), so every regex is
matched by RE2, whose time is linear in the answer. RE2 reads the dialect the grammar backends take
(no backreferences, no lookarounds; ``\\d``, ``\\w`` are ASCII, as in JSON Schema's ECMA-262); a
pattern RE2 refuses makes the answer a violation naming the pattern and why, never a fallback to
`re`. A schema whose check runs past `CHECK_SECONDS` (nested ``anyOf`` over a deep answer is
exponential) makes the answer a violation that says so.

`grammar_schema` tightens a schema before it reaches the grammar backend where a known
defect can be avoided: a string bounded by minLength/maxLength (and without a pattern of its
own, bounds up to `MAX_TIGHTENED_LENGTH`) is given as a pattern of that length over characters
other than U+0000 to U+001F, so no raw control character can be generated inside it. The
validator still checks the schema as the row gave it.
"""

from __future__ import annotations

import contextvars
import functools
import json
import math
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import re2

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
# The longest one answer's schema check may run: a real answer checks in milliseconds; past this the
# check is stopped (a pure-Python check does not starve other threads, but it must still end).
CHECK_SECONDS = 2.0
# How deep an answer may nest arrays and objects to be parsed, and to be checked against its schema (the
# check recurses several frames a level): bounds of their own, not the interpreter's recursion limit.
PARSE_DEPTH = 512
CHECK_DEPTH = 128
# Compiled patterns kept (RE2 programs; each bounded by RE2's max_mem, 8 MiB).
MOST_PATTERNS = 1024
# A JSON Schema pattern may write a character as \uXXXX (ECMA-262); RE2 writes it \x{XXXX}. Escapes
# are read pairwise from the left, so an escaped backslash before a "u" stays what it is.
_ESCAPE = re.compile(r"\\(u[0-9a-fA-F]{4}|.)", re.DOTALL)
_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False  # a refused pattern is reported in its row, not on stderr


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


def _nesting(text: str, most: int) -> bool:
    """Whether the JSON text `text` nests arrays and objects deeper than `most` (brackets inside strings not
    counted); linear in the text, and no scan at all when it has too few brackets to."""
    if text.count("[") + text.count("{") <= most:
        return False
    depth, in_string, escaped = 0, False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > most:
                return True
        elif ch in "]}":
            depth -= 1
    return False


def _depth(value: Any) -> int:
    """How deep a parsed JSON value nests arrays and objects (iteratively: no recursion to run out of)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (list, dict)):
            deepest = max(deepest, d)
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def _strict_json(text: str) -> Any:
    """The JSON value of `text`, refusing what Python's parser allows beyond JSON (NaN, Infinity)
    and raw control characters inside strings (json.loads refuses them with strict=True, its default).
    Nesting is bounded by `PARSE_DEPTH` before parsing, whatever the interpreter's recursion limit
    (which other libraries raise), so a deep answer is refused the same way everywhere."""
    if _nesting(text, PARSE_DEPTH):
        raise ValueError("nested deeper than the parser goes")
    try:
        return json.loads(text, parse_constant=_strict_constant)
    except RecursionError:
        raise ValueError("nested deeper than the parser goes") from None


@functools.lru_cache(maxsize=MOST_PATTERNS)
def linear_pattern(text: str) -> Any:
    """`text` compiled by RE2 (whose match time is linear in the string), or why RE2 refuses it (a str):
    a backreference, a lookaround, a count over 1,000, a program over RE2's memory bound."""
    try:
        return re2.compile(_ESCAPE.sub(_re2_escape, text), _RE2_OPTIONS)
    except re2.error as e:
        why = e.args[0] if e.args else e
        return (why.decode("utf-8", "replace") if isinstance(why, bytes) else str(why)) or "refused"


def _re2_escape(m: re.Match[str]) -> str:
    return f"\\x{{{m[1][1:]}}}" if m[1][0] == "u" and len(m[1]) == 5 else m[0]


def _refused(text: str, why: str) -> str:
    return f"the pattern {text!r} cannot be matched in linear time (RE2: {why})"


class _PastDeadline(Exception):
    """A schema check ran past its deadline."""


# When the schema check running in this thread must stop (monotonic clock).
_deadline: contextvars.ContextVar[float] = contextvars.ContextVar("bij_check_deadline", default=math.inf)


def _bounded(keyword: Any) -> Any:
    """A jsonschema keyword that first looks at the clock: every step of a check, however deep or
    branching, goes through a keyword, so a check past its deadline stops at its next step."""
    def check(validator: Any, value: Any, instance: Any, schema: Any) -> Iterator[Any]:
        if time.monotonic() > _deadline.get():
            raise _PastDeadline
        yield from keyword(validator, value, instance, schema) or ()
    return check


def _pattern_keyword(validator: Any, pattern: Any, instance: Any, schema: Any) -> Iterator[Any]:
    from jsonschema.exceptions import ValidationError

    if validator.is_type(instance, "string"):
        compiled = linear_pattern(pattern)
        if isinstance(compiled, str):
            yield ValidationError(_refused(pattern, compiled))
        elif not compiled.search(instance):
            yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties_keyword(validator: Any, patterns: Any, instance: Any, schema: Any) -> Iterator[Any]:
    from jsonschema.exceptions import ValidationError

    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        compiled = linear_pattern(pattern)
        if isinstance(compiled, str):
            yield ValidationError(_refused(pattern, compiled))
            continue
        for k, v in instance.items():
            if compiled.search(k):
                yield from validator.descend(v, subschema, path=k, schema_path=pattern)


def _additional_properties_keyword(validator: Any, extra: Any, instance: Any, schema: Any) -> Iterator[Any]:
    """jsonschema's additionalProperties, the patternProperties it skips matched by RE2 (a refused
    pattern is reported by patternProperties itself)."""
    from jsonschema.exceptions import ValidationError

    if not validator.is_type(instance, "object"):
        return
    patterns = schema.get("patternProperties", {})
    compiled = [c for c in map(linear_pattern, patterns) if not isinstance(c, str)]
    properties = schema.get("properties", {})
    extras = sorted((k for k in instance if k not in properties and not any(c.search(k) for c in compiled)), key=str)
    if validator.is_type(extra, "object"):
        for k in extras:
            yield from validator.descend(instance[k], extra, path=k)
    elif not extra and extras:
        names = ", ".join(map(repr, extras))
        if patterns:
            yield ValidationError(f"{names} {'does' if len(extras) == 1 else 'do'} not match any of the regexes: "
                                  + ", ".join(map(repr, sorted(patterns))))
        else:
            yield ValidationError(f"Additional properties are not allowed ({names} "
                                  f"{'was' if len(extras) == 1 else 'were'} unexpected)")


def _json_identity(value: Any) -> Any:
    """A hashable stand-in equal where JSON Schema's equality is (1 == 1.0, true != 1, keys unordered)."""
    if isinstance(value, bool):
        return ("boolean", value)
    if isinstance(value, int | float):
        return ("number", value)
    if isinstance(value, list):
        return ("array", tuple(map(_json_identity, value)))
    if isinstance(value, dict):
        return ("object", frozenset((k, _json_identity(v)) for k, v in value.items()))
    return (type(value).__name__, value)


def _unique_items_keyword(validator: Any, unique: Any, instance: Any, schema: Any) -> Iterator[Any]:
    """uniqueItems by hashing: jsonschema compares unsortable items (objects) pairwise, quadratic in
    a long answer's array, inside one step the deadline cannot stop."""
    from jsonschema.exceptions import ValidationError

    if unique and validator.is_type(instance, "array"):
        seen: set[Any] = set()
        for item in instance:
            key = _json_identity(item)
            if key in seen:
                yield ValidationError(f"{instance!r} has non-unique elements")
                return
            seen.add(key)


_LINEAR_KEYWORDS = {"pattern": _pattern_keyword, "patternProperties": _pattern_properties_keyword,
                    "additionalProperties": _additional_properties_keyword, "uniqueItems": _unique_items_keyword}


@functools.lru_cache(maxsize=16)
def _bounded_validator(base: Any) -> Any:
    """The draft's validator class with its regexes matched by RE2, uniqueItems hashed, and every keyword
    looking at the deadline."""
    import jsonschema

    keywords = {k: _bounded(_LINEAR_KEYWORDS.get(k, fn)) for k, fn in base.VALIDATORS.items()}
    return jsonschema.validators.extend(base, validators=keywords)


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

    def __init__(self, most: int = 1024, seconds: float = CHECK_SECONDS):
        self.most, self.seconds = most, seconds
        self._schemas: dict[str, Any] = {}

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
            if _depth(value) > CHECK_DEPTH:
                return "nested deeper than its schema's check goes"
            started = _deadline.set(time.monotonic() + self.seconds)
            try:
                error = next(iter(self._schema(text).iter_errors(value)), None)
            except _PastDeadline:
                return f"its schema's check ran past {self.seconds:g} s and was stopped (too costly to check)"
            except RecursionError:
                return "nested deeper than its schema's check goes"
            finally:
                _deadline.reset(started)
            if error is None:
                return None
            where = "/".join(map(str, error.absolute_path)) or "(the value)"
            return f"at {where}: {error.message} (keyword {error.validator})"
        if kind == "regex":
            pattern = linear_pattern(text)
            if isinstance(pattern, str):
                return _refused(text, pattern)
            return None if pattern.fullmatch(output) else f"does not match the pattern {text!r}"
        if kind == "choice":
            choices = json.loads(text)
            return None if output in choices else f"not one of the choices {choices!r}"
        return None

    def checkable(self, structured: tuple[str, str]) -> bool:
        return structured[0] in ("json_schema", "json_object", "regex", "choice")

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
            v = _bounded_validator(jsonschema.validators.validator_for(schema))(schema)
            if len(self._schemas) >= self.most:
                self._schemas.clear()
            self._schemas[text] = v
        return v
