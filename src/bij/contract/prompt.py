"""spec.prompt: a row's prompt rendered from its columns by a sandboxed Jinja template.

The template sees one variable, `row`: the row's columns (`{{ row.title }}`). It runs in Jinja's
immutable sandbox, so a template reaches no Python internals and changes nothing; a column the row
lacks is an error (StrictUndefined), never an empty string. `compile_template` is checked once, at
spec validation (a template that does not parse is a spec error naming its line) and once per lane;
`render` runs once per row and turns whatever the template does wrong into a `PromptError` whose
message names the column or the problem (the row's `template_error` error row).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from jinja2 import StrictUndefined, Template, TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

# The error row's code for a row the template cannot be rendered for.
TEMPLATE_ERROR = "template_error"

# A rendered prompt longer than this is refused: `{{ row.x * 100000000 }}` must not exhaust a lane's memory.
MAX_RENDERED_CHARS = 1 << 24
# Largest exponent `**` may take in a template (a huge power is a CPU and memory bomb).
_MAX_EXPONENT = 256


class PromptError(Exception):
    """A row the template cannot be rendered for; the message names the column or the problem."""


class _Columns(dict[str, Any]):
    """A row's columns, told apart from nested objects so a missing one is named as a column."""


class _MissingColumn(StrictUndefined):
    """StrictUndefined whose error names the row's missing column."""

    __slots__ = ()

    @property
    def _undefined_message(self) -> str:
        if self._undefined_hint is None and isinstance(self._undefined_obj, _Columns) \
                and isinstance(self._undefined_name, str):
            return f"the row has no column {self._undefined_name!r}"
        return str(super()._undefined_message)


class _Sandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with `*` and `**` bounded (Jinja leaves them unbounded)."""

    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "**" and isinstance(right, int) and abs(right) > _MAX_EXPONENT:
            raise SecurityError(f"an exponent over {_MAX_EXPONENT} is not allowed in a prompt template")
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int) \
                        and len(seq) * times > MAX_RENDERED_CHARS:
                    raise SecurityError(f"a repetition over {MAX_RENDERED_CHARS} items is not allowed in a prompt "
                                        "template")
        return super().call_binop(context, operator, left, right)


_ENV = _Sandbox(undefined=_MissingColumn, autoescape=False, keep_trailing_newline=False)


def compile_template(source: str) -> Template:
    """The compiled template; ValueError naming the line when it does not parse."""
    try:
        return _ENV.from_string(source)
    except TemplateSyntaxError as e:
        raise ValueError(f"does not parse as a Jinja template: line {e.lineno}: {e.message}") from None


@lru_cache(maxsize=16)
def compiled_template(source: str) -> Template:
    """compile_template, once per process for each source: a lane's shards share one compiled template."""
    return compile_template(source)


def render(template: Template, columns: Mapping[str, Any]) -> str:
    """The template rendered over one row's columns; PromptError saying why it cannot be."""
    parts: list[str] = []
    size = 0
    try:
        # Streamed, so a loop that writes without end is stopped at the limit rather than filling memory.
        for piece in template.generate(row=_Columns(columns)):
            size += len(piece)
            if size > MAX_RENDERED_CHARS:
                raise PromptError(f"spec.prompt.template rendered over {MAX_RENDERED_CHARS} characters for this row")
            parts.append(piece)
    except SecurityError as e:
        raise PromptError(f"spec.prompt.template is not allowed to do this: {e}") from None
    except TemplateError as e:  # UndefinedError included: a missing column
        raise PromptError(f"spec.prompt.template: {e}") from None
    except (ArithmeticError, TypeError, ValueError, LookupError, AttributeError, RecursionError, MemoryError) as e:
        # The template's own expressions (a division by zero, a filter given the wrong type): this row's fault.
        raise PromptError(f"spec.prompt.template failed: {type(e).__name__}: {e}") from None
    return "".join(parts)
