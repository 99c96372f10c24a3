"""The one driver: what a failed step means (pure), the driver's steps through a backend, and the
local Indexed Job controller that `bij run` hands the operator's own Job bodies to."""

from __future__ import annotations

import datetime as dt
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from bij.contract.codes import GENERATION_LABEL, JOB_LABEL, ROUND_LABEL, STEP_LABEL
from bij.contract.manifest import Manifest
from bij.contract.spec import parse_job
from bij.contract.step_results import PlanResult
from bij.control.decisions import CreateJob, MarkFailed, PlanRound, Publish, RerunStep, Retry, Wait
from bij.control.driver import Driver
from bij.control.driver_types import Observed
from bij.control.observe import parse_ranges
from bij.control.reconcile import decide
from bij.local.jobs import LocalJob
from bij.steps import main as steps

# --- steps, decided by decide() from their Job, pods and report ----------------------------------------

NOW = dt.datetime(2026, 1, 1, 12, 0, tzinfo=dt.timezone.utc)
UID = "bij-uid"


def a_job(backoff: int = 3) -> Any:
    return parse_job({"apiVersion": "batchinference.io/v1alpha1", "kind": "BatchInferenceJob",
                      "metadata": {"name": "emb", "namespace": "ml", "uid": UID},
                      "spec": {"input": {"uri": "file:///in/"}, "output": {"uri": "file:///out/"},
                               "model": {"engine": "echo", "task": "embed"},
                               "workers": {"backoffLimitPerIndex": backoff}}})


def step_job(name: str, *, state: str = "running", failed: int = 0, finished: str = "2026-01-01T11:59:50Z",
             generation: str = "1") -> dict[str, Any]:
    conditions = {"running": [], "done": [{"type": "Complete", "status": "True", "lastTransitionTime": finished}],
                  "failed": [{"type": "Failed", "status": "True", "reason": "FailedIndexes",
                              "message": "Job has failed indexes"}]}[state]
    return {"metadata": {"name": name, "uid": f"{name}-uid", "labels": {
        JOB_LABEL: "emb", STEP_LABEL: name[4:], GENERATION_LABEL: generation},
        "ownerReferences": [{"uid": UID}]},
        "spec": {}, "status": {"active": 1 if state == "running" else 0, "failed": failed, "conditions": conditions}}


def failed_pod(job_name: str, n: int, code: int, reason: str = "Error", message: str = "") -> dict[str, Any]:
    return {"metadata": {"name": f"{job_name}-0-{n}", "labels": {"batch.kubernetes.io/job-name": job_name},
                         "creationTimestamp": f"2026-01-01T11:5{n}:00Z"},
            "status": {"phase": "Failed", "containerStatuses": [{"state": {"terminated": {
                "exitCode": code, "reason": reason, "message": message}}}]}}


def reported(name: str, **report: Any) -> dict[str, Any]:
    return {"reports": {"steps": {name: {"jobUid": f"{name}-uid", "pod": f"{name}-0-1", **report}}}}


def error(code: str, message: str, permanent: bool = False) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "permanent": permanent}}


PUBLISHING = {"phase": "Publishing", "round": 0, "rounds": [{"round": 0, "shards": 1, "lanes": 1,
                                                             "completionTime": "2026-01-01T11:00:00Z"}]}


def test_a_new_bij_runs_its_plan_step_in_phase_planning() -> None:
    d = decide(a_job(), {}, [], now=NOW, generation=1)
    assert isinstance(d, PlanRound) and d.result is None and d.phase == "Planning"
    running = decide(a_job(), {}, [step_job("emb-plan-r0")], now=NOW, generation=1)
    assert isinstance(running, Wait) and running.phase == "Planning" and "emb-plan-r0" in running.message


def test_a_reported_result_is_the_decision_with_its_result() -> None:
    got = {"shards": 2, "lanes": 1, "bytes": 10, "objects": 1}
    d = decide(a_job(), reported("emb-plan-r0", result=got), [step_job("emb-plan-r0", state="done")], now=NOW,
               generation=1)
    # Read into the plan step's model, which writes it back as it came.
    assert isinstance(d, PlanRound) and isinstance(d.result, PlanResult) and d.result.shards == 2
    assert d.result.as_result() == got


