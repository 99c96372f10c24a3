"""A small TCP proxy that delays every HTTP write request (PUT/POST) by a fixed time, and
counts the requests that pass by kind.

Put it in front of a local S3 server (versitygw, moto) to give every segment upload and object
write the latency of real object storage, while reads pass at once (SigV4 signs the Host header,
which passes through unchanged, so signatures still verify):

    proxy = LatencyProxy(("127.0.0.1", s3_port), write_delay=0.1)
    proxy.start()            # listens on proxy.url
    proxy.counts()           # {"PUT": 12, "GET": 30, "LIST": 4, "HEAD": 9, ...} so far

Requests are told apart by the bytes a client sends first after the previous response
(a request line starting with PUT or POST); a body that happens to start a later read
with those bytes would be delayed too, which a benchmark can live with. A GET whose
target carries `list-type=` (ListObjectsV2) counts as a LIST.
"""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections import Counter

WRITES = (b"PUT ", b"POST ")
METHODS = (b"GET ", b"HEAD ", b"PUT ", b"POST ", b"DELETE ")


def request_kind(data: bytes) -> str | None:
    """The kind of S3 request a client's bytes start (LIST for a listing), or None for a body."""
    if not data.startswith(METHODS):
        return None
    line = data.split(b"\r\n", 1)[0]
    method, _, target = line.partition(b" ")
    if method == b"GET" and b"list-type=" in target:
        return "LIST"
    return method.decode()


class LatencyProxy:
    """Forward 127.0.0.1:<port> to `target`, sleeping `write_delay` before each write request."""

    def __init__(self, target: tuple[str, int], write_delay: float):
        self.target, self.write_delay = target, write_delay
        self.delayed = 0
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        proxy = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                upstream = socket.create_connection(proxy.target)
                client = self.request
                done = threading.Event()

                def back() -> None:
                    try:
                        while data := upstream.recv(1 << 16):
                            client.sendall(data)
                    except OSError:
                        pass
                    finally:
                        done.set()
                        try:
                            client.shutdown(socket.SHUT_WR)
                        except OSError:
                            pass

                threading.Thread(target=back, daemon=True).start()
                try:
                    while data := client.recv(1 << 16):
                        kind = request_kind(data)
                        if kind is not None:
                            with proxy._lock:
                                proxy._counts[kind] += 1
                        if data.startswith(WRITES):
                            proxy.delayed += 1
                            time.sleep(proxy.write_delay)
                        upstream.sendall(data)
                except OSError:
                    pass
                finally:
                    try:
                        upstream.shutdown(socket.SHUT_WR)
                    except OSError:
                        pass
                    done.wait(5)
                    upstream.close()

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True, name="latency-proxy")

    def counts(self) -> dict[str, int]:
        """Requests that passed so far, by kind (GET, LIST, HEAD, PUT, POST, DELETE)."""
        with self._lock:
            return dict(self._counts)

    def start(self) -> LatencyProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
