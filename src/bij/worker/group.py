"""A lane of several pods (spec.workers.nodesPerLane = n > 1): one engine spread over n nodes.

The round Job has n indexes per lane: index i is rank i % n of lane i // n. Rank 0, the leader, runs a Ray
head and the lane's worker (claims, leases, commits, SIGTERM as in a lane of one pod, bij.worker.main); its
engine is vLLM with Ray's executor, pipeline parallel over the n pods. Every other rank, a member, runs a
Ray worker node that joins the leader's head, and nothing else.

Besides Ray, the leader keeps a small TCP channel with its members (the group port): a member connects,
says `join <rank>`, and stays connected while it runs. It is how each side knows the other is there:

- the leader waits until every member has joined and Ray counts n nodes before it loads the engine (at
  most BIJ_GROUP_JOIN_SECONDS; then it fails, and that failure counts against its index);
- the lane done, the leader says `done` to every member: each stops its Ray node and exits 0, so a
  member's index succeeds with its leader's;
- a member that gets SIGTERM (a spot reclaim, a drain) says `leaving` and keeps its Ray node up until
  the leader lets it go (or its own drain time is over): the leader stops as on its own SIGTERM, its
  in-flight chunk may still finish and commit, and then it exits EXIT_GROUP_LOST;
- a member whose connection drops without a word (its pod or node is gone) costs the leader its in-flight
  rows: the leader stops at once, commits nothing more and exits EXIT_GROUP_LOST;
- the leader gone (its connection dropped before `done`), a member stops its Ray node and exits
  EXIT_GROUP_LOST.

So a group that loses one pod is replaced whole: EXIT_GROUP_LOST is not counted against an index
(the round Job's podFailurePolicy ignores it), while the pod at fault is (its own failure) or is not (a
preemption) as for a lane of one pod. The replacement leader takes its lane's claims at once, as a
replacement pod of any lane does (bij.worker.lanes), and resumes each shard from its durable prefix:
committed rows are never redone, uncommitted ones always are.
"""

from __future__ import annotations

import logging
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bij.contract.codes import (
    EXIT_FAILED,
    EXIT_GROUP_LOST,
    EXIT_OK,
    EXIT_TERMINATED,
    GROUP_LEADER_ENV,
    GROUP_PORT,
    NODES_PER_LANE_ENV,
    RAY_PORT,
    ROUND_ENV,
)

log = logging.getLogger("bij.group")

GROUP_PORT_ENV = "BIJ_GROUP_PORT"
RAY_PORT_ENV = "BIJ_RAY_PORT"
JOIN_SECONDS_ENV = "BIJ_GROUP_JOIN_SECONDS"
JOIN_SECONDS = 600.0


class GroupError(Exception):
    """The group could not form (a member or Ray did not join in time): worth a retry, counted."""


@dataclass(frozen=True)
class Role:
    """Which pod of which lane this process is."""

    index: int  # JOB_COMPLETION_INDEX
    nodes: int  # pods per lane

    @property
    def lane(self) -> int:
        return self.index // self.nodes

    @property
    def rank(self) -> int:
        return self.index % self.nodes

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def leader_index(self) -> int:
        return self.lane * self.nodes


def role_of(index: int, env: dict[str, str] | None = None) -> Role:
    """The role of Job index `index`: from env BIJ_NODES_PER_LANE (1 when unset)."""
    raw = (os.environ if env is None else env).get(NODES_PER_LANE_ENV) or "1"
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{NODES_PER_LANE_ENV} must be a positive integer, got {raw!r}")
    return Role(index, int(raw))


def leader_host(role: Role, env: dict[str, str] | None = None) -> str:
    """The leader's host name: env BIJ_GROUP_LEADER with its index (`<job>-{index}.<service>` on Kubernetes)."""
    pattern = (os.environ if env is None else env).get(GROUP_LEADER_ENV)
    if not pattern:
        raise ValueError(f"{GROUP_LEADER_ENV} is not set: a lane of several pods needs its leader's host name")
    return pattern.replace("{index}", str(role.leader_index))


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    return float(raw) if raw else default


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    return int(raw) if raw else default


def group_port() -> int:
    return _env_int(GROUP_PORT_ENV, GROUP_PORT)


def ray_port() -> int:
    return _env_int(RAY_PORT_ENV, RAY_PORT)


def join_seconds() -> float:
    return _env_float(JOIN_SECONDS_ENV, JOIN_SECONDS)


# --- Ray -------------------------------------------------------------------------------------------