@pytest.mark.parametrize("status, code, message, then, reason, says", [
    ({}, "PlanRefused", "spec.output.uri: belongs to team-b/x", MarkFailed, "PlanRefused", ""),
    ({}, "StorageRefused", "list s3://a/in/ as access key id AK: AccessDenied", MarkFailed, "StorageRefused",
     "cannot plan round 0: "),
    ({}, "PlanFailed", "no input objects under file:///in/", Retry, "PlanFailed", "cannot plan round 0: "),
    (PUBLISHING, "TooManyErrors", "12 of 100 rows failed", MarkFailed, "TooManyErrors", ""),
    (PUBLISHING, "WorkFilesRemoved", "removed at noon", MarkFailed, "WorkFilesRemoved", ""),
    (PUBLISHING, "PublishFailed", "a shard summary is missing", Retry, "PublishFailed", "publish failed: "),
    (PUBLISHING, "StorageRefused", "put s3://o/: AccessDenied", MarkFailed, "StorageRefused", "publish failed: "),
    (PUBLISHING, "StorageFailed", "file:///out: Permission denied", Retry, "PublishFailed", "publish failed: "),
])
def test_each_error_code_a_step_reports_is_one_decision(status: dict, code: str, message: str, then: type,
                                                         reason: str, says: str) -> None:
    name = "emb-plan-r0" if not status else "emb-publish-plan"
    d = decide(a_job(), {**status, **reported(name, **error(code, message))}, [step_job(name, state="done")],
               now=NOW, generation=1)
    assert type(d) is then and d.reason == reason and d.message == says + message, d
    if isinstance(d, MarkFailed):
        assert d.event == reason
    else:
        assert d.delay == pytest.approx(20.0)  # 30 s after the step reported, 10 s ago


def test_a_passing_failure_is_run_anew_once_its_retry_is_due() -> None:
    status = reported("emb-plan-r0", **error("PlanFailed", "no input yet"))
    d = decide(a_job(), status, [step_job("emb-plan-r0", state="done", finished="2026-01-01T11:59:00Z")], now=NOW,
               generation=1)
    assert isinstance(d, RerunStep) and d.job_name == "emb-plan-r0" and d.phase == "Planning"


def test_a_step_refused_for_an_earlier_generation_runs_again() -> None:
    status = reported("emb-plan-r0", **error("PlanRefused", "belongs to team-b/x", permanent=True))
    jobs = [step_job("emb-plan-r0", state="done", generation="1")]
    assert isinstance(decide(a_job(), status, jobs, now=NOW, generation=1), MarkFailed)
    assert isinstance(decide(a_job(), status, jobs, now=NOW, generation=2), RerunStep)


def test_a_killed_step_pod_is_said_and_left_to_its_job_to_run_again() -> None:
    name = "emb-finish-r0"
    status = {"phase": "Running", "round": 0, "rounds": [{"round": 0, "shards": 2, "lanes": 1}]}
    round_job = {"metadata": {"name": "emb-r0", "labels": {JOB_LABEL: "emb", ROUND_LABEL: "0"}},
                 "spec": {"completions": 1}, "status": {"completedIndexes": "0", "conditions": [
                     {"type": "Complete", "status": "True"}]}}
    d = decide(a_job(), status, [round_job, step_job(name, failed=1)], now=NOW, generation=1,
               pods=[failed_pod(name, 1, 137, "OOMKilled", "reading records\nstill reading")])
    assert isinstance(d, Wait) and d.warning == "StepRetrying" and d.phase == "Running"
    assert f"step finish-r0 failed (attempt 1 of 4), running it again; Job {name}, pod {name}-0-1: exit code 137 " \
           "(OOMKilled): reading records | still reading" in d.message


