"""The transformers engine: a causal LM with Hugging Face `generate`, tasks generate and chat.

For small models, CPU runs and tests. Choices a user can observe:

- Prompt tokens are the ids the model receives: the tokenizer's special tokens for
  `generate`, the rendered chat template (which carries its own BOS) for `chat`.
- Completion tokens count generated ids up to and including the first EOS, never padding.
- Sampling is plain temperature sampling over the whole vocabulary (no top-k, top-p or
  repetition penalty from the model's generation_config), as vLLM does with
  `SamplingParams(temperature=...)`, so both engines answer the same request alike.
  Temperature 0 is greedy.
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

from typing import Any

from . import hub
from .base import EngineConfig, Request, Result
from .prompts import GREEDY_EPS, count_prompt_tokens, pick_device, prompt_ids, truncate_prompt


class TransformersEngine:
    """A causal LM loaded with AutoModelForCausalLM from a local path or a hub id (tasks generate and chat).

    bf16 on a GPU, fp32 on CPU; batched generation with left padding. A hub id comes from the
    model cache, or is downloaded into it unless HF_HUB_OFFLINE is set (see `hub`).
    """

    name = "transformers"
    parallel_prepare = True  # its compute lets go of the interpreter: parse the next chunks meanwhile
    schedules_itself = False

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
        if self.config.task == "chat" and not getattr(tokenizer, "chat_template", None):
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
        return prompt_ids(self.tokenizer, requests, chat=self.config.task != "generate")

    def count_tokens(self, requests: list[Request]) -> list[int]:
        """Prompt tokens per request as the model receives them (batched tokenizer calls)."""
        self._loaded()
        return count_prompt_tokens(self.tokenizer, requests, chat=self.config.task != "generate")

    def run(self, requests: list[Request]) -> list[Result]:
        """Generate for the batch; rows that cannot run (too long, bad template) become row errors."""
        self._loaded()
        results = [Result() for _ in requests]
        limit = self.max_input_tokens()
        groups: dict[float, list[int]] = {}
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
                # One generate call serves one temperature; rows of the same job usually share it.
                temp = 0.0 if req.temperature < GREEDY_EPS else req.temperature
                groups.setdefault(temp, []).append(i)
                ready[i] = p
        for temp, idx in groups.items():
            outs = self._generate(temp, [requests[i] for i in idx], [ready[i] for i in idx])
            for i, res in zip(idx, outs, strict=True):
                results[i] = res
        return results

    def _generate(self, temperature: float, requests: list[Request], prompts: list[list[int]]) -> list[Result]:
        import torch

        model, tok = self.model, self.tokenizer
        batch = tok.pad({"input_ids": prompts}, padding=True, return_tensors="pt")
        input_ids = batch["input_ids"].to(self.device)
        attention_mask = batch["attention_mask"].to(self.device)
        width = input_ids.shape[1]
        # Rows in one batch share the step count: generate for the longest ask, cut each row to its own.
        caps = [r.max_tokens for r in requests]
        max_new = max(caps)
        if self._max_positions:
            # Past the position table a learned-position model fails and a RoPE one degrades.
            room = max(0, self._max_positions - width)
            max_new = min(max_new, room)
            caps = [min(c, room) for c in caps]
        kwargs: dict[str, Any] = {"max_new_tokens": max_new, "pad_token_id": tok.pad_token_id}
        if self._eos_ids:
            kwargs["eos_token_id"] = self._eos_ids
        if temperature > 0:
            seed = requests[0].seed if requests[0].seed is not None else self.config.seed
            torch.manual_seed(seed)
            kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        else:
            kwargs.update(do_sample=False)
        if max_new > 0:
            with torch.inference_mode():
                out = model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
            new = out[:, width:].cpu()
        else:
            new = torch.empty((len(prompts), 0), dtype=torch.long)

        # Tokens up to and including the first EOS; after it come only pads.
        steps = new.shape[1]
        if self._eos_ids and steps:
            is_eos = torch.isin(new, torch.tensor(self._eos_ids))
            first = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1) + 1, steps)
            until_eos = first.tolist()
            stopped = is_eos.any(dim=1).tolist()
        else:
            until_eos, stopped = [steps] * len(prompts), [False] * len(prompts)
        counts = [min(n, cap) for n, cap in zip(until_eos, caps, strict=True)]
        rows = new.tolist()
        texts = tok.batch_decode([row[:n] for row, n in zip(rows, counts, strict=True)], skip_special_tokens=True)
        return [
            Result(
                output=text,
                prompt_tokens=len(p),
                completion_tokens=n,
                extra={"finish_reason": "stop" if s and e <= cap else "length"},
            )
            for text, p, n, s, e, cap in zip(texts, prompts, counts, stopped, until_eos, caps, strict=True)
        ]
