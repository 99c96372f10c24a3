"""versitygw, the S3 server the tests run against: a real S3 implementation (signatures, IAM,
conditional writes, ranged reads, multipart, pagination) on a temp folder, one port, started in
well under a second.

`make s3-bin` builds it (`build.sh`, into `.s3/bin`, git-ignored). Its IAM is versitygw's internal
one (a folder of its own): the root account is the session's default identity, and `add_user`
creates more through versitygw's admin API (`versitygw admin create-user`), so a test can be
refused the way a tenant would be. `faults.FaultProxy` sits in front of it and drops connections.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from ports import free_port  # noqa: F401  (the S3 tests import it from here)

VERSION = "v1.8.0"  # build.sh builds the same
REPO = Path(__file__).resolve().parents[2]


def binary() -> Path | None:
    """The versitygw that `make s3-bin` built ($BIJ_S3_BIN or .s3/bin), or None."""
    folder = Path(os.environ.get("BIJ_S3_BIN") or REPO / ".s3" / "bin")
    path = folder / "versitygw"
    return path if path.is_file() and os.access(path, os.X_OK) else None


@dataclass(frozen=True)
class Identity:
    """An access key pair the server knows (or, for a test, one it should refuse)."""

    access_key: str
    secret_key: str

    def env(self) -> dict[str, str]:
        """The standard AWS variables that make boto3 (and so bij) sign as this identity."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key}


class S3Server:
    """One versitygw process: posix backend and internal IAM under `root_dir`, on `host` (127.0.0.1,
    or an address that pods in containers reach)."""

    def __init__(self, exe: Path, root_dir: Path, host: str = "127.0.0.1"):
        self.exe = exe
        self.host = host
        self.data = root_dir / "data"  # bucket <b>'s object <k> is the file data/<b>/<k>
        self.iam = root_dir / "iam"
        self.log = root_dir / "versitygw.log"
        # One line per request, with the access key that signed it ("-" for an unsigned one).
        self.access_log = root_dir / "access.log"
        self.root = Identity("bij-root", secrets.token_hex(16))
        self.proc: subprocess.Popen[bytes] | None = None
        self.endpoint = ""

    def start(self, timeout: float = 30.0) -> None:
        """Start on a free port; retried on another port if one was taken between choosing and binding."""
        self.data.mkdir(parents=True, exist_ok=True)
        self.iam.mkdir(parents=True, exist_ok=True)
        for _ in range(5):
            port = free_port()
            with open(self.log, "ab") as log:
                self.proc = subprocess.Popen(
                    [str(self.exe), "--port", f"{self.host}:{port}", "--access", self.root.access_key,
                     "--secret", self.root.secret_key, "--region", "us-east-1", "--iam-dir", str(self.iam),
                     "--access-log", str(self.access_log), "--quiet", "posix", str(self.data)],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    socket.create_connection((self.host, port), timeout=1).close()
                except OSError:
                    time.sleep(0.02)
                    continue
                # Someone else may have taken the port first: then ours exits, failing to bind it.
                time.sleep(0.2)
                if self.proc.poll() is None:
                    self.endpoint = f"http://{self.host}:{port}"
                    return
            self.stop()
        raise RuntimeError(f"versitygw did not start; its log: {self.log}:\n{self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def admin(self, *args: str) -> str:
        """A `versitygw admin` command against this server, as its root account."""
        p = subprocess.run([str(self.exe), "admin", "--access", self.root.access_key, "--secret", self.root.secret_key,
                            "--endpoint-url", self.endpoint, *args], capture_output=True, text=True, timeout=60)
        if p.returncode != 0:
            raise RuntimeError(f"versitygw admin {' '.join(args)}: {p.stderr.strip() or p.stdout.strip()}")
        return p.stdout

    def add_user(self, name: str) -> Identity:
        """A new IAM user (role `user`: may use only the buckets it owns or is granted)."""
        who = Identity(name, secrets.token_hex(16))
        self.admin("create-user", "--access", who.access_key, "--secret", who.secret_key, "--role", "user")
        return who

    def give_bucket(self, bucket: str, owner: Identity) -> None:
        """Make `owner` the owner of `bucket` (created by root)."""
        self.admin("change-bucket-owner", "--bucket", bucket, "--owner", owner.access_key)
