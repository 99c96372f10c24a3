"""glibc's malloc arenas, capped for the steps' reader threads.

glibc gives each thread that allocates an arena of its own, up to 8 per core, and an arena keeps the
memory its thread freed for later. The steps read records with 16 threads in flight (`progress`), so a
step's peak RSS grew with how long it ran, not with what it held: the finish statistics at 1M shards on
`file://` peaked at 54.5 MB with glibc's default and at 45.0 MB with two arenas, against 42.9 MB at 10k
shards (`bench/steps_scale.py`). `cap_malloc_arenas` sets what ``MALLOC_ARENA_MAX`` would, from inside the
process (a step pod's, or `bij run`'s, which runs its steps in threads), for arenas made after the call.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger("bij.steps")

# malloc.h: mallopt's parameter for the most arenas.
M_ARENA_MAX = -8
# Two: the main thread's and one the readers share (reads wait on storage, not on malloc's lock).
STEP_ARENAS = 2


def cap_malloc_arenas(arenas: int = STEP_ARENAS) -> bool:
    """Cap glibc's malloc arenas at `arenas` (arenas already made stay); False where the C library has no
    mallopt (not glibc) or refuses."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = bool(mallopt(M_ARENA_MAX, arenas))
    if not ok:
        log.debug("mallopt(M_ARENA_MAX, %d) refused", arenas)
    return ok
