"""Errors bij raises on purpose derive from one base, and a plain bug is never caught as one.

A `BijError` is an expected failure (`.permanent`: whether a retry can help). Catching them by
their own types, not `RuntimeError` or `Exception`, keeps a KeyError or a NotImplementedError
from reading as "storage hiccup, retry in 30 s".
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from bij.cli.main import main as bij_main
from bij.contract.errors import BijError
from bij.contract.fingerprint import PlanRefused
from bij.contract.spec import SpecError
from bij.steps import planner
from bij.steps.plan_input import PlanError
from bij.steps.publish import ErrorRatioExceeded, PublishError, WorkFilesRemoved
from bij.steps.publish_rows import PublishPlanError
from bij.steps.results import ResultsError
from bij.storage import NotFound, ObjectChanged, S3Storage, StorageError
from bij.worker.claim import Claim
from bij.worker.lanes import LeaseKeeper
from bij.worker.reader import CorruptInput
from bij.worker.shard import BadConfig, EngineFailure

ERRORS: list[type[BijError]] = [StorageError, NotFound, ObjectChanged, PublishError, ErrorRatioExceeded,
                                WorkFilesRemoved, ResultsError, PlanError, PlanRefused, SpecError,
                                PublishPlanError, BadConfig, EngineFailure, CorruptInput]


@pytest.mark.parametrize("cls", ERRORS, ids=lambda c: c.__name__)
def test_bij_errors_share_one_base_and_are_not_runtime_errors(cls: type[BijError]) -> None:
    assert issubclass(cls, BijError)
    # Neither RuntimeError (a NotImplementedError or RecursionError is one) nor ValueError (a bad
    # int() or a json error is one): catching those would catch bugs too.
    assert not issubclass(cls, (RuntimeError, ValueError))


def test_what_no_retry_fixes_says_so() -> None:
    assert SpecError(["spec.x: bad"]).permanent and PlanRefused("taken").permanent
    assert BadConfig("no plan").permanent and PublishPlanError("no plan").permanent
    assert PlanError("no input").permanent and not PlanError("outage", permanent=False).permanent
    assert NotFound("gone").permanent and not StorageError("outage").permanent
    assert not PublishError("not yet").permanent and not EngineFailure("broken").permanent


def s3_without_client() -> S3Storage:
    return S3Storage(client=object(), max_attempts=2, base_delay=0.0)


def test_a_bug_inside_an_s3_call_propagates_as_itself() -> None:
    def buggy() -> None:
        raise KeyError("ETag")

    # It used to become StorageError(permanent=True): the worker exited 42, "bad configuration".
    with pytest.raises(KeyError):
        s3_without_client()._call("read", "s3://b/k", buggy)


def test_an_s3_outage_is_still_a_retryable_storage_error() -> None:
    from botocore.exceptions import EndpointConnectionError

    calls = []

    def down() -> None:
        calls.append(1)
        raise EndpointConnectionError(endpoint_url="http://127.0.0.1:9")

    with pytest.raises(StorageError) as err:
        s3_without_client()._call("read", "s3://b/k", down)
    assert not err.value.permanent and len(calls) == 2


def write_job(tmp_path: Path) -> Path:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text('{"id": 1, "text": "x"}\n')
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({
        "apiVersion": "batchinference.io/v1alpha1", "kind": "BatchInferenceJob", "metadata": {"name": "e"},
        "spec": {"input": {"uri": f"file://{tmp_path}/in"}, "output": {"uri": f"file://{tmp_path}/out"}}}))
    return path


def test_bij_render_reports_a_storage_error_but_lets_a_bug_through(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_job(tmp_path)

    def outage(job: Any, round_no: int) -> int:
        raise StorageError("list s3://b/in: still failing after 8 attempts")

    monkeypatch.setattr(planner, "plan_shards_for", outage)
    assert bij_main(["render", str(path)]) == 1
    assert "cannot plan round 0" in capsys.readouterr().err

    def unfinished(job: Any, round_no: int) -> int:
        raise NotImplementedError("a code path nobody wrote")  # a RuntimeError: it used to read as "cannot plan"

    monkeypatch.setattr(planner, "plan_shards_for", unfinished)
    with pytest.raises(NotImplementedError):
        bij_main(["render", str(path)])


class FakeClaims:
    lane, lease = 0, 0.03

    def __init__(self, error: BaseException):
        self.error, self.calls = error, 0

    def renew(self, claim: Claim) -> bool:
        self.calls += 1
        raise self.error


def test_a_lease_keeper_retries_a_storage_hiccup_but_not_a_bug(monkeypatch: pytest.MonkeyPatch) -> None:
    claim = Claim(0, 0, 0, "w", 0.0)
    hiccup = FakeClaims(StorageError("put: SlowDown"))
    keeper = LeaseKeeper(hiccup, claim, lost=lambda: None)  # type: ignore[arg-type]
    time.sleep(0.2)
    keeper.close()
    assert hiccup.calls >= 3  # renewed again and again

    crashed: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: crashed.append(args.exc_value))
    bug = FakeClaims(KeyError("expiresAt"))
    keeper = LeaseKeeper(bug, claim, lost=lambda: None)  # type: ignore[arg-type]
    time.sleep(0.2)
    keeper.close()
    # It used to be logged as "cannot renew the claim" and retried forever.
    assert bug.calls == 1 and len(crashed) == 1 and isinstance(crashed[0], KeyError)
