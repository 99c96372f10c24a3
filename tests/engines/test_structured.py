"""Structured output: constrained decoding gives valid output on a random-weight model, row by row."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing here may reach a model hub
pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from byte_model import build_byte_model  # noqa: E402

from bij.contract.sampling import Sampling, json_schema_text  # noqa: E402
from bij.engines.base import EngineConfig, Request  # noqa: E402
from bij.engines.transformers import TransformersEngine  # noqa: E402

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "ok": {"type": "boolean"},
                                      "name": {"type": "string", "pattern": "^[a-z]{1,6}$"}},
     "required": ["answer", "ok", "name"], "additionalProperties": False},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"label": {"enum": ["cat", "dog", "bird"]}}, "required": ["label"],
     "additionalProperties": False},
]


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_byte_model(tmp_path_factory.mktemp("bytes"))


@pytest.fixture(scope="module")
def engine(byte_model: Path) -> Any:
    e = TransformersEngine(EngineConfig(task="generate", name=str(byte_model), device="cpu"))
    e.load()
    return e


def test_every_row_follows_its_own_json_schema_on_a_random_model(engine: Any) -> None:
    assert "structuredOutput" in engine.honours
    reqs = [Request(text="the fox", max_tokens=64, temperature=1.0, seed=i,
                    sampling=Sampling(structured_output=("json_schema", json_schema_text("s", SCHEMAS[i % 3]))))
            for i in range(12)]
    free = engine.run([Request(text="the fox", max_tokens=24, temperature=1.0, seed=1)])[0].output
    with pytest.raises(ValueError):
        json.loads(free)  # unconstrained, the random model writes no JSON
    for i, res in enumerate(engine.run(reqs)):
        assert res.error is None and res.extra["finish_reason"] == "stop", res
        jsonschema.validate(json.loads(res.output), SCHEMAS[i % 3])


def test_regex_and_choice_constrain_the_output(engine: Any) -> None:
    asks = [("regex", "[a-c]{3}-[0-9]{2}"), ("choice", '["red", "green", "blue"]')]
    reqs = [Request(text="x", max_tokens=20, temperature=1.0, seed=s, sampling=Sampling(structured_output=a))
            for a in asks for s in range(4)]
    outs = [r.output for r in engine.run(reqs)]
    assert all(re.fullmatch(r"[a-c]{3}-[0-9]{2}", o) for o in outs[:4])
    assert all(o in ("red", "green", "blue") for o in outs[4:])


def test_any_json_object_is_an_object_whenever_it_finishes(engine: Any) -> None:
    """An open object has no bound a random model keeps to (it writes keys of any length); whatever
    finishes is a JSON object, and what the token cap cut says so (finish_reason length)."""
    reqs = [Request(text="x", max_tokens=300, temperature=1.0, seed=s,
                    sampling=Sampling(structured_output=("json_object", ""))) for s in range(8)]
    results = engine.run(reqs)
    finished = [r for r in results if r.extra["finish_reason"] == "stop"]
    assert finished
    for r in finished:
        assert isinstance(json.loads(r.output), dict)
    for r in results:
        assert r.output.startswith("{") and (r.extra["finish_reason"] == "stop" or r.completion_tokens == 300)


def test_a_grammar_that_cannot_compile_fails_its_row_alone(engine: Any) -> None:
    bad, good = engine.run([
        Request(text="x", max_tokens=8, sampling=Sampling(structured_output=("grammar", "root ::= undefined_rule"))),
        Request(text="x", max_tokens=8, sampling=Sampling(structured_output=("choice", '["only"]'))),
    ])
    assert bad.error is not None and "structured output (grammar) cannot be compiled" in bad.error
    assert good.output == "only"


def test_with_the_judges_schema_as_structured_output_every_row_passes_at_round_zero(
        byte_model: Path, file_place: Any, make_job: Any, bij_bin: Any) -> None:
    import subprocess

    schema = SCHEMAS[0]
    rows = [{"id": i, "text": f"row {i} says"} for i in range(20)]
    path, job = make_job(
        file_place, file_place.write_jsonl("in.jsonl", rows),
        model={"engine": "transformers", "name": str(byte_model), "task": "generate", "maxTokens": 64,
               "temperature": 1.0, "structuredOutput": {"jsonSchema": schema}},
        judge={"type": "jsonSchema", "schema": schema, "maxRounds": 3},
        workers={"parallelism": 1, "backoffLimitPerIndex": 0})
    proc = subprocess.run([bij_bin("bij"), "run", str(path)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads((Path(job.spec.output.uri.removeprefix("file://")) / "manifest.json").read_text())
    assert manifest["counts"]["rows"] == 20 and manifest["counts"]["errors"] == 0
    assert manifest["counts"].get("capped", 0) == 0
    (only,) = manifest["rounds"]  # no second judge round was needed
    assert (only["approved"], only["rejected"], only["approvalRate"]) == (20, 0, 1.0)


def test_openai_response_format_reaches_the_engine_as_structured_output() -> None:
    from bij.worker.input_row import InputOptions
    from bij.worker.inputs import parse_line

    opts = InputOptions(format="openai", task="chat", engine="transformers",
                        honours=frozenset({"structuredOutput", "maxTokens", "temperature", "seed"}))
    body = {"messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "strict": True,
                                                                       "schema": SCHEMAS[2]}}}
    line = json.dumps({"custom_id": "a", "url": "/v1/chat/completions", "body": body}).encode()
    row = parse_line(line, (0, 0, len(line)), "in", opts)
    assert row.request.sampling.structured_output == ("json_schema", json_schema_text("s", SCHEMAS[2]))
    body["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": 7}}}
    line = json.dumps({"custom_id": "a", "url": "/v1/chat/completions", "body": body}).encode()
    row = parse_line(line, (0, 0, len(line)), "in", opts)
    assert row.error_code == "invalid_request" and "is not a valid JSON Schema" in str(row.error)
    echo = InputOptions(format="openai", task="chat", engine="echo", honours=frozenset({"maxTokens"}))
    body["response_format"] = {"type": "json_object"}
    line = json.dumps({"custom_id": "a", "url": "/v1/chat/completions", "body": body}).encode()
    row = parse_line(line, (0, 0, len(line)), "in", echo)
    assert row.error == "engine echo cannot honour body.response_format"


# --- Every structured answer is valid or an error row (bij.engines.structured) ---------------------

from tiny_models import build_model  # noqa: E402

from bij.engines.base import Choice, Result  # noqa: E402
from bij.engines.structured import UNENFORCED_KEYWORDS, Validator, grammar_schema  # noqa: E402

BOUNDED = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 2, "maxLength": 8},
    "tags": {"type": "array", "items": {"type": "array", "items": {"type": "string", "maxLength": 4},
                                        "maxItems": 2}, "maxItems": 3},
    "kind": {"enum": ["a", "b"]}, "code": {"type": "string", "pattern": "^[a-z]{1,3}$"},
    "seen": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "maxItems": 3}},
    "required": ["name", "tags", "kind", "code", "seen"], "additionalProperties": False}


def _structured(kind: str, value: Any) -> tuple[str, str]:
    if kind == "json_schema":
        return kind, json_schema_text("s", value)
    return kind, value


@pytest.mark.parametrize(("ask", "output", "why"), [
    (("json_schema", {"type": "string", "maxLength": 4}), '"ab\x02c"', "not valid JSON: Invalid control character"),
    (("json_schema", {"type": "array", "uniqueItems": True}), "[1, 1, 0]", "keyword uniqueItems"),
    (("json_schema", {"type": "integer", "not": {"const": 3}}), "3", "keyword not"),
    (("json_schema", {"type": "object"}), '{"a": NaN}', "not valid JSON"),
    (("json_object", ""), "[1]", "not an object"),
    (("regex", "[a-c]{3}"), "abcd", "does not match"),
    (("choice", '["red", "blue"]'), "green", "not one of the choices"),
])
def test_an_answer_that_breaks_its_structured_output_becomes_a_schema_violation(
        ask: tuple[str, Any], output: str, why: str) -> None:
    structured = _structured(*ask)
    req = Request(text="x", sampling=Sampling(structured_output=structured))
    results = [Result(output=output, completion_tokens=3, extra={"finish_reason": "stop"})]
    found = Validator().check([req], results)
    assert (found.validated, found.violations) == (0, 1)
    [res] = results
    assert res.extra["code"] == "schema_violation" and why in res.error and res.output == output


def test_valid_answers_count_as_validated_and_what_cannot_be_checked_is_left_alone() -> None:
    asks = [("json_schema", {"type": "array", "uniqueItems": True}), ("regex", "[a-c]{3}"),
            ("choice", '["red", "blue"]'), ("grammar", 'root ::= "x"'), ("json_object", "")]
    outputs = ["[1, 2]", "abc", "red", "anything", '{"a": 1}']
    reqs = [Request(text="x", sampling=Sampling(structured_output=_structured(*a))) for a in asks]
    results = [Result(output=o, extra={"finish_reason": "stop"}) for o in outputs]
    found = Validator().check(reqs, results)
    assert (found.validated, found.violations, found.unchecked) == (4, 0, 1)
    assert all(r.error is None for r in results)
    # An answer cut by its token cap that breaks its structured output is an error row too, saying it was cut;
    # one that still keeps to it (a prefix the pattern takes) stands, with its finish_reason.
    cut = [Result(output='{"a": ', completion_tokens=4, extra={"finish_reason": "length"})]
    assert Validator().check(reqs[4:], cut).violations == 1
    assert cut[0].extra["code"] == "schema_violation" and "cut at its token cap: 4 tokens" in str(cut[0].error)
    kept = [Result(output="ab", completion_tokens=2, extra={"finish_reason": "length"})]
    prefix = [Request(text="x", sampling=Sampling(structured_output=_structured("regex", "[a-c]{1,3}")))]
    assert Validator().check(prefix, kept).validated == 1 and kept[0].error is None
    # n answers: one broken answer makes the row an error naming it.
    many = [Result(output="red", choices=[Choice("red", 1, "stop"), Choice("green", 1, "stop")],
                   extra={"finish_reason": "stop"})]
    assert Validator().check(reqs[2:3], many).violations == 1 and "answer 1" in str(many[0].error)


def _problem(kind: str, value: Any, output: str, validator: Validator | None = None) -> str | None:
    return (validator or Validator()).problem(_structured(kind, value), output)


@pytest.mark.timeout(20)  # Python's re takes hours here (2**40 ways to split forty a's), holding the GIL
def test_a_backtracking_regex_is_checked_in_linear_time() -> None:
    req = Request(text="x", sampling=Sampling(structured_output=("regex", "(a+)+b")))
    cut = [Result(output="a" * 40, completion_tokens=40, extra={"finish_reason": "length"})]
    assert Validator().check([req], cut).violations == 1
    assert "does not match the pattern '(a+)+b' (cut at its token cap: 40 tokens" in str(cut[0].error)
    assert _problem("regex", "(a+)+b", "a" * 100_000 + "b") is None
    # The schema's own regexes too: pattern, and patternProperties (additionalProperties reads them).
    why = _problem("json_schema", {"type": "string", "pattern": "^(a+)+b$"}, json.dumps("a" * 40))
    assert why is not None and "does not match '^(a+)+b$' (keyword pattern)" in why
    keyed = {"type": "object", "patternProperties": {"^(a+)+b$": {"type": "integer"}}, "additionalProperties": False}
    why = _problem("json_schema", keyed, json.dumps({"a" * 40: 1}))
    assert why is not None and "not match any of the regexes: '^(a+)+b$' (keyword additionalProperties)" in why
    assert _problem("json_schema", keyed, json.dumps({"a" * 40 + "b": 1})) is None


@pytest.mark.parametrize(("pattern", "output", "matches"), [
    ("[a-c]{3}-[0-9]{2}", "abc-12", True),
    ("[a-c]{3}-[0-9]{2}", "abc-123", False),
    (r"\d+(\.\d+)?", "3.14", True),
    (r"\d+(\.\d+)?", "3.", False),
    ("(yes|no)", "yes", True),
    ("(yes|no)", "yesno", False),  # the whole answer, not a prefix
    ("é+ ok", "éé ok", True),
    (r"[\u0041-\u005a]+", "ABC", True),  # JSON Schema's (ECMA-262's) \uXXXX escape
    (r"[\u0041-\u005a]+", "abc", False),
    (r"\\u0041", "\\u0041", True),  # an escaped backslash, then a plain "u0041"
    (r"(?P<word>\w+) \w+", "hello world", True),
    ("a.c", "a\nc", False),  # "." stops at a line break, as in re
])
def test_ordinary_patterns_match_and_refuse_answers_as_before(pattern: str, output: str, matches: bool) -> None:
    why = _problem("regex", pattern, output)
    assert (why is None) == matches, why
    if not matches:
        assert why == f"does not match the pattern {pattern!r}"


@pytest.mark.parametrize(("pattern", "reason"), [
    (r"(a)\1", r"invalid escape sequence: \1"),  # a backreference
    ("(?=a)a", "invalid perl operator: (?="),  # a lookahead
    ("a{1001}", "invalid repetition size: {1001}"),
])
def test_a_pattern_the_linear_engine_refuses_is_a_violation_naming_it(pattern: str, reason: str) -> None:
    req = Request(text="x", sampling=Sampling(structured_output=("regex", pattern)))
    results = [Result(output="aa", completion_tokens=2, extra={"finish_reason": "stop"})]
    assert Validator().check([req], results).violations == 1
    assert results[0].extra["code"] == "schema_violation"
    assert results[0].error == (f"the answer breaks its structured output (regex): the pattern {pattern!r} "
                                f"cannot be matched in linear time (RE2: {reason})")
    why = _problem("json_schema", {"type": "string", "pattern": pattern}, '"aa"')
    assert why is not None and f"the pattern {pattern!r} cannot be matched in linear time" in why


@pytest.mark.timeout(20)
def test_a_schema_check_that_runs_too_long_is_stopped_and_says_so() -> None:
    # Each level tries both array branches before failing: 2**40 steps without a deadline.
    node = {"anyOf": [{"type": "array", "items": {"$ref": "#/$defs/n"}},
                      {"type": "array", "items": {"$ref": "#/$defs/n"}}, {"type": "integer"}]}
    schema = {"$defs": {"n": node}, "$ref": "#/$defs/n"}
    deep = "[" * 40 + '"x"' + "]" * 40
    assert _problem("json_schema", schema, deep, Validator(seconds=0.5)) == (
        "its schema's check ran past 0.5 s and was stopped (too costly to check)")
    assert _problem("json_schema", schema, "[[1], [[2]]]", Validator(seconds=0.5)) is None


@pytest.mark.timeout(20)
def test_unique_items_of_a_long_array_of_objects_is_checked_in_linear_time() -> None:
    schema = {"type": "array", "uniqueItems": True}
    items = [{"id": i, "tags": [i, {"k": True}]} for i in range(20_000)]  # pairwise: 2*10**8 comparisons
    assert _problem("json_schema", schema, json.dumps(items)) is None
    twice = items + [{"tags": [7.0, {"k": True}], "id": 7}]  # 7 == 7.0 and keys unordered, as JSON Schema says
    assert "has non-unique elements" in str(_problem("json_schema", schema, json.dumps(twice)))
    assert _problem("json_schema", schema, "[1, true, 0, false]") is None  # true is not 1


@pytest.mark.parametrize("recursion_limit", [None, 100_000])
def test_an_answer_nested_too_deep_is_a_violation_not_a_crash(recursion_limit: int | None) -> None:
    """The same answer, whatever the interpreter's recursion limit (libraries loaded in a worker raise it)."""
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(recursion_limit or before)
    try:
        assert _problem("json_object", "", "[" * 100_000) == "not valid JSON: nested deeper than the parser goes"
        deep = "[" * 400 + "]" * 400
        why = _problem("json_schema", {"items": {"$ref": "#"}}, deep)
        assert why == "nested deeper than its schema's check goes"
        # Brackets inside strings are text, not nesting.
        assert _problem("json_object", "", json.dumps({"text": "[" * 10_000})) is None
    finally:
        sys.setrecursionlimit(before)


