"""A webhook receiver for spec.notify's tests: a real HTTP server in a thread that records every POST and
answers 500 to its first attempts, then 200."""

from __future__ import annotations

import http.server
import threading
from typing import Any


class Webhook:
    """A webhook receiver: records every POST (headers, body); answers `fail_first` of them 500, then 200."""

    def __init__(self, fail_first: int = 0):
        self.fail_first = fail_first
        self.received: list[tuple[dict[str, str], bytes, int]] = []
        hook = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
                payload = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                code = 500 if len(hook.received) < hook.fail_first else 200
                hook.received.append((dict(self.headers.items()), payload, code))
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/bij?team=a"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def delivered(self) -> list[tuple[dict[str, str], bytes]]:
        return [(h, b) for h, b, code in self.received if code == 200]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
