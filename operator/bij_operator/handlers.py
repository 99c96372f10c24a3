"""`bij operator`: kopf handlers that apply what `reconcile.decide()` returns.

Every trigger — a BatchInferenceJob created, resumed after a restart or changed, and any
event of a Job labelled ``batchinference.io/job`` — runs the same loop for that bij:
read (spec, status, Jobs) from the API, ask `decide()`, apply the one step it returns,
repeat until it says `Wait` or `Nothing`. Each step is idempotent (deterministic Job
names, 409 means "already done", planning and publishing rewrite nothing), so an
operator killed anywhere continues where it stopped.

API calls go through the official client in a thread; kopf watches, dispatches, posts
Events and serves the liveness probe. Deleting a bij deletes its Jobs by owner reference
and keeps the results; kopf puts a finalizer on each bij for the progress timer (a real API
server shows it), so a bij is only deleted while an operator runs.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

import kopf
import urllib3
from bij_worker import publish_rows
from bij_worker.contract import layout
from bij_worker.contract.spec import API_GROUP, API_VERSION, BatchInferenceJob, SpecError, parse_job
from bij_worker.storage import StorageError
from kubernetes.client import ApiException

from .efficiency import status_fields
from .fingerprint import PlanRefused, field_digests
from .jobs import render_job, render_publish_job, worker_image_default
from .planner import PlanError, plan_round
from .progress import count_done, live_records, shard_records
from .publish import (
    ErrorRatioExceeded,
    PublishError,
    WorkFilesRemoved,
    finish_publish,
    prepare_publish,
    read_manifest,
)
from .reconcile import (
    JOB_LABEL,
    TERMINAL_PHASES,
    CreateJob,
    CreatePublishJob,
    Decision,
    FinishRound,
    MarkFailed,
    Nothing,
    PatchJob,
    Phase,
    PlanRound,
    PreparePublish,
    Publish,
    Wait,
    current_round,
    decide,
    format_ranges,
    owns,
    round_records,
)
from .rounds import summarize
from .status import (
    decision_status,
    fmt_time,
    now_utc,
    parse_time,
    phase_conditions,
    rows_progress,
    status_differs,
)

PLURAL = "batchinferencejobs"
# Progress-only status writes (shard counts, rows) per bij at most this often; phase
# changes and actions are written at once.
STATUS_INTERVAL = 5.0
# How often a running bij's rows are refreshed from its workers' live progress records.
PROGRESS_INTERVAL = 30.0
# Steps applied per trigger before yielding; a whole run takes about six.
MAX_STEPS = 12

log = logging.getLogger("bij.operator")
T = TypeVar("T")


# --- configuration -------------------------------------------------------------------------------


@dataclasses.dataclass
class OperatorConfig:
    """What `main()` parsed; read by the startup handler."""

    namespaces: list[str] = dataclasses.field(default_factory=list)
    clusterwide: bool = False
    liveness: str | None = None
    peering: str | None = None
    standalone: bool = True
    verbose: bool = False
    worker_image: str = dataclasses.field(default_factory=worker_image_default)
    status_interval: float = STATUS_INTERVAL
    # Watch requests end server-side after this long and are reopened; the client gives up a
    # little later, so a silently dead connection cannot stall the operator.
    watch_server_timeout: int = 300
    watch_client_timeout: int = 330
    watch_connect_timeout: int = 10


CONFIG = OperatorConfig()


# --- the Kubernetes API, through the official client -----------------------------------------------


class Api:
    """The few calls the operator makes, as plain dicts, off the event loop."""

    def __init__(self) -> None:
        import kubernetes

        try:
            kubernetes.config.load_incluster_config()
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config()
        self._client = kubernetes.client.ApiClient()
        self.custom = kubernetes.client.CustomObjectsApi(self._client)
        self.batch = kubernetes.client.BatchV1Api(self._client)

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def get_bij(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self._call(self.custom.get_namespaced_custom_object, API_GROUP, API_VERSION,
                                    namespace, PLURAL, name)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    async def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        await self._call(self.custom.patch_namespaced_custom_object_status, API_GROUP, API_VERSION,
                         namespace, PLURAL, name, {"status": status},
                         _content_type="application/merge-patch+json")

    async def list_jobs(self, namespace: str, bij_name: str) -> list[dict[str, Any]]:
        resp = await self._call(self.batch.list_namespaced_job, namespace,
                                label_selector=f"{JOB_LABEL}={bij_name}", _preload_content=False)
        return list(json.loads(resp.data).get("items") or [])

    async def create_job(self, namespace: str, body: dict[str, Any]) -> bool:
        """Create the Job; False when it already exists (an earlier attempt got there first)."""
        try:
            await self._call(self.batch.create_namespaced_job, namespace, body, _preload_content=False)
            return True
        except ApiException as e:
            if e.status == 409:
                return False
            raise

    async def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            resp = await self._call(self.batch.read_namespaced_job, name, namespace, _preload_content=False)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return dict(json.loads(resp.data))

    async def patch_job(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        await self._call(self.batch.patch_namespaced_job, name, namespace, patch,
                         _content_type="application/merge-patch+json", _preload_content=False)


API: Api | None = None


def api() -> Api:
    global API
    if API is None:
        API = Api()
    return API


# --- per-bij bookkeeping (in memory; a restart only loses the rate limit) ----------------------------


@dataclasses.dataclass
class Tracker:
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    last_progress: float = 0.0
    flush: asyncio.TimerHandle | None = None


TRACKERS: dict[tuple[str, str], Tracker] = {}


def tracker(namespace: str, name: str) -> Tracker:
    return TRACKERS.setdefault((namespace, name), Tracker())


# --- the loop --------------------------------------------------------------------------------------


async def reconcile(namespace: str, name: str) -> None:
    """Bring one bij forward as far as it can go now. Safe to call any time, any number of times.

    API failures become `kopf.TemporaryError`: kopf retries the create/resume/update
    handler, and a retry is scheduled here too, since Job event handlers are not retried.
    """
    try:
        await _reconcile(namespace, name)
    except (ApiException, urllib3.exceptions.HTTPError) as e:
        schedule(namespace, name, 10.0)
        code = getattr(e, "status", None)
        raise kopf.TemporaryError(f"Kubernetes API error {code or ''}: {e}".strip(), delay=10) from e
    except kopf.TemporaryError as e:
        schedule(namespace, name, float(e.delay or 30))
        raise


async def _reconcile(namespace: str, name: str) -> None:
    t = tracker(namespace, name)
    async with t.lock:
        for _ in range(MAX_STEPS):
            raw = await api().get_bij(namespace, name)
            if raw is None or raw["metadata"].get("deletionTimestamp"):
                TRACKERS.pop((namespace, name), None)
                return
            try:
                job = parse_job(raw)
            except SpecError as e:
                await mark_invalid(raw, e)
                raise kopf.PermanentError(f"invalid spec: {e}") from None
            jobs = await api().list_jobs(namespace, name)
            status = raw.get("status") or {}
            decision = decide(job, status, jobs, await shards_done(job, status))
            log.debug("%s/%s: %s", namespace, name, decision)
            METRICS.decisions.labels(type(decision).__name__).inc()
            if not await apply(raw, job, decision, t):
                return
    log.warning("%s/%s: still changing after %d steps; continuing on the next event", namespace, name, MAX_STEPS)


async def apply(raw: dict[str, Any], job: BatchInferenceJob, d: Decision, t: Tracker) -> bool:
    """Apply one decision. True when the loop should ask again (something changed)."""
    ns, name = job.metadata.namespace, job.metadata.name
    status: dict[str, Any] = raw.get("status") or {}
    now = now_utc()

    if isinstance(d, PlanRound):
        try:
            plan = await asyncio.to_thread(plan_round, job, d.round)
        except PlanRefused as e:
            # Another job owns the output, the URIs overlap, or the plan there was made from another
            # spec or input: a retry cannot help, a spec edit may (the phase is not final).
            refused = MarkFailed(round=d.round, phase="Failed", reason="PlanRefused", message=str(e))
            await write_status(raw, {**base(raw, refused, now), "message": refused.message},
                               event=("Warning", "PlanRefused", refused.message)
                               if status.get("message") != refused.message else None)
            return False
        except (PlanError, OSError, RuntimeError) as e:
            # Missing or unreadable input may appear later (an upload still running): retry.
            msg = f"cannot plan round {d.round}: {e}"
            await write_status(raw, {**base(raw, d, now), "phase": "Pending", "message": msg,
                                     "conditions": phase_conditions(status.get("conditions") or [], "Pending",
                                                                    "PlanFailed", msg,
                                                                    generation=generation(raw), now=now)},
                               event=("Warning", "PlanFailed", msg))
            raise kopf.TemporaryError(msg, delay=30) from e
        rounds = [r for r in status.get("rounds") or [] if r.get("round") != d.round]
        rec: dict[str, Any] = {"round": d.round, "shards": plan.shard_count, "lanes": plan.lanes,
                               "bytes": plan.total_bytes, "startTime": fmt_time(now)}
        if d.round == 0:
            rec["specDigests"] = field_digests(job)  # decide() refuses a later edit of these fields
        rounds.append(rec)
        msg = (f"round {d.round}: planned {plan.shard_count} shards in {plan.lanes} lanes from {plan.objects} "
               "input objects")
        patch = {**base(raw, d, now), "rounds": rounds, "message": msg,
                 "shards": {"done": 0, "total": plan.shard_count}, "shardsSummary": f"0/{plan.shard_count}"}
        if "rows" not in status:
            patch["rows"] = {"done": 0, "failed": 0}  # so the ROWS column reads 0, not <none>
        await write_status(raw, patch, event=("Normal", "RoundPlanned", msg))
        return True

    if isinstance(d, CreateJob):
        try:
            body = render_job(job, d.round, d.completions, layout.round_manifest_uri(job, d.round),
                              image=CONFIG.worker_image, owner_uid=job.metadata.uid)
        except ValueError as e:
            # e.g. more shards than an Indexed Job may have: only a spec change can help.
            failed = MarkFailed(round=d.round, phase="Failed", reason="CannotCreateJob",
                                message=f"round {d.round}: {e}", shards=d.shards)
            await write_status(raw, {**base(raw, failed, now), "message": failed.message},
                               event=("Warning", "CannotCreateJob", failed.message))
            return False
        created = await create_owned_job(raw, job, d, body, f"round {d.round}", "Pending", now)
        if created is None:
            return False
        job_name = body["metadata"]["name"]
        spec = body["spec"]
        msg = (f"round {d.round}: created Job {job_name} with {d.completions} lanes for "
               f"{d.shards.total if d.shards else '?'} shards, parallelism {spec['parallelism']}"
               + (", suspended" if spec.get("suspend") else ""))
        await write_status(raw, {**base(raw, d, now), "message": msg},
                           event=("Normal", "RoundStarted", msg) if created else None)
        return True

    if isinstance(d, PatchJob):
        job_spec: dict[str, Any] = {}
        if d.suspend is not None:
            job_spec["suspend"] = d.suspend
        if d.parallelism is not None:
            job_spec["parallelism"] = d.parallelism
        await api().patch_job(ns, d.job_name, {"spec": job_spec})
        reason = {True: "Suspended", False: "Resumed", None: "Scaled"}[d.suspend]
        what = {True: "suspended (durable work is kept)", False: "resumed",
                None: f"parallelism set to {d.parallelism}"}[d.suspend]
        msg = f"round {d.round}: Job {d.job_name} {what}"
        await write_status(raw, {**base(raw, d, now), "message": msg}, event=("Normal", reason, msg))
        return True

    if isinstance(d, FinishRound):
        records = await asyncio.to_thread(shard_records, job, d.round)
        planned = int((round_records(status).get(d.round) or {}).get("shards") or 0)
        stats = summarize(d.round, planned, records)
        rounds = []
        for rec in status.get("rounds") or []:
            if rec.get("round") == d.round:
                rec = {**rec, **stats.as_status(), "completionTime": fmt_time(now)}
            rounds.append(rec)
        msg = f"round {d.round} finished: {d.shards.summary if d.shards else '0/0'} shards, " \
              f"{stats.approved} rows, {stats.errors} error rows"
        if job.spec.judge is not None:
            msg += f", {stats.rejected} rejected, {stats.capped} capped (approval {stats.approval_rate:.1%})"
        if d.failed_lanes:
            noun = "lane" if len(d.failed_lanes) == 1 else "lanes"
            msg += f"; {noun} {format_ranges(d.failed_lanes)} failed, the other lanes finished their shards"
        patch = {**base(raw, d, now), "rounds": rounds, "message": msg,
                 **await progress(job, status, d.round, now)}
        await write_status(raw, patch, event=("Normal", "RoundFinished", msg))
        return True

    if isinstance(d, PreparePublish):
        if status.get("phase") != "Publishing":
            await write_status(raw, {**base(raw, d, now), "message": d.message})
        try:
            plan_uri, pplan = await asyncio.to_thread(prepare_publish, job, d.rounds)
        except WorkFilesRemoved as e:
            # Published before the operator could say so (a restart in between): the manifest stands.
            found = await asyncio.to_thread(read_manifest, job)
            if found is None:
                failed = MarkFailed(round=d.round, phase="Failed", reason="WorkFilesRemoved", message=str(e))
                await write_status(raw, {**base(raw, failed, now), "message": failed.message},
                                   event=("Warning", "WorkFilesRemoved", failed.message))
                return False
            return await published(raw, job, d, found, now)
        except PlanRefused as e:
            failed = MarkFailed(round=d.round, phase="Failed", reason="PlanRefused", message=str(e))
            await write_status(raw, {**base(raw, failed, now), "message": failed.message},
                               event=("Warning", "PlanRefused", failed.message))
            return False
        except (PublishError, OSError, StorageError) as e:
            msg = f"publish failed: {e}"
            await write_status(raw, {"message": msg}, event=("Warning", "PublishFailed", msg))
            raise kopf.TemporaryError(msg, delay=30) from e
        passes = {p: publish_rows.count(pplan, p) for p in publish_rows.PASSES}
        msg = f"publishing {d.rounds} round(s): passes {', '.join(f'{p} {n}' for p, n in passes.items())} indexes"
        await write_status(raw, {**base(raw, d, now), "message": msg,
                                 "publish": {"rounds": d.rounds, "planUri": plan_uri, "passes": passes}})
        return True

    if isinstance(d, CreatePublishJob):
        body = render_publish_job(job, d.pass_name, d.completions, d.plan_uri, image=CONFIG.worker_image,
                                  owner_uid=job.metadata.uid)
        created = await create_owned_job(raw, job, d, body, "publishing", "Publishing", now)
        if created is None:
            return False
        msg = f"publishing: created Job {body['metadata']['name']} for pass {d.pass_name} ({d.completions} pods)"
        await write_status(raw, {**base(raw, d, now), "message": msg},
                           event=("Normal", "PublishPassStarted", msg) if created else None)
        return True

    if isinstance(d, Publish):
        if status.get("phase") != "Publishing":
            await write_status(raw, {**base(raw, d, now), "message": d.message})
        try:
            # What finishing reads (plans, completion records, per-shard summaries) stays after the
            # work files go, so a restart between the manifest and the status write finishes again.
            pplan = await asyncio.to_thread(publish_rows.load, str((status.get("publish") or {})["planUri"]))
            manifest = await asyncio.to_thread(finish_publish, job, d.rounds, pplan)
        except ErrorRatioExceeded as e:
            # Permanent: duplicates found only at publish can push the share of bad rows over the limit.
            failed = MarkFailed(round=d.round, phase="Failed", reason="TooManyErrors", message=str(e))
            await write_status(raw, {**base(raw, failed, now), "message": failed.message},
                               event=("Warning", "TooManyErrors", failed.message))
            return False
        except (PublishError, OSError, StorageError, publish_rows.PublishPlanError) as e:
            msg = f"publish failed: {e}"
            await write_status(raw, {"message": msg}, event=("Warning", "PublishFailed", msg))
            raise kopf.TemporaryError(msg, delay=30) from e
        return await published(raw, job, d, manifest, now)

    if isinstance(d, MarkFailed):
        patch = {**base(raw, d, now), "message": d.message, **await progress(job, status, d.round, now)}
        # Once per failure: a recoverable one (SpecChanged) is decided again on every Job event.
        await write_status(raw, patch, event=("Warning", "Failed", d.message)
                           if status.get("message") != d.message else None)
        return False

    if isinstance(d, Nothing):
        # Finished: only keep observedGeneration and conditions current after spec edits.
        patch = {"observedGeneration": generation(raw),
                 "conditions": phase_conditions(status.get("conditions") or [], d.phase, d.reason, d.message,
                                                generation=generation(raw), now=now)}
        await write_status(raw, patch)
        return False

    assert isinstance(d, Wait)
    patch = {**base(raw, d, now), "message": d.message}
    phase_changed = status.get("phase") != d.phase or status.get("round") != d.round
    if not status_differs(status, patch) and not phase_changed:
        return False
    wait = t.last_progress + CONFIG.status_interval - time.monotonic()
    if not phase_changed and wait > 0:
        # Progress only: write it at the end of the interval, once, whatever happens meanwhile.
        schedule(ns, name, wait)
        return False
    patch.update(await progress(job, status, d.round, now))
    t.last_progress = time.monotonic()
    await write_status(raw, patch)
    return False


async def shards_done(job: BatchInferenceJob, status: dict[str, Any]) -> int | None:
    """How many shards of the current round have a completion record (one listing, no reads);
    None when no round is running or the records cannot be listed."""
    rec = round_records(status).get(current_round(status))
    if rec is None or rec.get("completionTime") or status.get("phase") in TERMINAL_PHASES:
        return None
    try:
        return await asyncio.to_thread(count_done, job, current_round(status))
    except (OSError, StorageError) as e:
        log.warning("%s/%s: cannot list shard records: %s", job.metadata.namespace, job.metadata.name, e)
        return None


async def create_owned_job(raw: dict[str, Any], job: BatchInferenceJob, d: Decision, body: dict[str, Any],
                           what: str, phase: Phase, now: Any) -> bool | None:
    """Create a Job owned by the bij: True if created, False if an earlier attempt of ours had (409);
    None when a Job of that name belongs to someone else: it is never adopted or replaced, the bij
    says so, and it is looked at again later."""
    ns, name = job.metadata.namespace, job.metadata.name
    kopf.adopt(body, owner=as_body(raw))
    if await api().create_job(ns, body):
        return True
    job_name = body["metadata"]["name"]
    existing = await api().get_job(ns, job_name)
    if existing is None or owns(job, existing):
        return False
    msg = f"{what}: a Job named {job_name} already exists and does not belong to this BatchInferenceJob; " \
          "delete or rename it"
    conflict = dataclasses.replace(d, phase=phase, reason="JobNameConflict", message=msg)
    status = raw.get("status") or {}
    await write_status(raw, {**base(raw, conflict, now), "message": msg},
                       event=("Warning", "JobNameConflict", msg) if status.get("message") != msg else None)
    schedule(ns, name, 15.0)
    return None


async def published(raw: dict[str, Any], job: BatchInferenceJob, d: Decision, manifest: dict[str, Any],
                    now: Any) -> bool:
    """Phase Succeeded with what the manifest says."""
    status: dict[str, Any] = raw.get("status") or {}
    counts = manifest.get("counts") or {}
    uri = layout.manifest_uri(job)
    msg = (f"published {counts.get('rows', 0)} rows in {len(manifest.get('files') or [])} files "
           f"({counts.get('errors', 0)} error rows) to {uri}")
    if counts.get("capped"):
        # Never silent: rows the judge still rejected at the cap are published apart and said so.
        capped = (f"RetryCapReached: {counts['capped']} rows were still rejected by the judge at the cap; "
                  "they are in the manifest's cappedFiles")
        msg += f"; {capped}"
        kopf.event(as_body(raw), type="Warning", reason="RetryCapReached", message=capped)
    done = dataclasses.replace(d, phase="Succeeded", reason="Published", message=msg)
    patch = {**base(raw, done, now), "manifestUri": uri, "message": msg,
             "rows": {"done": int(counts.get("rows", 0)), "failed": int(counts.get("errors", 0))}}
    patch.update({k: v for k, v in (await progress(job, status, d.round, now)).items() if k != "rows"})
    await write_status(raw, patch, event=("Normal", "Published", msg))
    return False


def schedule(namespace: str, name: str, delay: float) -> None:
    """Reconcile this bij again in `delay` seconds (at most one pending run per bij)."""
    t = tracker(namespace, name)
    if t.flush is None:
        t.flush = asyncio.get_running_loop().call_later(max(delay, 0.0), _flush, namespace, name)


def _flush(namespace: str, name: str) -> None:
    t = TRACKERS.get((namespace, name))
    if t is not None:
        t.flush = None
    task = asyncio.ensure_future(_reconcile_quietly(namespace, name))
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)


_BACKGROUND: set[asyncio.Future[Any]] = set()


async def _reconcile_quietly(namespace: str, name: str) -> None:
    try:
        await reconcile(namespace, name)
    except (kopf.TemporaryError, kopf.PermanentError) as e:
        log.warning("%s/%s: %s", namespace, name, e)  # already retried by reconcile() or reported
    except Exception:  # noqa: BLE001 - a deferred refresh must not kill the loop; the next event retries
        log.exception("%s/%s: deferred status refresh failed", namespace, name)


def as_body(raw: dict[str, Any]) -> kopf.Body:
    """The API's dict as kopf's Body (for Events and owner references)."""
    return kopf.Body(cast(kopf.RawBody, raw))


def generation(raw: dict[str, Any]) -> int | None:
    value = raw.get("metadata", {}).get("generation")
    return int(value) if value is not None else None


def base(raw: dict[str, Any], d: Decision, now: Any) -> dict[str, Any]:
    """The status fields every decision sets (phase, round, shards, conditions, ...)."""
    return decision_status(raw.get("status") or {}, d, generation=generation(raw), now=now,
                           output_uri=raw["spec"]["output"]["uri"])


async def progress(job: BatchInferenceJob, status: dict[str, Any], round_no: int, now: Any) -> dict[str, Any]:
    """``rows`` and ``rowsPerSecond`` from the completion records of rounds 0..round_no, and the
    live progress records of the current round's running shards."""
    def read() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        out: list[dict[str, Any]] = []
        for r in range(round_no):
            out.extend(shard_records(job, r).values())
        current = list(live_records(job, round_no).values())
        return out + current, current

    try:
        records, current = await asyncio.to_thread(read)
    except (OSError, RuntimeError) as e:
        log.warning("%s/%s: cannot read shard records: %s", job.metadata.namespace, job.metadata.name, e)
        return {}
    started = status.get("startTime") or min((str(r["startTime"]) for r in round_records(status).values()
                                              if r.get("startTime")), default=None)
    this_round = round_records(status).get(round_no) or {}
    round_start = parse_time(this_round.get("startTime"))
    return {**rows_progress(records, started, now),
            **status_fields(records, current, this_round.get("bytes"),
                            (now - round_start).total_seconds() if round_start else None,
                            job.spec.workers.price_per_hour)}


