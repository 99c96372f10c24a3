"""`bij run`: a whole BatchInferenceJob on one machine, through the operator's own decisions.

The same `driver.Driver` that the operator runs steps the job through `reconcile.decide()`;
`LocalBackend` keeps the status in memory, prints the Events, and runs each Job the operator
would create (one per round, one per publish pass) as local processes with
`JOB_COMPLETION_INDEX` set (`localjobs.LocalJob`): up to `parallelism` at once, a failed index
retried up to `workers.backoffLimitPerIndex` times, exit 42 (bad configuration) failing the
Job at once. A lane loads the model once and works many shards, taking over those of a lane
that stopped (bij.worker.lanes), so a round succeeds when every shard is done. Ctrl-C asks every
worker to stop cleanly; running the same command again resumes from what is durable.

Exit codes: 0 published; 1 failed, a rerun may help (it resumes); 3 stopped for good by
spec.cancel or spec.deadlineSeconds, the finished part published as a partial manifest; 42 bad
configuration, a rerun cannot help until something changes (the spec, the flags, the environment;
the message says what); 130 stopped by Ctrl-C. `bij cancel` (`LocalRunner(cancel=True)`) publishes
what a stopped run finished and exits 0 once the job is Cancelled.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Any

from bij.contract import layout
from bij.contract.codes import EXIT_BAD_CONFIG, PUBLISH_LABEL, ROUND_LABEL, STEP_LABEL
from bij.contract.efficiency import fmt_money
from bij.contract.fingerprint import PlanRefused
from bij.contract.lane_report import tally
from bij.contract.manifest import EfficiencyFigures, Manifest
from bij.contract.round_record import round_records
from bij.contract.spec import BatchInferenceJob, CanarySpec
from bij.contract.spec_base import SecretKeyRef
from bij.contract.status import JobStatus, Notified
from bij.control import notify
from bij.control.decisions import STOPPED_PHASES, TERMINAL_PHASES, Retry
from bij.control.driver import Driver
from bij.control.driver_types import Created, Observed
from bij.control.file_volume import FileVolume
from bij.control.jobs import render_job
from bij.control.observe import failure_reason
from bij.local.jobs import LocalJob, worker_command, worker_env
from bij.steps.output_claim import output_standing
from bij.steps.plan_input import PlanError
from bij.steps.planner import RoundPlan, plan_round
from bij.steps.progress import count_done, stream_records
from bij.steps.publish import read_manifest, removed_record
from bij.steps.removal import resume_removal
from bij.storage import StorageError, open_storage
from bij.worker.report import LANES, REPORT_ENV, FolderSink, read_folder

# Failures a rerun cannot fix until something changes (exit 42); any other failure may pass (exit 1).
BAD_CONFIG_REASONS = frozenset({"PodFailurePolicy", "InvalidSpec", "PlanRefused", "SpecChanged", "CannotCreateJob",
                                "TooManyErrors", "WorkFilesRemoved", "DamagedInput", "StorageRefused",
                                "CanaryFailed"})
EXIT_STOPPED = 3  # Cancelled or Expired: a partial manifest was published, and the job never runs again


@dataclass
class _Progress:
    """A round's progress line, from its workers' progress events."""

    total_bytes: int
    shards: int
    round_no: int
    done_shards: int = 0
    rows: int = 0
    errors: int = 0
    bytes: int = 0
    started: float = field(default_factory=time.monotonic)
    start_rows: int = 0
    start_frac: float = 0.0
    finished: set[int] = field(default_factory=set)  # shards with a completion record
    lock: threading.Lock = field(default_factory=threading.Lock)

    def follow(self, stream: IO[Any]) -> None:
        """Read one worker's progress events (`bij-worker --progress`) until it ends."""
        for raw in stream:
            try:
                ev: dict[str, Any] = json.loads(raw)
            except ValueError:
                continue
            with self.lock:
                if ev.get("event") == "chunk":
                    self.rows += ev.get("rows", 0)
                    self.errors += ev.get("errors", 0)
                    self.bytes += ev.get("bytes", 0)
                elif ev.get("event") == "done":
                    self.finished.add(int(ev.get("index", -1)))
                    self.done_shards = len(self.finished)
                elif ev.get("event") == "resume":
                    self.rows += ev.get("rows", 0)
                    self.errors += ev.get("errors", 0)
                    self.bytes += ev.get("bytes", 0)
                    self.start_rows += ev.get("rows", 0) + ev.get("errors", 0)

    def line(self) -> str:
        round_no = self.round_no
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


