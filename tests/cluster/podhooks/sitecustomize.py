"""Test hooks for worker pods on the local cluster, on when env BIJ_TEST_GATES names a folder.

A pod knows its round Job and index from its name (`<job>-<index>-<suffix>`, HOSTNAME) and
JOB_COMPLETION_INDEX; files in the folder steer it, so a test drives each state instead of
racing the clock:
  exit-<job>-<index>   "<code> <times>": the first <times> pods of that index exit with <code> at start
  hold-<job>-<index>   "<n>": after n engine calls, each further call waits while the file exists (the
                       simulated engine: after n engine steps, each further step)
  holdrow-<job>        "<text>": an engine call with a row containing <text> waits while the file exists,
                       whichever lane works that row's shard
  holdrow-all          the same for every job (for jobs whose names are made elsewhere, as bij-api does)
  computed-<job>-<index>  written by the pods: one line per row the engine computed
  started-<job>-<index>   written by the pods: one line per pod start
"""

import os
import sys
import time
from pathlib import Path

_gates = os.environ.get("BIJ_TEST_GATES")
_index = os.environ.get("JOB_COMPLETION_INDEX")
if _gates and _index is not None and Path(sys.argv[0]).name == "bij-worker":
    _folder = Path(_gates)
    _job = os.environ.get("HOSTNAME", "").rsplit("-", 2)[0]
    _key = f"{_job}-{_index}"
    with open(_folder / f"started-{_key}", "a") as f:
        f.write(f"{os.getpid()}\n")
    _exit = _folder / f"exit-{_key}"
    if _exit.exists():
        code, times = (int(x) for x in _exit.read_text().split())
        if len((_folder / f"started-{_key}").read_text().splitlines()) <= times:
            print(f"test hook: exiting with {code}", file=sys.stderr, flush=True)
            os._exit(code)

    from bij.engines import echo
    from bij.engines.base import request_text

    _run = echo.EchoEngine.run
    _calls = [0]

    def _hold(calls):
        """Wait while hold-<job>-<index> exists and says fewer than `calls` engine calls."""
        hold = _folder / f"hold-{_key}"
        while hold.exists() and calls > int(hold.read_text() or 0):
            time.sleep(0.05)

    def run(self, requests):
        _calls[0] += 1
        _hold(_calls[0])
        for hold_row in (_folder / f"holdrow-{_job}", _folder / "holdrow-all"):
            if hold_row.exists():
                needle = hold_row.read_text()
                if needle and any(needle in request_text(r) for r in requests):
                    while hold_row.exists():
                        time.sleep(0.05)
        out = _run(self, requests)
        with open(_folder / f"computed-{_key}", "a") as f:
            f.write("".join(request_text(r).replace("\n", " ") + "\n" for r in requests))
        return out

    echo.EchoEngine.run = run

    from bij.engines import simulated

    _step = simulated.SimulatedEngine.step
    _steps = [0]

    def step(self):
        if self.unfinished():  # a step that runs sequences (an idle one returns at once)
            _steps[0] += 1
            _hold(_steps[0])
        return _step(self)

    simulated.SimulatedEngine.step = step
