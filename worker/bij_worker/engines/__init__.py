"""Engine registry: the spec's `model.engine` picks one; heavy imports happen only when chosen."""

from __future__ import annotations

from .base import Engine, EngineConfig, Request, Result


def create_engine(engine: str, config: EngineConfig) -> Engine:
    """Build (not load) the engine named in the spec."""
    if engine == "echo":
        from .echo import EchoEngine

        return EchoEngine(config)
    if engine == "sentence-transformers":
        from .sentence_transformers import SentenceTransformersEngine

        return SentenceTransformersEngine(config)
    if engine == "transformers":
        from .transformers import TransformersEngine

        return TransformersEngine(config)
    if engine == "simulated":
        from .simulated import SimulatedEngine

        return SimulatedEngine(config)
    if engine == "vllm":
        from .vllm import VllmEngine

        return VllmEngine(config)
    raise ValueError(f"unknown engine {engine!r}")


__all__ = ["Engine", "EngineConfig", "Request", "Result", "create_engine"]
