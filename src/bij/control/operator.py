"""`bij operator`: its flags, then kopf run with the handlers of `bij.control.handlers`."""

from __future__ import annotations

import argparse
import logging
import os

import kopf

from bij.control.driver import STATUS_INTERVAL
from bij.control.handlers import Operator
from bij.control.operator_config import OperatorConfig
from bij.control.operator_metrics import OperatorMetrics
from bij.control.step_jobs import step_resources_default


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bij operator", description="Run the BatchInferenceJob operator (kopf).")
    p.add_argument("--namespace", "-n", action="append", default=[], metavar="NS",
                   help="serve this namespace (repeatable; globs allowed); default: all namespaces")
    p.add_argument("--all-namespaces", "-A", action="store_true", help="serve every namespace")
    p.add_argument("--liveness", metavar="URL", default=None,
                   help="serve a liveness probe, e.g. http://0.0.0.0:8080/healthz")
    peering = p.add_mutually_exclusive_group()
    peering.add_argument("--peering", metavar="NAME", default=None,
                         help="coordinate with other operator replicas via this kopf peering object")
    peering.add_argument("--standalone", action="store_true", help="no peering (the default)")
    p.add_argument("--worker-image", default=None,
                   help="worker image when a spec names none (default: env BIJ_WORKER_IMAGE)")
    p.add_argument("--steps-image", default=None,
                   help="image of the step Jobs (planning, counting, publish plan, manifest): bij without an "
                        "engine (default: env BIJ_STEPS_IMAGE, else the worker image)")
    p.add_argument("--status-interval", type=float, default=STATUS_INTERVAL, metavar="SECONDS",
                   help=f"least time between progress-only status writes per job (default {STATUS_INTERVAL:g})")
    p.add_argument("--metrics-port", type=int, default=int(os.environ.get("BIJ_METRICS_PORT") or 0) or None,
                   help="serve Prometheus metrics on this port (default: env BIJ_METRICS_PORT, else none)")
    p.add_argument("--verbose", "-v", action="store_true", help="debug logging")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the operator until SIGTERM/SIGINT. Uses in-cluster credentials or the kubeconfig."""
    import sys

    args = parse_args(sys.argv[1:] if argv is None else argv)
    config = OperatorConfig(namespaces=list(args.namespace), clusterwide=args.all_namespaces or not args.namespace,
                            liveness=args.liveness, peering=args.peering, standalone=args.peering is None,
                            verbose=args.verbose, status_interval=args.status_interval)
    if args.worker_image:
        config.worker_image = args.worker_image
    if args.steps_image:
        config.steps_image = args.steps_image
    try:
        step_resources_default()  # a bad chart value stops the operator at start, not at a bij's first step
    except ValueError as e:
        print(f"bij operator: {e}", file=sys.stderr)
        return 2
    metrics = OperatorMetrics()
    if args.metrics_port:
        metrics.serve(args.metrics_port)
    kopf.configure(verbose=args.verbose)
    # The API client's debug log prints every response body: too much even for --verbose.
    logging.getLogger("kubernetes.client.rest").setLevel(logging.INFO)
    kopf.run(
        standalone=config.standalone,
        peering_name=config.peering,
        clusterwide=config.clusterwide,
        namespaces=[] if config.clusterwide else config.namespaces,
        liveness_endpoint=config.liveness,
        memo=kopf.Memo(bij=Operator(config=config, metrics=metrics)),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
