"""The engines behind the one Engine interface: echo, sentence-transformers, transformers, vLLM.

Models are local: the packaged all-MiniLM-L6-v2, and tiny Llama models built here
(tiny_models.py; the "successor" model's greedy output is known in advance).
The vLLM adapter meets the real engine in test_vllm.py (the vLLM tier).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest

# Nothing here may reach a model hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from tiny_models import BOS, EOS, MAX_POSITIONS, VOCAB, build_model, chain_after  # noqa: E402

from bij.contract.sampling import Sampling  # noqa: E402
from bij.engines import create_engine  # noqa: E402
from bij.engines.base import EngineConfig, Request  # noqa: E402
from bij.engines.echo import ECHO_DIM, EchoEngine  # noqa: E402


@pytest.fixture(scope="module")
def wired_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("wired"))


@pytest.fixture(scope="module")
def random_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("random"), wired=False)


def loaded(engine: Any) -> Any:
    engine.load()
    return engine


# --- echo -----------------------------------------------------------------------------------


def test_echo_returns_each_rows_text_in_order() -> None:
    engine = loaded(EchoEngine(EngineConfig(task="generate")))
    texts = ["one", "two two", "three three three"]
    results = engine.run([Request(text=t) for t in texts])
    assert [r.output for r in results] == texts
    assert [r.prompt_tokens for r in results] == engine.count_tokens([Request(text=t) for t in texts])


def test_echo_embedding_is_a_stable_vector_of_the_text() -> None:
    engine = loaded(create_engine("echo", EngineConfig(task="embed")))
    a1, b, a2 = engine.run([Request(text="alpha"), Request(text="beta"), Request(text="alpha")])
    assert a1.embedding is not None and len(a1.embedding) == ECHO_DIM
    assert a1.embedding == a2.embedding != b.embedding


# --- sentence-transformers --------------------------------------------------------------------


@pytest.fixture(scope="module")
def minilm() -> Any:
    return loaded(create_engine("sentence-transformers", EngineConfig(task="embed", device="cpu")))


def cosine(u: list[float], v: list[float]) -> float:
    dot = sum(a * b for a, b in zip(u, v, strict=True))
    return dot / math.sqrt(sum(a * a for a in u) * sum(b * b for b in v))


def test_minilm_embeddings_are_384_dimensional_unit_vectors(minilm: Any) -> None:
    (res,) = minilm.run([Request(text="The cat sits on the mat.")])
    assert res.error is None and res.embedding is not None
    assert len(res.embedding) == 384
    assert all(type(x) is float for x in res.embedding)
    assert math.isclose(math.sqrt(sum(x * x for x in res.embedding)), 1.0, rel_tol=1e-4)


def test_minilm_paraphrases_are_closer_than_unrelated_text(minilm: Any) -> None:
    a, b, c = minilm.run([
        Request(text="How do I reset my password?"),
        Request(text="I forgot my password, how can I change it?"),
        Request(text="The stock market fell sharply on Tuesday."),
    ])
    assert cosine(a.embedding, b.embedding) > cosine(a.embedding, c.embedding) + 0.3


def test_minilm_batch_keeps_row_order(minilm: Any) -> None:
    texts = ["short", "a considerably longer sentence about trains and weather", "mid length text here"]
    batch = minilm.run([Request(text=t) for t in texts])
    for text, res in zip(texts, batch, strict=True):
        (alone,) = minilm.run([Request(text=text)])
        assert cosine(res.embedding, alone.embedding) > 0.9999


def test_minilm_counts_tokens_with_the_models_tokenizer(minilm: Any) -> None:
    texts = ["hello world", "Tokenization of unbelievably long words", ""]
    expected = [len(ids) for ids in minilm.tokenizer(texts)["input_ids"]]  # special tokens included
    assert expected[0] == 4  # [CLS] hello world [SEP]
    assert minilm.count_tokens([Request(text=t) for t in texts]) == expected
    assert [r.prompt_tokens for r in minilm.run([Request(text=t) for t in texts])] == expected


def test_minilm_row_over_max_seq_length_is_a_row_error(minilm: Any) -> None:
    assert minilm.max_input_tokens() == 256
    long, short = minilm.run([Request(text="word " * 300), Request(text="fine")])
    assert long.error is not None and "256" in long.error and long.embedding is None
    assert short.error is None and short.embedding is not None


def test_minilm_config_can_lower_the_input_limit() -> None:
    engine = loaded(create_engine("sentence-transformers", EngineConfig(task="embed", max_input_tokens=8)))
    assert engine.max_input_tokens() == 8
    over, ok = engine.run([Request(text="one two three four five six seven"), Request(text="one")])
    assert over.error is not None and ok.embedding is not None


def test_minilm_with_truncate_embeds_a_long_row_as_sentence_transformers_encode_does(minilm: Any) -> None:
    engine = loaded(create_engine("sentence-transformers", EngineConfig(task="embed", device="cpu", truncate=True)))
    text = " ".join(f"word{i}" for i in range(400))
    long, short = engine.run([Request(text=text), Request(text="fine")])
    assert long.error is None and long.prompt_tokens == 256
    # encode() of the plain model truncates to max_seq_length: the same vector.
    (reference,) = minilm.model.encode([text], convert_to_numpy=True).tolist()
    assert cosine(long.embedding, reference) > 0.9999
    (tail,) = minilm.run([Request(text=" ".join(f"word{i}" for i in range(350, 400)))])
    assert cosine(long.embedding, tail.embedding) < 0.99  # the head was kept, not the tail
    assert cosine(short.embedding, minilm.run([Request(text="fine")])[0].embedding) > 0.9999


def test_minilm_truncates_to_a_lowered_limit() -> None:
    cut = loaded(create_engine("sentence-transformers", EngineConfig(task="embed", max_input_tokens=4, truncate=True)))
    (res,) = cut.run([Request(text="alpha beta gamma delta epsilon")])
    (head,) = cut.run([Request(text="alpha beta")])  # [CLS] alpha beta [SEP] is 4 tokens
    assert res.prompt_tokens == 4 and res.embedding == head.embedding


def test_minilm_embeds_token_ids_as_the_text_they_tokenize_to(minilm: Any) -> None:
    """Token ids go to the model as they are, bypassing the tokenizer: the ids a text tokenizes to (its
    [CLS] and [SEP] included) embed as that text, alone or padded beside a longer row."""
    texts = ["The cat sits on the mat.", "A considerably longer sentence about trains, weather and tea."]
    ids = [minilm.tokenizer(t)["input_ids"] for t in texts]
    by_ids = minilm.run([Request(token_ids=i) for i in ids])
    by_text = minilm.run([Request(text=t) for t in texts])
    for a, b, i in zip(by_ids, by_text, ids, strict=True):
        assert a.error is None and a.prompt_tokens == len(i) == b.prompt_tokens
        assert a.embedding == pytest.approx(b.embedding, abs=1e-5)
    assert minilm.count_tokens([Request(token_ids=ids[0]), Request(text=texts[1])]) == [len(i) for i in ids]
    # Other ids, another embedding.
    (other,) = minilm.run([Request(token_ids=ids[0][:3] + ids[0][4:])])
    assert cosine(other.embedding, by_text[0].embedding) < 0.999


def test_token_ids_beyond_the_vocabulary_fail_their_row_alone_naming_it(minilm: Any) -> None:
    import json

    from bij.worker.input_row import InputOptions
    from bij.worker.inputs import parse_line
    from bij.worker.result_rows import merged_result, result_row

    opts = InputOptions(format="openai", task="embed", engine="sentence-transformers", honours=minilm.honours)

    def embed(cid: str, value: Any) -> tuple[Any, Any]:
        line = json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/embeddings",
                           "body": {"model": "m", "input": value}}).encode()
        row = parse_line(line, (0, 0, len(line)), "in.jsonl", opts)
        assert row.request is not None, row.error
        results = minilm.run(row.parts or [row.request])
        return row, merged_result(row, results) if row.parts else results[0]

    good = minilm.tokenizer("hello world")["input_ids"]
    row, res = embed("ids", [good, good[:2] + good[-1:]])
    assert res.error is None
    data = result_row(row, res, opts)["response"]["body"]["data"]
    assert [d["index"] for d in data] == [0, 1] and len(data[0]["embedding"]) == 384
    _, bad = embed("bad", [good, [101, 30522, 102]])
    assert bad.error == "body.input[1]: token id 30522 is outside the vocabulary of 30522 tokens"
    assert bad.extra["code"] == "invalid_request"
    _, alone = embed("alone", [101, 99999])
    assert alone.error == "token id 99999 is outside the vocabulary of 30522 tokens" and alone.embedding is None


def test_sentence_transformers_refuses_generate() -> None:
    with pytest.raises(ValueError, match="embed"):
        create_engine("sentence-transformers", EngineConfig(task="generate"))


# --- transformers ---------------------------------------------------------------------------


def tf_engine(path: Path, task: str = "generate", **kw: Any) -> Any:
    return loaded(create_engine("transformers", EngineConfig(task=task, name=str(path), device="cpu", **kw)))


def test_generate_continues_every_prompt_of_a_mixed_length_batch_in_order(wired_model: Path) -> None:
    engine = tf_engine(wired_model)
    prompts = ["a", "x y z c", "g", "h", "b c d e f"]
    results = engine.run([Request(text=p) for p in prompts])
    for prompt, res in zip(prompts, results, strict=True):
        words = chain_after(prompt.split()[-1])
        assert res.error is None
        assert res.output == " ".join(words), prompt
        assert res.prompt_tokens == len(prompt.split()) + 1  # + BOS
        assert res.completion_tokens == len(words) + 1  # + EOS
        assert res.extra["finish_reason"] == "stop"


def test_max_tokens_cuts_each_row_on_its_own(wired_model: Path) -> None:
    engine = tf_engine(wired_model)
    cut, full = engine.run([Request(text="a", max_tokens=2), Request(text="a", max_tokens=50)])
    assert (cut.output, cut.completion_tokens, cut.extra["finish_reason"]) == ("b c", 2, "length")
    assert (full.output, full.completion_tokens) == ("b c d e f g h", 8)


def test_transformers_counts_prompt_tokens_as_the_tokenizer_does(wired_model: Path) -> None:
    from transformers import AutoTokenizer

    engine = tf_engine(wired_model)
    texts = ["a b c", "x", "z y x w"]  # w is unknown: one <unk>
    expected = [len(ids) for ids in AutoTokenizer.from_pretrained(wired_model)(texts)["input_ids"]]
    assert expected == [4, 2, 5]
    assert engine.count_tokens([Request(text=t) for t in texts]) == expected


def test_chat_renders_the_template_once_with_a_single_bos(wired_model: Path) -> None:
    engine = tf_engine(wired_model, task="chat")
    req = Request(messages=[{"role": "user", "content": "a b"}])
    # <s> user : a b assistant :
    assert engine.count_tokens([req]) == [7]
    (res,) = engine.run([req])
    assert (res.output, res.prompt_tokens, res.completion_tokens) == ("f g h", 7, 4)


def test_chat_wraps_plain_text_as_one_user_message(wired_model: Path) -> None:
    engine = tf_engine(wired_model, task="chat")
    as_text, as_parts = engine.run([
        Request(text="a b"),
        Request(messages=[{"role": "user", "content": [{"type": "text", "text": "a b"}]}]),
    ])
    assert as_text.output == as_parts.output == "f g h"
    assert as_text.prompt_tokens == as_parts.prompt_tokens == 7


def test_chat_template_error_stays_with_its_row(wired_model: Path) -> None:
    engine = tf_engine(wired_model, task="chat")
    bad, good = engine.run([
        Request(messages=[{"role": "assistant", "content": "a"}]),
        Request(messages=[{"role": "user", "content": "c"}]),
    ])
    assert bad.error is not None and "assistant" in bad.error and bad.output is None
    assert good.output == "f g h"


def test_chat_without_a_template_fails_at_load(tmp_path: Path) -> None:
    path = build_model(tmp_path, chat_template=False)
    engine = create_engine("transformers", EngineConfig(task="chat", name=str(path), device="cpu"))
    with pytest.raises(ValueError, match="chat template"):
        engine.load()


def test_prompt_over_the_position_limit_is_a_row_error(wired_model: Path) -> None:
    engine = tf_engine(wired_model)
    assert engine.max_input_tokens() == MAX_POSITIONS
    long, ok = engine.run([Request(text="x " * MAX_POSITIONS), Request(text="g")])
    assert long.error is not None and long.prompt_tokens == MAX_POSITIONS + 1
    assert ok.output == "h"


def test_truncated_prompt_keeps_its_last_tokens(wired_model: Path) -> None:
    engine = tf_engine(wired_model, max_input_tokens=4, truncate=True)
    (res,) = engine.run([Request(text="x y z x y c", max_tokens=3)])
    # The tail "z x y c" (BOS cut off with the head) continues from c.
    assert (res.error, res.prompt_tokens, res.output) == (None, 4, "d e f")


def test_generation_stops_at_the_position_limit(wired_model: Path) -> None:
    engine = tf_engine(wired_model)
    (res,) = engine.run([Request(text=" ".join(["x"] * 60 + ["a"]), max_tokens=50)])
    # 62 prompt tokens leave room for 2 in a 64-position model.
    assert (res.output, res.completion_tokens, res.extra["finish_reason"]) == ("b c", 2, "length")


def test_learned_position_model_is_not_run_past_its_table(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    path = build_model(tmp_path)
    config = GPT2Config(vocab_size=len(VOCAB), n_positions=MAX_POSITIONS, n_embd=32, n_layer=1, n_head=2,
                        bos_token_id=BOS, eos_token_id=EOS)
    GPT2LMHeadModel(config).save_pretrained(path)  # replaces the Llama weights and config
    engine = tf_engine(path)
    (res,) = engine.run([Request(text=" ".join(["x"] * 60), max_tokens=50)])
    # GPT-2 has no position past 63: an unclamped generate would index out of its table.
    assert res.error is None and res.completion_tokens is not None and res.completion_tokens <= 3


def test_config_max_input_tokens_lowers_the_limit(wired_model: Path) -> None:
    engine = tf_engine(wired_model, max_input_tokens=3)
    assert engine.max_input_tokens() == 3
    over, ok = engine.run([Request(text="a b c"), Request(text="a b")])
    assert over.error is not None and ok.output == "c d e f g h"


def test_missing_pad_token_falls_back_to_eos(tmp_path: Path) -> None:
    engine = tf_engine(build_model(tmp_path, pad_token=False))
    assert engine.tokenizer.pad_token == "</s>"
    short, long = engine.run([Request(text="g"), Request(text="x y z a")])
    assert (short.output, short.completion_tokens) == ("h", 2)
    assert (long.output, long.completion_tokens) == ("b c d e f g h", 8)


def test_greedy_decoding_is_deterministic(random_model: Path) -> None:
    engine = tf_engine(random_model)
    reqs = [Request(text="a b c", max_tokens=12), Request(text="x", max_tokens=12)]
    first, second = engine.run(reqs), engine.run(reqs)
    assert [r.output for r in first] == [r.output for r in second]
    assert all(r.completion_tokens is not None and 1 <= r.completion_tokens <= 12 for r in first)


def test_sampling_repeats_with_the_same_seed_and_varies_with_another(random_model: Path) -> None:
    engine = tf_engine(random_model)

    def sample(seed: int) -> list[str | None]:
        reqs = [Request(text=t, max_tokens=16, temperature=1.0, seed=seed) for t in ("a", "b c", "x y z")]
        return [r.output for r in engine.run(reqs)]

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_transformers_stop_string_cuts_the_text_and_counts_the_tokens_to_it(wired_model: Path) -> None:
    engine = tf_engine(wired_model)
    stop = Sampling(stop=("d",))
    cut, two, never, plain = engine.run([
        Request(text="a", max_tokens=10, sampling=stop),
        Request(text="a", max_tokens=10, sampling=Sampling(stop=("z", "e f"))),
        Request(text="a", max_tokens=10, sampling=Sampling(stop=("x",))),
        Request(text="a", max_tokens=10),
    ])
    assert plain.output == "b c d e f g h"
    # a -> b c d: generation ends at the stop string, which is not part of the text.
    assert (cut.output, cut.completion_tokens, cut.extra["finish_reason"]) == ("b c ", 3, "stop")
    assert (two.output, two.completion_tokens) == ("b c d ", 5)
    assert (never.output, never.completion_tokens) == (plain.output, plain.completion_tokens)


def test_transformers_top_k_one_samples_the_greedy_answer(random_model: Path) -> None:
    engine = tf_engine(random_model)
    texts = ("a", "b c", "x y z")
    greedy = [r.output for r in engine.run([Request(text=t, max_tokens=16) for t in texts])]

    def sample(**knobs: Any) -> list[str | None]:
        reqs = [Request(text=t, max_tokens=16, temperature=1.5, seed=3, sampling=Sampling(**knobs)) for t in texts]
        return [r.output for r in engine.run(reqs)]

    assert sample() != greedy  # at temperature 1.5 the random model wanders off the greedy path
    assert sample(top_k=1) == greedy
    assert sample(top_p=1e-6) == greedy  # the nucleus holds only the most likely token


def test_transformers_repetition_penalty_changes_what_a_looping_model_says(random_model: Path) -> None:
    engine = tf_engine(random_model)
    reqs = [Request(text=t, max_tokens=24) for t in ("a", "b c", "x y z")]
    plain = [r.output for r in engine.run(reqs)]
    penalised = [r.output for r in engine.run([Request(text=r.text, max_tokens=24,
                                                       sampling=Sampling(repetition_penalty=1.9)) for r in reqs])]
    assert plain != penalised


def test_transformers_refuses_embed_and_needs_a_model_name() -> None:
    with pytest.raises(ValueError, match="embed"):
        create_engine("transformers", EngineConfig(task="embed", name="x"))
    with pytest.raises(ValueError, match="model.name"):
        create_engine("transformers", EngineConfig(task="generate"))


# --- the simulated engine ---------------------------------------------------------------------


def simulated(max_num_seqs: int, task: str = "generate", max_tokens: int = 256) -> Any:
    return loaded(create_engine("simulated", EngineConfig(task=task, max_tokens=max_tokens,
                                                          simulated={"maxNumSeqs": max_num_seqs,
                                                                     "stepSeconds": 0})))


def test_simulated_engine_adds_one_word_per_step_and_admits_new_requests_at_the_next_step() -> None:
    engine = simulated(2)
    engine.submit(0, Request(text="one", max_tokens=8))
    engine.submit(1, Request(text=" three  words\nhere ", max_tokens=8))
    engine.submit(2, Request(text="two words", max_tokens=8))
    assert engine.unfinished() == 3
    first = engine.step()  # 0 and 1 run; 0 needs one step
    assert [t for t, _ in first] == [0]
    engine.submit(3, Request(text="late", max_tokens=8))
    assert engine.step() == []  # 1 at its second word, 2 joined the freed slot
    done = dict(engine.step())
    assert sorted(done) == [1, 2]
    assert done[1].output == "three words here" and done[1].completion_tokens == 3
    assert done[1].prompt_tokens == 3 and done[1].extra["finish_reason"] == "stop"
    assert dict(engine.step())[3].output == "late"
    assert (engine.steps, engine.occupied, engine.unfinished()) == (4, 2 + 2 + 2 + 1, 0)


def test_simulated_engine_aborts_running_and_waiting_requests() -> None:
    engine = simulated(2)
    for tag, text in enumerate(["a b c", "d e f", "g h i", "j"]):
        engine.submit(tag, Request(text=text, max_tokens=8))
    assert engine.step() == []  # 0 and 1 run, 2 and 3 wait
    engine.abort([1, 2])
    assert engine.unfinished() == 2
    done = [t for _ in range(4) for t, _ in engine.step()]
    assert sorted(done) == [0, 3] and engine.unfinished() == 0
    engine.submit(5, Request(text="k l"))
    engine.step()
    engine.abort()
    assert engine.unfinished() == 0 and engine.step() == []


def test_simulated_engine_stops_at_max_tokens_and_counts_words_as_tokens() -> None:
    engine = simulated(4, max_tokens=2)
    (res,) = engine.run([Request(text="a b c d", max_tokens=2)])
    assert (res.output, res.prompt_tokens, res.completion_tokens, res.extra["finish_reason"]) == ("a b", 4, 2,
                                                                                                  "length")
    assert engine.count_tokens([Request(text="a b  c")]) == [3]
    (emb,) = simulated(4, task="embed").run([Request(text="a b")])
    assert emb.embedding is not None and len(emb.embedding) == ECHO_DIM


def test_simulated_engine_sleeps_each_step() -> None:
    import time

    engine = loaded(create_engine("simulated", EngineConfig(task="generate",
                                                            simulated={"maxNumSeqs": 1, "stepSeconds": 0.01})))
    t = time.perf_counter()
    engine.run([Request(text="a b c"), Request(text="d")])
    assert time.perf_counter() - t >= 0.04 and engine.steps == 4


# --- vLLM without vLLM (the adapter meets the real engine in test_vllm.py) -------------------


def test_llm_kwargs_pass_every_spec_knob_through() -> None:
    from bij.engines.vllm_llm import llm_kwargs

    config = EngineConfig(
        task="generate", name="/models/m", seed=3,
        vllm={"gpuMemoryUtilization": 0.8, "maxNumSeqs": 64, "enablePrefixCaching": False, "quantization": "fp8",
              "maxModelLen": 4096, "tensorParallelSize": 2, "dtype": "bfloat16"},
    )
    assert llm_kwargs(config) == {
        "model": "/models/m", "seed": 3, "gpu_memory_utilization": 0.8, "max_num_seqs": 64,
        "enable_prefix_caching": False, "quantization": "fp8", "max_model_len": 4096,
        "tensor_parallel_size": 2, "dtype": "bfloat16",
        # The spec's defaults for what the spec left out.
        "pipeline_parallel_size": 1, "enforce_eager": False,
    }


@pytest.mark.parametrize("task", ["embed", "classify", "score", "rerank"])
def test_a_pooling_task_leaves_prefix_caching_to_vllm_unless_engine_args_ask(task: str) -> None:
    """The spec's enablePrefixCaching (default true) is a generate and chat knob: asked of a BERT cross-encoder,
    vLLM's load fails (no KV cache group it can reuse); engineArgs still reach it."""
    from bij.engines.vllm_llm import llm_kwargs

    assert "enable_prefix_caching" not in llm_kwargs(EngineConfig(task=task, name="/models/m"))
    asked = EngineConfig(task=task, name="/models/m", vllm={"engineArgs": {"enablePrefixCaching": True}})
    assert llm_kwargs(asked)["enable_prefix_caching"] is True
    assert llm_kwargs(EngineConfig(task="generate", name="/models/m"))["enable_prefix_caching"] is True


