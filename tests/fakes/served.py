"""What every fake HTTP service of the tests shares: a real server on a thread of its own,
bound where it is told (IPv4 or IPv6, port 0 = any free one), a lock for what it records, and a
clean stop. Each fake brings its handler and its routes."""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class ServedFake:
    """Use as a context manager; a subclass's `__enter__` calls `_serve(Handler)`."""

    name = "fake"

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host, self.port = host, port
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def _serve(self, handler: type[BaseHTTPRequestHandler]) -> None:
        server_class = ThreadingHTTPServer
        if ":" in self.host:
            class V6(ThreadingHTTPServer):
                address_family = socket.AF_INET6

            server_class = V6
        self._server = server_class((self.host, self.port), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,),
                                        name=self.name, daemon=True)
        self._thread.start()

    def _copy(self, records: list[Any]) -> list[Any]:
        """What was recorded so far, as a list of its own (the server's threads append)."""
        with self._lock:
            return list(records)

    @property
    def origin(self) -> str:
        """http://HOST:PORT where it listens."""
        if self._server is None:
            raise RuntimeError(f"{type(self).__name__} is not started")
        host, port = self._server.server_address[:2]
        host = f"[{host}]" if ":" in str(host) else host
        return f"http://{host}:{port}"

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
