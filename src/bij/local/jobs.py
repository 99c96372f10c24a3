"""An Indexed Job controller for one machine: runs a batch/v1 Job body as local processes.

`bij run` hands the very Job bodies the operator would create (`jobs.render_job`,
`jobs.render_publish_job`) to `LocalJob`, which keeps the parts of the Job controller's
contract the workers and `reconcile.decide()` rely on:

- one process per index with ``JOB_COMPLETION_INDEX`` set, at most ``parallelism`` at once;
- ``backoffLimitPerIndex``: a failed index is started again until it has failed that many
  times more, then it is a failed index; ``maxFailedIndexes`` exceeded fails the Job;
- ``podFailurePolicy`` ``FailJob`` on the worker's exit codes: the Job fails at once and the
  other indexes are stopped (SIGTERM);
- status as the API server shows it: ``active``, ``completedIndexes``, ``failedIndexes`` and the
  ``Complete``/``Failed`` conditions (with the reasons the real controller uses).

The container's command becomes the local worker command; its environment comes from the
caller (the pod's image-specific settings, model cache paths and metrics ports do not apply
on one machine). A failed index's last line on stderr is kept for the Job's failure message,
as a kubelet keeps a terminated container's message.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

from bij.contract.codes import CANARY_SHARDS_ENV, LANE_OFFSET_ENV, POOL_ENV, TENSOR_PARALLEL_ENV
from bij.contract.spec import BatchInferenceJob
from bij.control.observe import format_ranges
from bij.control.status import fmt_time, now_utc
from bij.worker.report import JOB_UID_ENV, POD_NAME_ENV

# The worker's log format in front of a line: the message alone says what failed.
_LOG_PREFIX = re.compile(r"^\d{4}-\d\d-\d\d [\d:,]+ [A-Z]+ [\w.]+: ")


def worker_command() -> list[str]:
    """`bij-worker` from the same environment as this process."""
    found = shutil.which("bij-worker", path=os.path.dirname(sys.executable))
    return [found] if found else [sys.executable, "-m", "bij.cli.worker"]


def worker_env(job: BatchInferenceJob) -> dict[str, str]:
    """A local worker's environment: this process's, the storage settings, spec.workers.env."""
    env = dict(os.environ)
    s3 = job.spec.storage.s3
    if s3.endpoint_url:
        env["AWS_ENDPOINT_URL"] = s3.endpoint_url
    if s3.region:
        env["AWS_REGION"] = s3.region
    env.update(job.spec.workers.env)
    return env


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class LocalJob:
    """One Indexed Job as local processes. Call `tick()` often; `view()` is its batch/v1 shape."""

    def __init__(self, body: Mapping[str, Any], command: Sequence[str], env: Mapping[str, str], *,
                 extra_args: Sequence[str] = (), on_stdout: Callable[[IO[bytes]], None] | None = None,
                 say: Callable[[str], None] = _say, stats: list[dict[str, Any]] | None = None,
                 in_process: Callable[[list[str], Mapping[str, str]], int] | None = None):
        meta, spec = body["metadata"], body["spec"]
        self.name = str(meta["name"])
        self.uid = str(meta.get("uid") or uuid.uuid4())
        self.namespace = str(meta.get("namespace") or "default")
        self.labels = dict(meta.get("labels") or {})
        self.annotations = dict(meta.get("annotations") or {})
        self.completions = int(spec["completions"])
        self.parallelism = int(spec.get("parallelism") or 1)
        self.suspend = bool(spec.get("suspend"))
        self.backoff_limit = int(spec.get("backoffLimitPerIndex") or 0)
        self.max_failed = spec.get("maxFailedIndexes")
        self.fail_job_codes: set[int] = set()
        for rule in (spec.get("podFailurePolicy") or {}).get("rules") or []:
            codes = rule.get("onExitCodes") or {}
            if rule.get("action") == "FailJob" and codes.get("operator", "In") == "In":
                self.fail_job_codes.update(int(v) for v in codes.get("values") or [])
        (container,) = spec["template"]["spec"]["containers"]
        args = list(container.get("args") or [])
        if "--metrics-port" in args:  # one port per pod; processes on one machine would collide
            i = args.index("--metrics-port")
            del args[i:i + 2]
        self.command = [*command, *args, *extra_args]
        self.args = [*args, *extra_args]
        # Runs the pod's args in this process (a thread per index) instead of `command`: for a short
        # storage step, whose interpreter start and imports cost more than its work (see _InProcess).
        self.in_process = in_process
        # Of the pod's own variables only those that say which shards and lanes it works (a canary Job's, a
        # pool's Job's).
        own = {e["name"]: str(e.get("value", "")) for e in container.get("env") or []
               if e.get("name") in (CANARY_SHARDS_ENV, LANE_OFFSET_ENV, POOL_ENV, TENSOR_PARALLEL_ENV)}
        self.env = {**env, **own, JOB_UID_ENV: self.uid}
        self.on_stdout = on_stdout
        self.say = say
        self.stats = stats
        self.pending: deque[int] = deque(range(self.completions))
        self.attempts: dict[int, int] = {}
        self.procs: dict[int, tuple[subprocess.Popen[bytes] | _InProcess, float, threading.Thread]] = {}
        self.last_error: dict[int, str] = {}
        self.last_lines: dict[int, list[str]] = {}
        # Each failed attempt as the API server shows a failed pod (what `observe.failed_pods` reads).
        self.pods_failed: list[dict[str, Any]] = []
        self.completed: set[int] = set()
        self.failed: set[int] = set()
        self.failures: list[str] = []  # "index i exited rc: last line", for the Failed condition
        self.condition: dict[str, str] | None = None  # Complete or Failed, once finished
        self.fail_reason: tuple[str, str] | None = None  # decided, waiting for running indexes to end
        self.stopping = False
        self.readers: list[threading.Thread] = []

    # --- the controller ------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self.condition is not None

    @property
    def active(self) -> int:
        return len(self.procs)

    def tick(self) -> bool:
        """Reap ended processes, apply the Job's policies, start pending indexes. True if anything changed."""
        changed = False
        for i in list(self.procs):
            p, started, reader = self.procs[i]
            if isinstance(p, _InProcess):
                if reader.is_alive():
                    continue
                rc, rss = p.returncode, 0
                self.last_error[i], self.last_lines[i] = p.last_error(), p.tail()
            else:
                got, status, usage = os.wait4(p.pid, os.WNOHANG)
                if got != p.pid:
                    continue
                rc, rss = os.waitstatus_to_exitcode(status), usage.ru_maxrss
                p.returncode = rc
                reader.join(timeout=5)  # its stderr is read to the end: the last line is known
            changed = True
            del self.procs[i]
            if self.stats is not None:
                self.stats.append({"job": self.name, "index": i, "maxRssKiB": rss, "rc": rc,
                                   "seconds": round(time.monotonic() - started, 3)})
            self._ended(i, rc)
        if self.fail_reason is None and not self.stopping and not self.suspend:
            while self.pending and len(self.procs) < self.parallelism:
                self._start(self.pending.popleft())
                changed = True
        if self.condition is None and not self.procs:
            if self.fail_reason is not None:
                self._finish("Failed", *self.fail_reason)
                changed = True
            elif not self.pending and not self.stopping:
                if self.failed:
                    self._finish("Failed", "FailedIndexes", "Job has failed indexes: " + "; ".join(self.failures))
                else:
                    self._finish("Complete", "CompletionsReached", "Reached expected number of succeeded pods")
                changed = True
        return changed

    def _start(self, i: int) -> None:
        self.attempts[i] = self.attempts.get(i, 0) + 1
        # A session of its own: a terminal's Ctrl-C reaches only bij, which asks each worker once
        # (SIGTERM) to drain; a second signal would make the worker quit at once.
        env = {**self.env, "JOB_COMPLETION_INDEX": str(i), POD_NAME_ENV: f"{self.name}-{i}-{self.attempts[i]}"}
        if self.in_process is not None:
            pod = _InProcess(self.in_process, self.args, env)
            self.procs[i] = (pod, time.monotonic(), pod.thread)
            pod.thread.start()
            return
        p = subprocess.Popen(self.command, env=env,
                             stdin=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             stdout=subprocess.PIPE if self.on_stdout else subprocess.DEVNULL, start_new_session=True)
        assert p.stderr is not None
        reader = threading.Thread(target=self._relay, args=(i, p.stderr), daemon=True)
        reader.start()
        if self.on_stdout is not None:
            assert p.stdout is not None
            t = threading.Thread(target=self.on_stdout, args=(p.stdout,), daemon=True)
            t.start()
            self.readers.append(t)
        self.procs[i] = (p, time.monotonic(), reader)

    def _relay(self, i: int, stream: IO[bytes]) -> None:
        """Pass the worker's stderr through, keeping its last line."""
        last = ""
        tail: deque[str] = deque(maxlen=5)
        for raw in stream:
            out = getattr(sys.stderr, "buffer", None)  # a caller may have put a text stream in its place
            if out is not None:
                out.write(raw)
            else:
                sys.stderr.write(raw.decode(errors="replace"))
            sys.stderr.flush()
            text = raw.decode(errors="replace").strip()
            if text:
                last = text
                tail.append(_LOG_PREFIX.sub("", text))
        self.last_error[i] = _LOG_PREFIX.sub("", last)
        self.last_lines[i] = list(tail)

    def _ended(self, i: int, rc: int) -> None:
        if rc == 0:
            self.completed.add(i)
            return
        # As a container's status says it: a signal is 128 + its number; the message is the log's end
        # (terminationMessagePolicy FallbackToLogsOnError).
        self.pods_failed.append({
            "metadata": {"name": f"{self.name}-{i}-{self.attempts[i]}", "labels": {
                "batch.kubernetes.io/job-name": self.name}, "creationTimestamp": fmt_time(now_utc())},
            "status": {"phase": "Failed", "containerStatuses": [{"name": "worker", "state": {"terminated": {
                "exitCode": 128 - rc if rc < 0 else rc, "reason": "Error",
                "message": "\n".join(self.last_lines.get(i, []))}}}]}})
        what = f"index {i} exited {rc}" + (f": {self.last_error[i]}" if self.last_error.get(i) else "")
        if rc in self.fail_job_codes and self.fail_reason is None:
            # As the Job controller words it: the pod name says which index it was.
            self.fail_reason = ("PodFailurePolicy",
                                f"Container worker for pod {self.namespace}/{self.name}-{i}-local failed with exit "
                                f"code {rc} matching FailJob rule at index 0")
            self.failures.append(what)
            self.stop()
            return
        if self.suspend and not self.stopping:
            self.attempts[i] -= 1  # suspended: the index starts again on resume, as the Job's would
            self.pending.appendleft(i)
            return
        if self.stopping or self.fail_reason is not None:
            return  # stopped by us: neither done nor failed; a rerun resumes it
        if self.attempts[i] <= self.backoff_limit:
            self.say(f"bij: {self.name} index {i} failed (exit {rc}), retry {self.attempts[i]}/{self.backoff_limit}")
            self.pending.append(i)
            return
        self.failed.add(i)
        self.failures.append(what)
        self.say(f"bij: {self.name} index {i} failed (exit {rc}) after {self.backoff_limit} retries")
        if self.max_failed is not None and len(self.failed) > int(self.max_failed):
            self.fail_reason = ("MaxFailedIndexesExceeded", "Job has exceeded the specified maximal number of "
                                "failed indexes: " + "; ".join(self.failures))
            self.stop()

    def _finish(self, type_: str, reason: str, message: str) -> None:
        self.condition = {"type": type_, "status": "True", "reason": reason, "message": message,
                          "lastTransitionTime": fmt_time(now_utc())}
        for t in self.readers:
            t.join(timeout=5)

    def _signal(self, sig: int, group: bool = False) -> None:
        # By pid, not Popen.send_signal: that reaps an ended process, whose status tick() must read.
        # The pid cannot be reused before tick() reaps it. Each worker leads a session of its own
        # (start_new_session), so its process group is its pid: `group` reaches its children too.
        for p, _, _ in self.procs.values():
            if isinstance(p, _InProcess):
                continue  # a short step: it ends on its own (its work is rewritten whole if run again)
            try:
                (os.killpg if group else os.kill)(p.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        """SIGTERM every running index and start no more (what deleting the Job's pods does)."""
        self.stopping = True
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL every running index with all its processes, as a pod's kill ends every process in it
        (vLLM's engine core runs in a child of the worker; killed alone, the worker left it behind,
        holding its memory and the worker's stdout)."""
        self._signal(signal.SIGKILL, group=True)

    def patch(self, spec: Mapping[str, Any]) -> None:
        if "parallelism" in spec:
            self.parallelism = int(spec["parallelism"])
        if "suspend" in spec:
            self.suspend = bool(spec["suspend"])
            if self.suspend:
                self._signal(signal.SIGTERM)

    def run(self, poll: float = 0.05) -> None:
        """Run to the end (Complete or Failed)."""
        while not self.finished:
            if not self.tick():
                time.sleep(poll)
            if self.stopping and not self.procs and not self.finished:
                return

    def failed_pods(self) -> list[dict[str, Any]]:
        """The failed attempts as pods (their names, exit codes and last log lines)."""
        return list(self.pods_failed)

    def view(self) -> dict[str, Any]:
        """The Job as the API server would show it (what `observe.JobView` reads)."""
        status: dict[str, Any] = {"active": len(self.procs)}
        if self.pods_failed:
            status["failed"] = len(self.pods_failed)
        if self.completed:
            status["completedIndexes"] = format_ranges(self.completed)
        if self.failed:
            status["failedIndexes"] = format_ranges(self.failed)
        conditions = [dict(self.condition)] if self.condition is not None else []
        if self.suspend:  # as the Job controller says once it has acted on spec.suspend
            conditions.append({"type": "Suspended", "status": "True", "reason": "JobSuspended",
                               "message": "Job suspended"})
        if conditions:
            status["conditions"] = conditions
        return {"apiVersion": "batch/v1", "kind": "Job",
                "metadata": {"name": self.name, "namespace": self.namespace, "uid": self.uid,
                             "labels": dict(self.labels), "annotations": dict(self.annotations)},
                "spec": {"completions": self.completions, "parallelism": self.parallelism, "suspend": self.suspend},
                "status": status}


class _InProcess:
    """One index of a step Job run in a thread of this process (LocalJob's `in_process`).

    Its log lines (from its thread only) go to stderr at WARNING and above, as a step pod's
    (BIJ_LOG_LEVEL=WARNING) would, and the last ones are kept for the Job's failure message; an
    exception, or a SystemExit, ends it as a pod's process would end: exit 1, or the exit's code.
    """

    def __init__(self, run: Callable[[list[str], Mapping[str, str]], int], args: list[str],
                 env: Mapping[str, str]):
        self.run, self.args, self.env = run, args, env
        self.returncode = 1
        self.lines: deque[str] = deque(maxlen=5)
        self.thread = threading.Thread(target=self._main, name="bij-step", daemon=True)

    def _main(self) -> None:
        me = threading.get_ident()
        handler = _ThreadLog(me, self.lines)
        root = logging.getLogger()
        root.addHandler(handler)
        try:
            self.returncode = self.run(self.args, self.env)
        except SystemExit as e:
            self.returncode = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException as e:  # noqa: BLE001 - a pod's process would die of it: exit 1, its last words
            logging.getLogger("bij.worker").error("%s: %s", type(e).__name__, e, exc_info=True)
            self.returncode = 1
        finally:
            root.removeHandler(handler)

    def last_error(self) -> str:
        return self.lines[-1] if self.lines else ""

    def tail(self) -> list[str]:
        return list(self.lines)


class _ThreadLog(logging.Handler):
    """A step thread's log records: WARNING and above to stderr, the messages kept."""

    def __init__(self, thread: int, lines: deque[str]):
        super().__init__(level=logging.DEBUG)
        self.thread, self.lines = thread, lines
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread != self.thread:
            # Another thread's record, which Python's last-resort handler would have printed had this
            # one not been on the root logger: printed so by the first such handler, if it is alone there.
            handlers = logging.getLogger().handlers
            if record.levelno >= logging.WARNING and handlers and handlers[0] is self and \
                    all(isinstance(h, _ThreadLog) for h in handlers):
                sys.stderr.write(record.getMessage() + "\n")
            return
        self.lines.append(record.getMessage())
        if record.levelno >= logging.WARNING:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
