"""End to end on kind: the real images, the Helm chart and a BatchInferenceJob over in-cluster S3.

The job (manifests/bij-job.yaml) runs the echo engine, so no GPU or model is needed and every
result row must be its input row's text. The fixtures in conftest.py build the cluster; this
module uploads the input, applies the job, waits for it and checks what `kubectl get bij` shows
and what was published. Every failure message carries `kubectl describe`, operator and worker logs.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import time
from collections import Counter
from functools import cached_property
from typing import Any

import pytest
import yaml

from .conftest import (
    E2E_TIMEOUT,
    MANIFESTS,
    NAMESPACE,
    S3_ACCESS_KEY,
    S3_SECRET_KEY,
    Cluster,
)

# Without Docker, kind or kubectl every test here is skipped (conftest.prerequisites).
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(E2E_TIMEOUT), pytest.mark.usefixtures("prerequisites")]

JOB_MANIFEST = MANIFESTS / "bij-job.yaml"
JOB: dict[str, Any] = yaml.safe_load(JOB_MANIFEST.read_text())
JOB_NAME: str = JOB["metadata"]["name"]
OUTPUT_URI: str = JOB["spec"]["output"]["uri"]
JOB_TIMEOUT = float(os.environ.get("BIJ_E2E_JOB_TIMEOUT", "600"))
assert f".{NAMESPACE}.svc" in JOB["spec"]["storage"]["s3"]["endpointUrl"], "bij-job.yaml names another namespace"


def input_files(files: int = 2, rows_per_file: int = 40) -> dict[str, list[dict[str, Any]]]:
    """JSONL objects for s3://bij-e2e/input/: ids both integers and strings, texts of varied length
    and not only ASCII, about 2.5 KB per object, so targetShardBytes 1024 cuts several shards."""
    out: dict[str, list[dict[str, Any]]] = {}
    n = 0
    for f in range(files):
        rows = []
        for _ in range(rows_per_file):
            row_id: int | str = n if n % 2 == 0 else f"doc-{n}"
            rows.append({"id": row_id, "text": f"row {n} of the e2e input: " + "naïve café ✓ " * (n % 4) + "end"})
            n += 1
        out[f"part-{f}.jsonl"] = rows
    return out


def upload_input(cluster: Cluster, files: dict[str, list[dict[str, Any]]]) -> None:
    """The input as a ConfigMap, copied into the bucket by the upload-input Job (mc)."""
    configmap = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "bij-e2e-input"},
        "data": {name: "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows) for name, rows in files.items()},
    }
    cluster.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=json.dumps(configmap))
    cluster.apply(MANIFESTS / "upload-input.yaml", NAMESPACE)
    cluster.wait_job("upload-input", NAMESPACE, timeout=300)


def wait_until_finished(cluster: Cluster, timeout: float) -> dict[str, Any]:
    """Poll the bij until its phase is Succeeded or Failed, or `timeout` passes; the last object seen."""
    deadline = time.monotonic() + timeout
    while True:
        bij = cluster.get_json("bij", JOB_NAME, "-n", NAMESPACE)
        if bij.get("status", {}).get("phase") in ("Succeeded", "Failed") or time.monotonic() > deadline:
            return bij
        time.sleep(3)


def parse_table(text: str) -> list[dict[str, str]]:
    """kubectl's table output as dicts, cut at the header's column starts (a cell may be empty)."""
    header, *rows = text.rstrip("\n").splitlines()
    names = header.split()
    starts = [header.index(f" {n}") + 1 if i else 0 for i, n in enumerate(names)]
    bounds = list(zip(starts, starts[1:] + [None], strict=True))
    return [{n: row[a:b].strip() for n, (a, b) in zip(names, bounds, strict=True)} for row in rows]


def read_jsonl(client: Any, bucket: str, key: str) -> list[dict[str, Any]]:
    data: bytes = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    if key.endswith(".zst"):
        import zstandard

        data = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=True).read()
    return [json.loads(line) for line in data.decode().splitlines() if line.strip()]


@dataclasses.dataclass
class Published:
    manifest: dict[str, Any]
    results: list[dict[str, Any]]
    errors: list[dict[str, Any]]
    # (path, rows in the manifest, rows in the file) for every listed file
    file_rows: list[tuple[str, int, int]]


def read_published(client: Any, output_uri: str) -> Published:
    """manifest.json and every file it lists, read with plain boto3 (not bij's own storage code)."""
    bucket, _, prefix = output_uri.removeprefix("s3://").partition("/")
    prefix = prefix.rstrip("/") + "/"
    manifest = json.loads(client.get_object(Bucket=bucket, Key=prefix + "manifest.json")["Body"].read())
    results: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    file_rows = []
    for listed, into in ((manifest["files"], results), (manifest["errorFiles"], errors)):
        for f in listed:
            rows = read_jsonl(client, bucket, prefix + f["path"])
            file_rows.append((f["path"], f["rows"], len(rows)))
            into += rows
    return Published(manifest, results, errors, file_rows)


@dataclasses.dataclass
class JobRun:
    cluster: Cluster
    files: dict[str, list[dict[str, Any]]]
    bij: dict[str, Any]

    @property
    def rows(self) -> list[dict[str, Any]]:
        return [r for rows in self.files.values() for r in rows]

    @property
    def phase(self) -> str | None:
        return self.bij.get("status", {}).get("phase")  # type: ignore[no-any-return]

    @cached_property
    def diagnostics(self) -> str:
        return self.cluster.diagnostics(NAMESPACE)

    def explain(self, what: str) -> str:
        status = yaml.safe_dump(self.bij.get("status", {}), sort_keys=False)
        return f"{what}\n\n--- status of bij {JOB_NAME} ---\n{status}\n--- diagnostics ---\n{self.diagnostics}"

    def require_succeeded(self) -> None:
        assert self.phase == "Succeeded", self.explain(
            f"bij {JOB_NAME} ended in phase {self.phase!r} (waited up to {JOB_TIMEOUT:.0f}s)")


@pytest.fixture(scope="module")
def job_run(operator: Cluster) -> JobRun:
    """Upload the input, apply the job and wait until it has finished (or the timeout passed)."""
    files = input_files()
    upload_input(operator, files)
    operator.apply(JOB_MANIFEST, NAMESPACE)
    return JobRun(operator, files, wait_until_finished(operator, JOB_TIMEOUT))


def test_job_succeeds(job_run: JobRun) -> None:
    job_run.require_succeeded()
    conditions = {c["type"]: c["status"] for c in job_run.bij["status"].get("conditions", [])}
    assert conditions, job_run.explain("no status.conditions")


def test_round_job_is_indexed_with_one_index_per_lane(job_run: JobRun) -> None:
    job_run.require_succeeded()
    status = job_run.bij["status"]
    shards = status["shards"]["total"]
    (round0,) = [r for r in status["rounds"] if r["round"] == 0]
    lanes = round0["lanes"]
    parallelism = JOB["spec"]["workers"]["parallelism"]
    job = job_run.cluster.get_json("job", f"{JOB_NAME}-r0", "-n", NAMESPACE)
    spec, job_status = job["spec"], job.get("status", {})
    # targetShardBytes 1024 cuts the ~5 KB input into more shards than there are lanes, so each lane
    # (one index of the Job, one pod that loads the model once) works several shards.
    assert lanes == parallelism and shards > lanes, job_run.explain(
        f"expected more shards than the {parallelism} lanes, got {shards} shards in {lanes} lanes")
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == lanes
    assert spec["parallelism"] == parallelism
    assert job_status.get("succeeded") == lanes, job_run.explain(f"round Job status: {job_status}")
    assert status["shards"]["done"] == shards
    owners = job["metadata"].get("ownerReferences", [])
    assert [o["uid"] for o in owners] == [job_run.bij["metadata"]["uid"]]


def test_printer_columns_show_shards_done(job_run: JobRun) -> None:
    job_run.require_succeeded()
    status = job_run.bij["status"]
    total = status["shards"]["total"]
    (row,) = parse_table(job_run.cluster.kubectl("get", "bij", JOB_NAME, "-n", NAMESPACE, "-o", "wide"))
    expected = {"NAME": JOB_NAME, "PHASE": "Succeeded", "ROUND": "0", "SHARDS": f"{total}/{total}",
                "ROWS": str(len(job_run.rows)), "OUTPUT": OUTPUT_URI}
    assert {k: row.get(k) for k in expected} == expected, job_run.explain(f"kubectl get bij -o wide: {row}")
    assert row.get("AGE") and row.get("THROUGHPUT"), row


def test_manifest_lists_every_row_once_with_its_text(job_run: JobRun) -> None:
    job_run.require_succeeded()
    import boto3

    with job_run.cluster.port_forward("svc/minio", NAMESPACE, 9000) as port:
        client = boto3.session.Session().client(
            "s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1",
            aws_access_key_id=S3_ACCESS_KEY, aws_secret_access_key=S3_SECRET_KEY)
        published = read_published(client, OUTPUT_URI)

    assert published.errors == [], published.errors[:5]
    for path, listed, found in published.file_rows:
        assert listed == found, f"{path}: manifest says {listed} rows, the file has {found}"
    # Ids are compared as JSON: 4 and "4" are different ids and must come back as given.
    texts = {json.dumps(r["id"]): r["text"] for r in job_run.rows}
    seen = Counter(json.dumps(r["id"]) for r in published.results)
    assert {i for i, c in seen.items() if c > 1} == set(), "ids published more than once"
    assert set(texts) - set(seen) == set(), "input ids missing from the results"
    assert set(seen) - set(texts) == set(), "result ids that are not in the input"
    wrong = [r for r in published.results if r.get("output") != texts[json.dumps(r["id"])]]
    assert wrong == [], f"{len(wrong)} rows whose output is not their input text, e.g. {wrong[:3]}"
    counts = published.manifest["counts"]
    assert (counts["rows"], counts["errors"]) == (len(texts), 0), counts
