"""`bij publish` on one machine: the publish plan, its three row-level passes run as the Jobs the
operator would create for them (`step_jobs.render_publish_job`) by the local Job controller, then the
manifest. With no processes the passes run in this process (`bij.steps.publish.run_passes`)."""

from __future__ import annotations

from typing import Any

from bij.contract.manifest import Manifest
from bij.contract.publish_plan import PublishPlan
from bij.contract.spec import BatchInferenceJob
from bij.control.step_jobs import render_publish_job
from bij.local.jobs import LocalJob, worker_command, worker_env
from bij.steps import publish_rows
from bij.steps.publish import PublishError, finish_publish, prepare_publish, run_passes


def run_passes_in_processes(job: BatchInferenceJob, plan_uri: str, plan: PublishPlan, processes: int,
                            stats: list[dict[str, Any]] | None = None) -> None:
    """Each pass as its Job, run in at most `processes` processes, process k working indexes
    k, k + processes, ... (`stats` gets each process's peak RSS). A pass whose Job fails fails publishing."""
    for pass_name in publish_rows.PASSES:
        n = plan.count(pass_name)
        if n == 0:
            continue
        body = render_publish_job(job, pass_name, min(processes, n), plan_uri, image="local")
        ran: list[dict[str, Any]] = []
        lj = LocalJob(body, worker_command(), worker_env(job), say=lambda line: None, stats=ran)
        lj.run()
        if stats is not None:
            slots = lj.completions
            stats.extend({**s, "pass": pass_name, "indexes": len(range(s["index"], n, slots))} for s in ran)
        cond = lj.condition or {}
        if cond.get("type") != "Complete":
            e = PublishError(f"publish pass {pass_name} failed: {cond.get('reason', 'Stopped')}: "
                             f"{cond.get('message', 'stopped before the end')}")
            e.permanent = cond.get("reason") == "PodFailurePolicy"
            raise e


def publish_manifest(job: BatchInferenceJob, rounds: int = 1, processes: int = 0,
                     bucket_rows: int | None = None, stats: list[dict[str, Any]] | None = None) -> Manifest:
    """Publish rounds 0..rounds-1: the publish plan (`prepare_publish`), its passes in `processes` worker
    processes (0: in this one, `run_passes`), then the manifest (`finish_publish`). Returns the manifest as
    written (with `work_files_removal` where removing work files failed after it was written).
    `bucket_rows` overrides spec.output.publishBucketRows (`bij publish --bucket-rows`)."""
    plan_uri, plan = prepare_publish(job, rounds, bucket_rows)
    if processes <= 0:
        run_passes(plan)
    else:
        run_passes_in_processes(job, plan_uri, plan, processes, stats)
    return finish_publish(job, rounds, plan)
