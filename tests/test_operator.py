"""The real `bij operator` (kopf, in its own process) against the API emulator and local worker pods.

Each test starts a fresh emulator with the CRD installed, the test-side Job controller
(which runs real `bij-worker` processes for each Job index), and `bij operator
--all-namespaces --standalone` as the chart runs it. Inputs and outputs are file:// under
tmp_path and the engine is `echo`, so results are exact.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from k8s_emulator import ApiError, Emulator, JobController
from k8s_emulator.harness import BIJ, CRD, PLURAL, OperatorProcess, bij_doc, read_published, write_rows

NS = "default"
ROWS = 120


@dataclass
class Cluster:
    api: Emulator
    jobs: JobController
    operator: OperatorProcess
    tmp: Path

    def bij(self, name: str) -> dict[str, Any]:
        obj = self.api.get(BIJ, PLURAL, name, NS)
        assert obj is not None, f"bij {name} is gone"
        return obj

    def status(self, name: str) -> dict[str, Any]:
        return self.bij(name).get("status") or {}

    def columns(self, name: str) -> dict[str, Any]:
        return self.api.printer_columns(BIJ, PLURAL, name, NS, wide=True)

    def wait_phase(self, name: str, phase: str, timeout: float = 45) -> dict[str, Any]:
        return self.api.wait_for(lambda: self.status(name) if self.status(name).get("phase") == phase else None,
                                 timeout, message=f"{name} phase {phase} (operator log in the test output)")

    def one_shard_left(self, name: str, phase: str = "Running") -> dict[str, Any] | None:
        """The status once every shard but one is done (and the phase is `phase`), else None."""
        st = self.status(name)
        shards = st.get("shards") or {}
        if st.get("phase") == phase and shards.get("total") and shards.get("done") == shards["total"] - 1:
            return st
        return None

    def event_reasons(self, name: str) -> list[str]:
        return [e["reason"] for e in self.api.events_for(name, NS)]

    def job_creations(self) -> list[int | None]:
        """HTTP codes of every Job create the operator sent."""
        return [r.code for r in self.api.requests if r.verb == "create" and r.resource == "jobs"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture()
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    write_rows(tmp_path / "in", ROWS)
    with Emulator(crds=[CRD]) as api, JobController(api, log_dir=tmp_path / "pods", workdir=tmp_path) as ctl:
        op = OperatorProcess(api, tmp_path, args=["--all-namespaces", "--standalone", "--status-interval", "0.3",
                                                  f"--liveness=http://127.0.0.1:{free_port()}/healthz"])
        try:
            yield Cluster(api, ctl, op.start(), tmp_path)
        finally:
            op.stop()
            # Shown by pytest only when the test failed.
            print("---- operator log (tail) ----\n" + op.logs()[-6000:])


def condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    (found,) = [c for c in status.get("conditions") or [] if c["type"] == type_]
    return found


# --- (a) a job runs to Succeeded -----------------------------------------------------------------


def test_a_job_runs_to_succeeded_and_publishes_every_row_once(cluster: Cluster) -> None:
    c = cluster
    c.jobs.hold("emb-r0", 0)  # shard 0 waits, so the running state can be looked at
    created = c.api.create(BIJ, PLURAL, bij_doc("emb", c.tmp), NS)

    running = c.api.wait_for(lambda: c.one_shard_left("emb"), 45, message="every shard but the held one done")
    total = running["shards"]["total"]
    assert total >= 3
    cols = c.columns("emb")
    assert (cols["Phase"], cols["Round"], cols["Shards"]) == ("Running", 0, f"{total - 1}/{total}")
    assert 0 < cols["Rows"] < ROWS
    assert cols["Output"] == f"file://{c.tmp}/out-emb"
    assert condition(running, "Running")["status"] == "True"
    assert condition(running, "Ready")["status"] == "False"

    (job,) = c.api.list("batch/v1", "jobs", NS)
    assert job["metadata"]["name"] == "emb-r0"
    assert job["spec"]["completions"] == total
    assert job["metadata"]["labels"]["batchinference.io/job"] == "emb"
    assert [o["uid"] for o in job["metadata"]["ownerReferences"]] == [created["metadata"]["uid"]]

    c.jobs.release("emb-r0")
    done = c.wait_phase("emb", "Succeeded")
    cols = c.columns("emb")
    assert (cols["Phase"], cols["Round"], cols["Shards"], cols["Rows"]) == ("Succeeded", 0, f"{total}/{total}", ROWS)
    assert cols["Throughput"] > 0
    assert done["manifestUri"] == f"file://{c.tmp}/out-emb/manifest.json"
    assert done["outputUri"] == f"file://{c.tmp}/out-emb"
    assert done["rows"] == {"done": ROWS, "failed": 0}
    assert done["startTime"] <= done["completionTime"]
    assert done["observedGeneration"] == 1
    for type_, want in [("Ready", "True"), ("Succeeded", "True"), ("Running", "False"), ("Failed", "False")]:
        assert condition(done, type_)["status"] == want
        assert condition(done, type_)["observedGeneration"] == 1

    rows = read_published(c.tmp / "out-emb" / "manifest.json")
    ids = [r["id"] for r in rows]
    assert sorted(map(str, ids)) == sorted(map(str, (i if i % 3 else f"row-{i}" for i in range(ROWS))))
    assert len(ids) == len({json.dumps(i) for i in ids}) == ROWS
    assert all(isinstance(r["id"], int) == (not str(r["id"]).startswith("row-")) for r in rows)
    manifest = json.loads((c.tmp / "out-emb" / "manifest.json").read_text())
    assert manifest["counts"]["rows"] == ROWS

    c.api.wait_for(lambda: "Published" in c.event_reasons("emb"), 10, message="the Published event")
    assert c.event_reasons("emb") == ["RoundPlanned", "RoundStarted", "RoundFinished", "Published"]
    assert c.job_creations() == [201]

    # The liveness endpoint the chart's probe calls answers, with our probe in it.
    (url,) = [a.split("=", 1)[1] for a in c.operator.args if a.startswith("--liveness=")]
    with urllib.request.urlopen(url, timeout=5) as r:
        assert r.status == 200
        assert json.loads(r.read())["trackedJobs"] >= 0


# --- (b) the operator killed mid-round ---------------------------------------------------------


def test_an_operator_killed_mid_round_restarts_without_a_second_job(cluster: Cluster) -> None:
    c = cluster
    c.jobs.hold("kill-r0", 1)
    c.api.create(BIJ, PLURAL, bij_doc("kill", c.tmp), NS)
    c.api.wait_for(lambda: c.one_shard_left("kill"), 45, message="mid-round")
    c.operator.kill()
    c.jobs.release("kill-r0")  # the round finishes while no operator is watching
    c.api.wait_for(lambda: any(x["type"] == "Complete" for x in (c.api.get("batch/v1", "jobs", "kill-r0", NS) or {})
                               .get("status", {}).get("conditions", [])), 30, message="the Job completes")
    assert c.status("kill")["phase"] == "Running"  # nobody told the bij yet

    c.operator.start()
    done = c.wait_phase("kill", "Succeeded")
    assert c.job_creations() == [201]  # the restarted operator found the Job instead of creating one
    assert len(c.api.list("batch/v1", "jobs", NS)) == 1
    started = [i for name, i in c.jobs.pods_started if name == "kill-r0"]
    assert sorted(started) == list(range(done["shards"]["total"]))  # every shard ran exactly once
    assert len(read_published(c.tmp / "out-kill" / "manifest.json")) == ROWS


@pytest.mark.slow
def test_an_operator_killed_again_and_again_still_finishes_with_one_job(cluster: Cluster) -> None:
    c = cluster
    c.api.create(BIJ, PLURAL, bij_doc("chaos", c.tmp, workers={"parallelism": 1}), NS)
    phases_at_kill = []
    for delay in (1.2, 1.6, 2.0, 2.4, 2.8, 3.2, 3.6, 4.0):
        # The operator takes about a second to start: later and later kills land in planning,
        # Job creation, progress updates, publishing.
        time.sleep(delay)
        phases_at_kill.append(c.status("chaos").get("phase"))
        c.operator.kill()
        c.operator.start()
        if phases_at_kill[-1] == "Succeeded":
            break
    done = c.wait_phase("chaos", "Succeeded", timeout=60)
    # Which phases the kills land in depends on the machine's speed (an idle one may finish before the
    # first): what must hold whatever they were is one Job and every row.
    assert c.job_creations().count(201) == 1, phases_at_kill
    assert len(c.api.list("batch/v1", "jobs", NS)) == 1
    assert done["rows"]["done"] == ROWS
    assert len(read_published(c.tmp / "out-chaos" / "manifest.json")) == ROWS


# --- (c) failures ------------------------------------------------------------------------------


@pytest.mark.parametrize("exit_code, times, reason", [
    (1, 2, "FailedIndexes"),  # a retryable failure, twice: backoffLimitPerIndex 1 is used up
    (42, 1, "PodFailurePolicy"),  # bad configuration: FailJob at once, no retries
])
def test_a_failing_shard_marks_the_bij_failed_naming_the_shard(cluster: Cluster, exit_code: int, times: int,
                                                               reason: str) -> None:
    c = cluster
    c.jobs.inject_exit("bad-r0", 2, exit_code, times=times)
    c.api.create(BIJ, PLURAL, bij_doc("bad", c.tmp), NS)
    failed = c.wait_phase("bad", "Failed")
    cond = condition(failed, "Failed")
    assert (cond["status"], cond["reason"]) == ("True", reason)
    assert "round 0: shard 2 failed" in cond["message"]
    assert "bad-r0" in cond["message"]
    assert condition(failed, "Ready")["status"] == "False"
    assert failed["message"] == cond["message"]
    assert c.columns("bad")["Phase"] == "Failed"
    assert not (c.tmp / "out-bad" / "manifest.json").exists()
    c.api.wait_for(lambda: "Failed" in c.event_reasons("bad"), 10, message="the Failed event")
    (event,) = [e for e in c.api.events_for("bad", NS) if e["reason"] == "Failed"]
    assert event["type"] == "Warning" and "shard 2" in event["message"]


# --- (d) invalid specs -------------------------------------------------------------------------


def test_an_invalid_spec_is_rejected_at_admission_with_a_clear_message(cluster: Cluster) -> None:
    c = cluster
    doc = bij_doc("nope", c.tmp, workers={"parallelism": 0}, model={"engine": "gpt"})
    with pytest.raises(ApiError) as e:
        c.api.create(BIJ, PLURAL, doc, NS)
    assert e.value.code == 422
    assert 'BatchInferenceJob.batchinference.io "nope" is invalid' in e.value.message
    assert "spec.workers.parallelism: Invalid value: 0" in e.value.message
    assert 'spec.model.engine: Unsupported value: "gpt"' in e.value.message
    assert c.api.get(BIJ, PLURAL, "nope", NS) is None


def test_a_spec_only_the_operator_can_judge_invalid_fails_without_a_job_until_fixed(cluster: Cluster) -> None:
    c = cluster
    # The CRD cannot check that a regular expression compiles; the operator's spec model does.
    doc = bij_doc("regex", c.tmp, judge={"type": "regex", "pattern": "(unclosed"})
    c.api.create(BIJ, PLURAL, doc, NS)
    failed = c.wait_phase("regex", "Failed")
    cond = condition(failed, "Failed")
    assert cond["reason"] == "InvalidSpec"
    assert "spec.judge" in cond["message"] and "not a valid regular expression" in cond["message"]
    c.api.wait_for(lambda: "InvalidSpec" in c.event_reasons("regex"), 10, message="the InvalidSpec event")
    assert c.api.list("batch/v1", "jobs", NS) == []

    c.api.patch(BIJ, PLURAL, "regex", {"spec": {"judge": None}}, NS)  # the user fixes the spec
    done = c.wait_phase("regex", "Succeeded")
    assert done["observedGeneration"] == 2
    assert condition(done, "Failed")["status"] == "False"


# --- (e) suspend and resume --------------------------------------------------------------------


def test_suspend_stops_the_round_and_resume_finishes_it_keeping_progress(cluster: Cluster) -> None:
    c = cluster
    c.jobs.inject_exit("sus-r0", 0, 1, sleep=120)  # shard 0's first pod is slow: it is running at suspend
    c.api.create(BIJ, PLURAL, bij_doc("sus", c.tmp), NS)
    c.api.wait_for(lambda: c.one_shard_left("sus"), 45, message="all shards but the slow one")
    assert c.jobs.running("sus-r0") == [0]

    c.api.patch(BIJ, PLURAL, "sus", {"spec": {"suspend": True}}, NS)
    suspended = c.wait_phase("sus", "Suspended")
    total = suspended["shards"]["total"]
    assert suspended["shardsSummary"] == f"{total - 1}/{total}"  # progress is kept
    assert condition(suspended, "Suspended")["status"] == "True"
    c.api.wait_for(lambda: c.jobs.running("sus-r0") == [], 15, message="the slow pod stopped")
    job = c.api.get("batch/v1", "jobs", "sus-r0", NS)
    assert job is not None and job["spec"]["suspend"] is True
    assert job["status"]["failed"] == 0  # a suspended pod is not a failure

    c.api.patch(BIJ, PLURAL, "sus", {"spec": {"suspend": False}}, NS)
    done = c.wait_phase("sus", "Succeeded")
    assert condition(done, "Suspended")["status"] == "False"
    assert done["observedGeneration"] == 3
    started = [i for name, i in c.jobs.pods_started if name == "sus-r0"]
    # Finished shards never ran again; only the interrupted one got a second pod.
    assert sorted(started) == sorted([*range(total), 0])
    assert len(read_published(c.tmp / "out-sus" / "manifest.json")) == ROWS
    # kopf posts events from a queue: the Published event may trail the Succeeded status.
    c.api.wait_for(lambda: "Published" in c.event_reasons("sus"), 10, message="the Published event")
    reasons = c.event_reasons("sus")
    assert reasons.index("Suspended") < reasons.index("Resumed") < reasons.index("Published")


def test_judge_rounds_run_one_job_per_round_and_report_the_capped_rows(cluster: Cluster) -> None:
    c = cluster
    # echo returns the text, so this judge approves the even rows and rejects the odd ones for good.
    judge = {"type": "regex", "pattern": r"^row \d*[02468]:", "strategy": "rounds", "maxRounds": 2}
    c.api.create(BIJ, PLURAL, bij_doc("judged", c.tmp, judge=judge), NS)
    done = c.wait_phase("judged", "Succeeded", timeout=60)
    assert sorted(j["metadata"]["name"] for j in c.api.list("batch/v1", "jobs", NS)) == ["judged-r0", "judged-r1"]
    assert c.columns("judged")["Round"] == 1
    r0, r1 = done["rounds"]
    half = ROWS // 2
    assert (r0["rowsIn"], r0["approved"], r0["rejected"], r0["capped"]) == (ROWS, half, half, 0)
    assert (r1["rowsIn"], r1["approved"], r1["rejected"], r1["capped"]) == (half, 0, 0, half)
    assert done["rows"]["done"] == half
    assert "RetryCapReached" in condition(done, "Succeeded")["message"]
    manifest = json.loads((c.tmp / "out-judged" / "manifest.json").read_text())
    assert (manifest["counts"]["rows"], manifest["counts"]["capped"]) == (half, half)
    c.api.wait_for(lambda: "RetryCapReached" in c.event_reasons("judged"), 10, message="the cap is reported")
    assert c.event_reasons("judged").count("RoundStarted") == 2


def test_a_foreign_job_with_the_rounds_name_is_reported_never_adopted(cluster: Cluster) -> None:
    c = cluster
    foreign = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "clash-r0"}, "spec": {
        "template": {"spec": {"restartPolicy": "Never", "containers": [{"name": "x", "image": "busybox"}]}}}}
    c.jobs.hold("clash-r0", 0)  # nothing runs for it
    c.api.create("batch/v1", "jobs", foreign, NS)
    c.api.create(BIJ, PLURAL, bij_doc("clash", c.tmp), NS)
    st = c.api.wait_for(lambda: (lambda s: s if s.get("conditions") and condition(s, "Ready")["reason"]
                                 == "JobNameConflict" else None)(c.status("clash")), 30, message="the conflict")
    assert st["phase"] == "Pending"
    assert "a Job named clash-r0 already exists" in st["message"]
    job = c.api.get("batch/v1", "jobs", "clash-r0", NS)
    assert job is not None and "ownerReferences" not in job["metadata"]  # left alone
    c.api.wait_for(lambda: "JobNameConflict" in c.event_reasons("clash"), 10, message="the Warning event")


def test_deleting_the_bij_deletes_its_job_and_keeps_the_results(cluster: Cluster) -> None:
    c = cluster
    c.api.create(BIJ, PLURAL, bij_doc("gone", c.tmp), NS)
    c.wait_phase("gone", "Succeeded")
    c.api.delete(BIJ, PLURAL, "gone", NS)
    assert c.api.list("batch/v1", "jobs", NS) == []
    assert (c.tmp / "out-gone" / "manifest.json").exists()
    time.sleep(1)  # the operator sees the Job's deletion and must not recreate anything
    assert c.api.list("batch/v1", "jobs", NS) == []
    assert c.operator.proc is not None and c.operator.proc.poll() is None