def test_length_bounded_strings_reach_the_grammar_as_patterns_without_control_characters() -> None:
    tight = json.loads(grammar_schema(json.dumps(BOUNDED)))
    assert tight["properties"]["name"] == {"type": "string", "pattern": "^[^\\x00-\\x1f]{2,8}$"}
    assert tight["properties"]["tags"]["items"]["items"] == {"type": "string", "pattern": "^[^\\x00-\\x1f]{0,4}$"}
    assert tight["properties"]["code"] == BOUNDED["properties"]["code"]  # its own pattern stays
    assert grammar_schema('{"type":"string"}') == '{"type":"string"}'
    # A long bound is left to the validator: xgrammar's compile time grows with a counted pattern's bound.
    assert grammar_schema('{"type":"string","maxLength":1000}') == '{"type":"string","maxLength":1000}'
    assert {"uniqueItems", "not", "if", "then"} <= set(UNENFORCED_KEYWORDS)


@pytest.fixture(scope="module")
def wordpiece_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("wordpiece"))


def test_a_tokenizer_that_cannot_write_json_fails_those_rows_alone_and_says_so_once(
        wordpiece_model: Path, file_place: Any, make_job: Any, run_shards: Any, read_output: Any) -> None:
    """15 chat rows on a word-level (WordPiece-decoded) tokenizer, 6 asking for a JSON schema: the job
    publishes, the 6 are `unsupported` error rows naming why, the other 9 are answered, and the reason
    is in the manifest's notes once."""
    from bij.local.publish import publish_manifest

    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    rows = [{"id": i, "text": "a b", **({"sampling": {"structuredOutput": {"jsonSchema": schema}}}
                                        if i % 5 in (0, 2) else {})} for i in range(15)]
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", rows),
                      model={"engine": "transformers", "name": str(wordpiece_model), "task": "chat", "maxTokens": 8},
                      batching={"maxBatchSize": 4})
    engine = TransformersEngine(EngineConfig(task="chat", name=str(wordpiece_model), device="cpu", max_tokens=8))
    run_shards(job, engine=engine)
    manifest = publish_manifest(job)
    out = read_output(job)
    structured = [r["id"] for r in rows if "sampling" in r]
    assert len(structured) == 6
    assert sorted(out.result_ids) == [r["id"] for r in rows if "sampling" not in r]
    assert sorted(e["id"] for e in out.errors) == structured
    for e in out.errors:
        assert e["error"]["code"] == "unsupported"
        assert "has no token that can start a JSON value" in e["error"]["message"]
    assert len(manifest.notes) == 1 and "no token that can start a JSON value" in manifest.notes[0]
    assert manifest.counts.error_codes == {"unsupported": 6}


