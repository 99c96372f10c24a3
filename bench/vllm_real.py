"""bij against raw vLLM on the real engine (vLLM's CPU build, .venv-vllm): output tokens/s, bij / raw.

The same prompts (mixed lengths, one group in four sharing a long prefix) go through
`LLM.generate` alone and through bij's worker with the vLLM engine, durable commits on (an
fsynced zstd frame per chunk). Both sides build the LLM from the same spec (the worker's
own `shared_llm`), decode greedily and so generate the same tokens; each side's clock
starts once its model is loaded (raw: around `LLM.generate`; bij: the shard's own
`seconds`, from its start to its completion record, every row durable). Sides alternate
(raw bij raw bij ...) so that load from other processes hits both. Target: ratio >= 0.95.

Also, on the real engine: the time to the first durable commit (from the model loaded),
and rows computed twice after kill -9 at a random moment (a child wraps the real engine
to log each row it finishes, no hook in the worker), against the bound the worker
promises: the in-flight window plus the commit queue.

The model is the suite's tiny random Llama (tests/tiny_models.py, built here, nothing
downloaded). Run in .venv-vllm:

    .venv-vllm/bin/python bench/vllm_real.py [--rows 2000] [--max-tokens 48] [--repeats 1] [--kills 2]
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import harness

sys.path.insert(0, str(harness.REPO / "tests"))

TARGET = 0.95
MAX_MODEL_LEN = 512
PREFIX_WORDS = 160  # the shared prefix: one KV block of 128 and more
WORDS = ["a", "b", "c", "d", "e", "f", "g", "h", "x", "y", "z"]


def prompts(rows: int, seed: int = 0) -> list[str]:
    """Unique prompts of mixed lengths (4 to 300 words); every fourth starts with the same long prefix."""
    rng = random.Random(seed)
    prefix = " ".join(rng.choice(WORDS) for _ in range(PREFIX_WORDS))
    out = []
    for i in range(rows):
        # 12 random words make each prompt unique (the kill counts rows by their text).
        tail = " ".join(rng.choice(WORDS) for _ in range(12))
        if i % 4 == 0:
            out.append(f"{prefix} {tail}")
            continue
        n = rng.choice([4, 8, 16, 32, 64, 128, 300])
        out.append(" ".join(rng.choice(WORDS) for _ in range(n)) + " " + tail)
    return out


def key(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def model_section(model: Path, args: Any) -> dict[str, Any]:
    return {"engine": "vllm", "name": str(model), "task": "generate", "maxTokens": args.max_tokens,
            "temperature": 0.0,
            "vllm": {"maxModelLen": MAX_MODEL_LEN, "maxNumSeqs": args.max_num_seqs, "enablePrefixCaching": True,
                     "gpuMemoryUtilization": args.gpu_memory_utilization, "enforceEager": True}}


def engine_config(section: dict[str, Any]) -> Any:
    from bij.contract.spec_model import ModelSpec
    from bij.engines.base import EngineConfig

    m = ModelSpec.model_validate(section)
    return EngineConfig(task=m.task, name=m.name, max_tokens=m.max_tokens, temperature=m.temperature, seed=m.seed,
                        vllm=m.vllm.model_dump(mode="json", by_alias=True, exclude_none=True))


def raw_child(section_json: str, prompts_path: str) -> int:
    """A child process: load the LLM as the worker does, time one `LLM.generate` on every prompt."""
    from vllm import SamplingParams

    from bij.engines.vllm_llm import shared_llm

    section = json.loads(section_json)
    texts = json.loads(Path(prompts_path).read_text())
    t0 = time.perf_counter()
    llm = shared_llm(engine_config(section))
    load_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=section["maxTokens"], temperature=0.0)
    t0 = time.perf_counter()
    outs = llm.generate(texts, params, use_tqdm=False)
    gen_s = time.perf_counter() - t0
    print(json.dumps({"load_s": load_s, "generate_s": gen_s, "rows": len(outs),
                      "tokens_in": sum(len(o.prompt_token_ids) for o in outs),
                      "tokens_out": sum(len(o.outputs[0].token_ids) for o in outs),
                      "cached_tokens": sum(o.num_cached_tokens or 0 for o in outs)}))
    return 0


def counting_worker(side_file: str, worker_argv: list[str]) -> int:
    """A child: the real worker main, its vLLM engine logging each row it finishes (one write per step)."""
    import bij.engines as engines
    import bij.worker.main as worker_main
    from bij.engines.base import EngineConfig, Request, Result
    from bij.engines.vllm import VllmEngine

    fd = os.open(side_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    class Counting(VllmEngine):
        texts: dict[int, str] = {}

        def submit(self, tag: int, request: Request) -> None:
            super().submit(tag, request)
            self.texts[tag] = request.text or ""

        def step(self) -> list[tuple[int, Result]]:
            done = super().step()
            if done:
                os.write(fd, "".join(key(self.texts.pop(t)) + "\n" for t, _ in done).encode())
            return done

    def create_engine(name: str, config: EngineConfig) -> Any:
        return Counting(config)

    engines.create_engine = create_engine  # type: ignore[assignment]
    worker_main.create_engine = create_engine  # type: ignore[assignment]
    return worker_main.main(worker_argv)


def run_raw(work: Path, section: dict[str, Any], texts_path: Path) -> dict[str, Any]:
    """`LLM.generate` on every prompt, in a child process (the accelerator is free again after it)."""
    proc = subprocess.run([sys.executable, __file__, "--raw-child", json.dumps(section), str(texts_path)],
                          stdout=subprocess.PIPE, text=True, check=True)
    r: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    r["tokens_out_s"] = r["tokens_out"] / r["generate_s"]
    print(f"  raw LLM.generate: load {r['load_s']:.1f}s, generate {r['generate_s']:.1f}s, "
          f"{r['tokens_out']} tokens out, {r['tokens_out_s']:.0f} out tok/s", flush=True)
    return r


def run_bij(work: Path, section: dict[str, Any], input_path: Path, chunk_rows: int, batching: dict[str, Any],
            command: list[str] | None = None, kill_after: Any = None,
            env: dict[str, str] | None = None) -> dict[str, Any]:
    """Plan a one-shard job on the prompts and run one worker on it (its progress events timed)."""
    out = work / f"out-{time.monotonic_ns()}"
    spec = harness.write_spec(work / "spec.yaml", "bench-vllm", input_path, out, section, chunk_rows,
                              batching=batching)
    manifest, shards = harness.plan(spec)
    assert shards == 1, shards
    return {"out": out, "manifest": manifest, "run": harness.run_worker(manifest, command=command, env=env,
                                                                         kill_after=kill_after)}


def bij_timed(work: Path, section: dict[str, Any], input_path: Path, chunk_rows: int, batching: dict[str, Any],
              keep: bool) -> dict[str, Any]:
    """The worker's output tokens/s over its shard's own time (model load excluded), every row durable."""
    b = run_bij(work, section, input_path, chunk_rows, batching)
    run = b["run"]
    if run.rc != 0:
        raise RuntimeError(f"the worker exited {run.rc}")
    (rec,) = harness.done_records(b["out"])
    steady = harness.steady_seconds(rec, run.wall_s)
    loaded = run.at("loaded") or run.at("resume") or 0.0
    first = run.at("chunk")
    r = {"steady_s": steady, "load_s": rec["modelLoadSeconds"], "model_loads": rec.get("modelLoads"),
         "tokens_out": rec["tokensOut"], "rows": rec["rows"], "errors": rec["errors"],
         "cached_tokens": rec.get("cachedTokens"), "occupancy": rec.get("meanOccupancy"),
         "busy_s": rec.get("engineBusySeconds"), "wall_s": run.wall_s,
         "first_commit_s": (first - loaded) if first is not None else None}
    r["tokens_out_s"] = r["tokens_out"] / steady
    print(f"  bij worker:       load {r['load_s']:.1f}s, shard {steady:.1f}s, {r['tokens_out']} tokens out, "
          f"{r['tokens_out_s']:.0f} out tok/s, first commit {r['first_commit_s']:.2f}s after the load, "
          f"occupancy {r['occupancy']}, cached tokens {r['cached_tokens']}", flush=True)
    harness.cleanup(b["out"], keep)
    return r


def compare(work: Path, section: dict[str, Any], input_path: Path, chunk_rows: int, batching: dict[str, Any],
            repeats: int, keep: bool = False) -> dict[str, list[dict[str, Any]]]:
    """Raw `LLM.generate` and the bij worker on the same prompts, alternating, `repeats` times each."""
    texts_path = work / "prompts.json"
    texts_path.write_text(json.dumps([json.loads(line)["text"] for line in input_path.read_text().splitlines()]))
    return harness.interleave(
        repeats, raw=lambda _: run_raw(work, section, texts_path),
        bij=lambda _: bij_timed(work, section, input_path, chunk_rows, batching, keep))


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--raw-child":
        return raw_child(sys.argv[2], sys.argv[3])
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--counting-worker":
        return counting_worker(sys.argv[2], sys.argv[3:])
    p = harness.parser(__doc__, rows=2000, repeats=1)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.15,
                   help="on vLLM's CPU build, the share of host memory for the model and its KV cache")
    p.add_argument("--chunk-rows", type=int, default=256)
    p.add_argument("--kills", type=int, default=2, help="kill -9 trials (default 2)")
    p.add_argument("--seed", type=int, default=None, help="random seed for kill times (default: random)")
    args = harness.parse(p, argv)
    try:
        import vllm
    except ImportError:
        print("vllm_real: vLLM is not installed here; run it in .venv-vllm (make vllm-env)", file=sys.stderr)
        return 2
    from tiny_models import build_model

    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    report = harness.Report("vllm_real")
    work = harness.work_dir("vllm-real", args.keep)
    env = {"BIJ_LOG_LEVEL": "WARNING", "VLLM_LOGGING_LEVEL": "WARNING", "VLLM_LOGGING_STREAM": "ext://sys.stderr"}
    os.environ.update(env)
    try:
        model = build_model(work / "model", wired=False, max_positions=MAX_MODEL_LEN)
        section = model_section(model, args)
        texts = prompts(args.rows)
        input_path = work / "input" / "rows.jsonl"
        harness.write_rows(input_path, texts)
        window = 8 * args.max_num_seqs  # the worker's default inFlightRows for this engine
        queue = 4
        batching = {"inFlightRows": window, "commitQueueChunks": queue}
        words = sum(len(t.split()) for t in texts)
        print(f"vllm_real: vllm {vllm.__version__}, tiny random Llama (hidden 128, 1 layer, vocab 15, "
              f"{MAX_MODEL_LEN} positions), {args.rows} prompts ({words / args.rows:.0f} words on average, "
              f"one in four with a {PREFIX_WORDS}-word shared prefix), maxTokens {args.max_tokens}, "
              f"maxNumSeqs {args.max_num_seqs}, chunkRows {args.chunk_rows}", flush=True)

        runs = compare(work, section, input_path, args.chunk_rows, batching, args.repeats, args.keep)
        raw_s = harness.median(r["tokens_out_s"] for r in runs["raw"])
        bij_s = harness.median(r["tokens_out_s"] for r in runs["bij"])
        if any(r["tokens_out"] != runs["raw"][0]["tokens_out"] or r["rows"] != args.rows for r in runs["bij"]):
            report.note("bij and raw vLLM did not generate the same tokens: "
                        f"{[r['tokens_out'] for r in runs['raw']]} vs {[r['tokens_out'] for r in runs['bij']]}")
        report.ratio("output tokens/s, bij worker (durable commits) / raw LLM.generate", bij_s / raw_s, TARGET,
                     note=f"{bij_s:.0f} vs {raw_s:.0f} out tok/s, medians of {args.repeats}")
        first_commit = harness.median(r["first_commit_s"] for r in runs["bij"])
        report.ratio("time to first commit after the model load, seconds", first_commit, None)
        report.details.update(rows=args.rows, max_tokens=args.max_tokens, max_num_seqs=args.max_num_seqs,
                              vllm=vllm.__version__, raw=runs["raw"], bij=runs["bij"], seed=seed)

        # kill -9 on the real engine: rows the engine finished twice, against the worker's bound.
        expected_s = harness.median(r["steady_s"] for r in runs["bij"])
        trials = []
        for k in range(args.kills):
            side = work / f"computed-{k}.txt"
            cmd = [sys.executable, __file__, "--counting-worker", str(side)]
            after = rng.uniform(0.1 * expected_s, 0.9 * expected_s)
            # The engine in the worker's process: kill -9 of the worker is then kill -9 of the engine, as a
            # node loss or a pod kill takes the whole container (vLLM's engine-core child would outlive it).
            in_process = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
            b = run_bij(work, section, input_path, args.chunk_rows, batching, command=cmd,
                        kill_after=lambda after=after: after, env=in_process)
            second = harness.run_worker(b["manifest"], command=cmd, env=in_process) if b["run"].rc != 0 else None
            if second is not None and second.rc != 0:
                raise RuntimeError(f"kill trial {k}: the rerun exited {second.rc}")
            computed = [x for x in side.read_text().splitlines() if x]
            records, places = harness.log_places(b["out"])
            if len(set(computed)) != args.rows or places != args.rows or records != args.rows:
                raise RuntimeError(f"kill trial {k}: rows lost or repeated: computed {len(computed)} "
                                   f"({len(set(computed))} distinct), log {records} records, {places} places")
            t = {"killed": b["run"].rc == -9, "after_s": after,
                 "recomputed": len(computed) - len(set(computed))}
            trials.append(t)
            print(f"  kill {k}: {'killed' if t['killed'] else 'finished first'} at {t['after_s']:.1f}s, "
                  f"{t['recomputed']} rows computed twice", flush=True)
            harness.cleanup(b["out"], args.keep)
        killed = [t for t in trials if t["killed"]]
        bound = window + queue * args.chunk_rows
        if killed:
            worst = max(t["recomputed"] for t in killed)
            report.ratio("max rows recomputed per kill -9 / (inFlightRows + commitQueueChunks x chunkRows)",
                         worst / bound, 1.0, higher_is_better=False,
                         note=f"max {worst} over {len(killed)} kills; bound {window} + {queue} x {args.chunk_rows}")
        elif args.kills:
            report.note("no kill landed mid-work")
        report.details.update(kills=trials, recompute_bound=bound)
    finally:
        harness.cleanup(work, args.keep)
    report.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
