"""The process's one vLLM `LLM`: its keyword arguments from the spec, building it once, closing it.

`vllm.LLM` claims most of the GPU's memory, so a process holds one (`shared_llm`), which every vLLM
engine of the process (`bij.engines.vllm`, `bij.engines.vllm_pooling`) shares; asking for a different
one is an error. `llm_kwargs` maps the spec's model.vllm options onto `LLM`'s and EngineArgs' names
and checks them against the installed vLLM before anything loads; `close_llm` stops the engine's
processes when the worker is about to exit, `shutdown_llm` drops the LLM (tests).
"""

from __future__ import annotations

import gc
import inspect
import os
import re
from collections.abc import MutableMapping
from typing import Any

from bij.contract.engines import POOLING_TASKS
from bij.engines.base import EngineConfig

# The tasks vLLM's pooling runner runs (embeddings and the classify, score and rerank heads).
POOLING_RUNNER_TASKS = ("embed", *POOLING_TASKS)

# One LLM per process: it claims most of the GPU's memory, a second would not fit.
_LLM: Any = None
_LLM_KWARGS: dict[str, Any] | None = None
# LLMs closed (close_llm): kept until shutdown_llm, so that closing one frees nothing as the process exits.
_CLOSED: list[Any] = []

def snake_case(key: str) -> str:
    """`gpuMemoryUtilization` -> `gpu_memory_utilization` (already snake_case keys pass unchanged)."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", key).lower()


def llm_kwargs(config: EngineConfig, *, has_runner: bool = True, version: tuple[int, int] = (0, 10),
               cpu: bool = False) -> dict[str, Any]:
    """Keyword arguments for `vllm.LLM` from the engine config.

    Every option of `config.vllm` (spec.model.vllm, its defaults included) that is not None is passed
    as its `LLM`/`EngineArgs` name (the option's own snake_case name), then each of its engineArgs, over
    them. `has_runner`/`version` describe the installed vLLM and decide how the embedding (pooling) model
    is requested; `cpu`: vLLM's CPU build.
    """
    if not config.name:
        raise ValueError("engine vllm needs model.name (a model directory or a Hugging Face id)")
    kwargs: dict[str, Any] = {"model": config.name, "seed": config.seed}
    # engineArgs: free-form, over the named knobs; toolCallParser: bij's (as vLLM's server's) alone.
    kwargs.update(config.vllm.model_dump(mode="json", exclude_none=True, exclude={"engine_args", "tool_call_parser"}))
    if config.task in POOLING_RUNNER_TASKS:
        # Prefix caching is a generate and chat knob: vLLM decides it for a pooling model itself (off for an
        # encoder such as a BERT cross-encoder, whose KV cache it cannot reuse, where asking for it fails the
        # load). engineArgs may still ask for it.
        kwargs.pop("enable_prefix_caching", None)
    for key, value in config.vllm.engine_args.items():
        kwargs[snake_case(key)] = value
    if config.adapters:
        kwargs["enable_lora"] = True
        if cpu:
            # vLLM's CPU LoRA ops (plain torch) read a base-model row's adapter index, -1, as the last
            # adapter slot, so a base row batched next to adapter rows got that adapter's delta
            # (vllm-project/vllm#48421). One slot more than there are adapters keeps the last one
            # empty for good (slots fill from the first free one): its delta is zero.
            kwargs["max_loras"] = max(int(kwargs.get("max_loras") or 1), len(config.adapters)) + 1
    if config.task in POOLING_RUNNER_TASKS:  # the pooling runner
        if has_runner:
            kwargs["runner"] = "pooling"
        else:
            kwargs["task"] = ("embed" if version >= (0, 7) else "embedding") if config.task == "embed" else \
                "classify" if config.task == "classify" else "score"
    return kwargs


def unknown_arguments(kwargs: dict[str, Any], known: set[str]) -> list[str]:
    """The keyword arguments for `vllm.LLM` that are neither its own parameters nor EngineArgs fields."""
    return sorted(k for k in kwargs if k not in known)


def _known_arguments(vllm: Any) -> set[str]:
    """What `vllm.LLM(...)` takes: its own parameters and the installed vLLM's EngineArgs fields."""
    return set(inspect.signature(vllm.LLM.__init__).parameters) | set(vllm.EngineArgs.__dataclass_fields__)


def _version(text: str) -> tuple[int, int]:
    parts = re.findall(r"\d+", text)[:2]
    return (int(parts[0]), int(parts[1])) if len(parts) == 2 else (0, 0)


def engine_in_process(environ: MutableMapping[str, str], *, cpu: bool) -> None:
    """On vLLM's CPU platform, run the engine core and the model in this process, unless the
    environment already says otherwise (VLLM_ENABLE_V1_MULTIPROCESSING).

    That platform starts its engine core and its model worker by spawn (`CpuPlatform` sets
    VLLM_WORKER_MULTIPROC_METHOD=spawn), so each imports vLLM and torch again, one after the
    other, before the model loads: in process the engine is ready in less than half the time,
    with the same output tokens/s afterwards (bench/vllm_peers.py measures it against vLLM's own
    runners, docs/benchmarks.md has the figures). A kill of the worker is then a kill of the
    engine too, as a pod's loss is, with no engine process left behind. On CUDA vLLM forks its
    engine core, which costs no second import, and overlaps its output processing with the
    engine's steps: its default stands there.
    """
    if cpu:
        environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def shared_llm(config: EngineConfig) -> Any:
    """This process's `vllm.LLM`, built on first use; asking for a different one is an error."""
    global _LLM, _LLM_KWARGS
    # vLLM logs to stdout by default; a worker's stdout carries its progress events (bij-worker
    # --progress), so vLLM's lines go where bij's own logs go.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    try:
        import vllm
    except ImportError as e:
        raise ImportError("engine vllm needs the vllm package (pip install 'bij[vllm]' on a CUDA machine; "
                          "vLLM's CPU build: make vllm-env)") from e
    from vllm.platforms import current_platform

    cpu = current_platform.is_cpu()
    kwargs = llm_kwargs(
        config,
        has_runner="runner" in inspect.signature(vllm.LLM.__init__).parameters,
        version=_version(getattr(vllm, "__version__", "0.0")),
        cpu=cpu,
    )
    engine_in_process(os.environ, cpu=cpu)
    unknown = unknown_arguments(kwargs, _known_arguments(vllm))
    if unknown:
        # Checked before anything loads: vLLM's own error would come after minutes of start-up, if at all.
        raise ValueError(f"spec.model.vllm: vLLM {getattr(vllm, '__version__', '?')} has no engine argument "
                         f"{', '.join(unknown)} (spec.model.vllm.engineArgs takes EngineArgs names)")
    if _LLM is not None:
        if kwargs != _LLM_KWARGS:
            raise RuntimeError(
                f"this process already holds a vLLM engine built with {_LLM_KWARGS}; one per process"
            )
        return _LLM
    _LLM = vllm.LLM(**kwargs)
    _LLM_KWARGS = kwargs
    return _LLM


def shutdown_llm() -> None:
    """Drop this process's LLM so that another can be built (tests; a worker simply exits)."""
    global _LLM, _LLM_KWARGS
    _LLM, _LLM_KWARGS = None, None
    _CLOSED.clear()
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass


def holds_llm() -> bool:
    """Whether this process has built its vLLM engine (and not closed it)."""
    return _LLM is not None


def close_llm() -> None:
    """Stop this process's engine processes now (where vLLM runs its engine core in processes of
    its own), when the process is about to exit with every result durable. vLLM's own exit path
    sends them SIGTERM and waits up to 5 s before it kills them: nothing of theirs is needed any
    more, so they are killed at once (the driver frees the accelerator's memory with them).

    The LLM is kept referenced, not freed: freeing the model and the device's context is the
    interpreter teardown the worker skips at exit (bij.cli.worker). A later `shared_llm` builds a
    new one. Closing again does nothing."""
    global _LLM, _LLM_KWARGS
    llm, _LLM, _LLM_KWARGS = _LLM, None, None
    if llm is None:
        return
    _CLOSED.append(llm)
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is None:
        return
    try:
        core.shutdown(timeout=0)
    except TypeError:  # releases whose shutdown takes no timeout
        core.shutdown()


def refusals() -> tuple[type[BaseException], ...]:
    """The exceptions with which vLLM refuses one request (input or parameter validation)."""
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:  # releases before vLLM's own exception types raised ValueError
        return (ValueError,)
    return (ValueError, VLLMClientError)
