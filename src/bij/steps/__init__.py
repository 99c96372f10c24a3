"""bij.steps: the storage work of the driver's steps and of publishing, run in pods (`bij-worker step ...`,
`bij-worker publish ...`) or, by `bij run`, in its own process. This module imports nothing at load, so that
a publish pass (`bij.steps.publish_rows`) starts without the spec model or the planner."""

from __future__ import annotations

from collections.abc import Mapping


def run_in_process(argv: list[str], env: Mapping[str, str]) -> int:
    """One publish pass or storage step (`publish ...`, `step ...`) in this process, with `env` as its
    environment, for a caller whose own environment already holds the storage settings (`bij run`):
    no interpreter to start and nothing to import again. Logging is the caller's. Anything else
    (a lane, the probe) runs only in a process of its own."""
    if argv[:1] == ["publish"]:
        from bij.steps.publish_rows import main as publish_main

        return publish_main(argv[1:], env)
    if argv[:1] == ["step"]:
        from bij.steps.main import main as step_main

        return step_main(argv[1:], env)
    raise ValueError(f"only a publish pass or a step runs in-process, not {argv[:1]}")
