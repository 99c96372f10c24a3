"""Reports from a bij's pods to its driver (bij.worker.report) and the errors a step reports (steps)."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest

from bij.contract.fingerprint import PlanRefused
from bij.contract.step_report import StepErrorCode, StepReport
from bij.steps import main as steps
from bij.steps.plan_input import PlanError
from bij.storage import StorageError, StorageRefused
from bij.worker import report


@contextlib.contextmanager
def fake_api_server(handler: type[BaseHTTPRequestHandler], sa_dir: Path,
                    monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A plain-HTTP stand-in for the API server on 127.0.0.1, and a service account token in `sa_dir` (a
    sink's URL must then be made http://)."""
    server = HTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        (sa_dir / "token").write_text("tok-1\n")
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(server.server_address[1]))
        monkeypatch.setattr(report, "_tls", lambda cafile: None)
        yield
    finally:
        server.shutdown()


def test_folder_reports_are_read_back_as_the_status_holds_them_and_none_removes_one(tmp_path: Path) -> None:
    sink = report.FolderSink(str(tmp_path))
    sink.put("steps", "j-plan-r0", {"jobUid": "u", "result": {"shards": 3}})
    sink.put("lanes", "j-r0-0-1", {"round": 0, "shardsDone": 1})
    sink.put("lanes", "j-r0-1-1", {"round": 0, "shardsDone": 2})
    assert report.read_folder(tmp_path) == {
        "lanes": {"j-r0-0-1": {"round": 0, "shardsDone": 1}, "j-r0-1-1": {"round": 0, "shardsDone": 2}},
        "steps": {"j-plan-r0": {"jobUid": "u", "result": {"shards": 3}}}}
    sink.put("lanes", "j-r0-0-1", None)
    assert list(report.read_folder(tmp_path)["lanes"]) == ["j-r0-1-1"]
    assert report.read_folder(tmp_path / "nothing-here") == {}


def test_where_reports_go_comes_from_the_job_and_a_bad_setting_is_named() -> None:
    assert report.sink_from_env({}) is None  # a worker run by hand reports nothing
    assert isinstance(report.sink_from_env({"BIJ_REPORT_TO": "dir:/tmp/x"}), report.FolderSink)
    with pytest.raises(report.ReportError, match="BIJ_REPORT_TO='s3://b': expected kube:<namespace>/<name>"):
        report.sink_from_env({"BIJ_REPORT_TO": "s3://b"})


class Recording:
    def __init__(self) -> None:
        self.sent: list[tuple[str, str, Any]] = []

    def put(self, section: str, key: str, value: Any) -> None:
        self.sent.append((section, key, value))


def test_a_lane_counts_only_the_shards_it_finished_and_the_rows_it_made_durable() -> None:
    sink = Recording()
    lane = report.LaneReporter(sink, round_no=1, lane=2, interval=3600, key="j-r1-2-x")
    for event in ({"event": "done", "index": 7, "rows": 50, "errors": 0},   # found finished: another lane's
                  {"event": "resume", "index": 3, "rows": 10, "errors": 0, "bytes": 100},  # durable before
                  {"event": "chunk", "index": 3, "rows": 8, "errors": 2, "bytes": 300},
                  {"event": "chunk", "index": 3, "rows": 10, "errors": 0, "bytes": 310},
                  {"event": "done", "index": 3, "rows": 28, "errors": 2},
                  {"event": "loaded", "index": 3, "seconds": 1.0}):
        lane.on_event(event)
    lane.close()
    ((section, key, value),) = sink.sent
    assert (section, key) == ("lanes", "j-r1-2-x")
    assert {k: value[k] for k in ("round", "lane", "shardsDone", "rows", "errors", "bytes")} == {
        "round": 1, "lane": 2, "shardsDone": 1, "rows": 18, "errors": 2, "bytes": 610}
    lane.close()
    assert len(sink.sent) == 1  # nothing new: nothing sent again


