"""The vLLM engine: an adapter on vLLM's offline `LLM` class (no HTTP server in between).

vLLM batches continuously itself, so the worker drives its engine loop
(`continuous`): `submit` adds one request to `LLM.llm_engine` (`add_request`
with the prompt's token ids), `step` runs one engine step and returns the
requests that finished. The worker keeps eight times `maxNumSeqs` requests in
flight across chunk boundaries, so the running batch never drains at a chunk's
end. `run` (a whole list at once, through `LLM.generate` / `embed` / `chat`)
serves the judge's chunk-by-chunk path.

Version notes (vLLM >= 0.6.3):
- embeddings: vLLM >= 0.10 picks the pooling runner with `runner="pooling"`; older
  releases take `task="embed"` (0.7 to 0.9) or `task="embedding"` (0.6). `LLM.embed`
  exists from 0.6.6 on; before that `LLM.encode` returned the same outputs.
- a prompt vLLM rejects raises for the whole call; recent releases abort the requests
  already added, older ones leave them queued. Rows are therefore checked first (empty,
  too long), and a call that still fails is split in halves until the bad rows are
  alone; each becomes its own `Result.error`, queued leftovers are drained first.
- with `config.truncate`, a prompt over the limit is cut by bij before vLLM sees it
  (`truncate_prompt` in prompts.py: embeddings keep the head, generation the tail); a
  cut chat prompt goes in as token ids of the rendered template.
- a decoder prompt needs room for one generated token: the prompt limit is
  `max_model_len - 1` for generate and chat, `max_model_len` for embed.
"""

from __future__ import annotations

import gc
import inspect
import json
import re
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

from .base import BASIC_SAMPLING, Choice, EngineConfig, Request, Result, TokenLogprob, estimate_tokens, request_text
from .prompts import GREEDY_EPS, chat_messages, prompt_ids, truncate_prompt

# One LLM per process: it claims most of the GPU's memory, a second would not fit.
_LLM: Any = None
_LLM_KWARGS: dict[str, Any] | None = None


def snake_case(key: str) -> str:
    """`gpuMemoryUtilization` -> `gpu_memory_utilization` (already snake_case keys pass unchanged)."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", key).lower()


def llm_kwargs(config: EngineConfig, *, has_runner: bool = True, version: tuple[int, int] = (0, 10)) -> dict[str, Any]:
    """Keyword arguments for `vllm.LLM` from the engine config.

    Every key of `config.vllm` (camelCase, from spec.model.vllm) is passed through as its
    snake_case `LLM`/`EngineArgs` name. `has_runner`/`version` describe the installed
    vLLM and decide how the embedding (pooling) model is requested.
    """
    if not config.name:
        raise ValueError("engine vllm needs model.name (a model directory or a Hugging Face id)")
    kwargs: dict[str, Any] = {"model": config.name, "seed": config.seed}
    for key, value in config.vllm.items():
        kwargs[snake_case(key)] = value
    if config.adapters:
        kwargs["enable_lora"] = True
    if config.task == "embed":
        if has_runner:
            kwargs["runner"] = "pooling"
        else:
            kwargs["task"] = "embed" if version >= (0, 7) else "embedding"
    return kwargs


def _version(text: str) -> tuple[int, int]:
    parts = re.findall(r"\d+", text)[:2]
    return (int(parts[0]), int(parts[1])) if len(parts) == 2 else (0, 0)


def shared_llm(config: EngineConfig) -> Any:
    """This process's `vllm.LLM`, built on first use; asking for a different one is an error."""
    global _LLM, _LLM_KWARGS
    try:
        import vllm
    except ImportError as e:
        raise ImportError("engine vllm needs the vllm package (pip install 'bij[vllm]'; a CUDA machine)") from e
    kwargs = llm_kwargs(
        config,
        has_runner="runner" in inspect.signature(vllm.LLM.__init__).parameters,
        version=_version(getattr(vllm, "__version__", "0.0")),
    )
    if _LLM is not None:
        if kwargs != _LLM_KWARGS:
            raise RuntimeError(
                f"this process already holds a vLLM engine built with {_LLM_KWARGS}; one per process"
            )
        return _LLM
    _LLM = vllm.LLM(**kwargs)
    _LLM_KWARGS = kwargs
    return _LLM


def shutdown_llm() -> None:
    """Drop this process's LLM so that another can be built (tests; a worker simply exits)."""
    global _LLM, _LLM_KWARGS
    _LLM, _LLM_KWARGS = None, None
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass


def _structured_params(structured: tuple[str, str]) -> Any:
    """vLLM's StructuredOutputsParams for a row's structured output (compact JSON, as the
    transformers engine makes it: free whitespace lets a weak model pad forever)."""
    from vllm.sampling_params import StructuredOutputsParams

    kind, text = structured
    if kind == "json_schema":
        return StructuredOutputsParams(json=json.loads(text), disable_any_whitespace=True)
    if kind == "json_object":
        return StructuredOutputsParams(json={"type": "object"}, disable_any_whitespace=True)
    if kind == "choice":
        return StructuredOutputsParams(choice=json.loads(text))
    if kind == "regex":
        return StructuredOutputsParams(regex=text)
    return StructuredOutputsParams(grammar=text)


class VllmEngine:
    """Generate, chat or embed with vLLM's offline `LLM`; one shared instance per process."""

    name = "vllm"
    parallel_prepare = True  # its compute lets go of the interpreter: parse the next chunks meanwhile
    schedules_itself = True
    continuous = True
    # SamplingParams takes each of these as they are.
    GENERATION_FIELDS = BASIC_SAMPLING | {"topP", "topK", "minP", "stop", "presencePenalty", "frequencyPenalty",
                                          "repetitionPenalty", "n", "logprobs", "topLogprobs", "structuredOutput"}

    def __init__(self, config: EngineConfig):
        if config.task not in ("generate", "chat", "embed"):
            raise ValueError(f"engine vllm supports tasks generate, chat and embed, not {config.task!r}")
        llm_kwargs(config)  # a missing model name fails here, before any GPU work
        self.config = config
        self.honours = frozenset() if config.task == "embed" else self.GENERATION_FIELDS
        if config.adapters and config.task != "embed":
            self.honours = self.honours | {"adapters"}
        # One LoRARequest per adapter, ids 1.. in name order (vLLM keys its adapter cache by id).
        self._loras: dict[str, Any] = {}
        self.llm: Any = None
        self.tokenizer: Any = None
        self._max_model_len: int | None = None
        self._ids: dict[int, tuple[Request, list[int] | str]] = {}  # count_tokens' ids, kept for submit
        self._params: Any = None
        self._unfinished = 0
        self._top: dict[int, int] = {}  # tags of requests in flight that asked for top logprobs
        self._parts: dict[int, dict[int, Any]] = {}  # rows asking for n > 1 answers: the answers so far
        self.steps = 0  # engine steps taken through `step`
        self.occupied = 0  # min(unfinished, maxNumSeqs) summed over steps: what could run

    def load(self) -> None:
        """Build (or reuse) the process's LLM; vllm is imported only here."""
        if self.llm is not None:
            return
        self.llm = shared_llm(self.config)
        self.tokenizer = self.llm.get_tokenizer()
        self._max_model_len = self.llm.llm_engine.model_config.max_model_len

    def _loaded(self) -> Any:
        if self.llm is None:
            raise RuntimeError("VllmEngine.load() must run before count_tokens() or run()")
        return self.llm

    def max_input_tokens(self) -> int | None:
        """max_model_len (minus one for the first generated token), or config.max_input_tokens if smaller."""
        self._loaded()
        limit = self._max_model_len
        if limit is not None and self.config.task != "embed":
            limit -= 1
        limits = [n for n in (limit, self.config.max_input_tokens) if n]
        return min(limits) if limits else None

    def _prompt_ids(self, requests: list[Request]) -> list[list[int] | str]:
        """Token ids per request as vLLM will see them (it adds special tokens to plain prompts,
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
        """Sequences vLLM runs at once (max_num_seqs)."""
        return int(self.config.vllm.get("maxNumSeqs", self.config.vllm.get("max_num_seqs", 256)))

    def unfinished(self) -> int:
        return self._unfinished

    def submit(self, tag: int, request: Request) -> None:
        """Add one request to vLLM's engine; a prompt it cannot take raises ValueError (that row fails)."""
        llm = self._loaded()
        kept = self._ids.pop(id(request), None)
        prompt = kept[1] if kept is not None and kept[0] is request else self._prompt_ids([request])[0]
        if isinstance(prompt, str):
            raise ValueError(prompt)
        if not prompt:
            raise ValueError("empty prompt")
        limit = self.max_input_tokens()
        if limit is not None and len(prompt) > limit:
            if not self.config.truncate:
                raise ValueError(f"prompt is {len(prompt)} tokens, longer than the model's limit of {limit}")
            prompt = truncate_prompt(self.tokenizer, request, prompt, limit, embed=self.config.task == "embed")
        if self.config.task == "embed":
            params = self._pooling_params()
        else:
            params = self._sampling_params([request])[0]
        llm.llm_engine.add_request(str(tag), {"prompt_token_ids": prompt}, params,
                                   **({"lora_request": self._lora(request.adapter)} if request.adapter else {}))
        if request.sampling.logprobs and request.sampling.top_logprobs:
            self._top[tag] = request.sampling.top_logprobs
        if request.sampling.n and request.sampling.n > 1:
            self._parts[tag] = {}
        self._unfinished += 1

    def step(self) -> list[tuple[int, Result]]:
        """One vLLM engine step; the requests that finished in it, as (tag, result)."""
        engine = self._loaded().llm_engine
        self.steps += 1
        self.occupied += min(self._unfinished, self.concurrency())
        done = []
        for out in engine.step():
            tag = int(out.request_id)
            parts = self._parts.get(tag)
            if parts is not None:
                # n > 1: vLLM reports each answer on its own, under the row's id; the row is
                # finished with its last answer.
                for comp in out.outputs:
                    parts[comp.index] = comp
                if getattr(out, "finished", True):
                    del self._parts[tag]
                    out = SimpleNamespace(prompt_token_ids=out.prompt_token_ids,
                                          outputs=[parts[i] for i in sorted(parts)])
                    done.append((tag, self._result(out, self._top.pop(tag, 0))))
            elif getattr(out, "finished", True):
                done.append((tag, self._result(out, self._top.pop(tag, 0))))
        self._unfinished -= len(done)
        return done

    def _loras_of(self, requests: list[Request]) -> dict[str, Any]:
        """`lora_request` for LLM.generate/chat: one per row (None: the base model), when any row has one."""
        if not any(r.adapter for r in requests):
            return {}
        return {"lora_request": [self._lora(r.adapter) for r in requests]}

    def _lora(self, name: str | None) -> Any:
        """vLLM's LoRARequest for adapter `name` (None: the base model)."""
        if name is None:
            return None
        if not self._loras:
            from vllm.lora.request import LoRARequest

            self._loras = {n: LoRARequest(n, i, path)
                           for i, (n, path) in enumerate(sorted(self.config.adapters.items()), start=1)}
        return self._loras[name]

    def _pooling_params(self) -> Any:
        if self._params is None:
            from vllm import PoolingParams

            try:
                self._params = PoolingParams(task="embed")
            except TypeError:  # releases before pooling tasks
                self._params = PoolingParams()
        return self._params

    def run(self, requests: list[Request]) -> list[Result]:
        """Run a whole chunk through vLLM; bad rows become row errors, the rest keep their order."""
        llm = self._loaded()
        results = [Result() for _ in requests]
        if not requests:
            return results
        limit = self.max_input_tokens()
        prompts = self._prompt_ids(requests)
        runnable: list[int] = []
        cut: list[int] = []  # chat rows cut to the limit: sent as token ids, the template already applied
        task = self.config.task
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                results[i] = Result(error=p)
            elif not p:
                results[i] = Result(prompt_tokens=0, error="empty prompt")
            elif limit is not None and len(p) > limit and not self.config.truncate:
                results[i] = Result(
                    prompt_tokens=len(p), error=f"prompt is {len(p)} tokens, longer than the model's limit of {limit}"
                )
            elif limit is not None and len(p) > limit:
                prompts[i] = truncate_prompt(self.tokenizer, requests[i], p, limit, embed=task == "embed")
                (cut if task == "chat" else runnable).append(i)
            else:
                runnable.append(i)

        call: Callable[[list[int]], list[Any]]
        by_ids: Callable[[list[int]], list[Any]] | None = None
        if task == "embed":
            embed = getattr(llm, "embed", None) or llm.encode

            def call(idx: list[int]) -> list[Any]:
                # Token ids, not text: vLLM skips tokenizing again what was tokenized to check the rows.
                return list(embed([{"prompt_token_ids": prompts[i]} for i in idx], use_tqdm=False))
        else:
            params = self._sampling_params(requests)

            def by_ids(idx: list[int]) -> list[Any]:
                return list(
                    llm.generate(
                        [{"prompt_token_ids": prompts[i]} for i in idx],
                        sampling_params=[params[i] for i in idx],
                        use_tqdm=False,
                        **self._loras_of([requests[i] for i in idx]),
                    )
                )

            if task == "generate":
                call = by_ids
            else:
                # LLM.chat renders the template itself (content-part formats, model quirks).
                def call(idx: list[int]) -> list[Any]:
                    convs = [requests[i].messages or chat_messages(requests[i]) for i in idx]
                    return list(llm.chat(convs, sampling_params=[params[i] for i in idx], use_tqdm=False,
                                         **self._loras_of([requests[i] for i in idx]),
                                         chat_template=self.config.chat_template,
                                         chat_template_kwargs=self.config.chat_template_kwargs or None))

        outs = self._isolate(runnable, call)
        if cut and by_ids is not None:
            outs.update(self._isolate(cut, by_ids))
        for i, out in outs.items():
            s = requests[i].sampling
            results[i] = out if isinstance(out, Result) else self._result(out, s.top_logprobs or 0)
        return results

    def _sampling_params(self, requests: Sequence[Request]) -> list[Any]:
        """One SamplingParams per request; identical asks share one object."""
        from vllm import SamplingParams

        cache: dict[tuple[Any, ...], Any] = {}
        out = []
        for r in requests:
            greedy = r.temperature < GREEDY_EPS
            # A seeded row samples the same tokens whatever else shares its batch (resume-safe).
            seed = None if greedy else (r.seed if r.seed is not None else self.config.seed)
            s = r.sampling
            # Only the fields a row sets: vLLM's own defaults stand for the rest.
            extra = tuple((k, v) for k, v in (
                ("top_p", s.top_p), ("top_k", s.top_k if s.top_k else None), ("min_p", s.min_p),
                ("stop", list(s.stop) if s.stop else None), ("presence_penalty", s.presence_penalty),
                ("frequency_penalty", s.frequency_penalty), ("repetition_penalty", s.repetition_penalty),
                ("n", s.n if s.n and s.n > 1 else None),
                # vLLM returns the sampled token's logprob and this many of the most likely ones.
                ("logprobs", (s.top_logprobs or 0) if s.logprobs else None),
            ) if v is not None)
            key = (r.max_tokens, 0.0 if greedy else r.temperature, seed, repr(extra), s.structured_output)
            if key not in cache:
                more = dict(extra)
                if s.structured_output is not None:
                    more["structured_outputs"] = _structured_params(s.structured_output)
                cache[key] = SamplingParams(max_tokens=key[0], temperature=key[1], seed=seed, **more)
            out.append(cache[key])
        return out

    def _isolate(self, idx: list[int], call: Callable[[list[int]], list[Any]]) -> dict[int, Any]:
        """Outputs by row index; a call vLLM rejects is split until each bad row stands alone."""
        if not idx:
            return {}
        try:
            outs = call(idx)
        except ValueError as e:  # vLLM's input validation; engine failures and our own bugs propagate
            self._drain()
            if len(idx) == 1:
                return {idx[0]: Result(error=f"vllm rejected the request: {e}")}
            mid = len(idx) // 2
            return {**self._isolate(idx[:mid], call), **self._isolate(idx[mid:], call)}
        if len(outs) != len(idx):
            raise RuntimeError(f"vllm returned {len(outs)} outputs for {len(idx)} prompts")
        return dict(zip(idx, outs, strict=True))

    def _drain(self) -> None:
        # Releases before the abort-on-error fix keep the requests added before the bad one
        # queued; they would come back mixed into the next call's outputs.
        engine = self.llm.llm_engine
        if engine.has_unfinished_requests():
            self.llm._run_engine(use_tqdm=False)

    def _result(self, out: Any, top: int = 0) -> Result:
        """A row's Result from vLLM's RequestOutput; `top`: the most likely tokens it asked for per position."""
        prompt_tokens = len(out.prompt_token_ids) if out.prompt_token_ids is not None else None
        if self.config.task == "embed":
            emb = out.outputs.embedding
            return Result(embedding=emb.tolist() if hasattr(emb, "tolist") else list(emb), prompt_tokens=prompt_tokens)
        comps = list(out.outputs)
        for comp in comps:
            if comp.finish_reason not in ("stop", "length"):
                return Result(
                    prompt_tokens=prompt_tokens, error=f"generation ended without finishing ({comp.finish_reason})"
                )
        comp = comps[0]
        if len(comps) == 1 and comp.logprobs is None:
            return Result(
                output=comp.text,
                prompt_tokens=prompt_tokens,
                completion_tokens=len(comp.token_ids),
                extra={"finish_reason": comp.finish_reason},
            )
        # n answers (sorted by index: vLLM may finish them in any order), or logprobs.
        comps.sort(key=lambda c: c.index)
        choices = [Choice(output=c.text, completion_tokens=len(c.token_ids), finish_reason=c.finish_reason,
                          logprobs=None if c.logprobs is None else self._logprobs(c, top))
                   for c in comps]
        return Result(output=choices[0].output, prompt_tokens=prompt_tokens,
                      completion_tokens=sum(c.completion_tokens for c in choices),
                      extra={"finish_reason": choices[0].finish_reason}, choices=choices)

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