async def write_status(raw: dict[str, Any], patch: dict[str, Any],
                       event: tuple[str, str, str] | None = None) -> None:
    """Merge-patch the status subresource (only if it changes) and post the Event."""
    status = raw.get("status") or {}
    meta = raw["metadata"]
    if status_differs(status, patch):
        await api().patch_status(meta["namespace"], meta["name"], patch)
    if event is not None:
        type_, reason, message = event
        kopf.event(as_body(raw), type=type_, reason=reason, message=message)


async def mark_invalid(raw: dict[str, Any], err: SpecError) -> None:
    """Phase Failed with the validation problems; posted once per distinct message."""
    status = raw.get("status") or {}
    msg = "invalid spec: " + "; ".join(err.problems)
    now = now_utc()
    patch = {"phase": "Failed", "message": msg, "observedGeneration": generation(raw),
             "conditions": phase_conditions(status.get("conditions") or [], "Failed", "InvalidSpec", msg,
                                            generation=generation(raw), now=now)}
    if status.get("message") != msg:
        await write_status(raw, patch, event=("Warning", "InvalidSpec", msg))


# --- kopf wiring -----------------------------------------------------------------------------------


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    """Timeouts, our own annotation prefix, Event identity; peering as the CLI asked."""
    settings.watching.server_timeout = CONFIG.watch_server_timeout
    settings.watching.client_timeout = CONFIG.watch_client_timeout
    settings.watching.connect_timeout = CONFIG.watch_connect_timeout
    settings.networking.request_timeout = 60
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=API_GROUP)
    settings.persistence.finalizer = f"{API_GROUP}/finalizer"
    settings.posting.reporting_component = "bij-operator"
    settings.posting.event_name_prefix = "bij-"
    settings.posting.level = logging.INFO
    if not CONFIG.clusterwide and not any(ch in ns for ns in CONFIG.namespaces for ch in "*?[]!,"):
        # Exact namespace names: no need to list and watch namespaces (and CRDs) cluster-wide, so
        # a namespaced install runs on Roles alone. The CRD must exist before the operator starts.
        settings.scanning.disabled = True
    settings.peering.standalone = CONFIG.standalone
    if CONFIG.peering:
        settings.peering.name = CONFIG.peering
        settings.peering.mandatory = True
    api()  # log in now: a broken kubeconfig fails the start, not the first handler


