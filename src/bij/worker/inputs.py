"""Input rows in: `jsonl` rows and OpenAI batch request lines, each parsed into its request (or an error row).

A bad row never stops a shard: it becomes an error row that says what is wrong
and where the row is (object and byte offset). Rows without an id get a stable
one from their place, ``<object name>:<byte offset>``, the same on every run.

Each row's request is built here, once: its content, and its sampling fields from the
spec, the OpenAI body or the sampling column (`sampling.py`). A field bij does not know
is an ``invalid_request`` row; one the engine cannot honour, an ``unsupported`` row.

A plain row's other columns are carried to its result, error and capped rows
(`contract.columns`, input.passThrough); a row with a column named like a result field
is an ``invalid_row`` row naming it. Integers beyond 64 bits are read exactly (exact_json).

With spec.prompt a plain row's prompt is rendered from its columns (`contract.prompt`, once per row,
the template compiled once per lane): a row the template fails on (a missing column, a sandbox refusal)
is a ``template_error`` row naming why.

A row's ``_bij`` field is bij's own bookkeeping of judge rounds, read only from a later
round's input (which bij wrote); a user's row with one is an ``invalid_row`` row.
"""

from __future__ import annotations

import json
from itertools import repeat
from typing import Any, cast

import orjson

from bij.contract.columns import carried as carried_columns
from bij.contract.columns import clash_message
from bij.contract.sampling import over_budget
from bij.engines.base import Request
from bij.storage.exact_json import beyond_int64, may_hold_big_int
from bij.worker.input_row import InputOptions, Row
from bij.worker.openai_rows import parse_openai
from bij.worker.plain_rows import parse_plain
from bij.worker.row_requests import error_row, valid_id

# Reserved field of re-dispatched rows (judge rounds): {"id", "attempts", "verdicts", "output"}.
CARRY_FIELD = "_bij"


def carry(obj: dict[str, Any], opts: InputOptions) -> dict[str, Any] | str:
    """A row's pass-through columns (contract.columns), or the name of one that clashes with a result field."""
    if opts.pass_through == ():
        return {}
    out = carried_columns(obj, opts.consumed, opts.pass_through)
    if opts.pass_through is None:
        clash = next((k for k in out if k in opts.result_fields), None)
        if clash is not None:
            return clash
    return out


def parse_line(line: bytes, at: tuple[int, int, int], object_name: str, opts: InputOptions) -> Row:
    """Parse one input line into a Row (never raises for bad input)."""
    try:
        obj = orjson.loads(line)
    except ValueError:
        try:  # the stdlib's message says where the JSON breaks
            obj = json.loads(line)
        except ValueError as e:
            return error_row(at, "invalid_json", f"not valid JSON: {e}")
        # The stdlib also accepts what orjson refuses for good reason: a lone surrogate escape
        # ("\ud800") is no Unicode text, and no result or error row could be written with it.
        problem = _not_unicode(obj)
        if problem:
            rid = obj.get("custom_id" if opts.format == "openai" else opts.id_field) if isinstance(obj, dict) else None
            return error_row(at, "invalid_unicode", f"not valid Unicode: {problem}",
                             rid if valid_id(rid) and not _not_unicode(rid) else None)
    else:
        if may_hold_big_int(line):
            # orjson reads integers beyond 64 bits as floats: ids and carried columns come back exactly as given.
            obj = json.loads(line)
    if not isinstance(obj, dict):
        return error_row(at, "invalid_row", f"a row must be a JSON object, got {type(obj).__name__}")
    own = obj.pop(CARRY_FIELD, _ABSENT)
    if opts.format == "openai":
        row = parse_openai(obj, at, opts)
    else:
        columns = carry(obj, opts)
        if isinstance(columns, str):  # never written over a result field, nor dropped unsaid
            rid = obj.get(opts.id_field)
            return error_row(at, "invalid_row", clash_message(columns, "in this row"), rid if valid_id(rid) else None)
        row = parse_plain(obj, at, object_name, opts)
        row.carried = columns or None
    if own is not _ABSENT:
        # What bij records about a row comes from bij's own lines only (a later judge round's input),
        # never from a column of the user's.
        problem = _history(row, own) if opts.redispatched else _RESERVED
        if problem is not None:
            return _invalid_row(row, problem)
    big = _beyond_int64(row.carried, opts) if row.request is not None else None
    if big is not None:
        return _invalid_row(row, big)
    req = row.request
    if req is not None and opts.task in ("generate", "chat"):
        # A row's cost is bounded before it runs (model.rowBudget), whatever it asks.
        costly = over_budget(req.max_tokens, req.sampling, opts.row_budget, _SPELLED,
                             len(row.parts) if row.parts else 1)
        if costly:
            bad = error_row(at, "invalid_request", costly, row.id)
            bad.carried = row.carried
            return bad
        if (req.sampling.min_tokens or 0) > req.max_tokens:
            bad = error_row(at, "invalid_request", f"minTokens {req.sampling.min_tokens} is over maxTokens "
                            f"{req.max_tokens}", row.id)
            bad.carried = row.carried
            return bad
    return row


_ABSENT = object()
_RESERVED = (f"field {CARRY_FIELD!r} is reserved for bij's own bookkeeping of judge rounds and cannot be an input "
             "column; rename it")


def _invalid_row(row: Row, message: str) -> Row:
    """`row` as an `invalid_row` error row: its id, and its carried columns, kept."""
    bad = error_row(row.at, "invalid_row", message, row.id)
    bad.carried = row.carried
    return bad


