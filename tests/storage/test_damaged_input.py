"""A `.zst` input object cut short or damaged (an upload that died): `input.onDamagedObject`.

`fail` (the default) fails the round naming the object and where it breaks, with every row
before the break durable; a rerun after the object is put back whole resumes there. `errorRow`
publishes with one `corrupt_input` error row in its place, and says which object it was.
"""

from __future__ import annotations

import json
import subprocess
import time
from typing import Any

import pytest
import zstandard

from bij.contract import layout
from bij.contract.records import DamageRecord
from bij.control.decisions import MarkFailed
from bij.control.reconcile import decide
from bij.steps.publish import read_manifest

ROWS = [{"id": i, "text": f"row {i} " + "z" * (i * 7 % 50)} for i in range(12000)]  # several zstd blocks
DATA = b"".join(json.dumps(r).encode() + b"\n" for r in ROWS)
WHOLE = zstandard.ZstdCompressor(level=1).compress(DATA)
CUT = WHOLE[: len(WHOLE) * 2 // 3]  # an upload that died two thirds in


def bij(bij_bin: Any, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([bij_bin("bij"), *args], env=env, capture_output=True, text=True, timeout=180)


def put(place: Any, name: str, data: bytes) -> str:
    uri = place.uri(name)
    place.storage.write_bytes(uri, data)
    return uri


def durable_ids(place: Any, job: Any) -> list[Any]:
    """The ids of every durable result record of round 0, shard by shard, in log order."""
    from conftest import shard_log_lines

    return [rec["row"]["id"] for _, recs in sorted(shard_log_lines(place, job).items()) for rec in recs
            if rec["kind"] == "result"]


def good_prefix(offset: int) -> int:
    """How many input rows lie wholly before uncompressed byte `offset` (it must be a line end)."""
    ends = [0]
    for r in ROWS:
        ends.append(ends[-1] + len(json.dumps(r)) + 1)
    assert offset in ends, f"{offset} is not a line end"
    return ends.index(offset)


def test_a_cut_object_fails_the_run_naming_it_and_a_rerun_after_putting_it_back_resumes(
        place, make_job, worker_env, bij_bin, read_output, tmp_path):
    put(place, "in/b.jsonl.zst", CUT)
    place.write_jsonl("in/a.jsonl", [{"id": "a", "text": "a"}])
    spec, job = make_job(place, place.uri("in/"), sharding={"chunkRows": 100, "targetShardBytes": 1 << 20})
    echo_log = tmp_path / "echo.log"
    env = worker_env(place, echo_log=echo_log)

    p = bij(bij_bin, "run", str(spec), env=env)
    assert p.returncode == 42, p.stderr
    assert read_manifest(job) is None  # nothing published
    (rec,) = [DamageRecord.from_json(place.storage.read_bytes(o.uri))
              for o in place.storage.list(layout.damaged_folder(layout.round_prefix(job, 0)))]
    assert rec.name == "b.jsonl.zst" and rec.mode == "fail"
    k = good_prefix(rec.offset)
    assert 0 < k < len(ROWS)
    # The console names the object and where it breaks, in the run's last words.
    last = p.stderr.strip().splitlines()[-1]
    assert "b.jsonl.zst is damaged after uncompressed byte" in last and f"{rec.offset:,}" in last, p.stderr
    assert "replace the object and run again" in last
    # Every row before the break is durable, and nothing after it.
    assert sorted(i for i in durable_ids(place, job) if i != "a") == list(range(k))
    status = bij(bij_bin, "status", str(spec), env=env)
    assert f"damaged   b.jsonl.zst is damaged after uncompressed byte {rec.offset:,}" in status.stdout, status

    # Put the whole object back: the rerun resumes after the durable rows and publishes every row once.
    echo_log.unlink()
    time.sleep(0.05)  # past a tick of the coarse clock that stamps mtimes
    put(place, "in/b.jsonl.zst", WHOLE)
    p = bij(bij_bin, "run", str(spec), env=env)
    assert p.returncode == 0, p.stderr
    out = read_output(job)
    assert sorted(r["id"] for r in out.results if r["id"] != "a") == list(range(len(ROWS)))
    assert out.errors == [] and out.manifest["damagedObjects"] == []
    recomputed = echo_log.read_text().splitlines()
    assert not set(recomputed) & {r["text"] for r in ROWS[:k]}, "rows made before the break were made again"
    assert len(recomputed) == len(ROWS) - k
    assert place.storage.list(layout.damaged_folder(layout.round_prefix(job, 0))) == []


def test_a_replacement_that_differs_before_the_break_is_refused(file_place, make_job, worker_env, bij_bin):
    put(file_place, "in/b.jsonl.zst", CUT)
    spec, job = make_job(file_place, file_place.uri("in/"), sharding={"chunkRows": 100})
    env = worker_env(file_place)
    assert bij(bij_bin, "run", str(spec), env=env).returncode == 42
    time.sleep(0.05)
    other = b"".join(json.dumps({**r, "text": r["text"].upper()}).encode() + b"\n" for r in ROWS)
    put(file_place, "in/b.jsonl.zst", zstandard.ZstdCompressor(level=1).compress(other))
    p = bij(bij_bin, "run", str(spec), env=env)
    assert p.returncode == 42, p.stderr
    assert "does not begin with the same bytes" in p.stderr
    assert read_manifest(job) is None


def test_another_object_put_in_place_of_an_undamaged_one_is_still_refused(file_place, make_job, worker_env,
                                                                          bij_bin):
    put(file_place, "in/b.jsonl.zst", CUT)
    file_place.write_jsonl("in/a.jsonl", [{"id": "a", "text": "a"}])
    spec, job = make_job(file_place, file_place.uri("in/"), sharding={"chunkRows": 100})
    env = worker_env(file_place)
    assert bij(bij_bin, "run", str(spec), env=env).returncode == 42
    time.sleep(0.05)
    put(file_place, "in/b.jsonl.zst", WHOLE)
    file_place.write_jsonl("in/a.jsonl", [{"id": "a", "text": "changed"}])
    p = bij(bij_bin, "run", str(spec), env=env)
    assert p.returncode == 42
    assert "a.jsonl (" in p.stderr and "since round 0 was planned" in p.stderr


def test_error_row_mode_publishes_and_names_the_object_on_the_console_and_in_status(
        file_place, make_job, worker_env, bij_bin, read_output):
    put(file_place, "in/b.jsonl.zst", CUT)
    spec, job = make_job(file_place, file_place.uri("in/"), input={"onDamagedObject": "errorRow"},
                         sharding={"chunkRows": 100})
    env = worker_env(file_place)
    p = bij(bij_bin, "run", str(spec), env=env)
    assert p.returncode == 0, p.stderr
    out = read_output(job)
    (err,) = out.errors
    assert err["object"] == "b.jsonl.zst" and err["error"]["code"] == "corrupt_input"
    (damaged,) = out.manifest["damagedObjects"]
    assert (damaged["object"], damaged["offset"]) == ("b.jsonl.zst", err["offset"])
    k = good_prefix(err["offset"])
    assert sorted(r["id"] for r in out.results) == list(range(k))
    # The console says which object: the worker's warning and the published message.
    published = [line for line in p.stderr.splitlines() if line.startswith("bij: published")]
    assert published and "damaged input" in published[0] and "b.jsonl.zst" in published[0], p.stderr
    for target in (str(spec), layout.manifest_uri(job)):
        status = bij(bij_bin, "status", target, env=env)
        assert f"damaged   b.jsonl.zst is damaged after uncompressed byte {err['offset']:,}" in status.stdout


def test_a_round_that_failed_on_a_damaged_object_publishes_after_switching_to_error_rows(
        file_place, make_job, worker_env, bij_bin, read_output, tmp_path):
    put(file_place, "in/b.jsonl.zst", CUT)
    spec, job = make_job(file_place, file_place.uri("in/"), sharding={"chunkRows": 100})
    env = worker_env(file_place)
    assert bij(bij_bin, "run", str(spec), env=env).returncode == 42
    doc = spec.read_text().replace("input:\n", "input:\n    onDamagedObject: errorRow\n", 1)
    assert "onDamagedObject" in doc
    spec.write_text(doc)
    p = bij(bij_bin, "run", str(spec), env=env)
    assert p.returncode == 0, p.stderr
    out = read_output(job)
    (err,) = out.errors
    assert err["error"]["code"] == "corrupt_input" and err["object"] == "b.jsonl.zst"
    assert sorted(r["id"] for r in out.results) == list(range(good_prefix(err["offset"])))


# --- the decision ---------------------------------------------------------------------------------


def _job() -> Any:
    from bij.contract.spec import parse_job

    return parse_job({"apiVersion": "batchinference.io/v1alpha1", "kind": "BatchInferenceJob",
                      "metadata": {"name": "j", "namespace": "ns", "uid": "u1"},
                      "spec": {"input": {"uri": "s3://b/in/"}, "output": {"uri": "s3://b/out/"}}})


def _failed_round_job() -> dict[str, Any]:
    return {"metadata": {"name": "j-r0", "labels": {"batchinference.io/job": "j", "batchinference.io/round": "0"},
                         "ownerReferences": [{"uid": "u1"}]},
            "spec": {"completions": 2, "parallelism": 2},
            "status": {"conditions": [{"type": "Failed", "status": "True", "reason": "PodFailurePolicy",
                                       "message": "Container worker for pod ns/j-r0-1-abcde failed with exit code "
                                                  "42 matching FailJob rule at index 0"}]}}


def test_a_round_failed_on_a_damaged_object_fails_the_bij_naming_it() -> None:
    what = "b.jsonl.zst is damaged after uncompressed byte 1,234 (the object ends inside a zstd frame)"
    # The round's finish step counted 5 shards done and found the damage record its worker left.
    finish = {"metadata": {"name": "j-finish-r0", "uid": "f1", "labels": {"batchinference.io/job": "j"},
                           "ownerReferences": [{"uid": "u1"}]},
              "spec": {}, "status": {"conditions": [{"type": "Complete", "status": "True"}]}}

    def counted(damaged: list[str]) -> dict[str, Any]:
        return {"phase": "Running", "round": 0, "rounds": [{"round": 0, "shards": 8, "lanes": 2}],
                "reports": {"steps": {"j-finish-r0": {"jobUid": "f1", "result": {"done": 5, "damaged": damaged}}}}}

    d = decide(_job(), counted([what]), [_failed_round_job(), finish])
    assert isinstance(d, MarkFailed) and d.reason == "DamagedInput" and d.event == "DamagedInput"
    assert what in d.message and "replace the object and run again" in d.message
    # Without a damage record the failure is the Job's own, as before.
    plain = decide(_job(), counted([]), [_failed_round_job(), finish])
    assert isinstance(plain, MarkFailed) and plain.reason == "PodFailurePolicy"


@pytest.mark.parametrize("value, ok", [("fail", True), ("errorRow", True), ("skip", False)])
def test_on_damaged_object_is_fail_or_error_row_in_the_model_and_the_crd(value, ok) -> None:
    from bij.cli.validate import check_document

    doc = {"apiVersion": "batchinference.io/v1alpha1", "kind": "BatchInferenceJob", "metadata": {"name": "j"},
           "spec": {"input": {"uri": "s3://b/in/", "onDamagedObject": value}, "output": {"uri": "s3://b/out/"}}}
    verdicts = check_document(doc)
    assert (verdicts.schema == [], verdicts.model == []) == (ok, ok), verdicts
    # Left out, both the API server and the model say fail.
    del doc["spec"]["input"]["onDamagedObject"]  # type: ignore[attr-defined]
    verdicts = check_document(doc)
    assert verdicts.schema == verdicts.model == [] and verdicts.stored is not None
    assert verdicts.stored["spec"]["input"]["onDamagedObject"] == "fail"
    from bij.contract.spec import parse_job

    assert parse_job(doc).spec.input.on_damaged_object == "fail"
