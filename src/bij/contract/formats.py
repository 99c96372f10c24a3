"""spec.output.format: the formats of published result files, each written by its writer in
bij.storage.writers. Its own module, so that the spec and the publish plan share it and the publish
passes load no spec model."""

from __future__ import annotations

from typing import Literal

OutputFormat = Literal["jsonl", "parquet", "csv"]