def test_a_report_is_a_merge_patch_of_the_pods_own_key_in_the_bijs_status(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    got: list[tuple[str, str, dict[str, Any], str]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_PATCH(self) -> None:  # noqa: N802 (http.server's name)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            got.append((self.path, self.headers["Content-Type"], body, self.headers["Authorization"]))
            self.send_response(200 if len(got) > 1 else 503)  # the first attempt meets an outage
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: Any) -> None:
            pass

    with fake_api_server(Handler, tmp_path, monkeypatch):
        sink = report.KubeStatus("team-a", "emb", sa_dir=tmp_path)
        sink.url = sink.url.replace("https://", "http://")  # this test's server speaks plain HTTP
        report.put_with_retries(sink, "steps", "emb-plan-r0", {"jobUid": "u", "result": {"shards": 2}}, delay=0.01)
    assert len(got) == 2
    path, ctype, body, auth = got[-1]
    assert path == "/apis/batchinference.io/v1alpha1/namespaces/team-a/batchinferencejobs/emb/status"
    assert ctype == "application/merge-patch+json" and auth == "Bearer tok-1"
    assert body == {"status": {"reports": {"steps": {"emb-plan-r0": {"jobUid": "u", "result": {"shards": 2}}}}}}


def test_a_report_the_api_server_forbids_is_not_retried_and_says_the_verb_missing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    forbidden = ('batchinferencejobs.batchinference.io "emb" is forbidden: User "system:serviceaccount:team-a:'
                 'bij-worker" cannot patch resource "batchinferencejobs/status" in API group "batchinference.io" '
                 'in the namespace "team-a"')

    class Handler(BaseHTTPRequestHandler):
        def do_PATCH(self) -> None:  # noqa: N802 (http.server's name)
            self.rfile.read(int(self.headers["Content-Length"]))
            calls.append(self.path)
            body = json.dumps({"kind": "Status", "status": "Failure", "message": forbidden, "reason": "Forbidden",
                               "code": 403}).encode()
            self.send_response(403)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    with fake_api_server(Handler, tmp_path, monkeypatch):
        sink = report.KubeStatus("team-a", "emb", sa_dir=tmp_path)
        sink.url = sink.url.replace("https://", "http://")
        with pytest.raises(report.ReportError) as refused:
            report.put_with_retries(sink, "steps", "emb-plan-r0", {"jobUid": "u", "result": {}}, delay=0.01)
    assert len(calls) == 1 and refused.value.permanent
    assert str(refused.value).endswith(f"HTTP 403: {forbidden}")


@pytest.mark.parametrize("error, code", [
    (PlanRefused("spec.output.uri: s3://b/o/ belongs to BatchInferenceJob team-b/x"), StepErrorCode.PLAN_REFUSED),
    (PlanError("spec.input.uri: no input at s3://b/in/", permanent=False), StepErrorCode.PLAN_FAILED),
    (StorageRefused("list s3://team-a/in/ as access key id B: AccessDenied: Access Denied."),
     StepErrorCode.STORAGE_REFUSED),
    (StorageError("file:///out: Permission denied", permanent=False), StepErrorCode.STORAGE_FAILED),
])
def test_a_steps_error_travels_under_its_code_not_its_class_name(error: Exception, code: StepErrorCode) -> None:
    sent = StepReport(job_uid="u", pod="p", error=steps.error_of(error)).as_status()
    assert sent["error"]["code"] == code.value and "type" not in sent["error"]
    back = StepReport.parse(json.loads(json.dumps(sent)))
    assert back is not None and back.error is not None
    assert back.error.code is code and back.error.message == str(error)
    assert back.error.permanent == error.permanent  # type: ignore[attr-defined]


def test_an_unknown_or_overlong_step_error_is_internal_with_its_type_and_its_message_cut() -> None:
    error = steps.error_of(RuntimeError("x" * 5000))
    assert error.code is StepErrorCode.INTERNAL and error.message.startswith("RuntimeError: xxx")
    assert len(error.message) < 2100 and error.message.endswith(" ...")


@pytest.mark.parametrize("raw", [None, "x", {"jobUid": "u"}, {"jobUid": "u", "error": {"type": "PlanError"}},
                                 {"jobUid": "u", "result": {}, "error": {"code": "Internal", "message": "m"}}])
def test_what_is_not_a_report_is_never_taken_for_one(raw: object) -> None:
    assert StepReport.parse(raw) is None


def test_a_rounds_lane_reports_sum_into_one_tally_that_leaves_out_what_is_no_report() -> None:
    from bij.contract.lane_report import LaneReport, LaneTally, tally

    reports = [
        {"round": 0, "lane": 0, "rows": 5, "errors": 1, "shardsDone": 1, "bytes": 70, "at": "t1"},
        {"round": 0, "lane": 1, "rank": 1, "groupLost": "leader gone", "at": "t3"},
        {"round": 0, "lane": 2, "rows": 7, "shardsDone": 2, "bytes": 30, "at": "t4"},
        {"round": 0, "lane": 3, "rank": 2, "groupLost": "member 1 gone", "at": "t2"},
        {"round": 1, "lane": 0, "rows": 9},  # another round
        "not a report", None,
        {"round": 0, "lane": "first"},  # a lane that is no number
    ]
    assert tally(iter(reports), 0) == LaneTally(round=0, pods=4, shards_done=3, rows=12, errors=1, bytes=100,
                                                groups_replaced=2, last_group_lost="leader gone",
                                                last_group_lost_at="t3", last_at="t4")
    assert tally([], 0) == LaneTally(round=0)
    assert tally([LaneReport(round=1, lane=0, rows=9)], 1).rows == 9
    # What a pod writes: camelCase, the loss only when there is one.
    assert LaneReport(round=2, lane=1, rank=1, group_lost="leader gone").as_status() == {
        "round": 2, "lane": 1, "rank": 1, "shardsDone": 0, "rows": 0, "errors": 0, "bytes": 0,
        "groupLost": "leader gone", "at": ""}
    assert "groupLost" not in LaneReport(round=0, lane=0).as_status()


def test_each_pod_reports_less_often_the_more_run_so_a_rounds_reports_per_second_stay_flat() -> None:
    from bij.contract.lane_report import LANE_REPORTS_PER_SECOND, REPORT_SECONDS, report_interval

    assert report_interval(1) == report_interval(10) == REPORT_SECONDS
    for pods in (100, 1_000, 10_000, 100_000):
        assert pods / report_interval(pods) <= LANE_REPORTS_PER_SECOND
    assert 10_000 / report_interval(10_000) == LANE_REPORTS_PER_SECOND  # not slower than it must be


def test_the_operator_sums_a_rounds_leases_less_often_the_more_there_are_so_it_reads_as_many_a_second() -> None:
    from bij.contract.lane_report import TALLY_SECONDS, report_interval, tally_interval

    assert tally_interval(10) == tally_interval(100) == TALLY_SECONDS
    per_second = {pods: pods / tally_interval(pods) for pods in (1_000, 10_000, 100_000)}
    assert max(per_second.values()) <= 2 * min(per_second.values())
    for pods in (1_000, 10_000):
        assert tally_interval(pods) < report_interval(pods)  # with many pods, still read within their interval


def test_a_lane_report_goes_into_a_lease_of_its_own_made_once_then_patched(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    got: list[tuple[str, str, dict[str, Any]]] = []
    answers = {"POST": [201, 201, 409], "PATCH": [200, 404, 200]}

    class Handler(BaseHTTPRequestHandler):
        def answer(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            got.append((self.command, self.path, body))
            code = answers[self.command].pop(0)
            self.send_response(code)
            self.end_headers()
            self.wfile.write(b"{}")

        do_POST = do_PATCH = answer  # noqa: N815 (http.server's names)

        def log_message(self, *args: Any) -> None:
            pass

    with fake_api_server(Handler, tmp_path, monkeypatch):
        sink = report.sink_from_env({"BIJ_REPORT_TO": "kube:team-a/emb", "BIJ_REPORT_INTERVAL": "5",
                                     "BIJ_JOB_NAME": "emb-r0", "BIJ_JOB_UID": "uid-1"}, sa_dir=tmp_path)
        assert isinstance(sink, report.KubeReports)
        sink.leases.url = sink.leases.url.replace("https://", "http://")  # this test's server speaks plain HTTP
        one = {"round": 0, "lane": 3, "rows": 10}
        sink.put("lanes", "emb-r0-3-abcde", one)  # made
        sink.put("lanes", "emb-r0-3-abcde", {**one, "rows": 20})  # patched
        sink.put("lanes", "emb-r0-3-abcde", {**one, "rows": 30})  # gone under it (404): made again
        other = report.sink_from_env({"BIJ_REPORT_TO": "kube:team-a/emb"}, sa_dir=tmp_path)
        assert isinstance(other, report.KubeReports)
        other.leases.url = other.leases.url.replace("https://", "http://")
        other.put("lanes", "emb-r0-4-fghij", one)  # made by an earlier try whose answer was lost (409): patched
    base = "/apis/coordination.k8s.io/v1/namespaces/team-a/leases"
    assert [(m, p) for m, p, _ in got] == [("POST", base), ("PATCH", f"{base}/emb-r0-3-abcde"),
                                          ("PATCH", f"{base}/emb-r0-3-abcde"), ("POST", base),
                                          ("POST", base), ("PATCH", f"{base}/emb-r0-4-fghij")]
    made = got[0][2]
    assert made["kind"] == "Lease" and made["metadata"]["name"] == "emb-r0-3-abcde"
    assert made["metadata"]["labels"] == {"batchinference.io/job": "emb", "batchinference.io/round": "0"}
    assert made["metadata"]["ownerReferences"] == [{"apiVersion": "batch/v1", "kind": "Job", "name": "emb-r0",
                                                    "uid": "uid-1"}]
    assert made["spec"]["holderIdentity"] == "emb-r0-3-abcde" and made["spec"]["leaseDurationSeconds"] == 16
    assert json.loads(made["metadata"]["annotations"]["batchinference.io/lane-report"]) == one
    patched = got[1][2]
    assert "labels" not in patched["metadata"] and "ownerReferences" not in patched["metadata"]
    assert json.loads(patched["metadata"]["annotations"]["batchinference.io/lane-report"])["rows"] == 20
    assert "ownerReferences" not in got[4][2]["metadata"]  # no Job named: the Lease goes with its namespace
