"""The one driver: what a failed step means (pure), the driver's steps through a backend, and the
local Indexed Job controller that `bij run` hands the operator's own Job bodies to."""

from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from bij_operator import steps
from bij_operator.driver import Driver, Observed
from bij_operator.failures import failed_step
from bij_operator.fingerprint import PlanRefused
from bij_operator.localjobs import LocalJob
from bij_operator.planner import PlanError
from bij_operator.publish import ErrorRatioExceeded, PublishError
from bij_operator.reconcile import (
    CreateJob,
    CreatePublishJob,
    MarkFailed,
    PlanRound,
    PreparePublish,
    Publish,
    Retry,
    Wait,
    parse_ranges,
)
from bij_worker.contract.codes import GENERATION_LABEL, STEP_LABEL
from bij_worker.storage import StorageError, StorageRefused

# --- failed_step: the decision after a step raised ----------------------------------------------------

PLAN = PlanRound(round=0, phase="Pending", reason="Planning", message="planning round 0")
CREATE = CreateJob(round=1, phase="Pending", reason="RoundStarting", message="", completions=4, suspend=False)
PREPARE = PreparePublish(round=0, phase="Publishing", reason="Publishing", message="", rounds=1)
PUBLISH = Publish(round=0, phase="Publishing", reason="Publishing", message="", rounds=1)


def test_a_refused_plan_fails_the_bij_until_the_spec_changes() -> None:
    d = failed_step(PLAN, PlanRefused("spec.model.name changed from null to \"x\""))
    assert isinstance(d, MarkFailed) and d.reason == d.event == "PlanRefused" and "spec.model.name" in d.message


def test_input_that_may_still_appear_is_retried_and_says_whether_time_alone_can_fix_it() -> None:
    later = failed_step(PLAN, PlanError("no input objects under file:///in/", permanent=False))
    assert isinstance(later, Retry) and later.reason == "PlanFailed" and later.phase == "Pending"
    assert later.message == "cannot plan round 0: no input objects under file:///in/" and not later.permanent
    archived = failed_step(PLAN, StorageError("read s3://b/in/a.jsonl: InvalidObjectState: archived", permanent=True))
    assert isinstance(archived, Retry) and archived.permanent and archived.delay > 0


@pytest.mark.parametrize("step, says", [(PLAN, "cannot plan round 0: "), (PREPARE, "publish failed: "),
                                        (PUBLISH, "publish failed: ")])
def test_a_store_that_refuses_the_identity_fails_the_bij_naming_the_uri_and_the_key(step: Any, says: str) -> None:
    refused = StorageRefused("list s3://team-a/in/ as access key id AKIAB: AccessDenied: Access Denied.")
    d = failed_step(step, refused)
    assert isinstance(d, MarkFailed) and d.phase == "Failed" and d.reason == d.event == "StorageRefused"
    assert d.message == says + str(refused)


def test_a_job_that_cannot_be_rendered_fails_with_cannot_create_job() -> None:
    d = failed_step(CREATE, ValueError("a round needs 1 to 100000 lanes, got 100001"))
    assert isinstance(d, MarkFailed) and d.reason == "CannotCreateJob" and d.message.startswith("round 1: ")


def test_publish_failures_retry_except_too_many_errors() -> None:
    too_many = failed_step(PUBLISH, ErrorRatioExceeded("12 of 100 rows failed"))
    assert isinstance(too_many, MarkFailed) and too_many.reason == "TooManyErrors"
    for step in (PREPARE, PUBLISH):
        d = failed_step(step, PublishError("a shard summary is missing"))
        assert isinstance(d, Retry) and d.reason == "PublishFailed" and d.phase == "Publishing"
        d = failed_step(step, StorageError("file:///out: Permission denied"))
        assert isinstance(d, Retry) and "Permission denied" in d.message


def test_unreadable_worker_records_at_a_rounds_finish_are_retried_and_named() -> None:
    from bij_operator.reconcile import FinishRound

    finish = FinishRound(round=2, phase="Running", reason="RoundFinished", message="")
    d = failed_step(finish, StorageError("file:///out/_bij/j/round-2/done/00003.json: not a JSON object",
                                         permanent=True))
    assert isinstance(d, Retry) and d.reason == "StorageFailed" and d.permanent and d.phase == "Running"
    assert d.message == "round 2: file:///out/_bij/j/round-2/done/00003.json: not a JSON object"


