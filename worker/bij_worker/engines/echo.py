"""The echo engine: output = input text, embedding = a deterministic vector of the text.

It makes pipeline tests and benchmarks exact: any misalignment between rows and
results shows up as a row whose output is not its own input.
"""

from __future__ import annotations

import hashlib
import struct

from .base import EngineConfig, Request, Result, estimate_tokens, request_text

ECHO_DIM = 8


def echo_embedding(text: str, dim: int = ECHO_DIM) -> list[float]:
    """A unit-free vector derived from the text's hash, stable across processes."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=4 * dim).digest()
    return [round(v / 2**32, 6) for v in struct.unpack(f"<{dim}I", digest)]


class EchoEngine:
    name = "echo"
    schedules_itself = False

    def __init__(self, config: EngineConfig):
        self.config = config

    def load(self) -> None:
        return None

    def count_tokens(self, requests: list[Request]) -> list[int]:
        return [estimate_tokens(request_text(r)) for r in requests]

    def max_input_tokens(self) -> int | None:
        return self.config.max_input_tokens

    def run(self, requests: list[Request]) -> list[Result]:
        out = []
        for r in requests:
            text = request_text(r)
            n = estimate_tokens(text)
            if self.config.task == "embed":
                out.append(Result(embedding=echo_embedding(text), prompt_tokens=n))
            else:
                out.append(Result(output=text, prompt_tokens=n, completion_tokens=n))
        return out
