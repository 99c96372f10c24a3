"""The driver's Jobs: creating one (a Job of our name that belongs to someone else is said, never adopted), and
a storage step run as a one-pod Job in the bij's namespace (`bij.steps.main`)."""

from __future__ import annotations

import logging
from typing import Any

from bij.contract.codes import GENERATION_LABEL
from bij.contract.spec import BatchInferenceJob
from bij.contract.status import Phase
from bij.control.decisions import Decision, StepDecision, name_conflict
from bij.control.driver_status import StatusMixin
from bij.control.driver_types import Created, Idle, Observed
from bij.control.status import now_utc
from bij.control.step_jobs import render_step_job

log = logging.getLogger("bij.driver")

# A Job of our name that belongs to someone else is looked at again this often.
CONFLICT_RECHECK = 15.0


class StepMixin(StatusMixin):
    """The driver's Job creation and storage steps."""

    def create_job(self, seen: Observed, d: Decision, body: dict[str, Any], what: str,
                   phase: Phase) -> Created:
        created = self.backend.create_job(body)
        if created == "foreign":
            conflict = name_conflict(d, body["metadata"]["name"], what, phase)
            self.write_status(seen, self.base(seen, conflict, now_utc(), conflict.message),
                              event=("Warning", "JobNameConflict", conflict.message)
                              if seen.state.message != conflict.message else None)
        return created

    def run_step(self, seen: Observed, job: BatchInferenceJob, d: StepDecision) -> Idle | None:
        """Create the one-pod Job of step `d` (`decide()` saw none): its pod reports into the bij's status,
        and `decide()` takes it from there. None: look again (something changed)."""
        args = d.step_args()
        body = render_step_job(job, **args, image=self.backend.steps_image, owner_uid=job.metadata.uid,
                               file_volume=self.backend.file_volume)
        body["metadata"]["labels"][GENERATION_LABEL] = str(seen.generation or 0)
        name = body["metadata"]["name"]
        created = self.create_job(seen, d, body, f"{d.message}: step {args['kind']}", d.phase)
        if created == "foreign":
            return Idle(d, recheck=CONFLICT_RECHECK)
        if created == "created":
            log.info("%s/%s: step %s runs in Job %s", job.metadata.namespace, job.metadata.name, args["kind"], name)
            # The phase from the start (Planning, Publishing, ...), not only once the step reports.
            self.write_status(seen, self.base(seen, d, now_utc(), f"{d.message} (step Job {name})"))
        return None