def merge_patch(target: dict[str, Any], patch: dict[str, Any]) -> None:
    """RFC 7386, as the API server applies a status merge patch: objects merge, null deletes."""
    for k, v in patch.items():
        if v is None:
            target.pop(k, None)
        elif isinstance(v, dict) and isinstance(target.get(k), dict):
            merge_patch(target[k], v)
        else:
            target[k] = json.loads(json.dumps(v))


class LocalBackend:
    """The driver's steps on one machine: status in memory, Events printed, Jobs as local processes."""

    worker_image = steps_image = "local"  # Jobs run the local worker command, not an image
    file_volume: FileVolume | None = None  # local processes see this machine's files

    def __init__(self, job: BatchInferenceJob, worker_cmd: list[str], show_progress: bool, log_progress: bool,
                 steps_here: bool = False):
        self.job = job
        self.worker_cmd = worker_cmd
        # Step and publish Jobs of one index run in this process (see LocalRunner).
        self.steps_here = steps_here
        self.status: dict[str, Any] = {}
        self.jobs: dict[str, LocalJob] = {}
        self.progress: dict[str, _Progress] = {}
        self.show_progress = show_progress
        self.log_progress = log_progress
        self.stopping = False
        self.last_draw = 0.0
        # Where this run's pods report (bij.worker.report), read into the status as the API server would.
        self.reports = tempfile.TemporaryDirectory(prefix="bij-reports-")

    def env(self) -> dict[str, str]:
        return {**worker_env(self.job), REPORT_ENV: f"dir:{self.reports.name}"}

    # --- Backend ---------------------------------------------------------------------------------

    def observe(self) -> Observed:
        status = json.loads(json.dumps(self.status))
        reported = read_folder(self.reports.name)
        lanes = reported.pop(LANES, None)
        if reported:
            status["reports"] = reported
        round_no = status.get("round")
        return Observed(job=self.job, spec_error=None, status=status, generation=1,
                        output_uri=self.job.spec.output.uri, jobs=[j.view() for j in self.jobs.values()],
                        pods=[p for j in self.jobs.values() if STEP_LABEL in j.labels for p in j.failed_pods()],
                        lanes=tally(lanes.values(), round_no) if lanes and isinstance(round_no, int) else None)

    def create_job(self, body: dict[str, Any]) -> Created:
        name = body["metadata"]["name"]
        if name in self.jobs:
            return "exists"
        labels = body["metadata"].get("labels") or {}
        on_stdout = None
        extra: list[str] = []
        if ROUND_LABEL in labels and PUBLISH_LABEL not in labels:
            prog = self.round_progress(int(labels[ROUND_LABEL]))
            self.progress[name] = prog
            on_stdout = prog.follow
            extra = ["--progress"]
        env = self.env()
        if STEP_LABEL in labels:
            # A step's result is what counts, and the driver prints it: its own log only when asked.
            env.setdefault("BIJ_LOG_LEVEL", "WARNING")
        here = None
        if self.steps_here and (STEP_LABEL in labels or PUBLISH_LABEL in labels) and body["spec"]["completions"] == 1:
            from bij.steps import run_in_process

            here = run_in_process
        job = LocalJob(body, self.worker_cmd, env, extra_args=extra, on_stdout=on_stdout, in_process=here)
        if self.stopping:
            job.stop()
        self.jobs[name] = job
        job.tick()
        return "created"

    def create_service(self, body: dict[str, Any]) -> None:
        # Lanes of several pods are refused before a local run starts (nodes_per_lane_refusal).
        raise NotImplementedError("bij run has no Services: a lane of several pods runs on Kubernetes only")

    def patch_job(self, name: str, spec: dict[str, Any]) -> None:
        self.jobs[name].patch(spec)

    def delete_job(self, name: str) -> None:
        job = self.jobs.pop(name, None)
        if job is not None and not job.finished:
            job.stop()

    def write_status(self, patch: dict[str, Any]) -> None:
        patch = dict(patch)
        sink = FolderSink(self.reports.name)
        for section, entries in (patch.pop("reports", None) or {}).items():
            for key, value in (entries or {}).items():
                sink.put(section, key, value)
        merge_patch(self.status, patch)

    def event(self, type_: str, reason: str, message: str) -> None:
        print(f"bij: {message}", file=sys.stderr, flush=True)

    def notify_key(self, ref: SecretKeyRef) -> bytes:
        # No Secrets here: the key of spec.notify[].secretRef is an environment variable named after it.
        name = notify.secret_env(ref)
        value = os.environ.get(name)
        if not value:
            raise LookupError(f"set env {name} to the key of Secret {ref.name}, key {ref.key}")
        return value.encode()

    # --- processes ------------------------------------------------------------------------------

    def round_progress(self, round_no: int) -> _Progress:
        rec = round_records(self.status).get(round_no)
        shards = rec.shards if rec is not None else 0
        prog = _Progress(total_bytes=rec.bytes if rec is not None else 0, shards=shards, round_no=round_no)
        for index, r in stream_records(self.job, round_no):
            prog.finished.add(index)
            prog.rows += r.get("rows", 0)
            prog.errors += r.get("errors", 0)
        prog.done_shards = len(prog.finished)
        if prog.finished:
            prog.bytes = int(prog.total_bytes * len(prog.finished) / max(1, shards))
        prog.start_frac = prog.bytes / prog.total_bytes if prog.total_bytes else 0.0
        prog.start_rows = prog.rows + prog.errors
        return prog

    def running(self) -> bool:
        return any(j.active for j in self.jobs.values())

    def wait(self, timeout: float) -> None:
        """Run the local Jobs until one of them changes or `timeout` passes."""
        deadline = time.monotonic() + timeout
        while True:
            changed = False
            for name, job in self.jobs.items():
                if job.finished:
                    continue
                if job.tick():
                    changed = True
                if job.finished and name in self.progress:
                    self.draw(self.progress[name], final=True)
            self.draw_running()
            if changed or time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def draw_running(self) -> None:
        now = time.monotonic()
        if not self.show_progress or now - self.last_draw < 0.5:
            return
        self.last_draw = now
        for name, job in self.jobs.items():
            if not job.finished and name in self.progress:
                self.draw(self.progress[name])

    def draw(self, prog: _Progress, final: bool = False) -> None:
        with prog.lock:
            line = prog.line()
        if self.show_progress:
            sys.stderr.write("\r" + line + "\x1b[K" + ("\n" if final else ""))
            sys.stderr.flush()
        elif final and self.log_progress:
            print(line, file=sys.stderr)

    def stop_all(self) -> None:
        self.stopping = True
        for job in self.jobs.values():
            job.stop()

    def kill_all(self) -> None:
        for job in self.jobs.values():
            job.kill()

    def wait_stopped(self) -> None:
        while self.running():
            self.wait(0.2)