@pytest.mark.parametrize("step, error", [
    (PLAN, KeyError("shards")),                 # a bug in planning
    (PLAN, ValueError("bad literal")),          # a ValueError that is not a PlanError
    (CREATE, TypeError("unhashable")),
    (PUBLISH, ZeroDivisionError()),
    (CreatePublishJob(round=0, phase="Publishing", reason="Publishing", message="", rounds=1, pass_name="ids",
                      completions=1, plan_uri="file:///p"), KeyError("x")),
])
def test_a_bug_is_raised_again_never_retried_as_an_outage(step: Any, error: Exception) -> None:
    with pytest.raises(type(error)):
        failed_step(step, error)


# --- the driver through a backend ------------------------------------------------------------------------


class FakeBackend:
    """Status and Jobs in memory, Events recorded; `foreign` names Jobs someone else owns."""

    worker_image = "img"
    file_volume = None

    def __init__(self, job: Any, foreign: set[str] = frozenset()):  # type: ignore[assignment]
        self.job = job
        self.status: dict[str, Any] = {}
        self.jobs: dict[str, dict[str, Any]] = {}
        self.events: list[tuple[str, str, str]] = []
        self.creates: list[str] = []
        self.deletes: list[str] = []
        self.foreign = foreign

    def observe(self) -> Observed:
        import copy

        return Observed(job=self.job, spec_error=None, status=copy.deepcopy(self.status), generation=1,
                        output_uri=self.job.spec.output.uri, jobs=[copy.deepcopy(j) for j in self.jobs.values()])

    def create_job(self, body: dict[str, Any]) -> Any:
        name = body["metadata"]["name"]
        self.creates.append(name)
        if name in self.foreign:
            return "foreign"
        if name in self.jobs:
            return "exists"
        uid = uuid.uuid4().hex
        self.jobs[name] = {"metadata": {**body["metadata"], "uid": uid}, "spec": body["spec"], "status": {}}
        if STEP_LABEL in body["metadata"]["labels"]:
            # A step's pod, run here and now: its report lands in the status, its Job completes.
            (container,) = body["spec"]["template"]["spec"]["containers"]
            args = steps.parse_args(container["args"][1:])
            self.status.setdefault("reports", {}).setdefault("steps", {})[name] = steps.step_report(args, uid)
            self.jobs[name]["status"] = {"conditions": [{"type": "Complete", "status": "True"}]}
        return "created"

    def patch_job(self, name: str, spec: dict[str, Any]) -> None:
        self.jobs[name]["spec"].update(spec)

    def delete_job(self, name: str) -> None:
        self.deletes.append(name)
        self.jobs.pop(name, None)

    def write_status(self, patch: dict[str, Any]) -> None:
        from bij_operator.local import merge_patch

        merge_patch(self.status, patch)

    def event(self, type_: str, reason: str, message: str) -> None:
        self.events.append((type_, reason, message))


def test_the_driver_plans_creates_one_job_and_waits_for_it(file_place, make_job) -> None:
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", [{"id": i, "text": f"t{i}"} for i in range(50)]))
    backend = FakeBackend(job)
    idle = Driver(backend).reconcile()
    # Planning runs in a Job of its own (the operator reads no storage), then the round's Job.
    made = [f"{job.metadata.name}-plan-r0", f"{job.metadata.name}-r0"]
    assert isinstance(idle.decision, Wait) and backend.creates == made
    assert [e[1] for e in backend.events] == ["RoundPlanned", "RoundStarted"]
    assert backend.status["rounds"][0]["shards"] >= 1 and backend.status["phase"] == "Pending"
    # Asked again with nothing changed: no second Job, no second Event.
    Driver(backend).reconcile()
    assert backend.creates == made and len(backend.events) == 2


