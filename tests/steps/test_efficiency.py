"""Efficiency and cost: from the shards' completion records into the manifest, the status and `bij run`."""

from __future__ import annotations

import math

import pytest

from bij.contract.efficiency import cost, efficiency, eta_seconds, fmt_duration, fmt_money, status_fields
from bij.contract.spec import SpecError, parse_spec
from bij.local.publish import publish_manifest

RECORDS = [
    {"rows": 600, "errors": 1, "tokensIn": 30000, "tokensOut": 0, "seconds": 50.0, "modelLoadSeconds": 10.0,
     "engineBusySeconds": 45.0, "bytes": 1000},
    {"rows": 400, "errors": 0, "tokensIn": 20000, "tokensOut": 0, "seconds": 30.0, "modelLoadSeconds": 10.0,
     "engineBusySeconds": 15.0, "bytes": 500},
]


def test_efficiency_sums_worker_time_with_model_load_and_divides_by_it() -> None:
    eff = efficiency(RECORDS)
    assert eff == {"workerSeconds": 100.0, "modelLoads": 2, "modelLoadSeconds": 20.0, "engineBusySeconds": 60.0,
                   "engineBusyFraction": 0.6, "rowsPerSecondPerWorker": 10.0, "tokensPerSecondPerWorker": 500.0,
                   "slowestModelLoadSeconds": 10.0, "weightsBytes": 0}


def test_cost_per_million_rows_is_total_over_rows() -> None:
    spent = cost(2.5, 7200.0, rows=1000, tokens=50000)
    assert spent is not None
    assert spent["total"] == 5.0  # two pod hours
    assert spent["perMillionRows"] == 5.0 / 1000 * 1e6 and spent["perMillionTokens"] == 100.0
    assert cost(None, 7200.0, 1000, 1) is None
    assert cost(1.0, 10.0, 0, 0) == {"pricePerHour": 1.0, "total": round(10 / 3600, 6),
                                     "perMillionRows": None, "perMillionTokens": None}
    # A lane of two pods (spec.workers.nodesPerLane): its worker seconds are the leader's, paid twice.
    two = cost(2.5, 7200.0, rows=1000, tokens=50000, pods_per_lane=2)
    assert two is not None and two["total"] == 10.0 and two["podsPerLane"] == 2


def test_status_has_cost_so_far_and_the_rounds_eta() -> None:
    # 1,500 of 6,000 bytes in 60 s: 180 s to go.
    out = status_fields(RECORDS, RECORDS, round_bytes=6000, round_seconds=60.0, price_per_hour=36.0)
    assert out["eta"] == "3m00s"
    assert out["cost"]["total"] == 1.0  # 100 worker seconds at 36 an hour
    assert "cost" not in status_fields(RECORDS, RECORDS, 6000, 60.0, None)
    assert status_fields([], [], 6000, 60.0, None)["eta"] == "?"
    assert eta_seconds(10, 10, 5) == 0.0 and fmt_duration(3725) == "1h02m" and fmt_duration(None) == "?"


def test_money_reads_without_exponents() -> None:
    assert [fmt_money(v) for v in (0.000003125, 0.0123456, 2.5, 1234.5678, 0, None)] == \
        ["0.000003125", "0.01235", "2.500", "1,235", "0", "-"]


def test_manifest_carries_efficiency_and_with_a_price_cost(file_place, make_job, run_shards, read_output) -> None:
    rows = [{"id": i, "text": f"row {i}"} for i in range(50)]
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", rows), workers={"pricePerHour": 3.6})
    run_shards(job)
    manifest = publish_manifest(job)
    eff, spent = manifest.efficiency, manifest.cost
    assert eff is not None and spent is not None
    assert eff.worker_seconds > 0 and 0 <= eff.engine_busy_fraction <= 1
    assert math.isclose(eff.rows_per_second_per_worker, 50 / eff.worker_seconds, rel_tol=1e-2)
    assert math.isclose(spent.total, 3.6 * eff.worker_seconds / 3600, rel_tol=1e-3, abs_tol=1e-6)
    assert spent.per_million_rows is not None
    assert math.isclose(spent.per_million_rows, spent.total / 50 * 1e6, rel_tol=1e-3)
    assert read_output(job).manifest["cost"] == spent.as_json()

    _, free = make_job(file_place, file_place.write_jsonl("in2.jsonl", rows), out_dir="out2/")
    run_shards(free)
    publish_manifest(free)
    written = read_output(free).manifest
    assert "cost" not in written and "efficiency" in written