def test_engine_args_pass_through_over_the_named_knobs_and_unknown_names_are_found() -> None:
    from bij.engines.vllm_llm import llm_kwargs, unknown_arguments

    config = EngineConfig(task="generate", name="/models/m", adapters={"fr": "/a/fr"},
                          vllm={"maxNumSeqs": 64, "engineArgs": {"maxNumBatchedTokens": 512, "max_num_seqs": 32,
                                                                 "swap_space": 4}})
    kwargs = llm_kwargs(config)
    defaults = llm_kwargs(EngineConfig(task="generate", name="/models/m"))  # the spec's defaults
    assert kwargs == {**defaults, "max_num_seqs": 32, "max_num_batched_tokens": 512, "swap_space": 4,
                      "enable_lora": True}
    known = {*defaults, "max_num_seqs", "max_num_batched_tokens", "enable_lora"}
    assert unknown_arguments(kwargs, known) == ["swap_space"]


def test_on_vllms_cpu_build_one_lora_slot_more_than_adapters_stays_empty_for_base_rows() -> None:
    from bij.engines.vllm_llm import llm_kwargs

    two = {"fr": "/a/fr", "de": "/a/de"}
    assert "max_loras" not in llm_kwargs(EngineConfig(task="generate", name="m", adapters=two))
    assert llm_kwargs(EngineConfig(task="generate", name="m", adapters=two), cpu=True)["max_loras"] == 3
    assert llm_kwargs(EngineConfig(task="generate", name="m", adapters=two, vllm={"maxLoras": 4}),
                      cpu=True)["max_loras"] == 5
    assert "max_loras" not in llm_kwargs(EngineConfig(task="generate", name="m"), cpu=True)


