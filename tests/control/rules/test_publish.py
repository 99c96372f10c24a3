"""`rules.publish`: the publish plan, one Job per pass in order, then the manifest."""

from __future__ import annotations

from typing import Any

import pytest

from bij.control.decisions import (
    CreatePublishJob,
    MarkFailed,
    PreparePublish,
    Publish,
    Wait,
)
from bij.control.reconcile import decide
from bij.control.rules import publish
from rules.builders import k8s_job, make_job, observation, planned, publish_pass_job, publishing


def test_a_finished_round_publishes_all_rounds_so_far() -> None:
    d = decide(make_job(), planned(done=True), [k8s_job(completed="0-7")])
    assert isinstance(d, PreparePublish)
    assert (d.rounds, d.phase) == (1, "Publishing")


def test_a_finished_round_whose_job_is_gone_after_its_ttl_still_publishes() -> None:
    d = decide(make_job(), planned(done=True), [])
    assert isinstance(d, PreparePublish)
    assert d.rounds == 1


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


def test_publishing_again_after_a_crash_mid_publish_is_the_decision() -> None:
    status = planned(done=True)
    status["phase"] = "Publishing"
    assert isinstance(decide(make_job(), status, []), PreparePublish)


# --- publishing(): the plan, the passes in order, the manifest -----------------------------------------------

PLAN_URI = "file:///out/_bij/emb/publish/plan.json"


def plan(rounds: int = 1, **passes: int) -> dict[str, Any]:
    """The publish plan's record in the status; `passes`: the indexes of each (ids, dedupe, write), 0 unless said."""
    return {"rounds": rounds, "planUri": PLAN_URI, "passes": {"ids": 0, "dedupe": 0, "write": 0, **passes}}


@pytest.mark.parametrize(("record", "passes", "partial", "kind", "fields"), [
    (None, {}, None, PreparePublish, {"rounds": 1, "partial": None}),
    (None, {}, "Cancelled", PreparePublish, {"rounds": 1, "partial": "Cancelled"}),
    # A plan of another number of rounds (an earlier round's), or none written: planned again.
    (plan(rounds=2, ids=8), {}, None, PreparePublish, {"rounds": 1}),
    ({"rounds": 1, "passes": {"ids": 8}}, {}, None, PreparePublish, {"rounds": 1}),
    # Each pass in order; a pass of no indexes is skipped; never more pods than spec.workers.parallelism.
    (plan(ids=8, dedupe=3, write=8), {}, None, CreatePublishJob,
     {"pass_name": "ids", "completions": 4, "plan_uri": PLAN_URI, "rounds": 1}),
    (plan(ids=8, dedupe=3, write=8), {"ids": "done"}, None, CreatePublishJob,
     {"pass_name": "dedupe", "completions": 3}),
    (plan(dedupe=3, write=2), {}, None, CreatePublishJob, {"pass_name": "dedupe"}),
    (plan(ids=8, write=2), {"ids": "done"}, None, CreatePublishJob, {"pass_name": "write", "completions": 2}),
    (plan(ids=8, dedupe=3), {"ids": "running"}, None, Wait, {"reason": "Publishing", "phase": "Publishing"}),
    (plan(ids=8, dedupe=3), {"ids": "done", "dedupe": "failed"}, None, MarkFailed, {"reason": "PublishFailed"}),
    (plan(ids=8, dedupe=3), {"ids": "old-object"}, None, Wait, {"reason": "WaitingForOldJob"}),
    (plan(ids=8, dedupe=3, write=8), {"ids": "done", "dedupe": "done", "write": "done"}, None, Publish,
     {"rounds": 1, "plan_uri": PLAN_URI, "partial": None}),
    (plan(), {}, "Expired", Publish, {"partial": "Expired"}),
], ids=["unplanned", "unplanned-partial", "other-rounds", "no-plan-uri", "first-pass", "second-pass",
        "empty-pass-skipped", "empty-pass-between", "pass-running", "pass-failed", "old-objects-pass", "manifest",
        "no-passes-partial"])
def test_publishing(record: dict[str, Any] | None, passes: dict[str, str], partial: str | None, kind: type,
                    fields: dict[str, Any]) -> None:
    status = planned(done=True)
    if record is not None:
        status["publish"] = record
    jobs = [publish_pass_job(name, state) if state != "old-object" else
            publish_pass_job(name, "running", owner_uid="uid-of-the-old-object") for name, state in passes.items()]
    got = publish.publishing(make_job(), observation(status, jobs), 0, partial=partial)
    assert isinstance(got, kind), got
    assert {k: getattr(got, k) for k in fields} == fields
    if isinstance(got, MarkFailed):
        assert "publish pass dedupe failed; Job emb-publish-dedupe: FailedIndexes" in got.message
    if isinstance(got, Wait) and got.reason == "Publishing":
        assert got.message == "publishing: pass ids, 0/2 pods done"
