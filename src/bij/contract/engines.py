"""What each engine is, in one table: the tasks it runs, whether it schedules its own batches, whether a
lane may span pods, and the class that runs each task.

The spec's checks and the CRD's rules are made from it (contract/spec_model.py, contract/spec.py), the
worker builds engines from it (engines.create_engine), and tests/engines/test_engine_rows.py holds every
class to its row. A new engine is its module under bij/engines and one row here (and its name in
ModelSpec.engine's Literal, which the same test checks).
"""

from __future__ import annotations

from dataclasses import dataclass

POOLING_TASKS = ("classify", "score", "rerank")


@dataclass(frozen=True)
class EngineRow:
    tasks: tuple[str, ...]
    """the model.task values it runs"""
    schedules_itself: bool
    """it takes requests as they come and batches them itself (no batching.targetBatchTokens/maxBatchSize)"""
    in_flight: str | None
    """the spec field that bounds its requests in flight, where it schedules itself"""
    across_pods: bool
    """a lane may span pods (workers.nodesPerLane above 1)"""
    classes: tuple[tuple[tuple[str, ...], str], ...]
    """(tasks, "module:Class" under bij.engines): the first entry naming a task runs it"""
    weights: bool = False
    """it loads model weights from a folder: model.name may be an object-store prefix of them"""

    def class_path(self, task: str) -> str:
        for tasks, path in self.classes:
            if task in tasks:
                return path
        raise ValueError(f"no class runs task {task!r}")


_ST = "sentence_transformers:SentenceTransformersEngine"
ENGINES: dict[str, EngineRow] = {
    "echo": EngineRow(("embed", "generate", "chat"), False, None, False,
                      ((("embed", "generate", "chat"), "echo:EchoEngine"),)),
    "sentence-transformers": EngineRow(("embed", *POOLING_TASKS), False, None, False,
                                       ((("embed",), _ST),
                                        # sentence-transformers has no classifier: transformers' head runs it
                                        (("classify",), "pooling:SequenceClassifierEngine"),
                                        (("score", "rerank"), "pooling:CrossEncoderEngine")), weights=True),
    "transformers": EngineRow(("generate", "chat", *POOLING_TASKS), False, None, False,
                              ((("generate", "chat"), "transformers:TransformersEngine"),
                               (POOLING_TASKS, "pooling:SequenceClassifierEngine")), weights=True),
    "vllm": EngineRow(("generate", "chat", "embed", *POOLING_TASKS), True, "model.vllm.maxNumSeqs", True,
                      ((("generate", "chat", "embed"), "vllm:VllmEngine"),
                       (POOLING_TASKS, "vllm_pooling:VllmPoolingEngine")), weights=True),
    "simulated": EngineRow(("embed", "generate", "chat"), True, "model.simulated.maxNumSeqs", True,
                           ((("embed", "generate", "chat"), "simulated:SimulatedEngine"),)),
    "http": EngineRow(("embed", "generate", "chat", *POOLING_TASKS), True, "model.http.maxInFlight", False,
                      ((("embed", "generate", "chat"), "http:HttpEngine"),
                       (POOLING_TASKS, "http_pooling:HttpPoolingEngine"))),
}

ENGINE_TASKS: dict[str, tuple[str, ...]] = {name: row.tasks for name, row in ENGINES.items()}
# Engines that schedule their own batches step by step (add and finish requests as they go).
CONTINUOUS_ENGINES = tuple(name for name, row in ENGINES.items() if row.schedules_itself)
# Engines that load weights from a folder (model.name may name an object-store prefix of them).
WEIGHTS_ENGINES = tuple(name for name, row in ENGINES.items() if row.weights)
# Engines whose lane may span pods (pipeline parallel across them).
GROUP_ENGINES = tuple(name for name, row in ENGINES.items() if row.across_pods)


def names(engines: tuple[str, ...]) -> str:
    """'a, b and c'."""
    *first, last = engines
    return f"{', '.join(first)} and {last}" if first else last