def test_rows_count_every_finished_round_also_while_the_last_one_publishes(file_place, make_job) -> None:
    from bij_operator.status import now_utc

    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", [{"id": 1, "text": "t"}]))
    driver = Driver(FakeBackend(job))
    lanes = {"reports": {"lanes": {"p0": {"round": 1, "rows": 7, "errors": 1}}}}
    rounds = [{"round": 0, "completionTime": "2026-01-01T00:00:00Z", "approved": 40, "errors": 2},
              {"round": 1, "startTime": "2026-01-01T00:00:00Z"}]
    # Round 1 running: round 0's record and what round 1's lanes reported so far.
    assert driver.progress({"rounds": rounds, **lanes}, 1, now_utc())["rows"] == {"done": 47, "failed": 3}
    # Round 1 finished and publishing: both records, and no lane report counted twice.
    rounds[1].update(completionTime="2026-01-01T00:01:00Z", approved=9, errors=1)
    assert driver.progress({"rounds": rounds, **lanes}, 1, now_utc())["rows"] == {"done": 49, "failed": 3}


def test_a_job_of_our_name_that_is_someone_elses_is_reported_never_adopted(file_place, make_job) -> None:
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", [{"id": 1, "text": "t"}]))
    backend = FakeBackend(job, foreign={f"{job.metadata.name}-r0"})
    idle = Driver(backend).reconcile()
    assert isinstance(idle.decision, CreateJob) and idle.recheck == 15.0
    assert backend.status["message"].startswith(f"round 0: a Job named {job.metadata.name}-r0 already exists")
    assert backend.events[-1][:2] == ("Warning", "JobNameConflict")
    Driver(backend).reconcile()  # still there: said once
    assert [e[1] for e in backend.events].count("JobNameConflict") == 1


def test_missing_input_is_a_retry_with_its_message_on_the_status(file_place, make_job) -> None:
    _, job = make_job(file_place, file_place.uri("nothing-here/"))
    backend = FakeBackend(job)
    idle = Driver(backend).reconcile()
    assert isinstance(idle.decision, Retry) and idle.recheck == 30.0
    assert backend.status["phase"] == "Pending" and backend.status["message"].startswith("cannot plan round 0: ")
    assert backend.events == [("Warning", "PlanFailed", backend.status["message"])]
    # The plan Job goes, so that the next attempt plans anew (the input may have arrived by then).
    assert backend.deletes == [f"{job.metadata.name}-plan-r0"]


@pytest.mark.parametrize("case", ["another-tenants-bucket", "no-such-input-bucket"])
def test_planning_as_an_identity_the_store_refuses_fails_the_bij_once_naming_the_uri_and_the_key(
        case, s3_tenant, s3_service, make_job, monkeypatch) -> None:
    if case == "another-tenants-bucket":  # the bij's credentials are another tenant's
        _, job = make_job(s3_tenant.place, s3_tenant.place.write_jsonl("in.jsonl", [{"id": 1, "text": "t"}]))
        who, where, code = s3_service.add_user(f"other-{uuid.uuid4().hex[:8]}"), s3_tenant.place.base, "AccessDenied"
    else:  # its own output bucket, an input bucket that does not exist
        where = "s3://bij-no-such-bucket-here/in/"
        _, job = make_job(s3_tenant.place, where)
        who, code = s3_tenant.identity, "NoSuchBucket"
    for k, v in who.env().items():
        monkeypatch.setenv(k, v)
    backend = FakeBackend(job)
    idle = Driver(backend).reconcile()
    # Only the plan Job, which met the refusal: no round Job.
    assert isinstance(idle.decision, MarkFailed) and idle.recheck is None
    assert backend.creates == [f"{job.metadata.name}-plan-r0"]
    message = backend.status["message"]
    assert backend.status["phase"] == "Failed" and message.startswith("cannot plan round 0: ")
    assert where in message and code in message, message
    assert f"as access key id {who.access_key}:" in message and who.secret_key not in message
    assert backend.events == [("Warning", "StorageRefused", message)]
    # Looked at again (a spec edit may fix it, so it is decided again): the same failure, said once.
    Driver(backend).reconcile()
    assert backend.status["phase"] == "Failed" and len(backend.events) == 1
    # ...without planning again: the refused plan's Job and report stay until the spec changes.
    assert backend.creates == [f"{job.metadata.name}-plan-r0"] and backend.deletes == []


