"""The round state machine as a pure function: (spec, status, observed Jobs) -> one decision."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

import pytest

from bij.contract import codes
from bij.contract.lane_report import tally
from bij.contract.spec import BatchInferenceJob, parse_job
from bij.control import observe
from bij.control.decisions import (
    CreateJob,
    CreatePublishJob,
    FinishRound,
    MarkFailed,
    Nothing,
    PatchJob,
    PlanRound,
    PreparePublish,
    Publish,
    Wait,
)
from bij.control.observe import format_ranges, parse_ranges
from bij.control.reconcile import decide
from bij.control.rules.rounds import round_stats
from bij.control.status import decision_status, phase_conditions, rows_progress, set_condition

UID = "0b6a2c1e-uid"


def make_job(*, suspend: bool = False, parallelism: int = 4, judge: dict | None = None,
             task: str = "embed", uid: str | None = UID, queue: str | None = None,
             max_error_ratio: float | None = None) -> BatchInferenceJob:
    spec: dict[str, Any] = {
        "input": {"uri": "file:///data/in"},
        "output": {"uri": "file:///data/out"},
        "model": {"engine": "echo", "task": task},
        "workers": {"parallelism": parallelism},
        "suspend": suspend,
    }
    if queue:
        spec["workers"]["queueName"] = queue
    if max_error_ratio is not None:
        spec["maxErrorRatio"] = max_error_ratio
    if judge is not None:
        spec["judge"] = judge
    meta: dict[str, Any] = {"name": "emb", "namespace": "ml"}
    if uid:
        meta["uid"] = uid
    return parse_job({"apiVersion": "batchinference.io/v1alpha1", "kind": "BatchInferenceJob",
                      "metadata": meta, "spec": spec})


def planned(round_no: int = 0, shards: int = 8, done: bool = False, **extra: Any) -> dict[str, Any]:
    rounds = [{"round": r, "shards": shards, "startTime": "2024-01-01T00:00:00Z",
               "completionTime": "2024-01-01T01:00:00Z", "approved": 10, "rejected": 5} for r in range(round_no)]
    rec: dict[str, Any] = {"round": round_no, "shards": shards, "startTime": "2024-01-01T00:00:00Z"}
    if done:
        rec["completionTime"] = "2024-01-01T01:00:00Z"
    rec.update(extra)
    rounds.append(rec)
    return {"phase": "Running", "round": round_no, "rounds": rounds}


def k8s_job(round_no: int = 0, *, completions: int = 8, parallelism: int = 4, suspend: bool = False,
            completed: str = "", failed: str = "", active: int = 0,
            conditions: Sequence[tuple[str, str, str, str]] = (), owner_uid: str | None = UID,
            name: str = "emb", deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": f"{name}-r{round_no}",
        "namespace": "ml",
        "labels": {codes.JOB_LABEL: name, codes.ROUND_LABEL: str(round_no)},
    }
    if owner_uid:
        meta["ownerReferences"] = [{"apiVersion": "batchinference.io/v1alpha1", "kind": "BatchInferenceJob",
                                    "name": name, "uid": owner_uid, "controller": True}]
    if deleting:
        meta["deletionTimestamp"] = "2024-01-01T00:00:00Z"
    status: dict[str, Any] = {"active": active}
    if completed:
        status["completedIndexes"] = completed
    if failed:
        status["failedIndexes"] = failed
    if conditions:
        status["conditions"] = [{"type": t, "status": s, "reason": r, "message": m}
                                for t, s, r, m in conditions]
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta,
            "spec": {"completions": completions, "parallelism": parallelism, "suspend": suspend,
                     "completionMode": "Indexed"},
            "status": status}


def counted(status: dict[str, Any], done: int, round_no: int = 0, damaged: Sequence[str] = ()) -> tuple[
        dict[str, Any], dict[str, Any]]:
    """`status` with the report of round `round_no`'s finish step (`done` shards), and that step's Job."""
    name = f"emb-finish-r{round_no}"
    step_job = {"metadata": {"name": name, "uid": "finish-uid", "labels": {codes.JOB_LABEL: "emb"}},
                "spec": {}, "status": {"conditions": [{"type": "Complete", "status": "True"}]}}
    report = {"jobUid": "finish-uid", "result": {"done": done, "damaged": list(damaged)}}
    return {**status, "reports": {"steps": {name: report}}}, step_job


# --- index range strings -----------------------------------------------------------------------


@pytest.mark.parametrize("text, indexes", [
    ("", set()),
    (None, set()),
    ("0", {0}),
    ("1,3-5,7", {1, 3, 4, 5, 7}),
    ("0-2,4-6", {0, 1, 2, 4, 5, 6}),
    (" 2 , 9 ", {2, 9}),
])
def test_parse_ranges_reads_the_job_index_syntax(text: str | None, indexes: set[int]) -> None:
    assert parse_ranges(text) == indexes


@pytest.mark.parametrize("indexes, text", [
    ([], ""),
    ([5], "5"),
    ([7, 1, 3, 4, 5], "1,3-5,7"),
    ([0, 1, 2, 3], "0-3"),
    ([2, 2, 3], "2-3"),
])
def test_format_ranges_folds_consecutive_runs(indexes: list[int], text: str) -> None:
    assert format_ranges(indexes) == text
    assert parse_ranges(format_ranges(indexes)) == set(indexes)


# --- the round lifecycle -----------------------------------------------------------------------


def test_a_new_job_plans_round_zero() -> None:
    d = decide(make_job(), {}, [])
    assert isinstance(d, PlanRound)
    assert (d.round, d.phase) == (0, "Planning")


def test_a_planned_round_without_a_job_creates_it_with_one_index_per_lane() -> None:
    d = decide(make_job(), planned(shards=8, lanes=2), [])
    assert isinstance(d, CreateJob)
    assert (d.round, d.completions, d.suspend) == (0, 2, False)
    assert d.shards is not None and d.shards.summary == "0/8"
    assert "8 shards in 2 lanes" in d.message


def test_a_round_planned_before_lanes_existed_has_one_lane_per_shard() -> None:
    d = decide(make_job(), planned(shards=8), [])
    assert isinstance(d, CreateJob) and d.completions == 8


def test_a_suspended_spec_creates_the_job_suspended() -> None:
    d = decide(make_job(suspend=True), planned(shards=3), [])
    assert isinstance(d, CreateJob)
    assert d.suspend is True
    assert d.phase == "Suspended"


def test_an_existing_job_is_never_created_again() -> None:
    # The operator died after creating the Job but before writing anything else.
    d = decide(make_job(), planned(), [k8s_job(active=4)])
    assert not isinstance(d, CreateJob)
    assert isinstance(d, Wait)


def test_a_running_job_reports_shards_from_their_records_and_lanes_from_its_indexes() -> None:
    d = decide(make_job(), planned(), [k8s_job(completed="0-2,5", active=4)], shards_done=6)
    assert isinstance(d, Wait)
    assert d.phase == "Running"
    assert d.shards == observe.Shards(done=6, total=8)
    assert d.lanes == observe.Lanes(done=4, failed=0, active=4, total=8)
    assert "6/8 shards done, 4/8 lanes done" in d.message


def test_a_job_without_pods_yet_is_pending() -> None:
    d = decide(make_job(), planned(), [k8s_job(active=0)])
    assert isinstance(d, Wait)
    assert d.phase == "Pending"


def test_failed_indexes_of_a_running_job_show_but_do_not_fail_the_bij_yet() -> None:
    # With backoffLimitPerIndex the other indexes keep running; the Job decides when it is over.
    d = decide(make_job(), planned(), [k8s_job(completed="0-3", failed="6", active=3)], shards_done=5)
    assert isinstance(d, Wait)
    assert d.phase == "Running"
    assert d.lanes == observe.Lanes(done=4, failed=1, active=3, total=8)
    assert "1 failed (6)" in d.message


def test_a_replaced_lane_group_is_a_warning_once_and_stays_in_the_message_and_lanes() -> None:
    """A lane of several pods replaced whole (its pods' lane reports, summed, say `groupLost`): the Running
    message and status.lanes say so, and the first decision to see each new loss posts a Warning."""
    job = make_job()
    reports = tally([
        {"round": 0, "lane": 0, "rows": 40, "at": "2024-01-01T00:10:00Z",
         "groupLost": "lane 0: member 1 is stopping (SIGTERM)"},
        {"round": 0, "lane": 0, "rows": 5, "at": "2024-01-01T00:20:00Z"},
        {"round": 0, "lane": 1, "rank": 1, "at": "2024-01-01T00:15:00Z",
         "groupLost": "lane 1: the leader is gone (seen by member 1)"},
        {"round": 1, "lane": 0, "groupLost": "another round's"},
    ], 0)
    status = planned()
    d = decide(job, status, [k8s_job(completions=8, active=4)], shards_done=2, lanes_reported=reports)
    assert isinstance(d, Wait) and d.phase == "Running"
    assert d.warning == "LaneGroupReplaced"
    assert d.lanes is not None and d.lanes.replaced == 2 and d.lanes.summary == "0/8 (2 replaced)"
    assert d.message.endswith("a lane's group of pods was replaced 2 times, last: "
                              "lane 1: the leader is gone (seen by member 1)")
    now = dt.datetime(2024, 1, 1, 0, 30, tzinfo=dt.timezone.utc)
    patch = decision_status(status, d, generation=1, now=now, output_uri="file:///data/out")
    assert patch["lanes"]["replaced"] == 2 and patch["lanesSummary"] == "0/8 (2 replaced)"
    # Said once: the status shows both losses now.
    again = decide(job, {**status, "lanes": patch["lanes"]}, [k8s_job(completions=8, active=4)], shards_done=3,
                   lanes_reported=reports)
    assert isinstance(again, Wait) and again.warning is None and again.lanes is not None
    assert again.lanes.replaced == 2
    # No loss: nothing said, and the count is 0 (a merge patch keeps no earlier round's count).
    quiet = decide(job, planned(), [k8s_job(completions=8, active=4)], shards_done=2,
                   lanes_reported=tally([{"round": 0, "lane": 0, "rows": 5}], 0))
    assert isinstance(quiet, Wait) and quiet.warning is None and "replaced" not in quiet.message
    quiet_patch = decision_status(planned(), quiet, generation=1, now=now, output_uri="file:///data/out")
    assert quiet_patch["lanes"]["replaced"] == 0


def test_jobs_of_other_bijs_and_other_rounds_are_ignored() -> None:
    other = k8s_job(name="other", completed="0-7", conditions=[("Complete", "True", "", "")])
    old_round = k8s_job(round_no=1, completed="0-7", conditions=[("Complete", "True", "", "")])
    d = decide(make_job(), planned(), [other, old_round])
    assert isinstance(d, CreateJob)


@pytest.mark.parametrize("condition", ["Complete", "SuccessCriteriaMet"])
def test_a_completed_job_finishes_the_round(condition: str) -> None:
    job = k8s_job(completed="0-7", conditions=[(condition, "True", "CompletionsReached", "")])
    d = decide(make_job(), planned(), [job])
    assert isinstance(d, FinishRound)
    assert d.round == 0
    assert d.shards == observe.Shards(done=8, total=8)


def test_a_condition_that_is_false_means_nothing() -> None:
    job = k8s_job(completed="0-6", active=1, conditions=[("Complete", "False", "", "")])
    assert isinstance(decide(make_job(), planned(), [job]), Wait)


def test_a_finished_round_publishes_all_rounds_so_far() -> None:
    d = decide(make_job(), planned(done=True), [k8s_job(completed="0-7")])
    assert isinstance(d, PreparePublish)
    assert (d.rounds, d.phase) == (1, "Publishing")


def test_a_finished_round_whose_job_is_gone_after_its_ttl_still_publishes() -> None:
    d = decide(make_job(), planned(done=True), [])
    assert isinstance(d, PreparePublish)
    assert d.rounds == 1


PASSES = {"ids": 8, "dedupe": 3, "write": 8}


def publishing(**passes_done: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A status whose publish plan is written, and the pass Jobs: "done", "running" or "failed"."""
    status = planned(done=True)
    status["phase"] = "Publishing"
    status["publish"] = {"rounds": 1, "planUri": "file:///out/_bij/emb/publish/plan.json", "passes": PASSES}
    jobs = []
    for pass_name, state in passes_done.items():
        j = k8s_job(completions=2, completed="0-1" if state == "done" else "", active=2 if state == "running" else 0,
                    conditions=[("Complete", "True", "", "")] if state == "done" else
                    [("Failed", "True", "FailedIndexes", "Job has failed indexes")] if state == "failed" else [])
        j["metadata"]["name"] = f"emb-publish-{pass_name}"
        del j["metadata"]["labels"][codes.ROUND_LABEL]
        j["metadata"]["labels"][codes.PUBLISH_LABEL] = pass_name
        jobs.append(j)
    return status, jobs


def test_publishing_runs_one_job_per_pass_in_order_then_writes_the_manifest() -> None:
    status, jobs = publishing()
    d = decide(make_job(parallelism=4), status, jobs)
    assert isinstance(d, CreatePublishJob)
    assert (d.pass_name, d.completions, d.plan_uri) == ("ids", 4, status["publish"]["planUri"])
    status, jobs = publishing(ids="running")
    d = decide(make_job(), status, jobs)
    assert isinstance(d, Wait) and d.phase == "Publishing" and "pass ids" in d.message
    status, jobs = publishing(ids="done")
    d = decide(make_job(parallelism=4), status, jobs)
    assert isinstance(d, CreatePublishJob) and (d.pass_name, d.completions) == ("dedupe", 3)  # 3 buckets
    status, jobs = publishing(ids="done", dedupe="done", write="done")
    d = decide(make_job(), status, jobs)
    assert isinstance(d, Publish) and d.rounds == 1
    # The round Job's indexes are not a publish pass's, nor the other way round.
    assert isinstance(decide(make_job(), *publishing(ids="done", dedupe="done", write="done")), Publish)


def test_a_failed_publish_pass_fails_the_bij_naming_it() -> None:
    status, jobs = publishing(ids="done", dedupe="failed")
    d = decide(make_job(), status, jobs)
    assert isinstance(d, MarkFailed) and d.reason == "PublishFailed"
    assert "publish pass dedupe failed; Job emb-publish-dedupe: FailedIndexes" in d.message


def test_an_unfinished_round_whose_job_vanished_is_recreated() -> None:
    # Someone deleted the Job mid-round: workers resume from durable state, nothing is redone.
    d = decide(make_job(), planned(shards=5), [])
    assert isinstance(d, CreateJob)
    assert d.completions == 5


def test_an_empty_input_finishes_its_round_without_a_job() -> None:
    d = decide(make_job(), planned(shards=0), [])
    assert isinstance(d, FinishRound)
    assert d.shards == observe.Shards(done=0, total=0)


def test_publishing_again_after_a_crash_mid_publish_is_the_decision() -> None:
    status = planned(done=True)
    status["phase"] = "Publishing"
    assert isinstance(decide(make_job(), status, []), PreparePublish)


def test_a_succeeded_bij_is_left_alone() -> None:
    status = planned(done=True)
    status["phase"] = "Succeeded"
    assert isinstance(decide(make_job(), status, [k8s_job(completed="0-7")]), Nothing)


# --- failures ----------------------------------------------------------------------------------


def test_a_failed_job_with_shards_undone_marks_the_bij_failed_naming_the_failed_lanes() -> None:
    job = k8s_job(completed="0-1,3-5,7", failed="2,6",
                  conditions=[("Failed", "True", "FailedIndexes", "Job has failed indexes")])
    # Its finish step counts the shards done first.
    d = decide(make_job(), planned(), [job], shards_done=6)
    assert isinstance(d, FinishRound) and d.result is None and d.reason == "RoundFinishing"
    status, step_job = counted(planned(), done=6)
    d = decide(make_job(), status, [job, step_job])
    assert isinstance(d, MarkFailed)
    assert d.phase == "Failed"
    assert d.reason == "FailedIndexes"
    assert d.failed_lanes == (2, 6)
    assert "lanes 2,6 failed with 2 of 8 shards undone" in d.message
    assert "emb-r0" in d.message


def test_failed_lanes_whose_shards_the_others_finished_leave_the_round_whole() -> None:
    job = k8s_job(completions=4, completed="0-1,3", failed="2",
                  conditions=[("Failed", "True", "FailedIndexes", "Job has failed indexes")])
    status, step_job = counted(planned(shards=8, lanes=4), done=8)
    d = decide(make_job(), status, [job, step_job])
    assert isinstance(d, FinishRound) and d.result is not None and d.result.as_result() == {"done": 8, "damaged": []}
    assert d.shards == observe.Shards(done=8, total=8)
    assert "lane 2 failed; the other lanes finished its shards" in d.message
    assert d.failed_lanes == (2,)
    # Without the shard records the operator cannot tell: the Job's verdict stands.
    status, step_job = counted(planned(shards=8, lanes=4), done=5)
    assert isinstance(decide(make_job(), status, [job, step_job]), MarkFailed)


def test_failure_target_fails_the_round_before_the_pods_are_gone() -> None:
    job = k8s_job(active=2, conditions=[
        ("FailureTarget", "True", "PodFailurePolicy",
         "Container worker for pod ml/emb-r0-3-x failed with exit code 42 matching FailJob rule at index 3"),
    ])
    status, step_job = counted(planned(), done=5)
    d = decide(make_job(), status, [job, step_job])
    assert isinstance(d, MarkFailed)
    assert d.reason == "PodFailurePolicy"
    assert d.failed_lanes == (3,)
    assert "round 0: lane 3 failed" in d.message
    # A bad configuration fails the bij even when the other lanes got every shard done meanwhile.
    status, step_job = counted(planned(), done=8)
    assert isinstance(decide(make_job(), status, [job, step_job]), MarkFailed)
    assert "exit code 42" in d.message


def test_a_failed_bij_stays_failed() -> None:
    status = planned()
    status["phase"] = "Failed"
    status["conditions"] = [{"type": "Failed", "status": "True", "reason": "FailedIndexes", "message": "x"}]
    failed = k8s_job(failed="1", conditions=[("Failed", "True", "FailedIndexes", "")])
    d = decide(make_job(), status, [failed])
    assert isinstance(d, Nothing)
    assert d.phase == "Failed"


def test_a_bij_failed_for_an_invalid_spec_starts_once_the_spec_is_valid() -> None:
    status = {"phase": "Failed", "conditions": [
        {"type": "Failed", "status": "True", "reason": "InvalidSpec", "message": "spec.model.engine: bad"}]}
    assert isinstance(decide(make_job(), status, []), PlanRound)


# --- suspend and parallelism -------------------------------------------------------------------


def test_suspending_the_spec_patches_the_running_job() -> None:
    d = decide(make_job(suspend=True), planned(), [k8s_job(completed="0-2", active=4)])
    assert isinstance(d, PatchJob)
    assert (d.job_name, d.suspend, d.parallelism) == ("emb-r0", True, None)
    assert d.phase == "Suspended"
    # Progress is kept: the done lanes are still reported.
    assert d.lanes is not None and d.lanes.done == 3


def test_resuming_the_spec_unsuspends_the_job() -> None:
    d = decide(make_job(suspend=False), planned(), [k8s_job(completed="0-2", suspend=True)])
    assert isinstance(d, PatchJob)
    assert d.suspend is False
    assert d.phase == "Running"


def test_a_suspended_job_that_matches_the_spec_waits_suspended() -> None:
    d = decide(make_job(suspend=True), planned(), [k8s_job(completed="0-2", suspend=True)], shards_done=5)
    assert isinstance(d, Wait)
    assert d.phase == "Suspended"
    assert d.shards is not None and d.shards.summary == "5/8"
    assert d.lanes is not None and d.lanes.summary == "3/8"


def test_a_parallelism_change_is_applied_to_the_job() -> None:
    d = decide(make_job(parallelism=6), planned(), [k8s_job(parallelism=4, active=4)])
    assert isinstance(d, PatchJob)
    assert (d.suspend, d.parallelism) == (None, 6)
    # More pods than shards cannot run: the patch stops at the Job's completions.
    d = decide(make_job(parallelism=16), planned(), [k8s_job(parallelism=4, active=4)])
    assert isinstance(d, PatchJob)
    assert d.parallelism == 8


def test_parallelism_capped_by_the_shard_count_is_not_patched() -> None:
    # The Job runs min(parallelism, shards) pods; that is not a difference to fix.
    d = decide(make_job(parallelism=16), planned(shards=3), [k8s_job(completions=3, parallelism=3, active=3)])
    assert isinstance(d, Wait)


def test_a_job_queued_in_kueue_is_never_unsuspended_by_the_operator() -> None:
    d = decide(make_job(queue="gpu"), planned(), [k8s_job(suspend=True)])
    assert isinstance(d, Wait)
    assert (d.phase, d.reason) == ("Pending", "Queued")


def test_a_job_queued_in_kueue_is_still_suspended_on_request() -> None:
    d = decide(make_job(queue="gpu", suspend=True), planned(), [k8s_job(active=2)])
    assert isinstance(d, PatchJob)
    assert d.suspend is True


def test_a_completed_job_is_not_resumed_or_patched() -> None:
    job = k8s_job(completed="0-7", suspend=True, conditions=[("Complete", "True", "", "")])
    assert isinstance(decide(make_job(suspend=False), planned(), [job]), FinishRound)


# --- ownership ---------------------------------------------------------------------------------


def test_a_job_left_by_a_deleted_bij_of_the_same_name_is_waited_out() -> None:
    stale = k8s_job(owner_uid="uid-of-the-old-object", completed="0-7",
                    conditions=[("Complete", "True", "", "")])
    d = decide(make_job(), planned(), [stale])
    assert isinstance(d, Wait)
    assert d.reason == "WaitingForOldJob"


def test_a_job_being_deleted_is_not_ours_to_finish() -> None:
    d = decide(make_job(), planned(), [k8s_job(deleting=True, completed="0-7",
                                               conditions=[("Complete", "True", "", "")])])
    assert isinstance(d, Wait)


def test_a_job_of_the_same_name_without_our_label_is_not_ours() -> None:
    foreign = k8s_job(owner_uid=None)
    del foreign["metadata"]["labels"][codes.JOB_LABEL]
    assert not observe.owns(make_job(), foreign)
    assert observe.owns(make_job(), k8s_job())
    assert not observe.owns(make_job(), k8s_job(owner_uid="someone-else"))


def test_locally_named_jobs_without_uid_match_by_labels() -> None:
    job = k8s_job(owner_uid=None, completed="0-7", conditions=[("Complete", "True", "", "")])
    assert isinstance(decide(make_job(uid=None), planned(), [job]), FinishRound)


def test_too_many_error_rows_fail_instead_of_publishing() -> None:
    status = planned(done=True, approved=80, capped=10, errors=10)
    d = decide(make_job(max_error_ratio=0.05), status, [])
    assert isinstance(d, MarkFailed)
    assert d.reason == "TooManyErrors"
    assert "10 of 100 rows failed" in d.message


def test_error_rows_within_the_budget_publish() -> None:
    d = decide(make_job(max_error_ratio=0.2), planned(done=True, approved=90, errors=10), [])
    assert isinstance(d, PreparePublish)


# --- judge rounds ------------------------------------------------------------------------------


JUDGE = {"type": "regex", "pattern": "ok", "strategy": "rounds", "maxRounds": 3}


def test_a_round_with_rejected_rows_plans_the_next_round() -> None:
    d = decide(make_job(task="generate", judge=JUDGE), planned(done=True, rejected=5), [])
    assert isinstance(d, PlanRound)
    assert d.round == 1


def test_the_last_allowed_round_caps_its_rejects_and_publishes() -> None:
    # The worker of the final round records still-rejected rows as capped, not rejected.
    d = decide(make_job(task="generate", judge=JUDGE), planned(round_no=2, done=True, rejected=0, capped=5), [])
    assert isinstance(d, PreparePublish)
    assert d.rounds == 3


def test_a_round_without_rejections_publishes() -> None:
    d = decide(make_job(task="generate", judge=JUDGE), planned(done=True, rejected=0), [])
    assert isinstance(d, PreparePublish)


def test_without_a_judge_rejections_cannot_add_rounds() -> None:
    assert isinstance(decide(make_job(), planned(done=True, rejected=5), []), PreparePublish)


def test_the_second_round_creates_its_own_job() -> None:
    d = decide(make_job(task="generate", judge=JUDGE), planned(round_no=1, shards=2),
               [k8s_job(round_no=0, completed="0-7", conditions=[("Complete", "True", "", "")])])
    assert isinstance(d, CreateJob)
    assert (d.round, d.completions) == (1, 2)


# --- replaying a whole run ---------------------------------------------------------------------


def test_replaying_the_decisions_of_a_whole_run_reaches_succeeded_with_one_job_per_round_and_pass() -> None:
    """Apply each decision to a fake cluster the way the handler does, and count Jobs."""
    job = make_job()
    status: dict[str, Any] = {}
    jobs: list[dict[str, Any]] = []
    created: list[str] = []
    for step in range(30):  # noqa: B007 - asserted after the loop
        d = decide(job, status, jobs)
        status.update({"phase": d.phase, "round": d.round})
        if isinstance(d, PlanRound):
            status.setdefault("rounds", []).append({"round": d.round, "shards": 12, "lanes": 3})
        elif isinstance(d, CreateJob):
            created.append("r0")
            jobs.append(k8s_job(completions=d.completions, parallelism=3, active=3))
        elif isinstance(d, CreatePublishJob):
            created.append(d.pass_name)
            j = k8s_job(completions=d.completions, parallelism=d.completions, active=d.completions)
            del j["metadata"]["labels"][codes.ROUND_LABEL]
            j["metadata"]["labels"][codes.PUBLISH_LABEL] = d.pass_name
            jobs.append(j)
        elif isinstance(d, Wait):
            # The Job controller finishes every index of the Job last created.
            n = jobs[-1]["spec"]["completions"]
            jobs[-1]["status"] = {"completedIndexes": f"0-{n - 1}", "conditions": [
                {"type": "Complete", "status": "True"}]}
        elif isinstance(d, FinishRound):
            status["rounds"][d.round]["completionTime"] = "2024-01-01T01:00:00Z"
        elif isinstance(d, PreparePublish):
            status["publish"] = {"rounds": d.rounds, "planUri": "file:///p.json", "passes": PASSES}
        elif isinstance(d, Publish):
            status["phase"] = "Succeeded"
        elif isinstance(d, Nothing):
            break
    assert status["phase"] == "Succeeded"
    assert created == ["r0", "ids", "dedupe", "write"]
    assert jobs[0]["spec"]["completions"] == 3  # a Job of 3 lanes for 12 shards
    assert step < 20


# --- status and conditions ---------------------------------------------------------------------

T0 = dt.datetime(2024, 1, 1, tzinfo=dt.timezone.utc)
T1 = T0 + dt.timedelta(seconds=30)


def test_a_condition_keeps_its_transition_time_while_its_status_holds() -> None:
    cs = set_condition([], "Running", True, "Running", "1/8", generation=1, now=T0)
    cs = set_condition(cs, "Running", True, "Running", "5/8", generation=2, now=T1)
    assert cs == [{"type": "Running", "status": "True", "reason": "Running", "message": "5/8",
                   "lastTransitionTime": "2024-01-01T00:00:00Z", "observedGeneration": 2}]
    cs = set_condition(cs, "Running", False, "Suspended", "", generation=2, now=T1)
    assert cs[0]["lastTransitionTime"] == "2024-01-01T00:00:30Z"


def test_phase_conditions_list_every_type_once_with_the_phase_true() -> None:
    cs = phase_conditions([], "Suspended", "Suspended", "round 0 suspended", generation=3, now=T0)
    by_type = {c["type"]: c for c in cs}
    assert sorted(by_type) == sorted(["Ready", "Running", "Suspended", "Succeeded", "Failed"])
    assert by_type["Suspended"]["status"] == "True"
    assert by_type["Running"]["status"] == "False"
    assert by_type["Ready"]["status"] == "False"
    assert by_type["Ready"]["message"] == "round 0 suspended"
    assert all(c["observedGeneration"] == 3 for c in cs)


def test_decision_status_fills_the_printer_columns() -> None:
    d = decide(make_job(), planned(), [k8s_job(completed="0-2", active=4)], shards_done=5)
    patch = decision_status({}, d, generation=1, now=T0, output_uri="file:///data/out")
    assert patch["phase"] == "Running"
    assert patch["round"] == 0
    assert patch["shardsSummary"] == "5/8"
    assert patch["shards"] == {"done": 5, "total": 8}
    assert patch["lanesSummary"] == "3/8"
    assert patch["lanes"] == {"done": 3, "failed": 0, "active": 4, "total": 8, "replaced": 0}
    assert patch["startTime"] == "2024-01-01T00:00:00Z"
    assert "completionTime" not in patch


def test_rows_progress_sums_completion_records_over_wall_time() -> None:
    records = [{"rows": 100, "errors": 2}, {"rows": 50, "errors": 0}]
    out = rows_progress(records, "2024-01-01T00:00:00Z", T1)
    assert out == {"rows": {"done": 150, "failed": 2}, "rowsPerSecond": 5.0}


# --- a plan is a promise: edits of what decides the rows after planning ---------------------------


def with_fields(job: BatchInferenceJob, **spec: Any) -> BatchInferenceJob:
    doc = job.model_dump(mode="json", by_alias=True, exclude_none=True)
    for section, fields in spec.items():
        doc["spec"][section] = {**doc["spec"].get(section, {}), **fields}
    return parse_job(doc)


def test_editing_a_row_deciding_field_after_planning_fails_the_bij_naming_it() -> None:
    from bij.contract.fingerprint import field_digests

    job = make_job()
    status = planned(0, specDigests=field_digests(job))
    edited = with_fields(job, model={"name": "another-model"}, input={"textField": "body"})
    d = decide(edited, status, [k8s_job(0, completed="0-3", active=4)])
    assert isinstance(d, MarkFailed) and d.reason == "SpecChanged"
    assert "spec.input.textField, spec.model.name changed after round 0 was planned" in d.message
    # Fields that only say how the work is done may change; so may a spec changed back.
    assert isinstance(decide(with_fields(job, workers={"parallelism": 2}), status, []), CreateJob)
    failed = {**status, "phase": "Failed", "conditions": [{"type": "Failed", "status": "True",
                                                           "reason": "SpecChanged"}]}
    assert isinstance(decide(job, failed, []), CreateJob)


def test_round_records_are_read_typed_and_an_entry_that_is_no_record_is_left_out() -> None:
    from bij.contract.round_record import RoundRecord, round_records
    from bij.contract.status import JobStatus

    status = {"rounds": [
        {"round": 0, "shards": 8, "lanes": 2, "bytes": 512, "startTime": "2026-01-01T00:00:00Z",
         "completionTime": "2026-01-01T00:05:00Z", "approved": 70, "rejected": 5, "capped": 1, "errors": 4,
         "engineCalls": 9, "approvalRate": 0.875, "rowsIn": 80, "specDigests": {"spec.model": "abc"}},
        {"round": 1, "shards": 3, "startTime": "2026-01-01T00:05:01Z"},
        {"shards": 4},  # no round number
        {"round": 2, "shards": "many"},  # not a count
        "not a record",
    ]}
    got = round_records(status)
    assert sorted(got) == [0, 1]
    assert got[0].finished and got[0].spec_digests == {"spec.model": "abc"} and got[0].stats().approved == 70
    assert got[1] == RoundRecord(round=1, shards=3, start_time="2026-01-01T00:05:01Z") and not got[1].finished
    state = JobStatus.read(status)
    assert state.round_records() == got and len(state.problems) == 3  # each entry left out is named
    assert round_stats(state) == [got[0].stats()]  # round 1 has not finished
    assert round_records({"rounds": "garbage"}) == {}
