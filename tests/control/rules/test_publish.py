"""`rules.publish`: the publish plan, one Job per pass in order, then the manifest."""

from __future__ import annotations

from bij.control.decisions import (
    CreatePublishJob,
    MarkFailed,
    PreparePublish,
    Publish,
    Wait,
)
from bij.control.reconcile import decide
from rules.builders import k8s_job, make_job, planned, publishing


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
