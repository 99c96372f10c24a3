"""The driver's publishing: the publish plan step's record, the Job of each publish pass, and the bij's end
from what the manifest says."""

from __future__ import annotations

import dataclasses
import datetime as dt

from bij.contract import layout
from bij.contract.spec import BatchInferenceJob
from bij.contract.status import PublishRecord, Rows
from bij.contract.step_report import REMOVAL_CONDITION
from bij.contract.step_results import ManifestSummary
from bij.control.decisions import CreatePublishJob, Decision, PreparePublish
from bij.control.driver_steps import CONFLICT_RECHECK, StepMixin
from bij.control.driver_types import Idle, Observed
from bij.control.status import fmt_time, now_utc, with_condition
from bij.control.step_jobs import render_publish_job


class PublishMixin(StepMixin):
    """The driver's publish decisions."""

    def _prepare_publish(self, seen: Observed, job: BatchInferenceJob, d: PreparePublish,
                         now: dt.datetime) -> Idle | None:
        """The publish plan step's result: the publish record the passes follow (or the manifest, when one stands)."""
        got = d.result
        assert got is not None
        if got.published is not None:
            # Published before the status said so (a restart in between): the manifest stands.
            return self.published(seen, job, d, got.published)
        plan_uri, passes = got.plan_uri, dict(got.passes)
        msg = f"publishing {d.rounds} round(s): passes " + ", ".join(f"{p} {n}" for p, n in passes.items()) \
            + " indexes" + (" (partial)" if d.partial else "")
        patch = self.base(seen, d, now, msg)
        patch.publish = PublishRecord(rounds=d.rounds, plan_uri=plan_uri, passes=passes, started_at=fmt_time(now),
                                      partial=d.partial or None)
        self.write_status(seen, patch)
        return None

    def _create_publish_job(self, seen: Observed, job: BatchInferenceJob, d: CreatePublishJob,
                            now: dt.datetime) -> Idle | None:
        """The Job of one publish pass."""
        body = render_publish_job(job, d.pass_name, d.completions, d.plan_uri, image=self.backend.worker_image,
                                  owner_uid=job.metadata.uid, file_volume=self.backend.file_volume)
        created = self.create_job(seen, d, body, "publishing", "Publishing")
        if created == "foreign":
            return Idle(d, recheck=CONFLICT_RECHECK)
        pods = f"{d.completions} pod" + ("s" if d.completions != 1 else "")
        msg = f"publishing: created Job {body['metadata']['name']} for pass {d.pass_name} ({pods})"
        self.write_status(seen, self.base(seen, d, now, msg),
                          event=("Normal", "PublishPassStarted", msg) if created == "created" else None)
        return None

    def published(self, seen: Observed, job: BatchInferenceJob, d: Decision, manifest: ManifestSummary) -> Idle:
        """Phase Succeeded with what the manifest says (Cancelled or Expired for a partial manifest)."""
        now = now_utc()
        counts = manifest.counts
        uri = layout.manifest_uri(job)
        partial = manifest.partial.phase if manifest.partial is not None else None
        codes = counts.error_codes
        by_code = (": " + ", ".join(f"{n} {code}" for code, n in sorted(codes.items(), key=lambda e: -e[1]))
                   if codes else "")
        msg = (f"published {counts.rows} rows in {manifest.files} files "
               f"({counts.errors} error rows{by_code}) to {uri}")
        if partial and manifest.partial is not None:
            msg = (f"{partial.lower()} ({manifest.partial.reason}): " + msg
                   + f"; {counts.not_run or 0} rows not run")
        structured = counts.structured
        if structured.validated or structured.violations:
            # Structured answers checked after decoding (bij.engines.structured).
            msg += (f"; structured answers: {structured.validated} validated "
                    f"({structured.repaired} repaired on a second grammar backend), "
                    f"{structured.violations} schema_violation error rows")
        for note in manifest.notes:
            msg += f"; {note}"  # what the engine could not serve at all, once each (not per row)
        damaged = [o.message for o in manifest.damaged_objects]
        if damaged:
            # input.onDamagedObject errorRow: published without what lay behind the break; never silent.
            msg += "; damaged input (one corrupt_input error row each, the rest unread): " + "; ".join(damaged)
        if counts.capped:
            # Never silent: rows the judge still rejected at the cap are published apart and said so.
            capped = (f"RetryCapReached: {counts.capped} rows were still rejected by the judge at the cap; "
                      "they are in the manifest's cappedFiles")
            msg += f"; {capped}"
            self.backend.event("Warning", "RetryCapReached", capped)
        removal = manifest.work_files_removal
        if removal is not None:
            # The manifest stands: work files left behind are a warning, never a failed bij.
            left = (f"RemovalFailed: removing work files failed after {removal.removed} objects: "
                    f"{removal.error}; the rest are left under {removal.left} (a rerun resumes "
                    "the removal, or a bucket lifecycle rule on the _bij/ prefix removes them)")
            msg += f"; {left}"
            self.backend.event("Warning", "RemovalFailed", left)
        done = dataclasses.replace(d, phase=partial or "Succeeded", reason=partial or "Published", message=msg)
        patch = self.base(seen, done, now, msg).updated(self.progress(seen, d.round, now), leave=("rows",))
        patch.manifest_uri = uri
        patch.rows = Rows(done=counts.rows, failed=counts.errors, not_run=(counts.not_run or 0) if partial else None)
        if removal is not None:
            patch.conditions = with_condition(patch.conditions or [], REMOVAL_CONDITION, False, "RemovalFailed",
                                              left, generation=seen.generation, now=now)
        self.write_status(seen, patch, event=("Normal", partial or "Published", msg))
        return Idle(done)
