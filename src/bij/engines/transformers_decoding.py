"""The transformers engine's decoding pieces: what runs inside one Hugging Face `generate` call.

Logits processors that record logprobs (`logprob_recorder`) and keep each sequence to its grammar
(`grammar_processor` with xgrammar, `guidance_processor` with llguidance, the second backend), and the
stop strings' stopping criterion and cut (`stop_strings`, `stop_at`). The engine itself, which builds
the call and reads its answers, is `bij.engines.transformers`.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # the type of grammar_from_json_schema's options


def logprob_recorder(top: int) -> Any:
    """A logits processor that records, per step, the log-probability of the token chosen at the step
    before and the `top` most likely tokens (values and ids): O(rows x top) a step. Only the last
    step's whole distribution is held, until the next step says which token was chosen from it.
    What it records stays on the model's device until `finish`: reading it back every step would
    make the host wait for the device twice a step."""
    import torch
    from transformers import LogitsProcessor

    class Recorder(LogitsProcessor):
        def __init__(self) -> None:
            self.chosen: list[Any] = []  # step -> the chosen token's logprob, per sequence (a tensor)
            self.top: list[tuple[Any, Any]] = []  # step -> (values, ids), tensors of sequences x top
            self.last: Any = None  # the last step's log-probabilities (rows x vocab)

        def __call__(self, input_ids: Any, scores: Any) -> Any:
            if self.last is not None:
                self.chosen.append(self.last.gather(1, input_ids[:, -1:].to(self.last.device))[:, 0])
            lp = torch.log_softmax(scores.float(), dim=-1)
            if top:
                best = lp.topk(top, dim=-1)
                self.top.append((best.values, best.indices))
            self.last = lp
            return scores

        def finish(self, rows: list[list[int]]) -> tuple[list[list[float]], list[Any]]:
            """The chosen tokens' logprobs and the top tokens per step (lists, read back at once), the last
            step's resolved from `rows`."""
            if self.last is not None:
                step = len(self.chosen)
                ids = torch.tensor([r[step] if step < len(r) else 0 for r in rows])[:, None]
                self.chosen.append(self.last.gather(1, ids.to(self.last.device))[:, 0])
                self.last = None
            chosen: list[list[float]] = torch.stack(self.chosen).tolist() if self.chosen else []
            tops: list[Any] = []
            if self.top:
                values = torch.stack([v for v, _ in self.top]).tolist()
                indices = torch.stack([i for _, i in self.top]).tolist()
                tops = list(zip(values, indices, strict=True))
            return chosen, tops

    return Recorder()


def guidance_grammar(structured: tuple[str, str]) -> str:
    """A row's structured output as an llguidance grammar (compact JSON, as with xgrammar)."""
    from llguidance import LLMatcher

    kind, text = structured
    compact: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ",
                                   "key_separator": ": "}  # as xgrammar writes
    if kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(text, defaults=compact)
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=compact)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(text)
    if kind == "choice":
        return LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in json.loads(text)))
    return LLMatcher.grammar_from_lark(text)


def guidance_processor(grammars: list[str], tokenizer: Any, eos_ids: list[int], eos: int) -> Any:
    """The second grammar backend's logits processor (llguidance), one grammar per sequence; a
    sequence it cannot continue is ended with EOS and listed in `stuck`, as `grammar_processor` does."""
    import llguidance
    import llguidance.torch
    import torch
    from transformers import LogitsProcessor

    class Guidance(LogitsProcessor):
        def __init__(self) -> None:
            self.matchers = [llguidance.LLMatcher(tokenizer, g, log_level=0) for g in grammars]
            self.mask = llguidance.torch.allocate_token_bitmask(len(grammars), tokenizer.vocab_size)
            self.stuck: dict[int, int] = {}
            self.done: set[int] = set()
            self.step = 0

        def __call__(self, input_ids: Any, scores: Any) -> Any:
            device = scores.device
            on_cpu = scores.to("cpu") if device.type != "cuda" else scores
            for i, m in enumerate(self.matchers):
                if i in self.stuck or i in self.done:
                    continue
                if self.step:
                    token = int(input_ids[i, -1])
                    if token in eos_ids:
                        self.done.add(i)
                        continue
                    if not m.consume_token(token) or m.is_error():
                        self.stuck[i] = self.step
                        continue
                llguidance.torch.fill_next_token_bitmask(m, self.mask, i)
                if m.is_error() or not bool(self.mask[i].any()):
                    self.stuck[i] = self.step
                    continue
                llguidance.torch.apply_token_bitmask_inplace(on_cpu[i], self.mask[i])
            for i in self.stuck:
                on_cpu[i, :] = -torch.inf
                on_cpu[i, eos] = 0.0
            self.step += 1
            return on_cpu.to(device) if on_cpu.device != device else on_cpu

    return Guidance()


