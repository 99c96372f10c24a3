"""Parquet: result files that publish writes, and input objects read by row groups.

Output: one file per shard, zstd-compressed, with `id`, then `embedding` (a list of
float32) for embed, `output` and the usage columns for generate and chat, or the pooling
tasks' own (`label` and `probs`, a list of float32, for classify; `score`; rerank's `results`,
a list of {index, relevance_score}) and `prompt_tokens`, then `truncated`,
and `attempts` / `round` when a judge ran, then the rows' pass-through columns (their
types read from the values in that file; a column of mixed types holds JSON text; an integer
beyond 64 bits is refused, `BeyondInt64`).
The `id` column is int64 when every result id of the job is an integer, string when
every one is a string; when a job mixes them, `id` holds every id as text and `id_int`
(int64, null for string ids) keeps the integers, so `1` and `"1"` stay apart (an integer
id beyond 64 bits is kept as text only). The choice is made once per job (from the shards'
completion records), so every file of a job has the same result columns.

Input: the planner reads only the footer of each object (row-group row counts and sizes,
the column names); the worker reads the row groups of its piece, only the columns it
needs and the pass-through columns, and hands each row on as a JSON line, so every later step (parsing, bad rows,
judge rounds) is the one JSONL rows take. A row's place is its row number in the object.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson

from bij.contract.columns import RESULT_FIELDS, TASK_FIELDS, result_fields
from bij.storage import Storage
from bij.storage.exact_json import beyond_int64

ID_INT = "id_int"
SUFFIX = ".parquet"


def is_int64(value: Any) -> bool:
    """An id the int64 `id` / `id_int` columns can hold (integers beyond 64 bits are kept as text)."""
    return isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63


def id_kind(int_ids: int | None, str_ids: int | None) -> str:
    """'int', 'str' or 'mixed' for a job's result ids (counts unknown: 'mixed', which holds anything)."""
    if int_ids is None or str_ids is None:
        return "mixed"
    if str_ids == 0:
        return "int"
    if int_ids == 0:
        return "str"
    return "mixed"


def _choices_type() -> Any:
    import pyarrow as pa

    top = pa.list_(pa.struct([("token", pa.string()), ("logprob", pa.float64())]))
    token = pa.struct([("token", pa.string()), ("logprob", pa.float64()), ("top_logprobs", top)])
    return pa.list_(pa.struct([("index", pa.int64()), ("output", pa.string()), ("finish_reason", pa.string()),
                               ("completion_tokens", pa.int64()), ("logprobs", pa.list_(token))]))


def _choice(rec: dict[str, Any]) -> dict[str, Any]:
    """A choice as the JSONL result row has it (no logprobs key when it asked for none)."""
    return {k: v for k, v in rec.items() if k != "logprobs" or v is not None}


def results_table(rows: list[dict[str, Any]], task: str, ids: str, judged: bool) -> Any:
    """The Arrow table of published result rows (plain shape: `id`, `embedding` or `output`, `usage`)."""
    import pyarrow as pa

    columns: dict[str, Any] = {}
    raw = [r.get("id") for r in rows]
    if ids == "int":
        columns["id"] = pa.array(raw, type=pa.int64())
    else:
        columns["id"] = pa.array([None if v is None else str(v) for v in raw], type=pa.string())
        if ids == "mixed":
            columns[ID_INT] = pa.array([v if is_int64(v) else None for v in raw], type=pa.int64())
    usage = [r.get("usage") or {} for r in rows]
    if task in TASK_FIELDS:
        columns.update(_pooled_columns(rows, task))
        columns["prompt_tokens"] = pa.array([u.get("prompt_tokens") for u in usage], type=pa.int64())
    elif task == "embed":
        columns["embedding"] = pa.array([r.get("embedding") for r in rows], type=pa.list_(pa.float32()))
        columns["prompt_tokens"] = pa.array([u.get("prompt_tokens") for u in usage], type=pa.int64())
    else:
        columns["output"] = pa.array([r.get("output") for r in rows], type=pa.string())
        for key in ("prompt_tokens", "completion_tokens"):
            columns[key] = pa.array([u.get(key) for u in usage], type=pa.int64())
        if any("choices" in r for r in rows):  # rows that asked for n answers or logprobs
            columns["choices"] = pa.array([r.get("choices") for r in rows], type=_choices_type())
    columns["truncated"] = pa.array([bool(r.get("truncated")) for r in rows], type=pa.bool_())
    if judged:
        columns["attempts"] = pa.array([r.get("attempts") for r in rows], type=pa.int64())
        columns["round"] = pa.array([r.get("round") for r in rows], type=pa.int64())
    for name in carried_names(rows, task):
        columns[name] = _carried_array(name, [r.get(name) for r in rows], raw)
    return pa.table(columns)