def test_a_result_left_by_an_earlier_job_of_the_steps_name_is_never_taken(file_place, make_job) -> None:
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", [{"id": 1, "text": "t"}]))
    backend = FakeBackend(job)
    name = f"{job.metadata.name}-plan-r0"
    # A Job of that name is running, and the status holds a result of another Job of that name (deleted).
    backend.jobs[name] = {"metadata": {"name": name, "uid": "new", "labels": {STEP_LABEL: "plan-r0"}},
                          "spec": {}, "status": {"active": 1}}
    backend.status["reports"] = {"steps": {name: {"jobUid": "old", "result": {"shards": 99, "lanes": 9, "bytes": 1,
                                                                               "objects": 1}}}}
    idle = Driver(backend).reconcile()
    assert isinstance(idle.decision, PlanRound) and "rounds" not in backend.status  # waits for its own Job's


def test_a_step_refused_for_a_spec_since_edited_runs_again(file_place, make_job) -> None:
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", [{"id": 1, "text": "t"}]))
    backend = FakeBackend(job)
    name = f"{job.metadata.name}-plan-r0"
    refused = {"type": "PlanRefused", "message": "spec.output.uri: belongs to another job", "permanent": True}
    backend.jobs[name] = {"metadata": {"name": name, "uid": "u1", "labels": {STEP_LABEL: "plan-r0",
                                                                          GENERATION_LABEL: "1"}},
                          "spec": {}, "status": {"conditions": [{"type": "Complete", "status": "True"}]}}
    backend.status["reports"] = {"steps": {name: {"jobUid": "u1", "error": refused}}}
    Driver(backend).reconcile()
    assert backend.status["phase"] == "Failed" and backend.deletes == []  # kept: no plan Job in a loop
    backend.jobs[name]["metadata"]["labels"][GENERATION_LABEL] = "0"  # made for an earlier generation
    idle = Driver(backend).reconcile()
    assert backend.deletes == [name] and idle.recheck == 1.0  # looked at again once it is gone
    Driver(backend).reconcile()
    # Planned anew for this spec: the round is planned and its Job made.
    assert backend.deletes == [name] and backend.creates == [name, f"{job.metadata.name}-r0"]
    assert backend.status["rounds"][0]["shards"] == 1


# --- the local Indexed Job controller ----------------------------------------------------------------------

SCRIPT = """
import os, sys, time
i = int(os.environ["JOB_COMPLETION_INDEX"])
codes = os.environ["CODES"].split(",")
tries = len([f for f in os.listdir(os.environ["DIR"]) if f.startswith(f"{i}-")])
open(os.path.join(os.environ["DIR"], f"{i}-{tries}"), "w").close()
code = int(codes[i])
if not code:
    time.sleep(float(os.environ.get("SLEEP", "0")))  # the failing index ends first
if code:
    print(f"index {i} says: no", file=sys.stderr)
sys.exit(code)
"""


def job_body(completions: int, parallelism: int = 8, backoff: int = 0, max_failed: int | None = None) -> dict:
    spec: dict[str, Any] = {
        "completionMode": "Indexed", "completions": completions, "parallelism": parallelism,
        "backoffLimitPerIndex": backoff,
        "podFailurePolicy": {"rules": [{"action": "FailJob", "onExitCodes": {
            "containerName": "worker", "operator": "In", "values": [42]}}]},
        "template": {"spec": {"containers": [{"name": "worker", "command": ["bij-worker"],
                                              "args": ["--metrics-port", "9400"]}]}},
    }
    if max_failed is not None:
        spec["maxFailedIndexes"] = max_failed
    return {"metadata": {"name": "j-r0", "namespace": "ml", "labels": {"a": "b"}}, "spec": spec}


def run_local(tmp_path: Path, body: dict, codes: list[int], sleep: float = 0.0) -> tuple[LocalJob, list[str]]:
    said: list[str] = []
    env = {"CODES": ",".join(map(str, codes)), "DIR": str(tmp_path), "SLEEP": str(sleep), "PATH": "/usr/bin:/bin"}
    lj = LocalJob(body, [sys.executable, "-c", SCRIPT], env, say=said.append)
    lj.run(poll=0.01)
    return lj, said


def attempts(tmp_path: Path, index: int) -> int:
    return len(list(tmp_path.glob(f"{index}-*")))


def test_every_index_done_completes_the_job(tmp_path: Path) -> None:
    lj, said = run_local(tmp_path, job_body(3), [0, 0, 0])
    view = lj.view()
    assert view["status"]["completedIndexes"] == "0-2" and view["status"]["active"] == 0
    assert [c["type"] for c in view["status"]["conditions"]] == ["Complete"] and said == []
    assert "--metrics-port" not in lj.command  # one port per pod: not for processes on one machine


