"""One loaded continuous engine shared by the shards a lane works at once (`EngineShare`, a shard's
`EngineView` of it).

With a continuous-batching engine (vLLM, simulated) a lane starts its next shard as soon as
every row of the current one is in the engine, so the engine's running batch does not drain at
each shard's end; at most two shards of a lane are open at once.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from bij.engines.base import ContinuousEngine, Request, Result, run_to_completion


class EngineShare:
    """One loaded continuous engine, shared by the shards a lane works at once.

    While one shard's last rows run (its tail), the lane starts its next shard, so the engine's
    running batch never drains between shards. Each shard's worker talks to its own `view`:
    tags are mapped to engine-wide ones, and a step's results go to the view whose rows they are
    (kept for it until it steps next). A closed view's rows still in the engine finish there,
    and their results are dropped.
    """

    def __init__(self, engine: ContinuousEngine):
        self.engine = engine
        self.lock = threading.Lock()
        self._owner: dict[int, tuple[int, int]] = {}  # engine tag -> (view, its tag)
        self._inbox: dict[int, list[tuple[int, Result]]] = {}
        self._closed: set[int] = set()
        self._next_tag = 0
        self._next_view = 0

    def view(self) -> EngineView:
        with self.lock:
            self._next_view += 1
            self._inbox[self._next_view] = []
            return EngineView(self, self._next_view)

    def submit(self, view: int, tag: int, request: Request) -> None:
        with self.lock:
            g = self._next_tag
            self._next_tag += 1
            self.engine.submit(g, request)  # a ValueError: this row fails alone, nothing recorded
            self._owner[g] = (view, tag)

    def step(self, view: int) -> list[tuple[int, Result]]:
        with self.lock:
            mine = self._inbox[view]
            if mine:
                self._inbox[view] = []
                return mine
            for g, res in self.engine.step():
                owner, tag = self._owner.pop(g)
                if owner == view:
                    mine.append((tag, res))
                elif owner not in self._closed:
                    self._inbox[owner].append((tag, res))
            self._inbox[view] = []
            return mine

    def close(self, view: int) -> None:
        with self.lock:
            self._closed.add(view)
            self._inbox.pop(view, None)
            # Its rows still in the engine are nobody's now: aborting them frees their slots.
            left = [g for g, (owner, _) in self._owner.items() if owner == view]
            if left:
                self.engine.abort(left)
                for g in left:
                    del self._owner[g]

    def abort(self, view: int, tags: Sequence[int] | None = None) -> int:
        """Drop a view's rows still in the engine (those of its `tags`, or all); how many were dropped."""
        with self.lock:
            wanted = None if tags is None else set(tags)
            gone = [g for g, (owner, tag) in self._owner.items()
                    if owner == view and (wanted is None or tag in wanted)]
            if gone:
                self.engine.abort(gone)
                for g in gone:
                    del self._owner[g]
            return len(gone)

    def idle(self) -> bool:
        """Nothing of any view still in the engine (closed views' rows included)."""
        with self.lock:
            return not self._owner


class EngineView:
    """A shard's handle on a shared continuous engine (a `ContinuousEngine` itself): its own tags,
    submit, step and abort; everything else is the shared engine's."""

    continuous = True

    def __init__(self, share: EngineShare, view: int):
        self._share, self._view = share, view
        self._engine = share.engine
        self._out = 0  # submitted and not yet returned
        self.name = self._engine.name
        self.schedules_itself = self._engine.schedules_itself
        self.parallel_prepare = self._engine.parallel_prepare

    def submit(self, tag: int, request: Request) -> None:
        self._share.submit(self._view, tag, request)
        self._out += 1

    def step(self) -> list[tuple[int, Result]]:
        done = self._share.step(self._view)
        self._out -= len(done)
        return done

    def unfinished(self) -> int:
        return self._out

    def abort(self, tags: Sequence[int] | None = None) -> None:
        self._out -= self._share.abort(self._view, tags)

    def close(self) -> None:
        self._share.close(self._view)

    # The shared engine's own answers.
    @property
    def honours(self) -> frozenset[str]:
        return self._engine.honours

    @property
    def steps(self) -> int:
        return self._engine.steps

    @property
    def occupied(self) -> int:
        return self._engine.occupied

    @property
    def notes(self) -> Sequence[str]:
        return self._engine.notes

    def load(self) -> None:
        self._engine.load()

    def concurrency(self) -> int:
        return self._engine.concurrency()

    def count_tokens(self, requests: list[Request]) -> list[int]:
        return self._engine.count_tokens(requests)

    def max_input_tokens(self) -> int | None:
        return self._engine.max_input_tokens()

    def batch_shape(self) -> tuple[int, int] | None:
        return self._engine.batch_shape()

    def run(self, requests: list[Request]) -> list[Result]:
        return run_to_completion(self, requests)
