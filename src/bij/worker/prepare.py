"""Row preparation, in one place: input lines become requests (or error rows) before any engine runs them.

A line is parsed into its request (inputs.py: content, sampling, adapter, images), its images
are fetched, its prompt tokens counted with the engine's tokenizer and checked against the
token limit (cut to it with `model.truncate`, else a `too_many_tokens` row). Both schedulers
take their rows from here, and the rows' answers go back through here to become log records.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, cast

from bij.engines.base import Engine, Request, Result
from bij.engines.structured import SCHEMA_VIOLATION, Checked, Validator
from bij.storage import Storage
from bij.storage.parquet import is_int64
from bij.storage.segments import ShardLog, encode_plain_results
from bij.worker.committer import Tally, length_cut
from bij.worker.images import ImageProblem, fetch_images
from bij.worker.input_row import InputOptions, Row
from bij.worker.inputs import parse_line, parse_plain_lines
from bij.worker.reader import Chunk, InputProblem, Line
from bij.worker.result_rows import error_row, merged_result, result_row

_ERROR = attrgetter("error")


@dataclass(slots=True)
class OpenChunk:
    """A chunk in the in-flight window: its rows' results fill in as the engine returns them.

    The rows for the engine are columns (places, ids, requests, tokens), filled a chunk at a
    time; `rows` keeps the parsed rows only where a chunk was parsed line by line.
    """

    chunk: Chunk
    records: list[dict[str, Any]]  # rows that never reach the engine (bad input, too long)
    places: list[tuple[int, int, int]]  # the rows for the engine: their places in the input
    ids: list[Any]
    requests: list[Request]
    results: list[Result | None]
    left: int  # rows still out
    rows: list[Row] | None = None  # the parsed rows, when the chunk was parsed line by line
    tokens: list[int] = field(default_factory=list)  # prompt tokens, once counted
    truncated: set[int] = field(default_factory=set)  # rows whose prompt the engine cuts to the limit
    final: bytes | None = None  # the chunk's log lines, once every row is back
    tally: Tally | None = None  # what the final records add to the shard's counts
    carried: list[dict[str, Any]] | None = None  # a chunk parsed in one pass: its rows' pass-through columns

    def place(self, i: int, res: Result) -> None:
        """Row i's answer is back."""
        self.results[i] = res
        self.left -= 1

    def answers(self) -> list[Result]:
        """`results` once every row is back (`left` is 0): none of them None."""
        return cast("list[Result]", self.results)