def test_a_step_whose_job_gave_up_fails_the_bij_naming_the_pod_and_the_cause() -> None:
    name = "emb-plan-r0"
    pods = [failed_pod(name, n, 1, message="cannot report the result of step plan: PATCH https://k/status: HTTP "
                                            "403: User \"system:serviceaccount:ml:bij-worker\" cannot patch "
                                            "resource \"batchinferencejobs/status\"") for n in (1, 2)]
    d = decide(a_job(backoff=1), {}, [step_job(name, state="failed", failed=2)], now=NOW, generation=1, pods=pods)
    assert isinstance(d, MarkFailed) and d.reason == d.event == "StepFailed" and d.phase == "Failed"
    assert d.message.startswith(f"step plan-r0 failed 2 time(s), giving up (spec.workers.backoffLimitPerIndex 1); "
                                f"Job {name}, last pod {name}-0-2: exit code 1: cannot report")
    assert "HTTP 403" in d.message and "cannot patch resource \"batchinferencejobs/status\"" in d.message


def test_an_internal_error_a_step_reported_is_named_once_its_job_gave_up() -> None:
    name = "emb-plan-r0"
    status = reported(name, **error("Internal", "KeyError: 'shards'"))
    running = decide(a_job(), status, [step_job(name, failed=1)], now=NOW, generation=1)
    assert isinstance(running, Wait) and running.warning == "StepRetrying" and "KeyError: 'shards'" in running.message
    failed = decide(a_job(), status, [step_job(name, state="failed", failed=4)], now=NOW, generation=1)
    assert isinstance(failed, MarkFailed) and "KeyError: 'shards'" in failed.message


def test_a_job_of_the_steps_name_from_an_earlier_object_is_waited_for() -> None:
    old = step_job("emb-plan-r0")
    old["metadata"]["ownerReferences"] = [{"uid": "another"}]
    d = decide(a_job(), {}, [old], now=NOW, generation=1)
    assert isinstance(d, Wait) and d.reason == "WaitingForOldJob"


# --- the driver through a backend ------------------------------------------------------------------------


class FakeBackend:
    """Status and Jobs in memory, Events recorded; `foreign` names Jobs someone else owns."""

    worker_image = "img"
    steps_image = "steps-img"
    file_volume = None

    def __init__(self, job: Any, foreign: set[str] = frozenset()):  # type: ignore[assignment]
        self.job = job
        self.status: dict[str, Any] = {}
        self.jobs: dict[str, dict[str, Any]] = {}
        self.events: list[tuple[str, str, str]] = []
        self.creates: list[str] = []
        self.deletes: list[str] = []
        self.foreign = foreign
        self.lanes: dict[str, Any] = {}  # lane reports by pod, as their Leases hold them

    def observe(self) -> Observed:
        import copy

        from bij.contract.lane_report import tally

        r = self.status.get("round")
        return Observed(job=self.job, spec_error=None, status=copy.deepcopy(self.status), generation=1,
                        output_uri=self.job.spec.output.uri, jobs=[copy.deepcopy(j) for j in self.jobs.values()],
                        lanes=tally(self.lanes.values(), r) if isinstance(r, int) else None)

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
            self.status.setdefault("reports", {}).setdefault("steps", {})[name] = \
                steps.step_report(args, uid).as_status()
            self.jobs[name]["status"] = {"conditions": [{"type": "Complete", "status": "True"}],
                                         "completionTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        return "created"

    def create_service(self, body: dict[str, Any]) -> None:
        self.creates.append(f"service/{body['metadata']['name']}")

    def patch_job(self, name: str, spec: dict[str, Any]) -> None:
        self.jobs[name]["spec"].update(spec)

    def delete_job(self, name: str) -> None:
        self.deletes.append(name)
        self.jobs.pop(name, None)

    def write_status(self, patch: dict[str, Any]) -> None:
        from bij.local.run import merge_patch

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


def test_a_bij_whose_lanes_span_several_pods_gets_its_headless_service_before_its_round_job(
        file_place, make_job) -> None:
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", [{"id": i, "text": f"t{i}"} for i in range(50)]),
                      model={"engine": "simulated", "task": "generate"}, workers={"parallelism": 2, "nodesPerLane": 2})
    backend = FakeBackend(job)
    Driver(backend).reconcile()
    name = job.metadata.name
    assert backend.creates == [f"{name}-plan-r0", f"service/{name}-lanes", f"{name}-r0"]
    round_job = backend.jobs[f"{name}-r0"]
    lanes = backend.status["rounds"][0]["lanes"]
    assert round_job["spec"]["completions"] == 2 * lanes
    assert round_job["spec"]["template"]["spec"]["subdomain"] == f"{name}-lanes"