def test_structured_rows_on_a_byte_level_model_are_never_an_invalid_success(
        byte_model: Path, file_place: Any, make_job: Any, run_shards: Any, read_output: Any) -> None:
    """Schemas with maxLength, nested arrays, enums, patterns and uniqueItems (which the grammar does not
    enforce), sampled at temperature 1 beside plain rows: every published answer validates, every
    other structured row is an error row carrying its answer, and the plain rows are answered."""
    from bij.local.publish import publish_manifest

    choice = ["red", "green"]
    asks = [{"jsonSchema": BOUNDED}, {"jsonSchema": SCHEMAS[1]}, {"regex": "[a-c]{2}-[0-9]"}, {"choice": choice}]
    rows = [{"id": i, "text": f"row {i}", **({"sampling": {"structuredOutput": asks[i % 5], "seed": i}}
                                            if i % 5 < 4 else {})} for i in range(60)]
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", rows),
                      model={"engine": "transformers", "name": str(byte_model), "task": "generate", "maxTokens": 96,
                             "temperature": 1.0})
    engine = TransformersEngine(EngineConfig(task="generate", name=str(byte_model), device="cpu"))
    run_shards(job, engine=engine)
    manifest = publish_manifest(job)
    out = read_output(job)
    by_id = {r["id"]: r for r in rows}
    answered = 0
    for res in out.results:
        ask = by_id[res["id"]].get("sampling", {}).get("structuredOutput")
        if ask is None or res["usage"]["completion_tokens"] >= 96:  # cut by its token cap: not finished
            continue
        answered += 1
        if "jsonSchema" in ask:
            jsonschema.validate(json.loads(res["output"]), ask["jsonSchema"])
        elif "regex" in ask:
            assert re.fullmatch(ask["regex"], res["output"])
        else:
            assert res["output"] in choice
    assert sorted([r["id"] for r in out.results] + [e["id"] for e in out.errors]) == list(range(60))
    assert all(r["id"] in [x["id"] for x in out.results] for r in rows if "sampling" not in r)
    for e in out.errors:
        assert e["error"]["code"] == "schema_violation" and "output" in e and "breaks its structured output" in \
            e["error"]["message"]
    s = manifest.counts.structured
    assert s.validated >= answered > 0
    assert s.violations == len(out.errors) == manifest.counts.error_codes.get("schema_violation", 0)


