"""What the driver says when something is wrong: a failed bij or a step to retry (`apply_failure`), a spec
that does not validate (`mark_invalid`), status entries bij cannot read (`say_damage`)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from bij.contract.spec import BatchInferenceJob, SpecError
from bij.contract.status import JobStatus, StatusPatch
from bij.control.decisions import Decision, MarkFailed, Retry
from bij.control.driver_status import StatusMixin
from bij.control.driver_types import Idle, Observed
from bij.control.status import now_utc, with_condition, with_phase_conditions

log = logging.getLogger("bij.driver")

# The condition that names status entries bij cannot read (`FailureMixin.say_damage`).
DAMAGED_CONDITION = "StatusDamaged"


class FailureMixin(StatusMixin):
    """The driver's failures, damage and invalid specs."""

    def apply_failure(self, seen: Observed, d: Decision, job: BatchInferenceJob | None = None) -> Idle:
        """A failed bij (MarkFailed) or a step to try again later (Retry): status, one Event per message."""
        now = now_utc()
        patch = self.base(seen, d, now, d.message)
        if isinstance(d, MarkFailed) and job is not None:
            patch = patch.updated(self.progress(seen, d.round, now))
        # Once per message: a recoverable failure (SpecChanged) is decided again on every change.
        first = seen.state.message != d.message
        reason = d.reason if isinstance(d, Retry) else d.event if isinstance(d, MarkFailed) else "Failed"
        self.write_status(seen, patch, event=("Warning", reason, d.message) if first else None)
        return Idle(d, recheck=d.delay if isinstance(d, Retry) else None)

    def mark_invalid(self, seen: Observed, err: SpecError) -> None:
        """Phase Failed with the validation problems; posted once per distinct message."""
        msg = "invalid spec: " + "; ".join(err.problems)
        now = now_utc()
        patch = StatusPatch(phase="Failed", message=msg, observed_generation=seen.generation,
                            conditions=with_phase_conditions(seen.state.conditions, "Failed", "InvalidSpec", msg,
                                                             generation=seen.generation, now=now))
        if seen.state.message != msg:
            self.write_status(seen, patch, event=("Warning", "InvalidSpec", msg))

    def say_damage(self, seen: Observed, state: JobStatus) -> bool:
        """Status entries bij cannot read (written by something else, or damaged) are left out where they are
        read; here they are named in the StatusDamaged condition and a Warning Event, once, and the condition
        turns False when they are gone. A damaged condition is dropped (conditions are rewritten whole),
        said in the Event. True when the status was written."""
        said = next((c for c in state.conditions if c.type == DAMAGED_CONDITION), None)
        dropped = [p for p in state.problems if p.startswith("status.conditions")]
        lasting = [p for p in state.problems if p not in dropped]
        message = unreadable(lasting)
        new = bool(lasting) and (said is None or said.status != "True" or said.message != message)
        conditions = state.conditions
        now = now_utc()
        if new:
            conditions = with_condition(conditions, DAMAGED_CONDITION, True, "UnreadableEntries", message,
                                       generation=seen.generation, now=now)
        elif not lasting and said is not None and said.status == "True":
            conditions = with_condition(conditions, DAMAGED_CONDITION, False, "Readable",
                                       "every status entry is readable", generation=seen.generation, now=now)
        elif not dropped:
            return False
        self.put_status(StatusPatch(conditions=conditions))
        if new or dropped:
            log.warning("%s: %s", seen.output_uri, unreadable(state.problems))
            self.backend.event("Warning", DAMAGED_CONDITION, unreadable(state.problems))
        return True



def unreadable(problems: Sequence[str]) -> str:
    """What the StatusDamaged condition and Event say of `problems` (at most five named)."""
    if not problems:
        return ""
    more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
    return "status entries left out as unreadable: " + "; ".join(problems[:5]) + more