def test_rows_count_every_finished_round_also_while_the_last_one_publishes(file_place, make_job) -> None:
    from bij.control.status import now_utc

    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", [{"id": 1, "text": "t"}]))
    backend = FakeBackend(job)
    driver = Driver(backend)
    backend.lanes = {"p0": {"round": 1, "lane": 0, "rows": 7, "errors": 1}}
    rounds = [{"round": 0, "completionTime": "2026-01-01T00:00:00Z", "approved": 40, "errors": 2},
              {"round": 1, "startTime": "2026-01-01T00:00:00Z"}]
    backend.status = {"round": 1, "rounds": rounds}
    # Round 1 running: round 0's record and what round 1's lanes reported so far.
    assert driver.progress(backend.observe(), 1, now_utc()).as_patch()["rows"] == {"done": 47, "failed": 3}
    # Round 1 finished and publishing: both records, and no lane report counted twice.
    rounds[1].update(completionTime="2026-01-01T00:01:00Z", approved=9, errors=1)
    assert driver.progress(backend.observe(), 1, now_utc()).as_patch()["rows"] == {"done": 49, "failed": 3}


def test_rows_a_lane_reports_reach_the_status_while_its_shard_is_still_running(file_place, make_job) -> None:
    """A lane commits many chunks of one shard: nothing the decision shows changes (shards, lanes,
    message), yet the status's rows follow the lane's reports, at most once per status interval."""
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", [{"id": i, "text": f"t{i}"} for i in range(50)]))
    backend = FakeBackend(job)
    driver = Driver(backend, status_interval=0.0)
    driver.reconcile()
    name = f"{job.metadata.name}-r0"
    backend.jobs[name]["status"] = {"active": 1}
    driver.reconcile()
    assert backend.status["phase"] == "Running" and backend.status["rows"]["done"] == 0
    for rows in (8, 16):
        backend.lanes = {f"{name}-0-x": {"round": 0, "lane": 0, "rows": rows}}
        driver.reconcile()
        assert backend.status["rows"]["done"] == rows


