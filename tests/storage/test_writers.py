"""Result writers (bij.storage.writers): one per output format the spec accepts, each reading back what it
wrote, and the one registered for a format is the one a publish and `bij results` use."""

from __future__ import annotations

import hashlib
import io
import json
import tempfile
from collections.abc import Callable, Iterator
from typing import IO, Any, get_args

import pytest

from bij.cli import validate
from bij.contract.publish_plan import PublishPlan
from bij.contract.spec_io import OutputSpec
from bij.local.publish import publish_manifest
from bij.steps.results import iter_rows, write_jsonl
from bij.storage.writers import WRITERS, ResultShape, writer_of_path


def test_every_output_format_the_spec_accepts_has_a_writer() -> None:
    formats = set(get_args(OutputSpec.model_fields["format"].annotation))
    assert formats == set(WRITERS)
    assert set(get_args(PublishPlan.model_fields["format"].annotation)) == formats
    crd = validate.crd_schema()["properties"]["spec"]["properties"]["output"]["properties"]["format"]
    assert set(crd["enum"]) == formats
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
