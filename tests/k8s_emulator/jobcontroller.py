"""A test-side Job controller: runs each Indexed Job's pods as local processes.

It does what kube-controller-manager's Job controller and the kubelet do for the
operator's Jobs, with real `bij-worker` processes instead of containers: at most
``parallelism`` pods at a time, ``JOB_COMPLETION_INDEX`` per pod, SIGTERM on suspend
(not counted as a failure) and a fresh pod on resume, ``backoffLimitPerIndex`` /
``maxFailedIndexes`` / ``backoffLimit``, the ``podFailurePolicy`` rules (``FailJob`` on an
exit code, ``Ignore`` on ``DisruptionTarget`` for preempted pods), and the status a real
cluster writes: ``completedIndexes``/``failedIndexes`` range strings, ``active`` /
``succeeded`` / ``failed`` / ``terminating`` counts, ``SuccessCriteriaMet`` then
``Complete``, ``FailureTarget`` then ``Failed``, ``Suspended``, and
``ttlSecondsAfterFinished``.

Tests steer it with `inject_exit()` (the next pod of an index exits with a given code,
optionally after a while), `hold()`/`release()` (pods of an index wait, as if
unschedulable) and `preempt()` (a spot node goes away under a running pod).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import random
import shutil
import signal
import socket
import string
import sys
from pathlib import Path
from typing import Any

from .server import Emulator
from .store import Change, Obj, Resource, now_iso


def format_ranges(indexes: set[int]) -> str:
    """``{1,3,4,5,7}`` as the Job API writes it: ``"1,3-5,7"``."""
    items = sorted(indexes)
    parts, i = [], 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1] == items[j] + 1:
            j += 1
        parts.append(str(items[i]) if i == j else f"{items[i]}-{items[j]}")
        i = j + 1
    return ",".join(parts)


@dataclasses.dataclass(eq=False)
class Pod:
    index: int
    name: str
    proc: asyncio.subprocess.Process | None = None
    # Why the controller is stopping this pod: "suspend", "failing", "deleted"; None while it runs.
    stopping: str | None = None
    disrupted: bool = False
    grace: float = 30.0


@dataclasses.dataclass
class JobState:
    namespace: str
    name: str
    uid: str
    pods: dict[int, Pod] = dataclasses.field(default_factory=dict)
    completed: set[int] = dataclasses.field(default_factory=set)
    failed_indexes: set[int] = dataclasses.field(default_factory=set)
    index_failures: dict[int, int] = dataclasses.field(default_factory=dict)
    succeeded: int = 0
    failed_pods: int = 0
    # (reason, message) once the controller decided the Job fails; pods are then stopped.
    failure: tuple[str, str] | None = None
    finished: bool = False
    started: str | None = None
    attempts: int = 0
    gone: bool = False


class JobController:
    """Runs the pods of every Job in the emulator as subprocesses. Start after the emulator."""

    def __init__(self, emulator: Emulator, *, env: dict[str, str] | None = None, log_dir: str | Path | None = None,
                 entrypoint: list[str] | None = None, workdir: str | Path | None = None):
        self.emulator = emulator
        self.env = dict(env or {})
        self.log_dir = Path(log_dir) if log_dir else None
        self.entrypoint = entrypoint or ["bij-worker"]
        self.workdir = str(workdir) if workdir else None
        self.jobs: dict[str, JobState] = {}
        self._faults: dict[tuple[str, int], list[tuple[int, float]]] = {}
        self._held: set[tuple[str, int]] = set()
        self._res: Resource | None = None
        self._pending: set[str] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stopped = False
        self.pods_started: list[tuple[str, int]] = []  # (job name, index) per pod, for assertions

    # --- control from tests (thread-safe) -------------------------------------------------

    def start(self) -> JobController:
        self.emulator.call(self._start)
        return self

    def stop(self) -> None:
        self.emulator.submit(self._stop_all()).result(timeout=60)

    def __enter__(self) -> JobController:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def inject_exit(self, job_name: str, index: int, exit_code: int, times: int = 1, sleep: float = 0.0) -> None:
        """The next `times` pods of `index` of Job `job_name` run for `sleep` seconds (a stand-in
        for a slow shard) and exit with `exit_code`, instead of running the worker."""
        fault = (exit_code, sleep)
        self.emulator.call(lambda: self._faults.setdefault((job_name, index), []).extend([fault] * times))

    def hold(self, job_name: str, *indexes: int) -> None:
        """Pods of these indexes are not started (as if unschedulable) until `release()`."""
        self.emulator.call(lambda: self._held.update((job_name, i) for i in indexes))

    def release(self, job_name: str) -> None:
        def go() -> None:
            self._held.difference_update({k for k in self._held if k[0] == job_name})
            for st in self.jobs.values():
                if st.name == job_name:
                    self._schedule({"metadata": {"uid": st.uid, "namespace": st.namespace, "name": st.name}})
        self.emulator.call(go)

    def preempt(self, job_name: str, index: int) -> bool:
        """A spot node goes away: the pod of `index` gets SIGTERM and a DisruptionTarget condition."""
        def go() -> bool:
            for st in self.jobs.values():
                pod = st.pods.get(index)
                if st.name == job_name and pod is not None and pod.stopping is None:
                    pod.disrupted = True
                    self._terminate(pod, "preempted")
                    return True
            return False
        return self.emulator.call(go)

    def running(self, job_name: str) -> list[int]:
        """Indexes with a live pod right now."""
        def go() -> list[int]:
            return sorted(i for st in self.jobs.values() if st.name == job_name
                          for i, p in st.pods.items() if p.stopping is None)
        return self.emulator.call(go)

    # --- on the emulator's loop ------------------------------------------------------------

    def _start(self) -> None:
        store = self.emulator.store
        assert store is not None
        self._res = store.resource("batch", "v1", "jobs")
        store.listeners.append(self._on_change)
        for obj in store.all_objects(self._res):
            self._schedule(obj)

    async def _stop_all(self) -> None:
        self._stopped = True
        store = self.emulator.store
        if store is not None and self._on_change in store.listeners:
            store.listeners.remove(self._on_change)
        for st in self.jobs.values():
            for pod in st.pods.values():
                self._terminate(pod, "deleted", grace=2.0)
        for _ in range(100):
            if not any(st.pods for st in self.jobs.values()):
                break
            await asyncio.sleep(0.05)
        for t in list(self._tasks):
            t.cancel()

    def _on_change(self, change: Change) -> None:
        if change.key != ("batch", "jobs"):
            return
        uid = change.obj["metadata"]["uid"]
        if change.type == "DELETED":
            st = self.jobs.get(uid)
            if st is not None:
                st.gone = True
                for pod in st.pods.values():
                    self._terminate(pod, "deleted")
            return
        self._schedule(change.obj)

    def _schedule(self, obj: Obj) -> None:
        # Coalesce: many writes in one loop iteration give one sync.
        uid = obj["metadata"]["uid"]
        if uid not in self.jobs:
            meta = obj["metadata"]
            self.jobs[uid] = JobState(meta["namespace"], meta["name"], uid)
        if uid not in self._pending:
            self._pending.add(uid)
            asyncio.get_running_loop().call_soon(self._sync, uid)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _sync(self, uid: str) -> None:
        self._pending.discard(uid)
        st = self.jobs.get(uid)
        store = self.emulator.store
        if st is None or st.gone or store is None or self._res is None or self._stopped:
            return
        try:
            job = store.get(self._res, st.namespace, st.name)
        except Exception:  # noqa: BLE001 - deleted between the event and now
            return
        if job["metadata"]["uid"] != uid or st.finished:
            return
        spec = job.get("spec") or {}
        status = dict(job.get("status") or {})
        conditions: list[dict[str, Any]] = list(status.get("conditions") or [])
        completions = int(spec.get("completions") or 1)
        live = {i: p for i, p in st.pods.items() if p.stopping is None}

        if st.failure is not None:
            for pod in live.values():
                self._terminate(pod, "failing")
        elif spec.get("suspend"):
            for pod in live.values():
                self._terminate(pod, "suspend")
            if not _has(conditions, "Suspended"):
                conditions = _set(conditions, "Suspended", "True", "JobSuspended", "Job suspended")
                st.started = None  # a resumed Job gets a fresh startTime, as in Kubernetes
        else:
            if _has(conditions, "Suspended"):
                conditions = _set(conditions, "Suspended", "False", "JobResumed", "Job resumed")
            st.started = st.started or status.get("startTime") or now_iso()
            todo = [i for i in range(completions)
                    if i not in st.completed and i not in st.failed_indexes and i not in st.pods
                    and (st.name, i) not in self._held]
            room = int(spec.get("parallelism", 1)) - len(live)
            for index in todo[:max(room, 0)]:
                self._start_pod(st, job, index)

        # Terminal states, in the order Kubernetes >= 1.31 writes them.
        max_failed = spec.get("maxFailedIndexes")
        if st.failure is None and max_failed is not None and len(st.failed_indexes) > max_failed:
            st.failure = ("MaxFailedIndexesExceeded", "Job has exceeded the specified maximal number of failed indexes")
        if st.failure is None and spec.get("backoffLimitPerIndex") is None and \
                st.failed_pods > int(spec.get("backoffLimit", 6)):
            st.failure = ("BackoffLimitExceeded", "Job has reached the specified backoff limit")
        all_settled = len(st.completed) + len(st.failed_indexes) >= completions
        if st.failure is None and all_settled and st.failed_indexes:
            st.failure = ("FailedIndexes", "Job has failed indexes")
        if st.failure is not None:
            reason, message = st.failure
            conditions = _set(conditions, "FailureTarget", "True", reason, message)
            for pod in [p for p in st.pods.values() if p.stopping is None]:
                self._terminate(pod, "failing")
            if not st.pods:
                conditions = _set(conditions, "Failed", "True", reason, message)
                st.finished = True
        elif all_settled:
            conditions = _set(conditions, "SuccessCriteriaMet", "True", "CompletionsReached",
                              "Reached expected number of succeeded pods")
            if not st.pods:
                conditions = _set(conditions, "Complete", "True", "CompletionsReached",
                                  "Reached expected number of succeeded pods")
                status["completionTime"] = now_iso()
                st.finished = True

        active = sum(1 for p in st.pods.values() if p.stopping is None)
        status.update({
            "active": active,
            "ready": active,
            "terminating": sum(1 for p in st.pods.values() if p.stopping is not None),
            "succeeded": st.succeeded,
            "failed": st.failed_pods,
            "completedIndexes": format_ranges(st.completed),
            "conditions": conditions,
        })
        if spec.get("backoffLimitPerIndex") is not None:
            status["failedIndexes"] = format_ranges(st.failed_indexes)
        if st.started:
            status["startTime"] = st.started
        else:
            status.pop("startTime", None)
        if not conditions:
            status.pop("conditions", None)
        # A full status write (not a merge patch), so fields can also disappear (startTime on suspend).
        store.replace(self._res, st.namespace, st.name, {**job, "status": status}, "status")
        if st.finished:
            ttl = spec.get("ttlSecondsAfterFinished")
            if ttl is not None:
                asyncio.get_running_loop().call_later(float(ttl), self._expire, st)

    def _expire(self, st: JobState) -> None:
        store = self.emulator.store
        if store is None or self._res is None or st.gone:
            return
        with contextlib.suppress(Exception):
            if store.get(self._res, st.namespace, st.name)["metadata"]["uid"] == st.uid:
                store.delete(self._res, st.namespace, st.name)

    # --- pods ------------------------------------------------------------------------------

    def _command(self, job: Obj, index: int) -> tuple[list[str], dict[str, str], int, str]:
        pod = ((job.get("spec") or {}).get("template") or {}).get("spec") or {}
        container = (pod.get("containers") or [{}])[0]
        cmd = list(container.get("command") or self.entrypoint) + list(container.get("args") or [])
        exe = cmd[0]
        if "/" not in exe:
            # The image's PATH is this interpreter's bin dir (the venv with bij-worker installed).
            found = shutil.which(exe, path=os.pathsep.join([str(Path(sys.executable).parent),
                                                            os.environ.get("PATH", "")]))
            cmd[0] = found or exe
        # Every pod has its own network namespace in a cluster; here they share the host's, so each
        # declared containerPort gets a free port of its own wherever it appears in args or env.
        ports = {str(p["containerPort"]): str(_free_port()) for p in container.get("ports") or []
                 if "containerPort" in p}
        cmd = [ports.get(a, a) for a in cmd]
        fault = self._faults.get((job["metadata"]["name"], index))
        if fault:
            code, sleep = fault.pop(0)
            cmd = [sys.executable, "-c", f"import sys, time; time.sleep({sleep}); sys.exit({code})"]
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "PYTHONPATH", "LANG", "TMPDIR")}
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        for item in container.get("env") or []:
            if "value" in item:
                env[item["name"]] = ports.get(str(item["value"]), str(item["value"]))
            elif "batch.kubernetes.io/job-completion-index" in str(item.get("valueFrom")):
                env[item["name"]] = str(index)
        env.update(self.env)
        env["JOB_COMPLETION_INDEX"] = str(index)
        grace = int(pod.get("terminationGracePeriodSeconds", 30))
        return cmd, env, grace, str(container.get("name") or "worker")

    def _start_pod(self, st: JobState, job: Obj, index: int) -> None:
        suffix = "".join(random.choices(string.ascii_lowercase + string.digits, k=5))
        pod = Pod(index=index, name=f"{st.name}-{index}-{suffix}")
        st.pods[index] = pod
        st.attempts += 1
        self.pods_started.append((st.name, index))
        self._spawn(self._run_pod(st, job, pod))

    async def _run_pod(self, st: JobState, job: Obj, pod: Pod) -> None:
        cmd, env, grace, container = self._command(job, pod.index)
        log = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log = open(self.log_dir / f"{pod.name}.log", "wb")  # noqa: SIM115 - closed below
        try:
            pod.proc = await asyncio.create_subprocess_exec(
                *cmd, env=env, cwd=self.workdir, stdout=log or asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.STDOUT, start_new_session=True)
            pod.grace = grace
            if pod.stopping is not None:
                self._signal(pod, signal.SIGTERM)
            rc = await pod.proc.wait()
        except OSError as e:
            # The kubelet's "container cannot run": exit code 128.
            if log:
                log.write(f"cannot start {cmd}: {e}\n".encode())
            rc = 128
        finally:
            if log:
                log.close()
        code = 128 - rc if rc < 0 else rc
        self._on_exit(st, job, pod, code, container)

    def _signal(self, pod: Pod, sig: int) -> None:
        if pod.proc is not None and pod.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pod.proc.pid, sig)

    def _terminate(self, pod: Pod, why: str, grace: float | None = None) -> None:
        if pod.stopping is not None:
            return
        pod.stopping = why
        self._signal(pod, signal.SIGTERM)
        wait = grace if grace is not None else pod.grace
        asyncio.get_running_loop().call_later(wait, self._signal, pod, signal.SIGKILL)

    def _on_exit(self, st: JobState, job: Obj, pod: Pod, code: int, container: str) -> None:
        if st.pods.get(pod.index) is pod:
            del st.pods[pod.index]
        spec = job.get("spec") or {}
        if pod.stopping in ("suspend", "failing", "deleted"):
            pass  # removed by the controller: never a failure
        elif code == 0:
            st.completed.add(pod.index)
            st.succeeded += 1
        else:
            action = self._policy_action(spec, pod, code, container, st)
            if action == "FailIndex":
                st.failed_pods += 1
                st.failed_indexes.add(pod.index)
            elif action != "Ignore":
                st.failed_pods += 1
                n = st.index_failures[pod.index] = st.index_failures.get(pod.index, 0) + 1
                limit = spec.get("backoffLimitPerIndex")
                if limit is not None and n > int(limit):
                    st.failed_indexes.add(pod.index)
        if not st.gone:
            self._schedule({"metadata": {"uid": st.uid, "namespace": st.namespace, "name": st.name}})

    def _policy_action(self, spec: dict[str, Any], pod: Pod, code: int, container: str, st: JobState) -> str:
        """The first matching podFailurePolicy rule's action ("Count" when none matches)."""
        for i, rule in enumerate((spec.get("podFailurePolicy") or {}).get("rules") or []):
            codes = rule.get("onExitCodes")
            if codes is not None:
                if codes.get("containerName") not in (None, container):
                    continue
                hit = code in codes.get("values", [])
                if (codes.get("operator") == "In") != hit:
                    continue
            else:
                wanted = {c.get("type") for c in rule.get("onPodConditions") or [] if c.get("status", "True") == "True"}
                if not (pod.disrupted and "DisruptionTarget" in wanted):
                    continue
            action = str(rule.get("action"))
            if action == "FailJob" and st.failure is None:
                st.failure = ("PodFailurePolicy", f"Container {container} for pod {st.namespace}/{pod.name} failed "
                                                  f"with exit code {code} matching FailJob rule at index {i}")
            return action
        return "Count"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _has(conditions: list[dict[str, Any]], type_: str) -> bool:
    return any(c.get("type") == type_ and c.get("status") == "True" for c in conditions)


def _set(conditions: list[dict[str, Any]], type_: str, status: str, reason: str, message: str) -> list[dict[str, Any]]:
    out = [dict(c) for c in conditions]
    for c in out:
        if c.get("type") == type_:
            if (c.get("status"), c.get("reason"), c.get("message")) != (status, reason, message):
                if c.get("status") != status:
                    c["lastTransitionTime"] = now_iso()
                c.update(status=status, reason=reason, message=message, lastProbeTime=now_iso())
            return out
    out.append({"type": type_, "status": status, "reason": reason, "message": message,
                "lastProbeTime": now_iso(), "lastTransitionTime": now_iso()})
    return out
