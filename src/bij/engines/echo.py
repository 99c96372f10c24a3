"""The echo engine: output = input text, embedding = a deterministic vector of the text.

It makes pipeline tests and benchmarks exact: any misalignment between rows and
results shows up as a row whose output is not its own input.
"""

from __future__ import annotations

import hashlib
import struct
from itertools import repeat

from bij.engines.base import (
    BASIC_SAMPLING,
    EngineBase,
    EngineConfig,
    EstimatedTokens,
    Request,
    Result,
    estimate_many,
    request_texts,
)

ECHO_DIM = 8


def echo_embedding(text: str, dim: int = ECHO_DIM) -> list[float]:
    """A unit-free vector derived from the text's hash, stable across processes."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=4 * dim).digest()
    return [round(v / 2**32, 6) for v in struct.unpack(f"<{dim}I", digest)]


def truncate_text(text: str, tokens: int, head: bool) -> str:
    """The head (embed) or tail (generate, chat) of `text` that estimates to `tokens` tokens,
    cut on a character boundary: the sides the real engines keep (see prompts.truncate_prompt)."""
    data = text.encode("utf-8")
    part = data[: tokens * 4] if head else data[len(data) - tokens * 4:]
    return part.decode("utf-8", "ignore")


class EchoEngine(EstimatedTokens, EngineBase):
    name = "echo"
    schedules_itself = False
    continuous = False
    parallel_prepare = False  # its work is Python: parsing alongside would only take turns with it

    def __init__(self, config: EngineConfig):
        self.config = config
        # The identity is deterministic (temperature and seed change nothing) and answers with
        # the text whole, whatever maxTokens says: its contract, for exact pipeline tests.
        self.honours = frozenset() if config.task == "embed" else BASIC_SAMPLING

    def load(self) -> None:
        return None

    def run(self, requests: list[Request]) -> list[Result]:
        texts = request_texts(requests)
        counts = estimate_many(texts)
        limit = self.config.max_input_tokens if self.config.truncate else None
        if limit is not None and counts and max(counts) > limit:
            for i, n in enumerate(counts):
                if n > limit:
                    texts[i], counts[i] = truncate_text(texts[i], limit, head=self.config.task == "embed"), limit
        if self.config.task == "embed":
            return [Result(embedding=echo_embedding(text), prompt_tokens=n)
                    for text, n in zip(texts, counts, strict=True)]
        return list(map(Result, texts, repeat(None), counts, counts))