class LocalRunner:
    """Runs one job to the end through the operator's decisions, with worker subprocesses."""

    def __init__(self, job: BatchInferenceJob, parallelism: int | None = None, show_progress: bool = True,
                 worker_cmd: list[str] | None = None, cancel: bool = False, canary_only: bool = False,
                 notify_backoff: notify.Backoff = notify.BACKOFF):
        if parallelism is not None and parallelism < 1:
            raise ValueError(f"--parallelism must be at least 1, got {parallelism}")
        refused = None if cancel else nodes_per_lane_refusal(job)
        if refused:
            raise ValueError(refused)
        if parallelism is not None and parallelism != job.spec.workers.parallelism:
            # --parallelism is spec.workers.parallelism for this run: lanes of rounds not planned yet,
            # processes at once, publish processes.
            job = job.model_copy(update={"spec": job.spec.model_copy(update={
                "workers": job.spec.workers.model_copy(update={"parallelism": parallelism})})})
        if cancel:
            # `bij cancel`: as the operator does for spec.cancel, publish what is durable and stop for good.
            job = job.model_copy(update={"spec": job.spec.model_copy(update={"cancel": True})})
        if canary_only and job.spec.canary is None:
            # --canary-only without spec.canary: the default canary, thresholds none (its figures and estimate).
            job = job.model_copy(update={"spec": job.spec.model_copy(update={"canary": CanarySpec()})})
        self.cancel = cancel
        self.canary_only = canary_only
        self.notify_backoff = notify_backoff
        self.job = job
        self.output_claimed = False  # the plan step claimed the output for this job: its status may go there
        self.over: Manifest | None = None  # published before this run (`restore_status`): decide() leaves it alone
        self.store: Any = None
        # The pod's command; a library user can run workers another way (a container, another venv).
        self.worker_cmd = worker_cmd or worker_command()
        self.parallelism = job.spec.workers.parallelism
        # A step (plan, a round's statistics, the publish plan and a pass of one index, the manifest)
        # is a second of storage work; as a process of its own, its interpreter start and imports cost
        # about 0.4 s here, seven times a job. They run in this process when theirs would be the same
        # code with the same environment: the worker command is ours and the spec adds no variables.
        steps_here = worker_cmd is None and worker_env(job) == dict(os.environ)
        self.backend = LocalBackend(job, self.worker_cmd, show_progress=show_progress and sys.stderr.isatty(),
                                    log_progress=show_progress, steps_here=steps_here)

    def run_round(self, round_no: int, plan: RoundPlan) -> tuple[bool, str]:
        """Run one planned round's Job alone (no status, no publish), as the driver would create it.
        Returns (succeeded, message)."""
        body = render_job(self.job, round_no, plan.lanes, plan.manifest_uri, image=self.backend.worker_image)
        lj = LocalJob(body, self.worker_cmd, self.backend.env())
        lj.run()
        if lj.condition is None or lj.condition["type"] != "Complete":
            if count_done(self.job, round_no) >= plan.shard_count and (
                    lj.condition is None or lj.condition["reason"] != "PodFailurePolicy"):
                return True, ""  # lanes failed, the others finished their shards
            return False, (lj.condition or {}).get("message", "stopped")
        return True, ""

    def run(self) -> int:
        """Plan, run and publish. Returns the process exit code."""
        previous = signal.getsignal(signal.SIGINT)

        def on_int(signum: int, frame: Any) -> None:
            if self.backend.stopping:
                self.backend.kill_all()
                return
            print("\nbij: stopping workers cleanly (Ctrl-C again to kill them)", file=sys.stderr)
            self.backend.stop_all()

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
            self.backend.stop_all()
            self.backend.wait_stopped()
            signal.signal(signal.SIGINT, previous)

    def _run(self) -> int:
        if self.job.spec.suspend and not self.job.spec.cancel:
            print(f"bij: {self.job.metadata.name} is suspended (spec.suspend: true): nothing was run; "
                  "set spec.suspend to false to run it", file=sys.stderr)
            return EXIT_BAD_CONFIG
        self.store = store = open_storage(self.job.spec.output.uri, self.job.spec.storage.s3)
        self.over = self.restore_status(store)
        if self.over is not None and self.over.partial is None and not self.cancel:
            self.published_before(store)
        backend = self.backend
        # Nobody reads this status while it runs: refresh its row counts (from the lanes' reports) once a
        # minute, not every few seconds; phase changes are written at once.
        # Local processes run under no RBAC: no worker grants to check (worker_grants None).
        driver = Driver(backend, status_interval=60.0, worker_grants=None, notify_backoff=self.notify_backoff)
        kept: dict[str, Any] | None = None
        while True:
            if backend.stopping:
                backend.wait_stopped()
                print("bij: stopped; run the same command again to resume", file=sys.stderr)
                return 130
            idle = driver.reconcile()
            status, state = backend.status, JobStatus.read(backend.status)
            if status != kept:
                # Every change, as the operator's status writes (progress at most once a status interval).
                kept = json.loads(json.dumps(status))
                self.keep_status(store, status)
            if state.phase in TERMINAL_PHASES:
                if not notify.settled(self.job, state) and idle.recheck is not None:
                    # spec.notify's webhooks are told (or given up) before bij run ends, as the operator would.
                    backend.wait(idle.recheck)
                    continue
                return self.finished(status)
            if self.canary_only and state.canary is not None and state.canary.verdict == "Passed":
                # The verdict and estimate were said (the CanaryPassed Event); the rest runs on the next `bij run`.
                print("bij: --canary-only: the canary passed; run again without --canary-only to run the rest "
                      "(the canary's rows are kept)", file=sys.stderr)
                return 0
            if isinstance(idle.decision, Retry):
                # The operator would try again later; here the person who ran bij decides.
                return EXIT_BAD_CONFIG if idle.decision.permanent else 1
            backend.wait(min(idle.recheck or 1.0, 1.0))

    def keep_status(self, store: Any, status: dict[str, Any]) -> None:
        """The whole status, kept at layout.local_status_uri as the API server keeps a bij's: what `bij status` shows
        (as `kubectl get bij` would), published or not, and what the next `bij run` takes up (`restore_status`).
        Best effort: a status that cannot be kept does not stop the run.

        Kept once the plan step claimed the output for this job; before that only a failure that is not a
        refusal (a plan step that crashed), and never where the output overlaps the input or is another
        job's: a refused spec writes nothing."""
        uri = layout.local_status_uri(self.job)
        try:
            standing = "ours" if self.output_claimed else output_standing(self.job, store)
            self.output_claimed = standing == "ours"
            crashed = status.get("phase") == "Failed" and failure_reason(JobStatus.read(status)) != "PlanRefused"
            if standing == "refused" or (standing == "unclaimed" and not crashed):
                return
            store.write_bytes(uri, json.dumps(status).encode())
        except (StorageError, OSError):
            pass

    def restore_status(self, store: Any) -> Manifest | None:
        """The status the last run kept (`keep_status`) put back, as the operator finds a bij's status when it
        restarts, so that `decide()` takes the rerun up; the manifest when the job was published (its phase then
        Succeeded, Cancelled or Expired, which `decide()` leaves alone), else None.

        Only where the output is this job's (else the plan step refuses it, as on any run). A job not published
        gets its startTime back alone, from which spec.deadlineSeconds counts (as the operator's does without a
        creationTimestamp): its rerun plans round 0 again, which refuses a changed spec or input, and it resumes
        after a failure, which on a cluster is final."""
        if output_standing(self.job, store) != "ours":
            return None
        self.output_claimed = True
        try:
            kept = json.loads(store.read_bytes(layout.local_status_uri(self.job)))
        except (StorageError, OSError, ValueError):
            kept = None
        kept = kept if isinstance(kept, dict) else {}
        manifest = read_manifest(self.job)
        if manifest is None:
            started = kept.get("startTime") or round_planned_at(self.job, store)
            if started:
                self.backend.status = {"startTime": started}
            return None
        phase = manifest.partial.phase if manifest.partial is not None else "Succeeded"
        if kept.get("phase") != phase:
            kept = status_of_manifest(self.job, manifest, phase)
        self.backend.status = kept
        return manifest

    def published_before(self, store: Any) -> None:
        """A rerun of a job published whole, where `bij run` does what the operator (which leaves a Succeeded bij
        alone, whatever its spec says) does not: refuse a changed spec or input, as any rerun does, and finish a
        removal of work files cut short (its RemovalFailed warning says a rerun does)."""
        plan_round(self.job, 0)
        resumed = resume_removal(store, self.job)
        warning = resumed.warning() if resumed is not None else None
        if warning:
            print(f"bij: warning: {warning}", file=sys.stderr)

    def over_before(self, manifest: Manifest) -> int:
        """The exit code and last words of a rerun of a job that was over before it (`decide()` left it alone)."""
        name = self.job.metadata.name
        partial = manifest.partial
        if partial is not None:
            print(f"bij: {name} was {partial.phase.lower()} ({partial.reason}) and its finished part published at "
                  f"{manifest.published_at}: it never runs or publishes again; to run it anew, bij run --restart "
                  "(deletes its results) or choose a new spec.output.uri", file=sys.stderr)
        elif self.cancel:
            print(f"bij: {name} was published whole at {manifest.published_at}: nothing to cancel", file=sys.stderr)
        elif (removed := removed_record(self.store, self.job)) is not None:
            # Nothing to work, and its logs are gone (keepIntermediate false).
            print(f"bij: {name} was published before; its work files were removed at {removed.get('removedAt')} "
                  "(output.keepIntermediate: false), nothing to do", file=sys.stderr)
        else:
            print(f"bij: {name} was published before, at {manifest.published_at}: nothing to do", file=sys.stderr)
        print(layout.manifest_uri(self.job))
        if partial is not None and not (self.cancel and partial.phase == "Cancelled"):
            return EXIT_STOPPED
        return 0

    def finished(self, status: dict[str, Any]) -> int:
        """The exit code and last words of a job that ended."""
        if self.over is not None:
            return self.over_before(self.over)
        if status.get("phase") in STOPPED_PHASES:
            manifest = read_manifest(self.job)
            assert manifest is not None and manifest.partial is not None, "stopped without a partial manifest"
            c = manifest.partial.counts
            print(f"bij: {status['phase'].lower()}: {c.completed:,} rows completed, {c.failed:,} failed, "
                  f"{c.not_run:,} not run", file=sys.stderr)
            self.summary(manifest)
            return 0 if self.cancel and status["phase"] == "Cancelled" else EXIT_STOPPED
        if status.get("phase") == "CanaryFailed":
            return EXIT_BAD_CONFIG  # its message, with the figures and failing rows, was said (the Event)
        if status.get("phase") != "Succeeded":
            reason = failure_reason(JobStatus.read(status)) or "Failed"
            if reason == "PodFailurePolicy":
                print("bij: a worker reported a bad configuration (exit 42); see its log above", file=sys.stderr)
            return EXIT_BAD_CONFIG if reason in BAD_CONFIG_REASONS else 1
        manifest = read_manifest(self.job)
        assert manifest is not None, "Succeeded without a manifest"
        self.summary(manifest)
        return 0

    def summary(self, manifest: Manifest) -> None:
        """What the run cost and what to know about its rows (the Published Event said where they are)."""
        c = manifest.counts
        eff, spent = manifest.efficiency or EfficiencyFigures(), manifest.cost
        print(f"bij: {eff.worker_seconds:,.1f} worker seconds ({eff.model_loads} model loads, "
              f"{eff.model_load_seconds:,.1f} s), engine busy {eff.engine_busy_fraction:.0%}, "
              f"{eff.rows_per_second_per_worker:,.1f} rows/s per worker", file=sys.stderr)
        if spent is not None:
            print(f"bij: cost {fmt_money(spent.total)} at {spent.price_per_hour:g}/hour per worker: "
                  f"{fmt_money(spent.per_million_rows)} per million rows, "
                  f"{fmt_money(spent.per_million_tokens)} per million tokens", file=sys.stderr)
        if c.truncated:
            print(f"bij: {c.truncated:,} rows were longer than the model's input limit and were truncated "
                  f"(marked \"truncated\": true in their result)", file=sys.stderr)
        if c.capped:
            print(f"bij: RetryCapReached: {c.capped:,} rows were still rejected at the cap; "
                  f"they are in the manifest's cappedFiles", file=sys.stderr)
        print(layout.manifest_uri(self.job))