def ray_command() -> str:
    """The `ray` command next to this interpreter (the worker's environment), else on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "ray")
    found = here if os.path.exists(here) else shutil.which("ray")
    if not found:
        raise GroupError("a lane of several pods needs Ray: no `ray` command (pip install 'ray>=2.40')")
    return found


class RayNode:
    """One Ray node of the group: `ray start ... --block` as a child process in a session of its own, so
    that stopping it stops every Ray process it started (and nothing of another node on the same host)."""

    def __init__(self, args: list[str]):
        cmd = [ray_command(), "start", *args, "--block", "--disable-usage-stats"]
        log.info("starting Ray: %s", " ".join(cmd))
        # Ray's own output goes to the pod's log (stderr): stdout carries the worker's progress events.
        self.proc = subprocess.Popen(cmd, start_new_session=True, stdin=subprocess.DEVNULL, stdout=sys.stderr)

    @classmethod
    def head(cls, port: int) -> RayNode:
        return cls(["--head", f"--port={port}", "--include-dashboard=false"])

    @classmethod
    def worker(cls, address: str) -> RayNode:
        return cls([f"--address={address}"])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        # What `ray start` left in its session (raylet, GCS, workers) goes with it.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def ray_nodes_alive(address: str) -> int:
    """Alive nodes of the Ray cluster at `address`, as a driver of it (this process stays connected: the
    engine's Ray executor uses the same connection)."""
    import ray

    if not ray.is_initialized():
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    return sum(1 for n in ray.nodes() if n.get("Alive"))


# --- the leader ------------------------------------------------------------------------------------

class GroupLeader:
    """The leader's end of the group channel (see the module doc). `on_lost(reason, drain)`: called once,
    from the channel's thread, when a member leaves (`drain` True: it said so and waits) or is gone."""

    def __init__(self, role: Role, on_lost: Callable[[str, bool], None], *, port: int | None = None,
                 host: str = "0.0.0.0", ray: bool = True):
        self.role = role
        self.on_lost = on_lost
        self.ray = ray
        self.server = socket.create_server((host, group_port() if port is None else port), reuse_port=False)
        self.port = self.server.getsockname()[1]
        self.members: dict[int, socket.socket] = {}
        self._buffers: dict[socket.socket, bytes] = {}
        self._lock = threading.Lock()
        self._joined = threading.Condition(self._lock)
        self._finishing = False
        self._lost: str | None = None
        self._closed = threading.Event()
        self.head: RayNode | None = None
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.server, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._serve, name="group", daemon=True)

    def start(self) -> GroupLeader:
        if self.ray:
            self.head = RayNode.head(ray_port())
        self._thread.start()
        return self

    @property
    def lost(self) -> str | None:
        return self._lost

    def wait_members(self, timeout: float, stop: threading.Event | None = None) -> None:
        """Until every member has joined (and with Ray, the cluster counts every node). GroupError after
        `timeout` seconds; returns early once `stop` is set or the group is lost."""
        deadline = time.monotonic() + timeout
        want = self.role.nodes - 1
        with self._lock:
            while len(self.members) < want and self._lost is None and not (stop and stop.is_set()):
                if time.monotonic() >= deadline:
                    raise GroupError(f"lane {self.role.lane}: {len(self.members)} of {want} members joined in "
                                     f"{timeout:.0f}s (ranks {sorted(self.members)})")
                self._joined.wait(0.2)
        if not self.ray or self._lost is not None or (stop and stop.is_set()):
            return
        address = f"127.0.0.1:{ray_port()}"
        while True:
            if self.head is not None and not self.head.alive():
                raise GroupError("the Ray head exited while the group formed")
            try:
                nodes = ray_nodes_alive(address)
            except ConnectionError as e:  # the head still starting
                nodes, why = 0, str(e)
            else:
                why = f"{nodes} of {self.role.nodes} Ray nodes alive"
            if nodes >= self.role.nodes:
                log.info("lane %d: %d Ray nodes joined", self.role.lane, nodes)
                os.environ["RAY_ADDRESS"] = address  # the engine's Ray executor joins the same cluster
                return
            if time.monotonic() >= deadline or (stop and stop.is_set()):
                raise GroupError(f"lane {self.role.lane}: Ray did not form in {timeout:.0f}s: {why}")
            time.sleep(0.5)

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                events = self._selector.select(0.2)
            except (OSError, ValueError):
                return
            for key, _ in events:
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self.server:
                    try:
                        conn, _ = self.server.accept()
                    except OSError:
                        continue
                    conn.setblocking(False)
                    self._buffers[conn] = b""
                    self._selector.register(conn, selectors.EVENT_READ)
                    continue
                try:
                    data = sock.recv(4096)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    self._gone(sock)
                    continue
                self._buffers[sock] += data
                while sock in self._buffers and b"\n" in self._buffers[sock]:
                    line, _, rest = self._buffers[sock].partition(b"\n")
                    self._buffers[sock] = rest
                    self._said(sock, line.decode(errors="replace").strip())
            if self.head is not None and not self.head.alive() and not self._finishing:
                self._lose("the Ray head exited", drain=False)

    def _rank(self, sock: socket.socket) -> int | None:
        return next((r for r, s in self.members.items() if s is sock), None)

    def _said(self, sock: socket.socket, line: str) -> None:
        word, _, arg = line.partition(" ")
        if word == "join" and arg.isdigit():
            rank = int(arg)
            with self._lock:
                if self._finishing or rank in self.members or not 0 < rank < self.role.nodes:
                    refused = True
                else:
                    refused = False
                    self.members[rank] = sock
                    self._joined.notify_all()
            if refused:
                log.warning("lane %d: refused a join as rank %s", self.role.lane, arg)
                self._drop(sock)
            else:
                log.info("lane %d: member %d joined", self.role.lane, rank)
        elif word == "leaving":
            self._lose(f"member {self._rank(sock)} is stopping (SIGTERM)", drain=True)

    def _gone(self, sock: socket.socket) -> None:
        rank = self._rank(sock)
        self._drop(sock)
        if rank is None:
            return
        with self._lock:
            del self.members[rank]
            finishing = self._finishing
        if not finishing:
            self._lose(f"member {rank} is gone", drain=False)

    def _drop(self, sock: socket.socket) -> None:
        try:
            self._selector.unregister(sock)
        except (KeyError, ValueError):
            pass
        self._buffers.pop(sock, None)
        sock.close()

    def _lose(self, reason: str, drain: bool) -> None:
        with self._lock:
            if self._lost is not None or self._finishing:
                return
            self._lost = reason
            self._joined.notify_all()
        log.warning("lane %d: %s: the group is replaced", self.role.lane, reason)
        self.on_lost(reason, drain)

    def finish(self, timeout: float = 30.0) -> None:
        """The lane is done: tell every member, and wait (at most `timeout`) until each has hung up."""
        with self._lock:
            self._finishing = True
            members = dict(self.members)
        for sock in members.values():
            try:
                sock.setblocking(True)
                sock.sendall(b"done\n")
                sock.setblocking(False)
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self.members:
                    break
            time.sleep(0.1)

    def close(self, regroup: bool = False) -> None:
        """Stop the channel (members still connected see it drop) and the Ray head. `regroup`: tell the
        members first that this leader replaces the group and has reported why (they report nothing)."""
        self._closed.set()
        if self._thread.is_alive():
            self._thread.join(2)
        for sock in list(self._buffers):
            if regroup:
                try:
                    sock.setblocking(True)
                    sock.settimeout(2.0)
                    sock.sendall(b"regroup\n")
                except OSError:
                    pass
            self._drop(sock)
        try:
            self._selector.unregister(self.server)
        except (KeyError, ValueError):
            pass
        self.server.close()
        self._selector.close()
        if self.ray:
            try:
                import ray

                if ray.is_initialized():
                    ray.shutdown()
            except ImportError:
                pass
        if self.head is not None:
            self.head.stop()