def test_a_failing_index_is_retried_per_index_then_the_job_fails_naming_it(tmp_path: Path) -> None:
    lj, said = run_local(tmp_path, job_body(3, backoff=2), [0, 1, 0])
    assert attempts(tmp_path, 1) == 3 and attempts(tmp_path, 0) == attempts(tmp_path, 2) == 1
    status = lj.view()["status"]
    assert parse_ranges(status["completedIndexes"]) == {0, 2} and status["failedIndexes"] == "1"
    (cond,) = status["conditions"]
    assert cond["type"] == "Failed" and cond["reason"] == "FailedIndexes"
    assert "index 1 exited 1: index 1 says: no" in cond["message"]  # its last words, like a termination message
    assert said[:2] == ["bij: j-r0 index 1 failed (exit 1), retry 1/2", "bij: j-r0 index 1 failed (exit 1), retry 2/2"]


def test_exit_42_fails_the_job_at_once_and_stops_the_other_indexes(tmp_path: Path) -> None:
    lj, _ = run_local(tmp_path, job_body(4, parallelism=4, backoff=3), [42, 0, 0, 0], sleep=5)
    (cond,) = lj.view()["status"]["conditions"]
    assert cond["type"] == "Failed" and cond["reason"] == "PodFailurePolicy"
    # Worded as the Job controller does, so the pod name says which lane it was.
    assert "for pod ml/j-r0-0-" in cond["message"] and "exit code 42" in cond["message"]
    assert attempts(tmp_path, 0) == 1  # no retry
    assert "completedIndexes" not in lj.view()["status"]  # the others were stopped, not finished


def test_more_failed_indexes_than_allowed_fail_the_job(tmp_path: Path) -> None:
    lj, _ = run_local(tmp_path, job_body(3, parallelism=1, max_failed=0), [1, 0, 0])
    (cond,) = lj.view()["status"]["conditions"]
    assert cond["reason"] == "MaxFailedIndexesExceeded" and attempts(tmp_path, 2) == 0


def test_a_caller_that_replaced_stderr_with_a_text_stream_still_gets_the_workers_lines(tmp_path: Path) -> None:
    import contextlib
    import io

    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        lj, _ = run_local(tmp_path, job_body(2, backoff=0), [0, 1])
    assert "index 1 says: no" in said.getvalue()
    assert "index 1 exited 1: index 1 says: no" in lj.view()["status"]["conditions"][0]["message"]


def test_kill_ends_each_index_with_the_processes_it_started(tmp_path: Path) -> None:
    # Each index starts a child (as vLLM starts its engine core) that would outlive a kill of the index alone.
    script = ("import os, subprocess, sys, time; "
              "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
              "open(os.path.join(os.environ['DIR'], os.environ['JOB_COMPLETION_INDEX']), 'w').write(str(c.pid)); "
              "time.sleep(60)")
    lj = LocalJob(job_body(2, parallelism=2), [sys.executable, "-c", script],
                  {"DIR": str(tmp_path), "PATH": "/usr/bin:/bin"})
    deadline = time.monotonic() + 30
    while len(list(tmp_path.iterdir())) < 2 or any(not p.read_text() for p in tmp_path.iterdir()):
        lj.tick()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    children = [int(p.read_text()) for p in tmp_path.iterdir()]
    lj.kill()
    while lj.active:
        lj.tick()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    for pid in children:  # killed too; once reaped by init, the pid is gone (or a zombie at most)
        while time.monotonic() < deadline:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except FileNotFoundError:
                break
            if state == "Z":
                break
            time.sleep(0.01)
        else:
            raise AssertionError(f"child {pid} of a killed index is still running")


def test_parallelism_bounds_the_processes_at_once(tmp_path: Path) -> None:
    body = job_body(4, parallelism=2)
    lj = LocalJob(body, [sys.executable, "-c", SCRIPT],
                  {"CODES": "0,0,0,0", "DIR": str(tmp_path), "SLEEP": "0.3", "PATH": "/usr/bin:/bin"})
    most = 0
    while not lj.finished:
        lj.tick()
        most = max(most, lj.active)
        time.sleep(0.01)
    assert most == 2 and lj.view()["status"]["completedIndexes"] == "0-3"
