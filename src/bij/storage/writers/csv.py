"""`output.format: csv`: RFC 4180 CSV for spreadsheets, warehouse loads (BigQuery, Snowflake, Redshift COPY) and
pandas, zstd-compressed (`.csv.zst`) unless output.compression is none (`.csv`; BigQuery loads only
uncompressed or gzip CSV). Its error and capped files are JSON lines: their rows have no common columns.

A file is UTF-8 without a byte order mark: a header row, then one row each, fields separated by commas,
lines ended by CRLF (RFC 4180's own; Python's csv module quotes a field holding a lone CR only then),
a field quoted only where it holds a comma, a quote (doubled inside) or a line break.
The columns are those `output.format: parquet` chooses (bij.storage.parquet): `id`, then `embedding`,
`output` and the usage columns, or the pooling task's own, then `prompt_tokens`, `truncated`,
`attempts` / `round` when a judge ran, then the rows' pass-through columns in the order they first appear
in the file. Every file of a job has the same columns but for `choices` (a file where a row has them) and
the pass-through ones.

A cell is read back as it was written, by this rule:

- `output`, `label` and a text `id`: the string as it is (an empty cell: an empty string).
- `id`: integers when every id of the job is one (`typed_ids`, as Parquet's int64 column). Otherwise the file
  has `id_int` too, even when no id is an integer: `id` holds every id as text and `id_int` the int64 ones
  (an integer beyond 64 bits is kept as text only, as in Parquet). CSV has no column types: that `id_int`
  is there is what says `id` is text.
- every other column of bij's own (numbers, `truncated` as true or false, `embedding`, `probs`,
  `results`, `choices`): its compact JSON text; null is an empty cell.
- a pass-through column: null is an empty cell; a string as it is, unless it is empty or would read as
  JSON (`42`, `true`, `null`, `[1]`, `"x"`): then its JSON text (`"42"`); any other value (a number,
  true or false, a list, an object) its compact JSON text, integers beyond 64 bits too. A reader takes a
  cell that reads as JSON as that value, any other as the string. A column a row lacks is null, as in
  Parquet.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Any

import orjson
import zstandard

from bij.contract.columns import result_fields
from bij.storage import exact_json
from bij.storage.exact_json import may_hold_big_int
from bij.storage.parquet import ID_INT, is_int64, result_rows
from bij.storage.segments import encode_records
from bij.storage.writers.base import HeldRows, ResultShape

LEVEL = 3  # zstd level of published files
LINE_END = "\r\n"
TEXT_COLUMNS = frozenset({"output", "label"})
POOLED_COLUMNS = {"classify": ("label", "probs"), "score": ("score",), "rerank": ("results",)}
FIELD_LIMIT = 2**31 - 1  # a cell may be as long as an answer or an embedding's JSON (the csv module's default: 128 KiB)


def _dumps(value: Any) -> str:
    """Compact JSON text (non-ASCII as itself), integers beyond 64 bits exactly."""
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _as_json(cell: str) -> tuple[bool, Any]:
    """(True, its value) for a cell that reads as JSON, else (False, None)."""
    try:
        value = orjson.loads(cell)
    except orjson.JSONDecodeError:
        return False, None
    data = cell.encode()
    return True, json.loads(cell) if may_hold_big_int(data) else value


def _carried_cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str) and value and not _as_json(value)[0]:
        return value
    return _dumps(value)


def _carried_value(cell: str) -> Any:
    if not cell:
        return None
    is_json, value = _as_json(cell)
    return value if is_json else cell


def _own_cell(value: Any) -> str:
    return "" if value is None else _dumps(value)


def _own_value(cell: str) -> Any:
    return None if not cell else exact_json.loads(cell.encode())  # not JSON: ValueError, the file is not bij's


class _Columns:
    """The columns of one file, chosen as `bij.storage.parquet.results_table` chooses them, and each row's cells."""

    def __init__(self, shape: ResultShape, has_choices: bool, carried: Iterable[str]):
        self.text_ids = shape.id_kind != "int"
        names = ["id"] + ([ID_INT] if self.text_ids else [])
        if shape.task in POOLED_COLUMNS:
            names += [*POOLED_COLUMNS[shape.task], "prompt_tokens"]
        elif shape.task == "embed":
            names += ["embedding", "prompt_tokens"]
        else:
            names += ["output", "prompt_tokens", "completion_tokens"] + (["choices"] if has_choices else [])
        names.append("truncated")
        if shape.judged:
            names += ["attempts", "round"]
        self.own = len(names)
        self.names = names + list(carried)

    def cells(self, row: dict[str, Any]) -> list[str]:
        usage = row.get("usage") or {}
        out: list[str] = []
        for name in self.names[:self.own]:
            if name == "id":
                rid = row.get("id")
                out.append(("" if rid is None else str(rid)) if self.text_ids else _own_cell(rid))
            elif name == ID_INT:
                out.append(_own_cell(row["id"] if is_int64(row.get("id")) else None))
            elif name in TEXT_COLUMNS:
                out.append(row.get(name) or "")
            elif name in ("prompt_tokens", "completion_tokens"):
                out.append(_own_cell(usage.get(name)))
            elif name == "truncated":
                out.append(_dumps(bool(row.get("truncated"))))
            else:
                out.append(_own_cell(row.get(name)))
        out += [_carried_cell(row.get(name)) for name in self.names[self.own:]]
        return out


