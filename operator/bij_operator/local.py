"""`bij run`: a whole BatchInferenceJob on one machine, with the pod contract kept exactly.

Each lane runs as a `bij-worker` subprocess with `JOB_COMPLETION_INDEX` set,
as an Indexed Job pod would; up to `parallelism` at once. A lane loads the
model once and works many shards, taking over those of a lane that stopped
(bij_worker.lanes). A failed lane is retried up to
`workers.backoffLimitPerIndex` times, and the round still succeeds when the
other lanes finished every shard; exit 42 (bad configuration) stops everything.
Ctrl-C asks every worker to stop cleanly; running the same command again resumes
from what is durable.

Exit codes: 0 published; 1 failed, a rerun may help (it resumes); 42 bad
configuration, a rerun cannot help until something changes (the spec, the
flags, the environment; the message says what); 130 stopped by Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import IO, Any

from bij_worker import publish_rows
from bij_worker.contract import layout
from bij_worker.contract.codes import EXIT_BAD_CONFIG, EXIT_OK, EXIT_TERMINATED
from bij_worker.contract.spec import BatchInferenceJob, SpecError, load_job
from bij_worker.storage import StorageError, open_storage

from .efficiency import fmt_money
from .fingerprint import PlanRefused
from .planner import PlanError, RoundPlan, plan_round, reset_output
from .progress import shard_records
from .publish import PublishError, publish, read_manifest, removed_record
from .rounds import RoundStats, needs_another_round, round_history


def worker_command() -> list[str]:
    """`bij-worker` from the same environment as this process."""
    found = shutil.which("bij-worker", path=os.path.dirname(sys.executable))
    return [found] if found else [sys.executable, "-m", "bij_worker.main"]


@dataclass
class _Progress:
    total_bytes: int
    shards: int
    done_shards: int = 0
    rows: int = 0
    errors: int = 0
    bytes: int = 0
    started: float = field(default_factory=time.monotonic)
    start_rows: int = 0
    start_frac: float = 0.0
    finished: set[int] = field(default_factory=set)  # shards with a completion record
    lock: threading.Lock = field(default_factory=threading.Lock)

    def line(self, round_no: int) -> str:
        elapsed = max(1e-6, time.monotonic() - self.started)
        rate = (self.rows + self.errors - self.start_rows) / elapsed
        frac = min(1.0, self.bytes / self.total_bytes) if self.total_bytes else 1.0
        eta = "?"
        if 0 < frac < 1 and elapsed > 1:
            left = elapsed / max(1e-9, frac - self.start_frac) * (1 - frac) if frac > self.start_frac else 0
            eta = f"{int(left // 60)}m{int(left % 60):02d}s"
        width = 24
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        return (f"round {round_no} [{bar}] {frac:5.1%} shards {self.done_shards}/{self.shards} "
                f"rows {self.rows:,} errors {self.errors:,} {rate:,.0f} rows/s ETA {eta}")


class LocalRunner:
    """Runs the rounds of one job with worker subprocesses."""

    def __init__(self, job: BatchInferenceJob, parallelism: int | None = None, show_progress: bool = True,
                 worker_cmd: list[str] | None = None):
        if parallelism is not None and parallelism < 1:
            raise ValueError(f"--parallelism must be at least 1, got {parallelism}")
        if parallelism is not None and parallelism != job.spec.workers.parallelism:
            # --parallelism decides the lanes of rounds not planned yet, as spec.workers.parallelism would.
            job = job.model_copy(update={"spec": job.spec.model_copy(update={
                "workers": job.spec.workers.model_copy(update={"parallelism": parallelism})})})
        self.job = job
        # The pod's command; a library user can run workers another way (a container, another venv).
        self.worker_cmd = worker_cmd or worker_command()
        self.parallelism = parallelism or job.spec.workers.parallelism
        self.show_progress = show_progress and sys.stderr.isatty()
        self.log_progress = show_progress
        self.stopping = False
        self.bad_config = False  # a worker exited 42: no retry can help
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def _env(self, index: int) -> dict[str, str]:
        env = dict(os.environ)
        env["JOB_COMPLETION_INDEX"] = str(index)
        s3 = self.job.spec.storage.s3
        if s3.endpoint_url:
            env["AWS_ENDPOINT_URL"] = s3.endpoint_url
        if s3.region:
            env["AWS_REGION"] = s3.region
        env.update(self.job.spec.workers.env)
        return env

    def run_round(self, round_no: int, plan: RoundPlan) -> tuple[bool, str]:
        """Run the lanes of a round until every shard is done. Returns (succeeded, message)."""
        done = shard_records(self.job, round_no)
        prog = _Progress(total_bytes=plan.total_bytes, shards=plan.shard_count, done_shards=len(done))
        prog.finished.update(done)
        for rec in done.values():
            prog.rows += rec.get("rows", 0)
            prog.errors += rec.get("errors", 0)
        if len(done) >= plan.shard_count:
            return True, ""
        # One process per lane, as the Job has one pod per lane; each loads the model once and
        # works many shards, taking over those of a lane that stopped.
        pending = deque(range(plan.lanes))
        attempts: dict[int, int] = {}
        limit = self.job.spec.workers.backoff_limit_per_index
        failed: list[int] = []
        bad_config: str | None = None
        readers: list[threading.Thread] = []
        last_draw = 0.0
        if done:
            prog.bytes = int(plan.total_bytes * len(done) / max(1, plan.shard_count))
        prog.start_frac = prog.bytes / plan.total_bytes if plan.total_bytes else 0.0
        prog.start_rows = prog.rows + prog.errors

        # Once stopping (Ctrl-C, or a bad configuration), pending lanes are not started: wait only for
        # the running ones, or the loop would spin forever on a queue nothing drains.
        while self.procs or (pending and not self.stopping):
            while pending and len(self.procs) < self.parallelism and not self.stopping and bad_config is None:
                i = pending.popleft()
                attempts[i] = attempts.get(i, 0) + 1
                # A session of its own: a terminal's Ctrl-C reaches only bij, which asks each worker
                # once (SIGTERM) to drain; a second signal would make the worker quit at once.
                p = subprocess.Popen(
                    [*self.worker_cmd, "--manifest", plan.manifest_uri, "--progress"],
                    env=self._env(i), stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True,
                )
                self.procs[i] = p
                assert p.stdout is not None
                t = threading.Thread(target=self._follow, args=(p.stdout, prog), daemon=True)
                t.start()
                readers.append(t)
            for i, p in list(self.procs.items()):
                rc = p.poll()
                if rc is None:
                    continue
                del self.procs[i]
                if rc == EXIT_OK:
                    pass
                elif rc == EXIT_BAD_CONFIG:
                    bad_config = f"lane {i}: the worker reported a bad configuration (exit 42); see its log above"
                    self.bad_config = True
                    self._stop_all()
                elif self.stopping or rc == EXIT_TERMINATED or rc == -signal.SIGINT:
                    pass
                elif attempts[i] <= limit:
                    print(f"bij: lane {i} failed (exit {rc}), retry {attempts[i]}/{limit}", file=sys.stderr)
                    pending.append(i)
                else:
                    print(f"bij: lane {i} failed (exit {rc}) after {limit} retries; the other lanes take over "
                          "its shards", file=sys.stderr)
                    failed.append(i)
            now = time.monotonic()
            if self.show_progress and now - last_draw > 0.5:
                with prog.lock:
                    sys.stderr.write("\r" + prog.line(round_no) + "\x1b[K")
                sys.stderr.flush()
                last_draw = now
            if not self.procs and (not pending or self.stopping):
                break
            time.sleep(0.05)
        for t in readers:
            t.join(timeout=5)
        if self.show_progress:
            sys.stderr.write("\r" + prog.line(round_no) + "\x1b[K\n")
        elif self.log_progress:
            print(prog.line(round_no), file=sys.stderr)
        if bad_config:
            return False, bad_config
        if self.stopping:
            return False, "stopped; run the same command again to resume"
        left = plan.shard_count - len(shard_records(self.job, round_no))
        if left > 0:
            which = f"lanes {', '.join(map(str, sorted(failed)))} failed after {limit} retries" if failed \
                else "the lanes stopped"
            return False, f"{which} with {left} of {plan.shard_count} shards undone; run again to resume"
        return True, ""

    def _follow(self, stream: IO[bytes], prog: _Progress) -> None:
        for raw in stream:
            try:
                ev: dict[str, Any] = json.loads(raw)
            except ValueError:
                continue
            with prog.lock:
                if ev.get("event") == "chunk":
                    prog.rows += ev.get("rows", 0)
                    prog.errors += ev.get("errors", 0)
                    prog.bytes += ev.get("bytes", 0)
                elif ev.get("event") == "done":
                    prog.finished.add(int(ev.get("index", -1)))
                    prog.done_shards = len(prog.finished)
                elif ev.get("event") == "resume":
                    prog.rows += ev.get("rows", 0)
                    prog.errors += ev.get("errors", 0)
                    prog.bytes += ev.get("bytes", 0)
                    prog.start_rows += ev.get("rows", 0) + ev.get("errors", 0)

    def _stop_all(self) -> None:
        self.stopping = True
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    def run(self) -> int:
        """Plan, run and publish. Returns the process exit code."""
        previous = signal.getsignal(signal.SIGINT)

        def on_int(signum: int, frame: Any) -> None:
            if self.stopping:
                for p in self.procs.values():
                    p.kill()
                return
            print("\nbij: stopping workers cleanly (Ctrl-C again to kill them)", file=sys.stderr)
            self._stop_all()

        signal.signal(signal.SIGINT, on_int)
        signal.signal(signal.SIGTERM, on_int)
        try:
            return self._run()
        except (PlanError, PlanRefused) as e:
            print(f"bij: {e}", file=sys.stderr)
            return EXIT_BAD_CONFIG if e.permanent else 1
        except StorageError as e:
            print(f"bij: storage: {e}", file=sys.stderr)
            return EXIT_BAD_CONFIG if e.permanent else 1
        finally:
            signal.signal(signal.SIGINT, previous)

    def _run(self) -> int:
        if self.job.spec.suspend:
            print(f"bij: {self.job.metadata.name} is suspended (spec.suspend: true): nothing was run; "
                  "set spec.suspend to false to run it", file=sys.stderr)
            return EXIT_BAD_CONFIG
        store = open_storage(self.job.spec.output.uri, self.job.spec.storage.s3)
        removed = removed_record(store, self.job)
        if removed is not None and read_manifest(self.job) is not None:
            plan_round(self.job, 0)  # a changed spec or input is refused here as on any rerun
            # A rerun of a finished job: nothing to work, and its logs are gone (keepIntermediate false).
            print(f"bij: {self.job.metadata.name} was published before; its work files were removed at "
                  f"{removed.get('removedAt')} (output.keepIntermediate: false), nothing to do", file=sys.stderr)
            print(layout.manifest_uri(self.job))
            return 0
        round_no = 0
        history: list[RoundStats] = []
        while True:
            plan = plan_round(self.job, round_no)
            print(f"bij: {self.job.metadata.name}: round {round_no}, {plan.shard_count} shards in {plan.lanes} "
                  f"lanes, {plan.total_bytes:,} {plan.unit} in {plan.objects} objects", file=sys.stderr)
            ok, msg = self.run_round(round_no, plan)
            if not ok:
                print(f"bij: {msg}", file=sys.stderr)
                if self.bad_config:
                    return EXIT_BAD_CONFIG
                return 130 if self.stopping and "stopped" in msg else 1
            history = round_history(self.job, round_no + 1)
            stats = history[-1]
            if self.job.spec.judge is not None:
                print(f"bij: round {round_no}: {stats.rows_in:,} rows in, {stats.approved:,} approved, "
                      f"{stats.rejected:,} rejected, {stats.capped:,} capped "
                      f"(approval {stats.approval_rate:.1%})", file=sys.stderr)
            if not needs_another_round(self.job.spec.judge, history):
                break
            round_no += 1
        try:
            # The row-level passes run as worker processes, like the rounds.
            manifest = publish(self.job, rounds=round_no + 1, processes=self.parallelism)
        except PublishError as e:
            print(f"bij: publish failed: {e}", file=sys.stderr)
            return EXIT_BAD_CONFIG if e.permanent else 1
        except StorageError as e:
            print(f"bij: publish failed: {e}", file=sys.stderr)
            return EXIT_BAD_CONFIG if e.permanent else 1
        c = manifest["counts"]
        print(f"bij: published {layout.manifest_uri(self.job)}: {c['rows']:,} rows, {c['errors']:,} errors "
              f"in {len(manifest['files'])} result files", file=sys.stderr)
        eff, spent = manifest["efficiency"], manifest.get("cost")
        print(f"bij: {eff['workerSeconds']:,.1f} worker seconds ({eff['modelLoads']} model loads, "
              f"{eff['modelLoadSeconds']:,.1f} s), engine busy {eff['engineBusyFraction']:.0%}, "
              f"{eff['rowsPerSecondPerWorker']:,.1f} rows/s per worker", file=sys.stderr)
        if spent is not None:
            print(f"bij: cost {fmt_money(spent['total'])} at {spent['pricePerHour']:g}/hour per worker: "
                  f"{fmt_money(spent['perMillionRows'])} per million rows, "
                  f"{fmt_money(spent['perMillionTokens'])} per million tokens", file=sys.stderr)
        if c.get("truncated"):
            print(f"bij: {c['truncated']:,} rows were longer than the model's input limit and were truncated "
                  f"(marked \"truncated\": true in their result)", file=sys.stderr)
        if c.get("capped"):
            print(f"bij: RetryCapReached: {c['capped']:,} rows were still rejected at the cap; "
                  f"they are in the manifest's cappedFiles", file=sys.stderr)
        print(layout.manifest_uri(self.job))
        return 0


def cli_run(args: argparse.Namespace) -> int:
    try:
        job = load_job(args.spec)
    except SpecError as e:
        print(f"bij: {e}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    if args.parallelism is not None and args.parallelism < 1:
        print(f"bij: --parallelism must be at least 1, got {args.parallelism}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    if args.restart:
        try:
            gone = reset_output(job)
        except StorageError as e:
            print(f"bij: --restart: {e}", file=sys.stderr)
            return EXIT_BAD_CONFIG if e.permanent else 1
        print(f"bij: --restart: deleted the manifest and {gone} objects (plans, durable results) of "
              f"{job.metadata.name} under {job.spec.output.uri}", file=sys.stderr)
    return LocalRunner(job, args.parallelism, show_progress=not args.no_progress).run()


def planned_rounds(job: BatchInferenceJob) -> int:
    """How many rounds have a plan (publish covers all of them)."""
    from bij_worker.storage import open_storage

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
        manifest = publish(job, rounds=max(1, planned_rounds(job)), processes=processes,
                           bucket_rows=args.bucket_rows or publish_rows.BUCKET_ROWS, stats=stats)
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
    print(json.dumps(manifest["counts"]))
    return 0
