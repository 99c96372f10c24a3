"""The chart's fileStorage: the one volume every pod of a bij mounts, and the file:// URIs it lets a bij use."""

from __future__ import annotations

import json
import os
import posixpath
from dataclasses import dataclass
from typing import Any

from bij.contract.spec import BatchInferenceJob

# The chart's fileStorage value, as the operator's environment carries it (JSON: mountPath, volume).
FILE_STORAGE_ENV = "BIJ_FILE_STORAGE"
FILE_VOLUME = "bij-files"


@dataclass(frozen=True)
class FileVolume:
    """A volume every pod of a bij mounts at `mount_path` (chart value fileStorage): on a cluster, file://
    URIs are only worked with where they lie under it, since nothing else is shared between pods."""

    mount_path: str
    source: dict[str, Any]

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> FileVolume | None:
        raw = (os.environ if env is None else env).get(FILE_STORAGE_ENV)
        if not raw:
            return None
        doc = json.loads(raw)
        mount, source = doc.get("mountPath"), doc.get("volume")
        if not isinstance(mount, str) or not mount.startswith("/") or not isinstance(source, dict) or not source:
            raise ValueError(f"{FILE_STORAGE_ENV}: expected {{\"mountPath\": \"/abs/path\", \"volume\": {{...}}}}, "
                             f"got {raw!r}")
        return cls(posixpath.normpath(mount), dict(source))

    def covers(self, uri: str) -> bool:
        path = posixpath.normpath(uri[len("file://"):])
        return path == self.mount_path or path.startswith(self.mount_path.rstrip("/") + "/")


def file_uri_problems(job: BatchInferenceJob, volume: FileVolume | None) -> list[str]:
    """The file:// URIs of `job` its pods on a cluster could not share: all of them without the chart's
    fileStorage volume, else those outside its mountPath."""
    uris = [("spec.input.uri", job.spec.input.uri), ("spec.output.uri", job.spec.output.uri)]
    uris += [(f"spec.model.adapters[{i}].uri", a.uri) for i, a in enumerate(job.spec.model.adapters)]
    problems = []
    for field, uri in uris:
        if not uri.startswith("file://"):
            continue
        if volume is None:
            problems.append(f"{field}: {uri}: file:// URIs need a volume shared by every pod of the bij, and this "
                            "operator has none: set the chart value fileStorage (volume and mountPath), or use s3:// or gs://")
        elif not volume.covers(uri):
            problems.append(f"{field}: {uri} is outside the shared volume at {volume.mount_path} (chart value "
                            "fileStorage.mountPath): pods elsewhere do not see it")
    return problems
