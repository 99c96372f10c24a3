"""Many shards: S3 requests and wall time per shard, the same rows as 100, 1,000 and 10,000 shards (issue 22).

A lane claims every shard it works in the output store. Each claim decision once listed
every claim and completion record of the round, so a round cost O(shards^2) requests and
per-shard time grew with the shard count (40,000 rows on the real control plane: 7 shards
in 6 s, 405 shards in 26 s). This cuts the same --rows echo rows (input and output on S3)
into each of --shards shard counts and runs round 0's lanes as a Job's pods would:
--lanes `bij-worker` processes (JOB_COMPLETION_INDEX 0..lanes-1), started together. Every
S3 request passes through a counting proxy (latency_proxy.py, no delay added), so the
counts are what the server saw, from every lane process.

Targets, at the largest shard count ÷ the smallest: S3 requests per shard <= 1.5, and wall
time per shard <= 1.5, measured between the first shard done and the last (so the lanes'
start-up, a second or two each, does not flatter the small counts). Reported: the round's
whole wall time per shard (first lane start to last lane exit). Checked: every shard done
and every row computed, from the lanes' own progress events. A round of 100 shards lasts
seconds, so counts under 300 run ceil(300 / count) times (before and after alternating) and
the median of each figure counts.

Anchor ("before"): commit ANCHOR_COMMIT, the last whose claim decisions listed the round,
its operator and worker trees taken from git and run whole on the same plans, in the same
run, at --anchor-shards only (default 100 and 1,000): at 10,000 shards each of its 10,000
decisions would list 20,000 objects, hours of listing.

The S3 server is moto's (ThreadedMotoServer, in this process) unless --endpoint names
another one (credentials from the AWS_* environment; the bucket is created if missing). moto
takes about 5 ms a request and scans every key of the bucket for each LIST, page after page:
there the defaults are 100 and 1,000 shards, the anchor at 100 only (at 1,000 shards its two
listings of up to 1,000 keys a decision take about a second each on moto). Give a real S3
server for the full range (`--endpoint`):

    python bench/many_shards.py [--rows 40000] [--shards 100,1000,10000] [--lanes 4]
                                [--anchor-shards 100,1000] [--no-anchor] [--endpoint URL]
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import harness
import yaml
from latency_proxy import LatencyProxy

TARGET = 1.5  # per-shard figures, largest shard count / smallest
ANCHOR_COMMIT = "af30f29"  # the last commit whose claim decisions listed every claim of the round
BUCKET = "bench-many-shards"
MIN_SHARD_BYTES = 1024  # the smallest targetShardBytes the spec allows
SMALL_ROUND_SHARDS = 300  # a count below this runs ceil(300 / count) times: 100 shards three times


@contextlib.contextmanager
def s3_server(endpoint: str | None) -> Iterator[str]:
    """An S3 endpoint: `endpoint` as given, or moto's server on a free port for the duration."""
    if endpoint:
        yield endpoint
        return
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log
    for k, v in {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                 "AWS_EC2_METADATA_DISABLED": "true"}.items():
        os.environ.setdefault(k, v)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


def anchor_tree(work: Path) -> Path | None:
    """ANCHOR_COMMIT's operator and worker packages under work/anchor; None without that commit."""
    dest = work / "anchor"
    dest.mkdir()
    archive = subprocess.run(["git", "-C", str(harness.REPO), "archive", ANCHOR_COMMIT, "operator", "worker"],
                             capture_output=True)
    if archive.returncode != 0:
        return None
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest


def texts_for(rows: int, max_shards: int) -> list[str]:
    """`rows` texts, long enough that the input cut into `max_shards` shards still has shards of at
    least MIN_SHARD_BYTES; prose from the demo corpus, cut or repeated to one length."""
    per_row = -(-MIN_SHARD_BYTES * max_shards * 105 // 100 // rows)
    length = max(16, per_row - 30)  # {"id": "doc-0000000", "text": ""} and a newline: about 30 bytes
    words = "offline batch inference on spot GPUs cuts a round into shards and lanes claim them ".split()
    out = []
    for i in range(rows):
        text = " ".join(words[(i + j) % len(words)] for j in range(length // 4 + 2))
        out.append(text[:length])
    return out


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__, rows=40_000, repeats=1)
    p.add_argument("--shards", default=None,
                   help="shard counts to cut the rows into, comma-separated (default 100,1000,10000; on moto "
                        "100,1000: it answers a request in about 5 ms and scans every key of the bucket for each "
                        "LIST, so 10,000 shards take it over ten minutes)")
    p.add_argument("--lanes", type=int, default=4, help="workers.parallelism: lane processes at once")
    p.add_argument("--anchor-shards", default=None,
                   help="shard counts the anchor runs at (default 100,1000; on moto 100: each of its decisions "
                        "lists the round: hours at 10,000 shards, and on moto over a quarter of an hour at 1,000)")
    p.add_argument("--no-anchor", action="store_true", help="skip the anchor")
    p.add_argument("--endpoint", default=None, help="an S3 endpoint to use instead of starting moto's server")
    args = harness.parse(p, argv)
    if args.shards is None:
        args.shards = "100,1000,10000" if args.endpoint else "100,1000"
    if args.anchor_shards is None:
        args.anchor_shards = "100,1000" if args.endpoint else "100"
    counts = sorted({int(x) for x in args.shards.split(",") if x})
    anchor_counts = [] if args.no_anchor else sorted({int(x) for x in args.anchor_shards.split(",") if x})
    anchor_counts = [n for n in anchor_counts if n in counts]

    from bij.contract import layout
    from bij.contract.spec import load_job
    from bij.steps.planner import plan_round

    report = harness.Report("many_shards")
    work = harness.work_dir("many-shards", args.keep)
    try:
        anchor = anchor_tree(work) if anchor_counts else None
        if anchor_counts and anchor is None:
            report.note(f"no anchor: commit {ANCHOR_COMMIT} is not in this checkout")
            anchor_counts = []
        here = Path(__file__).resolve().parents[1]
        trees = {"after": here, "before": anchor}
        with s3_server(args.endpoint) as endpoint:
            target = urlparse(endpoint)
            proxy = LatencyProxy((target.hostname or "127.0.0.1", target.port or 80), write_delay=0.0).start()
            os.environ.setdefault("AWS_REGION", os.environ.get("AWS_DEFAULT_REGION", "us-east-1"))
            region = os.environ["AWS_REGION"]
            import boto3

            s3 = boto3.client("s3", endpoint_url=endpoint, region_name=region)
            with contextlib.suppress(s3.exceptions.BucketAlreadyOwnedByYou, s3.exceptions.BucketAlreadyExists):
                s3.create_bucket(Bucket=BUCKET)
            texts = texts_for(args.rows, max(counts))
            local_input = work / "rows.jsonl"
            size = harness.write_rows(local_input, texts)
            run_id = secrets.token_hex(3)
            input_uri = f"s3://{BUCKET}/input-{run_id}/rows.jsonl"
            s3.upload_file(str(local_input), BUCKET, f"input-{run_id}/rows.jsonl")
            storage = {"s3": {"endpointUrl": proxy.url, "region": region}}
            print(f"many_shards: {args.rows:,} rows ({size:,} bytes) on S3 at {endpoint}, {args.lanes} lanes; "
                  f"shards {counts}, anchor ({ANCHOR_COMMIT}) at {anchor_counts}", flush=True)

            def run(side: str, shards: int, attempt: int) -> dict[str, Any]:
                """Plan round 0 of the rows cut into `shards` shards, run its lanes with `side`'s tree."""
                # A fresh job and output each time, also on a server that keeps what earlier runs wrote.
                name = f"bench-many-{side}-{shards}-{run_id}-{attempt}"
                spec = harness.write_spec(work / f"{name}.yaml", name, local_input, f"s3://{BUCKET}/{name}/",
                                          {"engine": "echo", "task": "generate"}, chunk_rows=512,
                                          shard_bytes=max(MIN_SHARD_BYTES, -(-size // shards)), storage=storage)
                doc = yaml.safe_load(spec.read_text())
                doc["spec"]["input"]["uri"] = input_uri
                doc["spec"]["sharding"].update(minShardBytes=MIN_SHARD_BYTES, shardsPerLane=1)
                doc["spec"]["workers"].update(parallelism=args.lanes)
                spec.write_text(yaml.safe_dump(doc, sort_keys=False))
                job = load_job(spec)
                plan = plan_round(job, 0)
                tree = trees[side]
                assert tree is not None
                env = {**os.environ, "AWS_ENDPOINT_URL": proxy.url, "BIJ_LOG_LEVEL": "WARNING",
                       "PYTHONPATH": os.pathsep.join([str(tree / "operator"), str(tree / "worker")])}
                cmd = [sys.executable, "-m", "bij.cli.worker", "--manifest", layout.round_manifest_uri(job, 0),
                       "--progress"]
                done: dict[int, int] = {}
                done_at: list[float] = []  # when each "done" event arrived, seconds since the start

                def lane(proc: subprocess.Popen[str]) -> None:
                    assert proc.stdout is not None
                    for line in proc.stdout:
                        with contextlib.suppress(ValueError):
                            ev = json.loads(line)
                            if ev.get("event") == "done":
                                done_at.append(time.perf_counter() - t0)
                                done[int(ev["index"])] = int(ev["rows"]) + int(ev["errors"])

                before = proxy.counts()
                errs = [tempfile.TemporaryFile() for _ in range(plan.lanes)]
                t0 = time.perf_counter()
                procs = [subprocess.Popen(cmd, env={**env, "JOB_COMPLETION_INDEX": str(i)}, text=True,
                                          stdout=subprocess.PIPE, stderr=errs[i], stdin=subprocess.DEVNULL)
                         for i in range(plan.lanes)]
                readers = [threading.Thread(target=lane, args=(proc,), daemon=True) for proc in procs]
                for reader in readers:
                    reader.start()
                errors = []
                for proc, err in zip(procs, errs, strict=True):
                    proc.wait()
                    if proc.returncode != 0:
                        err.seek(0)
                        errors.append(f"lane exited {proc.returncode}: {err.read().decode()[-2000:]}")
                    err.close()
                wall = time.perf_counter() - t0
                for reader in readers:
                    reader.join(10)
                after = proxy.counts()
                kinds = {k: after.get(k, 0) - before.get(k, 0) for k in sorted(set(after) | set(before))}
                requests = sum(kinds.values())
                if errors:
                    raise RuntimeError(f"{side} at {shards} shards: " + "\n".join(errors))
                complete = sorted(done) == list(range(plan.shard_count)) and sum(done.values()) == args.rows
                if not complete:
                    report.note(f"{side} at {shards} shards: {len(done)} of {plan.shard_count} shards reported "
                                f"done, {sum(done.values())} of {args.rows} rows")
                n = plan.shard_count
                # Between the first shard done and the last: lane start-up and exit left out.
                steady = (max(done_at) - min(done_at)) / (len(done_at) - 1) if len(done_at) > 1 else wall / n
                r = {"side": side, "shards": n, "lanes": plan.lanes, "wall_s": wall, "requests": requests,
                     "by_kind": kinds, "requests_per_shard": requests / n, "wall_per_shard_s": wall / n,
                     "steady_per_shard_s": steady, "complete": complete}
                print(f"  {side:6} {n:6,} shards: {wall:7.1f}s, {wall / n * 1000:6.1f} ms/shard "
                      f"({steady * 1000:.1f} after start-up); {requests:8,} S3 requests = {requests / n:6.2f}/shard ("
                      + ", ".join(f"{k} {v / n:.2f}" for k, v in kinds.items() if v) + ")"
                      + ("" if complete else "  INCOMPLETE"), flush=True)
                return r

            runs: dict[str, dict[int, list[dict[str, Any]]]] = {"after": {}, "before": {}}
            for shards in counts:
                # A round of a few hundred shards lasts seconds, and load from other processes moves
                # its figures: small counts run a few times (anchor and candidate alternating), the
                # median counts.
                repeats = max(args.repeats, -(-SMALL_ROUND_SHARDS // shards))
                for attempt in range(repeats):
                    if shards in anchor_counts:
                        runs["before"].setdefault(shards, []).append(run("before", shards, attempt))
                    runs["after"].setdefault(shards, []).append(run("after", shards, attempt))
            proxy.stop()
        results: dict[str, dict[int, dict[str, Any]]] = {"after": {}, "before": {}}
        for side, by_count in runs.items():
            for shards, rs in by_count.items():
                med = {k: harness.median(r[k] for r in rs) for k in
                       ("wall_s", "requests", "requests_per_shard", "wall_per_shard_s", "steady_per_shard_s")}
                results[side][shards] = {**rs[0], **med, "complete": all(r["complete"] for r in rs),
                                         "runs": rs}

        report.details.update(rows=args.rows, bytes=size, lanes=args.lanes, endpoint=args.endpoint or "moto",
                              anchor_commit=ANCHOR_COMMIT, results=results)
        after, before = results["after"], results["before"]

        def flat(side: dict[int, dict[str, Any]], label: str, target: float | None) -> None:
            lo, hi = min(side), max(side)
            if lo == hi:
                return
            for key, what, unit in (("requests_per_shard", "S3 requests per shard", 1),
                                    ("steady_per_shard_s", "wall time per shard", 1000),
                                    ("wall_per_shard_s", "round wall time per shard (start-up in)", 1000)):
                report.ratio(f"{label}{what}, {hi:,} / {lo:,} shards", side[hi][key] / side[lo][key],
                             None if key == "wall_per_shard_s" else target, higher_is_better=False,
                             note=f"{side[lo][key] * unit:.2f} vs {side[hi][key] * unit:.2f}"
                                  + (" ms" if unit != 1 else ""))

        flat(after, "", TARGET)
        if len(before) >= 2:
            flat(before, "before: ", None)
        for shards in sorted(before):
            report.ratio(f"S3 requests at {shards:,} shards: after / before", after[shards]["requests"]
                         / before[shards]["requests"], None,
                         note=f"{before[shards]['requests']:,.0f} before, {after[shards]['requests']:,.0f} after")
            report.ratio(f"wall time at {shards:,} shards: after / before", after[shards]["wall_s"]
                         / before[shards]["wall_s"], None,
                         note=f"{before[shards]['wall_s']:.1f}s before, {after[shards]['wall_s']:.1f}s after")
        ok = all(r["complete"] for side in results.values() for r in side.values())
        report.ratio("every shard and row done (1 = yes)", float(ok), 1.0)
    finally:
        harness.cleanup(work, args.keep)
    report.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