def _scan(rows: Iterable[dict[str, Any]], task: str) -> tuple[bool, list[str]]:
    """Whether a row has `choices`, and the pass-through columns in the order they first appear."""
    own = result_fields(task)
    has_choices = False
    carried: dict[str, None] = {}
    for r in rows:
        has_choices = has_choices or "choices" in r
        for k in r:
            if k not in own:
                carried[k] = None
    return has_choices, list(carried)


class _Encoder:
    """CSV text of rows, taken as bytes (compressed with zstd or not) a batch at a time."""

    def __init__(self, columns: _Columns, compression: str):
        self.columns, self.buf = columns, io.StringIO()
        self.out = csv.writer(self.buf, lineterminator=LINE_END)
        self.cctx = zstandard.ZstdCompressor(level=LEVEL).compressobj() if compression == "zstd" else None
        self.out.writerow(columns.names)

    def add(self, row: dict[str, Any]) -> None:
        self.out.writerow(self.columns.cells(row))

    def take(self, last: bool = False) -> bytes:
        data = self.buf.getvalue().encode()
        self.buf.seek(0)
        self.buf.truncate()
        if self.cctx is None:
            return data
        return self.cctx.compress(data) + (self.cctx.flush() if last else b"")


def _encode_part(rows: list[dict[str, Any]], shape: ResultShape) -> bytes:
    encoder = _Encoder(_Columns(shape, *_scan(rows, shape.task)), shape.compression)
    for row in rows:
        encoder.add(row)
    return encoder.take(last=True)


class _Stream:
    """Rows spooled as JSON lines: at the end one pass for the columns (the header comes first), a second
    writing the CSV into a new spool, `batch_rows` rows at a time."""

    def __init__(self, shape: ResultShape, spool: Callable[[], IO[bytes]], batch_rows: int):
        self.shape, self.new_spool, self.limit = shape, spool, batch_rows
        self.spool = spool()

    def add(self, row: dict[str, Any]) -> None:
        self.spool.write(encode_records([row]))

    def _rows(self) -> Iterator[dict[str, Any]]:
        self.spool.seek(0)
        for line in self.spool:
            yield exact_json.loads(line)  # a pass-through integer beyond 64 bits too

    def finish(self) -> IO[bytes]:
        encoder = _Encoder(_Columns(self.shape, *_scan(self._rows(), self.shape.task)), self.shape.compression)
        out = self.new_spool()
        for n, row in enumerate(self._rows(), 1):
            encoder.add(row)
            if n % self.limit == 0:
                out.write(encoder.take())
        out.write(encoder.take(last=True))
        self.spool.close()
        self.spool = out
        out.seek(0)
        return out

    def discard(self) -> None:
        self.spool.close()


def _records(data: bytes) -> tuple[list[str], Iterator[dict[str, Any]]]:
    """The header of a CSV file and its rows as {column: value}, each cell read back by the module's rule."""
    csv.field_size_limit(max(csv.field_size_limit(), FIELD_LIMIT))
    reader = csv.reader(io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", newline=""))
    names = next(reader, [])
    # bij's own columns end at `truncated` (and a judge's `attempts`, `round`): pass-through columns follow.
    own = names.index("truncated") + 1 if "truncated" in names else len(names)
    while own < len(names) and names[own] in ("attempts", "round"):
        own += 1
    text_ids = ID_INT in names[:own]
    decode: list[Callable[[str], Any]] = [
        str if name in TEXT_COLUMNS or (name == "id" and text_ids) else _own_value for name in names[:own]]
    decode += [_carried_value] * (len(names) - own)
    return names, ({n: f(c) for n, f, c in zip(names, decode, cells, strict=True)} for cells in reader)


class CsvWriter:
    name = "csv"
    suffixes: tuple[str, ...] = (".csv.zst", ".csv")
    error_format = "jsonl"
    typed_ids = True

    def suffix(self, compression: str) -> str:
        return ".csv.zst" if compression == "zstd" else ".csv"

    def part(self, shape: ResultShape) -> HeldRows:
        return HeldRows(shape, _encode_part)

    def stream(self, shape: ResultShape, spool: Callable[[], IO[bytes]], batch_rows: int) -> _Stream:
        return _Stream(shape, spool, batch_rows)

    def rows(self, data: bytes, path: str) -> Iterator[dict[str, Any]]:
        if path.endswith(".zst"):
            data = zstandard.ZstdDecompressor().decompress(data, max_output_size=1 << 34)
        names, records = _records(data)
        yield from result_rows(names, records)

    def lines(self, data: bytes, path: str) -> Iterator[bytes]:
        for row in self.rows(data, path):
            yield encode_records([row])[:-1]


CSV = CsvWriter()
