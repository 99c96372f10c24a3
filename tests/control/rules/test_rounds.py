"""`rules.rounds`: a round from its Job: create it, keep it in line with the spec, count and finish it once it
ended, fail the bij with the lanes that failed; then the next judge round or publishing (`after_round`); and a
row-deciding spec field edited after planning (`spec_changed`)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from bij.contract.lane_report import tally
from bij.contract.spec import BatchInferenceJob, parse_job
from bij.contract.status import JobStatus
from bij.control import observe
from bij.control.decisions import (
    CreateJob,
    FinishRound,
    MarkFailed,
    PatchJob,
    PlanRound,
    PreparePublish,
    Wait,
)
from bij.control.observe import JobView, Shards
from bij.control.reconcile import decide
from bij.control.rules.rounds import job_failed, round_stats, single_job_round, spec_changed
from rules.builders import JUDGE, counted, decision_status, k8s_job, make_job, observation, planned

# --- the round's Job -----------------------------------------------------------------------------------


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


def test_an_unfinished_round_whose_job_vanished_is_recreated() -> None:
    # Someone deleted the Job mid-round: workers resume from durable state, nothing is redone.
    d = decide(make_job(), planned(shards=5), [])
    assert isinstance(d, CreateJob)
    assert d.completions == 5


def test_an_empty_input_finishes_its_round_without_a_job() -> None:
    d = decide(make_job(), planned(shards=0), [])
    assert isinstance(d, FinishRound)
    assert d.shards == observe.Shards(done=0, total=0)


# --- failures ------------------------------------------------------------------------------------------


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


def _ended_job(failed: str, reason: str, message: str) -> JobView:
    return JobView.of({"metadata": {"name": "j-r0"}, "spec": {"completions": 4},
                       "status": {"failedIndexes": failed, "conditions": [
                           {"type": "Failed", "status": "True", "reason": reason, "message": message}]}})


@pytest.mark.parametrize(("view", "lanes", "message"), [
    (_ended_job("1,3", "BackoffLimitExceeded", "too many retries"), (1, 3),
     "round 0: lanes 1,3 failed with 2 of 8 shards undone; Job j-r0: BackoffLimitExceeded (too many retries)"),
    # FailJob names no failed index, only the pod: its name says the lane.
    (_ended_job("", "PodFailurePolicy", "Container worker for pod ns/j-r0-2-x7k2q failed with exit code 42"), (2,),
     "round 0: lane 2 failed with 2 of 8 shards undone; Job j-r0: PodFailurePolicy (Container worker for pod "
     "ns/j-r0-2-x7k2q failed with exit code 42)"),
])
def test_job_failed(view: JobView, lanes: tuple[int, ...], message: str) -> None:
    got = job_failed(0, view, Shards(done=6, total=8))
    assert (got.phase, got.failed_lanes, got.message) == ("Failed", lanes, message)


# --- suspend and parallelism ---------------------------------------------------------------------------


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


# --- ownership -----------------------------------------------------------------------------------------


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


def test_locally_named_jobs_without_uid_match_by_labels() -> None:
    job = k8s_job(owner_uid=None, completed="0-7", conditions=[("Complete", "True", "", "")])
    assert isinstance(decide(make_job(uid=None), planned(), [job]), FinishRound)


# --- after a round: error budget, judge rounds ---------------------------------------------------------


def test_too_many_error_rows_fail_instead_of_publishing() -> None:
    status = planned(done=True, approved=80, capped=10, errors=10)
    d = decide(make_job(max_error_ratio=0.05), status, [])
    assert isinstance(d, MarkFailed)
    assert d.reason == "TooManyErrors"
    assert "10 of 100 rows failed" in d.message


def test_error_rows_within_the_budget_publish() -> None:
    d = decide(make_job(max_error_ratio=0.2), planned(done=True, approved=90, errors=10), [])
    assert isinstance(d, PreparePublish)


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


# --- a plan is a promise: edits of what decides the rows after planning --------------------------------


def test_spec_changed_with_nothing_recorded_is_none() -> None:
    assert spec_changed(make_job(), JobStatus.read({})) is None


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


# --- single_job_round(): a round in one Job, from its Job alone ------------------------------------------------

FAILED_INDEXES = ("Failed", "True", "FailedIndexes", "Job has failed indexes")
EXIT_42 = ("FailureTarget", "True", "PodFailurePolicy",
           "Container worker for pod ml/emb-r0-3-x failed with exit code 42 matching FailJob rule at index 3")


@pytest.mark.parametrize(("spec", "planned_shards", "job", "finished", "kind", "fields"), [
    ({}, 0, None, None, FinishRound, {"reason": "RoundFinished", "shards": Shards(done=0, total=0)}),
    ({}, 8, None, None, CreateJob, {"completions": 4, "suspend": False, "phase": "Pending", "reason": "RoundStarting"}),
    ({"suspend": True}, 8, None, None, CreateJob, {"suspend": True, "phase": "Suspended"}),
    ({}, 8, {"owner_uid": "uid-of-the-old-object", "active": 4}, None, Wait, {"reason": "WaitingForOldJob"}),
    ({"suspend": True}, 8, {"active": 4}, None, PatchJob, {"suspend": True, "parallelism": None}),
    ({}, 8, {"suspend": True}, None, PatchJob, {"suspend": False, "phase": "Running"}),
    ({"queue": "gpu"}, 8, {"suspend": True}, None, Wait, {"reason": "Queued", "phase": "Pending"}),
    ({"suspend": True}, 8, {"suspend": True}, None, Wait, {"reason": "Suspended", "phase": "Suspended"}),
    ({"parallelism": 2}, 8, {"completions": 4, "active": 4}, None, PatchJob, {"suspend": None, "parallelism": 2}),
    ({"parallelism": 16}, 8, {"completions": 4, "active": 4}, None, Wait, {"reason": "Running"}),
    ({}, 8, {"completions": 4}, None, Wait, {"reason": "WaitingForPods", "phase": "Pending"}),
    ({}, 8, {"completions": 4, "active": 4, "completed": "0"}, None, Wait, {"reason": "Running", "phase": "Running"}),
    # No pod active, but lanes got done: running (between pods), not waiting for the first.
    ({}, 8, {"completions": 4, "completed": "0-1"}, None, Wait, {"reason": "Running", "phase": "Running"}),
    # Its Job ended: its finish step counts the shards first, then the round finishes or fails.
    ({}, 8, {"completions": 4, "completed": "0-3", "conditions": [("Complete", "True", "", "")]}, None, FinishRound,
     {"reason": "RoundFinishing", "result": None}),
    ({}, 8, {"completions": 4, "completed": "0-3", "conditions": [("Complete", "True", "", "")]}, 8, FinishRound,
     {"reason": "RoundFinished", "shards": Shards(done=8, total=8), "failed_lanes": ()}),
    ({}, 8, {"completions": 4, "completed": "0-2", "failed": "3", "conditions": [FAILED_INDEXES]}, 6, MarkFailed,
     {"reason": "FailedIndexes", "failed_lanes": (3,), "shards": Shards(done=6, total=8)}),
    ({}, 8, {"completions": 4, "completed": "0-2", "failed": "3", "conditions": [FAILED_INDEXES]}, 8, FinishRound,
     {"reason": "RoundFinished", "failed_lanes": (3,)}),
    ({}, 8, {"completions": 4, "conditions": [EXIT_42]}, 8, MarkFailed, {"reason": "PodFailurePolicy",
                                                                        "failed_lanes": (3,)}),
    ({}, 8, {"completions": 4, "conditions": [EXIT_42]}, (5, "in/a.jsonl: gzip stream cut"), MarkFailed,
     {"reason": "DamagedInput", "event": "DamagedInput"}),
    # A damaged object counted, but no worker stopped at it (no exit 42): the lanes' failure is the cause.
    ({}, 8, {"completions": 4, "completed": "0-2", "failed": "3", "conditions": [FAILED_INDEXES]},
     (6, "in/a.jsonl: gzip stream cut"), MarkFailed, {"reason": "FailedIndexes"}),
], ids=["empty-round", "no-job", "no-job-suspended", "old-objects-job", "suspend", "resume", "queued",
        "held-suspended", "parallelism", "parallelism-capped", "waiting-for-pods", "running",
        "running-between-pods", "ended-uncounted", "succeeded", "lanes-failed-shards-left",
        "lanes-failed-others-finished", "bad-configuration", "damaged-input", "damaged-without-exit-42"])
def test_single_job_round(spec: dict[str, Any], planned_shards: int, job: dict[str, Any] | None,
                          finished: int | tuple[int, str] | None, kind: type, fields: dict[str, Any]) -> None:
    status = planned(shards=planned_shards, lanes=4)
    jobs = [k8s_job(**job)] if job is not None else []
    if finished is not None:
        done, damaged = finished if isinstance(finished, tuple) else (finished, "")
        status, step = counted(status, done=done, damaged=[damaged] if damaged else [])
        jobs.append(step)
    got = single_job_round(make_job(**spec), observation(status, jobs), 0, 4, planned_shards, None, None)
    assert isinstance(got, kind), got
    assert {k: getattr(got, k) for k in fields} == fields
    if isinstance(got, MarkFailed) and got.reason == "DamagedInput":
        assert "damaged input: in/a.jsonl: gzip stream cut" in got.message