# --- a member --------------------------------------------------------------------------------------

def _connect(host: str, port: int, deadline: float, stop: threading.Event) -> socket.socket | None:
    """Connect to the leader's group port, retrying (its name may not resolve yet) until `deadline`."""
    last: Exception | None = None
    while time.monotonic() < deadline and not stop.is_set():
        try:
            return socket.create_connection((host, port), timeout=5)
        except OSError as e:
            last = e
            stop.wait(1.0)
    if stop.is_set():
        return None
    raise GroupError(f"cannot reach the lane's leader at {host}:{port}: {last}")


def run_member(role: Role, host: str, *, drain_seconds: float, ray: bool = True,
               stop: threading.Event | None = None, port: int | None = None,
               report: Callable[[str], None] | None = None) -> int:
    """A member's whole life: join the leader (its Ray head and its group channel), then wait for `done`
    (exit 0), the leader's loss (EXIT_GROUP_LOST) or SIGTERM (say `leaving`, keep the Ray node up while the
    leader drains, at most `drain_seconds`; exit 143). Its own Ray node failing: EXIT_FAILED. The leader gone
    without a word (not `regroup`): `report` says why the group is replaced, as the leader would have."""
    stop = stop or threading.Event()
    port = group_port() if port is None else port
    log.info("lane %d: member %d of %d, leader %s", role.lane, role.rank, role.nodes, host)
    try:
        sock = _connect(host, port, time.monotonic() + join_seconds(), stop)
    except GroupError as e:
        log.error("%s", e)
        return EXIT_FAILED
    if sock is None:
        return EXIT_TERMINATED
    node: RayNode | None = None
    try:
        if ray:
            joined = _join_ray(host, stop)
            if isinstance(joined, int):
                return joined
            node = joined
        sock.sendall(f"join {role.rank}\n".encode())
        sock.settimeout(0.5)
        return _follow_leader(role, sock, node, stop, drain_seconds, report)
    finally:
        sock.close()
        if node is not None:
            node.stop()


