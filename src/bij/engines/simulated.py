"""The simulated engine: continuous batching on a clock, for dry runs, cost estimates and benchmarks.

It behaves like a continuous-batching server (vLLM) with a fixed step time, and
computes nothing. Each step takes `stepSeconds` (slept) and adds one token to
every running sequence, at most `maxNumSeqs` at once; a request submitted
between steps joins at the next one. A row's output is the first
k = min(word count, max tokens) whitespace-separated words of its text joined by
single spaces, one word per step; usage counts words as tokens. Embeddings take
one step and are the echo engine's vector of the text.

Rehearsing a job with it exercises the whole pipeline (sharding, streaming,
commits, resume, publish) at the speed the step time says, and its step count
and occupancy say what the same schedule would cost on the real engine.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from bij.engines.base import BASIC_SAMPLING, EngineBase, EngineConfig, Request, Result, request_text, run_to_completion
from bij.engines.echo import echo_embedding

# The model load is slept once per process, as a real engine loads once.
_LOADED = False


@dataclass(slots=True)
class _Seq:
    tag: int
    words: list[str]
    k: int  # tokens to generate
    done: int = 0


class SimulatedEngine(EngineBase):
    """Continuous batching with `model.simulated: {maxNumSeqs, stepSeconds, loadSeconds}`."""

    name = "simulated"
    continuous = True
    schedules_itself = True
    parallel_prepare = False  # chunks are parsed in the shard's own thread

    def __init__(self, config: EngineConfig):
        sim = config.simulated
        self.config = config
        # Its output is deterministic (temperature and seed change nothing) and maxTokens caps it.
        self.honours = frozenset() if config.task == "embed" else BASIC_SAMPLING
        # Validated as the spec validates them (contract.spec_model.SimulatedOptions).
        self.max_num_seqs = sim.max_num_seqs
        self.step_seconds = sim.step_seconds
        self.load_seconds = sim.load_seconds
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self.steps = 0  # steps taken
        self.occupied = 0  # running sequences summed over steps: occupied / (steps x maxNumSeqs) is occupancy

    def load(self) -> None:
        global _LOADED
        if not _LOADED and self.load_seconds:
            time.sleep(self.load_seconds)
        _LOADED = True

    def count_tokens(self, requests: list[Request]) -> list[int]:
        """Words per prompt: the simulated tokenizer."""
        return [max(1, len(request_text(r).split())) for r in requests]

    def max_input_tokens(self) -> int | None:
        return self.config.max_input_tokens

    def concurrency(self) -> int:
        return self.max_num_seqs

    def submit(self, tag: int, request: Request) -> None:
        words = request_text(request).split()
        limit = self.config.max_input_tokens
        if self.config.truncate and limit and len(words) > limit:
            # The sides the real engines keep: the head for embeddings, the tail for generation.
            words = words[:limit] if self.config.task == "embed" else words[-limit:]
        k = 1 if self.config.task == "embed" else min(len(words), request.max_tokens)
        self._waiting.append(_Seq(tag, words, max(1, k)))

    def unfinished(self) -> int:
        return len(self._waiting) + len(self._running)

    def abort(self, tags: Sequence[int] | None = None) -> None:
        """Drop requests not yet returned: those tags, or all of them."""
        if tags is None:
            self._waiting.clear()
            self._running.clear()
            return
        gone = set(tags)
        self._waiting = deque(s for s in self._waiting if s.tag not in gone)
        self._running = [s for s in self._running if s.tag not in gone]

    def step(self) -> list[tuple[int, Result]]:
        """One step: waiting requests join while there is room, every running sequence gains a token."""
        while self._waiting and len(self._running) < self.max_num_seqs:
            self._running.append(self._waiting.popleft())
        if not self._running:
            return []
        if self.step_seconds:
            time.sleep(self.step_seconds)
        self.steps += 1
        self.occupied += len(self._running)
        finished: list[tuple[int, Result]] = []
        still: list[_Seq] = []
        for seq in self._running:
            seq.done += 1
            if seq.done < seq.k:
                still.append(seq)
            else:
                finished.append((seq.tag, self._result(seq)))
        self._running = still
        return finished

    def _result(self, seq: _Seq) -> Result:
        n = len(seq.words)
        if self.config.task == "embed":
            return Result(embedding=echo_embedding(" ".join(seq.words)), prompt_tokens=n)
        return Result(output=" ".join(seq.words[: seq.k]), prompt_tokens=n, completion_tokens=seq.k,
                      extra={"finish_reason": "stop" if seq.k >= n else "length"})

    def run(self, requests: list[Request]) -> list[Result]:
        return run_to_completion(self, requests)
