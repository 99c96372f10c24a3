"""Result writers (bij.storage.writers): one per output format the spec accepts, each reading back what it
wrote, and the one registered for a format is the one a publish and `bij results` use."""

from __future__ import annotations

import hashlib
import io
import json
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, get_args

import pytest
import yaml

from bij.cli import validate
from bij.contract.publish_plan import PublishPlan
from bij.contract.spec import API_VERSION
from bij.contract.spec_io import OutputSpec
from bij.local.publish import publish_manifest
from bij.steps.results import iter_rows, write_jsonl
from bij.storage.writers import WRITERS, ResultShape, writer_of_path

ROOT = Path(__file__).resolve().parents[2]
CRD_FILES = [ROOT / "crds" / "batchinferencejobs.yaml",
             ROOT / "charts" / "bij-operator" / "crds" / "batchinferencejobs.yaml"]


def test_every_output_format_the_spec_accepts_has_a_writer() -> None:
    formats = set(get_args(OutputSpec.model_fields["format"].annotation))
    assert formats == set(WRITERS)
    assert set(get_args(PublishPlan.model_fields["format"].annotation)) == formats
    crd = validate.crd_schema()["properties"]["spec"]["properties"]["output"]["properties"]["format"]
    assert set(crd["enum"]) == formats
    for path in CRD_FILES:  # the files kubectl and Helm install: `make sync-crd` after a new format
        (version,) = [v for v in yaml.safe_load(path.read_text())["spec"]["versions"] if v["name"] == API_VERSION]
        spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
        assert set(spec["properties"]["output"]["properties"]["format"]["enum"]) == formats, f"{path}: make sync-crd"
    for name, writer in WRITERS.items():
        assert writer.name == name and writer.error_format in WRITERS
        for compression in ("zstd", "none"):
            assert writer.suffix(compression) in writer.suffixes
        for suffix in writer.suffixes:  # a published file's suffix names its writer, and only it
            assert writer_of_path(f"results/r0-00000{suffix}") is writer


ROWS = [{"id": i if i % 3 else f"s{i}", "output": f"answer {i}",
         "usage": {"prompt_tokens": i, "completion_tokens": 2, "total_tokens": i + 2}} for i in range(25)]


@pytest.mark.parametrize("name", sorted(WRITERS))
@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_each_writer_reads_back_what_it_wrote(name: str, compression: str) -> None:
    writer = WRITERS[name]
    shape = ResultShape("generate", "mixed", False, compression)
    path = f"results/x{writer.suffix(compression)}"
    part = writer.part(shape)
    for row in ROWS:
        part.add(row)
    assert len(part) == len(ROWS)
    whole = part.finish()
    # Spooled, in batches of 4 rows, past a spool's 64 bytes in memory: the same rows.
    stream = writer.stream(shape, lambda: tempfile.SpooledTemporaryFile(max_size=64), 4)
    for row in ROWS:
        stream.add(row)
    with stream.finish() as spool:
        streamed = spool.read()
    for data in (whole, streamed):
        assert list(writer.rows(data, path)) == ROWS
        assert [json.loads(line) for line in writer.lines(data, path)] == ROWS
    empty = writer.stream(shape, lambda: tempfile.SpooledTemporaryFile(max_size=64), 4)
    with empty.finish() as spool:  # an input object without results still gets its (empty) file
        assert list(writer.rows(spool.read(), path)) == []


class TabSeparated:
    """A stand-in output format: `id` and `output` as JSON, tab separated, one row a line."""

    name = "parquet"  # registered below in place of Parquet: the spec accepts no other name
    suffixes: tuple[str, ...] = (".tsv",)
    error_format = "jsonl"
    typed_ids = False

    def suffix(self, compression: str) -> str:
        return ".tsv"

    @staticmethod
    def line(row: dict[str, Any]) -> bytes:
        return f"{json.dumps(row['id'])}\t{json.dumps(row['output'])}\n".encode()

    def part(self, shape: ResultShape) -> Any:
        return _Lines(self.line)

    def stream(self, shape: ResultShape, spool: Callable[[], IO[bytes]], batch_rows: int) -> Any:
        return _StreamLines(self.line)

    def rows(self, data: bytes, path: str) -> Iterator[dict[str, Any]]:
        for line in data.decode().splitlines():
            rid, output = line.split("\t")
            yield {"id": json.loads(rid), "output": json.loads(output)}

    def lines(self, data: bytes, path: str) -> Iterator[bytes]:
        for row in self.rows(data, path):
            yield json.dumps(row).encode()