def test_status_entries_bij_cannot_read_are_named_in_a_condition_and_one_event_and_the_job_goes_on(
        file_place, make_job) -> None:
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", [{"id": i, "text": f"t{i}"} for i in range(50)]))
    backend = FakeBackend(job)
    driver = Driver(backend, status_interval=0.0)
    driver.reconcile()
    name = f"{job.metadata.name}-r0"
    backend.jobs[name]["status"] = {"active": 1}
    backend.lanes = {"stranger": {"round": "zero", "lane": 0}, f"{name}-0-x": {"round": 0, "lane": 0, "rows": 8}}
    backend.status["rounds"].append({"round": 7, "shards": "many"})
    backend.status["conditions"].append("not a condition")
    driver.reconcile()

    def damaged() -> list[dict[str, Any]]:
        return [c for c in backend.status["conditions"] if c["type"] == "StatusDamaged"]

    (cond,) = damaged()
    assert cond["status"] == "True" and cond["reason"] == "UnreadableEntries"
    assert "status.rounds[1]: shards:" in cond["message"]
    warned = [e for e in backend.events if e[1] == "StatusDamaged"]
    assert len(warned) == 1 and warned[0][0] == "Warning" and "status.conditions[" in warned[0][2]
    assert "not a condition" not in backend.status["conditions"]  # dropped, and said so
    # The readable entries still count: the lane's rows, round 0's record.
    assert backend.status["phase"] == "Running" and backend.status["rows"]["done"] == 8
    driver.reconcile()  # the same damage: said once
    assert len([e for e in backend.events if e[1] == "StatusDamaged"]) == 1
    backend.status["rounds"].pop()
    driver.reconcile()
    (cond,) = damaged()
    assert cond["status"] == "False" and cond["reason"] == "Readable"


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
    began = time.monotonic()
    idle = Driver(backend).reconcile()
    took = time.monotonic() - began
    # The retry is due 30 s after the plan step ended, which was at most `took` (plus the clock's second) ago.
    assert isinstance(idle.decision, Retry) and 29.0 - took < (idle.recheck or 0) <= 30.0
    assert backend.status["phase"] == "Planning" and backend.status["message"].startswith("cannot plan round 0: ")
    assert backend.events == [("Warning", "PlanFailed", backend.status["message"])]
    # Once the retry is due the plan Job goes, so that the step plans anew (the input may have arrived by then).
    name = f"{job.metadata.name}-plan-r0"
    assert backend.deletes == []
    backend.jobs[name]["status"]["completionTime"] = "2000-01-01T00:00:00Z"
    idle = Driver(backend).reconcile()
    assert backend.deletes == [name] and isinstance(idle.decision, RerunStep)
    Driver(backend).reconcile()
    assert backend.creates == [name, name] and [e[1] for e in backend.events] == ["PlanFailed"] * 2  # each try said


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
    assert isinstance(idle.decision, Wait) and "rounds" not in backend.status  # waits for its own Job's
    assert backend.status["phase"] == "Planning"


def test_a_step_refused_for_a_spec_since_edited_runs_again(file_place, make_job) -> None:
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", [{"id": 1, "text": "t"}]))
    backend = FakeBackend(job)
    name = f"{job.metadata.name}-plan-r0"
    refused = {"code": "PlanRefused", "message": "spec.output.uri: belongs to another job", "permanent": True}
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


def in_process_job(body: dict, outcomes: list[Any]) -> tuple[LocalJob, list[str], list[tuple[list[str], dict]]]:
    """A LocalJob whose pods run `step` in this process: each call takes the next outcome (an exit code
    to return, or an exception to raise) and logs a line first."""
    import logging

    said: list[str] = []
    calls: list[tuple[list[str], dict]] = []
    left = list(outcomes)

    def step(args: list[str], env: Any) -> int:
        calls.append((args, dict(env)))
        outcome = left.pop(0)
        logging.getLogger("bij.steps").error("attempt %d of index %s", len(calls), env["JOB_COMPLETION_INDEX"])
        if isinstance(outcome, BaseException):
            raise outcome
        return int(outcome)

    lj = LocalJob(body, ["never-run"], {"A": "1"}, say=said.append, in_process=step)
    lj.run(poll=0.01)
    return lj, said, calls


def test_an_in_process_pod_gets_its_args_and_environment_and_is_retried_as_a_process_would_be() -> None:
    lj, said, calls = in_process_job(job_body(1, backoff=2), [1, RuntimeError("storage went away"), 0])
    assert [c["type"] for c in lj.view()["status"]["conditions"]] == ["Complete"]
    assert len(calls) == 3 and all(args == [] for args, _ in calls)  # --metrics-port is dropped as for a process
    assert [env["A"] for _, env in calls] == ["1"] * 3
    assert [env["JOB_COMPLETION_INDEX"] for _, env in calls] == ["0"] * 3
    assert {env["POD_NAME"] for _, env in calls} == {"j-r0-0-1", "j-r0-0-2", "j-r0-0-3"}
    assert said == ["bij: j-r0 index 0 failed (exit 1), retry 1/2", "bij: j-r0 index 0 failed (exit 1), retry 2/2"]
    # Each failed attempt is a failed pod whose message is the end of its log: the exception for the second.
    (first, second) = lj.failed_pods()
    assert first["status"]["containerStatuses"][0]["state"]["terminated"]["message"] == "attempt 1 of index 0"
    assert "RuntimeError: storage went away" in second["status"]["containerStatuses"][0]["state"]["terminated"][
        "message"]