def status_of_manifest(job: BatchInferenceJob, manifest: Manifest, phase: str) -> dict[str, Any]:
    """The status of a job published by a bij that kept no status once published (or whose kept status was
    lost): what its manifest says. Its spec.notify webhooks are not told again: that run told them before it
    ended, and whether they answered is not known here, so each is recorded as given up, saying why."""
    said = f"{phase.lower()} ({manifest.partial.reason}): " if manifest.partial is not None else ""
    status: dict[str, Any] = {"phase": phase, "manifestUri": layout.manifest_uri(job),
                              "message": f"{said}published at {manifest.published_at}"}
    why = "published by an earlier run whose status was not kept: not told again"
    told = [Notified(url=target.url, event=event, gave_up=True, last_error=why).as_status()
            for target, event in notify.wanted(job, JobStatus.read(status))]
    if told:
        status["notified"] = told
    return status


def round_planned_at(job: BatchInferenceJob, store: Any) -> str | None:
    """When round 0 was planned, or None: the start of a job whose status was not kept, or kept by a bij of an
    earlier version without its startTime."""
    from bij.contract.plan import Plan
    from bij.storage import NotFound

    uri = layout.round_manifest_uri(job, 0)
    try:
        return Plan.from_json(store.read_bytes(uri), f"round plan {uri}").created_at
    except NotFound:
        return None


def nodes_per_lane_refusal(job: BatchInferenceJob) -> str | None:
    """Why `bij run` cannot run `job` here: a lane of several pods (spec.workers.nodesPerLane) needs a node per
    pod and a Ray cluster across them, which only a Kubernetes cluster gives."""
    nodes = job.spec.workers.nodes_per_lane
    if nodes == 1:
        return None
    return (f"spec.workers.nodesPerLane is {nodes}: a lane of several pods (a Ray head and Ray workers on "
            "different nodes) runs on Kubernetes only; `bij run` runs one process per lane: set "
            "nodesPerLane to 1 here (the model must fit one machine), or apply the job to a cluster")
