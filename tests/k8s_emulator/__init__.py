"""A test-only Kubernetes API emulator and Job controller, for running the real operator.

    with Emulator(crds=["crds/batchinferencejobs.yaml"]) as api, JobController(api) as jobs:
        api.write_kubeconfig(tmp_path / "kubeconfig")   # point `bij operator` at api.url
        api.create("batchinference.io/v1alpha1", "batchinferencejobs", doc, namespace="default")
        api.wait_for(lambda: (api.get(...) or {}).get("status", {}).get("phase") == "Succeeded")
        api.requests                                     # what the operator asked the API for
"""

from .jobcontroller import JobController
from .server import Emulator, RequestRecord
from .store import ApiError

__all__ = ["ApiError", "Emulator", "JobController", "RequestRecord"]
