"""Pass-through columns: which input columns a published row carries beside its own fields.

A plain (JSONL or Parquet) input row's other columns are carried to its result row, its
error row and its capped row, at the top level after the row's own fields, as Ray Data keeps
a dataset's columns (`input.passThrough`):

- unset: every column the row's request does not consume. Consumed are the id column (the
  result has it as `id`), the text, messages, sampling and adapter columns, and the judge
  rounds' `_bij` field (bij's own, read only from a later round's input; a user's row with it
  is an error row); so is any column of a name in `RESULT_FIELDS`, which a row may not
  have then (the planner refuses the job, a worker makes such a row an error row naming it).
- a list: those columns only (a column a row lacks is left out of its JSON line, null in
  Parquet); it may name a consumed column (the text, to keep it beside its answer).
- []: none.

OpenAI batch lines carry nothing: their output line has a fixed shape.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

# The names a published row (result, error or capped; JSON lines or Parquet) uses itself.
RESULT_FIELDS = frozenset({
    "id", "id_int", "output", "embedding", "usage", "prompt_tokens", "completion_tokens", "choices",
    "truncated", "attempts", "round", "verdicts", "error", "object", "offset", "_bij",
})
# The pooling tasks' own result fields (model.task classify, score, rerank): in a job of that task an
# input column of such a name clashes as a RESULT_FIELDS one does; other tasks carry it as any column.
TASK_FIELDS: dict[str, frozenset[str]] = {
    "classify": frozenset({"label", "probs"}), "score": frozenset({"score"}), "rerank": frozenset({"results"}),
}


def result_fields(task: str) -> frozenset[str]:
    """The names a published row of `task` uses itself: RESULT_FIELDS and the task's own."""
    return RESULT_FIELDS | TASK_FIELDS.get(task, frozenset())


def consumed(id_field: str, text_field: str, messages_field: str | None, sampling_field: str,
             adapter_field: str) -> frozenset[str]:
    """The columns a plain row's request consumes: never carried by every-column pass-through."""
    return frozenset(c for c in (id_field, text_field, messages_field, sampling_field, adapter_field, "_bij") if c)


def clash_message(column: str, where: str) -> str:
    """Why an input column cannot be carried: it has a result field's name."""
    return (f"input column {column!r} ({where}) clashes with the result field of that name; rename the column, "
            "or name the columns to carry in spec.input.passThrough (or [] for none)")


def first_clash(columns: Iterable[str], consumed: Iterable[str]) -> str | None:
    """The first of `columns` that every-column pass-through would carry and that has a result field's name."""
    skip = set(consumed)
    return next((c for c in columns if c in RESULT_FIELDS and c not in skip), None)


def carried(obj: dict[str, Any], consumed: frozenset[str], pass_through: tuple[str, ...] | None) -> dict[str, Any]:
    """The columns of `obj` its published rows carry (no clash check: see `first_clash`)."""
    if pass_through is None:
        return {k: v for k, v in obj.items() if k not in consumed}
    return {k: obj[k] for k in pass_through if k in obj}
