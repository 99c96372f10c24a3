"""`bij render`: the Job (and Service) the operator would create for a round, as YAML."""

from __future__ import annotations

import argparse
import sys

import yaml

from bij.contract import layout
from bij.contract.spec import SpecError, load_job
from bij.control.jobs import render_job, render_lane_service, worker_image_default
from bij.steps import plan_input, planner, sharding
from bij.storage import StorageError


def cli_render(args: argparse.Namespace) -> int:
    """`bij render SPEC [--round R] [--shards N] [--image IMG]`: print the round's Job as YAML (after the
    headless Service of its lanes when spec.workers.nodesPerLane is above 1).

    Without --shards the input is planned now (object sizes only) to count the shards; the Job
    has one index per lane (workers.parallelism, at most one per shard).
    """
    try:
        job = load_job(args.spec)
    except SpecError as e:
        print(e, file=sys.stderr)
        return 1
    completions = args.shards
    if completions is None:
        try:
            completions = planner.plan_shards_for(job, args.round)
        except (plan_input.PlanError, StorageError, OSError) as e:
            print(f"cannot plan round {args.round} of {job.metadata.name}: {e}", file=sys.stderr)
            print("pass --shards N to render without reading the input", file=sys.stderr)
            return 1
        if completions == 0:
            print(f"round {args.round} of {job.metadata.name} has no input to shard; pass --shards N",
                  file=sys.stderr)
            return 1
    try:
        rendered = render_job(
            job,
            args.round,
            sharding.lanes_for(job, completions),
            layout.round_manifest_uri(job, args.round),
            image=args.image or worker_image_default(),
            owner_uid=job.metadata.uid,
        )
    except ValueError as e:
        print(f"cannot render: {e}", file=sys.stderr)
        return 1
    if job.spec.workers.nodes_per_lane > 1:
        # Lanes of several pods: the headless Service the operator creates first, then the Job.
        service = render_lane_service(job, owner_uid=job.metadata.uid)
        sys.stdout.write(yaml.safe_dump_all([service, rendered], sort_keys=False))
        return 0
    sys.stdout.write(yaml.safe_dump(rendered, sort_keys=False))
    return 0
