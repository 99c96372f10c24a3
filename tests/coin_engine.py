"""A deterministic engine whose outputs a regex judge approves at a known rate.

Output = the input text plus `` #NN``, where NN (0-99) is a hash of the text and
the request's seed. Attempts use different seeds, so a retry re-rolls NN; a
judge with pattern ``#(\\d)$`` or ``#[0-8]\\d$`` approves 10% or 90% of attempts.

Run as a worker (``python tests/coin_engine.py --manifest ...``), it is the real
`bij-worker` with this engine in place of the spec's, plus optional simulated
costs for benchmarks: COIN_LOAD_S (model load), COIN_BATCH_S and COIN_ROW_S
(per batch and per row), and COIN_LOG (a file where every computed row is
appended, to count recomputation).
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from typing import Any

from bij.engines.base import BASIC_SAMPLING, EngineBase, EngineConfig, Request, Result, estimate_tokens, request_text


def coin(text: str, seed: int | None) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}|{text}".encode(), digest_size=4).digest(), "little") % 100


def approve_pattern(rate_percent: int) -> str:
    """A regex approving outputs whose coin is below `rate_percent` (10, 30, 50, 70 or 90)."""
    tens = rate_percent // 10
    return rf"#[0-{tens - 1}]\d$" if tens > 1 else r"#0\d$"


class CoinEngine(EngineBase):
    name = "coin"
    schedules_itself = False
    continuous = parallel_prepare = False
    honours = BASIC_SAMPLING

    def __init__(self, config: EngineConfig):
        self.config = config
        self.calls: list[list[Request]] = []
        self.load_s = float(os.environ.get("COIN_LOAD_S", "0"))
        self.batch_s = float(os.environ.get("COIN_BATCH_S", "0"))
        self.row_s = float(os.environ.get("COIN_ROW_S", "0"))
        self.log = os.environ.get("COIN_LOG")

    def load(self) -> None:
        time.sleep(self.load_s)

    def count_tokens(self, requests: list[Request]) -> list[int]:
        return [estimate_tokens(request_text(r)) for r in requests]

    def max_input_tokens(self) -> int | None:
        return None

    def run(self, requests: list[Request]) -> list[Result]:
        self.calls.append(list(requests))
        time.sleep(self.batch_s + self.row_s * len(requests))
        out = []
        for r in requests:
            text = request_text(r)
            out.append(Result(output=f"{text} #{coin(text, r.seed):02d}", prompt_tokens=1, completion_tokens=1))
        if self.log:
            with open(self.log, "a") as f:
                f.write("".join(f"{request_text(r)}\t{r.seed}\n" for r in requests))
        return out


def install() -> None:
    """Make every engine name build a CoinEngine (the worker process only)."""
    import bij.engines as engines
    import bij.worker.main as main

    def create(engine: str, config: EngineConfig) -> Any:
        return CoinEngine(config)

    engines.create_engine = create  # type: ignore[assignment]
    main.create_engine = create  # type: ignore[assignment]


def worker_cmd() -> list[str]:
    return [sys.executable, os.path.abspath(__file__)]


if __name__ == "__main__":
    install()
    from bij.cli.worker import main as worker_main

    sys.exit(worker_main(sys.argv[1:]))
