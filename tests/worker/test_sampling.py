"""Every field a request carries is honoured or refused: the request built per row (sampling.py, inputs.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bij.cli.validate import check_document
from bij.contract.sampling import NO_SAMPLING, Sampling
from bij.contract.spec import SpecError, job_to_dict, load_job, parse_job
from bij.engines.base import BASIC_SAMPLING, CHAT_TEMPLATE_FIELDS
from bij.worker.input_row import InputOptions
from bij.worker.inputs import parse_line, parse_plain_lines
from bij.worker.main import engine_config

TRANSFORMERS = BASIC_SAMPLING | {"topP", "topK", "minP", "repetitionPenalty", "stop"}
ECHO_CHAT = InputOptions(format="openai", task="chat", engine="echo", honours=BASIC_SAMPLING)
HF_CHAT = InputOptions(format="openai", task="chat", engine="transformers", honours=TRANSFORMERS)
HF_PLAIN = InputOptions(task="generate", engine="transformers", honours=TRANSFORMERS)


def parse(obj: Any, opts: InputOptions) -> Any:
    line = json.dumps(obj).encode()
    return parse_line(line, (0, 0, len(line)), "in.jsonl", opts)


def chat(**body: Any) -> dict[str, Any]:
    return {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], **body}}


def test_openai_sampling_fields_reach_the_request() -> None:
    row = parse(chat(top_p=0.9, top_k=5, min_p=0.1, stop=["\n", "END"], repetition_penalty=1.2, temperature=0.7,
                     max_completion_tokens=12, seed=3), HF_CHAT)
    assert row.error is None
    req = row.request
    assert (req.max_tokens, req.temperature, req.seed) == (12, 0.7, 3)
    s = req.sampling
    assert (s.top_p, s.top_k, s.min_p, s.stop, s.repetition_penalty) == (0.9, 5, 0.1, ("\n", "END"), 1.2)


def test_a_field_the_engine_cannot_honour_is_an_unsupported_row_naming_engine_and_field() -> None:
    row = parse(chat(top_p=0.5, presence_penalty=0.3), ECHO_CHAT)
    assert row.request is None and row.error_code == "unsupported"
    assert row.error == "engine echo cannot honour body.presence_penalty, body.top_p"
    row = parse(chat(presence_penalty=0.3, n=2), HF_CHAT)
    assert row.error_code == "unsupported"
    assert row.error == "engine transformers cannot honour body.n, body.presence_penalty"


def test_an_unknown_field_is_an_invalid_request_row_naming_it() -> None:
    row = parse(chat(top_q=0.5), HF_CHAT)
    assert row.request is None and row.error_code == "invalid_request"
    assert "unknown field 'body.top_q'" in str(row.error)
    row = parse({"id": 1, "text": "x", "sampling": {"topP": 0.5, "temprature": 1}}, HF_PLAIN)
    assert row.error_code == "invalid_request" and "unknown field 'sampling.temprature'" in str(row.error)


def test_known_openai_fields_that_no_engine_honours_are_refused_not_dropped() -> None:
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    for body in ({"response_format": schema}, {"logit_bias": {"50256": -100}}, {"stream": True},
                 {"tools": [{"type": "function", "function": {"name": "f"}}]}):
        row = parse(chat(**body), HF_CHAT)
        assert row.error_code == "unsupported", body
        assert f"body.{next(iter(body))}" in str(row.error)


def test_neutral_values_ask_for_nothing() -> None:
    """What OpenAI clients often send explicitly: n 1, top_p 1, no penalties, the text format."""
    row = parse(chat(n=1, top_p=1, presence_penalty=0, frequency_penalty=0, logprobs=False, stop=None,
                     response_format={"type": "text"}, stream=False, user="u-1"), ECHO_CHAT)
    assert row.error is None and row.request is not None


def test_bad_values_name_the_field() -> None:
    for body, needle in (({"top_p": 0}, "body.top_p must be in (0"), ({"n": 0}, "body.n must be an integer from 1"),
                         ({"stop": [""]}, "body.stop must be"),
                         ({"temperature": "hot"}, "body.temperature must be a number"),
                         ({"max_tokens": 0}, "body.max_tokens must be an integer at least 1"),
                         ({"top_logprobs": 2}, "body.top_logprobs needs body.logprobs true")):
        row = parse(chat(**body), HF_CHAT)
        assert row.error_code == "invalid_request" and needle in str(row.error), (body, row.error)


def test_an_image_part_on_a_text_only_engine_is_unsupported() -> None:
    msgs = [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                         {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    row = parse(chat(messages=msgs), HF_CHAT)
    assert row.error_code == "unsupported" and "an image_url content part" in str(row.error)
    audio = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]
    row = parse(chat(messages=audio), HF_CHAT)
    assert row.error_code == "unsupported" and "'input_audio'" in str(row.error)


def test_completions_logprobs_is_a_count_of_top_tokens() -> None:
    opts = InputOptions(format="openai", task="generate", engine="vllm",
                        honours=TRANSFORMERS | {"logprobs", "topLogprobs"})
    row = parse({"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "p", "logprobs": 3}}, opts)
    assert row.request.sampling.logprobs is True and row.request.sampling.top_logprobs == 3


def test_embedding_rows_take_no_sampling_fields() -> None:
    opts = InputOptions(format="openai", task="embed", engine="sentence-transformers", honours=frozenset())
    row = parse({"custom_id": "e", "url": "/v1/embeddings", "body": {"input": "x", "model": "m"}}, opts)
    assert row.error is None
    row = parse({"custom_id": "e", "url": "/v1/embeddings", "body": {"input": "x", "temperature": 0.5}}, opts)
    assert row.error_code == "invalid_request" and "body.temperature" in str(row.error)
    row = parse({"custom_id": "e", "url": "/v1/embeddings", "body": {"input": "x", "dimensions": 64}}, opts)
    assert row.error_code == "unsupported" and "body.dimensions" in str(row.error)
    plain = InputOptions(task="embed", engine="sentence-transformers", honours=frozenset())
    row = parse({"id": 1, "text": "x", "sampling": {"maxTokens": 5}}, plain)
    assert row.error == "engine sentence-transformers cannot honour sampling.maxTokens"


def test_the_sampling_column_wins_over_the_spec_defaults() -> None:
    opts = InputOptions(task="generate", engine="transformers", honours=TRANSFORMERS, max_tokens=32,
                        sampling=Sampling(max_tokens=32, temperature=0.0, seed=0, top_p=0.8, stop=("x",)))
    row = parse({"id": 1, "text": "go", "sampling": {"temperature": 0.9, "topK": 4, "stop": "END",
                                                     "topP": None}}, opts)
    assert row.error is None
    req = row.request
    assert (req.max_tokens, req.temperature) == (32, 0.9)
    assert (req.sampling.top_p, req.sampling.top_k, req.sampling.stop) == (0.8, 4, ("END",))
    plain = parse({"id": 2, "text": "go"}, opts)
    assert plain.request.sampling is opts.sampling


def test_a_chunk_with_sampling_columns_leaves_the_one_pass_parser() -> None:
    lines = [b'{"id": 1, "text": "a"}', b'{"id": 2, "text": "b", "sampling": {"topP": 0.5}}']
    assert parse_plain_lines(lines, HF_PLAIN) is None
    ids, requests, _ = parse_plain_lines(lines[:1], HF_PLAIN)  # type: ignore[misc]
    assert ids == [1] and requests[0].sampling is NO_SAMPLING


def _spec(model: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "batchinference.io/v1alpha1", "kind": "BatchInferenceJob", "metadata": {"name": "s"},
            "spec": {"input": {"uri": "file:///in/"}, "output": {"uri": "file:///out/"}, "model": model}}


def test_spec_sampling_defaults_resolve_under_the_older_fields(tmp_path: Any) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps(_spec({"engine": "transformers", "name": "/m", "task": "generate", "seed": 7,
                                      "sampling": {"topP": 0.9, "stop": ["END"], "maxTokens": 9}})))
    model = load_job(path).spec.model
    s = model.resolved_sampling()
    assert (s.max_tokens, s.temperature, s.seed, s.top_p, s.stop) == (9, 0.0, 7, 0.9, ("END",))
    assert model.own_sampling().asked() == frozenset({"topP", "stop", "maxTokens"})


@pytest.mark.parametrize("model, needle", [
    ({"task": "generate", "maxTokens": 5, "sampling": {"maxTokens": 9}},
     "model.maxTokens and model.sampling.maxTokens both set"),
    ({"task": "embed", "sampling": {"topP": 0.5}}, "model.sampling.topP has no meaning for task embed"),
    ({"task": "generate", "sampling": {"topP": 0}}, "topP"),
    ({"task": "generate", "sampling": {"topLogprobs": 2}}, "topLogprobs needs logprobs"),
])
def test_spec_sampling_problems_name_the_fields(tmp_path: Any, model: dict[str, Any], needle: str) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps(_spec(model)))
    with pytest.raises(SpecError, match="sampling") as e:
        load_job(path)
    assert needle in str(e.value)


def test_a_job_answers_what_it_can_and_refuses_the_rest_in_input_order(file_place, make_job, run_shards,
                                                                         read_output) -> None:
    from bij.local.publish import publish_manifest

    def line(cid: str, **body: Any) -> dict[str, Any]:
        return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "m", "messages": [{"role": "user", "content": f"text of {cid}"}], **body}}

    lines = [line("plain"), line("nucleus", top_p=0.5), line("neutral", n=1, top_p=1.0), line("typo", temprature=1),
             line("seeded", seed=4, temperature=0.3)]
    _, job = make_job(file_place, file_place.write_jsonl("batch.jsonl", lines),
                      input={"format": "openai"}, model={"task": "chat"})
    run_shards(job)
    publish_manifest(job)
    out = read_output(job)
    assert [(r["custom_id"], r["response"]["body"]["choices"][0]["message"]["content"]) for r in out.results] == [
        ("plain", "text of plain"), ("neutral", "text of neutral"), ("seeded", "text of seeded")]
    assert [(e["custom_id"], e["error"]["code"]) for e in out.errors] == [
        ("nucleus", "unsupported"), ("typo", "invalid_request")]
    assert out.errors[0]["error"]["message"] == "engine echo cannot honour body.top_p"


@pytest.mark.parametrize(("model", "named"), [
    ({"sampling": {"topP": 0.5, "stop": ["."]}}, "spec.model.sampling.stop, spec.model.sampling.topP"),
    ({"structuredOutput": {"regex": "[a-z]+"}}, "spec.model.structuredOutput"),
], ids=["sampling", "structured-output"])
def test_spec_sampling_the_engine_cannot_honour_fails_the_job_at_start(model: dict[str, Any], named: str,
                                                                      file_place, make_job, bij_bin) -> None:
    import subprocess

    path, _ = make_job(file_place, file_place.write_jsonl("in.jsonl", [{"id": 1, "text": "x"}]),
                       model={"task": "generate", **model})
    proc = subprocess.run([bij_bin("bij"), "run", str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 42, proc.stderr
    assert f"engine echo cannot honour {named}" in proc.stderr


def _answers() -> Any:
    from bij.engines.base import Choice, Result, TokenLogprob

    lps = [TokenLogprob("Hel", -0.1, (("Hel", -0.1), ("He", -2.5))), TokenLogprob("lo", -0.3, (("lo", -0.3),))]
    choices = [Choice("Hello", 2, "stop", lps), Choice("Hi", 1, "length", lps[:1])]
    return Result(output="Hello", prompt_tokens=4, completion_tokens=3, choices=choices)


@pytest.mark.parametrize("url", ["/v1/chat/completions", "/v1/completions"])
def test_n_answers_and_logprobs_come_out_in_openai_shapes_the_sdk_parses(url: str) -> None:
    openai_types = pytest.importorskip("openai.types")
    from openai.types.chat import ChatCompletion

    from bij.worker.input_row import Row
    from bij.worker.result_rows import result_row

    kind = "chat" if "chat" in url else "generate"
    opts = InputOptions(format="openai", task=kind)
    line = result_row(Row(at=(0, 0, 1), id="r", url=url), _answers(), opts)
    body = line["response"]["body"]
    if kind == "chat":
        parsed: Any = ChatCompletion.model_validate(body)
        assert [c.message.content for c in parsed.choices] == ["Hello", "Hi"]
        first = parsed.choices[0].logprobs.content
        assert [(t.token, t.logprob, [a.token for a in t.top_logprobs]) for t in first] == [
            ("Hel", -0.1, ["Hel", "He"]), ("lo", -0.3, ["lo"])]
    else:
        parsed = openai_types.Completion.model_validate(body)
        assert [c.text for c in parsed.choices] == ["Hello", "Hi"]
        lp = parsed.choices[0].logprobs
        assert (lp.tokens, lp.token_logprobs, lp.text_offset) == (["Hel", "lo"], [-0.1, -0.3], [0, 3])
        assert lp.top_logprobs == [{"Hel": -0.1, "He": -2.5}, {"lo": -0.3}]
    assert [c.finish_reason for c in parsed.choices] == ["stop", "length"]
    assert [c.index for c in parsed.choices] == [0, 1]
    assert (parsed.usage.completion_tokens, parsed.usage.total_tokens) == (3, 7)  # every choice counts


def test_n_answers_in_plain_rows_survive_parquet() -> None:
    from bij.storage.parquet import results_table, table_rows
    from bij.worker.result_rows import plain_result

    rows = [plain_result(1, _answers()), {"id": 2, "output": "plain", "usage": {
        "prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}]
    assert rows[0]["output"] == "Hello" and [c["output"] for c in rows[0]["choices"]] == ["Hello", "Hi"]
    assert rows[0]["choices"][1]["logprobs"][0]["top_logprobs"][0] == {"token": "Hel", "logprob": -0.1}
    assert list(table_rows(results_table(rows, "generate", "int", False))) == rows


@pytest.mark.parametrize(("field", "value"), [("seed", 2**70), ("seed", -(2**64)), ("maxTokens", 10**30),
                                              ("topK", 2**64)])
def test_an_integer_beyond_64_bits_is_refused_alike_whichever_json_parser_read_the_line(field: str, value: int) -> None:
    """orjson reads such an integer as a float; a line it refuses (a NaN elsewhere) is read by the
    standard library, as an exact int: both lines are the same invalid_request naming the field."""
    body = f'{{"id": 1, "text": "x", "sampling": {{"{field}": {value}}}'
    plain = parse_line(f"{body}}}".encode(), (0, 0, 1), "in.jsonl", HF_PLAIN)
    with_nan = parse_line(f'{body}, "note": NaN}}'.encode(), (0, 0, 1), "in.jsonl", HF_PLAIN)
    for row in (plain, with_nan):
        assert row.request is None and row.error_code == "invalid_request", row
        assert f"sampling.{field} must be an integer from" in str(row.error)


def test_a_row_over_its_budget_is_refused_before_it_runs_naming_its_fields() -> None:
    """n x maxTokens x (1 + topLogprobs) within model.rowBudget: the row of 128 answers of 10**9 tokens
    with 20 top logprobs each never reaches an engine; a row within the budget does."""
    honours = TRANSFORMERS | {"n", "logprobs", "topLogprobs"}
    ALL = InputOptions(task="generate", engine="transformers", honours=honours)
    huge = {"n": 128, "maxTokens": 10**9, "logprobs": True, "topLogprobs": 20}
    row = parse({"id": 1, "text": "x", "sampling": huge}, ALL)
    assert row.request is None and row.error_code == "invalid_request"
    assert row.error == (f"this row costs n 128 x maxTokens {10**9} x 1 + topLogprobs 20 = {128 * 10**9 * 21} "
                         "generated token places, over model.rowBudget (1048576)")
    fits = parse({"id": 2, "text": "x", "sampling": {"n": 4, "maxTokens": 4096, "logprobs": True,
                                                      "topLogprobs": 5}}, ALL)
    assert fits.request is not None
    small = InputOptions(task="generate", engine="transformers", honours=honours, row_budget=100)
    row = parse({"id": 3, "text": "x", "sampling": {"maxTokens": 101}}, small)
    assert row.error_code == "invalid_request" and "maxTokens 101 = 101" in str(row.error)
    # A chunk of plain rows whose spec defaults are over the budget is refused row by row too.
    over = InputOptions(task="generate", engine="transformers", honours=honours, row_budget=100,
                        max_tokens=200)
    assert parse_plain_lines([b'{"id": 1, "text": "x"}'], over) is None


# --- vLLM's own fields: min_tokens, ignore_eos, logit_bias, bad_words, the chat template's --------------

VLLM_GENERATION = BASIC_SAMPLING | {"minTokens", "ignoreEos", "logitBias", "badWords"}
VLLM_CHAT = InputOptions(format="openai", task="chat", engine="vllm", honours=VLLM_GENERATION | CHAT_TEMPLATE_FIELDS)


def completion(**body: Any) -> dict[str, Any]:
    return {"custom_id": "c1", "method": "POST", "url": "/v1/completions", "body": {"model": "m", "prompt": "p",
                                                                                    **body}}


def test_vllms_extra_fields_reach_the_request() -> None:
    row = parse(chat(min_tokens=2, ignore_eos=True, logit_bias={"12": 5, "3": -100.0}, bad_words=["no", "never"],
                     chat_template_kwargs={"enable_thinking": False}, max_tokens=9), VLLM_CHAT)
    assert row.error is None, row.error
    s = row.request.sampling
    assert (s.min_tokens, s.ignore_eos, s.logit_bias, s.bad_words) == (2, True, ((3, -100.0), (12, 5.0)),
                                                                       ("no", "never"))
    assert json.loads(s.chat_template_kwargs) == {"enable_thinking": False}
    assert s.add_generation_prompt is None and s.continue_final_message is None
    # A prefill: the last (assistant) message is continued, so no new generation prompt follows it.
    row = parse(chat(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure,"}],
                     continue_final_message=True), VLLM_CHAT)
    assert (row.request.sampling.continue_final_message, row.request.sampling.add_generation_prompt) == (True, False)
    # Plain rows set the same fields in their sampling column.
    plain = InputOptions(task="generate", engine="vllm", honours=VLLM_GENERATION)
    row = parse({"id": 1, "text": "go", "sampling": {"minTokens": 3, "ignoreEos": True, "badWords": ["x"]}}, plain)
    assert row.error is None and (row.request.sampling.min_tokens, row.request.sampling.bad_words) == (3, ("x",))


def test_engines_that_cannot_honour_vllms_fields_refuse_the_row_naming_them() -> None:
    row = parse(chat(min_tokens=2, bad_words=["no"], logit_bias={"5": 1}), HF_CHAT)
    assert row.request is None and row.error_code == "unsupported"
    assert row.error == "engine transformers cannot honour body.bad_words, body.logit_bias, body.min_tokens"
    row = parse(chat(messages=[{"role": "assistant", "content": "Sure,"}], continue_final_message=True), ECHO_CHAT)
    assert row.error == "engine echo cannot honour body.continue_final_message"
    row = parse(chat(chat_template_kwargs={"x": 1}, ignore_eos=True), ECHO_CHAT)
    assert row.error == "engine echo cannot honour body.chat_template_kwargs, body.ignore_eos"


def test_vllms_fields_at_their_neutral_values_ask_for_nothing() -> None:
    row = parse(chat(min_tokens=0, ignore_eos=False, logit_bias={}, bad_words=[], chat_template_kwargs={},
                     add_generation_prompt=True, continue_final_message=False), ECHO_CHAT)
    assert row.error is None and row.request is not None


def test_bad_values_of_vllms_fields_name_the_field() -> None:
    for body, needle in (
            ({"logit_bias": {"the": 1}}, "body.logit_bias: key 'the' is not a token id"),
            ({"logit_bias": {"5": 101}}, "body.logit_bias['5'] must be in [-100"),
            ({"logit_bias": [5]}, "body.logit_bias must be an object"),
            ({"bad_words": [""]}, "body.bad_words must be a list of non-blank strings"),
            ({"bad_words": "no"}, "body.bad_words must be a list"),
            ({"min_tokens": -1}, "body.min_tokens must be an integer at least 0"),
            ({"min_tokens": 10, "max_tokens": 4}, "minTokens 10 is over maxTokens 4"),
            ({"ignore_eos": 1}, "body.ignore_eos must be true or false"),
            ({"chat_template_kwargs": ["x"]}, "body.chat_template_kwargs must be an object"),
            ({"chat_template_kwargs": {"tokenize": True}}, "body.chat_template_kwargs.tokenize is not a chat template"),
            ({"continue_final_message": True, "add_generation_prompt": True},
             "body.continue_final_message and body.add_generation_prompt cannot both be true")):
        row = parse(chat(**body), VLLM_CHAT)
        assert row.error_code == "invalid_request" and needle in str(row.error), (body, row.error)


def test_chat_template_fields_belong_to_chat_lines_only() -> None:
    opts = InputOptions(format="openai", task="generate", engine="vllm", honours=VLLM_GENERATION)
    row = parse(completion(continue_final_message=True), opts)
    assert row.error_code == "invalid_request" and "unknown field 'body.continue_final_message'" in str(row.error)
    row = parse(completion(min_tokens=1, ignore_eos=True), opts)
    assert row.error is None and row.request.sampling.ignore_eos is True


# --- several prompts in one line, token ids, dimensions, encoding_format ----------------------------------

ECHO_GENERATE = InputOptions(format="openai", task="generate", engine="echo", honours=BASIC_SAMPLING)


def test_a_list_prompt_is_one_row_with_a_request_per_prompt() -> None:
    row = parse(completion(prompt=["one", "two three"], max_tokens=5), ECHO_GENERATE)
    assert row.error is None and row.request is row.parts[0]
    assert [(r.text, r.max_tokens) for r in row.parts] == [("one", 5), ("two three", 5)]
    single = parse(completion(prompt=["one"]), ECHO_GENERATE)
    assert single.parts is None and single.request.text == "one"


def test_token_id_prompts_need_an_engine_that_takes_them() -> None:
    row = parse(completion(prompt=[[5, 6], [7]]), ECHO_GENERATE)
    assert row.error_code == "unsupported" and row.error == "engine echo cannot honour body.prompt as token ids"
    opts = InputOptions(format="openai", task="generate", engine="vllm", honours=BASIC_SAMPLING | {"tokenIds"})
    row = parse(completion(prompt=[5, 6]), opts)
    assert row.error is None and row.parts is None and (row.request.text, row.request.token_ids) == (None, [5, 6])
    row = parse(completion(prompt=[[5, 6], "seven"]), opts)
    assert [(r.text, r.token_ids) for r in row.parts] == [(None, [5, 6]), ("seven", None)]


@pytest.mark.parametrize(("prompt", "needle"), [
    ([], "body.prompt must be a non-empty string, a list of them, a list of token ids, or a list of such lists"),
    ("  ", "body.prompt must be a non-empty string"),
    (["a", " "], "body.prompt[1] must be a non-empty string"),
    (["a", 5], "body.prompt[1] must be a non-empty string or a non-empty list of token ids"),
    ([[1], []], "body.prompt[1] must be a non-empty string or a non-empty list of token ids"),
    ([-1], "body.prompt[0] must be a non-empty string or a non-empty list of token ids"),
    ([True], "body.prompt[0] must be"),
    (["x"] * 2049, "body.prompt holds 2049 prompts, more than 2048"),
], ids=["empty", "blank", "blank-item", "mixed", "empty-ids", "negative-id", "bool", "too-many"])
def test_malformed_prompt_lists_are_refused_naming_the_place(prompt: Any, needle: str) -> None:
    row = parse(completion(prompt=prompt), ECHO_GENERATE)
    assert row.error_code == "invalid_request" and needle in str(row.error), row.error


def test_the_row_budget_counts_every_prompt_of_a_row() -> None:
    opts = InputOptions(format="openai", task="generate", engine="echo", honours=BASIC_SAMPLING, row_budget=100)
    assert parse(completion(prompt=["a", "b"], max_tokens=50), opts).error is None
    row = parse(completion(prompt=["a", "b", "c"], max_tokens=50), opts)
    assert row.error_code == "invalid_request"
    assert "this row costs prompts 3 x maxTokens 50 = 150 generated token places" in str(row.error)


def test_embedding_lines_take_dimensions_where_the_model_allows_and_an_encoding_format() -> None:
    def embed(**body: Any) -> dict[str, Any]:
        return {"custom_id": "e", "url": "/v1/embeddings", "body": {"input": "x", **body}}

    matryoshka = InputOptions(format="openai", task="embed", engine="vllm", honours=frozenset({"dimensions"}))
    row = parse(embed(dimensions=64, encoding_format="base64", input=["a", "b"]), matryoshka)
    assert row.error is None and row.encoding == "base64"
    assert [(r.text, r.sampling.dimensions) for r in row.parts] == [("a", 64), ("b", 64)]
    other = InputOptions(format="openai", task="embed", engine="sentence-transformers", honours=frozenset())
    row = parse(embed(dimensions=64), other)
    assert row.error_code == "unsupported" and row.error == "engine sentence-transformers cannot honour body.dimensions"
    assert parse(embed(encoding_format="float", dimensions=None), other).error is None
    for body, needle in (({"encoding_format": "int8"}, "body.encoding_format must be float or base64"),
                         ({"dimensions": 0}, "body.dimensions must be an integer at least 1"),
                         ({"min_tokens": 1}, "unknown field 'body.min_tokens'")):
        row = parse(embed(**body), matryoshka)
        assert row.error_code == "invalid_request" and needle in str(row.error), row.error


def _stored(model: dict[str, Any]) -> Any:
    """The job the operator reads: the document with the CRD's defaults applied as the API server does."""
    verdicts = check_document(_spec(model))
    assert verdicts.schema == [] and verdicts.stored is not None
    return verdicts


