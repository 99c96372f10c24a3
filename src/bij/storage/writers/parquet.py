"""`output.format: parquet`: one Parquet file per file part or input object (`.parquet`, zstd-compressed
unless output.compression is none), columns as bij.storage.parquet lays them out. Its error and capped
files are JSON lines: their rows have no common columns."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import IO, Any

import orjson

from bij.contract.columns import RESULT_FIELDS
from bij.storage.parquet import SUFFIX, encode_results, read_table, results_table, table_bytes, table_rows
from bij.storage.segments import encode_records, loads_record
from bij.storage.writers.base import HeldRows, ResultShape


def _encode_part(rows: list[dict[str, Any]], s: ResultShape) -> bytes:
    return encode_results(rows, s.task, s.id_kind, s.judged, s.compression)


class _Stream:
    """Rows spooled as JSON lines; at the end one Arrow table made of `batch_rows` rows at a time, written
    as one Parquet file into a new spool."""

    def __init__(self, shape: ResultShape, spool: Callable[[], IO[bytes]], batch_rows: int):
        self.shape, self.new_spool, self.limit = shape, spool, batch_rows
        self.spool = spool()
        self.n = 0

    def add(self, row: dict[str, Any]) -> None:
        self.n += 1
        self.spool.write(encode_records([row]))

    def _batches(self, as_text: frozenset[str] = frozenset()) -> Iterator[Any]:
        """The spooled rows as result tables of `limit` rows; the carried columns `as_text` as JSON text."""
        self.spool.seek(0)
        rows: list[dict[str, Any]] = []
        for line in self.spool:
            rows.append(loads_record(line))
            if len(rows) >= self.limit:
                yield self._table(rows, as_text)
                rows = []
        if rows or not self.n:
            yield self._table(rows, as_text)

    def _table(self, rows: list[dict[str, Any]], as_text: frozenset[str]) -> Any:
        import pyarrow as pa

        s = self.shape
        table = results_table(rows, s.task, s.id_kind, s.judged)
        for name in as_text & set(table.column_names):
            text = [None if r.get(name) is None else json.dumps(r[name], sort_keys=True, ensure_ascii=False)
                    for r in rows]
            table = table.set_column(table.column_names.index(name), name, pa.array(text, type=pa.string()))
        return table

    def _parquet(self) -> bytes:
        """The spooled rows as one Parquet file: a carried column whose type differs between batches
        holds JSON text in every batch (as within one batch), made from the rows again."""
        import pyarrow as pa

        tables = list(self._batches())
        try:
            table = pa.concat_tables(tables, promote_options="default")  # columns missing or all null: null
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            kinds: dict[str, set[Any]] = {}
            for t in tables:
                for f in t.schema:
                    if f.name not in RESULT_FIELDS and f.type != pa.null():
                        kinds.setdefault(f.name, set()).add(f.type)
            mixed = frozenset(name for name, types in kinds.items() if len(types) > 1)
            del tables
            table = pa.concat_tables(list(self._batches(mixed)), promote_options="default")
        return table_bytes(table, self.shape.compression)

    def finish(self) -> IO[bytes]:
        data = self._parquet()
        self.spool.close()
        self.spool = self.new_spool()
        self.spool.write(data)
        self.spool.seek(0)
        return self.spool

    def discard(self) -> None:
        self.spool.close()


class ParquetWriter:
    name = "parquet"
    suffixes: tuple[str, ...] = (SUFFIX,)
    error_format = "jsonl"
    typed_ids = True

    def suffix(self, compression: str) -> str:
        return SUFFIX

    def part(self, shape: ResultShape) -> HeldRows:
        return HeldRows(shape, _encode_part)

    def stream(self, shape: ResultShape, spool: Callable[[], IO[bytes]], batch_rows: int) -> _Stream:
        return _Stream(shape, spool, batch_rows)

    def rows(self, data: bytes, path: str) -> Iterator[dict[str, Any]]:
        yield from table_rows(read_table(data))

    def lines(self, data: bytes, path: str) -> Iterator[bytes]:
        for row in self.rows(data, path):
            yield orjson.dumps(row)


PARQUET = ParquetWriter()
