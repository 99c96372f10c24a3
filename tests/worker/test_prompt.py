"""spec.prompt: each row's prompt rendered from its columns by a sandboxed Jinja template."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from bij.cli.main import main as bij_main
from bij.contract.fingerprint import PlanRefused
from bij.contract.spec import SpecError, load_job
from bij.engines.echo import echo_embedding
from bij.local.publish import publish_manifest
from bij.steps.planner import plan_round
from bij.worker.input_row import InputOptions
from bij.worker.inputs import parse_line

TITLED = "{{ row.title }}: {{ row.body }}"


def articles(n: int) -> list[dict[str, Any]]:
    return [{"id": i, "title": f"Title {i}", "body": f"body of {i}", "lang": "en"} for i in range(n)]


def test_generate_rows_get_the_template_rendered_over_their_columns(file_place, make_job, run_shards,
                                                                    read_output) -> None:
    _, job = make_job(file_place, file_place.write_jsonl("in/a.jsonl", articles(40)), prompt={"template": TITLED})
    run_shards(job)
    publish_manifest(job)
    out = read_output(job)
    assert out.errors == []
    assert [(r["id"], r["output"]) for r in out.results] == [(i, f"Title {i}: body of {i}") for i in range(40)]
    # The columns are still carried to the result (the template reads them, the request does not consume them).
    assert all(r["title"] == f"Title {r['id']}" and r["lang"] == "en" for r in out.results)


def test_parquet_rows_are_read_for_every_column_the_template_may_use(file_place, make_job, run_shards,
                                                                     read_output) -> None:
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(articles(30)), buf, row_group_size=10)
    file_place.storage.write_bytes(file_place.uri("in/a.parquet"), buf.getvalue())
    # passThrough narrows what is carried, not what the template can read.
    _, job = make_job(file_place, file_place.uri("in/"), input={"format": "parquet", "passThrough": ["lang"]},
                      prompt={"template": TITLED})
    run_shards(job)
    publish_manifest(job)
    out = read_output(job)
    assert out.errors == []
    assert [(r["output"], r["lang"]) for r in out.results] == [(f"Title {i}: body of {i}", "en") for i in range(30)]
    assert all("title" not in r for r in out.results)


def test_chat_rows_get_the_system_message_then_the_rendered_user_message(file_place, make_job, run_shards,
                                                                         read_output) -> None:
    _, job = make_job(file_place, file_place.write_jsonl("in/a.jsonl", articles(3)), model={"task": "chat"},
                      prompt={"system": "Summarise in one line.", "template": TITLED})
    row = parse_line(b'{"id": 1, "title": "T", "body": "B"}', (0, 0, 1), "a.jsonl", InputOptions.from_spec(job.spec))
    assert row.request is not None
    assert row.request.messages == [{"role": "system", "content": "Summarise in one line."},
                                    {"role": "user", "content": "T: B"}]
    run_shards(job)
    publish_manifest(job)
    out = read_output(job)
    # The echo engine answers with the messages' contents, one a line.
    assert [r["output"] for r in out.results] == [f"Summarise in one line.\nTitle {i}: body of {i}" for i in range(3)]


def test_embed_rows_get_the_instruction_prefix(file_place, make_job, run_shards, read_output) -> None:
    inputs = [{"id": i, "text": f"query {i}"} for i in range(5)]
    _, job = make_job(file_place, file_place.write_jsonl("in/a.jsonl", inputs), model={"task": "embed"},
                      prompt={"template": "Represent this question for retrieval: {{ row.text }}"})
    run_shards(job)
    publish_manifest(job)
    out = read_output(job)
    assert run_shards.engine.seen == [f"Represent this question for retrieval: query {i}" for i in range(5)]
    assert [r["embedding"] for r in out.results] == [
        echo_embedding(f"Represent this question for retrieval: query {i}") for i in range(5)]


def test_a_row_missing_a_column_is_one_template_error_row_naming_it(file_place, make_job, run_shards,
                                                                     read_output) -> None:
    inputs = articles(10)
    del inputs[4]["body"]
    _, job = make_job(file_place, file_place.write_jsonl("in/a.jsonl", inputs), prompt={"template": TITLED})
    run_shards(job)
    publish_manifest(job)
    out = read_output(job)
    assert [r["id"] for r in out.results] == [0, 1, 2, 3, 5, 6, 7, 8, 9]
    (bad,) = out.errors
    assert bad["id"] == 4 and bad["error"]["code"] == "template_error"
    assert "the row has no column 'body'" in bad["error"]["message"]
    assert bad["title"] == "Title 4"  # its columns are carried, as on any error row
    assert out.manifest["counts"]["errorCodes"] == {"template_error": 1}


@pytest.mark.parametrize("template", [
    "{{ row.__class__.__mro__ }}",
    "{{ ''.__class__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ row.title.__globals__ }}",
    "{{ row.pop('title') }}",
    "{{ row.title * 100000000 }}",
    "{{ 9 ** 99999999 }}",
    # a loop that writes without end is stopped at the size limit
    "{% for i in range(100000) %}{% for j in range(100000) %}" + "x" * 4096 + "{% endfor %}{% endfor %}",
])
def test_a_template_reaching_for_python_internals_is_an_error_row_not_a_leak(template: str) -> None:
    from bij.contract.spec import parse_spec

    spec = parse_spec({"input": {"uri": "file:///in/"}, "output": {"uri": "file:///out/"},
                       "model": {"engine": "echo", "task": "generate"}, "prompt": {"template": template}})
    row = parse_line(b'{"id": 1, "title": "T", "body": "B"}', (0, 0, 1), "a.jsonl", InputOptions.from_spec(spec))
    assert row.request is None and row.error_code == "template_error", row
    assert row.error is not None and "spec.prompt.template" in row.error
    assert "<class" not in row.error and "object at 0x" not in row.error


def test_a_template_that_does_not_parse_is_refused_naming_the_field_and_line(tmp_path: Path, capsys) -> None:
    doc = {"apiVersion": "batchinference.io/v1alpha1", "kind": "BatchInferenceJob", "metadata": {"name": "p"},
           "spec": {"input": {"uri": "file:///in/"}, "output": {"uri": "file:///out/"},
                    "model": {"engine": "echo", "task": "generate"},
                    "prompt": {"template": "Title: {{ row.title }}\nBody: {{ row.body "}}}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(SpecError, match=r"spec\.prompt\.template: does not parse as a Jinja template: line 2: "):
        load_job(path)
    assert bij_main(["validate", str(path)]) == 1
    out = capsys.readouterr().out
    assert "spec.prompt.template: does not parse as a Jinja template: line 2:" in out


def test_a_rerun_with_another_template_is_refused(file_place, make_job) -> None:
    uri = file_place.write_jsonl("in/a.jsonl", articles(3))
    _, job = make_job(file_place, uri, prompt={"template": TITLED})
    plan_round(job, 0)
    plan_round(job, 0)  # the same template: the same plan
    _, other = make_job(file_place, uri, prompt={"template": "{{ row.body }}"})
    with pytest.raises(PlanRefused, match=r"spec\.prompt changed from .*row\.title.* to .*row\.body"):
        plan_round(other, 0)


def test_validate_shows_the_first_rows_rendered(file_place, make_job, capsys) -> None:
    inputs = articles(5)
    del inputs[1]["body"]
    path, _ = make_job(file_place, file_place.write_jsonl("in/a.jsonl", inputs), model={"task": "chat"},
                       prompt={"system": "Be terse.", "template": TITLED})
    assert bij_main(["validate", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "valid"
    assert out[1].startswith("spec.prompt rendered for the first rows of file://") and "a.jsonl" in out[1]
    assert out[2:] == [
        "  row 0:", "    system: Be terse.", "    user: Title 0: body of 0",
        "  row 1: template_error: spec.prompt.template: the row has no column 'body'",
        "  row 2:", "    system: Be terse.", "    user: Title 2: body of 2",
    ]


def test_the_example_job_renders_its_rows(monkeypatch, capsys) -> None:
    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)  # its input is file://examples/articles.jsonl, relative to the repository
    assert bij_main(["validate", "examples/prompt-columns.yaml"]) == 0
    out = capsys.readouterr().out
    assert '  row "a1":\n    system: You write one-sentence summaries for a changelog.\n' in out
    assert "    user: Summarise this article.\n      Title: Lanes and shards\n" in out


def test_a_row_a_judge_round_sends_again_is_rendered_from_its_columns_again() -> None:
    from bij.contract.spec import parse_spec
    from bij.worker.inputs import redispatch_line

    spec = parse_spec({"input": {"uri": "file:///in/"}, "output": {"uri": "file:///out/"},
                       "model": {"engine": "echo", "task": "generate"}, "prompt": {"template": TITLED},
                       "judge": {"type": "regex", "pattern": "x"}})
    line = b'{"id": 1, "title": "T", "body": "B"}'
    first = parse_line(line, (0, 0, 1), "a.jsonl", InputOptions.from_spec(spec))
    again = redispatch_line(line, first, 1, ["rejected"], "T: B").encode()
    row = parse_line(again, (0, 0, 1), "rejected.jsonl", InputOptions.from_spec(spec, round_no=1))
    assert row.request is not None and row.request.text == "T: B" and row.prior_attempts == 1
