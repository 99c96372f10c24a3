"""`bij-worker`: the pod entry point. Works shard JOB_COMPLETION_INDEX of a round plan.

Exit codes (the Job's podFailurePolicy relies on them):

- 0    the shard is done (its completion record is written)
- 143  terminated by SIGTERM/SIGINT: the in-flight chunk was committed or dropped whole;
       a rerun resumes where it stopped
- 42   bad configuration (missing plan, index out of range, unknown engine, missing model,
       a storage error no retry fixes, an input object changed since planning):
       a retry cannot help, the Job fails at once
- other  a failure worth a retry (storage outage, engine crash); a rerun resumes
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from typing import Any

from .engines import EngineConfig, create_engine
from .inputs import truncates
from .metrics import Metrics, Stats
from .storage import StorageError
from .worker import (
    EXIT_BAD_CONFIG,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_TERMINATED,
    BadConfig,
    ShardWorker,
    StopFlag,
    load_plan,
)

log = logging.getLogger("bij.worker")


def engine_config(spec: dict[str, Any]) -> EngineConfig:
    """The engine's settings from spec.model (camelCase, as carried in the plan)."""
    m = spec.get("model", {})
    return EngineConfig(
        task=m.get("task", "embed"),
        name=m.get("name"),
        max_tokens=int(m.get("maxTokens", 256)),
        temperature=float(m.get("temperature", 0.0)),
        seed=int(m.get("seed", 0)),
        max_input_tokens=m.get("maxInputTokens"),
        truncate=truncates(m),
        vllm=dict(m.get("vllm", {})),
        simulated=dict(m.get("simulated", {})),
        device=os.environ.get("BIJ_DEVICE") or None,
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bij-worker", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--manifest", default=os.environ.get("BIJ_MANIFEST"),
                   help="URI of the round plan (shards.json); env BIJ_MANIFEST")
    p.add_argument("--index", type=int, default=None,
                   help="shard index (default: env JOB_COMPLETION_INDEX, as set by an Indexed Job)")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    p.add_argument("--drain-seconds", type=float, default=float(os.environ.get("BIJ_DRAIN_SECONDS", "15")),
                   help="after SIGTERM, how long the in-flight chunk may still run before it is dropped")
    p.add_argument("--progress", action="store_true", help="print JSON progress events on stdout")
    return p.parse_args(argv)


def publish_main(argv: list[str]) -> int:
    """`bij-worker publish --plan URI --pass ids|dedupe|write [--index I]`: one index of a publish pass."""
    from . import publish_rows

    p = argparse.ArgumentParser(prog="bij-worker publish", description=publish_rows.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", required=True, help="URI of the publish plan (plan.json)")
    p.add_argument("--pass", dest="pass_name", required=True, choices=publish_rows.PASSES)
    p.add_argument("--index", type=int, default=None,
                   help="shard or bucket index (default: env JOB_COMPLETION_INDEX, as set by an Indexed Job)")
    args = p.parse_args(argv)
    index = args.index
    if index is None:
        raw = os.environ.get("JOB_COMPLETION_INDEX", "")
        if not raw.isdigit():
            log.error("no index: pass --index or set JOB_COMPLETION_INDEX (got %r)", raw)
            return EXIT_BAD_CONFIG
        index = int(raw)
    try:
        publish_rows.run_pass(publish_rows.load(args.plan), args.pass_name, index)
    except publish_rows.PublishPlanError as e:
        log.error("bad configuration: %s", e)
        return EXIT_BAD_CONFIG
    except StorageError as e:
        if e.permanent:  # a missing bucket, denied access: the same on every retry
            log.error("bad configuration: storage: %s", e)
            return EXIT_BAD_CONFIG
        log.error("storage: %s", e)
        return EXIT_FAILED
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("BIJ_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    rest = sys.argv[1:] if argv is None else argv
    if rest[:1] == ["publish"]:
        return publish_main(rest[1:])
    args = parse_args(argv)
    stop = StopFlag(args.drain_seconds)

    def on_signal(signum: int, frame: Any) -> None:
        if stop.requested:
            # A second signal: no more waiting. What is durable stays durable;
            # a torn append is cut on resume.
            os._exit(EXIT_TERMINATED)
        log.info("signal %d: taking no new chunk", signum)
        stop.request()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    def emit(event: dict[str, Any]) -> None:
        if args.progress:
            sys.stdout.write(json.dumps(event) + "\n")
            sys.stdout.flush()

    try:
        if not args.manifest:
            raise BadConfig("no round plan: pass --manifest or set BIJ_MANIFEST")
        index = args.index
        if index is None:
            raw = os.environ.get("JOB_COMPLETION_INDEX")
            if raw is None or not raw.isdigit():
                raise BadConfig(f"no shard index: pass --index or set JOB_COMPLETION_INDEX (got {raw!r})")
            index = int(raw)
        # The plan says where everything else is; S3 settings for reading it come from the
        # standard AWS environment (AWS_ENDPOINT_URL, AWS_REGION), as the Job sets them.
        plan = load_plan(args.manifest)
        spec = plan["job"]["spec"]
        metrics = Metrics()
        if args.metrics_port:
            metrics.serve(args.metrics_port)
        stats = Stats(started_at=time.time())
        engine_name = spec.get("model", {}).get("engine", "echo")
        try:
            engine = create_engine(engine_name, engine_config(spec))
        except ValueError as e:
            raise BadConfig(str(e)) from None
        worker = ShardWorker(plan, index, engine, metrics=metrics, stop=stop, progress=emit, stats=stats)
        name = spec.get("model", {}).get("name")
        if name and (name.startswith(("/", "./", "../"))) and not os.path.exists(name):
            raise BadConfig(f"spec.model.name: no model at {name}")
        t = time.perf_counter()
        try:
            engine.load()
        except (FileNotFoundError, ImportError, ValueError) as e:
            # Only what fails on every node alike: a full disk or a flaky mount is an
            # OSError worth a retry elsewhere, and must not fail the whole round.
            raise BadConfig(f"cannot load model for engine {engine_name}: {type(e).__name__}: {e}") from None
        stats.model_load_s = time.perf_counter() - t
        metrics.model_load.set(stats.model_load_s)
        emit({"event": "loaded", "index": index, "seconds": round(stats.model_load_s, 3)})
        outcome = worker.run()
    except BadConfig as e:
        log.error("bad configuration: %s", e)
        return EXIT_BAD_CONFIG
    except StorageError as e:
        if e.permanent:
            # A missing bucket, denied access, no credentials, an input replaced after planning:
            # the same on every retry and every node.
            log.error("bad configuration: storage: %s", e)
            return EXIT_BAD_CONFIG
        log.error("storage: %s", e)
        return EXIT_FAILED
    except Exception:
        log.exception("shard failed")
        return EXIT_FAILED
    if outcome.status == "stopped":
        log.info("shard %d: stopped with %d rows durable", index, outcome.rows)
        return EXIT_TERMINATED
    log.info("shard %d: done, %d rows, %d errors", index, outcome.rows, outcome.errors)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