def test_cost_is_summed_per_pool_at_each_pools_price() -> None:
    records = [{"rows": 10, "errors": 0, "seconds": 3600.0, "pool": "spot"},
               {"rows": 10, "errors": 0, "seconds": 1800.0, "modelLoadSeconds": 1800.0, "pool": "od"}]
    eff = efficiency(records)
    assert eff["workerSeconds"] == 7200.0 and eff["workerSecondsByPool"] == {"od": 3600.0, "spot": 3600.0}
    spent = cost(3.0, eff["workerSeconds"], 20, 0, pool_prices={"spot": 1.0, "od": None},
                 by_pool=eff["workerSecondsByPool"])
    assert spent is not None and spent["pools"] == {"spot": 1.0, "od": 3.0} and spent["total"] == 4.0
    # Priced pools without workers.pricePerHour still cost; the status says the same.
    alone = status_fields(records, records, None, None, None, pool_prices={"spot": 1.0, "od": 2.0})
    assert alone["cost"]["total"] == 3.0 and alone["cost"]["pools"] == {"spot": 1.0, "od": 2.0}


def test_a_pools_pods_name_their_pool_in_the_shard_records_and_the_manifest_costs_it(
        file_place, make_job, run_shards, monkeypatch) -> None:
    rows = [{"id": i, "text": f"row {i}"} for i in range(50)]
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", rows),
                      workers={"pricePerHour": 3.6, "pools": [{"name": "spot", "pricePerHour": 0.36}, {"name": "od"}]})
    monkeypatch.setenv("BIJ_POOL", "spot")
    run_shards(job)
    manifest = publish_manifest(job)
    eff, spent = manifest.efficiency, manifest.cost
    assert eff is not None and spent is not None and spent.pools is not None
    assert eff.worker_seconds_by_pool == {"spot": eff.worker_seconds}
    assert math.isclose(spent.pools["spot"], 0.36 * eff.worker_seconds / 3600, rel_tol=1e-3, abs_tol=1e-6)
    assert spent.total == spent.pools["spot"]


@pytest.mark.parametrize("price", ["two dollars", "$2.50", -1, True])
def test_a_price_that_is_not_a_number_names_the_field(price: object) -> None:
    spec = {"input": {"uri": "file:///in"}, "output": {"uri": "file:///out"}, "workers": {"pricePerHour": price}}
    with pytest.raises(SpecError) as e:
        parse_spec(spec)
    assert "spec.workers.pricePerHour" in str(e.value)


def test_time_a_stopped_run_spent_counts_towards_the_shard(file_place, make_job, run_shards) -> None:
    from bij.contract import layout
    from bij.steps.progress import live_records, shard_records
    from bij.worker.metrics import Stats
    from bij.worker.shard import StopFlag

    rows = [{"id": i, "text": f"row {i}"} for i in range(100)]
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", rows),
                      sharding={"chunkRows": 10, "targetShardBytes": 1 << 20},
                      batching={"inFlightRows": 10, "commitQueueChunks": 1})
    stop = StopFlag()
    chunks: list[int] = []

    def progress(ev: dict) -> None:
        if ev["event"] == "chunk":
            chunks.append(1)
            if len(chunks) == 2:
                stop.request()

    assert run_shards(job, stop=stop, progress=progress,
                      stats=Stats(model_load_s=5.0, model_loads=1))[0].status == "stopped"
    (first,) = live_records(job, 0).values()  # the stopped run's progress record
    assert first["seconds"] > 0 and first["modelLoadSeconds"] == 5.0 and first["modelLoads"] == 1
    assert not file_place.storage.exists(layout.join(layout.round_prefix(job, 0), "done/00000.json"))
    assert run_shards(job, stats=Stats(model_load_s=2.0, model_loads=1))[0].status == "done"
    (done,) = shard_records(job, 0).values()
    assert done["seconds"] >= first["seconds"] and done["modelLoadSeconds"] == 7.0 and done["modelLoads"] == 2
