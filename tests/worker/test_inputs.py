"""Input rows: every bad row becomes an error row with its reason and place, and the job goes on."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bij.contract.result_rows import id_key
from bij.engines.echo import echo_embedding
from bij.local.publish import publish_manifest
from bij.steps.planner import plan_round
from bij.worker.input_row import InputOptions
from bij.worker.inputs import parse_line

AT = (0, 120, 140)
PLAIN = InputOptions(task="generate")


def parse(line: Any, opts: InputOptions = PLAIN) -> Any:
    raw = line if isinstance(line, bytes) else json.dumps(line).encode()
    return parse_line(raw, AT, "in/a.jsonl", opts)


@pytest.mark.parametrize("line,code,message", [
    (b'{"id": 1, "text": "unterminated', "invalid_json", "not valid JSON"),
    (b"\xff\xfe", "invalid_json", "not valid JSON"),
    ([1, 2], "invalid_row", "JSON object, got list"),
    ("just a string", "invalid_row", "JSON object, got str"),
    (7, "invalid_row", "JSON object, got int"),
    ({"id": 1}, "missing_text", "no field 'text'"),
    ({"id": 1, "text": 5}, "invalid_text", "must be a string, got int"),
    ({"id": 1, "text": ["a"]}, "invalid_text", "must be a string, got list"),
    ({"id": 1, "text": ""}, "empty_text", "is empty"),
    ({"id": 1, "text": " \n\t"}, "empty_text", "is empty"),
    ({"id": True, "text": "a"}, "invalid_id", "non-empty string or an integer, got true"),
    ({"id": 1.5, "text": "a"}, "invalid_id", "got 1.5"),
    ({"id": [1], "text": "a"}, "invalid_id", "got [1]"),
    ({"id": {"a": 1}, "text": "a"}, "invalid_id", "got {"),
    ({"id": "", "text": "a"}, "invalid_id", 'got ""'),
])
def test_a_bad_plain_row_becomes_an_error_with_its_reason(line, code, message):
    row = parse(line)
    assert row.request is None and row.error_code == code and message in str(row.error)
    assert row.at == AT


@pytest.mark.parametrize("body,code,message", [
    ({"url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "hi"}]}},
     "invalid_id", "custom_id must be a non-empty string"),
    ({"custom_id": 5, "url": "/v1/chat/completions", "body": {}}, "invalid_id", "custom_id"),
    ({"custom_id": "a", "url": "/v1/images", "body": {}}, "invalid_request", "url must be one of"),
    ({"custom_id": "a", "url": "/v1/embeddings", "body": {"input": "x"}}, "invalid_request",
     "url /v1/embeddings needs model.task embed, the job runs chat"),
    ({"custom_id": "a", "url": "/v1/chat/completions", "body": "hi"}, "invalid_request", "body must be an object"),
    ({"custom_id": "a", "url": "/v1/chat/completions", "body": {"messages": []}}, "invalid_request",
     "body.messages must be a non-empty list"),
    ({"custom_id": "a", "url": "/v1/chat/completions", "body": {"messages": [{"content": "x"}]}},
     "invalid_request", "message 0 must be an object with a string role"),
    ({"custom_id": "a", "url": "/v1/chat/completions", "method": "GET", "body": {}}, "invalid_request",
     "method must be POST"),
    ({"custom_id": "a", "url": "/v1/chat/completions",
      "body": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}}, "invalid_request",
     "body.max_tokens must be an integer at least 1, got 0"),
    ({"custom_id": "a", "url": "/v1/chat/completions",
      "body": {"messages": [{"role": "user", "content": "x"}], "temperature": 3}}, "invalid_request",
     "body.temperature must be in [0, 2], got 3"),
])
def test_a_bad_openai_request_becomes_an_error_with_its_reason(body, code, message):
    row = parse(body, InputOptions(format="openai", task="chat"))
    assert row.request is None and row.error_code == code and message in str(row.error)


def test_a_row_without_id_gets_a_stable_one_from_its_place():
    assert parse({"text": "a"}).id == "in/a.jsonl:120"
    assert parse({"id": None, "text": "a"}).id == "in/a.jsonl:120"
    assert parse({"text": "a"}).generated_id


def test_ids_come_back_exactly_as_given_and_1_is_not_1_as_a_string():
    assert parse({"id": 1, "text": "a"}).id == 1
    assert parse({"id": "1", "text": "a"}).id == "1"
    assert id_key(1) != id_key("1")
    assert parse({"doc": "x", "body": "b"}, InputOptions(id_field="doc", text_field="body")).id == "x"


def test_openai_requests_take_their_parameters_from_the_body():
    row = parse({"custom_id": "r1", "url": "/v1/completions",
                 "body": {"prompt": "say", "max_tokens": 7, "temperature": 0.5, "seed": 3}},
                InputOptions(format="openai", task="generate"))
    assert (row.id, row.request.text, row.request.max_tokens, row.request.temperature, row.request.seed) == \
        ("r1", "say", 7, 0.5, 3)


def offsets(lines: list[Any]) -> list[int]:
    out, off = [], 0
    for line in lines:
        out.append(off)
        off += len(line if isinstance(line, bytes) else (json.dumps(line) if not isinstance(line, str)
                                                          else line).encode()) + 1
    return out


def test_every_bad_row_kind_lands_in_an_error_file_with_its_place_and_the_job_goes_on(
        file_place, make_job, run_shards, read_output):
    lines: list[Any] = [
        {"id": "ok-1", "text": "first"},
        '{"id": "broken", "text": ',
        [1, 2, 3],
        {"id": "no-text"},
        {"id": "typed", "text": {"a": 1}},
        {"id": "blank", "text": "   "},
        {"id": False, "text": "bool id"},
        {"id": 2.5, "text": "float id"},
        {"id": ["x"], "text": "list id"},
        {"id": "long", "text": "w" * 400},
        {"id": "ok-1", "text": "same id again"},
        {"id": "ok-2", "text": "last"},
    ]
    want = {  # line number -> error code
        1: "invalid_json", 2: "invalid_row", 3: "missing_text", 4: "invalid_text", 5: "empty_text",
        6: "invalid_id", 7: "invalid_id", 8: "invalid_id", 9: "too_many_tokens", 10: "duplicate_id",
    }
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", lines),
                      model={"maxInputTokens": 50}, sharding={"chunkRows": 4})
    run_shards(job)
    publish_manifest(job)
    out = read_output(job)
    assert [(r["id"], r["output"]) for r in out.results] == [("ok-1", "first"), ("ok-2", "last")]
    where = offsets(lines)
    got = {where.index(e["offset"]): e for e in out.errors}
    assert {n: e["error"]["code"] for n, e in got.items()} == want
    assert all(e["object"] == "in.jsonl" and e["error"]["message"] for e in got.values())
    assert got[3]["id"] == "no-text" and got[1]["id"] is None and got[6]["id"] is None
    assert "400" not in got[9]["error"]["message"] and "at most 50" in got[9]["error"]["message"]
    assert out.manifest["counts"] == {**out.manifest["counts"], "rows": 2, "errors": 10, "inputRows": 12}


def test_an_id_repeated_across_shards_keeps_the_first_in_input_order(file_place, make_job, run_shards, read_output):
    a = [{"id": "dup", "text": "from a"}] + [{"id": f"a{i}", "text": f"a{i} " + "x" * 60} for i in range(30)]
    b = [{"id": f"b{i}", "text": f"b{i} " + "x" * 60} for i in range(30)] + [{"id": "dup", "text": "from b"}]
    file_place.write_jsonl("in/a.jsonl", a)
    file_place.write_jsonl("in/b.jsonl", b)
    _, job = make_job(file_place, file_place.uri("in/"), sharding={"targetShardBytes": 1024})
    shards = plan_round(job, 0).shard_count
    assert shards >= 4
    run_shards(job, indexes=list(reversed(range(shards))))  # the order shards finish in does not matter
    publish_manifest(job)
    out = read_output(job)
    assert out.result_ids == [r["id"] for r in a + b[:-1]]
    assert [r["output"] for r in out.results if r["id"] == "dup"] == ["from a"]
    [dup] = out.errors
    assert (dup["id"], dup["error"]["code"], dup["object"], dup["offset"]) == \
        ("dup", "duplicate_id", "b.jsonl", offsets(b)[-1])
    assert out.manifest["counts"]["duplicates"] == 1


def test_rows_without_id_get_the_same_generated_id_on_every_run(file_place, make_job, run_shards, read_output):
    lines = [{"text": "one"}, {"id": 9, "text": "nine"}, {"text": "three"}, "bad"]
    uri = file_place.write_jsonl("in/x.jsonl", lines)
    ids = []
    for out_dir in ("out1/", "out2/"):
        _, job = make_job(file_place, uri, out_dir=out_dir)
        run_shards(job)
        publish_manifest(job)
        out = read_output(job)
        ids.append((out.result_ids, [e["id"] for e in out.errors]))
    where = offsets(lines)
    assert ids[0] == ids[1] == ([f"x.jsonl:{where[0]}", 9, f"x.jsonl:{where[2]}"], [None])


def test_openai_batch_errors_carry_custom_id_and_place(file_place, make_job, run_shards, read_output):
    def chat(cid: Any, text: str) -> dict[str, Any]:
        return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "m", "messages": [{"role": "user", "content": text}]}}

    lines = [chat("c1", "hello"), {"method": "POST", "url": "/v1/chat/completions", "body": {}},
             {**chat("c2", "x"), "url": "/v1/nope"}, {**chat("c3", "x"), "url": "/v1/embeddings"},
             {**chat("c4", "x"), "body": [1]}, chat("c5", "bye")]
    _, job = make_job(file_place, file_place.write_jsonl("batch.jsonl", lines),
                      input={"format": "openai"}, model={"task": "chat"})
    run_shards(job)
    publish_manifest(job)
    out = read_output(job)
    assert out.result_ids == ["c1", "c5"]
    where = offsets(lines)
    assert [(e["custom_id"], e["error"]["code"], e["offset"], e["response"]) for e in out.errors] == [
        (None, "invalid_id", where[1], None), ("c2", "invalid_request", where[2], None),
        ("c3", "invalid_request", where[3], None), ("c4", "invalid_request", where[4], None)]


def test_embed_rows_get_the_echo_vector_of_their_text(file_place, make_job, run_shards, read_output):
    texts = ["alpha", "beta beta", "γάμμα"]
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", [{"id": t, "text": t} for t in texts]),
                      model={"task": "embed"})
    run_shards(job)
    publish_manifest(job)
    out = read_output(job)
    assert [(r["id"], r["embedding"]) for r in out.results] == [(t, echo_embedding(t)) for t in texts]


def test_a_lone_surrogate_escape_is_an_error_row_not_a_crash():
    row = parse(b'{"id": 7, "text": "half a pair: \\ud800 here"}')
    assert (row.error_code, row.id, row.request) == ("invalid_unicode", 7, None)
    assert "lone surrogate" in str(row.error)
    # The id itself may be the broken part: the place still says where the row is.
    assert parse(b'{"id": "\\udfff", "text": "a"}').id is None
    assert parse(b'{"id": 1, "text": "\\ud83d\\ude00 a whole pair is fine"}').request is not None


def test_lone_surrogates_and_overlong_lines_become_error_rows_and_the_job_goes_on(file_place, make_job, run_shards,
                                                                                  read_output):
    rows: list[Any] = [{"id": i, "text": f"row {i}"} for i in range(20)]
    rows[3] = '{"id": 3, "text": "\\ud800"}'
    rows[11] = json.dumps({"id": 11, "text": "x" * 5000})  # longer than maxLineBytes
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", rows), input={"maxLineBytes": 1024})
    run_shards(job)
    publish_manifest(job)
    out = read_output(job)
    assert out.result_ids == [i for i in range(20) if i not in (3, 11)]
    errors = {e["error"]["code"]: e for e in out.errors}
    assert set(errors) == {"invalid_unicode", "line_too_long"}
    assert errors["invalid_unicode"]["id"] == 3
    long = errors["line_too_long"]
    assert long["id"] is None and long["offset"] == sum(len(json.dumps(r) if isinstance(r, dict) else r) + 1
                                                        for r in rows[:11])
    assert f"{len(rows[11])} bytes, more than spec.input.maxLineBytes (1024)" in long["error"]["message"]


@pytest.mark.parametrize("damage", ["cut", "corrupt"])
def test_with_error_rows_a_cut_or_damaged_zst_object_ends_in_an_error_row_naming_it_never_quietly(
        place, make_job, run_shards, read_output, damage):
    # input.onDamagedObject errorRow; the default, fail, is in test_damaged_input.py.
    import zstandard

    rows = [{"id": i, "text": f"row {i} " + "z" * (i % 50)} for i in range(4000)]
    data = b"".join(json.dumps(r).encode() + b"\n" for r in rows)
    whole = zstandard.ZstdCompressor(level=1).compress(data)
    if damage == "cut":
        broken = whole[: len(whole) * 2 // 3]  # an upload cut short
    else:
        broken = bytearray(whole)
        broken[len(whole) // 2] ^= 0xFF
    place.storage.write_bytes(place.uri("in/b.jsonl.zst"), bytes(broken))
    place.write_jsonl("in/a.jsonl", [{"id": "a", "text": "a"}])
    _, job = make_job(place, place.uri("in/"), input={"onDamagedObject": "errorRow"},
                      sharding={"chunkRows": 100, "targetShardBytes": 1 << 20})
    run_shards(job)
    publish_manifest(job)
    out = read_output(job)
    (err,) = out.errors
    assert err["object"] == "b.jsonl.zst" and err["error"]["code"] == "corrupt_input"
    (damaged,) = out.manifest["damagedObjects"]
    assert (damaged["object"], damaged["offset"]) == ("b.jsonl.zst", err["offset"])
    assert f"at uncompressed byte {err['offset']}" in err["error"]["message"]
    # Every row before the break is a result; the error row stands where the readable part ends.
    good = [r for r in out.result_ids if r != "a"]
    assert good == list(range(len(good))) and len(good) < len(rows)
    assert damage == "corrupt" or len(good) > 0  # a cut keeps what came before it; damage may sit in block 1
    assert err["offset"] == sum(len(json.dumps(r)) + 1 for r in rows[: len(good)])
    assert out.manifest["counts"]["errors"] == 1


def test_a_zst_object_of_several_frames_is_read_to_its_end(file_place, make_job, run_shards, read_output):
    import zstandard

    rows = [{"id": i, "text": f"row {i}"} for i in range(30)]
    frames = b"".join(zstandard.ZstdCompressor().compress(b"".join(json.dumps(r).encode() + b"\n" for r in part))
                      for part in (rows[:10], rows[10:25], rows[25:]))  # `cat a.zst b.zst`, pzstd
    file_place.storage.write_bytes(file_place.uri("in.jsonl.zst"), frames)
    _, job = make_job(file_place, file_place.uri("in.jsonl.zst"))
    run_shards(job)
    publish_manifest(job)
    assert read_output(job).result_ids == list(range(30))


# Lines a chunk may hold: plain good rows (the one-pass parse takes them) and every kind of
# row that needs parse_line's closer look.
PLAIN_LINES = [b'{"id": 1, "text": "one"}', b'{"id": "a-2", "text": "two"}', b'{"id": 0, "text": "z"}',
               '{"id": "é", "text": "ünïcødé ✓ 🙂"}'.encode(), b'{"text": "x", "id": 9223372036854775807}',
               b'{"id": -3, "text": "neg", "other": [1, {"a": null}]}', b'{"id":"t","text":"\\u00e9\\n"}',
               b'{"id": 5, "lang": "de", "text": "five", "score": 0.5}',
               b'{"id": 6, "text": "big", "big": 1180591620717411303425, "n": {"x": [-9223372036854775809]}}']
OTHER_LINES = [b'{"text": "no id"}', b'{"id": null, "text": "null id"}', b'{"id": true, "text": "bool id"}',
               b'{"id": 1.5, "text": "float id"}', b'{"id": "", "text": "empty id"}',
               b'{"id": 123456789012345678901234567890, "text": "big id"}',
               b'{"id": 18446744073709551615, "text": "u64 id"}', b'{"id": 1, "text": ""}',
               b'{"id": 1, "text": " \\t"}', b'{"id": 1, "text": 5}', b'{"id": 1}', b'[1, 2]', b'"text"',
               b'not json', b'{"id": 1, "text": "lone \\ud800"}', b'{"id": 1, "text": NaN}',
               b'{"id": 1, "text": "t", "_bij": {"id": "kept", "attempts": 1}}',
               b'{"id": 1, "messages": [{"role": "user", "content": "hi"}], "text": "t"}',
               b'{"id": 1, "text": "t", "output": "a column named like a result field"}']


@pytest.mark.parametrize("opts", [PLAIN, InputOptions(task="embed"), InputOptions(task="chat"),
                                  InputOptions(task="chat", messages_field="messages"),
                                  InputOptions(task="generate", id_field="key", text_field="body"),
                                  InputOptions(task="generate", pass_through=("lang", "other")),
                                  InputOptions(task="generate", pass_through=())])
def test_a_chunk_parsed_in_one_pass_gives_what_parse_line_gives(opts):
    import random

    from bij.worker.inputs import parse_plain_lines

    def fields(line: bytes) -> bytes:  # the same rows under the job's field names
        return line.replace(b'"id"', b'"%s"' % opts.id_field.encode()).replace(
            b'"text"', b'"%s"' % opts.text_field.encode())

    rnd = random.Random(7)
    taken = 0
    for _ in range(300):
        lines = [fields(rnd.choice(PLAIN_LINES)) for _ in range(rnd.randint(1, 12))]
        other = rnd.random() < 0.5
        if other:
            lines.insert(rnd.randrange(len(lines) + 1), fields(rnd.choice(OTHER_LINES)))
        one_by_one = [parse_line(line, (0, i, i + 1), "in/a.jsonl", opts) for i, line in enumerate(lines)]
        got = parse_plain_lines(lines, opts)
        if got is None:  # parse_line takes the chunk, line by line: a plain chunk never goes that way
            assert other, lines
            continue
        taken += 1
        ids, requests, carried = got
        assert (carried or [{}] * len(ids)) == [r.carried or {} for r in one_by_one]  # pass-through columns
        assert all(r.request is not None and not r.generated_id and not r.prior_attempts for r in one_by_one)
        assert ids == [r.id for r in one_by_one]
        assert [type(i) for i in ids] == [type(r.id) for r in one_by_one]  # 1 and "1" stay apart
        assert requests == [r.request for r in one_by_one]
    assert taken > 100
    assert parse_plain_lines([], PLAIN) is None
    assert parse_plain_lines(PLAIN_LINES, InputOptions(format="openai", task="generate")) is None


def exactly(value: Any) -> str:
    """`value` as JSON text: 2**70 and the float 2**70 compare equal in Python, never as text."""
    return json.dumps(value, sort_keys=True)


def test_integers_beyond_64_bits_in_any_column_are_read_exactly_in_one_pass_and_line_by_line():
    from bij.worker.inputs import parse_plain_lines

    big = {"big": 2**70, "nested": {"x": [2**80, -(2**63) - 1]}}
    line = json.dumps({"id": 1, "text": "t", **big}).encode()
    assert exactly(parse(line).carried) == exactly(big)
    one_pass = parse_plain_lines([b'{"id": 0, "text": "z", "big": 1}', line], PLAIN)
    assert one_pass is not None and exactly(one_pass[2]) == exactly([{"big": 1}, big])


def test_a_carried_integer_a_parquet_result_cannot_hold_is_an_error_row_naming_its_column():
    from bij.worker.inputs import parse_plain_lines

    parquet = InputOptions(task="generate", int64_columns=True)
    row = parse({"id": 4, "text": "t", "ok": 2**63 - 1, "nested": {"x": [1, 2**80]}}, parquet)
    assert (row.id, row.request, row.error_code) == (4, None, "invalid_row")
    assert row.error.startswith("column 'nested' holds an integer beyond 64 bits (at nested.x[1]), which a Parquet "
                                "result (output.format: parquet) cannot hold")
    assert exactly(row.carried) == exactly({"ok": 2**63 - 1, "nested": {"x": [1, 2**80]}})  # kept on its error row
    assert parse({"id": 2**70, "text": "t", "ok": -(2**63)}, parquet).request is not None  # an id is kept as text
    assert parse_plain_lines([json.dumps({"id": 1, "text": "t", "n": 2**64}).encode()], parquet) is None


@pytest.mark.parametrize("bij", [{"attempts": "many"}, {"id": "g-30"}, {"id": "x", "attempts": 1, "verdicts": []},
                                 "text", None])
def test_a_users_own_bij_field_is_an_error_row_naming_it_and_never_read(bij):
    for line in ({"id": 7, "text": "t", "_bij": bij}, {"text": "t", "_bij": bij, "lang": "de"}):
        row = parse(line)
        assert row.request is None and row.error_code == "invalid_row"
        assert row.error.startswith("field '_bij' is reserved for bij's own bookkeeping of judge rounds")
        assert row.id == line.get("id", "in/a.jsonl:120") and row.prior_attempts == 0 and row.verdicts == []
    assert parse({"text": "t", "_bij": bij, "lang": "de"}).carried == {"lang": "de"}
    line = {"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "p"}, "_bij": bij}
    assert parse(line, InputOptions(format="openai", task="generate")).error_code == "invalid_row"


def test_a_judge_rounds_own_bij_field_gives_the_row_its_id_and_history_and_a_broken_one_an_error_row():
    later = InputOptions(task="generate", redispatched=True)
    row = parse({"text": "t", "_bij": {"id": "a.jsonl:0", "attempts": 2, "verdicts": ["no", "no"]}}, later)
    assert (row.id, row.generated_id, row.prior_attempts, row.verdicts) == ("a.jsonl:0", False, 2, ["no", "no"])
    assert parse({"id": 3, "text": "t", "_bij": {"id": 3, "attempts": 1}}, later).prior_attempts == 1
    for bij, message in [({"attempts": "many"}, "field '_bij'.attempts must be a non-negative integer, got \"many\""),
                         ({"attempts": -1}, "attempts must be a non-negative integer"),
                         ({"verdicts": "no"}, "field '_bij'.verdicts must be a list"),
                         ({"id": 1.5}, "field '_bij'.id must be a non-empty string or an integer"),
                         ([1], "field '_bij' must be an object, got list")]:
        row = parse({"id": 3, "text": "t", "_bij": bij}, later)
        assert (row.id, row.request, row.error_code) == (3, None, "invalid_row") and message in row.error, row.error