def test_an_in_process_pod_that_exits_42_fails_the_job_at_once() -> None:
    lj, _, calls = in_process_job(job_body(1, backoff=3), [SystemExit(42)])
    (cond,) = lj.view()["status"]["conditions"]
    assert cond["type"] == "Failed" and cond["reason"] == "PodFailurePolicy" and "exit code 42" in cond["message"]
    assert len(calls) == 1


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


def test_a_step_whose_job_gave_up_waits_a_little_for_its_pods_to_say_why() -> None:
    name = "emb-plan-r0"
    gave_up = step_job(name, state="failed", failed=2)
    gave_up["status"]["conditions"][0]["lastTransitionTime"] = "2026-01-01T11:59:50Z"
    soon = decide(a_job(), {}, [gave_up], now=NOW, generation=1)
    assert isinstance(soon, Wait) and soon.reason == "StepFailing" and soon.recheck
    later = decide(a_job(), {}, [gave_up], now=NOW + dt.timedelta(seconds=30), generation=1)
    assert isinstance(later, MarkFailed) and later.message.endswith(
        "Job emb-plan-r0, last FailedIndexes: Job has failed indexes")
    told = decide(a_job(), {}, [gave_up], now=NOW, generation=1, pods=[failed_pod(name, 2, 1, message="boom")])
    assert isinstance(told, MarkFailed) and told.message.endswith(f"last pod {name}-0-2: exit code 1: boom")


def test_a_step_pod_that_cannot_pull_its_image_is_said_naming_the_pod_and_the_reason() -> None:
    name = "emb-publish-plan"
    pod = {"metadata": {"name": f"{name}-0-abcde", "labels": {"batch.kubernetes.io/job-name": name}},
           "status": {"phase": "Pending", "containerStatuses": [{"state": {"waiting": {
               "reason": "ImagePullBackOff", "message": 'Back-off pulling image "registry.local/bij-steps:nope"'}}}]}}
    d = decide(a_job(), PUBLISHING, [step_job(name)], now=NOW, generation=1, pods=[pod])
    assert isinstance(d, Wait) and d.warning == "StepCannotStart" and d.phase == "Publishing" and d.recheck
    assert f"step publish-plan cannot start; Job {name}, pod {name}-0-abcde: ImagePullBackOff: Back-off pulling " \
           'image "registry.local/bij-steps:nope"' in d.message


@pytest.mark.parametrize("stop", [{"cancel": True}, {"deadlineSeconds": 60}])
def test_a_bij_whose_plan_step_cannot_start_still_ends_at_once_when_cancelled_or_expired(stop: dict[str, Any]) -> None:
    from bij.control.decisions import StopHeld

    name = "emb-plan-r0"
    pod = {"metadata": {"name": f"{name}-0-abcde", "labels": {"batch.kubernetes.io/job-name": name}},
           "status": {"phase": "Pending", "containerStatuses": [{"state": {"waiting": {
               "reason": "ErrImagePull", "message": 'pull "registry.local/bij-steps:nope": not found'}}}]}}
    started = {"phase": "Planning", "startTime": "2026-01-01T11:58:00Z"}
    job = a_job()
    stuck = decide(job, started, [step_job(name)], now=NOW, generation=1, pods=[pod])
    assert isinstance(stuck, Wait) and stuck.reason == "StepCannotStart"
    job = job.model_copy(update={"spec": job.spec.model_copy(update={
        "cancel": stop.get("cancel", False), "deadline_seconds": stop.get("deadlineSeconds")})})
    d = decide(job, started, [step_job(name)], now=NOW, generation=1, pods=[pod])
    # Stopping would plan round 0 in that same step: it ends at once instead, nothing ran, its Job goes.
    assert isinstance(d, StopHeld) and d.job_name == name
    assert d.phase == ("Cancelled" if "cancel" in stop else "Expired")
    assert "could not be planned" in d.message and "ErrImagePull" in d.message
    assert "nothing ran and nothing was published" in d.message
    backend = FakeBackend(job)
    backend.jobs[name] = step_job(name)
    Driver(backend)._stop_held(Observed(job=job, spec_error=None, status=dict(started), generation=1,
                                        output_uri=job.spec.output.uri, jobs=[]), job, d, NOW)
    assert backend.deletes == [name] and backend.status["phase"] == d.phase
    assert any(reason == d.phase for _, reason, _ in backend.events)


