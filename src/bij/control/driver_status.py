"""The status the driver writes: the fields every decision sets, a patch written only when it changes, and
the progress of rows and shards its lanes reported (the operator reads no storage)."""

from __future__ import annotations

from typing import Any

from bij.contract.efficiency import eta_seconds, fmt_duration
from bij.contract.lane_report import LaneTally
from bij.contract.rounds import RoundStats
from bij.contract.status import StatusPatch
from bij.control.decisions import TERMINAL_PHASES, Decision
from bij.control.driver_types import Backend, Observed
from bij.control.status import decision_patch, parse_time, rows_patch, status_differs


class StatusMixin:
    """The driver's status writing, on which its other parts build (`Driver` holds the backend)."""

    backend: Backend

    def base(self, seen: Observed, d: Decision, now: Any, message: str | None = None) -> StatusPatch:
        """The status fields every decision sets (phase, round, shards, conditions, ...), and `message`."""
        patch = decision_patch(seen.state, d, generation=seen.generation, now=now, output_uri=seen.output_uri)
        if message is not None:
            patch.message = message
        return patch

    def write_status(self, seen: Observed, patch: StatusPatch, event: tuple[str, str, str] | None = None) -> None:
        """Merge-patch the status (only if it changes) and post the Event."""
        if status_differs(seen.status, patch.as_patch()):
            self.put_status(patch)
        if event is not None:
            self.backend.event(*event)

    def put_status(self, patch: StatusPatch) -> None:
        """Merge-patch the status: the one place a patch becomes the JSON the backend writes."""
        self.backend.write_status(patch.as_patch())

    # --- progress from the pods' reports (the operator reads no storage) ------------------------------

    def shards_done(self, seen: Observed) -> int | None:
        """How many shards of the current round its lanes reported finished; None when no round runs.
        A lane counts only shards it finished itself, so the sum counts each shard once."""
        state = seen.state
        rec = state.round_records().get(state.current_round)
        if rec is None or rec.finished or state.phase in TERMINAL_PHASES:
            return None
        return self.reported(seen, state.current_round).shards_done

    @staticmethod
    def reported(seen: Observed, round_no: int) -> LaneTally:
        """Round `round_no`'s lane reports as the backend summed them (none, for another round)."""
        return seen.lanes if seen.lanes is not None and seen.lanes.round == round_no else LaneTally(round=round_no)

    def progress(self, seen: Observed, round_no: int, now: Any,
                 ended: RoundStats | None = None) -> StatusPatch:
        """``rows`` and ``rowsPerSecond``: the finished rounds' counts in ``status.rounds``, and the
        current round's (its statistics once `ended`, else what its lanes reported); ``eta`` of the
        running round from the input its lanes reported done."""
        state = seen.state
        done = failed = 0
        records = state.round_records()
        for r, rec in records.items():
            # A finished round counts from its record (the current one too: while publishing, say),
            # unless its statistics are being recorded right now (`ended`).
            if rec.finished and not (r == round_no and ended is not None):
                done += rec.approved
                failed += rec.errors
        this_round = records.get(round_no)
        finished = this_round is not None and this_round.finished
        current = LaneTally(round=round_no) if finished else self.reported(seen, round_no)
        if ended is not None:
            done += ended.approved
            failed += ended.errors
        else:
            done += current.rows
            failed += current.errors
        started = state.start_time or min((r.start_time for r in records.values() if r.start_time),
                                                 default=None)
        out = rows_patch(done, failed, started, now)
        round_start = parse_time(this_round.start_time if this_round is not None else None)
        size = this_round.bytes if this_round is not None else 0
        if ended is None and size and round_start is not None and current.pods:
            out.eta = fmt_duration(eta_seconds(current.bytes, size, (now - round_start).total_seconds()))
        return out