def _pooled_columns(rows: list[dict[str, Any]], task: str) -> dict[str, Any]:
    """classify's `label` (string) and `probs` (list of float32), score's `score` (double), rerank's `results`
    (list of {index int64, relevance_score double}, best first)."""
    import pyarrow as pa

    if task == "classify":
        return {"label": pa.array([r.get("label") for r in rows], type=pa.string()),
                "probs": pa.array([r.get("probs") for r in rows], type=pa.list_(pa.float32()))}
    if task == "score":
        return {"score": pa.array([r.get("score") for r in rows], type=pa.float64())}
    ranked = pa.list_(pa.struct([("index", pa.int64()), ("relevance_score", pa.float64())]))
    return {"results": pa.array([r.get("results") for r in rows], type=ranked)}


def carried_names(rows: list[dict[str, Any]], task: str = "") -> list[str]:
    """The pass-through columns of result rows of `task` (contract.columns), in the order they first appear."""
    own = result_fields(task)
    names: dict[str, None] = {}
    for r in rows:
        for k in r:
            if k not in own:
                names[k] = None
    return list(names)


class BeyondInt64(ValueError):
    """A pass-through column holds an integer beyond 64 bits, which no Parquet column holds exactly.

    The worker makes such a row an error row before it runs (output.format: parquet); this is
    what a Parquet stream of JSON lines results (`bij results --format parquet`) says of one.
    """


def _carried_array(name: str, values: list[Any], ids: list[Any]) -> Any:
    """A pass-through column: Arrow's type for its values (JSON types: a string, int64, double, bool,
    list or struct column), or each value's JSON text where they share no type (a column that is
    sometimes a number, sometimes a string). An integer beyond 64 bits is refused (BeyondInt64), never
    made a float or text."""
    import pyarrow as pa

    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
        for rid, value in zip(ids, values, strict=True):
            where = beyond_int64(value, name)
            if where is not None:
                raise BeyondInt64(f"column {name!r} of the result row with id {json.dumps(rid)[:80]} holds an "
                                  f"integer beyond 64 bits (at {where}), which Parquet cannot hold") from None
        return pa.array([None if v is None else json.dumps(v, sort_keys=True, ensure_ascii=False)
                         for v in values], type=pa.string())


def encode_results(rows: list[dict[str, Any]], task: str, ids: str, judged: bool, compression: str) -> bytes:
    """A whole Parquet file of result rows, zstd-compressed unless `compression` is 'none'."""
    return table_bytes(results_table(rows, task, ids, judged), compression)


def table_bytes(table: Any, compression: str) -> bytes:
    """A whole Parquet file of an Arrow table, zstd-compressed unless `compression` is 'none'."""
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd" if compression == "zstd" else "none")
    return buf.getvalue()


def table_rows(table: Any) -> Iterator[dict[str, Any]]:
    """Rows of a results table in the JSONL result shape (the inverse of `results_table`)."""
    yield from result_rows(table.column_names, table.to_pylist())


