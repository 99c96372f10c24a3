"""Length sorting: worker rows/s with spec.batching.sortByLength true ÷ false, same texts.

Both sides are `bij run` of the same job (engine sentence-transformers, one shard, one
worker, the demo's batching: chunkRows 512, targetBatchTokens 16384, maxBatchSize 128)
over the demo corpus (real prose of mixed lengths), differing only in sortByLength.
Throughput is the steady state (rows / the worker's time on its shard, from its
completion record, after the model load). Target: sorted / unsorted >= 1.5.

Why "off" stays unsorted although `SentenceTransformer.encode` sorts by length itself:
the sentence-transformers engine passes each worker batch to `model.encode` with
`batch_size=len(batch)`, so encode's own sort only reorders rows inside one forward pass
that is padded to that batch's longest row anyway. The worker's batches — cut in input
order when sorting is off — are what the model sees. This is checked at run time below
with a stand-in model that records each encode call.

The expected gain is printed too: padded tokens (rows x longest row, per batch) of the
worker's batches with and without sorting, from the worker's own batch planner.

    python bench/sorting.py [--rows 300] [--repeats 2]
"""

from __future__ import annotations

import sys
from typing import Any

import harness

TARGET = 1.5
BATCHING = {"targetBatchTokens": 16384, "maxBatchSize": 128}


def padded_tokens(counts: list[int], chunk_rows: int, sort: bool) -> int:
    """Tokens the model processes, padding included, for the worker's batches of these rows."""
    from bij.worker.batcher import plan_batches

    total = 0
    for start in range(0, len(counts), chunk_rows):
        chunk = counts[start:start + chunk_rows]
        for batch in plan_batches(chunk, BATCHING["targetBatchTokens"], BATCHING["maxBatchSize"], sort):
            total += len(batch) * max(chunk[i] for i in batch)
    return total


def engine_keeps_batches() -> tuple[bool, str]:
    """Does the engine hand each worker batch to model.encode as one batch? (A stand-in model records it.)"""
    try:
        from bij.engines.base import EngineConfig, Request
        from bij.engines.sentence_transformers import SentenceTransformersEngine

        calls: list[tuple[int, int]] = []

        class Matrix(list[list[float]]):
            def tolist(self) -> list[list[float]]:
                return list(self)

        class SpyModel:
            def encode(self, sentences: list[str], batch_size: int = 32, **kw: Any) -> Matrix:
                calls.append((len(sentences), batch_size))
                return Matrix([[0.0] for _ in sentences])

        engine = SentenceTransformersEngine(EngineConfig(task="embed"))
        engine.model = SpyModel()
        engine.tokenizer = lambda texts, **kw: {"input_ids": [[0] * len(t.split()) for t in texts]}
        batch = [Request(text=" ".join(["word"] * n)) for n in (30, 2, 17, 5, 9, 1, 25)]
        engine.run(batch)
    except Exception as e:  # noqa: BLE001 - a report, not a test: say what could not be checked
        return False, f"could not check the engine with a stand-in model ({type(e).__name__}: {e})"
    if calls and all(bs >= n for n, bs in calls) and sum(n for n, _ in calls) == len(batch):
        return True, (f"checked: a worker batch of {len(batch)} rows reached model.encode as "
                      f"{len(calls)} call(s) with batch_size >= its rows {calls}, so encode's own length "
                      "sort only reorders rows inside one padded forward pass; with sortByLength false the "
                      "model sees the worker's unsorted batches")
    return False, (f"a worker batch of {len(batch)} rows reached model.encode as {calls} (rows, batch_size): "
                   "encode may re-sort and re-cut it, so 'off' is partly sorted and the ratio understates sorting")


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__, rows=300, repeats=2)
    p.add_argument("--chunk-rows", type=int, default=512, help="spec.sharding.chunkRows")
    args = harness.parse(p, argv)

    report = harness.Report("sorting")
    ok, why = engine_keeps_batches()
    report.note(why)
    report.details["engine_keeps_batches"] = ok
    work = harness.work_dir("sorting", args.keep)
    try:
        texts, counts = harness.embeddable_texts(work, args.rows)
        input_path = work / "input" / "rows.jsonl"
        harness.write_rows(input_path, texts)
        pad_on = padded_tokens(counts, args.chunk_rows, True)
        pad_off = padded_tokens(counts, args.chunk_rows, False)
        print(f"sorting: {len(texts)} rows, {sum(counts)} tokens ({min(counts)}..{max(counts)} a row); "
              f"padded tokens sorted {pad_on}, unsorted {pad_off} ({pad_off / pad_on:.2f}x)", flush=True)
        report.details.update(rows=len(texts), tokens=sum(counts), padded_tokens_sorted=pad_on,
                              padded_tokens_unsorted=pad_off)
        model = {"engine": "sentence-transformers", "task": "embed"}
        warm = work / "warm" / "rows.jsonl"
        harness.write_rows(warm, texts[:32])
        harness.run_bij(harness.write_spec(work / "warm.yaml", "bench-sort-warm", warm, work / "out-warm",
                                           model, args.chunk_rows, BATCHING))

        def side(sort: bool) -> Any:
            def run(i: int) -> dict[str, float]:
                name = "on" if sort else "off"
                out = work / f"out-{name}-{i}"
                spec = harness.write_spec(work / f"spec-{name}-{i}.yaml", "bench-sort", input_path, out, model,
                                          args.chunk_rows, {**BATCHING, "sortByLength": sort})
                wall = harness.run_bij(spec)
                (rec,) = harness.done_records(out)
                if rec["rows"] != len(texts):
                    raise RuntimeError(f"sortByLength {sort}: {rec['rows']} rows done, expected {len(texts)}")
                steady = harness.steady_seconds(rec, wall)
                print(f"  sortByLength {str(sort).lower():5}  wall {wall:6.1f}s  steady {steady:6.1f}s  "
                      f"{rec.get('batches', 0):3} batches  {len(texts) / steady:7.1f} rows/s", flush=True)
                return {"wall_s": wall, "steady_s": steady, "batches": rec.get("batches", 0)}
            return run

        runs = harness.interleave(args.repeats, off=side(False), on=side(True))
        on_s = harness.median(r["steady_s"] for r in runs["on"])
        off_s = harness.median(r["steady_s"] for r in runs["off"])
        report.details["runs"] = runs
        report.ratio("sorted/unsorted rows/s", off_s / on_s, TARGET,
                     note=f"padding alone predicts {pad_off / pad_on:.2f}x")
        report.ratio("sorted/unsorted rows/s end to end",
                     harness.median(r["wall_s"] for r in runs["off"]) / harness.median(r["wall_s"] for r in runs["on"]),
                     None, note="bij run wall times, start-up included")
    finally:
        harness.cleanup(work, args.keep)
    report.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