def test_the_operator_looks_at_a_steps_pods_only_once_one_failed_or_is_slow_to_start() -> None:
    from bij.control.backend import pods_failed, slow_to_start

    running = {"status": {"active": 1, "ready": 0, "startTime": "2026-01-01T12:00:00Z"}}
    started = NOW.timestamp()
    assert not slow_to_start(running, now=started + 5) and slow_to_start(running, now=started + 25)
    assert not slow_to_start({"status": {**running["status"], "ready": 1}}, now=started + 25)
    assert not pods_failed(running)
    # Started, no pod running, not finished: its pod failed and the next is not made yet.
    assert pods_failed({"status": {"active": 0, "startTime": "2026-01-01T12:00:00Z"}})
    assert not pods_failed({"status": {"startTime": "2026-01-01T12:00:00Z", "conditions": [
        {"type": "Complete", "status": "True"}]}})
    assert pods_failed({"status": {"uncountedTerminatedPods": {"failed": ["uid"]}}})
    assert pods_failed({"status": {"conditions": [{"type": "FailureTarget", "status": "True"}]}})


def test_a_step_result_this_operator_cannot_read_fails_the_bij_saying_so(file_place, make_job) -> None:
    _, job = make_job(file_place, file_place.write_jsonl("in.jsonl", [{"id": 1, "text": "t"}]))
    backend = FakeBackend(job)
    name = f"{job.metadata.name}-plan-r0"
    backend.jobs[name] = {"metadata": {"name": name, "uid": "u1", "labels": {STEP_LABEL: "plan-r0",
                                                                          GENERATION_LABEL: "1"}},
                          "spec": {}, "status": {"conditions": [{"type": "Complete", "status": "True"}]}}
    backend.status["reports"] = {"steps": {name: {"jobUid": "u1", "result": {"shardCount": 3}}}}
    idle = Driver(backend).reconcile()
    assert isinstance(idle.decision, MarkFailed) and backend.status["phase"] == "Failed"
    assert "step plan of round 0: its result cannot be read (shards: Field required)" in backend.status["message"]


def test_work_files_left_after_the_manifest_are_a_condition_and_one_warning_and_the_bij_succeeds() -> None:
    job = a_job()
    backend = FakeBackend(job)
    manifest = {"counts": {"rows": 10, "errors": 0}, "files": [{"path": "results/part-0.jsonl"}],
                "workFilesRemoval": {"removed": 2000, "bytes": 9, "left": "file:///out/_bij/x/",
                                     "error": "delete file:///out/_bij/x/y: Permission denied"}}
    result = steps.manifest_summary(Manifest.parse(manifest))  # what the manifest step reports
    d = Publish(round=0, phase="Publishing", reason="Publishing", message="publishing", rounds=1, result=result)
    Driver(backend).published(backend.observe(), job, d, result)
    assert backend.status["phase"] == "Succeeded"
    conditions = {c["type"]: c for c in backend.status["conditions"]}
    assert conditions["Succeeded"]["status"] == "True"
    left = conditions["WorkFilesRemoved"]
    assert left["status"] == "False" and left["reason"] == "RemovalFailed"
    assert "Permission denied" in left["message"] and "file:///out/_bij/x/" in left["message"]
    warnings = [e for e in backend.events if e[0] == "Warning"]
    assert [w[1] for w in warnings] == ["RemovalFailed"] and "Permission denied" in warnings[0][2]
    assert [e[1] for e in backend.events if e[0] == "Normal"] == ["Published"]