def _request(job_spec: Any) -> Any:
    opts = InputOptions.from_spec(job_spec, honours=TRANSFORMERS)
    row = parse({"id": 1, "text": "go"}, opts)
    assert row.error is None
    return row.request


def test_model_sampling_basics_alone_pass_after_the_crds_defaults_and_reach_every_row() -> None:
    verdicts = _stored({"task": "generate", "sampling": {"temperature": 0.7, "maxTokens": 10, "seed": 3}})
    assert verdicts.model == verdicts.model_stored == []
    job = parse_job(verdicts.stored)
    for spec in (job.spec, parse_job(job_to_dict(job)).spec):  # as stored, and as a round plan carries it
        req = _request(spec)
        assert (req.max_tokens, req.temperature, req.seed) == (10, 0.7, 3)
        assert engine_config(spec).seed == 3  # the engine's own seed follows the rows'


def test_a_spec_setting_no_sampling_runs_rows_with_256_tokens_greedy_and_seed_0() -> None:
    verdicts = _stored({"task": "generate"})
    assert verdicts.model == verdicts.model_stored == []
    job = parse_job(verdicts.stored)
    req = _request(job.spec)
    assert (req.max_tokens, req.temperature, req.seed) == (256, 0.0, 0)
    cfg = engine_config(job.spec)
    assert (cfg.max_tokens, cfg.temperature, cfg.seed) == (256, 0.0, 0)


@pytest.mark.parametrize("model, needle", [
    ({"temperature": 0.2, "sampling": {"temperature": 0.7}}, "model.temperature and model.sampling.temperature"),
    # Set to the value a spec that sets neither runs with: still set, still ambiguous.
    ({"temperature": 0, "sampling": {"temperature": 0.7}}, "model.temperature and model.sampling.temperature"),
    ({"seed": 0, "sampling": {"seed": 3}}, "model.seed and model.sampling.seed"),
])
def test_a_field_set_both_in_model_and_model_sampling_is_refused_after_the_crds_defaults(
        model: dict[str, Any], needle: str) -> None:
    verdicts = _stored({"task": "generate", **model})
    for problems in (verdicts.model, verdicts.model_stored):
        assert any(f"{needle} both set: set one" in p for p in problems), problems
