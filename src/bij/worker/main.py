"""`bij-worker`: the pod entry point. Works lane JOB_COMPLETION_INDEX of a round plan.

The lane's shards first, then unfinished shards of other lanes (see lanes.py), with the
model loaded once for all of them.

Exit codes (the Job's podFailurePolicy relies on them):

- 0    every shard of the round is done (their completion records are written)
- 143  terminated by SIGTERM/SIGINT: the in-flight chunks were committed or dropped whole;
       a rerun resumes where it stopped
- 42   bad configuration (missing plan, index out of range, unknown engine, missing model,
       a storage error no retry fixes, an input object changed since planning):
       a retry cannot help, the Job fails at once
- 44   a lane of several pods lost a member (or its leader): the group is replaced whole, and this
       index is not to blame (bij.worker.group)
- other  a failure worth a retry (storage outage, engine crash); a rerun resumes

With spec.workers.nodesPerLane = n > 1 (env BIJ_NODES_PER_LANE) index i is rank i % n of lane i // n:
rank 0 works the lane as above, with a Ray head and the group's members joined before its engine loads;
the other ranks run a Ray worker node each and nothing else (bij.worker.group).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from bij.contract.canary import canary_shards
from bij.contract.codes import (
    CANARY_SHARDS_ENV,
    EXIT_BAD_CONFIG,
    EXIT_FAILED,
    EXIT_GROUP_LOST,
    EXIT_OK,
    EXIT_TERMINATED,
    LANE_OFFSET_ENV,
    REPORT_INTERVAL_ENV,
    TENSOR_PARALLEL_ENV,
)
from bij.contract.lane_report import REPORT_SECONDS
from bij.contract.plan import Plan
from bij.contract.sampling import ALL_FIELDS, refusal
from bij.contract.spec import JobSpec
from bij.contract.spec_model import ENGINE_OPTIONS
from bij.engines import EngineConfig, create_engine
from bij.engines.base import Engine, is_continuous
from bij.storage import StorageError, open_storage
from bij.worker.adapters import AdapterError, adapter_folders, fetch_adapters
from bij.worker.claim import Claim
from bij.worker.engine_share import EngineShare
from bij.worker.group import GroupError, GroupLeader, Role, join_seconds, member_main, role_of
from bij.worker.lanes import Claims, LeaseKeeper, open_claims
from bij.worker.metrics import Metrics, Stats
from bij.worker.reader import DamagedObject, ReplacementDiffers
from bij.worker.report import LaneReporter, ReportError, sink_from_env
from bij.worker.round_claims import RoundClaims
from bij.worker.shard import BadConfig, ShardOutcome, ShardWorker, load_plan
from bij.worker.stopflag import StopFlag
from bij.worker.weights import WeightsError, is_remote, list_weights

# How often a lane reports its progress to the operator (seconds; the round's Job sets it from its lane count).
REPORT_INTERVAL = float(os.environ.get(REPORT_INTERVAL_ENV) or REPORT_SECONDS)

log = logging.getLogger("bij.worker")


def engine_config(spec: JobSpec, adapters: dict[str, str] | None = None, model_path: str | None = None) -> EngineConfig:
    """The engine's settings from spec.model (the engines' options as the spec parsed them);
    `adapters`: the local folders of spec.model.adapters, once fetched; `model_path`: the local folder of
    weights named by an object-store prefix (`weights`), once fetched. A lane of several pods
    (spec.workers.nodesPerLane) runs vLLM with Ray's executor, one pipeline stage a pod."""
    m = spec.model
    basic = m.basics()
    lane: dict[str, Any] = {}  # what the lane sets of model.vllm
    if spec.workers.nodes_per_lane > 1:
        # The executor is an engine argument (spec.model.vllm.engineArgs may still name its own).
        lane["engine_args"] = {"distributed_executor_backend": "ray", **m.vllm.engine_args}
        lane["pipeline_parallel_size"] = spec.workers.nodes_per_lane
    tp = os.environ.get(TENSOR_PARALLEL_ENV)
    if tp and tp.isdigit() and int(tp) > 0:
        lane["tensor_parallel_size"] = int(tp)  # a pool's GPUs (spec.workers.pools[].tensorParallelSize)
    # Each engine's options as the spec parsed them (model.vllm, model.http, ...), typed, to the engine.
    options: dict[str, Any] = {engine: getattr(m, engine) for engine in ENGINE_OPTIONS}
    if lane:
        options["vllm"] = m.vllm.model_copy(update=lane)
    return EngineConfig(
        task=m.task,
        name=model_path or m.name,
        max_tokens=basic.max_tokens,
        temperature=basic.temperature,
        seed=basic.seed,
        max_input_tokens=m.max_input_tokens,
        truncate=m.truncates,
        **options,
        device=os.environ.get("BIJ_DEVICE") or None,
        chat_template=m.chat_template,
        chat_template_kwargs=dict(m.chat_template_kwargs or {}),
        adapters=dict(adapters or {}),
    )


