"""Keeping a continuous-batching engine full: `bij run` time ÷ the ideal, with the simulated engine.

The simulated engine (model.engine: simulated) runs at most maxNumSeqs sequences, one
word per step of stepSeconds. The ideal is every step full: total generated words /
maxNumSeqs x stepSeconds. The candidate is `bij run` over mixed-length rows in small
chunks (one shard, one worker), timed by the worker's completion record (its clock
starts after the model load: start-up is excluded), with its output

- on file:// — target <= 1.15 x ideal;
- on s3:// (versitygw, the tests' S3 server, when `make s3-bin` built it; moto otherwise)
  behind a proxy that adds --write-delay (default 100 ms) to every write request, so every
  segment commit is slow — target <= 1.2 x ideal.

Also reported: the same against a measured anchor (the simulated engine driven bare, in
this process, every row submitted at once, so only the shard's own tail keeps a step from
being full), and the worker's mean occupancy and step count.

    python bench/simulated.py [--rows 3000] [--repeats 2] [--max-num-seqs 64] [--step-seconds 0.02]
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import harness

sys.path.insert(0, str(harness.REPO / "tests"))  # the tests' S3 server (s3server)

TARGET_FILE = 1.15
TARGET_S3 = 1.2


def mixed_rows(n: int, max_words: int, seed: int = 5) -> list[str]:
    """Texts of mixed length: most short, some medium, a few as long as max_words."""
    rnd = random.Random(seed)
    vocab = [f"w{i}" for i in range(500)]
    texts = []
    for _ in range(n):
        r = rnd.random()
        words = rnd.randint(1, 8) if r < 0.5 else rnd.randint(9, max_words // 3) if r < 0.85 else \
            rnd.randint(max_words // 3, max_words)
        texts.append(" ".join(rnd.choice(vocab) for _ in range(words)))
    return texts


def bare_engine_seconds(texts: list[str], max_num_seqs: int, step_seconds: float, max_tokens: int) -> float:
    """The anchor: every request submitted at once to the simulated engine, stepped until all are back."""
    from bij.engines import EngineConfig, create_engine
    from bij.engines.base import Request

    engine: Any = create_engine("simulated", EngineConfig(task="generate", max_tokens=max_tokens, simulated={
        "maxNumSeqs": max_num_seqs, "stepSeconds": step_seconds}))
    t0 = time.perf_counter()
    for i, t in enumerate(texts):
        engine.submit(i, Request(text=t, max_tokens=max_tokens))
    while engine.unfinished():
        engine.step()
    return time.perf_counter() - t0


def done_record(out_uri: str, s3: dict[str, Any] | None) -> dict[str, Any]:
    from bij.storage import open_storage

    store = open_storage(out_uri, s3)
    (obj,) = [o for o in store.list(out_uri + "_bij/") if "/done/" in o.uri]
    return dict(json.loads(store.read_bytes(obj.uri)))


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__, rows=3000, repeats=2)
    p.add_argument("--chunk-rows", type=int, default=32, help="spec.sharding.chunkRows (small chunks)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--step-seconds", type=float, default=0.02)
    p.add_argument("--max-words", type=int, default=64, help="longest row, in words (= generated tokens)")
    p.add_argument("--write-delay", type=float, default=0.1, help="seconds the proxy adds to every S3 write")
    p.add_argument("--in-flight-rows", type=int, default=None,
                   help="spec.batching.inFlightRows (default: the worker's)")
    args = harness.parse(p, argv)

    report = harness.Report("simulated")
    work = harness.work_dir("simulated", args.keep)
    moto = proxy = server = None
    try:
        import logging
        import os

        import s3server
        from latency_proxy import LatencyProxy

        exe = s3server.binary()
        if exe is not None:
            server = s3server.S3Server(exe, work / "s3")
            server.start()
            os.environ.update(server.root.env())
            port = int(server.endpoint.rsplit(":", 1)[1])
            s3_server = f"versitygw {s3server.VERSION}"
        else:
            from moto.server import ThreadedMotoServer

            logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log
            os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench"})
            port = s3server.free_port()
            moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
            moto.start()
            s3_server = "moto (versitygw not built: make s3-bin)"
        os.environ.update({"AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1",
                           "AWS_EC2_METADATA_DISABLED": "true"})
        os.environ.pop("AWS_ENDPOINT_URL", None)
        proxy = LatencyProxy(("127.0.0.1", port), args.write_delay).start()
        import boto3

        boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}").create_bucket(Bucket="bench")
        s3 = {"s3": {"endpointUrl": proxy.url, "region": "us-east-1"}}

        texts = mixed_rows(args.rows, args.max_words)
        words = sum(min(len(t.split()), args.max_words) for t in texts)
        ideal = words / args.max_num_seqs * args.step_seconds
        input_path = work / "input" / "rows.jsonl"
        harness.write_rows(input_path, texts)
        model = {"engine": "simulated", "task": "generate", "maxTokens": args.max_words,
                 "simulated": {"maxNumSeqs": args.max_num_seqs, "stepSeconds": args.step_seconds}}
        print(f"simulated: {args.rows} rows, {words} words to generate, maxNumSeqs {args.max_num_seqs}, "
              f"step {args.step_seconds * 1000:.0f} ms, chunkRows {args.chunk_rows}: ideal {ideal:.2f}s",
              flush=True)

        def candidate(where: str, i: int) -> dict[str, float]:
            if where == "file":
                out: Path | str = work / f"out-{where}-{i}"
                out_uri = Path(out).resolve().as_uri() + "/"
                storage = None
            else:
                out = out_uri = f"s3://bench/run-{i}-{time.monotonic_ns()}/"
                storage = s3
            batching = {"inFlightRows": args.in_flight_rows} if args.in_flight_rows else {}
            spec = harness.write_spec(work / f"spec-{where}-{i}.yaml", f"bench-sim-{where}", input_path, out, model,
                                      args.chunk_rows, batching=batching, storage=storage)
            delayed = proxy.delayed  # type: ignore[union-attr]
            wall = harness.run_bij(spec)
            rec = done_record(out_uri, storage["s3"] if storage else None)
            if rec["rows"] != args.rows:
                raise RuntimeError(f"bij did {rec['rows']} rows, expected {args.rows}")
            r = {"seconds": float(rec["seconds"]), "wall_s": wall, "occupancy": float(rec["meanOccupancy"]),
                 "steps": int(rec["engineSteps"]), "delayed_writes": proxy.delayed - delayed}  # type: ignore[union-attr]
            print(f"  bij run {where:4}  {r['seconds']:6.2f}s = {r['seconds'] / ideal:5.3f} x ideal  "
                  f"(occupancy {r['occupancy']:.3f}, {r['steps']} steps, process {wall:.1f}s"
                  + (f", {r['delayed_writes']} slow writes" if where == "s3" else "") + ")", flush=True)
            return r

        def anchor(i: int) -> dict[str, float]:
            s = bare_engine_seconds(texts, args.max_num_seqs, args.step_seconds, args.max_words)
            print(f"  bare engine    {s:6.2f}s = {s / ideal:5.3f} x ideal", flush=True)
            return {"seconds": s}

        runs = harness.interleave(args.repeats, anchor=anchor, file=lambda i: candidate("file", i),
                                  s3=lambda i: candidate("s3", i))
        bare = harness.median(r["seconds"] for r in runs["anchor"])
        on_file = harness.median(r["seconds"] for r in runs["file"])
        on_s3 = harness.median(r["seconds"] for r in runs["s3"])
        report.details.update(rows=args.rows, words=words, ideal_s=ideal, runs=runs, max_num_seqs=args.max_num_seqs,
                              step_seconds=args.step_seconds, chunk_rows=args.chunk_rows,
                              write_delay=args.write_delay)
        report.ratio("bij run (file) / ideal", on_file / ideal, TARGET_FILE, higher_is_better=False,
                     note="completion-record seconds (after model load) / every step full")
        report.ratio(f"bij run (s3, +{args.write_delay * 1000:.0f} ms a write) / ideal", on_s3 / ideal, TARGET_S3,
                     higher_is_better=False, note=f"{s3_server} behind a latency proxy")
        report.ratio("bare engine / ideal", bare / ideal, None, note="the shard's tail and sleep overshoot alone")
        report.ratio("bij run (file) / bare engine", on_file / bare, None)
        report.ratio("bij mean occupancy", harness.median(r["occupancy"] for r in runs["file"]), None)
    finally:
        if proxy is not None:
            proxy.stop()
        if moto is not None:
            moto.stop()
        if server is not None:
            server.stop()
        harness.cleanup(work, args.keep)
    report.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
