"""What decisions read of the cluster: the bij's Jobs (`JobView`, found by labels), their pods
(`failed_pods`, `stuck_pods`), the step reports and the status, gathered in one `Observation`.

Plain functions over the Jobs and pods as the API server shows them; they decide nothing.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bij.contract.codes import (
    CANARY_LABEL,
    JOB_LABEL,
    LANE_OFFSET_ANNOTATION,
    NODES_PER_LANE_ANNOTATION,
    POOL_LABEL,
    PUBLISH_LABEL,
    ROUND_LABEL,
)
from bij.contract.spec import BatchInferenceJob
from bij.contract.status import JobStatus
from bij.contract.step_report import StepReport


def parse_ranges(text: str | None) -> frozenset[int]:
    """Indexes from a Job's ``completedIndexes``/``failedIndexes`` string, e.g. ``"1,3-5,7"``."""
    out: set[int] = set()
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        if sep:
            out.update(range(int(lo), int(hi) + 1))
        else:
            out.add(int(lo))
    return frozenset(out)


def format_ranges(indexes: Iterable[int]) -> str:
    """The inverse of `parse_ranges`: sorted, with consecutive runs folded (``"1,3-5,7"``)."""
    items = sorted(set(indexes))
    parts: list[str] = []
    i = 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1] == items[j] + 1:
            j += 1
        parts.append(str(items[i]) if i == j else f"{items[i]}-{items[j]}")
        i = j + 1
    return ",".join(parts)


@dataclass(frozen=True, kw_only=True)
class Shards:
    """Shard progress of one round (from the workers' completion records): the `SHARDS` column."""

    done: int
    total: int

    @property
    def summary(self) -> str:
        return f"{self.done}/{self.total}"


@dataclass(frozen=True, kw_only=True)
class Lanes:
    """The round Job's indexes: lanes done, failed for good, running, and in all."""

    done: int
    failed: int
    active: int
    total: int
    replaced: int = 0  # lane groups (spec.workers.nodesPerLane > 1) replaced whole this round

    @property
    def summary(self) -> str:
        return f"{self.done}/{self.total}" + (f" ({self.replaced} replaced)" if self.replaced else "")


@dataclass(frozen=True, kw_only=True)
class Condition:
    status: bool
    reason: str
    message: str


