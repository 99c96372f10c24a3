"""spec.canary's pure parts: how many rows and which shards, its figures and thresholds, its Job and the worker
that works only the canary's shards. The rule in decide(): tests/control/rules/test_canary.py."""

from __future__ import annotations

import pytest
from rules.builders import CANARY, canary_bij

from bij.contract import codes
from bij.contract.canary import CanaryFigures, broken, canary_rows, canary_shards, estimate, spread_count
from bij.contract.spec import CanarySpec
from bij.control import observe

# --- the pure parts -----------------------------------------------------------------------------


def test_the_default_canary_is_half_a_percent_of_the_rows_at_most_2000_and_one_at_least() -> None:
    assert canary_rows(CanarySpec(), 10_000) == 50
    assert canary_rows(CanarySpec(), 10_000_000) == 2000
    assert canary_rows(CanarySpec(), 3) == 1
    assert canary_rows(CanarySpec(rows=700), 10_000_000) == 700


def test_the_canarys_shards_are_spread_over_the_round_one_at_the_middle_of_each_stretch() -> None:
    # One in each tenth of the plan (which is in input order), at its middle.
    assert canary_shards(1000, 10) == [50, 150, 250, 350, 450, 550, 650, 750, 850, 950]
    assert canary_shards(100, 3) == [16, 50, 83]
    assert canary_shards(5, 2) == [1, 3]
    assert canary_shards(7, 7) == list(range(7))  # the whole round
    assert canary_shards(7, 9) == list(range(7))
    assert canary_shards(1, 1) == [0]
    for total in range(1, 60):
        for count in range(1, total + 1):
            got = canary_shards(total, count)
            assert len(set(got)) == count and got == sorted(got) and 0 <= got[0] and got[-1] < total
            # The j-th holds the middle of the j-th stretch, (j + 1/2) * total / count.
            assert all(2 * s * count <= (2 * j + 1) * total < 2 * (s + 1) * count for j, s in enumerate(got))


def test_the_canary_takes_as_many_spread_shards_as_hold_its_rows() -> None:
    assert spread_count([30] * 10, 50) == 2
    assert spread_count([30] * 10, 10) == 1
    assert spread_count([30] * 10, 500) == 10
    assert spread_count([], 10) == 0
    # Shards of unequal length: grown until the shards it takes hold the rows, whichever those are.
    rows = [10.0, 1.0] * 50
    count = spread_count(rows, 40)
    assert sum(rows[s] for s in canary_shards(100, count)) >= 40


def test_no_threshold_set_breaks_nothing_and_figures_read_from_records() -> None:
    f = CanaryFigures.of([{"rows": 8, "errors": 2, "lengthCuts": 3, "tokensOut": 50, "seconds": 5.0, "bytes": 10},
                          {"rows": 10, "errors": 0, "seconds": 5.0, "bytes": 10}])  # an older worker: no lengthCuts
    assert (f.rows_in, f.errors, f.length_cuts, f.tokens_per_second_per_lane) == (20, 2, 3, 5.0)
    assert broken(CanarySpec(), f) == []
    assert estimate(f, 100, 2, None) == {"rows": 100, "laneSeconds": 50.0, "seconds": 25.0}


def test_the_canary_job_is_the_round_job_whose_lanes_work_only_the_first_shards() -> None:
    from bij.contract.codes import CANARY_SHARDS_ENV
    from bij.control.jobs import render_canary_job, render_job

    job = canary_bij({"maxErrorShare": 0.1})
    body = render_canary_job(job, 2, CANARY, "file:///data/out/_bij/x/round-0/shards.json")
    round_body = render_job(job, 0, 2, "file:///data/out/_bij/x/round-0/shards.json")
    assert body["metadata"]["name"] == "emb-r0-canary" != round_body["metadata"]["name"]
    assert body["metadata"]["labels"][codes.CANARY_LABEL] == "true"
    (container,) = body["spec"]["template"]["spec"]["containers"]
    assert {"name": CANARY_SHARDS_ENV, "value": str(CANARY)} in container["env"]
    assert observe.round_job(job, 0, [body]) is None and observe.canary_job(job, [body]) is not None


def test_a_worker_of_a_canary_job_works_only_the_canarys_spread_shards_and_refuses_a_bad_count() -> None:
    from bij.contract.codes import CANARY_SHARDS_ENV
    from bij.worker.main import worked_shards
    from bij.worker.shard import BadConfig

    assert worked_shards(40, {}) is None  # the round's
    assert worked_shards(40, {CANARY_SHARDS_ENV: "3"}) == [6, 20, 33]
    assert worked_shards(2, {CANARY_SHARDS_ENV: "3"}) == [0, 1]
    with pytest.raises(BadConfig, match="BIJ_CANARY_SHARDS must be a positive number of shards, not '0'"):
        worked_shards(40, {CANARY_SHARDS_ENV: "0"})
