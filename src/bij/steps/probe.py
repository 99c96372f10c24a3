"""`bij-worker probe --job-spec JSON`: can this pod, under its identity and `spec.storage`, read the
job's input and write its output? `bij doctor` runs it as a short-lived pod in the bij's namespace,
so the answer comes from the same place and credentials as the job's own pods, never from the
operator's or the caller's.

It lists the input (sizes only), then creates, reads back and deletes one small object under the
job's own work folder of the output. Each check is one JSON line on stdout; the last line is the
summary. The exit code is 0 when every check passed, 1 otherwise (the pod's termination message,
`FallbackToLogsOnError`, then carries the lines).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import uuid
from typing import Any

from bij.contract import layout
from bij.contract.errors import BijError
from bij.contract.spec import SpecError, parse_job
from bij.storage import open_storage

# Where the kubelet takes a container's termination message from (the pod's default path).
TERMINATION_LOG = "/dev/termination-log"


def check(name: str, ok: bool, detail: str) -> dict[str, Any]:
    return {"check": name, "ok": ok, "detail": detail}


def describe(e: Exception) -> str:
    return str(e) if isinstance(e, BijError) else f"{type(e).__name__}: {e}"


def probe(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The storage checks for the job `doc` (a BatchInferenceJob as a dict), in order."""
    try:
        job = parse_job(doc, "--job-spec")
    except SpecError as e:
        return [check("spec", False, str(e))]
    s3 = job.spec.storage.s3
    src = job.spec.input.uri
    out: list[dict[str, Any]] = []
    try:
        objects = open_storage(src, s3).list(src)
        data = [o for o in objects if o.size > 0]
        out.append(check("input", bool(data),
                         f"{len(data)} non-empty object(s) under {src}" if data else f"nothing to read under {src}"))
    except Exception as e:  # noqa: BLE001 - every failure is this check's answer, named
        out.append(check("input", False, f"cannot list {src}: {describe(e)}"))
    probe_uri = layout.join(layout.state_prefix(job), f"doctor-probe-{uuid.uuid4().hex}.json")
    body = json.dumps({"probe": "bij doctor"}).encode()
    try:
        store = open_storage(probe_uri, s3)
        store.write_bytes(probe_uri, body)
        try:
            same = store.read_bytes(probe_uri) == body
        finally:
            store.delete(probe_uri)
        out.append(check("output", same, f"wrote, read back and deleted {probe_uri}" if same
                         else f"{probe_uri} read back differs from what was written"))
    except Exception as e:  # noqa: BLE001
        out.append(check("output", False, f"cannot write under {job.spec.output.uri}: {describe(e)}"))
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bij-worker probe", description=__doc__.splitlines()[0])
    parser.add_argument("--job-spec", required=True, help="the BatchInferenceJob as JSON")
    args = parser.parse_args(argv)
    try:
        doc = json.loads(args.job_spec)
    except ValueError as e:
        print(json.dumps(check("spec", False, f"--job-spec is not JSON: {e}")))
        return 1
    results = probe(doc)
    ok = all(r["ok"] for r in results)
    lines = [json.dumps(r) for r in results] + [json.dumps({"summary": "ok" if ok else "failed"})]
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    sys.stdout.flush()
    if os.access(TERMINATION_LOG, os.W_OK):
        with open(TERMINATION_LOG, "w") as f:
            f.write(text[-4000:])
    return 0 if ok else 1