def _join_ray(host: str, stop: threading.Event) -> RayNode | int:
    """Join the leader's Ray head once it answers (the leader starts it as it opens the channel): this
    pod's Ray node, or the exit code when the head cannot be reached (EXIT_FAILED) or SIGTERM came first."""
    try:
        head = _connect(host, ray_port(), time.monotonic() + join_seconds(), stop)
    except GroupError as e:
        log.error("%s", e)
        return EXIT_FAILED
    if head is None:
        return EXIT_TERMINATED
    head.close()
    return RayNode.worker(f"{host}:{ray_port()}")


def _follow_leader(role: Role, sock: socket.socket, node: RayNode | None, stop: threading.Event,
                   drain_seconds: float, report: Callable[[str], None] | None) -> int:
    """Listen on the joined group channel until the lane is done, the leader is gone, this pod's Ray node
    exits or, after SIGTERM (said to the leader as `leaving`), the drain time is up; the member's exit code."""
    buffer = b""
    said_leaving_at: float | None = None
    while True:
        if stop.is_set() and said_leaving_at is None:
            log.info("lane %d member %d: SIGTERM, the leader drains before this node stops", role.lane, role.rank)
            try:
                sock.sendall(b"leaving\n")
            except OSError:
                return EXIT_TERMINATED
            said_leaving_at = time.monotonic()
        if said_leaving_at is not None and time.monotonic() - said_leaving_at > drain_seconds:
            return EXIT_TERMINATED
        if node is not None and not node.alive():
            log.error("lane %d member %d: this pod's Ray node exited (%s)", role.lane, role.rank,
                      node.proc.returncode)
            return EXIT_TERMINATED if said_leaving_at is not None else EXIT_FAILED
        try:
            data = sock.recv(4096)
        except TimeoutError:
            continue
        except OSError:
            data = b""
        if not data:
            return EXIT_TERMINATED if said_leaving_at is not None else _leader_closed(role, buffer, report)
        buffer += data
        if b"done\n" in buffer:
            log.info("lane %d member %d: the lane is done", role.lane, role.rank)
            return EXIT_OK


def _leader_closed(role: Role, buffer: bytes, report: Callable[[str], None] | None) -> int:
    """The leader closed the channel before `done`: it replaces the group (it said `regroup`) or it is gone
    without a word, which `report` says as the leader would have. Either way EXIT_GROUP_LOST."""
    if b"regroup\n" in buffer:
        log.warning("lane %d member %d: the leader replaces the group", role.lane, role.rank)
        return EXIT_GROUP_LOST
    log.error("lane %d member %d: the leader is gone before the lane was done", role.lane, role.rank)
    if report is not None:
        report(f"lane {role.lane}: the leader is gone (seen by member {role.rank})")
    return EXIT_GROUP_LOST


def member_main(role: Role, drain_seconds: float) -> int:
    """`bij-worker` as a member of a lane of several pods (bij.worker.main hands over to it)."""
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        if stop.is_set():
            os._exit(EXIT_TERMINATED)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        host = leader_host(role)
    except ValueError as e:
        log.error("bad configuration: %s", e)
        from bij.contract.codes import EXIT_BAD_CONFIG

        return EXIT_BAD_CONFIG
    return run_member(role, host, drain_seconds=drain_seconds, stop=stop, report=_member_report(role))


def _member_report(role: Role, env: dict[str, str] | None = None) -> Callable[[str], None] | None:
    """Where a member says its group is replaced: its own lane report (bij.worker.report), keyed by its pod
    name, for the round the Job says (BIJ_ROUND); None when the pod reports nowhere."""
    from bij.contract.lane_report import LaneReport
    from bij.contract.records import now_stamp
    from bij.worker.report import POD_NAME_ENV, ReportError, put_with_retries, sink_from_env

    env = dict(os.environ) if env is None else env
    raw = env.get(ROUND_ENV, "")
    try:
        sink = sink_from_env(env)
    except ReportError as e:
        log.warning("cannot report: %s", e)
        return None
    if sink is None or not raw.isdigit():
        return None
    key = env.get(POD_NAME_ENV) or f"lane-{raw}-{role.lane}-member-{role.rank}"

    def report(reason: str) -> None:
        value = LaneReport(round=int(raw), lane=role.lane, rank=role.rank, group_lost=reason,
                           at=now_stamp()).as_status()
        try:
            put_with_retries(sink, "lanes", key, value, attempts=3)
        except (ReportError, OSError) as e:
            log.warning("cannot report the group's loss: %s", e)

    return report
