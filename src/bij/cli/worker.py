"""`bij-worker`: a round's lane (`bij.worker.main`), one publish pass (`bij-worker publish ...`,
`bij.steps.publish_rows`) or one of the driver's storage steps (`bij-worker step ...`: planning, a
round's statistics, the publish plan, the manifest; `bij.steps.main`, shipped in the same image) or
`bij doctor`'s storage probe (`bij-worker probe ...`, `bij.steps.probe`).
A publish pass imports neither the engines nor the spec model, so the three short-lived pass
processes per publish start in about half the time."""

from __future__ import annotations

import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    rest = sys.argv[1:] if argv is None else argv
    if rest[:1] in (["publish"], ["step"]):
        logging.basicConfig(level=os.environ.get("BIJ_LOG_LEVEL", "INFO"),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
        from bij.steps import run_in_process

        return run_in_process(rest, os.environ)
    if rest[:1] == ["probe"]:
        from bij.steps.probe import main as probe_main

        return probe_main(rest[1:])
    from bij.worker.main import main as work_main

    code = work_main(argv)
    if argv is None:
        # The process's lane has ended: every result it committed is fsynced and its completion
        # records are written (or its failure is reported), and its engine is closed (Engine.close: vLLM's
        # engine processes ended now rather than after vLLM's 5 s grace period at exit). The interpreter's
        # teardown is skipped: it frees the model and the device's context and joins the engine's threads,
        # 1.6 s for a small model on CPU here and more with a GPU, between a lane's last commit and its
        # Job's end; the multiprocessing resource tracker still removes the engine's shared memory once
        # this process is gone.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
