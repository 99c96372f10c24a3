"""Telling spec.notify's webhooks that a job ended: which POSTs are due, what an attempt leaves, and the POST.

Once the phase is final (`contract.notify.event_of`), each webhook that asks for its event gets one signed
POST (`contract.notify.body`). Every attempt is recorded in ``status.notified`` (one entry per URL and event),
so an operator that restarts neither sends a delivered event again nor forgets one half-way through its
retries; a failed attempt is tried again after an exponential backoff, and once the attempts are spent the
entry is given up (the driver says so in a Warning Event and the Notified condition). Nothing here changes the
job's phase. A POST is delivered at least once: a 2xx whose record is lost with a restart is sent again under
the same ``X-Bij-Delivery`` id.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from bij.contract.notify import event_of
from bij.contract.spec import BatchInferenceJob, NotifyTarget
from bij.contract.spec_base import SecretKeyRef
from bij.contract.status import JobStatus, Notified
from bij.control.status import fmt_time, parse_time

# The condition that says how the webhooks fared (True: every one told; False: one given up).
CONDITION = "Notified"


@dataclasses.dataclass(frozen=True)
class Backoff:
    """How often and how patiently a webhook is tried: ``attempts`` POSTs at most, the n-th retry after
    ``first_delay * 2**(n-1)`` seconds (at most ``max_delay``), each POST given ``timeout`` seconds."""

    attempts: int = 8
    first_delay: float = 2.0
    max_delay: float = 300.0
    timeout: float = 10.0

    def delay(self, attempts_made: int) -> float:
        """Seconds before the next attempt, after `attempts_made` that failed."""
        return min(self.max_delay, self.first_delay * 2 ** max(0, attempts_made - 1))


# About 4 minutes of retries: 2, 4, ... 128 seconds apart.
BACKOFF = Backoff()


@dataclasses.dataclass(frozen=True)
class Due:
    """One POST to make now: to `target`, for `event`, its record so far (`record.attempts` made)."""

    target: NotifyTarget
    event: str
    record: Notified


def wanted(job: BatchInferenceJob, state: JobStatus) -> list[tuple[NotifyTarget, str]]:
    """The webhooks to tell of the job's end, with its event (none while it has not ended)."""
    event = event_of(state.phase)
    if event is None:
        return []
    return [(t, event) for t in job.spec.notify if event in t.events]


def records(state: JobStatus) -> dict[tuple[str, str], Notified]:
    """``status.notified`` keyed by (URL, event)."""
    return {(n.url, n.event): n for n in state.notified}


def settled(job: BatchInferenceJob, state: JobStatus) -> bool:
    """Whether every webhook of the job's end was told or given up (`bij run` waits for it)."""
    seen = records(state)
    for target, event in wanted(job, state):
        rec = seen.get((target.url, event))
        if rec is None or not (rec.delivered_at or rec.gave_up):
            return False
    return True


def due(job: BatchInferenceJob, state: JobStatus, now: dt.datetime) -> tuple[list[Due], float | None]:
    """The POSTs to make now, and in how many seconds the next one falls due (None: none waits)."""
    seen = records(state)
    out: list[Due] = []
    wake: float | None = None
    for target, event in wanted(job, state):
        rec = seen.get((target.url, event)) or Notified(url=target.url, event=event)
        if rec.delivered_at or rec.gave_up:
            continue
        at = parse_time(rec.next_attempt_at)
        if at is None or at <= now:
            out.append(Due(target, event, rec))
        else:
            left = (at - now).total_seconds()
            wake = left if wake is None else min(wake, left)
    return out, wake


def attempted(rec: Notified, error: str | None, now: dt.datetime, backoff: Backoff) -> Notified:
    """`rec` after one more attempt: delivered (`error` None), to try again after the backoff, or given up
    once ``backoff.attempts`` were made."""
    attempts = rec.attempts + 1
    if error is None:
        return rec.model_copy(update={"attempts": attempts, "delivered_at": fmt_time(now), "next_attempt_at": None,
                                      "last_error": None})
    if attempts >= backoff.attempts:
        return rec.model_copy(update={"attempts": attempts, "next_attempt_at": None, "last_error": error,
                                      "gave_up": True})
    later = now + dt.timedelta(seconds=backoff.delay(attempts))
    # Milliseconds: a backoff below a second (tests) is kept, not cut to the second before.
    at = later.astimezone(dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return rec.model_copy(update={"attempts": attempts, "next_attempt_at": at, "last_error": error})


def merged(state: JobStatus, changed: Sequence[Notified]) -> list[Notified]:
    """``status.notified`` with `changed` in place of their (URL, event) entries (a merge patch replaces a list
    whole)."""
    out = records(state)
    for rec in changed:
        out[(rec.url, rec.event)] = rec
    return list(out.values())


def secret_env(ref: SecretKeyRef) -> str:
    """Where `bij run` finds a notify Secret's key: env BIJ_SECRET_<NAME>_<KEY>, upper case, other characters _."""
    return re.sub(r"[^A-Z0-9]", "_", f"BIJ_SECRET_{ref.name}_{ref.key}".upper())


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    # A redirected POST would be re-sent as a GET without its body: a redirect is an answer that failed.
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)


def post(url: str, payload: bytes, headers: Mapping[str, str], timeout: float) -> str | None:
    """POST `payload`; None when the webhook answered 2xx, else why it was not delivered (one line)."""
    request = urllib.request.Request(url, data=payload, headers=dict(headers), method="POST")
    try:
        with _OPENER.open(request, timeout=timeout) as response:
            code = response.status
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code} {e.reason}".strip()
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        return f"{type(e).__name__}: {reason}"
    return None if 200 <= code < 300 else f"HTTP {code}"