def test_a_thousand_structured_rows_every_success_validates(
        byte_model: Path, file_place: Any, make_job: Any, run_shards: Any, read_output: Any) -> None:
    from bij.local.publish import publish_manifest

    schema = {"type": "object", "properties": {"label": {"enum": ["cat", "dog", "bird"]},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["label", "n"], "additionalProperties": False}
    rows = [{"id": i, "text": f"r{i}"} for i in range(1000)]
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", rows),
                      model={"engine": "transformers", "name": str(byte_model), "task": "generate", "maxTokens": 32,
                             "temperature": 1.0, "structuredOutput": {"jsonSchema": schema}},
                      batching={"maxBatchSize": 64}, sharding={"targetShardBytes": 1 << 20, "chunkRows": 250})
    run_shards(job, engine=TransformersEngine(EngineConfig(task="generate", name=str(byte_model), device="cpu")))
    manifest = publish_manifest(job)
    out = read_output(job)
    assert len(out.results) + len(out.errors) == 1000
    finished = [r for r in out.results if r["usage"]["completion_tokens"] < 32]  # the rest hit the cap
    assert len(finished) > 700
    for r in finished:
        jsonschema.validate(json.loads(r["output"]), schema)
    assert manifest.counts.structured.validated == len(finished)
    assert {e["error"]["code"] for e in out.errors} <= {"schema_violation"}
    assert manifest.counts.structured.violations == len(out.errors)