class _Lines:
    """A file part: the lines in memory."""

    def __init__(self, line: Callable[[dict[str, Any]], bytes]):
        self.line, self.data = line, bytearray()
        self.n = 0

    def add(self, row: dict[str, Any]) -> None:
        self.data += self.line(row)
        self.n += 1

    def __len__(self) -> int:
        return self.n

    def finish(self) -> Any:
        return bytes(self.data)


class _StreamLines(_Lines):
    """A file of any size (for the test, in memory too)."""

    def finish(self) -> Any:
        return io.BytesIO(bytes(self.data))

    def discard(self) -> None:
        self.data.clear()


@pytest.mark.parametrize("partition_by", ["shard", "input"])
def test_a_publish_writes_with_the_writer_registered_for_its_format(file_place, make_job, run_shards, monkeypatch,
                                                                     partition_by: str) -> None:
    fake = TabSeparated()
    monkeypatch.setitem(WRITERS, "parquet", fake)
    inputs = [{"id": i if i % 2 else f"s{i}", "text": f"t{i}"} for i in range(12)] + [{"id": "e", "text": ""}]
    file_place.write_jsonl("in/a.jsonl", inputs)
    _, job = make_job(file_place, file_place.uri("in/"),
                      output={"format": "parquet", "compression": "zstd", "partitionBy": partition_by})
    run_shards(job)
    manifest = publish_manifest(job)
    (entry,) = manifest.files or []
    assert entry.path in ("results/r0-00000.tsv", "results/a.tsv") and entry.rows == 12
    data = file_place.storage.read_bytes(job.spec.output.uri + entry.path)
    assert data == b"".join(fake.line({"id": r["id"], "output": r["text"]}) for r in inputs[:12])
    assert entry.sha256 == hashlib.sha256(data).hexdigest() and entry.bytes == len(data)
    # Error rows are in the writer's error format; bij results reads each file with its own writer.
    assert [f.path.rsplit(".", 2)[1:] for f in manifest.error_files or []] == [["jsonl", "zst"]]
    assert [(r["id"], r["output"]) for r in iter_rows(job.spec.output.uri, "results", None)] == [
        (r["id"], r["text"]) for r in inputs[:12]]
    out = io.BytesIO()
    assert write_jsonl(job.spec.output.uri, "errors", out, None) == 1
    assert json.loads(out.getvalue())["error"]["code"] == "empty_text"


# --- csv ------------------------------------------------------------------------------------------

CSV_SHAPE = ResultShape("generate", "mixed", False, "none")
TRICKY = ["a, b", 'say "hi"', "line\nbreak", "cr\ronly", "crlf\r\nend", "naïve 日本語 🙂", "", " padded ",
          "42", "true", "null", '"quoted"', "[1, 2]", "x\x00y"]


def csv_rows() -> list[dict[str, Any]]:
    """Result rows whose outputs and pass-through columns hold what a CSV cell must quote or tell apart."""
    rows: list[dict[str, Any]] = []
    carried: list[Any] = [*TRICKY, 42, 2.5, True, None, 2**70, [1, "a, b"], {"k": "v\n", "n": None}, -(2**63)]
    for i, value in enumerate(carried):
        row: dict[str, Any] = {"id": [i, f"s{i}", str(i), 2**70][i % 4], "output": TRICKY[i % len(TRICKY)],
                               "usage": {"prompt_tokens": i, "completion_tokens": 1, "total_tokens": i + 1}}
        if i % 5 == 0:
            row["truncated"] = True
        row["meta"] = value
        if i % 3 == 0:  # a column some rows lack reads back as null
            row["note"] = f"n{i}"
        rows.append(row)
    return rows