def _history(row: Row, own: Any) -> str | None:
    """Take a judge round's bookkeeping (the `_bij` field bij wrote, see redispatch_line) into `row`: its id
    (even a generated one) and its attempts and verdicts so far; what is wrong with it, if anything."""
    if not isinstance(own, dict):
        return f"field {CARRY_FIELD!r} must be an object, got {type(own).__name__}"
    attempts, verdicts = own.get("attempts", 0), own.get("verdicts", [])
    if not isinstance(attempts, int) or isinstance(attempts, bool) or attempts < 0:
        return f"field {CARRY_FIELD!r}.attempts must be a non-negative integer, got {json.dumps(attempts)[:80]}"
    if not isinstance(verdicts, list):
        return f"field {CARRY_FIELD!r}.verdicts must be a list, got {type(verdicts).__name__}"
    if "id" in own:
        if not valid_id(own["id"]):
            got = json.dumps(own["id"])[:80]
            return f"field {CARRY_FIELD!r}.id must be a non-empty string or an integer, got {got}"
        if row.generated_id:
            row.id, row.generated_id = own["id"], False
    row.prior_attempts, row.verdicts = attempts, [str(v) for v in verdicts]
    return None


def _beyond_int64(columns: dict[str, Any] | None, opts: InputOptions) -> str | None:
    """Why a row's carried columns cannot go into a Parquet result (an integer beyond 64 bits), else None."""
    if not opts.int64_columns or not columns:
        return None
    for name, value in columns.items():
        where = beyond_int64(value, name)
        if where is not None:
            return (f"column {name!r} holds an integer beyond 64 bits (at {where}), which a Parquet result "
                    "(output.format: parquet) cannot hold; make it a string, or use output.format jsonl")
    return None


def parse_plain_lines(lines: list[bytes], opts: InputOptions
                      ) -> tuple[list[Any], list[Request], list[dict[str, Any]] | None] | None:
    """The ids, requests and pass-through columns (None: no row carries any) of a chunk's lines in one
    pass, when every line is a plain good row; else None.

    A plain good row is what parse_line makes a request of without a second look: a JSON
    object with a string or integer id and a non-blank string text (no messages to check,
    no judge-round carry field). The checks run over the whole chunk at once, in C; any
    line that is not such a row sends the whole chunk to parse_line, line by line, which
    says what is wrong and where (a column that clashes with a result field too).
    """
    if opts.format != "jsonl" or not lines or opts.prompt is not None or opts.task in ("score", "rerank") or (
            opts.task in ("generate", "chat")
            and over_budget(opts.max_tokens, opts.sampling, opts.row_budget, _SPELLED)):
        return None
    try:
        objs = list(map(orjson.loads, lines))
    except ValueError:
        return None
    if set(map(type, objs)) != {dict}:
        return None
    ids = list(map(dict.get, objs, repeat(opts.id_field)))
    kinds = set(map(type, ids))
    # Not None (a generated id), a float (orjson's reading of an integer beyond 64 bits), a bool.
    if not kinds <= {str, int} or (str in kinds and "" in ids):
        return None
    texts = cast("list[str]", list(map(dict.get, objs, repeat(opts.text_field))))  # checked on the next line
    if set(map(type, texts)) != {str} or not all(texts) or any(map(str.isspace, texts)):
        return None
    if any(map(dict.__contains__, objs, repeat(CARRY_FIELD))) or \
            any(map(dict.__contains__, objs, repeat(opts.sampling_field))) or \
            any(map(dict.__contains__, objs, repeat(opts.adapter_field))):
        return None
    if opts.task == "chat":
        if opts.messages_field and any(map(dict.__contains__, objs, repeat(opts.messages_field))):
            return None
        requests = [Request(None, [{"role": "user", "content": text}], opts.max_tokens, opts.temperature, opts.seed,
                            opts.sampling) for text in texts]
    else:
        requests = list(map(Request, texts, repeat(None), repeat(opts.max_tokens), repeat(opts.temperature),
                            repeat(opts.seed), repeat(opts.sampling)))
    columns: list[dict[str, Any]] | None = None
    # Every row has its id and text (checked above): a row with no more fields has nothing to carry.
    if opts.pass_through != () and max(map(len, objs)) > len({opts.id_field, opts.text_field}):
        # Only a carried column can still hold an integer beyond 64 bits, which orjson reads as a float:
        # those lines again, exactly (exact_json; the scan only where columns are carried, the common rows
        # pay nothing).
        if may_hold_big_int(b"\n".join(lines)):
            if opts.int64_columns:
                return None  # line by line: a carried one a Parquet result cannot hold is an error row naming it
            objs = [json.loads(line) if may_hold_big_int(line) else obj
                    for line, obj in zip(lines, objs, strict=True)]
        keys: set[str] = set().union(*map(dict.keys, objs))
        kept = keys - opts.consumed if opts.pass_through is None else keys & set(opts.pass_through)
        if kept & opts.result_fields and opts.pass_through is None:
            return None  # line by line: each such row is an error row naming the column
        if kept:
            consumed, only = opts.consumed, opts.pass_through
            columns = [carried_columns(obj, consumed, only) for obj in objs]
    return ids, requests, columns


# How a row's budget refusal names its fields (the spec's camelCase names, as a sampling field spells them).
_SPELLED = {"n": "n", "maxTokens": "maxTokens", "topLogprobs": "topLogprobs", "prompts": "prompts"}


def _not_unicode(value: Any) -> str | None:
    """Where a parsed value holds a string that cannot be UTF-8 (a lone surrogate), else None."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        return f"a lone surrogate escape (\\u{ord(e.object[e.start]):04x})"


def redispatch_line(line: bytes, row: Row, attempts: int, verdicts: list[str], output: str | None) -> str:
    """The input line for the next judge round: the original row plus its id and history."""
    obj = json.loads(line)
    obj[CARRY_FIELD] = {"id": row.id, "attempts": attempts, "verdicts": verdicts[-20:], "output": output}
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
