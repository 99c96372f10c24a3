"""`bij-worker`: a round's lane (`bij_worker.main`), one publish pass (`bij-worker publish ...`,
`bij_worker.publish_rows`) or one of the driver's storage steps (`bij-worker step ...`: planning, a
round's statistics, the publish plan, the manifest; `bij_operator.steps`, shipped in the same image) or
`bij doctor`'s storage probe (`bij-worker probe ...`, `bij_worker.probe`).
A publish pass imports neither the engines nor the spec model, so the three short-lived pass
processes per publish start in about half the time."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping


def main(argv: list[str] | None = None) -> int:
    rest = sys.argv[1:] if argv is None else argv
    if rest[:1] in (["publish"], ["step"]):
        logging.basicConfig(level=os.environ.get("BIJ_LOG_LEVEL", "INFO"),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
        return run_in_process(rest, os.environ)
    if rest[:1] == ["probe"]:
        from .probe import main as probe_main

        return probe_main(rest[1:])
    from .main import main as work_main

    code = work_main(argv)
    if argv is None:
        # The process's lane has ended: every result it committed is fsynced and its completion
        # records are written (or its failure is reported). The interpreter's teardown is skipped: it
        # frees the model and the device's context and joins the engine's threads, 1.6 s for a small
        # model on CPU here and more with a GPU, between a lane's last commit and its Job's end. vLLM's
        # engine processes are ended first rather than after vLLM's 5 s grace period at exit; the
        # multiprocessing resource tracker still removes the engine's shared memory once this process is gone.
        vllm = sys.modules.get("bij_worker.engines.vllm")
        if vllm is not None and vllm.holds_llm():
            vllm.close_llm()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def run_in_process(argv: list[str], env: Mapping[str, str]) -> int:
    """One publish pass or storage step (`publish ...`, `step ...`) in this process, with `env` as its
    environment, for a caller whose own environment already holds the storage settings (`bij run`):
    no interpreter to start and nothing to import again. Logging is the caller's. Anything else
    (a lane, the probe) runs only in a process of its own."""
    if argv[:1] == ["publish"]:
        from .publish_rows import main as publish_main

        return publish_main(argv[1:], env)
    if argv[:1] == ["step"]:
        from bij_operator.steps import main as step_main

        return step_main(argv[1:], env)
    raise ValueError(f"only a publish pass or a step runs in-process, not {argv[:1]}")


if __name__ == "__main__":
    sys.exit(main())
