"""Engine registry: the spec's `model.engine` and `model.task` pick a class from contract.engines' table;
its module (and the heavy libraries it imports) is imported only when chosen."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from bij.contract.engines import ENGINES
from bij.engines.base import Engine, EngineConfig, Request, Result


def engine_class(engine: str, task: str) -> type[Engine]:
    """The class that runs `task` on `engine`, by its row in contract.engines.ENGINES."""
    cls: type[Engine] = _imported_class(engine, task)
    return cls


def _imported_class(engine: str, task: str) -> Any:
    """engine_class's class as imported: its callers say which of its types they use."""
    row = ENGINES.get(engine)
    if row is None:
        raise ValueError(f"unknown engine {engine!r}")
    if task not in row.tasks:
        raise ValueError(f"engine {engine} runs tasks {', '.join(row.tasks)}, not {task!r}")
    module, name = row.class_path(task).split(":")
    return getattr(importlib.import_module(f"bij.engines.{module}"), name)


def create_engine(engine: str, config: EngineConfig) -> Engine:
    """Build (not load) the engine named in the spec."""
    # Every engine class is built from its config alone (Engine, a Protocol, cannot say so of a class).
    make: Callable[[EngineConfig], Engine] = _imported_class(engine, config.task)
    return make(config)


__all__ = ["Engine", "EngineConfig", "Request", "Result", "create_engine", "engine_class"]