def can_start(grammar: Any) -> bool:
    """Whether some token of the vocabulary can begin an output of `grammar`."""
    import xgrammar

    matcher = xgrammar.GrammarMatcher(grammar)
    mask = xgrammar.allocate_token_bitmask(1, grammar.tokenizer_info.vocab_size)
    matcher.fill_next_token_bitmask(mask, 0)
    return bool(mask.any())


def grammar_processor(grammars: list[Any], eos: int) -> Any:
    """A logits processor that keeps each sequence to its grammar (xgrammar's masks).

    Unlike xgrammar's own processor for transformers, which asserts that every sampled token
    is accepted, a sequence its grammar cannot continue (no token of the vocabulary fits: the
    tokenizer cannot write it) is ended with EOS and listed in `stuck` (sequence -> step): its
    row fails alone, the batch goes on.
    """
    import torch
    import xgrammar
    from transformers import LogitsProcessor

    class Grammars(LogitsProcessor):
        def __init__(self) -> None:
            self.matchers = [xgrammar.GrammarMatcher(g) for g in grammars]
            self.mask = xgrammar.allocate_token_bitmask(len(grammars), grammars[0].tokenizer_info.vocab_size)
            self.stuck: dict[int, int] = {}
            self.step = 0

        def __call__(self, input_ids: Any, scores: Any) -> Any:
            live = []
            for i, m in enumerate(self.matchers):
                if i in self.stuck or m.is_terminated():
                    continue
                if self.step and not m.accept_token(int(input_ids[i, -1])):
                    self.stuck[i] = self.step
                    continue
                if m.is_terminated():  # it just took its stop token
                    continue
                m.fill_next_token_bitmask(self.mask, i)
                if not bool(self.mask[i].any()):
                    self.stuck[i] = self.step
                    continue
                live.append(i)
            device = scores.device
            on_cpu = scores.to("cpu") if device.type != "cuda" else scores
            if live:
                xgrammar.apply_token_bitmask_inplace(on_cpu, self.mask.to(on_cpu.device), indices=live)
            for i in self.stuck:
                on_cpu[i, :] = -torch.inf
                on_cpu[i, eos] = 0.0
            self.step += 1
            return on_cpu.to(device) if on_cpu.device != device else on_cpu

    return Grammars()


def stop_strings(tok: Any, stop: tuple[str, ...], width: int) -> Any:
    """A stopping criterion that ends a row's generation once its decoded text holds a stop string.

    transformers' own `stop_strings` works from token surface forms, which some tokenizers
    (word-level ones with a WordPiece decoder) cannot give; decoding the generated ids works
    for every tokenizer.
    """
    import torch
    from transformers import StoppingCriteria

    class StopStrings(StoppingCriteria):
        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            texts = tok.batch_decode(input_ids[:, width:], skip_special_tokens=True)
            return torch.tensor([any(s in t for s in stop) for t in texts], device=input_ids.device)

    return StopStrings()


def stop_at(tok: Any, ids: list[int], stop: tuple[str, ...]) -> tuple[int, str] | None:
    """(tokens generated, text before the stop string) when a stop string shows in the decoded
    `ids`, else None. The fewest tokens whose text holds a stop string are found by bisection
    (holding one only grows with more tokens); the stop string itself is not part of the text."""
    def first(text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in stop) if i >= 0]
        return min(hits) if hits else None

    if first(tok.decode(ids, skip_special_tokens=True)) is None:
        return None
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if first(tok.decode(ids[:mid], skip_special_tokens=True)) is None:
            lo = mid + 1
        else:
            hi = mid
    text = tok.decode(ids[:lo], skip_special_tokens=True)
    return lo, text[: first(text)]