class Preparer:
    """Makes a shard's input lines into requests for `engine`, and their answers into log records.

    `names`: each input object's display name (error rows and generated ids say where a row is);
    `storage_for`: the storage of a URI (images); `corrupt`: called with (object, offset,
    message) where a damaged object becomes an error row.
    """

    def __init__(self, opts: InputOptions, engine: Engine, names: list[str], *, max_input_tokens: int | None,
                 storage_for: Callable[[str], Storage], corrupt: Callable[[int, int, str], None]):
        self.opts, self.engine, self.names = opts, engine, names
        self.max_input_tokens = max_input_tokens
        self.storage_for, self.corrupt = storage_for, corrupt
        self.validator = Validator()

    def token_limit(self) -> int | None:
        """The longest prompt a row may have: the spec's maxInputTokens or the model's own, the smaller."""
        limits = [x for x in (self.max_input_tokens, self.engine.max_input_tokens()) if x]
        return min(limits) if limits else None

    def row(self, line: bytes, at: tuple[int, int, int]) -> Row:
        """One line as a row to run (its images fetched) or an error row: what every path does with a line."""
        row = parse_line(line, at, self.names[at[0]], self.opts)
        req = row.request
        if req is not None and req.images:
            try:
                req.images = fetch_images(req.images, self.storage_for, self.opts.max_image_bytes,
                                          self.opts.image_root)
            except ImageProblem as e:
                row.request, row.error_code, row.error = None, e.code, str(e)
        return row

    def error_record(self, row: Row) -> dict[str, Any]:
        return {"at": list(row.at), "kind": "error", "row": error_row(row, self.names[row.at[0]], self.opts)}

    def parse(self, chunk: Chunk) -> OpenChunk:
        """Parse a chunk's lines (in the reader thread or the shard's); bad rows are settled here.

        A chunk of plain good rows (the common case) is parsed in one pass over its lines
        (parse_plain_lines); any other chunk line by line, where every bad row becomes its
        error row.
        """
        if set(map(type, chunk.data)) == {bytes}:
            parsed = parse_plain_lines(cast("list[bytes]", chunk.data), self.opts)  # all bytes: checked above
            if parsed is not None:
                ids, requests, carried = parsed
                return OpenChunk(chunk, [], chunk.places, ids, requests, [None] * len(ids), len(ids),
                                 carried=carried)
        records: list[dict[str, Any]] = []
        rows: list[Row] = []
        for at, line in chunk.lines:
            if isinstance(line, InputProblem):  # an over-long line, a cut .zst: an error row in its place
                records.append(self.error_record(Row(at=at, id=None, error_code=line.code, error=line.message)))
                if line.code == "corrupt_input":
                    self.corrupt(at[0], at[1], line.message)
                continue
            row = self.row(line, at)
            if row.request is None:
                records.append(self.error_record(row))
            elif row.parts is not None:
                # One entry per prompt, the row repeated: the chunk commits once all of them are back,
                # and encode answers them in one row.
                rows.extend([row] * len(row.parts))
            else:
                rows.append(row)
        # Every row kept here has a request (the others became error records above).
        work = cast("list[Request]", [r.request if r.parts is None else r.parts[k] for r, k in _part_numbers(rows)])
        return OpenChunk(chunk, records, [r.at for r in rows], [r.id for r in rows],
                         work, [None] * len(rows), len(rows), rows)

    def rows(self, lines: list[Line]) -> tuple[list[tuple[Row, bytes]], list[dict[str, Any]]]:
        """Lines as rows to run (each with its line), and the error records of those that cannot run
        (the judge's chunks)."""
        records: list[dict[str, Any]] = []
        rows: list[tuple[Row, bytes]] = []
        for at, line in lines:
            if isinstance(line, InputProblem):
                records.append(self.error_record(Row(at=at, id=None, error_code=line.code, error=line.message)))
                continue
            row = self.row(line, at)
            if row.request is not None and row.parts is not None:
                # A judge judges one answer per row.
                row.request, row.error_code = None, "unsupported"
                row.error = f"a judge job answers one prompt per row; this row holds {len(row.parts)}"
            if row.request is None:
                records.append(self.error_record(row))
            else:
                rows.append((row, line))
        return rows, records

    def over_limit(self, tokens: list[int]) -> tuple[list[int], dict[int, Result]]:
        """The rows over the token limit: those the engine cuts to it (`model.truncate`; their counts
        become the limit, in `tokens`), and the others' `too_many_tokens` results."""
        limit = self.token_limit()
        cut: list[int] = []
        refused: dict[int, Result] = {}
        if not limit or not tokens or max(tokens) <= limit:
            return cut, refused
        for i, t in enumerate(tokens):
            if t <= limit:
                continue
            if self.opts.truncate:  # the engine cuts the prompt to the limit (it was told to)
                tokens[i] = limit
                cut.append(i)
            else:
                refused[i] = Result(error=f"prompt has {t} tokens, the model takes at most {limit}",
                                    extra={"code": "too_many_tokens"})
        return cut, refused

    def count(self, op: OpenChunk) -> OpenChunk:
        """Count the prompts' tokens (the engine's tokenizer, in this thread); too long rows are settled."""
        if not op.requests:
            return op
        op.tokens = self.engine.count_tokens(op.requests)
        cut, refused = self.over_limit(op.tokens)
        for i in cut:
            op.truncated.add(i)
            if op.rows is not None:
                op.rows[i].truncated = True
        for i, res in refused.items():
            op.place(i, res)
        return op

    def encode(self, op: OpenChunk) -> tuple[bytes, Tally]:
        """The chunk's log lines once every row is back, and what they add to the counts.

        A chunk parsed in one pass whose results all have the common shape is encoded in one
        pass too (encode_plain_results) and counted in bulk; any other builds its records.
        """
        results = op.answers()
        # A chunk parsed in one pass has the spec's sampling on every row: nothing to check without a grammar.
        checked = self.validator.check(op.requests, results) \
            if op.rows is not None or self.opts.sampling.structured_output is not None else Checked()
        if op.rows is None and not op.truncated and set(map(_ERROR, results)) == {None}:
            data = encode_plain_results(op.places, op.ids, results, op.carried)
            if data is not None:
                tally = Tally(results=len(results), validated=checked.validated, repaired=checked.repaired,
                              length_cuts=sum(map(length_cut, results)))
                if set(map(type, op.ids)) == {str}:
                    tally.str_ids = len(results)
                else:
                    tally.int_ids = sum(map(is_int64, op.ids))
                    tally.str_ids = len(results) - tally.int_ids
                return data, tally
        rows = op.rows if op.rows is not None else [
            Row(at=at, id=rid, request=req, truncated=i in op.truncated,
                carried=op.carried[i] or None if op.carried is not None else None)
            for i, (at, rid, req) in enumerate(zip(op.places, op.ids, op.requests, strict=True))]
        records = op.records
        if op.rows is not None and len({id(r) for r in rows}) < len(rows):
            rows, results = _merge_parts(rows, results)
        for row, res in zip(rows, results, strict=True):
            if res.error is not None:
                self.fail(row, res)
                records.append(self.error_record(row))
            else:
                records.append({"at": list(row.at), "kind": "result", "row": result_row(row, res, self.opts)})
        tally = Tally.of(records, self.names)
        tally.validated, tally.repaired = checked.validated, checked.repaired
        tally.length_cuts = sum(map(length_cut, results))
        return ShardLog.encode(records), tally

    @staticmethod
    def fail(row: Row, res: Result) -> None:
        """Row takes the error of its result (a schema_violation keeps the answer that broke it)."""
        row.error_code, row.error = res.extra.get("code", "engine_error"), res.error
        if row.error_code == SCHEMA_VIOLATION:
            row.output = res.output


def _part_numbers(rows: list[Row]) -> list[tuple[Row, int]]:
    """Each entry's row and its prompt's place in the row (0 for a row of one prompt)."""
    out: list[tuple[Row, int]] = []
    for r in rows:
        out.append((r, out[-1][1] + 1 if out and out[-1][0] is r else 0))
    return out


def _merge_parts(rows: list[Row], results: list[Result]) -> tuple[list[Row], list[Result]]:
    """The entries of rows with several prompts folded back into one (row, merged result) each."""
    merged_rows: list[Row] = []
    merged: list[Result] = []
    i = 0
    while i < len(rows):
        row = rows[i]
        if row.parts is None:
            merged_rows.append(row)
            merged.append(results[i])
            i += 1
            continue
        k = len(row.parts)
        merged_rows.append(row)
        merged.append(merged_result(row, results[i:i + k]))
        i += k
    return merged_rows, merged