@dataclass(frozen=True, kw_only=True)
class JobView:
    """The parts of an observed ``batch/v1`` Job that decisions depend on."""

    name: str
    round: int | None
    owner_uids: frozenset[str]
    deleting: bool
    completions: int
    parallelism: int | None
    suspend: bool
    active: int
    terminating: int  # pods being deleted that have not ended yet (SIGTERM sent, draining)
    completed: frozenset[int]  # lanes done (their leader's index succeeded)
    failed: frozenset[int]  # lanes with an index failed for good
    conditions: Mapping[str, Condition]
    # Pods per lane (spec.workers.nodesPerLane when the Job was made): index i is rank i % n of lane i // n.
    nodes_per_lane: int = 1
    # Lane groups of the round replaced so far, and why the latest was (the pods' reports, `LaneTally`).
    groups_replaced: int = 0
    last_group_lost: str | None = None

    @classmethod
    def of(cls, job: Mapping[str, Any]) -> JobView:
        meta = job.get("metadata") or {}
        spec = job.get("spec") or {}
        status = job.get("status") or {}
        round_label = (meta.get("labels") or {}).get(ROUND_LABEL)
        raw_nodes = str((meta.get("annotations") or {}).get(NODES_PER_LANE_ANNOTATION) or "1")
        nodes = int(raw_nodes) if raw_nodes.isdigit() and int(raw_nodes) > 0 else 1
        conditions = {
            c["type"]: Condition(
                status=str(c.get("status")) == "True",
                reason=str(c.get("reason") or ""),
                message=str(c.get("message") or ""),
            )
            for c in status.get("conditions") or []
            if c.get("type")
        }
        return cls(
            name=str(meta.get("name", "")),
            round=int(round_label) if round_label is not None and str(round_label).isdigit() else None,
            owner_uids=frozenset(str(o.get("uid")) for o in meta.get("ownerReferences") or []),
            deleting=bool(meta.get("deletionTimestamp")),
            completions=int(spec.get("completions") or 0),
            parallelism=spec.get("parallelism"),
            suspend=bool(spec.get("suspend")),
            active=int(status.get("active") or 0),
            terminating=int(status.get("terminating") or 0),
            # A lane of several pods is done when its leader (rank 0) is: the others follow it. It has
            # failed when any of its pods has: the group cannot run without one of them.
            completed=frozenset(i // nodes for i in parse_ranges(status.get("completedIndexes")) if i % nodes == 0),
            failed=frozenset(i // nodes for i in parse_ranges(status.get("failedIndexes"))),
            conditions=conditions,
            nodes_per_lane=nodes,
        )

    def has(self, condition_type: str) -> bool:
        c = self.conditions.get(condition_type)
        return c is not None and c.status

    @property
    def succeeded(self) -> bool:
        # SuccessCriteriaMet comes first (Kubernetes >= 1.31), Complete once pods are gone; either
        # means every shard's results are durable.
        return self.has("Complete") or self.has("SuccessCriteriaMet")

    @property
    def failed_for_good(self) -> bool:
        # FailureTarget is set as soon as the Job controller has decided; Failed follows once the
        # remaining pods have terminated. Nothing can rescue the round after either.
        return self.has("Failed") or self.has("FailureTarget")

    @property
    def failure(self) -> Condition | None:
        for kind in ("Failed", "FailureTarget"):
            c = self.conditions.get(kind)
            if c is not None and c.status:
                return c
        return None

    @property
    def lanes(self) -> Lanes:
        return Lanes(done=len(self.completed), failed=len(self.failed), active=-(-self.active // self.nodes_per_lane),
                     total=self.completions // self.nodes_per_lane, replaced=self.groups_replaced)


def failure_reason(state: JobStatus) -> str | None:
    """The reason on the ``Failed`` condition, if the bij is marked failed."""
    for c in state.conditions:
        if c.type == "Failed" and c.status == "True":
            return c.reason or ""
    return None


# Lines of a failed pod's termination message (its last log lines) a message quotes.
LAST_LINES = 3
# bij's log format in front of a line (`bij.worker.main`): the message alone says what failed.
_LOG_PREFIX = re.compile(r"^\d{4}-\d\d-\d\d [\d:,.]+ [A-Z]+ [\w.]+: ")


def step_key(kind: str, round_no: int) -> str:
    """A step's label value and name suffix: plan-r<r>, finish-r<r>, publish-plan, manifest."""
    return f"{kind}-r{round_no}" if kind in ("plan", "finish") else kind


def step_job_name(job: BatchInferenceJob, kind: str, round_no: int = 0) -> str:
    return f"{job.metadata.name}-{step_key(kind, round_no)}"


@dataclass(frozen=True)
class Observation:
    """What `decide()` sees beside the spec: the status, the bij's Jobs and their pods (essences with
    metadata.name/labels/creationTimestamp and status.containerStatuses), metadata.generation, the time."""

    status: Mapping[str, Any]
    state: JobStatus  # the status, typed
    jobs: Sequence[Mapping[str, Any]]
    pods: Sequence[Mapping[str, Any]]
    generation: int | None
    now: dt.datetime


@dataclass(frozen=True, kw_only=True)
class PodEnd:
    """How one of a Job's pods ended: its name, exit code, the kubelet's reason and message."""

    pod: str
    exit_code: int | None
    reason: str
    message: str

    def describe(self) -> str:
        how = f"exit code {self.exit_code}" if self.exit_code is not None else "no exit code"
        if self.reason and self.reason not in ("Error", "Completed"):
            how += f" ({self.reason})"
        elif self.exit_code == 137:
            how += " (killed: SIGKILL, as an OOM kill or a lost node does)"
        lines: list[str] = []
        for ln in self.message.strip().splitlines():
            ln = _LOG_PREFIX.sub("", ln.strip())
            if ln and (not lines or lines[-1] != ln):
                lines.append(ln)
        lines = lines[-LAST_LINES:]
        return f"pod {self.pod}: {how}" + (": " + " | ".join(lines) if lines else "")


def failed_pods(job_name: str, pods: Sequence[Mapping[str, Any]]) -> list[PodEnd]:
    """The failed pods of Job `job_name`, oldest first."""
    out: list[tuple[str, str, PodEnd]] = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        if labels.get("batch.kubernetes.io/job-name", labels.get("job-name")) != job_name:
            continue
        status = pod.get("status") or {}
        if status.get("phase") != "Failed":
            continue
        ended: Mapping[str, Any] = {}
        for c in status.get("containerStatuses") or []:
            ended = (c.get("state") or {}).get("terminated") or (c.get("lastState") or {}).get("terminated") or {}
            if ended:
                break
        code = ended.get("exitCode")
        out.append((str(meta.get("creationTimestamp") or ""), str(meta.get("name") or ""), PodEnd(
            pod=str(meta.get("name") or "?"), exit_code=int(code) if isinstance(code, int) else None,
            reason=str(ended.get("reason") or status.get("reason") or ""),
            message=str(ended.get("message") or status.get("message") or ""))))
    return [p for _, _, p in sorted(out, key=lambda t: (t[0], t[1]))]


# A step pod waiting for good in one of these cannot start until someone acts (an image, a Secret).
STUCK_REASONS = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull",
                           "CreateContainerConfigError", "CreateContainerError"})


def stuck_pods(job_name: str, pods: Sequence[Mapping[str, Any]]) -> list[PodEnd]:
    """The pods of Job `job_name` that cannot start (`STUCK_REASONS`): the reason and the kubelet's message."""
    out = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        if labels.get("batch.kubernetes.io/job-name", labels.get("job-name")) != job_name:
            continue
        for c in (pod.get("status") or {}).get("containerStatuses") or []:
            waiting = (c.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in STUCK_REASONS:
                out.append(PodEnd(pod=str(meta.get("name") or "?"), exit_code=None, reason=str(waiting["reason"]),
                                  message=str(waiting.get("message") or "")))
    return out


def step_report(status: Mapping[str, Any], name: str, uid: str | None) -> StepReport | None:
    """The report of step Job `name` in the status, if it was made by the Job of that uid."""
    report = StepReport.parse(((status.get("reports") or {}).get("steps") or {}).get(name))
    return report if report is not None and uid and report.job_uid == uid else None


def round_job(
    job: BatchInferenceJob, round_no: int, observed_jobs: Sequence[Mapping[str, Any]]
) -> JobView | None:
    """The observed Job of `round_no` for this bij (by labels, so no name is computed twice)."""
    for raw in observed_jobs:
        view = JobView.of(raw)
        labels = (raw.get("metadata") or {}).get("labels") or {}
        if labels.get(JOB_LABEL) == job.metadata.name and view.round == round_no and CANARY_LABEL not in labels:
            return view
    return None


def canary_job(job: BatchInferenceJob, observed_jobs: Sequence[Mapping[str, Any]]) -> JobView | None:
    """The observed canary Job of this bij (spec.canary, round 0)."""
    for raw in observed_jobs:
        labels = (raw.get("metadata") or {}).get("labels") or {}
        if labels.get(JOB_LABEL) == job.metadata.name and labels.get(CANARY_LABEL):
            return JobView.of(raw)
    return None


def owns(job: BatchInferenceJob, raw_job: Mapping[str, Any]) -> bool:
    """Whether a Job found by name was made for this bij (a 409 on create may be someone else's)."""
    labels = (raw_job.get("metadata") or {}).get("labels") or {}
    return labels.get(JOB_LABEL) == job.metadata.name and is_ours(job, JobView.of(raw_job))


def is_ours(job: BatchInferenceJob, view: JobView) -> bool:
    """A Job left over from a deleted bij of the same name belongs to another uid."""
    if view.deleting:
        return False
    uid = job.metadata.uid
    return uid is None or not view.owner_uids or uid in view.owner_uids


def publish_job(job: BatchInferenceJob, pass_name: str, observed_jobs: Sequence[Mapping[str, Any]]) -> JobView | None:
    """The observed Job of one publish pass of this bij."""
    for raw in observed_jobs:
        labels = (raw.get("metadata") or {}).get("labels") or {}
        if labels.get(JOB_LABEL) == job.metadata.name and labels.get(PUBLISH_LABEL) == pass_name:
            return JobView.of(raw)
    return None


def pool_jobs(job: BatchInferenceJob, round_no: int,
              observed_jobs: Sequence[Mapping[str, Any]]) -> list[tuple[str, int, Mapping[str, Any]]]:
    """The observed Jobs of round `round_no` that run lanes in a pool: (pool name, lane offset, the Job)."""
    out = []
    for raw in observed_jobs:
        meta = raw.get("metadata") or {}
        labels = meta.get("labels") or {}
        offset = str((meta.get("annotations") or {}).get(LANE_OFFSET_ANNOTATION) or "")
        if labels.get(JOB_LABEL) == job.metadata.name and labels.get(ROUND_LABEL) == str(round_no) \
                and POOL_LABEL in labels and CANARY_LABEL not in labels and offset.isdigit():
            out.append((str(labels[POOL_LABEL]), int(offset), raw))
    return out


def merged_view(name: str, r: int, views: Sequence[tuple[int, JobView]]) -> JobView:
    """One view of the pools' Jobs of a round (each with its first lane): their lanes by lane id, ended (and
    succeeded) once every one has."""
    ended = bool(views) and all(v.succeeded or v.failed_for_good for _, v in views)
    conditions: dict[str, Condition] = {}
    if ended and all(v.succeeded for _, v in views):
        conditions["Complete"] = Condition(status=True, reason="", message="")
    elif ended:
        failure = next(v.failure for _, v in views if v.failure is not None)
        assert failure is not None
        conditions["Failed"] = failure
    return JobView(name=name, round=r, owner_uids=frozenset().union(*(v.owner_uids for _, v in views)),
                   deleting=False, completions=sum(v.completions for _, v in views),
                   parallelism=sum(v.parallelism or 0 for _, v in views),
                   suspend=all(v.suspend for _, v in views), active=sum(v.active for _, v in views),
                   terminating=sum(v.terminating for _, v in views),
                   completed=frozenset(o + i for o, v in views for i in v.completed),
                   failed=frozenset(o + i for o, v in views for i in v.failed), conditions=conditions)
