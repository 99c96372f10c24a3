"""The driver's spec.notify: the webhooks told, signed, that the bij ended, each attempt recorded in its status."""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Callable, Mapping

from bij.contract.notify import body as notify_body
from bij.contract.notify import delivery_id
from bij.contract.notify import headers as notify_headers
from bij.contract.spec import BatchInferenceJob
from bij.contract.status import JobStatus, StatusPatch
from bij.control import notify
from bij.control.driver_status import StatusMixin
from bij.control.driver_types import Idle, wake_at
from bij.control.status import now_utc, with_condition

log = logging.getLogger("bij.driver")


class NotifyMixin(StatusMixin):
    """The driver's webhooks: how often they are tried and how a POST is made (`notify.post`)."""

    notify_backoff: notify.Backoff
    send: Callable[[str, bytes, Mapping[str, str], float], str | None]

    def notify_ended(self, job: BatchInferenceJob, idle: Idle) -> Idle:
        """spec.notify's webhooks told that the bij ended: the POSTs due now (`notify.due`), each attempt recorded
        in ``status.notified``, an Event when one is delivered or given up, and the Notified condition; asked again
        when the next retry falls due. The phase stays what it is, whatever the webhooks answer."""
        seen = self.backend.observe()
        if seen is None or seen.job is None:
            return idle
        state, now = seen.state, now_utc()
        todo, wake = notify.due(job, state, now)
        if not todo:
            return wake_at(idle, wake)  # a retry not yet due (woken a little early): ask again then
        changed = [notify.attempted(item.record, self.notify_one(job, state, item, now), now, self.notify_backoff)
                   for item in todo]
        patch = StatusPatch(notified=notify.merged(state, changed))
        after = JobStatus.read({**seen.status, **patch.as_patch()})
        given_up = [r for r in after.notified if r.gave_up]
        conditions = state.conditions
        if given_up:
            told = "; ".join(f"{r.event} to {r.url} after {r.attempts} attempts: {r.last_error}" for r in given_up)
            patch.conditions = with_condition(conditions, notify.CONDITION, False, "NotifyFailed",
                                                f"not delivered: {told}", generation=seen.generation, now=now)
        elif notify.settled(job, after):
            patch.conditions = with_condition(conditions, notify.CONDITION, True, "Delivered",
                                                "every webhook of spec.notify was told", generation=seen.generation,
                                                now=now)
        self.put_status(patch)
        for r in changed:
            if r.delivered_at:
                self.backend.event("Normal", "Notified", f"{r.event}: told {r.url} (attempt {r.attempts})")
            elif r.gave_up:
                self.backend.event("Warning", "NotifyFailed",
                                   f"{r.event}: {r.url} was not told after {r.attempts} attempts ({r.last_error}); "
                                   f"the bij stays {state.phase}")
            else:
                log.warning("%s/%s: notify %s to %s failed (attempt %d): %s; next at %s", job.metadata.namespace,
                            job.metadata.name, r.event, r.url, r.attempts, r.last_error, r.next_attempt_at)
        return wake_at(idle, notify.due(job, after, now)[1])

    def notify_one(self, job: BatchInferenceJob, state: JobStatus, item: notify.Due, now: dt.datetime) -> str | None:
        """One signed POST of the bij's end; None when delivered, else why not."""
        try:
            key = self.backend.notify_key(item.target.secret_ref)
        except LookupError as e:
            return f"no signing key: {e.args[0] if e.args else e}"
        payload = notify_body(job, state, item.event, now)
        sent = notify_headers(key, payload, item.event, delivery_id(job, item.event), int(time.time()))
        return self.send(item.target.url, payload, sent, self.notify_backoff.timeout)
