"""The vLLM engine: an adapter on vLLM's offline `LLM` class (no HTTP server in between).

Public vLLM API only, as vLLM's own offline examples use it: `vllm.LLM` (one per process),
the `LLMEngine` it holds (`LLM.llm_engine`) driven with `add_request` / `step` /
`has_unfinished_requests` / `abort_request`, `SamplingParams`, `PoolingParams`,
`TokensPrompt` and `EmbeddingRequestOutput`. `tests/engines/test_vllm.py` checks every name and
keyword used here against the installed vLLM, so a release that moves one fails a test.

vLLM batches continuously itself, so the worker drives its engine loop
(`continuous`): `submit` adds one request (the prompt's token ids, as counted), `step`
runs one engine step and returns the requests that finished. The worker keeps about
`maxNumSeqs` requests in the engine and more in its window across chunk boundaries,
so the running batch never drains at a chunk's end. `run` (a whole list at once, the
judge's chunk-by-chunk path) is the same loop run to completion.

What the engine does, and the adapter relies on (checked by the vLLM test tier):
- every prompt goes in as token ids: the tokenizer's special tokens for plain prompts, the
  model's chat template rendered by its tokenizer for chat (what `count_tokens` counted);
- a prompt vLLM refuses raises from `add_request` (`VLLMValidationError`, which is not a
  `ValueError` in recent releases): that row alone becomes an error row;
- sampling requests ask for `RequestOutputKind.FINAL_ONLY`, as `LLM.generate` does: a
  step reports only requests that finished, not every running one;
- embeddings: vLLM >= 0.10 picks the pooling runner with `runner="pooling"`; older
  releases take `task="embed"` (0.7 to 0.9) or `task="embedding"` (0.6); a pooling
  request's output is a `PoolingRequestOutput` (a tensor), made a list of floats by
  `EmbeddingRequestOutput.from_base`;
- with `config.truncate`, a prompt over the limit is cut by bij before vLLM sees it
  (`truncate_prompt` in prompts.py: embeddings keep the head, generation the tail);
- a decoder prompt needs room for one generated token: the prompt limit is
  `max_model_len - 1` for generate and chat, `max_model_len` for embed;
- every sampling field a row carries goes into its `SamplingParams` (n, logprobs, stop,
  penalties, `StructuredOutputsParams`, and vLLM's own min_tokens, ignore_eos, logit_bias,
  bad_words); a row with n > 1 answers is reported one answer at a time under its request id,
  finished with the last; LoRA adapters are `LoRARequest`s (`enable_lora` when the spec lists
  adapters);
- chat answers go through vLLM's reasoning and tool call parsers when the spec names them
  (`model.vllm.reasoningParser`, `toolCallParser`), as its OpenAI server runs them (chat_parsing.py):
  `reasoning_parser` is also an engine argument, `tool_call_parser` only bij's;
- a chat row's own template variables, `add_generation_prompt` and `continue_final_message`
  render its prompt (prompts.prompt_ids, as `LLM.chat` renders it); a prompt given as token ids
  goes in as it is (vLLM refuses ids outside the vocabulary);
- embeddings with `dimensions`: the row's `PoolingParams(dimensions=...)`, which vLLM takes only
  for a model that declares Matryoshka embeddings (`model_config.is_matryoshka`: the engine
  honours the field only then) and cuts and normalises again itself;
- images (chat rows with `image_url` parts, on a model vLLM loads as multimodal) go in as the
  prompt's `multi_modal_data` (PIL images, in the order of their parts): the chat template puts one
  placeholder token per image, which vLLM's processor expands to the image's features, so the
  result's prompt tokens count them; a text-only model does not honour images.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from bij.contract.sampling import IMAGES, SEED_RANGE, TOKEN_IDS
from bij.engines.base import (
    BASIC_SAMPLING,
    CHAT_TEMPLATE_FIELDS,
    ENGINE_REJECTED,
    Choice,
    EngineBase,
    EngineConfig,
    Image,
    Request,
    Result,
    TokenLogprob,
    estimate_tokens,
    request_text,
    run_to_completion,
)
from bij.engines.chat_parsing import ChatParsing
from bij.engines.prompts import GREEDY_EPS, prompt_ids, truncate_prompt
from bij.engines.structured import grammar_schema
from bij.engines.tools import FORCED_TOOL_CHOICE, REASONING_EFFORT, TOOLS
from bij.engines.vllm_llm import close_llm, llm_kwargs, refusals, shared_llm


class Unservable(ValueError):
    """A row asking for what the grammar backend was found unable to serve: refused at once."""

    code = "unsupported"


def _structured_params(structured: tuple[str, str]) -> Any:
    """vLLM's StructuredOutputsParams for a row's structured output (compact JSON, as the
    transformers engine makes it: free whitespace lets a weak model pad forever)."""
    from vllm.sampling_params import StructuredOutputsParams

    kind, text = structured
    if kind == "json_schema":
        # Length-bounded strings tightened against raw control characters (bij.engines.structured).
        return StructuredOutputsParams(json=json.loads(grammar_schema(text)), disable_any_whitespace=True)
    if kind == "json_object":
        return StructuredOutputsParams(json={"type": "object"}, disable_any_whitespace=True)
    if kind == "choice":
        return StructuredOutputsParams(choice=json.loads(text))
    if kind == "regex":
        return StructuredOutputsParams(regex=text)
    return StructuredOutputsParams(grammar=text)


def _pil(image: Image, index: int) -> Any:
    """A row's image as the PIL image vLLM's processors take; one that is no image raises ValueError."""
    from PIL import Image as PILImage
    from PIL import UnidentifiedImageError

    if image.data is None:
        raise ValueError(f"image {index} ({image.source}) was never fetched")
    try:
        pil = PILImage.open(io.BytesIO(image.data))
        pil.load()
    except (UnidentifiedImageError, PILImage.DecompressionBombError, OSError, ValueError) as e:
        raise ValueError(f"image {index} ({image.source}) is not an image PIL can read: {e}") from None
    return pil.convert("RGB")


class VllmEngine(EngineBase):
    """Generate, chat or embed with vLLM's offline `LLM`; one shared instance per process."""

    name = "vllm"
    parallel_prepare = True  # its compute lets go of the interpreter: parse the next chunks meanwhile
    schedules_itself = True
    continuous = True
    # SamplingParams takes each of these as they are.
    GENERATION_FIELDS = BASIC_SAMPLING | {"topP", "topK", "minP", "stop", "presencePenalty", "frequencyPenalty",
                                          "repetitionPenalty", "n", "logprobs", "topLogprobs", "structuredOutput",
                                          "minTokens", "ignoreEos", "logitBias", "badWords"}

    def __init__(self, config: EngineConfig):
        if config.task not in ("generate", "chat", "embed"):
            raise ValueError(f"engine vllm supports tasks generate, chat and embed, not {config.task!r}")
        llm_kwargs(config)  # a missing model name fails here, before any GPU work
        self.config = config
        self.honours = frozenset() if config.task == "embed" else self.GENERATION_FIELDS
        self.honours |= CHAT_TEMPLATE_FIELDS if config.task == "chat" else {TOKEN_IDS}
        if config.task == "chat":
            # reasoning_effort goes to the chat template, as vLLM's server gives it.
            self.honours = self.honours | {REASONING_EFFORT}
            # A forced call (required, a named function) is served with or without a tool call parser, as
            # vLLM's server serves it; tool_choice auto needs the parser to read the calls.
            self.honours = self.honours | {FORCED_TOOL_CHOICE}
            if config.vllm.tool_call_parser:
                self.honours = self.honours | {TOOLS}
        self._parsing: ChatParsing | None = None  # vLLM's reasoning and tool call parsers (chat)
        self._chat: dict[str, Request] = {}  # chat requests in the engine whose answers are parsed
        if config.adapters and config.task != "embed":
            self.honours = self.honours | {"adapters"}
        # One LoRARequest per adapter, ids 1.. in name order (vLLM keys its adapter cache by id).
        self._loras: dict[str, Any] = {}
        self.llm: Any = None
        self.engine: Any = None  # the LLM's LLMEngine: add_request / step
        self.tokenizer: Any = None
        self._max_model_len: int | None = None
        self._ids: dict[int, tuple[Request, list[int] | str]] = {}  # count_tokens' ids, kept for submit
        self._pooling: Any = None
        self._sampling: dict[tuple[Any, ...], Any] = {}
        self._refused: tuple[type[BaseException], ...] = (ValueError,)
        self._in_engine: set[str] = set()  # request ids added and not yet returned
        self._top: dict[str, int] = {}  # requests in the engine that asked for top logprobs: how many
        self._parts: dict[str, dict[int, Any]] = {}  # requests asking for n > 1 answers: the answers so far
        self._concurrency: int | None = None
        self.steps = 0  # engine steps taken through `step`
        self.occupied = 0  # min(unfinished, maxNumSeqs) summed over steps: what could run
        self.cached_tokens = 0  # prompt tokens vLLM's prefix cache served, over finished requests
        self._asks: dict[str, tuple[str, str]] = {}  # requests in the engine with structured output: what
        # What vLLM's grammar backend cannot serve with this model's tokenizer, learnt from the first row
        # it ended with an error before its first token: a grammar (by its text), or "json" (any JSON).
        self._unservable: dict[tuple[str, str] | str, str] = {}
        self.notes: list[str] = []  # the same reasons, once each, for the job's status

    def load(self) -> None:
        """Build (or reuse) the process's LLM; vllm is imported only here."""
        if self.llm is not None:
            return
        self.llm = shared_llm(self.config)
        self.engine = self.llm.llm_engine
        self.tokenizer = self.llm.get_tokenizer()
        self._max_model_len = self.engine.model_config.max_model_len
        self._refused = refusals()
        if self.config.task == "chat" and self.engine.model_config.is_multimodal_model:
            self.honours = self.honours | {IMAGES}
        if self.config.task == "embed" and self.engine.model_config.is_matryoshka:
            # vLLM cuts a Matryoshka model's embeddings to `dimensions` and normalises them again; for
            # other models it refuses the field (the row is refused before it reaches vLLM).
            self.honours = self.honours | {"dimensions"}
        if self.config.task == "chat":  # the spec's parsers, if any; forced tool calls without them
            self._parsing = ChatParsing(self.config, self.tokenizer, self.engine.model_config)

    def _loaded(self) -> Any:
        if self.llm is None:
            raise RuntimeError("VllmEngine.load() must run before count_tokens() or run()")
        return self.llm

    def close(self) -> None:
        """Stop the process's LLM (close_llm: its engine core processes, and its Ray workers on the other
        pods of a lane that spans several); an engine never loaded, or closed before, has none."""
        if self.llm is None:
            return
        self.llm = None
        close_llm()

    def max_input_tokens(self) -> int | None:
        """max_model_len (minus one for the first generated token), or config.max_input_tokens if smaller."""
        self._loaded()
        limit = self._max_model_len
        if limit is not None and self.config.task != "embed":
            limit -= 1
        limits = [n for n in (limit, self.config.max_input_tokens) if n]
        return min(limits) if limits else None

    def _prompt_ids(self, requests: list[Request]) -> list[list[int] | str]:
        """Token ids per request as vLLM would make them (it adds special tokens to plain prompts,
        decoder-only and embedding models alike), or why a request cannot be rendered."""
        return prompt_ids(self.tokenizer, requests, chat=self.config.task == "chat",
                          template=self.config.chat_template, template_kwargs=self.config.chat_template_kwargs)

    def count_tokens(self, requests: list[Request]) -> list[int]:
        """Prompt tokens per request from vLLM's own tokenizer (batched); the ids wait for `submit`."""
        self._loaded()
        if not requests:
            return []
        if len(self._ids) > 1_000_000:  # rows counted and never submitted (the worker refused them)
            self._ids.clear()
        prompts = self._prompt_ids(requests)
        for r, p in zip(requests, prompts, strict=True):
            self._ids[id(r)] = (r, p)
        return [len(p) if isinstance(p, list) else estimate_tokens(request_text(r))
                for r, p in zip(requests, prompts, strict=True)]

    def concurrency(self) -> int:
        """Sequences vLLM runs at once (max_num_seqs: the spec's, else the loaded engine's own default)."""
        if self._concurrency is None:
            given = self.config.vllm.max_num_seqs
            engine_args = self.config.vllm.engine_args
            given = engine_args.get("maxNumSeqs", engine_args.get("max_num_seqs", given))
            if given is None and self.engine is not None:
                given = getattr(getattr(getattr(self.engine, "vllm_config", None), "scheduler_config", None),
                                "max_num_seqs", None)
            if given is None:
                return 256  # not loaded yet: vLLM's usual default
            self._concurrency = int(given)
        return self._concurrency

    def unfinished(self) -> int:
        return len(self._in_engine)

    def submit(self, tag: int, request: Request) -> None:
        """Add one request to vLLM's engine; a prompt it refuses raises ValueError (that row fails)."""
        self._loaded()
        kept = self._ids.pop(id(request), None)
        prompt = kept[1] if kept is not None and kept[0] is request else self._prompt_ids([request])[0]
        if isinstance(prompt, str):
            raise ValueError(prompt)
        if not prompt:
            raise ValueError("empty prompt")
        structured = request.sampling.structured_output
        if structured is not None:
            known = self._unservable.get(structured) or (
                self._unservable.get("json") if structured[0] in ("json_schema", "json_object") else None)
            if known:
                raise Unservable(known)
        limit = self.max_input_tokens()
        if limit is not None and len(prompt) > limit:
            if not self.config.truncate or request.images:
                # A prompt with images is never cut: a cut could split an image's placeholder from its features.
                raise ValueError(f"prompt is {len(prompt)} tokens, longer than the model's limit of {limit}")
            prompt = truncate_prompt(self.tokenizer, request, prompt, limit, embed=self.config.task == "embed")
        from vllm import TokensPrompt

        inputs = TokensPrompt(prompt_token_ids=prompt)
        if request.images:
            inputs["multi_modal_data"] = {"image": [_pil(im, i) for i, im in enumerate(request.images)]}
        rid = str(tag)
        try:
            params = self._pooling_params(request.sampling.dimensions) if self.config.task == "embed" \
                else self._sampling_params([request])[0]
            lora = {"lora_request": self._lora(request.adapter)} if request.adapter else {}
            self.engine.add_request(rid, inputs, params, **lora)
        except self._refused as e:
            raise ValueError(f"vllm refused the request: {e}") from None
        self._in_engine.add(rid)
        if structured is not None:
            self._asks[rid] = structured
        s = request.sampling
        if s.logprobs and s.top_logprobs:
            self._top[rid] = s.top_logprobs
        if s.n and s.n > 1:
            self._parts[rid] = {}
        if self._parsing is not None and self._parsing.reads(request):
            self._chat[rid] = request

    def step(self) -> list[tuple[int, Result]]:
        """One vLLM engine step; the requests that finished in it, as (tag, result)."""
        self._loaded()
        self.steps += 1
        self.occupied += min(len(self._in_engine), self.concurrency())
        done = []
        for out in self.engine.step():
            rid = out.request_id
            if rid not in self._in_engine:
                continue
            parts = self._parts.get(rid)
            if parts is not None:
                # n > 1: vLLM reports each answer on its own, under the row's id; the row is
                # finished with its last answer.
                for comp in out.outputs:
                    parts[comp.index] = comp
                if not out.finished:
                    continue
                del self._parts[rid]
                out = SimpleNamespace(prompt_token_ids=out.prompt_token_ids, num_cached_tokens=out.num_cached_tokens,
                                      error=getattr(out, "error", None), outputs=[parts[i] for i in sorted(parts)])
            elif not out.finished:
                continue
            self._in_engine.discard(rid)
            res = self._result(out, self._top.pop(rid, 0))
            chat = self._chat.pop(rid, None)
            if chat is not None and self._parsing is not None:
                res = self._parsing.apply(chat, res, sorted(out.outputs, key=lambda c: c.index), out.prompt_token_ids)
            structured = self._asks.pop(rid, None)
            if structured is not None and res.extra.get("finish_reason") == "error" \
                    and (res.completion_tokens or 0) <= 1:
                res = self._unserved(structured, res)
            done.append((int(rid), res))
        return done

    def _unserved(self, structured: tuple[str, str], res: Result) -> Result:
        """A structured row vLLM ended with an error at its first token: its grammar cannot be served
        with this tokenizer (for JSON: no JSON at all). Learnt here; later such rows are refused at once."""
        kind = structured[0]
        what: tuple[str, str] | str = "json" if kind in ("json_schema", "json_object") else structured
        asked = "jsonSchema and jsonObject" if what == "json" else f"({kind})"
        reason = (f"structured output {asked} cannot be served: vLLM's grammar backend rejected the first token "
                  f"model {self.config.name} generated for it (its tokenizer cannot write it)")
        if what not in self._unservable:
            self._unservable[what] = reason
            self.notes.append(reason)
        return Result(prompt_tokens=res.prompt_tokens, error=reason, extra={"code": "unsupported"})

    def abort(self, tags: Sequence[int] | None = None) -> None:
        """Drop requests still in the engine, all of them without `tags` (their rows are recomputed
        by whoever works them next)."""
        rids = list(self._in_engine) if tags is None else [str(t) for t in tags if str(t) in self._in_engine]
        if rids:
            self.engine.abort_request(rids)
            self._in_engine.difference_update(rids)
            for rid in rids:
                self._top.pop(rid, None)
                self._asks.pop(rid, None)
                self._parts.pop(rid, None)
                self._chat.pop(rid, None)

    def run(self, requests: list[Request]) -> list[Result]:
        """Run a whole chunk through vLLM's engine loop; refused rows become row errors, the rest keep order."""
        self._loaded()
        if self._in_engine:
            raise RuntimeError("VllmEngine.run() needs an engine with nothing else in flight")
        self.count_tokens(requests)
        return run_to_completion(self, requests)

    def _pooling_params(self, dimensions: int | None = None) -> Any:
        """The embed request's PoolingParams (vLLM checks `dimensions` against the model's Matryoshka ones)."""
        if dimensions is not None:
            from vllm import PoolingParams

            return PoolingParams(task="embed", dimensions=dimensions)
        if self._pooling is None:
            from vllm import PoolingParams

            try:
                self._pooling = PoolingParams(task="embed")
            except TypeError:  # releases before pooling tasks
                self._pooling = PoolingParams()
        return self._pooling

    def _sampling_params(self, requests: Sequence[Request]) -> list[Any]:
        """One SamplingParams per request; identical asks share one object."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        out = []
        for r in requests:
            greedy = r.temperature < GREEDY_EPS
            # A seeded row samples the same tokens whatever else shares its batch (resume-safe).
            seed = None if greedy else (r.seed if r.seed is not None else self.config.seed)
            if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
                raise ValueError(f"seed {seed} is outside the 64-bit range vLLM's samplers take")
            s = r.sampling
            # Only the fields a row sets: vLLM's own defaults stand for the rest.
            extra = tuple((k, v) for k, v in (
                ("top_p", s.top_p), ("top_k", s.top_k if s.top_k else None), ("min_p", s.min_p),
                ("stop", list(s.stop) if s.stop else None), ("presence_penalty", s.presence_penalty),
                ("frequency_penalty", s.frequency_penalty), ("repetition_penalty", s.repetition_penalty),
                ("n", s.n if s.n and s.n > 1 else None),
                ("min_tokens", s.min_tokens or None), ("ignore_eos", True if s.ignore_eos else None),
                ("logit_bias", dict(s.logit_bias) if s.logit_bias else None),
                ("bad_words", list(s.bad_words) if s.bad_words else None),
                # vLLM returns the sampled token's logprob and this many of the most likely ones.
                ("logprobs", (s.top_logprobs or 0) if s.logprobs else None),
            ) if v is not None)
            tooled, keep_special = self._parsing.adjusted(r) if self._parsing is not None else (None, False)
            if keep_special:
                extra += (("skip_special_tokens", False),)
            key = (r.max_tokens, 0.0 if greedy else r.temperature, seed, repr(extra), s.structured_output,
                   repr(tooled))
            if key not in self._sampling:
                if len(self._sampling) > 10_000:  # rows with their own seeds: keep the cache bounded
                    self._sampling.clear()
                more = dict(extra)
                if tooled is not None:  # a tool row: constrained as vLLM's server constrains it
                    more["structured_outputs"] = tooled
                elif s.structured_output is not None:
                    more["structured_outputs"] = _structured_params(s.structured_output)
                # FINAL_ONLY, as LLM.generate asks: a step reports a request once, when it finishes.
                self._sampling[key] = SamplingParams(max_tokens=key[0], temperature=key[1], seed=seed,
                                                     output_kind=RequestOutputKind.FINAL_ONLY, **more)
            out.append(self._sampling[key])
        return out

    def _lora(self, name: str | None) -> Any:
        """vLLM's LoRARequest for adapter `name` (None: the base model)."""
        if name is None:
            return None
        if not self._loras:
            from vllm.lora.request import LoRARequest

            self._loras = {n: LoRARequest(n, i, path)
                           for i, (n, path) in enumerate(sorted(self.config.adapters.items()), start=1)}
        return self._loras[name]

    def _result(self, out: Any, top: int = 0) -> Result:
        """A row's Result from vLLM's RequestOutput; `top`: the most likely tokens it asked for per position."""
        prompt_tokens = len(out.prompt_token_ids) if out.prompt_token_ids is not None else None
        cached = out.num_cached_tokens or 0
        self.cached_tokens += cached
        error = getattr(out, "error", None)
        if error is not None:
            return Result(prompt_tokens=prompt_tokens, error=f"vllm failed the request: {error}",
                          extra={"code": ENGINE_REJECTED})
        if self.config.task == "embed":
            from vllm import EmbeddingRequestOutput

            return Result(embedding=EmbeddingRequestOutput.from_base(out).outputs.embedding,
                          prompt_tokens=prompt_tokens, cached_tokens=cached)
        comps = list(out.outputs)
        for comp in comps:
            if comp.finish_reason not in ("stop", "length"):
                # vLLM ends a request "error" when, among others, its grammar backend rejects a token.
                return Result(prompt_tokens=prompt_tokens, completion_tokens=len(comp.token_ids),
                              error=f"generation ended without finishing ({comp.finish_reason})",
                              extra={"code": ENGINE_REJECTED, "finish_reason": comp.finish_reason})
        comp = comps[0]
        if len(comps) == 1 and comp.logprobs is None:
            return Result(
                output=comp.text,
                prompt_tokens=prompt_tokens,
                completion_tokens=len(comp.token_ids),
                extra={"finish_reason": comp.finish_reason},
                cached_tokens=cached,
            )
        # n answers (sorted by index: vLLM may finish them in any order), or logprobs.
        comps.sort(key=lambda c: c.index)
        choices = [Choice(output=c.text, completion_tokens=len(c.token_ids), finish_reason=c.finish_reason,
                          logprobs=None if c.logprobs is None else self._logprobs(c, top))
                   for c in comps]
        return Result(output=choices[0].output, prompt_tokens=prompt_tokens,
                      completion_tokens=sum(c.completion_tokens for c in choices),
                      extra={"finish_reason": choices[0].finish_reason}, choices=choices, cached_tokens=cached)

    def _logprobs(self, comp: Any, top: int) -> list[TokenLogprob]:
        """vLLM's per-position logprobs (token id -> Logprob: the sampled token and the `top` most
        likely ones, with their ranks) as the sampled token's and the top ones'."""
        def name(i: int, lp: Any) -> str:
            return lp.decoded_token if lp.decoded_token is not None else self.tokenizer.decode([i])

        out = []
        for tid, ranked in zip(comp.token_ids, comp.logprobs, strict=True):
            best = sorted(((i, lp) for i, lp in ranked.items() if lp.rank is not None and lp.rank <= top),
                          key=lambda e: e[1].rank)
            mine = ranked[tid]
            out.append(TokenLogprob(token=name(tid, mine), logprob=float(mine.logprob),
                                    top=tuple((name(i, lp), float(lp.logprob)) for i, lp in best)))
        return out
