"""Prompts sharing a prefix run together: the prefix share bij reaches ÷ the share possible.

Workload: --rows prompts, each one of a handful (--prompts) of long system prompts
(a few hundred to a thousand characters) followed by a short question, the system
prompts in random order. The job runs `bij run` with the simulated engine (one shard,
one worker), once with `batching.prefixOrder: true` (the default) and once with
`false`, and reads `engine.prefixShare` from the manifest: the share of prompt
characters each prompt shares with the prompt run just before it (what an engine's
prefix cache could reuse had it kept only that prompt).

The anchor is the share possible: the same prompts all sorted by text, so every
prompt but the first of each system prompt follows one that shares its system prompt.
Target: prefix-ordered share ÷ possible >= 0.9. Also reported: the share with
prefixOrder false (longest first only; lengths differ by system prompt, so it groups
some by chance) ÷ possible.

    python bench/prefix.py [--rows 3000] [--prompts 5] [--repeats 1]
"""

from __future__ import annotations

import json
import random
import sys

import harness

TARGET = 0.9


def prompts(n: int, systems: int, seed: int = 11) -> list[str]:
    rnd = random.Random(seed)
    words = ("answer briefly cite sources politely never speculate format as json use british spelling "
             "refuse unsafe requests summarise the document below in three bullet points").split()
    system = [f"System prompt {k}: you are assistant {k}. " + " ".join(rnd.choice(words) for _ in
                                                                        range(rnd.randint(60, 180)))
              for k in range(systems)]
    return [rnd.choice(system) + f"\n\nUser question {i}: " + " ".join(rnd.choice(words) for _ in
                                                                      range(rnd.randint(3, 30)))
            for i in range(n)]


def possible_share(texts: list[str]) -> float:
    from bij.worker.batcher import PrefixShare

    share = PrefixShare()
    for t in sorted(texts):
        share.add(t)
    return share.share


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__, rows=3000, repeats=1)
    p.add_argument("--prompts", type=int, default=5, help="distinct system prompts")
    p.add_argument("--chunk-rows", type=int, default=64)
    args = harness.parse(p, argv)

    report = harness.Report("prefix")
    work = harness.work_dir("prefix", args.keep)
    try:
        texts = prompts(args.rows, args.prompts)
        input_path = work / "input" / "rows.jsonl"
        harness.write_rows(input_path, texts)
        possible = possible_share(texts)
        model = {"engine": "simulated", "task": "generate", "maxTokens": 16,
                 "simulated": {"maxNumSeqs": 64, "stepSeconds": 0}}
        print(f"prefix: {args.rows} prompts, {args.prompts} system prompts in random order, "
              f"{sum(map(len, texts)) / len(texts):.0f} characters a prompt; possible share {possible:.3f}",
              flush=True)

        def run(prefix_order: bool, i: int) -> float:
            out = work / f"out-{int(prefix_order)}-{i}"
            spec = harness.write_spec(work / f"spec-{int(prefix_order)}-{i}.yaml", "bench-prefix", input_path, out,
                                      model, args.chunk_rows, batching={"prefixOrder": prefix_order})
            harness.run_bij(spec)
            share = float(json.loads((out / "manifest.json").read_text())["engine"]["prefixShare"])
            print(f"  prefixOrder {str(prefix_order).lower():5}  share {share:.3f}", flush=True)
            return share

        runs = harness.interleave(args.repeats, ordered=lambda i: run(True, i), unordered=lambda i: run(False, i))
        ordered = harness.median(runs["ordered"])
        arrival = harness.median(runs["unordered"])
        report.details.update(rows=args.rows, prompts=args.prompts, possible=possible, runs=runs)
        report.ratio("prefix share, prefix-ordered / possible", ordered / possible, TARGET,
                     note=f"{ordered:.3f} of {possible:.3f}")
        report.ratio("prefix share, prefixOrder false / possible", arrival / possible, None,
                     note=f"{arrival:.3f} of {possible:.3f}: longest first, prefixes ignored")
    finally:
        harness.cleanup(work, args.keep)
    report.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
