"""A TCP proxy in front of the S3 server that breaks connections the way networks do.

`cut_gets(after_bytes, times)`: the next `times` GET requests get `after_bytes` of their response
(status line, headers and part of the body), then the connection is dropped. What the client sends is
passed unchanged, so SigV4 signatures (which cover the Host header) still verify. `ranges` lists the
Range header of every GET, in order.
"""

from __future__ import annotations

import re
import socket
import socketserver
import threading
from types import TracebackType

_RANGE = re.compile(rb"\r\nrange: *([^\r\n]*)", re.IGNORECASE)


class FaultProxy:
    """Forward 127.0.0.1:<port> (`url`) to 127.0.0.1:`target_port`."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.ranges: list[str | None] = []
        self.cut = 0  # connections dropped so far
        self._cuts_left = 0
        self._after = 0
        self._lock = threading.Lock()
        proxy = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                proxy._relay(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True, name="fault-proxy")

    def cut_gets(self, after_bytes: int, times: int) -> None:
        with self._lock:
            self._after, self._cuts_left = after_bytes, times

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _relay(self, client: socket.socket) -> None:
        upstream = socket.create_connection(("127.0.0.1", self.target_port))
        budget: list[int | None] = [None]  # response bytes this connection may still pass; None: no limit

        def back() -> None:
            try:
                while data := upstream.recv(1 << 16):
                    left = budget[0]
                    if left is not None and len(data) >= left:
                        client.sendall(data[:left])
                        _drop(client)
                        _drop(upstream)
                        return
                    if left is not None:
                        budget[0] = left - len(data)
                    client.sendall(data)
            except OSError:
                pass
            finally:
                try:
                    client.shutdown(socket.SHUT_WR)
                except OSError:
                    pass

        reader = threading.Thread(target=back, daemon=True)
        reader.start()
        try:
            while data := client.recv(1 << 16):
                if data.startswith(b"GET "):
                    m = _RANGE.search(data)
                    with self._lock:
                        self.ranges.append(m.group(1).decode() if m else None)
                        if self._cuts_left > 0:
                            self._cuts_left -= 1
                            self.cut += 1
                            budget[0] = self._after
                upstream.sendall(data)
        except OSError:
            pass
        finally:
            reader.join(10)
            upstream.close()


def _drop(sock: socket.socket) -> None:
    """End the connection both ways at once (it wakes a thread blocked reading it, as close would not);
    the peer sees the response end before its Content-Length."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