@kopf.on.probe(id="trackedJobs")
def tracked_jobs(**_: Any) -> int:
    """For the liveness endpoint: how many BatchInferenceJobs this process is following."""
    return len(TRACKERS)


@kopf.on.create(API_GROUP, API_VERSION, PLURAL)
@kopf.on.resume(API_GROUP, API_VERSION, PLURAL)
@kopf.on.update(API_GROUP, API_VERSION, PLURAL, field="spec")
async def bij_changed(namespace: str | None, name: str, **_: Any) -> None:
    """A bij appeared, the operator restarted, or its spec changed (suspend, parallelism)."""
    assert namespace is not None  # the CRD is namespaced
    await reconcile(namespace, name)


@kopf.on.event("batch", "v1", "jobs", labels={JOB_LABEL: kopf.PRESENT})
async def round_job_changed(body: kopf.Body, namespace: str | None, logger: kopf.Logger, **_: Any) -> None:
    """Any change of a round or publish Job (pods done, failed, suspended, deleted) moves its bij."""
    owner = body.metadata.labels.get(JOB_LABEL)
    if not owner or namespace is None:
        return
    try:
        await reconcile(namespace, owner)
    except kopf.PermanentError:
        pass  # already reported on the bij; Job events cannot fix a spec
    except kopf.TemporaryError as e:
        logger.warning("%s/%s: %s (retrying)", namespace, owner, e)