def expected_back(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What a CSV (as Parquet) file gives back: every column for every row, ids beyond int64 as text."""
    out = []
    for r in rows:
        back = {**r, "id": r["id"] if not isinstance(r["id"], int) or abs(r["id"]) < 2**63 else str(r["id"])}
        back.setdefault("note", None)
        out.append(back)
    return out


def csv_bytes(rows: list[dict[str, Any]], shape: ResultShape, spooled: bool) -> bytes:
    writer = WRITERS["csv"]
    if not spooled:
        part = writer.part(shape)
        for row in rows:
            part.add(row)
        return part.finish()
    stream = writer.stream(shape, lambda: tempfile.SpooledTemporaryFile(max_size=64), 3)
    for row in rows:
        stream.add(row)
    with stream.finish() as spool:
        return spool.read()


@pytest.mark.parametrize("spooled", [False, True])
@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_csv_reads_back_commas_quotes_line_breaks_unicode_and_the_types_of_each_cell(spooled: bool,
                                                                                    compression: str) -> None:
    rows = csv_rows()
    shape = ResultShape("generate", "mixed", False, compression)
    writer = WRITERS["csv"]
    path = f"results/x{writer.suffix(compression)}"
    data = csv_bytes(rows, shape, spooled)
    assert list(writer.rows(data, path)) == expected_back(rows)
    assert [json.loads(line) for line in writer.lines(data, path)] == expected_back(rows)
    if compression == "none":
        assert data == csv_bytes(rows, shape, not spooled)  # a part and a spooled file are the same bytes
        check_csv_text(data.decode(), rows)


def check_csv_text(text: str, rows: list[dict[str, Any]]) -> None:
    """The file as RFC 4180 with the documented cells: what another CSV reader sees."""
    import csv

    import pyarrow as pa
    import pyarrow.csv as pacsv

    header = "id,id_int,output,prompt_tokens,completion_tokens,truncated,meta,note\r\n"
    assert text.startswith(header) and text.endswith("\r\n")
    first = text[len(header):].split("\r\n", 1)[0]
    assert first == "0,0,\"a, b\",0,1,true,\"a, b\",n0"  # quoted only where it must be
    cells = list(csv.DictReader(io.StringIO(text, newline="")))
    assert [c["output"] for c in cells] == [r["output"] for r in rows]
    meta = [c["meta"] for c in cells]
    assert meta[TRICKY.index("42")] == '"42"' and meta[len(TRICKY)] == "42"  # the string, the number
    assert meta[TRICKY.index("")] == '""' and meta[TRICKY.index("a, b")] == "a, b"
    assert meta[len(TRICKY) + 3] == "" and meta[len(TRICKY) + 4] == str(2**70)  # null; an integer beyond int64
    assert meta[len(TRICKY) + 6] == '{"k":"v\\n","n":null}'  # compact JSON
    assert [c["id"] for c in cells][:4] == ["0", "s1", "2", str(2**70)]
    assert [c["id_int"] for c in cells][:4] == ["0", "", "", ""]
    # pyarrow's own CSV reader (as a warehouse load) sees the same cells
    table = pacsv.read_csv(pa.BufferReader(text.encode()), parse_options=pacsv.ParseOptions(newlines_in_values=True),
                           convert_options=pacsv.ConvertOptions(column_types={"output": pa.string()},
                                                                strings_can_be_null=False))
    assert table.column("output").to_pylist() == [r["output"] for r in rows]


def test_csv_embeddings_are_exact_json_lists_and_ids_of_one_type_are_plain() -> None:
    writer = WRITERS["csv"]
    vectors = [[0.1, -2.5e-08, 1.0, 3.4028234663852886e38], [], [1 / 3] * 5]
    rows = [{"id": i, "embedding": v, "usage": {"prompt_tokens": 3, "total_tokens": 3}}
            for i, v in enumerate(vectors)]
    data = csv_bytes(rows, ResultShape("embed", "int", False, "none"), False)
    lines = data.decode().split("\r\n")
    assert lines[:2] == ["id,embedding,prompt_tokens,truncated", '0,"[0.1,-2.5e-8,1.0,3.4028234663852886e+38]",3,false']
    assert list(writer.rows(data, "results/x.csv")) == rows
    strs = [{"id": str(i), "output": "o", "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
            for i in range(3)]
    data = csv_bytes(strs, ResultShape("generate", "str", False, "none"), True)
    # string ids that look like numbers stay strings: `id_int` (empty) says the `id` column is text
    assert data.decode().split("\r\n")[:2] == ["id,id_int,output,prompt_tokens,completion_tokens,truncated",
                                               "0,,o,1,1,false"]
    assert list(writer.rows(data, "results/x.csv")) == strs


@pytest.mark.parametrize("task", ["generate", "embed", "classify", "score", "rerank"])
@pytest.mark.parametrize("judged", [False, True])
def test_csv_has_the_columns_parquet_chooses_and_reads_back_each_task(task: str, judged: bool) -> None:
    from bij.storage.parquet import results_table

    own: dict[str, Any] = {"generate": {"output": "x", "choices": [{"index": 0, "output": "x",
                                                                    "finish_reason": "stop", "completion_tokens": 1}]},
                           "embed": {"embedding": [0.5]}, "classify": {"label": "pos", "probs": [0.25, 0.75]},
                           "score": {"score": 0.5}, "rerank": {"results": [{"index": 1, "relevance_score": 0.5}]}}
    usage = {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3} if task == "generate" else \
        {"prompt_tokens": 2, "total_tokens": 2}
    rows = [{"id": i, **own[task], "usage": usage, **({"attempts": 1, "round": 0} if judged else {}),
             "score" if task == "classify" else "label": f"carried {i}", "meta": {"a": [i]}} for i in range(3)]
    shape = ResultShape(task, "int", judged, "none")
    data = csv_bytes(rows, shape, False)
    assert data.decode().split("\r\n")[0].split(",") == results_table(rows, task, "int", judged).column_names
    assert [dict(sorted(r.items())) for r in WRITERS["csv"].rows(data, "results/x.csv")] == [
        dict(sorted(r.items())) for r in rows]


def test_csv_output_refuses_openai_input() -> None:
    from bij.contract.spec import SpecError, parse_spec

    with pytest.raises(SpecError, match="output.format other than jsonl needs input.format jsonl or parquet"):
        parse_spec({"input": {"uri": "file:///in", "format": "openai"},
                    "output": {"uri": "file:///out", "format": "csv"}})


PUBLISHED: list[Any] = [{"id": 1, "text": 'one, "two"\nthree'}, {"id": "1", "text": "string one", "lang": "fr"},
                        {"id": "x", "text": "naïve ✓", "lang": 7}, '{"id": "broken", ', {"id": 2**70, "text": "big"},
                        {"id": 5, "text": ""}, {"text": "no id", "lang": ["a", "b"]}]


@pytest.mark.parametrize("partition_by", ["shard", "input"])
def test_a_csv_job_publishes_csv_files_and_bij_results_reads_them_as_the_jsonl_job_does(
        file_place, make_job, run_shards, publish_doc, partition_by: str) -> None:
    file_place.write_jsonl("in/a.jsonl", PUBLISHED)
    jobs = {}
    for fmt in ("jsonl", "csv"):
        _, job = make_job(file_place, file_place.uri("in/"), name=f"t-{fmt}", out_dir=f"out-{fmt}/",
                          output={"format": fmt, "compression": "zstd", "partitionBy": partition_by},
                          sharding={"targetShardBytes": 1024, "chunkRows": 2})
        run_shards(job)
        manifest = publish_doc(job)
        jobs[fmt] = job
    assert manifest["format"] == "csv"
    assert all(f["path"].endswith(".csv.zst") for f in manifest["files"])
    assert [f["path"].rsplit(".", 2)[1:] for f in manifest["errorFiles"]] == [["jsonl", "zst"]]
    want = list(iter_rows(jobs["jsonl"].spec.output.uri, "results", None))
    got = list(iter_rows(jobs["csv"].spec.output.uri, "results", None))
    # as Parquet: an integer id beyond int64 comes back as its text, a column a row lacks as null
    assert got == [{**r, "id": str(r["id"]) if r["id"] == 2**70 else r["id"], "lang": r.get("lang")} for r in want]
    assert [r["id"] for r in got][:4] == [1, "1", "x", str(2**70)] and got[0]["output"] == 'one, "two"\nthree'
    out = io.BytesIO()
    assert write_jsonl(jobs["csv"].spec.output.uri, "errors", out, None) == 2
    assert {json.loads(line)["error"]["code"] for line in out.getvalue().splitlines()} == {"invalid_json", "empty_text"}
