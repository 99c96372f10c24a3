"""Azurite's Blob service (Microsoft's Azure Storage emulator), which the az:// tests run against:
`make azure-bin` installs it (install.sh). It speaks the Blob REST API and checks Shared Key signatures
against its well-known development account."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from ports import free_port

VERSION = "3.37.0"  # install.sh installs the same
REPO = Path(__file__).resolve().parents[2]
# The emulator's one account and its published key (the same in every Azurite).
ACCOUNT = "devstoreaccount1"
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def binary() -> Path | None:
    """azurite-blob as `make azure-bin` installed it ($BIJ_AZURITE_DIR or .azurite), or None."""
    folder = Path(os.environ.get("BIJ_AZURITE_DIR") or REPO / ".azurite")
    path = folder / "node_modules" / ".bin" / "azurite-blob"
    return path if path.is_file() and os.access(path, os.X_OK) and shutil.which("node") else None


class Azurite:
    """One Azurite Blob service on a free port with its data under `root`."""

    def __init__(self, exe: Path, root: Path):
        self.exe, self.root = exe, root
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}/{ACCOUNT}"
        self.proc: subprocess.Popen[bytes] | None = None

    def env(self, key: str = KEY) -> dict[str, str]:
        """The standard Azure variables that point bij (and the Azure CLI) at this service."""
        return {"AZURE_STORAGE_ACCOUNT": ACCOUNT, "AZURE_STORAGE_KEY": key,
                "AZURE_STORAGE_BLOB_ENDPOINT": self.endpoint}

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        log = open(self.root / "azurite.log", "wb")  # noqa: SIM115 - the server's for its life
        self.proc = subprocess.Popen(
            [str(self.exe), "--blobHost", "127.0.0.1", "--blobPort", str(self.port), "--location", str(self.root),
             "--silent", "--skipApiVersionCheck", "--disableProductStyleUrl", "--disableTelemetry"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"azurite exited: {(self.root / 'azurite.log').read_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("azurite did not listen within 60 s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def create_container(endpoint: str, name: str, key: str = KEY) -> None:
    """Create a container (bij never does: like a bucket, it is the platform's), signed as the account."""
    import http.client
    import urllib.parse

    from bij.storage.azure import API_VERSION, Account, _http_date

    account = Account.from_env({"AZURE_STORAGE_ACCOUNT": ACCOUNT, "AZURE_STORAGE_KEY": key,
                                "AZURE_STORAGE_BLOB_ENDPOINT": endpoint})
    url = urllib.parse.urlsplit(endpoint)
    path = f"{url.path}/{name}"
    headers = {"x-ms-version": API_VERSION, "x-ms-date": _http_date(), "Content-Length": "0"}
    headers["Authorization"] = account.sign("PUT", path, {"restype": "container"}, headers)
    conn = http.client.HTTPConnection(url.netloc, timeout=30)
    try:
        conn.request("PUT", f"{path}?restype=container", headers=headers)
        answer = conn.getresponse()
        body = answer.read()
        if answer.status != 201:
            raise RuntimeError(f"creating container {name}: {answer.status} {body[:300]!r}")
    finally:
        conn.close()
