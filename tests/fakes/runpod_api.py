"""FakeRunPodApi: RunPod's REST API for POST /v1/pods/<id>/stop, over real HTTP.

    with FakeRunPodApi("127.0.0.1", 0, expected_key="k" * 32, fail_first=2) as api:
        runpod_api.stop_pod("abc123", "k" * 32, api.url)
        assert [c.pod_id for c in api.calls] == ["abc123"] * 3

It binds where it is told (any host address, port 0 = any free one), so a test can serve it
inside another network namespace or on a pod's address. Every request is recorded in `calls`
(thread-safe); `stopped` holds the pods it stopped.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any

from tests.fakes.served import ServedFake

_STOP = re.compile(r"^/v1/pods/([^/]+)/stop$")


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    pod_id: str | None  # from /v1/pods/<id>/stop, else None
    authorized: bool  # the Authorization header was "Bearer <expected_key>"
    status: int  # what the fake answered


class FakeRunPodApi(ServedFake):
    name = "fake-runpod-api"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, expected_key: str,
                 fail_first: int = 0, fail_status: int = 500) -> None:
        super().__init__(host, port)
        self.expected_key = expected_key
        self.fail_first = fail_first  # answer this many calls with fail_status first
        self.fail_status = fail_status
        self._calls: list[Call] = []
        self.stopped: list[str] = []

    @property
    def calls(self) -> list[Call]:
        return self._copy(self._calls)

    @property
    def url(self) -> str:
        """The base URL to give stop_pod: http://HOST:PORT/v1."""
        return f"{self.origin}/v1"

    def _answer(self, method: str, path: str, authorization: str | None) -> tuple[int, Any]:
        found = _STOP.match(path)
        pod_id = found.group(1) if found else None
        authorized = authorization == f"Bearer {self.expected_key}"
        with self._lock:
            if self.fail_first > 0:
                self.fail_first -= 1
                status, body = self.fail_status, {"error": "internal error (fake)"}
            elif not authorized:
                status, body = 401, {"error": "unauthorized"}
            elif method != "POST" or pod_id is None:
                status, body = 404, {"error": "not found"}
            else:
                self.stopped.append(pod_id)
                status, body = 200, {"id": pod_id, "desiredStatus": "EXITED"}
            self._calls.append(Call(method, path, pod_id, authorized, status))
        return status, body

    def __enter__(self) -> FakeRunPodApi:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                status, body = fake._answer(self.command, self.path,
                                            self.headers.get("Authorization"))
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_POST = do_GET = do_PUT = do_DELETE = _handle

            def log_message(self, format: str, *args: Any) -> None:  # quiet: no stderr lines
                pass

        self._serve(Handler)
        return self
