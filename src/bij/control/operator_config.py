"""`OperatorConfig`: what `bij operator` was told (its flags, the chart's environment)."""

from __future__ import annotations

import dataclasses

from bij.control.driver import PROGRESS_INTERVAL, STATUS_INTERVAL
from bij.control.file_volume import FileVolume
from bij.control.jobs import worker_image_default
from bij.control.step_jobs import steps_image_default


@dataclasses.dataclass
class OperatorConfig:
    """What `main()` parsed; handed to the handlers in kopf's memo."""

    namespaces: list[str] = dataclasses.field(default_factory=list)
    clusterwide: bool = False
    liveness: str | None = None
    peering: str | None = None
    standalone: bool = True
    verbose: bool = False
    worker_image: str = dataclasses.field(default_factory=worker_image_default)
    steps_image: str = dataclasses.field(default_factory=steps_image_default)
    # The chart's fileStorage (env BIJ_FILE_STORAGE): without it, a bij with a file:// URI is refused.
    file_volume: FileVolume | None = dataclasses.field(default_factory=FileVolume.from_env)
    status_interval: float = STATUS_INTERVAL
    progress_interval: float = PROGRESS_INTERVAL
    # Watch requests end server-side after this long and are reopened; the client gives up a
    # little later, so a silently dead connection cannot stall the operator.
    watch_server_timeout: int = 300
    watch_client_timeout: int = 330
    watch_connect_timeout: int = 10
