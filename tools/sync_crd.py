"""Write the BatchInferenceJob CRD generated from the contract's models (`bij.contract.crd`).

    python tools/sync_crd.py          write the files (make sync-crd)
    python tools/sync_crd.py --check  exit 1 when a file differs from what the models give (CI, tests)

Files: crds/batchinferencejobs.yaml (`kubectl apply -f crds/`) and the Helm chart's crds/ folder (Helm
installs it before the templates). `bij validate` builds the same CRD in process.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bij.contract.crd import crd_yaml

ROOT = Path(__file__).resolve().parent.parent
FILES = (
    Path("crds/batchinferencejobs.yaml"),
    Path("charts/bij-operator/crds/batchinferencejobs.yaml"),
)


def expected(root: Path = ROOT) -> dict[Path, str]:
    """Each file's path (absolute) and the text it must have."""
    text = crd_yaml()
    return {root / f: text for f in FILES}


def drifted(root: Path = ROOT) -> list[Path]:
    """Files that are missing or differ from what the models give."""
    return [p for p, text in expected(root).items() if not p.exists() or p.read_text() != text]


def main(argv: list[str] | None = None) -> int:
    """Write the files, or with --check report the ones that drifted."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check; exit 1 on drift")
    args = parser.parse_args(argv)
    if args.check:
        stale = drifted()
        for p in stale:
            print(f"{p.relative_to(ROOT)} differs from the models in src/bij/contract: run make sync-crd",
                  file=sys.stderr)
        return 1 if stale else 0
    for path, text in expected().items():
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
