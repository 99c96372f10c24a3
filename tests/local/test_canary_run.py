"""`bij run` with spec.canary: the canary's shards run first and alone, and gate the rest."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from bij.contract import layout
from bij.contract.canary import canary_shards
from bij.steps.planner import plan_round
from bij.steps.publish import read_manifest
from bij.storage import open_storage
from bij.storage.segments import ShardLog


def rows(n: int) -> list[dict[str, Any]]:
    return [{"id": f"doc-{i}", "text": f"document {i} " + "k" * (i * 7 % 90)} for i in range(n)]


def bij_run(bij_bin: Any, spec: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([bij_bin("bij"), "run", "--no-progress", *args, str(spec)], env=env, capture_output=True,
                          text=True, timeout=120)


def durable_rows(job: Any) -> dict[int, int]:
    """Rows durable in storage for each shard of round 0 that has any (its logs read, not its records)."""
    prefix = layout.round_prefix(job, 0)
    store = open_storage(prefix, job.spec.storage.s3)
    out = {}
    for i in range(plan_round(job, 0).shard_count):
        n = sum(1 for _ in ShardLog(store, layout.shard_prefix(prefix, i)).scan())
        if n:
            out[i] = n
    return out


def test_a_template_that_fails_every_row_ends_canary_failed_having_run_only_the_canary_rows(
        file_place, make_job, worker_env, bij_bin):
    spec, job = make_job(file_place, file_place.write_jsonl("in.jsonl", rows(2000)),
                         prompt={"template": "Summarise {{ row.title }}"}, canary={"rows": 50, "maxErrorShare": 0.1})
    p = bij_run(bij_bin, spec, worker_env())
    assert p.returncode == 42, p.stderr
    planned = plan_round(job, 0).shard_count
    assert planned > 10
    done = durable_rows(job)
    ran = sum(done.values())
    # The canary's shards alone, spread over the input: one in each stretch of the plan, the last past its middle.
    assert list(done) == canary_shards(planned, len(done)) and 50 <= ran < 2000 // 10 and max(done) > planned // 2
    assert f"{ran} of {ran} error rows (100.0%), above spec.canary.maxErrorShare 10.0%" in p.stderr
    failing = re.search(r"id doc-(\d+): template_error: spec.prompt.template: the row has no column 'title'", p.stderr)
    assert failing and int(failing.group(1)) > 0  # a row of the canary's first shard, which is not the plan's first
    assert "Job t-r0 " not in p.stderr  # round 0's own Job was never made
    assert read_manifest(job) is None
    again = bij_run(bij_bin, spec, worker_env())  # a rerun says the same, and runs nothing more
    assert again.returncode == 42 and "maxErrorShare" in again.stderr
    assert durable_rows(job) == done


def test_a_canary_that_passes_is_estimated_and_its_rows_are_published_once(
        file_place, make_job, read_output, worker_env, bij_bin):
    inputs = rows(2000)
    spec, job = make_job(file_place, file_place.write_jsonl("in.jsonl", inputs),
                         workers={"parallelism": 2, "backoffLimitPerIndex": 0, "pricePerHour": 2.5},
                         canary={"rows": 100, "maxErrorShare": 0.01, "maxLengthCutShare": 0.01})
    first = bij_run(bij_bin, spec, worker_env(), "--canary-only")
    assert first.returncode == 0, first.stderr
    assert "passed; round 0 whole: about " in first.stderr and "costing about " in first.stderr
    canary = durable_rows(job)
    assert 100 <= sum(canary.values()) < 2000 // 4
    assert list(canary) == canary_shards(plan_round(job, 0).shard_count, len(canary)) and len(canary) > 1
    assert read_manifest(job) is None
    status = subprocess.run([bij_bin("bij"), "status", str(spec)], env=worker_env(), capture_output=True, text=True,
                            timeout=60)
    assert f"  canary    Passed: {sum(canary.values())} rows, 0 errors, 0 cut at maxTokens; round 0 whole: about " \
        in status.stdout and "costing about" in status.stdout

    p = bij_run(bij_bin, spec, worker_env())
    assert p.returncode == 0, p.stderr
    out = read_output(job)
    assert [(r["id"], r["output"]) for r in out.results] == [(r["id"], r["text"]) for r in inputs]
    assert out.manifest["counts"]["rows"] == 2000 and out.manifest["counts"]["duplicates"] == 0
    # The estimate made from the canary, against round 0 as it ran: rows of one shape scale by their bytes.
    checked = out.manifest["canary"]
    assert checked["shards"] >= 1 and checked["actual"]["rows"] == 2000
    assert abs(checked["error"]["rows"]) < 0.05 and checked["estimate"]["rows"] == pytest.approx(2000, rel=0.05)
    assert set(checked["error"]) == {"rows", "laneSeconds", "cost"}
    assert checked["actual"]["cost"] == pytest.approx(checked["actual"]["laneSeconds"] / 3600 * 2.5, abs=1e-3)


def test_answers_cut_at_max_tokens_are_counted_and_end_the_job_canary_failed(file_place, make_job, worker_env,
                                                                             bij_bin):
    # The simulated engine answers with the prompt's words up to maxTokens: four words, two tokens, every answer cut.
    inputs = [{"id": i, "text": f"words of row {i}"} for i in range(1000)]
    spec, job = make_job(file_place, file_place.write_jsonl("in.jsonl", inputs),
                         model={"engine": "simulated", "task": "generate", "simulated": {"stepSeconds": 0},
                                "sampling": {"maxTokens": 2}},
                         canary={"rows": 20, "maxLengthCutShare": 0.5})
    p = bij_run(bij_bin, spec, worker_env())
    assert p.returncode == 42, p.stderr
    ran = sum(durable_rows(job).values())
    assert f"{ran} of {ran} answers cut at maxTokens (100.0%), above spec.canary.maxLengthCutShare 50.0%" in p.stderr
    assert ran < 1000 // 4 and read_manifest(job) is None


def test_validate_shows_the_canary_settings_with_their_defaults(file_place, make_job, capsys):
    from bij.cli.main import main as bij_main

    path, _ = make_job(file_place, file_place.write_jsonl("in.jsonl", rows(5)),
                       canary={"maxErrorShare": 0.02, "minTokensPerSecondPerLane": 40})
    assert bij_main(["validate", str(path)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "valid",
        "canary: shards of round 0 spread over the input holding about 0.5% of the input's rows, at most 2,000 "
        "run alone first (whole shards); the job stops there (CanaryFailed) on: error rows above 2.0%; "
        "fewer than 40 output tokens/s per lane"]
