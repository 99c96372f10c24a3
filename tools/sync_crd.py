"""Copy the one CRD source, crds/batchinferencejobs.yaml, to where it is shipped.

    python tools/sync_crd.py          write the copies
    python tools/sync_crd.py --check  exit 1 when a copy differs from the source (CI, tests)

Copies: the Helm chart's crds/ folder (Helm installs it before the templates) and the
bij package (so `bij validate` works from an installed wheel, without this repo).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = Path("crds/batchinferencejobs.yaml")
COPIES = (
    Path("charts/bij-operator/crds/batchinferencejobs.yaml"),
    Path("src/bij/contract/crds/batchinferencejobs.yaml"),
)
HEADER = f"# GENERATED from {SOURCE} by `python tools/sync_crd.py`: edit the source, not this copy.\n"


def expected_copies(root: Path = ROOT) -> dict[Path, str]:
    """Each copy's path (absolute) and the text it must have."""
    text = HEADER + (root / SOURCE).read_text()
    return {root / c: text for c in COPIES}


def drifted(root: Path = ROOT) -> list[Path]:
    """Copies that are missing or differ from the source."""
    return [p for p, text in expected_copies(root).items() if not p.exists() or p.read_text() != text]


def main(argv: list[str] | None = None) -> int:
    """Write the copies, or with --check report the ones that drifted."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check; exit 1 on drift")
    args = parser.parse_args(argv)
    if args.check:
        stale = drifted()
        for p in stale:
            print(f"{p.relative_to(ROOT)} differs from {SOURCE}: run python tools/sync_crd.py", file=sys.stderr)
        return 1 if stale else 0
    for path, text in expected_copies().items():
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
