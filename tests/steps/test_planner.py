"""Planner: shards from object sizes alone; every input line is owned by exactly one piece."""

from __future__ import annotations

import json
import random
import re
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import zstandard

from bij.contract import layout
from bij.contract.fingerprint import PlanRefused
from bij.contract.globs import glob_matches, split_glob
from bij.contract.plan import PlanObject
from bij.steps.plan_input import PlanError, input_objects
from bij.steps.planner import plan_round
from bij.steps.sharding import plan_shards
from bij.storage import FileStorage, ObjectInfo
from bij.worker.reader import iter_shard

FS = FileStorage()


def random_object(rnd: random.Random) -> bytes:
    """Lines of random lengths: blank ones, CRLF ones, a last line without a newline now and then."""
    lines = []
    for _ in range(rnd.randint(0, 40)):
        kind = rnd.random()
        if kind < 0.1:
            lines.append(b"" if rnd.random() < 0.5 else b"   ")
        else:
            body = json.dumps({"n": rnd.randint(0, 10**6), "t": "x" * rnd.choice([0, 1, 3, 20, 90])}).encode()
            lines.append(body + (b"\r" if kind < 0.2 else b""))
    data = b"\n".join(lines)
    return data + (b"\n" if lines and rnd.random() < 0.8 else b"")


def expected_lines(obj: int, data: bytes) -> list[tuple[tuple[int, int, int], bytes]]:
    """What reading the whole object must yield: non-blank lines with their places, CR stripped."""
    out, off = [], 0
    for line in data.split(b"\n"):
        if off >= len(data):
            break
        if line.strip():
            out.append(((obj, off, off + len(line) + 1), line.rstrip(b"\r")))
        off += len(line) + 1
    return out


def write_objects(tmp_path: Path, blobs: list[tuple[bytes, bool]]) -> list[PlanObject]:
    objects = []
    for i, (data, compressed) in enumerate(blobs):
        path = tmp_path / (f"o{i:03d}.jsonl" + (".zst" if compressed else ""))
        path.write_bytes(zstandard.ZstdCompressor().compress(data) if compressed else data)
        objects.append(PlanObject(uri=f"file://{path}", size=path.stat().st_size))
    return objects


def read_all(objects: list[PlanObject], shards: list[list[Any]]) -> list[list[Any]]:
    return [list(iter_shard(lambda uri: FS, objects, [list(p) for p in s])) for s in shards]


def test_byte_ranges_give_every_line_to_exactly_one_piece(tmp_path: Path):
    rnd = random.Random(11)
    for trial in range(60):
        d = tmp_path / str(trial)
        d.mkdir()
        blobs = [(random_object(rnd), rnd.random() < 0.15) for _ in range(rnd.randint(1, 5))]
        objects = write_objects(d, blobs)
        target = rnd.choice([1, 2, 7, 50, 333, 1000, 5000])
        shards = plan_shards([(o.size, o.uri.endswith(".zst")) for o in objects], target)

        # The pieces of each object tile it: no byte twice, none missing, in order.
        tiles: dict[int, list[tuple[int, int]]] = {}
        for s in shards:
            assert s, "no empty shard"
            for obj, start, end in s:
                tiles.setdefault(obj, []).append((start, end))
        for i, o in enumerate(objects):
            if o.size == 0:
                assert i not in tiles
                continue
            cuts = tiles[i]
            assert cuts[0][0] == 0 and cuts[-1][1] == o.size
            assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(cuts, cuts[1:], strict=False))
            if blobs[i][1]:
                assert cuts == [(0, o.size)]  # a .zst object is never cut

        got = [line for shard in read_all(objects, shards) for line in shard]
        want = [line for i, (data, _) in enumerate(blobs) for line in expected_lines(i, data)]
        assert got == want, (trial, target)


def test_reading_from_a_resume_cursor_gives_exactly_the_rest_of_the_shard(tmp_path: Path):
    rnd = random.Random(5)
    blobs = [(random_object(rnd) + random_object(rnd), i == 1) for i in range(3)]
    objects = write_objects(tmp_path, blobs)
    shards = plan_shards([(o.size, o.uri.endswith(".zst")) for o in objects], 700)
    for shard, lines in zip(shards, read_all(objects, shards), strict=True):
        for k, ((obj, _, end), _) in enumerate(lines):
            rest = list(iter_shard(lambda uri: FS, objects, [list(p) for p in shard], (obj, end)))
            assert rest == lines[k + 1:]