@kopf.timer(API_GROUP, API_VERSION, PLURAL, interval=PROGRESS_INTERVAL, initial_delay=PROGRESS_INTERVAL,
            field="status.phase", value="Running")
async def running_progress(namespace: str | None, name: str, **_: Any) -> None:
    """While a round runs, Job events are rare (only when a shard finishes): refresh ROWS from
    the workers' live progress records every so often."""
    assert namespace is not None
    await reconcile(namespace, name)


# --- `bij operator` --------------------------------------------------------------------------------


class OperatorMetrics:
    """What the operator did, for Prometheus (served with --metrics-port or env BIJ_METRICS_PORT)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = CollectorRegistry()
        self.decisions = Counter("bij_operator_decisions", "Reconcile decisions applied, by kind",
                                 ["decision"], registry=self.registry)
        self.tracked = Gauge("bij_operator_tracked_jobs", "BatchInferenceJobs this process follows",
                             registry=self.registry)
        self.tracked.set_function(lambda: len(TRACKERS))

    def serve(self, port: int) -> None:
        from prometheus_client import start_http_server

        start_http_server(port, registry=self.registry)


METRICS = OperatorMetrics()


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
    CONFIG.namespaces = list(args.namespace)
    CONFIG.clusterwide = args.all_namespaces or not args.namespace
    CONFIG.liveness = args.liveness
    CONFIG.peering = args.peering
    CONFIG.standalone = args.peering is None
    CONFIG.verbose = args.verbose
    CONFIG.status_interval = args.status_interval
    if args.worker_image:
        CONFIG.worker_image = args.worker_image
    if args.metrics_port:
        METRICS.serve(args.metrics_port)
    kopf.configure(verbose=args.verbose)
    # The API client's debug log prints every response body: too much even for --verbose.
    logging.getLogger("kubernetes.client.rest").setLevel(logging.INFO)
    kopf.run(
        standalone=CONFIG.standalone,
        peering_name=CONFIG.peering,
        clusterwide=CONFIG.clusterwide,
        namespaces=[] if CONFIG.clusterwide else CONFIG.namespaces,
        liveness_endpoint=CONFIG.liveness,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
