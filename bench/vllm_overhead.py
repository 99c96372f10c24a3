"""What the bij pipeline costs on top of raw vLLM: worker rows/s ÷ `LLM.generate` rows/s.

Needs one CUDA GPU and vllm. Both sides get the same synthetic prompts, the same
`LLM(...)` arguments (the spec's vLLM defaults, built by the engine's own code) and
greedy decoding, so they generate the same tokens:

1. raw: in a child process, build the LLM (timed apart) and call `LLM.generate` once
   on every prompt;
2. bij: write the prompts as JSONL and a BatchInferenceJob (engine vllm, task
   generate, file:// input and output), time `bij run spec.yaml --parallelism 1`.

The worker's steady state is its wall time minus the model load time it records in its
shard completion record (`modelLoadSeconds`); without that record the end-to-end time is
used and said so. Target: ratio >= 0.95.

    python bench/vllm_overhead.py --model Qwen/Qwen2.5-0.5B-Instruct --rows 2000 --max-tokens 128
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TARGET = 0.95
WORDS = (
    "the of and to in is was for on that with as by at from this be are it an or which have not "
    "model batch token queue shard worker round judge output input spot node cluster retry resume "
    "latency throughput memory cache prefix kernel tensor schedule request answer summary"
).split()


def synthetic_prompts(rows: int, min_words: int, max_words: int, seed: int = 0) -> list[str]:
    """Deterministic prompts of varied length (uniform in words), each asking for a continuation."""
    rng = random.Random(seed)
    out = []
    for i in range(rows):
        body = " ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words)))
        out.append(f"Document {i}: {body}\nSummarise the document above in plain words:")
    return out


def engine_config(args: argparse.Namespace) -> Any:
    """The EngineConfig the worker builds from the spec this benchmark writes."""
    from bij.contract.spec_model import ModelSpec
    from bij.engines.base import EngineConfig

    model = ModelSpec.model_validate(model_section(args))
    return EngineConfig(
        task=model.task, name=model.name, max_tokens=model.max_tokens, temperature=model.temperature,
        seed=model.seed, max_input_tokens=model.max_input_tokens,
        vllm=model.vllm.model_dump(by_alias=True, exclude_none=True),
    )


def model_section(args: argparse.Namespace) -> dict[str, Any]:
    """spec.model of the benchmark job (camelCase, as in the YAML)."""
    vllm: dict[str, Any] = {}
    if args.max_model_len:
        vllm["maxModelLen"] = args.max_model_len
    if args.gpu_memory_utilization:
        vllm["gpuMemoryUtilization"] = args.gpu_memory_utilization
    return {"engine": "vllm", "name": args.model, "task": "generate", "maxTokens": args.max_tokens,
            "temperature": 0.0, "vllm": vllm}


def raw_child(args: argparse.Namespace) -> None:
    """Runs in a child process: print one JSON line with the raw vLLM timings."""
    from vllm import SamplingParams

    from bij.engines.vllm_llm import shared_llm

    prompts = synthetic_prompts(args.rows, args.min_words, args.max_words)
    t0 = time.perf_counter()
    llm = shared_llm(engine_config(args))
    load_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    gen_s = time.perf_counter() - t0
    print(json.dumps({
        "load_s": load_s, "generate_s": gen_s, "rows": len(outs),
        "tokens_in": sum(len(o.prompt_token_ids) for o in outs),
        "tokens_out": sum(len(o.outputs[0].token_ids) for o in outs),
    }))


def run_raw(args: argparse.Namespace) -> dict[str, Any]:
    """The raw measurement, in its own process so that the GPU is free again for the worker."""
    cmd = [sys.executable, __file__, "--raw-child", "--model", args.model, "--rows", str(args.rows),
           "--max-tokens", str(args.max_tokens), "--min-words", str(args.min_words),
           "--max-words", str(args.max_words)]
    if args.max_model_len:
        cmd += ["--max-model-len", str(args.max_model_len)]
    if args.gpu_memory_utilization:
        cmd += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def write_job(workdir: Path, args: argparse.Namespace) -> Path:
    """The input JSONL and the BatchInferenceJob YAML; returns the spec path."""
    import yaml

    (workdir / "input").mkdir(parents=True)
    with open(workdir / "input" / "prompts.jsonl", "w") as f:
        for i, text in enumerate(synthetic_prompts(args.rows, args.min_words, args.max_words)):
            f.write(json.dumps({"id": i, "text": text}) + "\n")
    job = {
        "apiVersion": "batchinference.io/v1alpha1",
        "kind": "BatchInferenceJob",
        "metadata": {"name": "vllm-overhead"},
        "spec": {
            "input": {"uri": (workdir / "input").as_uri() + "/", "format": "jsonl"},
            "output": {"uri": (workdir / "output").as_uri() + "/"},
            "model": model_section(args),
            "sharding": {"chunkRows": args.chunk_rows},
            "workers": {"parallelism": 1, "gpus": 1},
        },
    }
    spec = workdir / "spec.yaml"
    spec.write_text(yaml.safe_dump(job, sort_keys=False))
    return spec


def find_key(doc: Any, key: str) -> Any:
    """The first value under `key` anywhere in a JSON document (the record's nesting is not fixed)."""
    if isinstance(doc, dict):
        if key in doc:
            return doc[key]
        doc = list(doc.values())
    if isinstance(doc, list):
        for item in doc:
            found = find_key(item, key)
            if found is not None:
                return found
    return None


def worker_records(output: Path) -> dict[str, float]:
    """Sums of the numbers the worker wrote into its shard completion records."""
    totals: dict[str, float] = {}
    for path in sorted(output.glob("_bij/*/round-*/done/*.json")):
        doc = json.loads(path.read_text())
        for key in ("modelLoadSeconds", "engineBusySeconds", "rows", "tokensIn", "tokensOut"):
            value = find_key(doc, key)
            if isinstance(value, (int, float)):
                totals[key] = totals.get(key, 0) + value
    return totals


def published_rows(output: Path) -> int:
    """Rows the published manifest lists as results."""
    manifest = json.loads((output / "manifest.json").read_text())
    return sum(int(f["rows"]) for f in manifest["files"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model directory or Hugging Face id (already cached)")
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--min-words", type=int, default=8)
    parser.add_argument("--max-words", type=int, default=400)
    parser.add_argument("--chunk-rows", type=int, default=512, help="spec.sharding.chunkRows")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="spec.model.vllm.maxModelLen (the spec default 8192 fails on shorter models)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--check", action="store_true", help=f"exit 1 when the ratio is below {TARGET}")
    parser.add_argument("--raw-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.raw_child:
        raw_child(args)
        return 0

    raw = run_raw(args)
    raw_rows_s = raw["rows"] / raw["generate_s"]
    workdir = Path(tempfile.mkdtemp(prefix="bij-vllm-overhead-"))
    try:
        spec = write_job(workdir, args)
        cmd = [sys.executable, "-m", "bij.cli.main", "run", str(spec), "--parallelism", "1", "--no-progress"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd)
        wall_s = time.perf_counter() - t0
        if proc.returncode != 0:
            print(f"bij run failed with exit code {proc.returncode} (work dir kept: {workdir})", file=sys.stderr)
            args.keep = True
            return 2
        rows = published_rows(workdir / "output")
        if rows != args.rows:
            print(f"bij published {rows} rows, expected {args.rows}", file=sys.stderr)
            args.keep = True
            return 2
        rec = worker_records(workdir / "output")
        load_s = rec.get("modelLoadSeconds")
        steady_s = wall_s - load_s if load_s is not None else wall_s
        worker_rows_s = rows / steady_s
        ratio = worker_rows_s / raw_rows_s

        print(f"rows {args.rows}, max_tokens {args.max_tokens}, model {args.model}")
        print(f"raw vLLM   load {raw['load_s']:7.1f}s  generate {raw['generate_s']:7.1f}s  "
              f"{raw_rows_s:8.1f} rows/s  {raw['tokens_out'] / raw['generate_s']:9.1f} out tok/s  "
              f"{(raw['tokens_in'] + raw['tokens_out']) / raw['generate_s']:9.1f} tok/s")
        basis = "wall - modelLoadSeconds" if load_s is not None else "end to end (no modelLoadSeconds recorded)"
        print(f"bij worker wall {wall_s:7.1f}s  load {load_s if load_s is not None else float('nan'):7.1f}s  "
              f"steady {steady_s:7.1f}s  {worker_rows_s:8.1f} rows/s  ({basis})")
        if "tokensOut" in rec:
            print(f"           {rec['tokensOut'] / steady_s:9.1f} out tok/s  "
                  f"engine busy {rec.get('engineBusySeconds', float('nan')):.1f}s")
        verdict = "ok" if ratio >= TARGET else "BELOW TARGET"
        print(f"ratio worker/raw rows/s = {ratio:.3f}  (target >= {TARGET})  {verdict}")
        return 1 if args.check and ratio < TARGET else 0
    finally:
        if args.keep:
            print(f"work dir: {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
