"""The handlers of `bij results` and `bij status`: what they were given (a job's YAML or a URI), and an error
printed with its exit code; the reading is `bij.steps.results`."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from bij.contract import layout
from bij.contract.schemes import WRITABLE
from bij.contract.spec import SpecError, load_job
from bij.steps.results import (
    ResultsError,
    job_summary,
    load_manifest,
    manifest_summary,
    write_csv,
    write_jsonl,
    write_parquet,
)
from bij.storage import StorageError


def target_manifest(target: str) -> tuple[str, Any]:
    """(manifest or output URI, S3 settings) for what `bij results`/`bij status` were given: a job's
    YAML (its output, with its spec.storage), or a bare URI (the standard AWS environment)."""
    if target.startswith(WRITABLE):
        return target, None
    job = load_job(target)
    return layout.manifest_uri(job), job.spec.storage.s3


def cli_results(args: argparse.Namespace) -> int:
    which = "errors" if args.errors else "capped" if args.capped else "results"
    out = sys.stdout.buffer
    try:
        uri, s3 = target_manifest(args.manifest)
        if args.format != "jsonl" and which != "results":
            raise ResultsError(f"error and capped rows are JSON lines: --format {args.format} reads results only")
        if args.format == "parquet":
            if out.isatty():
                raise ResultsError("--format parquet writes binary Parquet: redirect it to a file")
            write_parquet(uri, out, s3)
        elif args.format == "csv":
            write_csv(uri, out, s3)
        else:
            write_jsonl(uri, which, out, s3)
        out.flush()
    except (ResultsError, SpecError, StorageError) as e:
        print(f"bij: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `bij results ... | head`
        return 0
    return 0


def cli_status(args: argparse.Namespace) -> int:
    target: str = args.target
    try:
        if target.startswith(WRITABLE):
            _, _, manifest = load_manifest(target, None)  # a bare URI: the standard AWS environment
            lines = manifest_summary(manifest)
        else:
            lines = job_summary(load_job(target))
    except (ResultsError, SpecError, StorageError) as e:
        print(f"bij: {e}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0