def lane_offset(env: Mapping[str, str] | None = None) -> int:
    """The round's lane that this Job's index 0 is: env BIJ_LANE_OFFSET (a pool's Job, spec.workers.pools), else 0."""
    raw = (os.environ if env is None else env).get(LANE_OFFSET_ENV) or "0"
    if not raw.isdigit():
        raise BadConfig(f"{LANE_OFFSET_ENV} must be a lane number, got {raw!r}")
    return int(raw)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bij-worker", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--manifest", default=os.environ.get("BIJ_MANIFEST"),
                   help="URI of the round plan (shards.json); env BIJ_MANIFEST")
    p.add_argument("--index", type=int, default=None,
                   help="lane index (default: env JOB_COMPLETION_INDEX, as set by an Indexed Job)")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    p.add_argument("--drain-seconds", type=float, default=float(os.environ.get("BIJ_DRAIN_SECONDS", "15")),
                   help="after SIGTERM, how long the in-flight chunk may still run before it is dropped")
    p.add_argument("--progress", action="store_true", help="print JSON progress events on stdout")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("BIJ_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    lane = Lane(parse_args(argv))
    signal.signal(signal.SIGTERM, lane.on_signal)
    signal.signal(signal.SIGINT, lane.on_signal)
    code = lane.run()
    if lane.group.lost and code in (EXIT_TERMINATED, EXIT_FAILED) and not lane.group.signalled:
        # A member went (or said it goes) first: this index is not to blame; the group is replaced whole.
        return EXIT_GROUP_LOST
    return code


def worked_shards(planned: int, env: Mapping[str, str]) -> list[int] | None:
    """The shards this process's lanes work: None for the round's, or a canary Job's (`CANARY_SHARDS_ENV` says
    how many; `canary_shards` which, spread over the round)."""
    raw = env.get(CANARY_SHARDS_ENV)
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise BadConfig(f"{CANARY_SHARDS_ENV} must be a positive number of shards, not {raw!r}")
    return canary_shards(planned, int(raw))


class _Group:
    """The lane's group of pods as the leader's main sees it (nothing when the lane is one pod)."""

    def __init__(self) -> None:
        self.leader: GroupLeader | None = None
        self.lost: str | None = None
        self.signalled = False  # this pod's own SIGTERM came before any loss


class Lane:
    """One pod's lane of a round: set up from the plan (`setup`), its shards claimed and worked one after
    another (`work`), the exit code said by what ended it (`run`)."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.stop = StopFlag(args.drain_seconds)
        # The shard being worked has a stop flag of its own: a lost claim stops that shard only.
        self.current: list[StopFlag] = []
        self.group = _Group()
        self.reporter: LaneReporter | None = None  # set once the plan says which round this is
        self.lane = -1
        self.loaded = False
        self.unclosed: Engine | None = None  # the engine once built (setup), until closed (close_engine)

    def on_signal(self, signum: int, frame: Any) -> None:
        if self.stop.requested:
            # A second signal: no more waiting. What is durable stays durable;
            # a torn frame is skipped on resume.
            os._exit(EXIT_TERMINATED)
        log.info("signal %d: taking no new chunk", signum)
        self.group.signalled = self.group.lost is None
        self.stop.request()
        for flag in self.current:
            flag.request()

    def emit(self, event: dict[str, Any]) -> None:
        if self.args.progress:
            sys.stdout.write(json.dumps(event) + "\n")
            sys.stdout.flush()
        if self.reporter is not None:
            self.reporter.on_event(event)

    def run(self) -> int:
        """Work the lane; the exit code the Job's podFailurePolicy reads (see the module's docstring). The
        engine is closed as it ends, whatever ended it."""
        try:
            return self._run()
        finally:
            self.close_engine()

    def close_engine(self) -> None:
        """Close the lane's engine (Engine.close), the first time only: as the lane ends, and in a lane of
        several pods before its group goes (a vLLM engine's Ray workers on the members)."""
        engine, self.unclosed = self.unclosed, None
        if engine is None:
            return
        try:
            engine.close()
        except Exception:  # noqa: BLE001 - the pod exits next; nothing it could still commit is lost
            log.exception("closing the engine")

    def _run(self) -> int:
        completed = False
        try:
            role = self.role()
            if not role.leader:
                return member_main(role, self.args.drain_seconds)
            self.setup(role)
            code = self.work()
            completed = code == EXIT_OK
            if not completed:
                return code
        except DamagedObject as e:
            # input.onDamagedObject fail: no retry reads past it; the rows before it are durable.
            log.error("%s; the rows before it are durable: replace the object and run again (it resumes there), "
                      "or set spec.input.onDamagedObject: errorRow", e)
            return EXIT_BAD_CONFIG
        except ReplacementDiffers as e:
            log.error("%s", e)
            return EXIT_BAD_CONFIG
        except BadConfig as e:
            log.error("bad configuration: %s", e)
            return EXIT_BAD_CONFIG
        except GroupError as e:
            log.error("%s", e)
            return EXIT_FAILED
        except StorageError as e:
            if e.permanent:
                # A missing bucket, denied access, no credentials, an input replaced after planning:
                # the same on every retry and every node.
                log.error("bad configuration: storage: %s", e)
                return EXIT_BAD_CONFIG
            log.error("storage: %s", e)
            return EXIT_FAILED
        except Exception:
            log.exception("lane %d failed", self.lane)
            return EXIT_FAILED
        finally:
            self.close(completed)
        log.info("lane %d: every shard of the round is done", self.lane)
        if self.group.leader is not None:
            self.close_engine()  # before its pipeline stages on the members go
            self.group.leader.finish()  # members stop their Ray nodes and succeed with this pod
            self.group.leader.close()
        return EXIT_OK

    def role(self) -> Role:
        """Which lane (and rank in its group of pods) this pod's index is."""
        if not self.args.manifest:
            raise BadConfig("no round plan: pass --manifest or set BIJ_MANIFEST")
        index = self.args.index
        if index is None:
            raw = os.environ.get("JOB_COMPLETION_INDEX")
            if raw is None or not raw.isdigit():
                raise BadConfig(f"no lane index: pass --index or set JOB_COMPLETION_INDEX (got {raw!r})")
            index = int(raw)
        try:
            return role_of(index)
        except ValueError as e:
            raise BadConfig(str(e)) from None

    def setup(self, role: Role) -> None:
        """The plan, the reporter, the engine (not loaded yet), the group of pods and the claims; everything
        a lane cannot work with fails here as BadConfig."""
        self.lane = lane = role.lane + lane_offset()
        # The plan says where everything else is, and carries the spec whose storage settings every
        # later call uses; reading the plan itself takes them from the standard AWS environment
        # (AWS_ENDPOINT_URL, AWS_REGION), which the Job sets from the same spec.
        self.plan = plan = load_plan(self.args.manifest, None)
        self.spec = spec = plan.spec
        lanes = plan.lane_count
        if not 0 <= lane < lanes:
            raise BadConfig(f"lane index {lane} is out of range: the round has {lanes} lanes")
        try:
            sink = sink_from_env()
        except ReportError as e:
            raise BadConfig(str(e)) from None
        if sink is not None:
            # How far the lane got, for `kubectl get bij`: the operator never reads storage.
            self.reporter = LaneReporter(sink, plan.round, lane, interval=REPORT_INTERVAL)
        self.metrics = Metrics()
        if self.args.metrics_port:
            self.metrics.serve(self.args.metrics_port)
        engine_name = spec.model.engine
        try:
            # Weights named by an object-store prefix are listed now (their local folder is named by the
            # listing) and copied into the model cache just before the model loads, as the adapters are.
            self.weights = list_weights(str(spec.model.name), spec.storage.s3) if is_remote(spec.model.name) else None
            self.engine = self.unclosed = engine = create_engine(engine_name, engine_config(
                spec, adapter_folders(spec.model.adapters), str(self.weights.path) if self.weights else None))
        except ValueError as e:
            raise BadConfig(str(e)) from None
        except WeightsError as e:
            raise BadConfig(str(e)) from None
        refused = refusal(engine_name, spec.model.own_sampling().asked(), engine.honours,
                          {**{k: f"spec.model.sampling.{k}" for k in ALL_FIELDS},
                           "structuredOutput": "spec.model.structuredOutput"})
        if refused:
            # A default every row would ask for: one clear failure, not an error row per row.
            raise BadConfig(refused)
        name = spec.model.name
        if name and (name.startswith(("/", "./", "../"))) and not os.path.exists(name):
            raise BadConfig(f"spec.model.name: no model at {name}")
        if role.nodes > 1:
            self.group.leader = _form_group(role, self.group, self.stop, self.current, self.args.drain_seconds)
        self.claims = open_claims(open_storage(plan.round_prefix, spec.storage.s3), plan.round_prefix,
                                  lane=lane, lanes=lanes, shards=plan.shard_total,
                                  only=worked_shards(plan.shard_total, os.environ),
                                  writer=uuid.uuid4().hex[:12],
                                  lease_seconds=spec.workers.lease_seconds, share=plan.shares_shards)
        # A continuous engine is shared by the lane's shards, so the next one starts during the
        # current one's tail (judge jobs work chunk by chunk and do not overlap).
        self.share = EngineShare(engine) if is_continuous(engine) and not spec.judge else None

    def work(self) -> int:
        """Claim and work shards until none is left (EXIT_OK) or the pod is asked to stop (EXIT_TERMINATED)."""
        lane, claims, stop = self.lane, self.claims, self.stop
        # Nothing left to claim (a replacement pod after its shards were finished elsewhere):
        # done without loading the model.
        claim = claims.next_or_wait(stop.event)
        while claim is not None and not self.loaded and claims.is_done(claim.shard):
            # Finished elsewhere, its lane's marker lost to a crash: one HEAD of its record, not a model load.
            claims.finished(claim.shard)
            claim = claims.next_or_wait(stop.event)
        run = self.start(claim) if claim is not None else None
        while run is not None:
            while not run.tail.wait(0.2):
                pass
            after: ShardRun | None = None
            if self.share is not None and not stop.requested and run.alive():
                got = claims.next()  # the next shard, if one is free now; never waits
                if isinstance(got, Claim):
                    after = self.start(got)
            try:
                outcome = self.finish(run)
            except BaseException:
                if after is not None:
                    after.stop.request(drain_seconds=0)
                    self.finish(after)
                raise
            if outcome.status == "stopped":
                if stop.requested:
                    log.info("lane %d: stopped with %d rows of shard %d durable", lane, outcome.rows, run.claim.shard)
                    if after is not None:
                        self.finish(after)
                    return EXIT_TERMINATED
                if self.share is None:
                    # Another worker holds the shard now: what its rows still in the engine compute
                    # is not ours to commit.
                    drain(self.engine)
            else:
                log.info("lane %d: shard %d done, %d rows, %d errors", lane, run.claim.shard, outcome.rows,
                         outcome.errors)
                claims.finished(run.claim.shard)
            if after is None:
                claim = claims.next_or_wait(stop.event)
                after = self.start(claim) if claim is not None else None
            run = after
        if stop.requested:
            # Asked to stop as its last shard finished: nothing was left to drain, and it says so too.
            log.info("lane %d: stopped with every shard it took done", lane)
            return EXIT_TERMINATED
        return EXIT_OK

    def load(self, claim: Claim, stats: Stats) -> None:
        """Load the model, once per process, with the first shard claimed (a lane with nothing left never
        loads); the load counts with that shard (carried over to whoever resumes it)."""
        spec = self.spec
        t = time.perf_counter()
        # A big model loads for longer than a lease: renew the claim meanwhile, or the lane finds its own
        # claim expired and works the shard twice (others would take it over too).
        keeper = LeaseKeeper(self.claims, claim, lambda: None)
        try:
            if spec.model.adapters:
                # Once per pod, with a shard to work (a lane with nothing left fetches nothing);
                # a missing adapter fails the lane before the model loads.
                fetch_adapters(spec.model.adapters, spec.storage.s3)
            if self.weights is not None:
                got = self.weights.fetch()
                stats.weights_bytes = got.bytes
                log.info("lane %d: model weights %s in %s: %d bytes copied in %.1f s%s", self.lane,
                         self.weights.folder, got.path, got.bytes, got.seconds,
                         "" if got.bytes else " (copied before, on this node)")
            self.engine.load()
        except AdapterError as e:
            raise BadConfig(str(e)) from None
        except (FileNotFoundError, ImportError, ValueError) as e:
            # Only what fails on every node alike: a full disk or a flaky mount is an
            # OSError worth a retry elsewhere, and must not fail the whole round.
            raise BadConfig(f"cannot load model for engine {spec.model.engine}: {type(e).__name__}: {e}") from None
        finally:
            keeper.close()
        self.loaded = True
        stats.model_load_s, stats.model_loads = time.perf_counter() - t, 1
        self.metrics.model_load.set(stats.model_load_s)
        self.emit({"event": "loaded", "index": claim.shard, "lane": self.lane,
                   "seconds": round(stats.model_load_s, 3)})

    def start(self, claim: Claim) -> ShardRun:
        """Work `claim` in a thread of its own (loading the model first, the first time)."""
        stats = Stats(started_at=time.time())
        if not self.loaded:
            self.load(claim, stats)
        run = ShardRun(self.plan, claim, self.engine, self.claims, self.share, metrics=self.metrics,
                       progress=self.emit, stats=stats, drain_seconds=self.args.drain_seconds)
        self.current.append(run.stop)
        if self.stop.requested:
            run.stop.request()
        run.start()
        return run

    def finish(self, run: ShardRun) -> ShardOutcome:
        try:
            return run.join()
        finally:
            self.current.remove(run.stop)

    def close(self, completed: bool) -> None:
        """The last report; a group of pods told to regroup when this pod replaces it."""
        # This pod replaces its group (a member left first): its last report says why, and its members
        # are told so, and say nothing themselves. A leader stopped first is replaced as one pod is.
        regroup = None if self.group.signalled else self.group.lost
        if self.reporter is not None:
            if regroup is not None:
                self.reporter.group_lost(f"lane {self.lane}: {regroup}")
            self.reporter.close()
        if self.group.leader is not None and not completed:
            self.close_engine()
            # Members see `regroup`, or the channel drop without `done`.
            self.group.leader.close(regroup=regroup is not None)


def _form_group(role: Role, group: _Group, stop: StopFlag, current: list[StopFlag],
                drain_seconds: float) -> GroupLeader:
    """Start the lane's Ray head and group channel, and wait until every member has joined."""

    def on_lost(reason: str, drain: bool) -> None:
        group.lost = reason
        # A member that said it stops keeps its node up while the in-flight chunk finishes; one that is
        # gone took its pipeline stage with it: nothing in flight can finish, nothing more is committed.
        seconds = drain_seconds if drain else 0.0
        stop.request(drain_seconds=seconds)
        for flag in list(current):
            flag.request(drain_seconds=seconds)
        # An engine whose Ray worker died may never return a step: the pod goes regardless (what is
        # durable stays durable, a torn frame is skipped on resume), so that the group is replaced.
        watchdog = threading.Timer(seconds + 30.0, os._exit, args=(EXIT_GROUP_LOST,))
        watchdog.daemon = True
        watchdog.start()

    leader = GroupLeader(role, on_lost).start()
    try:
        leader.wait_members(join_seconds(), stop.event)
    except BaseException:
        leader.close()
        raise
    return leader


class ShardRun:
    """One claimed shard worked in a thread of its own, its claim renewed meanwhile."""

    def __init__(self, plan: Plan, claim: Claim, engine: Any, claims: Claims | RoundClaims, share: EngineShare | None,
                 *, metrics: Metrics, progress: Callable[[dict[str, Any]], None], stats: Stats,
                 drain_seconds: float):
        self.claim = claim
        self.stop = StopFlag(drain_seconds)
        self.tail = threading.Event()  # set once every row is in the engine, or the shard ended
        self.view = share.view() if share is not None else None
        self.worker = ShardWorker(plan, claim.shard, self.view or engine, metrics=metrics, stop=self.stop,
                                  progress=progress, stats=stats, lane=claims.lane)
        if self.view is not None:
            self.worker.on_tail = self.tail.set
        self.claims = claims
        self.outcome: ShardOutcome | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"shard-{claim.shard}", daemon=True)

    def start(self) -> None:
        self.keeper = LeaseKeeper(self.claims, self.claim, lost_claim(self.stop))
        self.thread.start()

    def _run(self) -> None:
        try:
            self.outcome = self.worker.run()
        except BaseException as e:  # noqa: BLE001 - raised again in the lane's thread by join()
            self.error = e
        finally:
            self.keeper.close()
            if self.view is not None:
                self.view.close()
            self.tail.set()

    def alive(self) -> bool:
        return self.thread.is_alive()

    def join(self) -> ShardOutcome:
        while self.thread.is_alive():
            self.thread.join(0.2)  # in slices: the lane's thread takes signals between them
        if self.error is not None:
            raise self.error
        assert self.outcome is not None
        return self.outcome


def lost_claim(flag: StopFlag) -> Callable[[], None]:
    """Stop working a shard another worker took over: nothing more of it is ours to commit."""
    return lambda: flag.request(drain_seconds=0)


def drain(engine: Any) -> None:
    """Drop what a continuous engine still runs: abort it, and step until nothing is left."""
    if is_continuous(engine):
        engine.abort()
        while engine.unfinished():
            engine.step()


if __name__ == "__main__":
    sys.exit(main())
