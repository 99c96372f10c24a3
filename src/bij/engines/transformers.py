"""The transformers engine: a causal LM with Hugging Face `generate`, tasks generate and chat.

For small models, CPU runs and tests. Choices a user can observe:

- Prompt tokens are the ids the model receives: the tokenizer's special tokens for
  `generate`, the rendered chat template (which carries its own BOS) for `chat`.
- Completion tokens count generated ids up to and including the first EOS, never padding.
- Sampling knobs come only from the request (never from the model's generation_config),
  as vLLM's `SamplingParams` takes them, so both engines answer the same request alike:
  temperature (0 is greedy), topP, topK, minP, repetitionPenalty and stop. A stop string
  ends the row's generation and is cut from its text (finish_reason "stop"), as OpenAI
  and vLLM do. `n` answers per row come from one generate call (greedy: one answer, repeated);
  logprobs are the model's raw distribution at each kept token, with the `topLogprobs` most
  likely tokens. presencePenalty and frequencyPenalty, and vLLM's own minTokens, ignoreEos,
  logitBias and badWords, are refused (`honours`). A chat row's own template variables,
  `addGenerationPrompt` and `continueFinalMessage` (a prefill) render its prompt; a plain prompt
  may come as token ids.
- Structured output (JSON Schema, any JSON object, regex, a choice of strings, an EBNF
  grammar) is constrained decoding with xgrammar's logits processor, the grammar engine vLLM
  uses by default, so both engines accept the same grammars; JSON comes out compact (no
  free whitespace, which a weak model could emit forever). Without xgrammar installed the
  engine does not honour it and such rows are refused.
- A forced tool call (chat `tool_choice` "required" or a named function) is decoded as vLLM's
  server decodes one without a tool call parser: under the JSON schema of the calls, arguments
  included (`tools.forced_schema`), read back as calls and checked (`tools.forced_result`).
- LoRA adapters (spec.model.adapters) load once with PEFT; rows are grouped by adapter, so a
  batch runs one adapter (or the base model, with the adapters disabled).
- Seeds are per batch: `torch.manual_seed` runs before each sampled batch with the
  first row's seed (else `config.seed`). The same batch gives the same answers; a
  row's sample can change when it lands in a different batch.
- With `config.truncate` a prompt over the limit keeps its last tokens (as vLLM's
  `truncate_prompt_tokens`); without it the row is an error.
- A tokenizer without a chat template fails `load()` for task chat: it is a
  configuration that can never work, better stopped before any row is read than
  turned into one error per row.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import re
from dataclasses import replace
from typing import Any, NamedTuple, cast

from bij.contract.sampling import TOKEN_IDS
from bij.engines import hub
from bij.engines.base import (
    BASIC_SAMPLING,
    CHAT_TEMPLATE_FIELDS,
    ENGINE_REJECTED,
    Choice,
    EngineBase,
    EngineConfig,
    Request,
    Result,
    TokenLogprob,
)
from bij.engines.prompts import GREEDY_EPS, count_prompt_tokens, pick_device, prompt_ids, truncate_prompt
from bij.engines.structured import Validator, grammar_schema
from bij.engines.tools import FORCED_TOOL_CHOICE, forced, forced_result, forced_schema
from bij.engines.transformers_decoding import (
    can_start,
    grammar_processor,
    guidance_grammar,
    guidance_processor,
    logprob_recorder,
    stop_at,
    stop_strings,
)


class TransformersEngine(EngineBase):
    """A causal LM loaded with AutoModelForCausalLM from a local path or a hub id (tasks generate and chat).

    bf16 on a GPU, fp32 on CPU; batched generation with left padding. A hub id comes from the
    model cache, or is downloaded into it unless HF_HUB_OFFLINE is set (see `hub`).
    """

    name = "transformers"
    parallel_prepare = True  # its compute lets go of the interpreter: parse the next chunks meanwhile
    schedules_itself = False
    continuous = False
    honours: frozenset[str] = BASIC_SAMPLING | {"topP", "topK", "minP", "repetitionPenalty", "stop", "n", "logprobs",
                                                "topLogprobs"}

    def __init__(self, config: EngineConfig):
        if config.task not in ("generate", "chat"):
            raise ValueError(f"engine transformers supports tasks generate and chat, not {config.task!r}")
        if not config.name:
            raise ValueError("engine transformers needs model.name (a local model directory or a hub id)")
        self.config = config
        self.model: Any = None
        self.tokenizer: Any = None
        self.device = "cpu"
        self._eos_ids: list[int] = []
        self._max_positions: int | None = None
        self._compiler: Any = None  # xgrammar's, built on the first row with structured output
        self._grammars: dict[tuple[str, str], Any] = {}
        self._bad_grammars: dict[tuple[str, str], tuple[str, str]] = {}  # (error code, why)
        # What the grammar backend cannot serve at all with this model's tokenizer, learnt once:
        # "*" (no grammar at all) or "json" (no JSON value); the reason each such row fails with.
        self._unservable: dict[str, str] = {}
        self.notes: list[str] = []  # the same reasons, once each, for the job's status
        self._checked: set[str] = set()  # what was probed already ("json")
        self._validator = Validator()
        self._llg: Any = None  # llguidance's tokenizer (the second grammar backend); False: none
        # Chat rows' own template variables and prefill (prompts.prompt_ids); plain prompts as token ids.
        self.honours = self.honours | (CHAT_TEMPLATE_FIELDS if config.task == "chat" else {TOKEN_IDS})
        if importlib.util.find_spec("xgrammar") is not None:
            self.honours = self.honours | {"structuredOutput"}
            if config.task == "chat":
                self.honours = self.honours | {FORCED_TOOL_CHOICE}
        if config.adapters and importlib.util.find_spec("peft") is not None:
            self.honours = self.honours | {"adapters"}

    def load(self) -> None:
        """Load tokenizer and model once; later calls are no-ops."""
        if self.model is not None:
            return
        name = str(self.config.name)
        local_only = hub.local_files_only(name)  # before the imports: a model that cannot be had fails fast
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        with hub.loading(name):
            tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=local_only)
        if self.config.task == "chat" and not (self.config.chat_template
                                               or getattr(tokenizer, "chat_template", None)):
            raise ValueError(
                f"model {name!r} has no chat template (tokenizer_config.json chat_template); "
                "use task generate, or a chat/instruct model"
            )
        # Left padding keeps every row's last prompt token next to its first generated token.
        tokenizer.padding_side = "left"
        if tokenizer.pad_token_id is None:
            if tokenizer.eos_token_id is None:
                raise ValueError(f"model {name!r}: tokenizer has neither a pad nor an eos token to pad batches")
            tokenizer.pad_token = tokenizer.eos_token

        self.device = pick_device(self.config.device)
        dtype = torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        # transformers 4.56 renamed torch_dtype to dtype; both are accepted in between.
        major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
        dtype_kw = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
        with hub.loading(name):
            model: Any = AutoModelForCausalLM.from_pretrained(name, local_files_only=local_only, **{dtype_kw: dtype})
        model.to(self.device)
        model.eval()

        eos = model.generation_config.eos_token_id
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos_ids:
            eos_ids.append(tokenizer.eos_token_id)
        self._eos_ids = eos_ids
        # A bare generation config: sampling knobs come only from the request (see module doc).
        model.generation_config = GenerationConfig(
            bos_token_id=model.generation_config.bos_token_id,
            eos_token_id=eos_ids or None,
            pad_token_id=tokenizer.pad_token_id,
        )
        text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self._max_positions = getattr(text_config, "max_position_embeddings", None)
        if self.config.adapters:
            from peft import PeftModel

            # Every adapter is loaded once; a batch runs one of them (set_adapter) or none.
            adapters = iter(self.config.adapters.items())
            first, path = next(adapters)
            model = PeftModel.from_pretrained(model, path, adapter_name=first)
            for more, path in adapters:
                model.load_adapter(path, adapter_name=more)
            model.eval()
        self.tokenizer = tokenizer
        self.model = model

    def batch_shape(self) -> tuple[int, int]:
        """(rows, padded prompt tokens) per batch when the spec leaves them out, by device."""
        device = self.device if self.model is not None else pick_device(self.config.device)
        return (64, 65536) if device.startswith("cuda") else (16, 8192)

    def _loaded(self) -> Any:
        if self.model is None:
            raise RuntimeError("TransformersEngine.load() must run before count_tokens() or run()")
        return self.model

    def max_input_tokens(self) -> int | None:
        """The model's max_position_embeddings, or `config.max_input_tokens` when that is smaller."""
        self._loaded()
        limits = [n for n in (self._max_positions, self.config.max_input_tokens) if n]
        return min(limits) if limits else None

    def _prompt_ids(self, requests: list[Request]) -> list[list[int] | str]:
        """Token ids per request, or the reason a request cannot become a prompt."""
        return prompt_ids(self.tokenizer, requests, chat=self.config.task != "generate",
                          template=self.config.chat_template, template_kwargs=self.config.chat_template_kwargs)

    def count_tokens(self, requests: list[Request]) -> list[int]:
        """Prompt tokens per request as the model receives them (batched tokenizer calls)."""
        self._loaded()
        return count_prompt_tokens(self.tokenizer, requests, chat=self.config.task != "generate",
                                   template=self.config.chat_template,
                                   template_kwargs=self.config.chat_template_kwargs)

    def run(self, requests: list[Request]) -> list[Result]:
        """Generate for the batch; rows that cannot run (too long, bad template) become row errors.
        A forced tool call is decoded under its calls' schema and read back as calls."""
        decoded = [replace(r, sampling=replace(r.sampling, structured_output=(
            "json_schema", json.dumps(forced_schema(r.tools))))) if r.tools is not None and forced(r.tools) else r
            for r in requests]
        results = self._run(decoded)
        return [forced_result(r, res) if r is not d else res
                for r, d, res in zip(requests, decoded, results, strict=True)]

    def _run(self, requests: list[Request]) -> list[Result]:
        self._loaded()
        results = [Result() for _ in requests]
        limit = self.max_input_tokens()
        groups: dict[_Knobs, list[int]] = {}
        ready: dict[int, list[int]] = {}
        prompts = self._prompt_ids(requests) if requests else []
        for i, (req, p) in enumerate(zip(requests, prompts, strict=True)):
            if isinstance(p, str):
                results[i] = Result(error=p)
            elif not p:
                results[i] = Result(prompt_tokens=0, error="empty prompt: nothing to continue from")
            elif limit is not None and len(p) > limit and not self.config.truncate:
                results[i] = Result(
                    prompt_tokens=len(p),
                    error=f"prompt is {len(p)} tokens, longer than the model's limit of {limit}",
                )
            else:
                if limit is not None:
                    p = truncate_prompt(self.tokenizer, req, p, limit, embed=False)
                if req.sampling.structured_output is not None:
                    problem = self._grammar_problem(req.sampling.structured_output)
                    if problem:
                        results[i] = Result(prompt_tokens=len(p), error=problem[1], extra={"code": problem[0]})
                        continue
                # One generate call serves one set of sampling knobs; rows of a job usually share them.
                groups.setdefault(_knobs(req), []).append(i)
                ready[i] = p
        for knobs, idx in groups.items():
            outs = self._generate(knobs, [requests[i] for i in idx], [ready[i] for i in idx])
            for i, res in zip(idx, outs, strict=True):
                results[i] = res
            if knobs.structured:
                self._repair(knobs, idx, requests, ready, results)
        return results

    def _repair(self, knobs: _Knobs, idx: list[int], requests: list[Request], ready: dict[int, list[int]],
                results: list[Result]) -> None:
        """Rows whose answer breaks its structured output run once more under the second grammar
        backend (llguidance, where installed); an answer that keeps to it then replaces the first,
        marked `repaired`. The others are left as they are: the worker's validator makes them
        schema_violation rows."""
        bad = [i for i in idx if results[i].error is None
               and self._validator.check([requests[i]], [replace(results[i])]).violations]
        if not bad or self._guidance() is None:
            return
        again = self._generate(knobs, [requests[i] for i in bad], [ready[i] for i in bad], second=True)
        for i, res in zip(bad, again, strict=True):
            if res.error is None and not self._validator.check([requests[i]], [replace(res)]).violations:
                res.extra["repaired"] = True
                results[i] = res

    def _guidance(self) -> Any:
        """The second grammar backend's tokenizer (llguidance), built once; None without it."""
        if self._llg is None:
            self._llg = False
            if importlib.util.find_spec("llguidance") is not None:
                try:
                    import llguidance.hf

                    self._llg = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.model.config.vocab_size,
                                                             eos_token=self._eos_ids or None)
                except Exception:  # noqa: BLE001 - a tokenizer it cannot read: no second backend
                    self._llg = False
        return self._llg or None

    def _generate(self, knobs: _Knobs, requests: list[Request], prompts: list[list[int]],
                  second: bool = False) -> list[Result]:
        """One generate call for rows that share `knobs`: their results, in order."""
        import torch

        # n sampled answers per row; greedy answers are all the same, so one is made and repeated.
        sampled = knobs.n if knobs.temperature > 0 else 1
        batch = self.tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt")
        input_ids = batch["input_ids"].to(self.device)
        attention_mask = batch["attention_mask"].to(self.device)
        width = input_ids.shape[1]
        caps, max_new = self._caps(requests, width)
        kwargs = self._sampling_kwargs(knobs, requests, max_new)
        recorder, grammar = self._processors(knobs, requests, sampled, second, kwargs)
        if knobs.stop:
            from transformers import StoppingCriteriaList

            kwargs["stopping_criteria"] = StoppingCriteriaList([stop_strings(self.tokenizer, knobs.stop, width)])
        if sampled > 1:
            # Answers of one row come out next to each other: row 0's n, then row 1's.
            kwargs["num_return_sequences"] = sampled
            caps = [c for c in caps for _ in range(sampled)]
        if max_new > 0:
            with torch.inference_mode(), self._adapter(knobs.adapter):
                out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
            new = out[:, width:].cpu()
        else:
            new = torch.empty((len(prompts) * sampled, 0), dtype=torch.long)
        rows, texts, counts, finish = self._decoded(new, caps, knobs.stop)
        stuck: dict[int, int] = grammar.stuck if grammar is not None else {}
        if knobs.n == 1 and not knobs.logprobs and not stuck:
            return [
                Result(output=text, prompt_tokens=len(p), completion_tokens=k, extra={"finish_reason": f})
                for text, p, k, f in zip(texts, prompts, counts, finish, strict=True)
            ]
        lps = self._logprobs(recorder, rows, counts) if knobs.logprobs else [None] * len(rows)
        answers = [Choice(output=t, completion_tokens=k, finish_reason=f, logprobs=lp)
                   for t, k, f, lp in zip(texts, counts, finish, lps, strict=True)]
        return self._results(knobs, requests, prompts, sampled, answers, stuck, second)

    def _caps(self, requests: list[Request], width: int) -> tuple[list[int], int]:
        """Each row's token cap and the call's max_new_tokens, within the model's position table."""
        # Rows in one batch share the step count: generate for the longest ask, cut each row to its own.
        caps = [r.max_tokens for r in requests]
        max_new = max(caps)
        if self._max_positions:
            # Past the position table a learned-position model fails and a RoPE one degrades.
            room = max(0, self._max_positions - width)
            max_new = min(max_new, room)
            caps = [min(c, room) for c in caps]
        return caps, max_new

    def _sampling_kwargs(self, knobs: _Knobs, requests: list[Request], max_new: int) -> dict[str, Any]:
        """generate's arguments for the knobs' sampling; a sampled call seeds torch first."""
        import torch

        kwargs: dict[str, Any] = {"max_new_tokens": max_new, "pad_token_id": self.tokenizer.pad_token_id}
        if self._eos_ids:
            kwargs["eos_token_id"] = self._eos_ids
        if knobs.temperature > 0:
            seed = requests[0].seed if requests[0].seed is not None else self.config.seed
            torch.manual_seed(seed)
            kwargs.update(do_sample=True, temperature=knobs.temperature, top_k=knobs.top_k, top_p=knobs.top_p)
            if knobs.min_p:
                kwargs["min_p"] = knobs.min_p
        else:
            kwargs.update(do_sample=False)
        return kwargs

    def _processors(self, knobs: _Knobs, requests: list[Request], sampled: int, second: bool,
                    kwargs: dict[str, Any]) -> tuple[Any, Any]:
        """Add the call's logits processors to `kwargs`: (the logprob recorder, the grammar processor),
        each None when the knobs do not ask for it."""
        processors: list[Any] = []
        recorder: Any = None
        if knobs.logprobs:
            # The model's own distribution (raw logits), as vLLM reports logprobs by default: recorded
            # first, before any processor changes it, and only the chosen and the top tokens are kept
            # (never a step's whole vocabulary, which n x maxTokens steps would multiply).
            recorder = logprob_recorder(knobs.top_logprobs)
            processors.append(recorder)
        if knobs.repetition_penalty != 1.0:
            if knobs.logprobs:  # after the recorder (generate's own would run before every custom one)
                from transformers import RepetitionPenaltyLogitsProcessor

                processors.append(RepetitionPenaltyLogitsProcessor(knobs.repetition_penalty))
            else:
                kwargs["repetition_penalty"] = knobs.repetition_penalty
        grammar: Any = None
        if knobs.structured:
            # One grammar per generated sequence (rows may each have their own schema); a
            # processor serves one generate call.
            # (every row of this group has one: structured output is one of the group's knobs)
            eos = self._eos_ids[0] if self._eos_ids else self.tokenizer.pad_token_id
            shapes = cast("list[tuple[str, str]]", [r.sampling.structured_output for r in requests])
            if second:
                grammar = guidance_processor([guidance_grammar(s) for s in shapes for _ in range(sampled)],
                                             self._llg, self._eos_ids, eos)
            else:
                grammars = [self._grammars[s] for s in shapes for _ in range(sampled)]
                grammar = grammar_processor(grammars, eos)
            processors.append(grammar)
        if processors:
            kwargs["logits_processor"] = processors
        return recorder, grammar

    def _decoded(self, new: Any, caps: list[int], stop: tuple[str, ...]
                 ) -> tuple[list[list[int]], list[str], list[int], list[str]]:
        """The generated ids per sequence, their texts, kept token counts and finish reasons."""
        import torch

        tok = self.tokenizer
        # Tokens up to and including the first EOS; after it come only pads.
        steps = new.shape[1]
        if self._eos_ids and steps:
            is_eos = torch.isin(new, torch.tensor(self._eos_ids))
            first = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1) + 1, steps)
            until_eos = first.tolist()
            stopped = is_eos.any(dim=1).tolist()
        else:
            until_eos, stopped = [steps] * len(caps), [False] * len(caps)
        counts = [min(e, cap) for e, cap in zip(until_eos, caps, strict=True)]
        finish = ["stop" if s and e <= cap else "length" for s, e, cap in zip(stopped, until_eos, caps, strict=True)]
        rows = new.tolist()
        texts = tok.batch_decode([row[:k] for row, k in zip(rows, counts, strict=True)], skip_special_tokens=True)
        if stop:
            for i, (row, k) in enumerate(zip(rows, counts, strict=True)):
                cut = stop_at(tok, row[:k], stop)
                if cut is not None:
                    counts[i], texts[i], finish[i] = cut[0], cut[1], "stop"
        return rows, texts, counts, finish

    def _results(self, knobs: _Knobs, requests: list[Request], prompts: list[list[int]], sampled: int,
                 answers: list[Choice], stuck: dict[int, int], second: bool) -> list[Result]:
        """Each row's result from its `sampled` answers (n when sampled, one repeated when greedy);
        a row with a sequence its grammar could not continue fails."""
        n = knobs.n
        results = []
        for i, p in enumerate(prompts):
            dead = [stuck[j] for j in range(i * sampled, (i + 1) * sampled) if j in stuck]
            if dead:
                results.append(self._stuck(requests[i], len(p), min(dead)) if not second else
                               Result(prompt_tokens=len(p), error="the second grammar backend's dead end"))
                continue
            mine = answers[i * sampled:(i + 1) * sampled]
            if sampled < n:
                mine = [replace(mine[0]) for _ in range(n)]
            if n == 1 and not knobs.logprobs:
                results.append(Result(output=mine[0].output, prompt_tokens=len(p),
                                      completion_tokens=mine[0].completion_tokens,
                                      extra={"finish_reason": mine[0].finish_reason}))
                continue
            results.append(Result(output=mine[0].output, prompt_tokens=len(p),
                                  completion_tokens=sum(c.completion_tokens for c in mine),
                                  extra={"finish_reason": mine[0].finish_reason}, choices=mine))
        return results

    def _stuck(self, req: Request, prompt_tokens: int, step: int) -> Result:
        """The error of a row whose grammar no token of the vocabulary could continue at `step`."""
        structured = cast("tuple[str, str]", req.sampling.structured_output)  # a stuck row has a grammar
        kind = structured[0]
        if step == 0:
            # Not even its first token: this grammar cannot be written with this tokenizer at all.
            reason = (f"structured output ({kind}) cannot be served: the tokenizer of model {self.config.name} "
                      f"({type(self.tokenizer).__name__}) has no token that can start it")
            self._bad_grammars[structured] = "unsupported", reason
            self._grammars.pop(structured, None)
            return Result(prompt_tokens=prompt_tokens, error=reason, extra={"code": "unsupported"})
        return Result(prompt_tokens=prompt_tokens, extra={"code": ENGINE_REJECTED},
                      error=f"structured output ({kind}): after {step} tokens the tokenizer of model "
                            f"{self.config.name} has no token that can continue it (the grammar backend's dead end)")

    def _adapter(self, name: str | None) -> Any:
        """A context in which generate runs the LoRA adapter `name`, or the base model for None."""
        if not self.config.adapters:
            return contextlib.nullcontext()
        if name is None:
            return self.model.disable_adapter()
        self.model.set_adapter(name)
        return contextlib.nullcontext()

    def _unserved(self, what: str, reason: str) -> str:
        """Learn that the grammar backend cannot serve `what` ("*": any grammar, "json": JSON) at all."""
        self._unservable[what] = reason
        self.notes.append(reason)
        return reason

    def _grammar_problem(self, structured: tuple[str, str]) -> tuple[str, str] | None:
        """Compile a row's grammar once (cached by its text); (error code, why) it cannot be served, else None.

        What the backend cannot serve at all with this tokenizer (any grammar, or any JSON) is learnt
        from the first row that asks and refuses later rows at once, with the same reason.
        """
        if structured in self._grammars:
            return None
        if structured in self._bad_grammars:
            return self._bad_grammars[structured]
        kind, text = structured
        json_kind = kind in ("json_schema", "json_object")
        for what in ("*", "json") if json_kind else ("*",):
            if what in self._unservable:
                return "unsupported", self._unservable[what]
        import xgrammar

        if self._compiler is None:
            try:
                info = xgrammar.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.model.config.vocab_size, stop_token_ids=self._eos_ids or None)
                self._compiler = xgrammar.GrammarCompiler(info)
            except Exception as e:  # noqa: BLE001 - whatever xgrammar raises, no grammar can be served
                return "unsupported", self._unserved("*", f"structured output cannot be served: the grammar backend "
                                                          f"(xgrammar) cannot read the tokenizer of "
                                                          f"model {self.config.name}: {type(e).__name__}: {e}")
        compiler = self._compiler
        if json_kind and "json" not in self._checked:
            self._checked.add("json")
            if not can_start(compiler.compile_builtin_json_grammar()):
                return "unsupported", self._unserved("json", (
                    f"structured output jsonSchema and jsonObject cannot be served: the tokenizer of model "
                    f"{self.config.name} ({type(self.tokenizer).__name__}) has no token that can start a JSON value"))
        try:
            if kind == "json_schema":
                # Compact JSON: a grammar that allows any whitespace lets a model pad forever. Strings
                # bounded in length are tightened against raw control characters (bij.engines.structured).
                grammar = compiler.compile_json_schema(grammar_schema(text), any_whitespace=False)
            elif kind == "json_object":
                grammar = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif kind == "regex":
                grammar = compiler.compile_regex(text)
            elif kind == "choice":
                grammar = compiler.compile_regex("|".join(re.escape(c) for c in json.loads(text)))
            else:
                grammar = compiler.compile_grammar(text)
        except (RuntimeError, ValueError) as e:
            self._bad_grammars[structured] = "invalid_request", f"structured output ({kind}) cannot be compiled: {e}"
            return self._bad_grammars[structured]
        self._grammars[structured] = grammar
        return None

    def _logprobs(self, recorder: Any, rows: list[list[int]], counts: list[int]) -> list[Any]:
        """Per generated row, each kept token's log-probability and the most likely tokens there (what
        `recorder` kept while generate ran)."""
        tok = self.tokenizer
        names: dict[int, str] = {}

        def name(i: int) -> str:
            if i not in names:
                names[i] = tok.decode([i])
            return names[i]

        chosen, top = recorder.finish(rows)
        out: list[list[TokenLogprob]] = [[] for _ in rows]
        for step, picked in enumerate(chosen):
            live = [j for j, k in enumerate(counts) if step < k]
            if not live:
                break
            values, indices = top[step] if top else ([], [])
            for j in live:
                alts: tuple[tuple[str, float], ...] = ()
                if values:
                    alts = tuple((name(int(i)), float(v)) for v, i in zip(values[j], indices[j], strict=True))
                out[j].append(TokenLogprob(token=name(rows[j][step]), logprob=float(picked[j]), top=alts))
        return out


class _Knobs(NamedTuple):
    """What one generate call shares: rows that differ in any of these run in separate calls."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    stop: tuple[str, ...]
    n: int
    logprobs: bool
    top_logprobs: int
    structured: bool  # rows with a grammar (each its own) run apart from rows without one
    adapter: str | None


def _knobs(req: Request) -> _Knobs:
    """A row's knobs, with the engine's neutral value for what it leaves unset."""
    s = req.sampling
    return _Knobs(
        temperature=0.0 if req.temperature < GREEDY_EPS else req.temperature,
        top_p=1.0 if s.top_p is None else s.top_p, top_k=s.top_k or 0, min_p=s.min_p or 0.0,
        repetition_penalty=1.0 if s.repetition_penalty is None else s.repetition_penalty, stop=s.stop or (),
        n=s.n or 1, logprobs=bool(s.logprobs), top_logprobs=s.top_logprobs or 0,
        structured=s.structured_output is not None, adapter=req.adapter)