def test_a_broken_answer_is_retried_once_on_the_second_grammar_backend(byte_model: Path) -> None:
    """Without its bounded strings tightened, xgrammar writes raw control characters into most answers
    of this schema on a random model; the rows whose answer breaks the schema run once more under
    llguidance, and an answer that keeps to it replaces the first, counted as repaired. Without a second
    backend the broken answers stay broken, and the validator makes them schema_violation rows."""
    pytest.importorskip("llguidance")
    import bij.engines.transformers as tf

    schema = {"type": "object", "properties": {"name": {"type": "string", "minLength": 2, "maxLength": 8}},
              "required": ["name"], "additionalProperties": False}
    ask = ("json_schema", json_schema_text("s", schema))
    reqs = [Request(text="x", max_tokens=60, temperature=1.0, seed=i, sampling=Sampling(structured_output=ask))
            for i in range(16)]
    counts = {}
    for second in (False, True):
        engine = TransformersEngine(EngineConfig(task="generate", name=str(byte_model), device="cpu"))
        engine.load()
        if not second:
            engine._llg = False  # no second backend
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(tf, "grammar_schema", lambda text: text)  # xgrammar's defect left in place
            results = engine.run(reqs)
        found = Validator().check(reqs, results)
        counts[second] = (found.validated, found.repaired, found.violations)
        for r in results:
            if r.error is None:
                jsonschema.validate(json.loads(r.output), schema)
            else:
                assert r.extra["code"] == "schema_violation" and r.output is not None
    validated, repaired, violations = counts[False]
    assert repaired == 0 and violations >= 4 and validated + violations == 16
    validated, repaired, violations = counts[True]
    assert repaired >= 4 and violations <= counts[False][2] - repaired


