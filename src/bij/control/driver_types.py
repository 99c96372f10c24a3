"""What the driver works with: what a backend sees of a bij (`Observed`), where the driver's steps take
effect (`Backend`: `backend.KubeBackend` for the operator, `local.LocalBackend` for `bij run`), and where a
reconcile stops (`Idle`)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol

from bij.contract.lane_report import LaneTally
from bij.contract.spec import BatchInferenceJob, SpecError
from bij.contract.spec_base import SecretKeyRef
from bij.contract.status import JobStatus
from bij.control.decisions import Decision
from bij.control.file_volume import FileVolume

Created = Literal["created", "exists", "foreign"]


@dataclasses.dataclass(frozen=True)
class Observed:
    """What a backend sees of the bij: its spec (parsed, or why it cannot be), status and Jobs."""

    job: BatchInferenceJob | None
    spec_error: SpecError | None
    status: Mapping[str, Any]
    generation: int | None
    output_uri: str
    jobs: Sequence[Mapping[str, Any]]
    # The pods of its step Jobs that failed (`observe.failed_pods` reads them): what a retry or a
    # failure says about the cause.
    pods: Sequence[Mapping[str, Any]] = ()
    # The current round's lane reports, summed by the backend from the lanes' own Leases (or files): the
    # one thing the driver sees of them, the same size for any number of lanes.
    lanes: LaneTally | None = None

    @functools.cached_property
    def state(self) -> JobStatus:
        """The status, typed (what does not parse is left out and named: `say_damage`)."""
        return JobStatus.read(self.status)


class Backend(Protocol):
    """Where the driver's steps take effect."""

    worker_image: str
    steps_image: str  # the image of step Jobs (bij without an engine)
    # The volume file:// URIs lie on, mounted into every pod (the chart's fileStorage); None: no volume.
    file_volume: FileVolume | None

    def observe(self) -> Observed | None:
        """The bij now; None when it is gone (deleted, or being deleted)."""

    def create_job(self, body: dict[str, Any]) -> Created:
        """Create a batch/v1 Job owned by the bij: "exists" when an earlier attempt of ours did,
        "foreign" when a Job of that name belongs to someone else (never adopted or replaced)."""

    def create_service(self, body: dict[str, Any]) -> None:
        """Create a v1 Service owned by the bij (the headless Service of lanes of several pods); one that
        exists already is fine."""

    def patch_job(self, name: str, spec: dict[str, Any]) -> None:
        """Merge `spec` into the Job's spec (suspend, parallelism)."""

    def delete_job(self, name: str) -> None:
        """Delete a step Job (and its pods) so that the step runs again; gone already is fine."""

    def write_status(self, patch: dict[str, Any]) -> None:
        """Merge-patch the bij's status."""

    def event(self, type_: str, reason: str, message: str) -> None:
        """Post an Event about the bij (Normal or Warning)."""

    def notify_key(self, ref: SecretKeyRef) -> bytes:
        """The key that signs spec.notify's POSTs: a Secret's key in the bij's namespace (the operator), an
        environment variable (`bij run`: `notify.secret_env`); LookupError, naming it, when there is none."""


@dataclasses.dataclass(frozen=True)
class Idle:
    """Where a reconcile stopped: the last decision, and when to ask again without a change.

    ``recheck`` None: only when something changes (a Job, the spec). ``gone``: the bij was deleted.
    """

    decision: Decision | None
    recheck: float | None = None
    gone: bool = False



def wake_at(idle: Idle, wake: float | None) -> Idle:
    """`idle`, asked again no later than `wake` seconds from now (None: as it was)."""
    if wake is None:
        return idle
    return dataclasses.replace(idle, recheck=wake if idle.recheck is None else min(idle.recheck, wake))

