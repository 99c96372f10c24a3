"""A stopped job's partial publish: the rows no worker finished ("not run"), counted and written as error lines.

The write pass (`bij.steps.publish_rows`) asks `count_not_run` for each shard unit of a partial publish
(`plan.partial`): the shard's input rows after its durable cursor and its rows between judge attempts,
for a shard without a completion record, and in the last round published the rows the judge
rejected. With OpenAI batch input each one becomes the error line OpenAI writes for a request a
stopped batch never ran (`not_run_line`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson

from bij.contract import layout
from bij.contract.publish_plan import PublishPlan, PublishPlanError
from bij.contract.result_rows import row_id
from bij.storage import NotFound, Storage, open_storage
from bij.storage.segments import ShardLog

if TYPE_CHECKING:
    from bij.contract.plan import Plan

# The error line of an OpenAI batch request a stopped batch never ran, by the phase it stopped in:
# OpenAI's codes, and its message for an expired request (its API reference's words for a cancelled one).
NOT_RUN_ERRORS = {
    "Expired": ("batch_expired", "This request could not be executed before the completion window expired."),
    "Cancelled": ("batch_cancelled", "The batch was cancelled before this request executed."),
}


def count_not_run(plan: PublishPlan, index: int, store: Storage,
                  emit: Callable[[dict[str, Any]], None] | None = None) -> int:
    """A stopped job's partial publish (`plan.partial`): the rows of unit `index` that no worker finished.

    They are the shard's input rows after its durable cursor (what a resumed worker would start
    from) and its rows between judge attempts, for a shard without a completion record; and in the
    last round published, the rows the judge rejected, whose next round never ran. Reads the
    shard's durable log and the input after its cursor: bounded by the shard, in the pass's pod.
    With OpenAI batch input, `emit` gets each one's error line (`not_run_line`).
    """
    round_no, shard, prefix = plan.unit(index)
    last_round = round_no == len(plan.round_plans) - 1
    rplan = _round_plan(plan, round_no, store)
    done = store.exists(layout.done_uri(rplan.round_prefix, shard))
    if done and not (last_round and plan.judge):
        return 0
    names = plan.object_names[round_no]

    def not_run(cid: Any, at: tuple[int, int]) -> None:
        assert emit is not None and plan.partial is not None
        emit(not_run_line(plan.partial, cid, names[at[0]], at[1]))

    line_of = not_run if emit is not None and rplan.spec.input.format == "openai" else None
    log_ = ShardLog(store, prefix)
    n, between = _not_run_in_log(log_, last_round, line_of)
    if not done:
        for place, cid in between:
            n += 1
            if line_of:
                line_of(cid, place)
        n += _not_run_after(plan, rplan, shard, log_.state.cursor, line_of)
    return n


def _round_plan(plan: PublishPlan, round_no: int, store: Storage) -> Plan:
    """Round `round_no`'s plan (shards.json), reading its parts from `store`."""
    # Here only: a whole publish loads no spec model (the round plan carries the job's spec).
    from bij.contract.plan import Plan

    uri = plan.round_plans[round_no]
    try:
        return Plan.from_json(store.read_bytes(uri), f"round plan {uri}").with_reader(store.read_bytes)
    except NotFound:
        raise PublishPlanError(f"round plan {uri} does not exist") from None


_LineOf = Callable[[Any, tuple[int, int]], None]  # a not-run row's error line, from its custom_id and place


def _not_run_in_log(log_: ShardLog, last_round: bool,
                    line_of: _LineOf | None) -> tuple[int, list[tuple[tuple[int, int], Any]]]:
    """Scan a shard's durable log: the rows the judge rejected in the last round published (each given to
    `line_of` as it is read), and the rows between attempts (no final record), in input order, with their ids."""
    attempts: dict[tuple[int, int], Any] = {}
    finals: set[tuple[int, int]] = set()
    n = 0
    for rec in log_.scan():
        place = (rec["at"][0], rec["at"][1])
        if rec["kind"] == "attempt":
            attempts[place] = rec.get("id")
            continue
        finals.add(place)
        if rec["kind"] == "rejected" and last_round:
            n += 1
            if line_of:
                line_of(row_id(rec["row"]), place)
    return n, [(place, attempts[place]) for place in sorted(set(attempts) - finals)]


def _not_run_after(plan: PublishPlan, rplan: Plan, shard: int, cursor: tuple[int, int],
                   line_of: _LineOf | None) -> int:
    """The shard's input rows after its durable `cursor` (each given to `line_of`)."""
    from bij.worker.reader import iter_shard_blocks

    spec = rplan.spec.input
    stores: dict[str, Storage] = {}

    def storage_for(u: str) -> Storage:
        scheme = u.split("://", 1)[0]
        if scheme not in stores:
            stores[scheme] = open_storage(u, plan.s3)
        return stores[scheme]

    columns = [c for c in (spec.id_field, spec.text_field, spec.messages_field, spec.sampling_field,
                           spec.adapter_field) if c]
    n = 0
    for places, lines, _ in iter_shard_blocks(storage_for, rplan.objects, rplan.pieces(shard),
                                              cursor, columns, spec.max_line_bytes, on_damaged="errorRow"):
        n += len(places)
        if line_of:
            for (obj, off, _), line in zip(places, lines, strict=True):
                line_of(_custom_id(line), (obj, off))
    return n


def not_run_line(phase: str, custom_id: Any, object_name: str, offset: int) -> dict[str, Any]:
    """The error line of an OpenAI batch request a batch stopped in `phase` never ran: OpenAI's
    fields (``custom_id``, ``response: null``, ``error`` with its code and message) and, as every
    error row here, ``id`` and where the line is."""
    code, message = NOT_RUN_ERRORS[phase]
    return {"id": custom_id, "error": {"code": code, "message": message}, "object": object_name,
            "offset": offset, "custom_id": custom_id, "response": None}


def _custom_id(line: Any) -> Any:
    """The custom_id of an OpenAI batch line not run (None when the line says none)."""
    if not isinstance(line, bytes | bytearray):
        return None  # a damaged object's break: no line to name
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    cid = obj.get("custom_id") if isinstance(obj, dict) else None
    return cid if isinstance(cid, str) else None
