"""A decision as status: the conditions, the printer columns and the rows' progress (`bij.control.status`)."""

from __future__ import annotations

import datetime as dt

from rules.builders import (
    decision_status,
    k8s_job,
    make_job,
    phase_conditions,
    planned,
    rows_progress,
    set_condition,
)

from bij.control.reconcile import decide

T0 = dt.datetime(2024, 1, 1, tzinfo=dt.timezone.utc)


T1 = T0 + dt.timedelta(seconds=30)


def test_a_condition_keeps_its_transition_time_while_its_status_holds() -> None:
    cs = set_condition([], "Running", True, "Running", "1/8", generation=1, now=T0)
    cs = set_condition(cs, "Running", True, "Running", "5/8", generation=2, now=T1)
    assert cs == [{"type": "Running", "status": "True", "reason": "Running", "message": "5/8",
                   "lastTransitionTime": "2024-01-01T00:00:00Z", "observedGeneration": 2}]
    cs = set_condition(cs, "Running", False, "Suspended", "", generation=2, now=T1)
    assert cs[0]["lastTransitionTime"] == "2024-01-01T00:00:30Z"


def test_phase_conditions_list_every_type_once_with_the_phase_true() -> None:
    cs = phase_conditions([], "Suspended", "Suspended", "round 0 suspended", generation=3, now=T0)
    by_type = {c["type"]: c for c in cs}
    assert sorted(by_type) == sorted(["Ready", "Running", "Suspended", "Succeeded", "Failed"])
    assert by_type["Suspended"]["status"] == "True"
    assert by_type["Running"]["status"] == "False"
    assert by_type["Ready"]["status"] == "False"
    assert by_type["Ready"]["message"] == "round 0 suspended"
    assert all(c["observedGeneration"] == 3 for c in cs)


def test_decision_status_fills_the_printer_columns() -> None:
    d = decide(make_job(), planned(), [k8s_job(completed="0-2", active=4)], shards_done=5)
    patch = decision_status({}, d, generation=1, now=T0, output_uri="file:///data/out")
    assert patch["phase"] == "Running"
    assert patch["round"] == 0
    assert patch["shardsSummary"] == "5/8"
    assert patch["shards"] == {"done": 5, "total": 8}
    assert patch["lanesSummary"] == "3/8"
    assert patch["lanes"] == {"done": 3, "failed": 0, "active": 4, "total": 8, "replaced": 0}
    assert patch["startTime"] == "2024-01-01T00:00:00Z"
    assert "completionTime" not in patch


def test_rows_progress_sums_completion_records_over_wall_time() -> None:
    records = [{"rows": 100, "errors": 2}, {"rows": 50, "errors": 0}]
    out = rows_progress(records, "2024-01-01T00:00:00Z", T1)
    assert out == {"rows": {"done": 150, "failed": 2}, "rowsPerSecond": 5.0}
