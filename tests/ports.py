"""Ports for the servers the tests start (control plane, S3, bij-api, moto)."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port nothing listens on, below the kernel's ephemeral range: a port the kernel hands out
    (bind to 0) can be taken by any outgoing connection on a busy machine before the server binds it."""
    top = _ephemeral_start()
    if top > 11000:
        for _ in range(500):
            port = random.randrange(10000, top)
            with socket.socket() as s:
                try:
                    s.bind(("0.0.0.0", port))
                except OSError:
                    continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