def test_zst_objects_stay_whole_and_small_objects_share_a_shard():
    sizes = [(100, False)] * 30 + [(10_000, True), (50, True), (100, False)]
    shards = plan_shards(sizes, 1000)
    assert [len(s) for s in shards[:3]] == [10, 10, 10]  # thirty 100-byte objects, ten to a shard
    assert [(obj, start, end) for s in shards for obj, start, end in s if obj == 30] == [(30, 0, 10_000)]
    assert sum(len(s) for s in shards) == 33
    for s in shards:
        plain = sum(end - start for obj, start, end in s if not sizes[obj][1])
        assert plain <= 1000


def test_a_large_object_is_cut_into_target_sized_pieces():
    shards = plan_shards([(10_500, False)], 1000)
    assert len(shards) == 11
    assert shards[0] == [(0, 0, 1000)] and shards[-1] == [(0, 10_000, 10_500)]


FIFTY_THOUSAND = {
    "objects": [(64 << 20, False)] * 50_000,  # one shard per object
    "small-objects": [(16 << 20, False)] * 200_000,  # four small objects per shard
    "one-huge-object": [(50_000 * (64 << 20), False)],  # one 3 TB object
    "zst": [(32 << 20, True)] * 100_000,  # compressed objects, two per shard
}


@pytest.mark.parametrize("case", FIFTY_THOUSAND)
def test_fifty_thousand_shards_plan_in_well_under_a_second(case):
    t = time.perf_counter()
    shards = plan_shards(FIFTY_THOUSAND[case], 64 << 20)
    elapsed = time.perf_counter() - t
    assert len(shards) == 50_000
    assert elapsed < 5  # about 0.1 to 0.3 s on one core


