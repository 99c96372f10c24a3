"""Build the demo corpus from real English text already on every Python install.

Paragraphs of the Python documentation's topic pages (``pydoc_data.topics``)
and of standard-library docstrings, one JSONL row each: ``{"id", "text"}``.
Deterministic, so the demo embeds the same rows everywhere.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
import warnings
from pathlib import Path

MODULES = ["argparse", "asyncio", "collections", "concurrent.futures", "contextlib", "csv", "dataclasses",
           "datetime", "decimal", "email", "functools", "http.client", "io", "itertools", "json", "logging",
           "os", "pathlib", "pickle", "re", "shutil", "socket", "sqlite3", "statistics", "string",
           "subprocess", "tarfile", "tempfile", "threading", "typing", "unittest", "urllib.parse", "uuid",
           "zipfile"]


def paragraphs() -> list[str]:
    out: list[str] = []
    from pydoc_data import topics

    for key in sorted(topics.topics):
        out.extend(re.split(r"\n\s*\n", topics.topics[key]))
    for name in MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        docs = [mod.__doc__ or ""]
        for attr in sorted(vars(mod)):
            obj = vars(mod)[attr]
            doc = getattr(obj, "__doc__", None)
            if not attr.startswith("_") and callable(obj) and isinstance(doc, str):
                docs.append(doc)
                if isinstance(obj, type):  # methods of classes too: more real prose
                    docs.extend(m.__doc__ for k, m in sorted(vars(obj).items())
                                if not k.startswith("_") and isinstance(getattr(m, "__doc__", None), str))
        for d in docs:
            out.extend(re.split(r"\n\s*\n", d))
    cleaned = []
    seen = set()
    for p in out:
        text = " ".join(p.split())
        if len(text) < 40 or text in seen or not re.search(r"[a-z]{3,} [a-z]{3,}", text):
            continue
        seen.add(text)
        cleaned.append(text[:2000])
    return cleaned


def main() -> None:
    warnings.simplefilter("ignore", DeprecationWarning)
    dest = Path(sys.argv[1] if len(sys.argv) > 1 else "examples/data/corpus.jsonl")
    limit = int(sys.argv[2]) if len(sys.argv) > 2 else 3000
    rows = paragraphs()[:limit]
    dest.parent.mkdir(parents=True, exist_ok=True)
    with dest.open("w") as f:
        for i, text in enumerate(rows):
            f.write(json.dumps({"id": f"doc-{i:05d}", "text": text}) + "\n")
    print(f"{len(rows)} rows, {dest.stat().st_size:,} bytes -> {dest}", file=sys.stderr)


if __name__ == "__main__":
    main()
