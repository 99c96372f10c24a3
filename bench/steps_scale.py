"""The steps' memory and time at 10k to 1M shards: flat in shards, or not (DESIGN principle 12).

For each N, a round of N tiny shards is simulated directly in storage on file:// (no job runs): a round
plan of N shards, N completion records as workers write them, and for the manifest N publish-pass
summaries of one file each. Each step then runs alone in a child process, which reports its peak RSS
(VmHWM) and wall time:

- finish: the finish step's statistics (`steps.main.round_figures`);
- publish-plan: `steps.publish.prepare_publish`, the completion records and the publish plan;
- manifest: `steps.publish.finish_publish` (output.keepIntermediate true: no removal timed);
- plan-read: what lane 0 reads of the round plan to work its own shards (`Plan.from_json`, and where the
  plan is written in parts, `Plan.pieces` of each of its shards: the head and its parts, a few kept).

`--store s3` puts the round in a bucket of versitygw (the tests' S3 server, `make s3-bin`): the simulated
objects are written into its posix folder directly (S3 would take 2 PUTs a shard), and the steps read them
through S3 (LIST, GET): the requests each step makes are counted from the server's access log.

The step children cap glibc's malloc arenas first, as a step pod's main does (`bij.steps.arenas`), where
the side's code has that; a lane (plan-read) does not. `--objects N` keeps the input at N objects at
every size, so that what grows with the input's objects (the plan head lists them) is told apart from
what grows with shards.

The same children run the code of the base commit (--base, default main, exported with `git archive`)
in the same run, on the same storage: the anchor. The round plan is simulated as one document (what the
base reads); before the new side's children run it is rewritten as the plan step of this version writes
it (`planner.write_plan`: parts above `PART_SHARDS` shards), where that exists, and the base's manifest is
removed (both sides publish a job never published before). Targets (issue 38): peak
RSS within 1.3x from the smallest to the largest N and under 512 MB; time per shard within 1.5x.

    python bench/steps_scale.py [--shards 10000,100000] [--objects 0] [--store file|s3] [--base main] [--keep]
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import harness

STEPS = ("finish", "publish-plan", "manifest", "plan-read")
RSS_FLAT, RSS_MB, TIME_FLAT = 1.3, 512.0, 1.5
SHARDS_PER_OBJECT = 100
# "<endpoint> <folder>": the round lives in versitygw's bucket `bench`, whose objects are files under <folder>.
S3_ENV = "BIJ_BENCH_S3"
BUCKET = "bench"


def place(root: Path) -> tuple[str, dict[str, Any] | None]:
    """Where the round under `root` lives: its base URI and spec.storage.s3 (None on file://)."""
    s3 = os.environ.get(S3_ENV)
    if not s3:
        return f"file://{root}", None
    return f"s3://{BUCKET}/{root.name}", {"endpointUrl": s3.split(" ", 1)[0], "region": "us-east-1"}


def local_path(uri: str) -> Path:
    """The file behind `uri`: itself on file://, the server's file on s3:// (written there directly)."""
    if uri.startswith("s3://"):
        return Path(os.environ[S3_ENV].split(" ", 1)[1]) / uri.removeprefix("s3://")
    return Path(uri.removeprefix("file://"))


def job_doc(root: Path) -> dict[str, Any]:
    base, s3 = place(root)
    spec: dict[str, Any] = {"input": {"uri": f"{base}/in/"},
                            "output": {"uri": f"{base}/out/", "compression": "none", "keepIntermediate": True},
                            "model": {"engine": "echo", "task": "generate"}}
    if s3:
        spec["storage"] = {"s3": s3}
    return {"apiVersion": "batchinference.io/v1alpha1", "kind": "BatchInferenceJob", "metadata": {"name": "scale"},
            "spec": spec}


def record(index: int) -> dict[str, Any]:
    return {"index": index, "round": 0, "lane": index % 1000, "rows": 10, "errors": 1, "truncated": 0,
            "tokensIn": 100, "tokensOut": 50, "rejected": 0, "capped": 0, "engineCalls": 3, "judgeCalls": 0,
            "batches": 1, "chunks": 1, "engineBusySeconds": 0.5, "modelLoadSeconds": 0.0, "modelLoads": 0,
            "engineSteps": 4, "meanOccupancy": 0.5, "prefixShare": 0.1, "promptChars": 1000, "cachedTokens": 0,
            "bytes": 999, "intIds": 11, "strIds": 0, "structuredValidated": 0, "structuredRepaired": 0,
            "structuredViolations": 0, "notes": [], "seconds": 1.0, "finishedAt": "2026-12-06T00:00:00Z"}


def simulate(root: Path, shards: int, objects: int = 0) -> None:
    """A round of `shards` shards, every one done, in storage under `root` (plain writes, no fsync); its input
    is `objects` objects (0: one per `SHARDS_PER_OBJECT` shards)."""
    from bij.contract import layout
    from bij.contract.plan import Plan
    from bij.contract.spec import parse_job

    job = parse_job(job_doc(root))
    prefix = layout.round_prefix(job, 0)
    per = -(-shards // objects) if objects else SHARDS_PER_OBJECT
    inputs = [{"uri": f"{place(root)[0]}/in/{o:06d}.jsonl", "size": per * 1000, "name": f"{o:06d}.jsonl",
               "version": "1"} for o in range(-(-shards // per))]
    plan = Plan.model_validate({
        "round": 0, "roundPrefix": prefix, "inputUri": job.spec.input.uri, "job": job, "objects": inputs,
        "fingerprint": {"spec": "s", "input": "i"}, "lanes": min(shards, 1000),
        "shards": [[(i // per, i % per * 1000, (i % per + 1) * 1000)] for i in range(shards)]})
    path = local_path(layout.round_manifest_uri(job, 0))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(plan.to_json())
    del plan
    done = local_path(layout.done_folder(prefix))
    done.mkdir(parents=True)
    for i in range(shards):
        (done / f"{i:05d}.json").write_text(json.dumps(record(i)))
    summaries = local_path(layout.join(layout.publish_prefix(job), "shards"))
    summaries.mkdir(parents=True)
    for i in range(shards):
        (summaries / f"{i:05d}.json").write_text(json.dumps({
            "round": 0, "counts": {"rows": 10, "errors": 1, "capped": 0, "duplicates": 0, "truncated": 0,
                                   "tokensIn": 100, "tokensOut": 50},
            "files": [{"path": f"results/r0-{i:05d}.jsonl", "rows": 10, "sha256": "0" * 64, "bytes": 1000}],
            "errorFiles": [{"path": f"errors/r0-{i:05d}.jsonl", "rows": 1, "sha256": "0" * 64, "bytes": 100}],
            "cappedFiles": []}))


def child(step: str, root: Path) -> int:
    """Run one step over the simulated round; print its seconds and peak RSS as JSON."""
    from bij.contract import layout
    from bij.contract.plan import Plan
    from bij.contract.spec import parse_job

    if step != "plan-read":
        try:  # as a step pod's main does, where this side's code does (`bij.steps.arenas`)
            from bij.steps.arenas import cap_malloc_arenas
        except ImportError:
            pass
        else:
            cap_malloc_arenas()
    job = parse_job(job_doc(root))
    t0 = time.perf_counter()
    if step == "finish":
        try:
            from bij.steps.main import round_figures
        except ImportError:  # a base from before the typed step results: its finish step's dict
            from bij.steps.main import finish_round

            assert finish_round(job, 0)["done"] > 0
        else:
            assert round_figures(job, 0).done > 0
    elif step == "publish-plan":
        from bij.steps.publish import prepare_publish

        prepare_publish(job, 1)
    elif step == "manifest":
        from bij.steps import publish_rows
        from bij.steps.publish import finish_publish

        pplan = publish_rows.load(layout.publish_plan_uri(layout.publish_prefix(job)), job.spec.storage.s3)
        finish_publish(job, 1, pplan)
    elif step == "plan-read":
        from bij.storage import open_storage

        uri = layout.round_manifest_uri(job, 0)
        read = open_storage(uri, job.spec.storage.s3).read_bytes

        plan = Plan.from_json(read(uri), uri)
        if hasattr(plan, "with_reader"):  # plans in parts: a lane reads its own shards' parts
            plan = plan.with_reader(read)
            for s in range(0, plan.shard_total, plan.lane_count):
                plan.pieces(s)
        else:
            for s in range(0, len(plan.shards), plan.lane_count):
                plan.shards[s]
    seconds = time.perf_counter() - t0
    print(json.dumps({"seconds": seconds, "rssMb": peak_rss_mb()}))
    return 0


def peak_rss_mb() -> float:
    """This process's peak RSS: VmHWM, the high-water mark of its own memory since exec. Not ru_maxrss,
    which Linux carries over from the parent's memory at exec (a child of a big parent starts big)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def write_as_planned(src: Path, root: Path) -> None:
    """Rewrite the simulated one-document plan as `src`'s plan step writes it (in parts where it would), and
    remove the manifest the base's manifest step wrote: publish-plan and the manifest step read a manifest
    already there (a republish), which the base's would make one of 100,000s of files."""
    code = ("import sys; from pathlib import Path; from bij.contract import layout; "
            "from bij.contract.plan import Plan; "
            "from bij.contract.spec import parse_job; from bij.storage import open_storage; "
            "from bij.steps import planner; import steps_scale as s; "
            "job = parse_job(s.job_doc(Path(sys.argv[1]))); uri = layout.round_manifest_uri(job, 0); "
            "store = open_storage(uri, job.spec.storage.s3); store.delete(layout.manifest_uri(job)); "
            "hasattr(planner, 'write_plan') and planner.write_plan(store, uri, Plan.from_json(store.read_bytes(uri)))")
    subprocess.run([sys.executable, "-c", code, str(root)], check=True,
                   env={**harness.os.environ, "PYTHONPATH": f"{src}:{Path(__file__).parent}"})


def run_child(src: Path, step: str, root: Path, access_log: Path | None = None) -> dict[str, float]:
    """One step's seconds and peak RSS (and with `access_log`, the S3 server's, the requests it made)."""
    before = _lines(access_log)
    proc = subprocess.run([sys.executable, __file__, "--child", step, str(root)], capture_output=True, text=True,
                          env={**harness.os.environ, "PYTHONPATH": str(src)})
    if proc.returncode != 0:
        raise RuntimeError(f"{step} on {src} failed: {proc.stderr[-2000:]}")
    out = dict(json.loads(proc.stdout.strip().splitlines()[-1]))
    if access_log is not None:
        out["requests"] = _lines(access_log) - before
    return out


def _lines(path: Path | None) -> int:
    if path is None or not path.exists():
        return 0
    with open(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))


def start_s3(work: Path) -> Any:
    """versitygw on a folder of `work`, with bucket `bench`, this process's environment pointed at it (the
    children inherit it)."""
    sys.path[:0] = [str(harness.REPO / "tests"), str(harness.REPO / "tests" / "s3server")]
    import boto3
    import s3server

    exe = s3server.binary()
    if exe is None:
        raise SystemExit("--store s3 needs versitygw: make s3-bin")
    server = s3server.S3Server(exe, work / "s3")
    server.start()
    os.environ.update({**server.root.env(), "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1",
                       "AWS_EC2_METADATA_DISABLED": "true", S3_ENV: f"{server.endpoint} {server.data}"})
    os.environ.pop("AWS_ENDPOINT_URL", None)
    boto3.client("s3", endpoint_url=server.endpoint).create_bucket(Bucket=BUCKET)
    return server


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__, rows=0, repeats=1)
    p.add_argument("--shards", default="10000,100000", help="comma-separated shard counts")
    p.add_argument("--objects", type=int, default=0, help="input objects of every round (default: one per "
                   f"{SHARDS_PER_OBJECT} shards, so that they grow with the shards)")
    p.add_argument("--store", choices=("file", "s3"), default="file", help="where the round lives: file://, or "
                   "versitygw's S3 (make s3-bin)")
    p.add_argument("--base", default="main", help="the commit whose steps are the anchor ('none': no anchor, "
                   "for N where the base would need GBs)")
    args = harness.parse(p, argv)
    counts = [int(n) for n in args.shards.split(",")]
    report = harness.Report("steps_scale")
    work = Path(tempfile.mkdtemp(prefix="bij-steps-scale-"))
    base = work / "base"
    base.mkdir()
    sides = {"new": harness.REPO / "src"}
    if args.base != "none":
        archive = subprocess.run(["git", "-C", str(harness.REPO), "archive", args.base, "src"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
        sides["base"] = base / "src"
    results: dict[str, dict[str, dict[int, dict[str, float]]]] = {s: {k: {} for k in STEPS} for s in sides}
    server = start_s3(work) if args.store == "s3" else None
    access_log = server.access_log if server is not None else None
    try:
        for n in counts:
            root = work / f"n{n}"
            t0 = time.perf_counter()
            simulate(root, n, args.objects)
            print(f"simulated {n:,} shards in {time.perf_counter() - t0:.0f}s", flush=True)
            # The base first, on the one-document plan; then the plan as this version writes it, for the new.
            for side in [s for s in ("base", "new") if s in sides]:
                if side == "new":
                    write_as_planned(sides[side], root)
                for step in STEPS:  # the manifest step reads the publish plan the publish-plan step wrote
                    m = results[side][step][n] = run_child(sides[side], step, root, access_log)
                    asked = f", {m['requests']:,} requests ({m['requests'] / n:.3f} a shard)" if "requests" in m else ""
                    print(f"{side:4} {step:12} {n:>9,} shards: {m['rssMb']:7.1f} MB peak RSS, "
                          f"{m['seconds']:7.2f} s ({m['seconds'] / n * 1e6:6.1f} us/shard){asked}", flush=True)
            if not args.keep:
                shutil.rmtree(root, ignore_errors=True)  # on s3 the round is the server's files
                if server is not None:
                    shutil.rmtree(local_path(place(root)[0]), ignore_errors=True)
        lo, hi = counts[0], counts[-1]
        for step in STEPS:
            for side in sides:
                a, b = results[side][step][lo], results[side][step][hi]
                rss, per = b["rssMb"] / a["rssMb"], (b["seconds"] / hi) / (a["seconds"] / lo)
                target = side == "new"
                report.ratio(f"{side} {step} RSS {hi}/{lo}", rss, RSS_FLAT if target else None, False)
                report.ratio(f"{side} {step} s/shard {hi}/{lo}", per, TIME_FLAT if target else None, False)
                if target:
                    report.ratio(f"{side} {step} peak RSS MB at {hi}", b["rssMb"], RSS_MB, False)
                if "requests" in a and a["requests"] and b["requests"]:
                    report.ratio(f"{side} {step} requests/shard {hi}/{lo}",
                                 (b["requests"] / hi) / (a["requests"] / lo), None, False)
            if "base" in sides:
                report.ratio(f"{step} RSS new/base at {hi}",
                             results["new"][step][hi]["rssMb"] / results["base"][step][hi]["rssMb"], None)
        report.details["results"] = results
    finally:
        if server is not None:
            server.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    report.write(args.out)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        sys.exit(child(sys.argv[2], Path(sys.argv[3])))
    sys.exit(main())
