"""Result writers: the published result files of each `spec.output.format`, one module per format.

`WRITERS` maps every format the spec accepts to its `ResultWriter` (see `base`); the publish passes,
the publish plan and `bij results` look formats up here and nowhere else.
"""

from __future__ import annotations

from bij.storage.writers.base import FilePart, FileStream, ResultShape, ResultWriter
from bij.storage.writers.csv import CSV
from bij.storage.writers.jsonl import JSONL
from bij.storage.writers.parquet import PARQUET

WRITERS: dict[str, ResultWriter] = {w.name: w for w in (JSONL, PARQUET, CSV)}

__all__ = ["CSV", "JSONL", "PARQUET", "WRITERS", "FilePart", "FileStream", "ResultShape", "ResultWriter", "writer_for",
           "writer_of_path"]


def writer_for(fmt: str) -> ResultWriter:
    """The writer of spec.output.format `fmt` (the spec and the publish plan accept no other)."""
    return WRITERS[fmt]


def writer_of_path(path: str) -> ResultWriter:
    """The writer of a published file, by its suffix (the longest that fits); ValueError when none has it."""
    found = [(len(s), w) for w in WRITERS.values() for s in w.suffixes if path.endswith(s)]
    if not found:
        raise ValueError(f"{path}: no output format writes files named so")
    return max(found, key=lambda f: f[0])[1]