def test_on_vllms_cpu_platform_the_engine_runs_in_the_workers_process_unless_the_environment_says() -> None:
    from bij.engines.vllm_llm import engine_in_process

    cpu: dict[str, str] = {}
    engine_in_process(cpu, cpu=True)
    assert cpu == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    chosen = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    engine_in_process(chosen, cpu=True)
    assert chosen == {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    cuda: dict[str, str] = {}
    engine_in_process(cuda, cpu=False)
    assert cuda == {}  # vLLM's own default: its engine core in a process of its own


def test_llm_kwargs_ask_for_a_pooling_model_in_each_vllm_generation() -> None:
    from bij.engines.vllm_llm import llm_kwargs

    config = EngineConfig(task="embed", name="m")
    assert llm_kwargs(config, has_runner=True)["runner"] == "pooling"
    assert llm_kwargs(config, has_runner=False, version=(0, 8))["task"] == "embed"
    assert llm_kwargs(config, has_runner=False, version=(0, 6))["task"] == "embedding"
    assert "runner" not in llm_kwargs(EngineConfig(task="generate", name="m"))


def test_vllm_engine_module_imports_without_vllm() -> None:
    from bij.engines.vllm import VllmEngine

    engine = VllmEngine(EngineConfig(task="generate", name="m"))
    assert engine.schedules_itself is True
    if "vllm" not in sys.modules:
        # ImportError: the worker reports it as a bad configuration (exit 42), not worth a retry.
        with pytest.raises(ImportError, match="vllm"):
            engine.load()


def test_transformers_n_answers_are_sampled_apart_and_greedy_ones_repeat(random_model: Path) -> None:
    engine = tf_engine(random_model)
    sampled, greedy = engine.run([
        Request(text="a b", max_tokens=12, temperature=1.5, seed=5, sampling=Sampling(n=3)),
        Request(text="x", max_tokens=12, sampling=Sampling(n=2)),
    ])
    assert sampled.choices is not None and len(sampled.choices) == 3
    assert len({c.output for c in sampled.choices}) > 1
    assert sampled.output == sampled.choices[0].output
    assert sampled.completion_tokens == sum(c.completion_tokens for c in sampled.choices)
    (alone,) = engine.run([Request(text="x", max_tokens=12)])
    assert greedy.choices is not None and [c.output for c in greedy.choices] == [alone.output] * 2


def test_transformers_logprobs_are_the_models_and_finite(wired_model: Path, random_model: Path) -> None:
    import math

    engine = tf_engine(wired_model)
    (res,) = engine.run([Request(text="a", max_tokens=3, sampling=Sampling(logprobs=True, top_logprobs=2))])
    (choice,) = res.choices or []
    assert choice.output == "b c d" and choice.logprobs is not None
    # The wired model is sure of each token's successor: logprob about 0, every other token far below.
    assert [t.token for t in choice.logprobs] == ["b", "c", "d"]
    assert all(-1e-3 < t.logprob <= 0 for t in choice.logprobs)
    assert [t.top[0] for t in choice.logprobs] == [(t.token, t.logprob) for t in choice.logprobs]
    assert all(len(t.top) == 2 and t.top[1][1] < -50 for t in choice.logprobs)

    engine = tf_engine(random_model)
    reqs = [Request(text=t, max_tokens=8, temperature=1.0, seed=1, sampling=Sampling(n=2, logprobs=True))
            for t in ("a", "x y")]
    for res in engine.run(reqs):
        for c in res.choices or []:
            assert c.logprobs is not None and len(c.logprobs) == c.completion_tokens
            assert all(math.isfinite(t.logprob) and t.logprob <= 0 and t.top == () for t in c.logprobs)


def test_transformers_keeps_logprobs_of_the_chosen_and_top_tokens_only(random_model: Path) -> None:
    """generate is never asked for every step's logits (vocabulary x steps x sequences): the logprobs
    are recorded as they go, the chosen token's and the top ones', the same values the raw logits give."""
    import torch

    engine = tf_engine(random_model)
    calls: list[dict[str, Any]] = []
    generate = engine.model.generate

    def spy(**kw: Any) -> Any:
        calls.append(kw)
        return generate(**kw)

    engine.model.generate = spy
    (res,) = engine.run([Request(text="a", max_tokens=6, temperature=1.0, seed=3,
                                 sampling=Sampling(n=3, logprobs=True, top_logprobs=4, repetition_penalty=1.3))])
    assert "output_logits" not in calls[0] and "output_scores" not in calls[0]
    assert "repetition_penalty" not in calls[0]  # applied after the recorder, not before it
    for c in res.choices or []:
        assert c.logprobs is not None and len(c.logprobs) == c.completion_tokens
        for t in c.logprobs:
            assert len(t.top) == 4 and [v for _, v in t.top] == sorted((v for _, v in t.top), reverse=True)
            assert t.logprob <= t.top[0][1] + 1e-6
    # Greedy, the chosen token is the most likely one of the model's own distribution.
    prompt = engine.tokenizer("a", return_tensors="pt")
    with torch.inference_mode():
        raw = engine.model(**prompt).logits[0, -1].float().log_softmax(-1)
    (greedy,) = engine.run([Request(text="a", max_tokens=1, sampling=Sampling(logprobs=True, top_logprobs=2))])
    first = (greedy.choices or [])[0].logprobs[0]  # type: ignore[index]
    assert abs(first.logprob - float(raw.max())) < 1e-4 and abs(first.top[1][1] - float(raw.topk(2).values[1])) < 1e-4


def test_transformers_logprobs_wait_for_no_device_read_while_generating() -> None:
    """Each step's logprobs stay on the model's device until the batch ends: a read-back a step (`.tolist()`)
    makes the host wait for a GPU twice a step. Meta tensors have no data, so any read-back fails on them."""
    import torch

    from bij.engines.transformers_decoding import logprob_recorder

    recorder = logprob_recorder(3)
    scores = torch.empty((2, 10), device="meta")
    for step in range(4):
        ids = torch.zeros((2, 5 + step), dtype=torch.long, device="meta")
        assert recorder(ids, scores) is scores
    assert len(recorder.chosen) == 3 and len(recorder.top) == 4
    # finish() reads the whole batch back at once: steps x sequences, and (values, ids) per step.
    recorder = logprob_recorder(2)
    for token in (1, 2):
        recorder(torch.tensor([[0, token], [0, token]]), torch.arange(10.0).repeat(2, 1))
    chosen, top = recorder.finish([[1, 2], [1, 3]])
    lp = torch.log_softmax(torch.arange(10.0), -1)
    assert chosen == [[float(lp[2])] * 2, [float(lp[2]), float(lp[3])]]
    assert [ids for _, ids in top] == [[[9, 8], [9, 8]], [[9, 8], [9, 8]]]


def test_chat_template_and_its_variables_from_the_spec_replace_the_tokenizers(tmp_path: Path) -> None:
    path = build_model(tmp_path, chat_template=False)
    template = ("{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}"
                "{% if stop_at_x %}x{% endif %}")
    plain = tf_engine(path, task="chat", chat_template=template)
    (res,) = plain.run([Request(messages=[{"role": "user", "content": "a b"}])])
    # <s> a b: the successor model goes on from b
    assert (res.output, res.prompt_tokens) == ("c d e f g h", 3)
    switched = tf_engine(path, task="chat", chat_template=template, chat_template_kwargs={"stop_at_x": True})
    (res,) = switched.run([Request(messages=[{"role": "user", "content": "a b"}])])
    assert (res.output, res.prompt_tokens) == ("", 4)  # x is followed by </s>
    assert switched.count_tokens([Request(messages=[{"role": "user", "content": "a b"}])]) == [4]


# --- a row's own chat template fields, token-id prompts, Matryoshka dimensions ----------------------------


def test_transformers_renders_each_chat_rows_own_template_variables_and_prefill(tmp_path: Path) -> None:
    path = build_model(tmp_path)
    engine = tf_engine(path, task="chat")
    user = {"role": "user", "content": "a b"}
    prefill, no_prompt, plain = engine.run([
        # <s> user : a b assistant : c  -- the assistant's message left open: the model goes on from c
        Request(messages=[user, {"role": "assistant", "content": "c"}],
                sampling=Sampling(continue_final_message=True, add_generation_prompt=False)),
        # <s> user : a b  -- no generation prompt: the model goes on from b
        Request(messages=[user], sampling=Sampling(add_generation_prompt=False)),
        Request(messages=[user]),
    ])
    assert (prefill.output, prefill.prompt_tokens) == ("d e f g h", 8)
    assert (no_prompt.output, no_prompt.prompt_tokens) == ("c d e f g h", 5)
    assert (plain.output, plain.prompt_tokens) == ("f g h", 7)
    template = ("{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}"
                "{% if stop_at_x %}x{% endif %}")
    spec_off = tf_engine(build_model(tmp_path / "bare", chat_template=False), task="chat", chat_template=template,
                         chat_template_kwargs={"stop_at_x": False})
    mine, spec = spec_off.run([Request(messages=[user], sampling=Sampling(chat_template_kwargs='{"stop_at_x":true}')),
                               Request(messages=[user])])
    assert (mine.output, mine.prompt_tokens) == ("", 4)  # the row's variable over the spec's: x, then </s>
    assert (spec.output, spec.prompt_tokens) == ("c d e f g h", 3)


def test_transformers_takes_a_prompt_as_token_ids_as_they_are(wired_model: Path) -> None:
    from tiny_models import IDS

    engine = tf_engine(wired_model)
    ids, text, bad = engine.run([Request(token_ids=[IDS["x"], IDS["c"]]), Request(text="x c"),
                                 Request(token_ids=[IDS["c"], len(VOCAB) + 5])])
    assert (ids.output, ids.prompt_tokens) == ("d e f g h", 2)  # no BOS added to given ids
    assert (text.output, text.prompt_tokens) == ("d e f g h", 3)
    assert bad.error == f"token id {len(VOCAB) + 5} is outside the vocabulary of {len(VOCAB)} tokens"
    assert engine.count_tokens([Request(token_ids=[IDS["c"]] * 5)]) == [5]


def test_minilm_declares_no_matryoshka_dimensions_so_it_does_not_honour_them(minilm: Any) -> None:
    assert "dimensions" not in minilm.honours


@pytest.fixture(scope="module")
def matryoshka_minilm(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """all-MiniLM-L6-v2 with a config that declares Matryoshka sizes (the weights are the same)."""
    import json
    import shutil

    from bij.engines.sentence_transformers import default_model_path

    path = tmp_path_factory.mktemp("matryoshka") / "minilm"
    shutil.copytree(default_model_path(), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [384, 128, 32]}))
    return loaded(create_engine("sentence-transformers", EngineConfig(task="embed", name=str(path), device="cpu")))


def test_matryoshka_dimensions_keep_the_head_of_the_embedding_renormalised(minilm: Any, matryoshka_minilm: Any) -> None:
    assert "dimensions" in matryoshka_minilm.honours
    text = "The cat sits on the mat."
    (full,) = minilm.run([Request(text=text)])
    short, whole, odd, over = matryoshka_minilm.run([Request(text=text, sampling=Sampling(dimensions=d))
                                                     for d in (32, 384, 100, 500)])
    head = full.embedding[:32]
    norm = math.sqrt(sum(v * v for v in head))
    assert short.error is None and short.embedding == pytest.approx([v / norm for v in head], abs=1e-6)
    assert math.isclose(sum(v * v for v in short.embedding), 1.0, rel_tol=1e-6) and norm < 0.99
    assert whole.embedding == pytest.approx(full.embedding, abs=1e-6)
    assert odd.error == "the model declares Matryoshka dimensions [384, 128, 32], got 100"
    assert odd.extra["code"] == "invalid_request"
    assert over.error == "dimensions must be in [1, 384], got 500"
