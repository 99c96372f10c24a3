"""Lanes of several pods (spec.workers.nodesPerLane, bij.worker.group): the leader and its members.

The group channel's rules run here without Ray (threads on localhost); with Ray installed (the vLLM
environment: `make vllm-env`) a real Ray head and worker node form the group, and a round runs through
`bij-worker` processes as a Job's pods would: the leader works the lane, a member's loss mid-round costs
only the rows in flight, and the replaced group finishes the round with every row exactly once.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from input_rows import numbered

from bij.contract.codes import EXIT_FAILED, EXIT_GROUP_LOST, EXIT_OK, EXIT_TERMINATED
from bij.worker.group import GroupError, GroupLeader, Role, run_member

HAS_RAY = importlib.util.find_spec("ray") is not None
# The vLLM tier's environment (make vllm-env) has Ray: `make test` runs the tests marked vllm there.


class Lost:
    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []
        self.event = threading.Event()

    def __call__(self, reason: str, drain: bool) -> None:
        self.calls.append((reason, drain))
        self.event.set()


def leader(nodes: int, lost: Lost) -> GroupLeader:
    return GroupLeader(Role(0, nodes), lost, port=0, host="127.0.0.1", ray=False).start()


def member(group: GroupLeader, rank: int, stop: threading.Event | None = None, drain: float = 30.0,
           report: Any = None) -> tuple[threading.Thread, list[int]]:
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(run_member(
        Role(rank, group.role.nodes), "127.0.0.1", drain_seconds=drain, ray=False, stop=stop, port=group.port,
        report=report)))
    thread.start()
    return thread, codes


def test_the_leader_waits_for_every_member_and_the_lane_done_they_all_succeed() -> None:
    lost = Lost()
    group = leader(3, lost)
    try:
        threads = [member(group, r) for r in (1, 2)]
        group.wait_members(30)
        assert sorted(group.members) == [1, 2]
        group.finish(timeout=30)
    finally:
        group.close()
    for thread, codes in threads:
        thread.join(30)
        assert codes == [EXIT_OK]
    assert lost.calls == []


def test_a_group_that_does_not_form_in_time_fails_counted() -> None:
    group = leader(2, Lost())
    try:
        with pytest.raises(GroupError, match="0 of 1 members joined"):
            group.wait_members(0.5)
    finally:
        group.close()


def test_a_member_gone_without_a_word_stops_the_leader_at_once() -> None:
    lost = Lost()
    group = leader(2, lost)
    try:
        sock = socket.create_connection(("127.0.0.1", group.port))
        sock.sendall(b"join 1\n")
        group.wait_members(30)
        sock.close()  # the member's pod is gone
        assert lost.event.wait(30)
        assert lost.calls == [("member 1 is gone", False)]
        assert group.lost == "member 1 is gone"
    finally:
        group.close()


def test_a_member_stopping_on_sigterm_lets_the_leader_drain_then_exits_143() -> None:
    lost = Lost()
    group = leader(2, lost)
    stop = threading.Event()
    thread, codes = member(group, 1, stop=stop)
    try:
        group.wait_members(30)
        stop.set()  # the member's SIGTERM
        assert lost.event.wait(30)
        assert lost.calls == [("member 1 is stopping (SIGTERM)", True)]
        time.sleep(0.5)
        assert thread.is_alive(), "the member left before the leader had drained"
    finally:
        group.close()  # the leader drained and exits: the member goes too
    thread.join(30)
    assert codes == [EXIT_TERMINATED]


def test_a_member_whose_leader_is_gone_exits_group_lost_and_says_why() -> None:
    said: list[str] = []
    group = leader(2, Lost())
    thread, codes = member(group, 1, report=said.append)
    group.wait_members(30)
    group.close()  # the leader's pod is gone, without `done`
    thread.join(30)
    assert codes == [EXIT_GROUP_LOST]
    assert said == ["lane 0: the leader is gone (seen by member 1)"]


def test_a_leader_that_replaces_its_group_tells_its_members_who_say_nothing() -> None:
    """Another member gone: the leader reports the loss (bij.worker.main) and says `regroup`, so the
    members left exit EXIT_GROUP_LOST without a second report of the same loss."""
    said: list[str] = []
    lost = Lost()
    group = leader(3, lost)
    thread, codes = member(group, 1, report=said.append)
    try:
        sock = socket.create_connection(("127.0.0.1", group.port))
        sock.sendall(b"join 2\n")
        group.wait_members(30)
        sock.close()  # member 2's pod is gone
        assert lost.event.wait(30) and lost.calls == [("member 2 is gone", False)]
    finally:
        group.close(regroup=True)
    thread.join(30)
    assert codes == [EXIT_GROUP_LOST]
    assert said == []


def test_a_member_reports_its_groups_loss_into_the_round_its_job_names(tmp_path: Path) -> None:
    from bij.worker.group import _member_report
    from bij.worker.report import read_folder

    env = {"BIJ_REPORT_TO": f"dir:{tmp_path}", "BIJ_ROUND": "2", "POD_NAME": "grp-r2-3-abcde"}
    report = _member_report(Role(3, 2), env)
    assert report is not None
    report("lane 1: the leader is gone (seen by member 1)")
    got = read_folder(tmp_path)["lanes"]["grp-r2-3-abcde"]
    assert (got["round"], got["lane"], got["rank"], got["groupLost"]) == (
        2, 1, 1, "lane 1: the leader is gone (seen by member 1)")
    # Nowhere to report, or no round named: nothing to say it with.
    assert _member_report(Role(3, 2), {"BIJ_ROUND": "2"}) is None
    assert _member_report(Role(3, 2), {"BIJ_REPORT_TO": f"dir:{tmp_path}"}) is None


def test_a_second_member_of_one_rank_is_refused() -> None:
    group = leader(3, Lost())
    try:
        first = socket.create_connection(("127.0.0.1", group.port))
        first.sendall(b"join 1\n")
        second = socket.create_connection(("127.0.0.1", group.port))
        second.sendall(b"join 1\n")
        second.settimeout(10)
        assert second.recv(10) == b""  # hung up on
        assert sorted(group.members) == [1]
        first.close()
        second.close()
    finally:
        group.close()


def test_a_member_that_cannot_reach_its_leader_fails_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BIJ_GROUP_JOIN_SECONDS", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there
    assert run_member(Role(1, 2), "127.0.0.1", drain_seconds=1, ray=False, port=port) == EXIT_FAILED


# --- with Ray ----------------------------------------------------------------------------------------

def free_port() -> int:
    """A port the kernel hands out (bind to 0), in its ephemeral range: not tests/ports.py's, which picks
    below that range, where Ray starts its own workers (ports 10002-19999) and may take it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ray_processes(session: int) -> list[int]:
    """Processes still alive in the process group `session` (a RayNode's)."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,pgid="], capture_output=True, text=True, check=True).stdout
    return [int(pid) for pid, pgid in (line.split() for line in out.splitlines()) if int(pgid) == session]


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_RAY, reason="Ray is not installed here (make vllm-env installs it)")
@pytest.mark.timeout(300)
def test_a_ray_head_and_a_member_node_form_the_group_and_leave_nothing_running(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BIJ_RAY_PORT", str(free_port()))
    lost = Lost()
    group = GroupLeader(Role(0, 2), lost, port=0, host="127.0.0.1").start()
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(
        run_member(Role(1, 2), "127.0.0.1", drain_seconds=30, port=group.port)))
    try:
        thread.start()
        group.wait_members(240)  # both joined the channel, and Ray counts two alive nodes
        import ray

        assert sum(1 for n in ray.nodes() if n["Alive"]) == 2
        assert os.environ["RAY_ADDRESS"].endswith(os.environ["BIJ_RAY_PORT"])
        assert group.head is not None
        head = group.head.proc.pid
        group.finish(timeout=60)
    finally:
        group.close()
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    thread.join(120)
    assert codes == [EXIT_OK]
    assert lost.calls == []
    deadline = time.monotonic() + 30
    while ray_processes(head) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray_processes(head) == [], "the Ray head's processes outlived the lane"


# --- a round of two-pod lanes, the pods as processes -------------------------------------------------

rows = numbered


def group_job(make_job: Any, place: Any, inputs: list[dict[str, Any]], name: str, **workers: Any) -> Any:
    from bij.contract.spec import BatchInferenceJob

    spec_path, job = make_job(place, place.write_jsonl("in.jsonl", inputs), name=name, out_dir=f"{name}/",
                              model={"engine": "simulated", "task": "generate", "maxTokens": 6, "seed": 3,
                                     "simulated": {"maxNumSeqs": 4, "stepSeconds": 0.03}},
                              sharding={"targetShardBytes": 4000, "chunkRows": 8},
                              workers={"parallelism": 1, "leaseSeconds": 5, **workers})
    assert isinstance(job, BatchInferenceJob)
    return job


def start_pod(bij_bin: Any, env: dict[str, str], manifest: str, index: int, **extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen([bij_bin("bij-worker"), "--manifest", manifest, "--progress", "--drain-seconds", "5"],
                            env={**env, "JOB_COMPLETION_INDEX": str(index), **extra},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def group_env(worker_env: Any, place: Any, nodes: int) -> dict[str, str]:
    return {**worker_env(place), "BIJ_NODES_PER_LANE": str(nodes), "BIJ_GROUP_LEADER": "127.0.0.1",
            "BIJ_RAY_PORT": str(free_port()), "BIJ_GROUP_PORT": str(free_port()), "BIJ_GROUP_JOIN_SECONDS": "240"}


def results(job: Any, read_output: Any) -> dict[int, str]:
    from bij.local.publish import publish_manifest

    publish_manifest(job)
    out = read_output(job).results
    ids = [r["id"] for r in out]
    assert len(ids) == len(set(ids)), "a row published twice"
    return {r["id"]: json.dumps(r["output"]) for r in out}


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_RAY, reason="Ray is not installed here (make vllm-env installs it)")
@pytest.mark.timeout(600)
def test_a_round_of_a_two_pod_lane_answers_as_one_pod_and_survives_its_member_stopped_then_lost(
        file_place: Any, make_job: Any, worker_env: Any, bij_bin: Any, read_output: Any, tmp_path: Path) -> None:
    from bij.contract import layout
    from bij.steps.planner import plan_round

    inputs = rows(240)
    # The reference: the same rows through a lane of one pod.
    single = group_job(make_job, file_place, inputs, "single")
    plan_round(single, 0)
    one = start_pod(bij_bin, worker_env(file_place), layout.round_manifest_uri(single, 0), 0)
    _, err = one.communicate(timeout=300)
    assert one.returncode == 0, err
    expected = results(single, read_output)
    assert sorted(expected) == list(range(len(inputs)))

    job = group_job(make_job, file_place, inputs, "grouped", nodesPerLane=2)
    plan = plan_round(job, 0)
    assert plan.lanes == 1 and plan.shard_count >= 3
    manifest = layout.round_manifest_uri(job, 0)
    def formed_and_working() -> tuple[subprocess.Popen[str], subprocess.Popen[str]]:
        """A new group (as the Job's replacement pods), once its leader has committed two chunks."""
        env = group_env(worker_env, file_place, 2)
        lead, mem = start_pod(bij_bin, env, manifest, 0), start_pod(bij_bin, env, manifest, 1)
        assert lead.stdout is not None
        chunks = 0
        while chunks < 2:
            line = lead.stdout.readline()
            assert line, lead.stderr.read() if lead.stderr else "the leader ended"
            chunks += json.loads(line)["event"] == "chunk"
        return lead, mem

    def shards_done(out: str) -> set[int]:
        return {json.loads(line)["index"] for line in out.splitlines() if json.loads(line)["event"] == "done"}

    # The member's pod is preempted (SIGTERM): it says so and keeps its Ray node up while the leader drains
    # (its in-flight chunk may still commit); then both go, neither counted against its index.
    lead, mem = formed_and_working()
    mem.send_signal(signal.SIGTERM)
    lead_out, lead_err = lead.communicate(timeout=120)
    _, mem_err = mem.communicate(timeout=60)
    assert lead.returncode == EXIT_GROUP_LOST, lead_err
    assert mem.returncode == EXIT_TERMINATED, mem_err
    assert "member 1 is stopping (SIGTERM)" in lead_err
    assert len(shards_done(lead_out)) < plan.shard_count, "the round ended before the member was stopped"

    # The replaced group works on; its member's pod is deleted without a word (SIGKILL: a node lost):
    # the leader stops at once, its in-flight rows lost, nothing of them committed.
    lead, mem = formed_and_working()
    mem.send_signal(signal.SIGKILL)
    mem.wait(timeout=30)
    lead_out, lead_err = lead.communicate(timeout=120)
    assert lead.returncode == EXIT_GROUP_LOST, lead_err
    assert "member 1 is gone" in lead_err
    assert len(shards_done(lead_out)) < plan.shard_count, "the round ended before the member was lost"

    # The Job replaces both pods (EXIT_GROUP_LOST and a lost pod are not counted): the new group resumes.
    env = group_env(worker_env, file_place, 2)
    lead = start_pod(bij_bin, env, manifest, 0)
    mem = start_pod(bij_bin, env, manifest, 1)
    _, lead_err = lead.communicate(timeout=300)
    _, mem_err = mem.communicate(timeout=120)
    assert lead.returncode == 0, lead_err
    assert mem.returncode == 0, mem_err
    assert "the lane is done" in mem_err
    assert results(job, read_output) == expected  # every row exactly once, answers as from one pod
