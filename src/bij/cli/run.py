"""The handlers of `bij run`, `bij cancel` and `bij publish`: the flags read, the job loaded and checked, a
refusal printed with its exit code; the work itself is `local.run.LocalRunner` and `local.publish`."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from bij.contract import layout
from bij.contract.codes import EXIT_BAD_CONFIG
from bij.contract.fingerprint import PlanRefused
from bij.contract.spec import BatchInferenceJob, SpecError, load_job
from bij.local.publish import publish_manifest
from bij.local.run import LocalRunner, nodes_per_lane_refusal
from bij.steps.output_claim import reset_output
from bij.steps.publish import PublishError
from bij.storage import StorageError


def cli_job(args: argparse.Namespace) -> BatchInferenceJob | None:
    """The job `bij run` / `bij cancel` name, or None once the reason it cannot run is printed."""
    try:
        job = load_job(args.spec)
    except SpecError as e:
        print(f"bij: {e}", file=sys.stderr)
        return None
    if args.parallelism is not None and args.parallelism < 1:
        print(f"bij: --parallelism must be at least 1, got {args.parallelism}", file=sys.stderr)
        return None
    refused = nodes_per_lane_refusal(job)
    if refused and getattr(args, "command", None) != "cancel":
        print(f"bij: {refused}", file=sys.stderr)
        return None
    return job


def cli_cancel(args: argparse.Namespace) -> int:
    """`bij cancel job.yaml`: stop a job for good and publish what its runs finished (phase Cancelled)."""
    job = cli_job(args)
    if job is None:
        return EXIT_BAD_CONFIG
    return LocalRunner(job, args.parallelism, show_progress=False, cancel=True).run()


def cli_run(args: argparse.Namespace) -> int:
    job = cli_job(args)
    if job is None:
        return EXIT_BAD_CONFIG
    if args.restart:
        try:
            gone = reset_output(job)
        except PlanRefused as e:
            print(f"bij: --restart: {e}", file=sys.stderr)
            return EXIT_BAD_CONFIG
        except StorageError as e:
            print(f"bij: --restart: {e}", file=sys.stderr)
            return EXIT_BAD_CONFIG if e.permanent else 1
        print(f"bij: --restart: deleted the manifest and {gone} objects (plans, durable results) of "
              f"{job.metadata.name} under {job.spec.output.uri}", file=sys.stderr)
    return LocalRunner(job, args.parallelism, show_progress=not args.no_progress,
                       canary_only=getattr(args, "canary_only", False)).run()


def planned_rounds(job: BatchInferenceJob) -> int:
    """How many rounds have a plan (publish covers all of them)."""
    from bij.storage import open_storage

    store = open_storage(job.spec.output.uri, job.spec.storage.s3)
    n = 0
    while store.exists(layout.round_manifest_uri(job, n)):
        n += 1
    return n


def cli_publish(args: argparse.Namespace) -> int:
    try:
        job = load_job(args.spec)
        stats: list[dict[str, Any]] = []
        processes = job.spec.workers.parallelism if args.parallelism is None else args.parallelism
        manifest = publish_manifest(job, rounds=max(1, planned_rounds(job)), processes=processes,
                                    bucket_rows=args.bucket_rows, stats=stats)
    except (SpecError, PlanRefused) as e:
        print(f"bij: {e}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except (PublishError, StorageError) as e:
        print(f"bij: {e}", file=sys.stderr)
        return EXIT_BAD_CONFIG if e.permanent else 1
    if args.process_stats:
        # This process's own peak (wait4 on it would also count its children's).
        own = next((int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:")), 0)
        with open(args.process_stats, "w") as f:
            json.dump([*stats, {"pass": "driver", "index": 0, "maxRssKiB": own}], f)
    failed = manifest.work_files_removal
    if failed is not None:
        # Published: work files left behind are a warning, not a failed publish.
        print(f"bij: warning: the manifest stands, but removing work files failed: {failed.error}; the rest are "
              f"left under {failed.left} (run `bij publish` again to resume the removal)", file=sys.stderr)
    print(json.dumps(manifest.counts.as_json()))
    return 0
