"""`bij`: run a job locally, be a worker, render or validate a spec, read results, run the operator."""

from __future__ import annotations

import argparse
import sys

from bij.contract.schemes import prefixes

BARE_URI_CREDENTIALS = "a bare URI's credentials from the standard environment: AWS's, or the Azure CLI's for az://"


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    if argv is None:
        argv = sys.argv[1:]
    # `worker`, `operator` and `api` take their own flags: hand the rest through untouched.
    if argv and argv[0] == "worker":
        from bij.cli.worker import main as worker_main

        return worker_main(argv[1:])
    if argv and argv[0] == "operator":
        from bij.control.operator import main as operator_main

        return operator_main(argv[1:])
    if argv and argv[0] == "api":
        from bij.api.server import main as api_main

        return api_main(argv[1:])
    return _dispatch(parser, parser.parse_args(argv))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bij", description="Batch inference on spot GPUs.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run_and_cancel(sub)
    sub.add_parser("worker", help="the pod entry point (same as bij-worker)", add_help=False)
    _add_render_and_validate(sub)
    _add_publish_and_readers(sub)
    _add_doctor(sub)
    sub.add_parser("operator", help="run the kopf operator (in-cluster or with a kubeconfig)", add_help=False)
    sub.add_parser("api", help="run bij-api, the OpenAI Files and Batches API (same as bij-api)", add_help=False)
    return parser


def _add_run_and_cancel(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("run", help="run a BatchInferenceJob on this machine (resumes when run again)")
    p.add_argument("spec", help="BatchInferenceJob YAML")
    p.add_argument("--parallelism", type=int, default=None, help="worker processes (default: spec.workers.parallelism)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--restart", action="store_true",
                   help="start over: delete this job's manifest, plans and durable results first")
    p.add_argument("--canary-only", action="store_true",
                   help="run only the canary (spec.canary, or its defaults) and stop with its verdict and the "
                        "estimate of the whole job; its results are kept for the full run")

    p = sub.add_parser("cancel", help="stop a job run with `bij run` for good and publish what it finished "
                                      "(a partial manifest, phase Cancelled)")
    p.add_argument("spec", help="BatchInferenceJob YAML")
    p.add_argument("--parallelism", type=int, default=None,
                   help="publish processes (default: spec.workers.parallelism)")


def _add_render_and_validate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("render", help="print the Job the operator would create for a round")
    p.add_argument("spec")
    p.add_argument("--round", type=int, default=0)
    p.add_argument("--image", default=None, help="worker image (default: the chart's default)")
    p.add_argument("--shards", type=int, default=None, help="shard count (default: plan the input now)")

    p = sub.add_parser("validate", help="check a spec against the CRD schema and its rules, offline")
    p.add_argument("spec")


def _add_publish_and_readers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("publish", help="publish the manifest of a finished job (normally automatic)")
    p.add_argument("spec")
    p.add_argument("--parallelism", type=int, default=None,
                   help="worker processes for the row-level passes (default: spec.workers.parallelism; 0: in this one)")
    p.add_argument("--bucket-rows", type=int, default=None,
                   help="ids one duplicate-detection process holds at once (default: spec.output.publishBucketRows)")
    p.add_argument("--process-stats", default=None, metavar="FILE",
                   help="write each publish process's peak RSS and time to FILE as JSON")

    p = sub.add_parser("results", help="print published rows as JSON lines (checks every file's sha256)")
    p.add_argument("manifest", help="the job's YAML (its output, read with its spec.storage), or the manifest's or "
                                    f"output's URI ({prefixes(writable_only=True)}; {BARE_URI_CREDENTIALS})")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--errors", action="store_true", help="the error rows instead of the results")
    which.add_argument("--capped", action="store_true", help="rows still rejected by the judge at the cap")
    p.add_argument("--format", choices=["jsonl", "parquet", "csv"], default="jsonl",
                   help="jsonl: JSON lines on stdout (default); parquet: one Parquet stream of the results; "
                        "csv: one CSV stream of the results, as output.format csv writes them")

    p = sub.add_parser("status", help="a short summary of a job: rounds, shards, rows, errors, truncated, cost")
    p.add_argument("target", help="the job's YAML (read with its spec.storage), or its manifest URI "
                                  f"({prefixes(writable_only=True)}; {BARE_URI_CREDENTIALS})")


def _add_doctor(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("doctor", help="is a namespace ready for bijs? the worker identity's grants, its Secret, "
                                      "nodes that fit, and storage as the job's pods see it")
    p.add_argument("spec", nargs="?", default=None,
                   help="a BatchInferenceJob YAML: also check its Secret, nodes, image and storage")
    p.add_argument("-n", "--namespace", default=None, help="the namespace (default: the job's, else default)")
    p.add_argument("--no-probe", action="store_true", help="do not start the storage probe pod")
    p.add_argument("--image", default=None, help="the worker image (default: the spec's, else the operator's)")
    p.add_argument("--operator-namespace", default="bij-system", help="where the operator runs (default bij-system)")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: in-cluster, else ~/.kube/config)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds the probe pod may take (default 300)")


def _dispatch(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.command == "run":
        from bij.cli.run import cli_run

        return cli_run(args)
    if args.command == "cancel":
        from bij.cli.run import cli_cancel

        return cli_cancel(args)
    if args.command == "render":
        from bij.cli.render import cli_render

        return cli_render(args)
    if args.command == "validate":
        from bij.cli.validate import cli_validate

        return cli_validate(args)
    if args.command == "results":
        from bij.cli.results import cli_results

        return cli_results(args)
    if args.command == "status":
        from bij.cli.results import cli_status

        return cli_status(args)
    if args.command == "doctor":
        from bij.cli.doctor import cli_doctor

        return cli_doctor(args)
    if args.command == "publish":
        from bij.cli.run import cli_publish

        return cli_publish(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
