"""A step caps glibc's malloc arenas, so that its reader threads' freed memory does not pile up in an arena
each (the finish statistics at 1M shards: 54.5 MB with glibc's default, 45.0 MB capped)."""

from __future__ import annotations

import subprocess
import sys

import pytest

# 16 threads that each allocate (as the steps' record readers do), then glibc's own count of its arenas.
COUNT_ARENAS = """
import ctypes, sys, threading
from bij.steps.arenas import cap_malloc_arenas
if sys.argv[1] == "capped":
    assert cap_malloc_arenas()
together = threading.Barrier(16)
def work():  # all at once, past pymalloc's small objects (512 bytes): malloc's own
    together.wait()
    keep = [bytes(4000) for _ in range(200)]
    together.wait()
    del keep
threads = [threading.Thread(target=work) for _ in range(16)]
for t in threads: t.start()
for t in threads: t.join()
ctypes.CDLL(None).malloc_stats()
"""


def arenas(mode: str) -> int:
    p = subprocess.run([sys.executable, "-c", COUNT_ARENAS, mode], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return sum(1 for line in p.stderr.splitlines() if line.startswith("Arena "))


def test_a_step_holds_two_malloc_arenas_where_its_threads_would_each_make_one() -> None:
    if sys.platform != "linux" or arenas("default") == 0:
        pytest.skip("not glibc: no malloc_stats")
    assert arenas("default") > 2  # glibc's default: an arena a thread (8 per core at most)
    assert arenas("capped") <= 2


def test_the_step_main_caps_the_arenas_before_it_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    from bij.steps import main as step_main

    calls: list[str] = []
    monkeypatch.setattr(step_main, "cap_malloc_arenas", lambda: calls.append("capped") or True)
    monkeypatch.setattr(step_main, "sink_from_env", lambda env: calls.append("sink") or None)
    assert step_main.main(["plan", "--job-spec", "{}", "--key", "k"], env={}) == 1  # nowhere to report
    assert calls == ["capped", "sink"]