def test_each_costly_or_odd_row_fails_alone_beside_good_rows(
        byte_model: Path, file_place: Any, make_job: Any, run_shards: Any, read_output: Any) -> None:
    """On the transformers engine: 128 answers of 10**9 tokens with 20 top logprobs (refused before it
    runs: nothing of it is ever held), a seed beyond 64 bits on a line with a NaN (read by the standard
    library's parser), a schema whose uniqueItems the grammar does not enforce, and good rows: the good
    rows are answered, each other row is an answer that keeps its schema or an error row naming why."""
    from bij.local.publish import publish_manifest

    unique = {"type": "array", "items": {"enum": [0, 1]}, "uniqueItems": True, "minItems": 2, "maxItems": 2}
    lines = [json.dumps({"id": i, "text": f"good {i}"}) for i in range(4)]
    lines.append(json.dumps({"id": "huge", "text": "x", "sampling": {"n": 128, "maxTokens": 10**9, "logprobs": True,
                                                                      "topLogprobs": 20}}))
    lines.append(f'{{"id": "seed", "text": "x", "sampling": {{"seed": {2**70}}}, "note": NaN}}')
    lines.append(json.dumps({"id": "unique", "text": "x", "sampling": {"structuredOutput": {"jsonSchema": unique}}}))
    uri = file_place.uri("in.jsonl")
    file_place.storage.write_bytes(uri, ("\n".join(lines) + "\n").encode())
    _, job = make_job(file_place, uri, model={"engine": "transformers", "name": str(byte_model), "task": "generate",
                                              "maxTokens": 12, "temperature": 1.0})
    run_shards(job, engine=TransformersEngine(EngineConfig(task="generate", name=str(byte_model), device="cpu")))
    publish_manifest(job)
    out = read_output(job)
    results = {r["id"]: r for r in out.results}
    errors = {e["id"]: e["error"] for e in out.errors}
    assert {0, 1, 2, 3} <= set(results)
    assert errors["huge"]["code"] == "invalid_request" and "over model.rowBudget" in errors["huge"]["message"]
    assert errors["seed"]["code"] == "invalid_request"
    assert "sampling.seed must be an integer" in errors["seed"]["message"]
    if "unique" in results:
        jsonschema.validate(json.loads(results["unique"]["output"]), unique)
    else:
        assert errors["unique"]["code"] == "schema_violation"


def test_bij_run_publishes_a_job_whose_structured_rows_cannot_be_served_and_says_why_once(
        wordpiece_model: Path, file_place: Any, make_job: Any, bij_bin: Any) -> None:
    import subprocess

    schema = {"type": "object"}
    rows = [{"id": i, "text": "a b", **({"sampling": {"structuredOutput": {"jsonSchema": schema}}} if i < 3 else {})}
            for i in range(6)]
    path, job = make_job(file_place, file_place.write_jsonl("in.jsonl", rows),
                         model={"engine": "transformers", "name": str(wordpiece_model), "task": "chat",
                                "maxTokens": 4},
                         workers={"parallelism": 1, "backoffLimitPerIndex": 0})
    proc = subprocess.run([bij_bin("bij"), "run", str(path)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(3 error rows: 3 unsupported)" in proc.stderr
    assert proc.stderr.count("has no token that can start a JSON value") == 1, proc.stderr[-3000:]
