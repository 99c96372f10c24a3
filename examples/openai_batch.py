"""The OpenAI Batch API on your own cluster: this script uses only the `openai` SDK.

    export OPENAI_BASE_URL=http://127.0.0.1:8765/v1   # bij-api (make cluster-up prints both)
    export OPENAI_API_KEY=$(kubectl create token batcher)  # a service-account token
    python examples/openai_batch.py [--model demo-chat]

It runs one chat batch end to end and parses every output line with the SDK's own models, then
starts a second, larger batch, cancels it mid-run and reads back the rows it finished.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time

from openai import OpenAI
from openai.types.chat import ChatCompletion


def batch_file(n: int, model: str, tag: str) -> io.BytesIO:
    lines = [{"custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": model, "max_tokens": 32,
                       "messages": [{"role": "user", "content": f"Question {i}: " + "why is the sky blue? " * 4}]}}
             for i in range(n)]
    return io.BytesIO("".join(json.dumps(line) + "\n" for line in lines).encode())


def wait(client: OpenAI, batch_id: str, until: set[str], timeout: float = 600) -> object:
    deadline = time.monotonic() + timeout
    while True:
        b = client.batches.retrieve(batch_id)
        c = b.request_counts
        print(f"  {b.id}: {b.status}, {c.completed if c else 0}/{c.total if c else '?'} done", flush=True)
        if b.status in until:
            return b
        if b.status in {"completed", "failed", "expired", "cancelled"} or time.monotonic() > deadline:
            sys.exit(f"batch {b.id} ended {b.status} (errors: {b.errors})")
        time.sleep(2)


def read_lines(client: OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines() if line.strip()]


def parsed(lines: list[dict]) -> list[ChatCompletion]:
    """Every output line's response body as the SDK's ChatCompletion (a line that is not one raises)."""
    return [ChatCompletion.model_validate(line["response"]["body"]) for line in lines]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo-chat", help="a model bij-api serves (its model map)")
    p.add_argument("--rows", type=int, default=50)
    args = p.parse_args()
    client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY

    print("1. a chat batch, end to end")
    f = client.files.create(file=("questions.jsonl", batch_file(args.rows, args.model, "q")), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                              metadata={"demo": "end-to-end"})
    done = wait(client, b.id, {"completed"})
    out = read_lines(client, done.output_file_id)  # type: ignore[attr-defined]
    answers = parsed(out)
    print(f"  {len(answers)} answers parsed as ChatCompletion, e.g. {out[0]['custom_id']}: "
          f"{answers[0].choices[0].message.content!r}")
    assert len(answers) == args.rows

    print("2. a larger batch, cancelled mid-run")
    f2 = client.files.create(file=("more.jsonl", batch_file(args.rows * 40, args.model, "m")), purpose="batch")
    b2 = client.batches.create(input_file_id=f2.id, endpoint="/v1/chat/completions", completion_window="24h")
    while True:  # some rows finished (the counts come from the workers' progress, every few seconds)
        counts = client.batches.retrieve(b2.id).request_counts
        if counts is not None and counts.completed > 0:
            break
        time.sleep(1)
    print(f"  cancelling {b2.id}: {client.batches.cancel(b2.id).status}")
    stopped = wait(client, b2.id, {"cancelled"})
    kept = read_lines(client, stopped.output_file_id)  # type: ignore[attr-defined]
    errors = read_lines(client, stopped.error_file_id)  # type: ignore[attr-defined]
    ids = [line["custom_id"] for line in kept]
    parsed(kept)
    counts = stopped.request_counts  # type: ignore[attr-defined]
    assert len(ids) == len(set(ids)) == counts.completed and len(errors) == counts.failed
    assert counts.completed + counts.failed == counts.total  # each request never run: a batch_cancelled line
    not_run = sum(1 for e in errors if e["error"]["code"] == "batch_cancelled")
    print(f"  cancelled: {counts.completed} of {counts.total} rows finished (each once, all parsed), "
          f"{counts.failed - not_run} failed, {not_run} not run (batch_cancelled in the error file)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