@pytest.mark.parametrize("case", ["objects", "one-huge-object"])
def test_planning_memory_is_proportional_to_the_plan_not_to_the_bytes(case):
    sizes = FIFTY_THOUSAND[case]
    tracemalloc.start()
    try:
        shards = plan_shards(sizes, 64 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # The plan itself is about 220 bytes a shard (11 MB here); nothing grows with rows or bytes.
    assert peak < 500 * len(shards)


def test_input_objects_skip_underscore_and_dot_folders_at_any_depth_below_the_input():
    base = "s3://b/_data/in/"  # the input's own path may have such names: the user chose it
    names = ["a.jsonl", "_temporary/0/part-1.jsonl", "x/.staging/b.jsonl", "_bij/t/round-0/rejected/00000.jsonl",
             "y/z/c.jsonl", "y/_tmp/z/d.jsonl"]
    objs = [ObjectInfo(base + n, 5) for n in names]
    assert [o.uri[len(base):] for o in input_objects(objs, base)] == ["a.jsonl", "y/z/c.jsonl"]
    # A single object named by the input URI is read whatever its folders are called.
    assert input_objects([ObjectInfo(base + "a.jsonl", 5)], base + "a.jsonl") == [ObjectInfo(base + "a.jsonl", 5)]


def test_input_objects_are_jsonl_files_skipping_empty_hidden_and_other_files():
    objs = [ObjectInfo(f"s3://b/in/{n}", size) for n, size in [
        ("a.jsonl", 5), ("b.ndjson", 5), ("c.json", 5), ("d.jsonl.zst", 5), ("e.jsonl", 0), ("_SUCCESS", 5),
        ("f.csv", 5), (".g.jsonl", 5), ("_h.jsonl", 5), ("i.jsonl.gz", 5)]]
    assert [o.uri.rsplit("/", 1)[1] for o in input_objects(objs)] == ["a.jsonl", "b.ndjson", "c.json", "d.jsonl.zst"]


def test_plan_round_writes_the_plan_once_and_names_objects_relative_to_the_input(file_place, make_job):
    file_place.write_jsonl("in/sub/a.jsonl", [{"id": i, "text": "x" * 50} for i in range(200)])
    file_place.write_jsonl("in/b.jsonl", [{"id": "b", "text": "y"}])
    _, job = make_job(file_place, file_place.uri("in/"), sharding={"targetShardBytes": 4096})
    first = plan_round(job, 0)
    uri = layout.round_manifest_uri(job, 0)
    doc = json.loads(file_place.storage.read_bytes(uri))
    assert [o["name"] for o in doc["objects"]] == ["b.jsonl", "sub/a.jsonl"]
    assert first.shard_count == len(doc["shards"]) >= 3
    assert doc["roundPrefix"] == layout.round_prefix(job, 0)
    # A second plan (an operator restart, a rerun) reads the plan already written.
    assert plan_round(job, 0) == first
    assert json.loads(file_place.storage.read_bytes(uri)) == doc
    # It records what decides the rows: the input objects with their versions, and a fingerprint.
    assert all(o["version"] for o in doc["objects"]) and set(doc["fingerprint"]) == {"spec", "input"}


def test_planning_an_empty_input_fails_naming_the_uri(place, make_job):
    place.write_jsonl("in/readme.txt", ["not input"])
    _, job = make_job(place, place.uri("in/"))
    with pytest.raises(PlanError, match=r"spec\.input\.uri: no input at " + place.uri("in/")):
        plan_round(job, 0)


@pytest.mark.parametrize(("uri", "base", "pattern"), [
    ("s3://b/in/", "s3://b/in/", None),
    ("s3://b/logs/2026-*/part-*.jsonl", "s3://b/logs/", "2026-*/part-*.jsonl"),
    ("file:///data/**/*.jsonl.zst", "file:///data/", "**/*.jsonl.zst"),
    ("s3://b/in/day-?.jsonl", "s3://b/in/", "day-?.jsonl"),
])
def test_a_glob_input_lists_the_folder_before_its_first_wildcard(uri: str, base: str, pattern: str | None) -> None:
    assert split_glob(uri) == (base, pattern)


@pytest.mark.parametrize(("pattern", "yes", "no"), [
    ("*.jsonl", ["a.jsonl", ".jsonl"], ["sub/a.jsonl", "a.jsonl.zst"]),
    ("2026-*/part-*.jsonl", ["2026-01/part-0.jsonl"], ["2025-01/part-0.jsonl", "2026-01/x/part-0.jsonl"]),
    ("**/*.jsonl", ["a.jsonl", "x/a.jsonl", "x/y/z/a.jsonl"], ["a.json", "x/a.jsonl.zst"]),
    ("x/**", ["x/a", "x/y/b.jsonl"], ["y/a"]),
    ("day-[0-2].jsonl", ["day-0.jsonl", "day-2.jsonl"], ["day-3.jsonl", "day-10.jsonl"]),
    ("day-[!0].jsonl", ["day-1.jsonl"], ["day-0.jsonl"]),
    ("a?c.jsonl", ["abc.jsonl"], ["a/c.jsonl", "ac.jsonl"]),
])
def test_glob_patterns_match_within_a_name_and_double_star_spans_folders(pattern: str, yes: list[str],
                                                                         no: list[str]) -> None:
    assert [glob_matches(pattern, p) for p in yes] == [True] * len(yes)
    assert [glob_matches(pattern, p) for p in no] == [False] * len(no)


def test_a_glob_input_plans_exactly_the_objects_it_matches(place, make_job):
    for day in ("2026-01", "2026-02", "2025-12"):
        place.write_jsonl(f"in/{day}/part-0.jsonl", [{"id": f"{day}-{i}", "text": "x"} for i in range(3)])
        place.write_jsonl(f"in/{day}/extra/part-1.jsonl", [{"id": f"{day}-x", "text": "y"}])
    _, job = make_job(place, place.uri("in/2026-*/part-*.jsonl"))
    plan_round(job, 0)
    doc = json.loads(place.storage.read_bytes(layout.round_manifest_uri(job, 0)))
    assert [o["name"] for o in doc["objects"]] == ["2026-01/part-0.jsonl", "2026-02/part-0.jsonl"]
    _, everywhere = make_job(place, place.uri("in/**/part-*.jsonl"), name="all", out_dir="out-all/")
    plan_round(everywhere, 0)
    doc = json.loads(place.storage.read_bytes(layout.round_manifest_uri(everywhere, 0)))
    assert len(doc["objects"]) == 6
    _, none = make_job(place, place.uri("in/2024-*/*.jsonl"), name="none", out_dir="out-none/")
    with pytest.raises(PlanError, match=r"no input at .*in/2024-\*/\*\.jsonl"):
        plan_round(none, 0)


def test_an_output_inside_the_folder_a_glob_lists_is_refused(file_place, make_job):
    file_place.write_jsonl("in/a.jsonl", [{"id": 1, "text": "x"}])
    _, job = make_job(file_place, file_place.uri("in/*.jsonl"), out_dir="in/out/")
    with pytest.raises(PlanRefused, match="must not be spec.input.uri, lie inside it or contain it"):
        plan_round(job, 0)


@pytest.mark.parametrize(("field", "uri", "says"), [
    ("input", "s3://b*/in/", "a glob may not be in the bucket name"),
    ("input", "gs://b*/in/", "a glob may not be in the bucket name"),
    ("input", "s3://b/in/**x/*.jsonl", "'**' must be a whole folder name"),
    ("input", "s3://b/in/day-[0-2.jsonl", "has no closing ']'"),
    ("output", "s3://b/out-*/", "an output is one folder: no wildcards"),
])
def test_a_bad_glob_is_refused_naming_the_field(field: str, uri: str, says: str) -> None:
    from bij.contract.spec import SpecError, parse_job

    spec: dict[str, Any] = {"input": {"uri": "s3://b/in/"}, "output": {"uri": "s3://b/out/"}}
    spec[field] = {"uri": uri}
    with pytest.raises(SpecError, match=f"spec.{field}.uri: .*" + re.escape(says)):
        parse_job({"apiVersion": "batchinference.io/v1alpha1", "kind": "BatchInferenceJob",
                   "metadata": {"name": "g"}, "spec": spec})


# --- a plan is a promise -----------------------------------------------------------------------


@pytest.mark.parametrize("change, says", [
    ({"input": {"textField": "body"}}, 'spec.input.textField changed from "text" to "body"'),
    ({"model": {"engine": "echo", "name": "other-model"}}, 'spec.model.name changed from null to "other-model"'),
    ({"model": {"maxTokens": 7}}, "spec.model.maxTokens changed from 256 to 7"),
    ({"model": {"truncate": True}}, "spec.model.truncate changed from null to true"),
    ({"judge": {"type": "regex", "pattern": "x"}}, "spec.judge changed from null to"),
])
def test_a_rerun_whose_spec_decides_rows_differently_is_refused_naming_the_change(file_place, make_job, change,
                                                                                  says):
    uri = file_place.write_jsonl("in.jsonl", [{"id": 1, "text": "a", "body": "b"}])
    _, job = make_job(file_place, uri)
    plan_round(job, 0)
    _, changed = make_job(file_place, uri, **change)
    with pytest.raises(PlanRefused) as e:
        plan_round(changed, 0)
    assert says in str(e.value)
    assert "bij run --restart" in str(e.value) and "\n" not in str(e.value)


def test_a_plan_whose_spec_carried_the_old_sampling_defaults_matches_a_spec_that_sets_none(file_place, make_job):
    # Plans written while model.maxTokens/temperature/seed had defaults of their own recorded 256, 0.0 and 0;
    # now unset, they must still read the same, or every resume across the upgrade would be refused.
    uri = file_place.write_jsonl("in.jsonl", [{"id": 1, "text": "a"}])
    _, job = make_job(file_place, uri)
    first = plan_round(job, 0)
    plan_uri = layout.round_manifest_uri(job, 0)
    doc = json.loads(file_place.storage.read_bytes(plan_uri))
    assert "maxTokens" not in doc["job"]["spec"]["model"]
    doc["job"]["spec"]["model"].update({"maxTokens": 256, "temperature": 0.0, "seed": 0})
    file_place.storage.write_bytes(plan_uri, json.dumps(doc).encode())
    assert plan_round(job, 0).shard_count == first.shard_count


def test_a_rerun_with_another_input_uri_is_refused(file_place, make_job):
    _, job = make_job(file_place, file_place.write_jsonl("in/a.jsonl", [{"id": 1, "text": "a"}]))
    plan_round(job, 0)
    _, other = make_job(file_place, file_place.write_jsonl("in/b.jsonl", [{"id": 1, "text": "a"}]))
    with pytest.raises(PlanRefused, match=r"spec\.input\.uri changed from .*a\.jsonl.* to .*b\.jsonl"):
        plan_round(other, 0)


def test_spec_fields_that_only_say_how_the_work_is_done_may_change(file_place, make_job):
    uri = file_place.write_jsonl("in.jsonl", [{"id": 1, "text": "a"}])
    _, job = make_job(file_place, uri)
    first = plan_round(job, 0)
    _, faster = make_job(file_place, uri, workers={"parallelism": 9}, batching={"maxBatchSize": 3},
                         sharding={"chunkRows": 5}, maxErrorRatio=0.5, model={"vllm": {"gpuMemoryUtilization": 0.5}},
                         output={"format": "parquet", "compression": "none", "keepIntermediate": True})
    assert plan_round(faster, 0) == first


def test_a_rerun_over_changed_input_objects_is_refused(place, make_job):
    place.write_jsonl("in/a.jsonl", [{"id": i, "text": "a"} for i in range(10)])
    place.write_jsonl("in/b.jsonl", [{"id": "b", "text": "b"}])
    _, job = make_job(place, place.uri("in/"))
    plan_round(job, 0)
    time.sleep(0.05)  # past a tick of the kernel's coarse clock, which stamps mtimes
    place.write_jsonl("in/b.jsonl", [{"id": "B", "text": "B"}])  # same size, new content
    with pytest.raises(PlanRefused, match=r"1 input object\(s\) changed: .*b\.jsonl \(rewritten"):
        plan_round(job, 0)
    place.write_jsonl("in/b.jsonl", [{"id": "bb", "text": "b"}])
    place.write_jsonl("in/c.jsonl", [{"id": "c", "text": "c"}])
    place.storage.delete(place.uri("in/a.jsonl"))
    with pytest.raises(PlanRefused) as e:
        plan_round(job, 0)
    assert "1 input object(s) added (" in str(e.value) and "c.jsonl" in str(e.value)
    assert "1 input object(s) gone (" in str(e.value) and "a.jsonl" in str(e.value)
    assert "b.jsonl (size 25 -> 26)" in str(e.value)


def test_a_second_job_at_an_output_another_job_owns_is_refused(place, make_job):
    uri = place.write_jsonl("in.jsonl", [{"id": 1, "text": "a"}])
    _, first = make_job(place, uri, name="first")
    plan_round(first, 0)
    _, second = make_job(place, uri, name="second")
    with pytest.raises(PlanRefused, match=r"spec\.output\.uri: .* belongs to BatchInferenceJob default/first"):
        plan_round(second, 0)
    _, elsewhere = make_job(place, uri, name="second", out_dir="out-second/")
    plan_round(elsewhere, 0)


def test_the_same_job_made_again_takes_its_output_over_and_drops_the_old_manifest(file_place, make_job):
    from bij.contract.spec import parse_job

    uri = file_place.write_jsonl("in.jsonl", [{"id": 1, "text": "a"}])
    _, job = make_job(file_place, uri)
    doc = job.model_dump(mode="json", by_alias=True, exclude_none=True)
    old = parse_job({**doc, "metadata": {"name": "t", "uid": "uid-1"}})
    plan_round(old, 0)
    file_place.storage.write_bytes(layout.manifest_uri(old), b"{}")  # published by the first object
    new = parse_job({**doc, "metadata": {"name": "t", "uid": "uid-2"}})  # deleted and applied again
    plan_round(new, 0)
    assert not file_place.storage.exists(layout.manifest_uri(new))
    owner = json.loads(file_place.storage.read_bytes(layout.owner_uri(new)))
    assert (owner["name"], owner["id"]) == ("t", "uid-2")


def test_an_output_inside_the_input_is_refused_at_plan_time_with_paths_resolved(file_place, make_job, tmp_path,
                                                                                monkeypatch):
    file_place.write_jsonl("in/a.jsonl", [{"id": 1, "text": "a"}])
    monkeypatch.chdir(tmp_path)
    # Written apart (one relative, one absolute), the spec check cannot see that they overlap.
    _, job = make_job(file_place, file_place.uri("in/"), output={"uri": "file://data/in/out/"})
    with pytest.raises(PlanRefused, match="spec.output.uri must not be spec.input.uri, lie inside it"):
        plan_round(job, 0)
    assert not (tmp_path / "data" / "in" / "out").exists()


def test_each_run_removes_temp_files_that_killed_writes_left(file_place, make_job):
    import os

    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", [{"id": 1, "text": "a"}]))
    plan_round(job, 0)
    out = Path(job.spec.output.uri[len("file://"):])
    left = [out / ".manifest.json.k1llx9q2.tmp", out / "results" / ".r0-00000.jsonl.0123456789abcdef.tmp",
            out / "_bij" / "t" / "round-0" / "done" / ".00000.json.a1b2c3d4.tmp"]
    for f in left:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"half a file")
        os.utime(f, (time.time() - 3600, time.time() - 3600))
    plan_round(job, 0)  # the next run
    assert not any(f.exists() for f in left)