def result_rows(columns: list[str], records: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Rows in the JSONL result shape from records of the result columns `results_table` lays out, by
    column name (Parquet's, and CSV's, bij.storage.writers.csv)."""
    names = set(columns)
    # A pooling task's own columns (its probs are float32 in Parquet: a row has them as the file holds them).
    pooled = [c for c in columns if any(c in f for f in TASK_FIELDS.values())]
    pooled = pooled if "output" not in names and "embedding" not in names else []
    carried = [c for c in columns if c not in RESULT_FIELDS and c not in pooled]
    for rec in records:
        rid = rec.get("id")
        if ID_INT in names and rec.get(ID_INT) is not None:
            rid = rec[ID_INT]
        out: dict[str, Any] = {"id": rid}
        if pooled:
            out.update((c, rec[c]) for c in pooled)
        elif "embedding" in names:
            out["embedding"] = rec["embedding"]
        else:
            out["output"] = rec["output"]
        usage = {k: rec[k] for k in ("prompt_tokens", "completion_tokens") if rec.get(k) is not None}
        if usage:
            usage["total_tokens"] = usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0)
            out["usage"] = usage
        if rec.get("choices") is not None:
            out["choices"] = [_choice(c) for c in rec["choices"]]
        if rec.get("truncated"):
            out["truncated"] = True
        for key in ("attempts", "round"):
            if key in names:
                out[key] = rec[key]
        for key in carried:
            out[key] = rec[key]
        yield out


def read_table(data: bytes) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    return pq.read_table(pa.BufferReader(data))


# --- input -------------------------------------------------------------------------------------


class RangeFile(io.RawIOBase):
    """A seekable, read-only view of one object: each read is one ranged read through `Storage`.

    Enough for pyarrow to read a footer (a read or two at the end) and then only the column
    chunks of the row groups asked for. With `version` (from the plan), every read is of that
    version of the object (`ObjectChanged` otherwise).
    """

    def __init__(self, storage: Storage, uri: str, size: int, version: str | None = None):
        self.storage, self.uri, self.size, self.version = storage, uri, size, version
        self.pos = 0
        self.bytes_read = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, b: Any) -> int:
        want = min(len(b), self.size - self.pos)
        if want <= 0:
            return 0
        got = 0
        view = memoryview(b)
        with self.storage.open_read(self.uri, self.pos, self.version) as stream:
            while got < want:
                chunk = stream.read(want - got)
                if not chunk:
                    break
                view[got:got + len(chunk)] = chunk
                got += len(chunk)
        self.pos += got
        self.bytes_read += got
        return got


@dataclass(frozen=True)
class Footer:
    """What planning needs from a Parquet object: its columns and row groups (rows, compressed bytes)."""

    columns: list[str]
    group_rows: list[int]
    group_bytes: list[int]


def read_footer(storage: Storage, uri: str, size: int) -> Footer:
    """The footer of a Parquet object; reads only its last bytes, never a row."""
    import pyarrow.parquet as pq

    md = pq.read_metadata(RangeFile(storage, uri, size))
    rows, sizes = [], []
    for g in range(md.num_row_groups):
        group = md.row_group(g)
        rows.append(group.num_rows)
        sizes.append(sum(group.column(c).total_compressed_size for c in range(group.num_columns)))
    return Footer(list(md.schema.to_arrow_schema().names), rows, sizes)


def _json_value(value: Any) -> Any:
    """What an input row's JSON line holds for a Parquet value JSON has no type for: binary as base64
    text, anything else (a decimal, a time of day) as its text."""
    if isinstance(value, (bytes, bytearray)):
        return base64.b64encode(value).decode("ascii")
    return str(value)


def iter_parquet_piece(storage: Storage, uri: str, size: int, group_rows: list[int], start: int, end: int,
                       columns: list[str] | None, resume_at: int = -1, batch_rows: int = 1024,
                       version: str | None = None) -> Iterator[tuple[int, bytes]]:
    """(row number, JSON line) for the rows of row groups [start, end) from `resume_at` on, with
    `columns` (None: every column).

    Row groups wholly before the resume row are not read at all.
    """
    import pyarrow.parquet as pq

    first = sum(group_rows[:start])
    groups: list[int] = []
    for g in range(start, end):
        if first + group_rows[g] > resume_at:
            groups.append(g)
            break
        first += group_rows[g]
    if not groups:
        return
    groups += list(range(groups[0] + 1, end))
    pf = pq.ParquetFile(RangeFile(storage, uri, size, version))
    present = None if columns is None else [c for c in columns if c in pf.schema_arrow.names]
    row = first
    for batch in pf.iter_batches(batch_size=batch_rows, row_groups=groups, columns=present):
        for rec in batch.to_pylist():
            if row >= resume_at:
                yield row, orjson.dumps(rec, default=_json_value)
            row += 1
