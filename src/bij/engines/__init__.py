"""Engine registry: the spec's `model.engine` picks one; heavy imports happen only when chosen."""

from __future__ import annotations

from bij.engines.base import Engine, EngineConfig, Request, Result


def create_engine(engine: str, config: EngineConfig) -> Engine:
    """Build (not load) the engine named in the spec."""
    if engine == "echo":
        from bij.engines.echo import EchoEngine

        return EchoEngine(config)
    if engine in ("sentence-transformers", "transformers") and config.task in ("classify", "score", "rerank"):
        # A cross-encoder (score, rerank) through sentence-transformers' CrossEncoder; a classifier through
        # transformers' sequence-classification head (sentence-transformers has no classifier of its own).
        from bij.engines.pooling import CrossEncoderEngine, SequenceClassifierEngine

        if engine == "sentence-transformers" and config.task != "classify":
            return CrossEncoderEngine(config)
        return SequenceClassifierEngine(config)
    if engine == "vllm" and config.task in ("classify", "score", "rerank"):
        from bij.engines.vllm_pooling import VllmPoolingEngine

        return VllmPoolingEngine(config)
    if engine == "sentence-transformers":
        from bij.engines.sentence_transformers import SentenceTransformersEngine

        return SentenceTransformersEngine(config)
    if engine == "transformers":
        from bij.engines.transformers import TransformersEngine

        return TransformersEngine(config)
    if engine == "simulated":
        from bij.engines.simulated import SimulatedEngine

        return SimulatedEngine(config)
    if engine == "vllm":
        from bij.engines.vllm import VllmEngine

        return VllmEngine(config)
    if engine == "http":
        from bij.engines.http import HttpEngine

        return HttpEngine(config)
    raise ValueError(f"unknown engine {engine!r}")


__all__ = ["Engine", "EngineConfig", "Request", "Result", "create_engine"]
