"""Engine.close(): the worker closes its lane's engine once, as the lane ends, on every path; closing an
engine again does nothing."""

from __future__ import annotations

import functools
import logging
from types import SimpleNamespace
from typing import Any

import pytest
from input_rows import numbered

import bij.worker.main as worker_main
from bij.contract import layout
from bij.contract.codes import EXIT_BAD_CONFIG, EXIT_FAILED, EXIT_OK
from bij.engines import EngineConfig, Request
from bij.engines.echo import EchoEngine
from bij.steps.planner import plan_round

rows = functools.partial(numbered, filler="q", period=40)


class Closing(EchoEngine):
    """An echo engine that counts its closes, and fails where it is told to."""

    def __init__(self, config: EngineConfig, fail: str | None = None):
        super().__init__(config)
        self.fail = fail
        self.closes = 0

    def load(self) -> None:
        if self.fail == "load":
            raise ValueError("no such model")
        super().load()

    def run(self, requests: list[Request]) -> Any:
        if self.fail == "run":
            raise RuntimeError("the device is gone")
        return super().run(requests)

    def close(self) -> None:
        self.closes += 1
        if self.fail == "close":
            raise RuntimeError("cannot close")
        super().close()


def lane(file_place: Any, make_job: Any, monkeypatch: pytest.MonkeyPatch, fail: str | None = None,
         n: int = 40) -> tuple[int, list[Closing]]:
    """Run lane 0 of a planned round in this process with Closing engines; its exit code and the engines."""
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", rows(n)), workers={"parallelism": 1},
                      sharding={"chunkRows": 8, "targetShardBytes": 1 << 20})
    plan_round(job, 0)
    built: list[Closing] = []

    def create(engine: str, config: EngineConfig) -> Closing:
        built.append(Closing(config, fail))
        return built[-1]

    monkeypatch.setattr(worker_main, "create_engine", create)
    args = worker_main.parse_args(["--manifest", layout.round_manifest_uri(job, 0), "--index", "0",
                                   "--drain-seconds", "0"])
    return worker_main.Lane(args).run(), built


def test_a_lane_closes_its_engine_once_when_its_shards_are_done(file_place, make_job, monkeypatch):
    code, built = lane(file_place, make_job, monkeypatch)
    assert code == EXIT_OK
    assert [e.closes for e in built] == [1]


@pytest.mark.parametrize(("fail", "code"), [("run", EXIT_FAILED), ("load", EXIT_BAD_CONFIG)])
def test_a_lane_that_fails_closes_its_engine_once(file_place, make_job, monkeypatch, fail, code):
    got, built = lane(file_place, make_job, monkeypatch, fail=fail)
    assert got == code
    assert [e.closes for e in built] == [1]


def test_an_engine_that_fails_to_close_does_not_change_the_lanes_exit(file_place, make_job, monkeypatch, caplog):
    with caplog.at_level(logging.ERROR, logger="bij.worker"):
        code, built = lane(file_place, make_job, monkeypatch, fail="close")
    assert code == EXIT_OK and [e.closes for e in built] == [1]
    assert "closing the engine" in caplog.text


def test_closing_an_engine_twice_does_nothing_the_second_time():
    echo = EchoEngine(EngineConfig(task="generate"))
    echo.load()
    echo.close()
    echo.close()


def test_the_http_engine_ends_its_sending_threads_at_close():
    from bij.contract.spec_model import HttpOptions
    from bij.engines.http import HttpEngine

    # Nothing listens on port 9 of localhost: each row fails fast, no server needed.
    engine = HttpEngine(EngineConfig(task="generate", name="m", http=HttpOptions(
        base_url="http://127.0.0.1:9", max_in_flight=3, retries=0, timeout_seconds=1)))
    engine.submit(0, Request(text="hi"))
    threads = list(engine._threads)
    assert len(threads) == 3
    engine.close()
    engine.close()
    for t in threads:
        t.join(timeout=5)
    assert not any(t.is_alive() for t in threads)
    assert engine.unfinished() == 0


def test_the_vllm_engine_stops_the_processes_llm_once(monkeypatch):
    from bij.engines import vllm, vllm_llm

    stops: list[Any] = []
    core = SimpleNamespace(shutdown=lambda timeout=None: stops.append(timeout))
    llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=core))
    monkeypatch.setattr(vllm_llm, "_LLM", llm)
    monkeypatch.setattr(vllm_llm, "_LLM_KWARGS", {"model": "m"})
    monkeypatch.setattr(vllm_llm, "_CLOSED", [])
    engine = vllm.VllmEngine(EngineConfig(task="generate", name="m"))
    engine.close()  # never loaded: nothing of its own to stop
    assert stops == [] and vllm_llm.holds_llm()
    engine.llm = llm  # as load() leaves it
    engine.close()
    engine.close()
    assert stops == [0]  # at once, not after vLLM's grace period
    assert not vllm_llm.holds_llm() and vllm_llm._CLOSED == [llm]  # kept, not freed, as the process exits
