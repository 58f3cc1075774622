"""FakeRunPodApi: RunPod's REST API v2 for what a pod asks of it about itself (POST
/v2/pods/{id}/action, GET /v2/pods/{id}), over real HTTP, without pods to run.

    with FakeRunPodApi("127.0.0.1", 0, expected_key="k" * 32, fail_first=2) as api:
        runpod_api.stop_pod("abc123", "k" * 32, api.url)
        assert [c.pod_id for c in api.calls] == ["abc123"] * 3

As RunPod's api-reference-v2/openapi.json says: the body is a PodActionRequest (checked
against the document's schema: 422 otherwise), an action not valid for the pod's status is 409
(a stopped pod cannot be stopped), `stop` answers 200 with the pod, `terminate` 204, a wrong
key 401 and a key the fake refuses actions for (`refuse_key`) 403, as an ErrorResponse. Every
answer carries the RateLimit headers. It binds where it is told (any host address, port 0 = any
free one), so a test can serve it inside another network namespace or on a pod's address.
Every request is recorded in `calls` (thread-safe); `stopped` holds the pods it stopped.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

from tests.fakes.served import ServedFake

_ACTION = re.compile(r"^/v2/pods/([^/]+)/action$")
_POD = re.compile(r"^/v2/pods/([^/]+)$")
_VALID = {"RUNNING": {"stop", "restart", "terminate"}, "EXITED": {"start", "terminate"},
          "ERROR": {"start", "terminate"}, "STARTING": {"stop", "terminate"},
          "PROVISIONING": {"stop", "terminate"}}


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    pod_id: str | None  # from /v2/pods/<id>[/action], else None
    action: str | None
    authorized: bool  # the Authorization header was "Bearer <expected_key>"
    status: int  # what the fake answered


@dataclass
class _Pod:
    status: str = "RUNNING"
    history: list[str] = field(default_factory=list)


def _problem(status: int, detail: str) -> dict[str, Any]:
    titles = {401: "Unauthorized", 403: "Forbidden", 404: "Not Found", 409: "Conflict",
              422: "Unprocessable Entity", 500: "Internal Server Error",
              429: "Too Many Requests"}
    return {"title": titles.get(status, "Error"), "status": status, "detail": detail}


class FakeRunPodApi(ServedFake):
    name = "fake-runpod-api"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, expected_key: str,
                 fail_first: int = 0, fail_status: int = 500, refuse_key: bool = False,
                 statuses: dict[str, str] | None = None) -> None:
        super().__init__(host, port)
        self.expected_key = expected_key
        self.fail_first = fail_first  # answer this many calls with fail_status first
        self.fail_status = fail_status
        self.refuse_key = refuse_key  # 403: the key is known but may not act on pods
        self._pods: dict[str, _Pod] = {k: _Pod(v) for k, v in (statuses or {}).items()}
        self._calls: list[Call] = []
        self.stopped: list[str] = []

    @property
    def calls(self) -> list[Call]:
        return self._copy(self._calls)

    @property
    def url(self) -> str:
        """The base URL to give stop_pod (RUNPOD_API_URL): the server root, as RunPod's
        https://api.runpod.io; paths add /v2/...."""
        return self.origin

    def status(self, pod_id: str) -> str:
        with self._lock:
            return self._pods.setdefault(pod_id, _Pod()).status

    def _pod_json(self, pod_id: str, pod: _Pod) -> dict[str, Any]:
        return {"id": pod_id, "name": f"pod-{pod_id}", "status": pod.status,
                "actions": sorted(_VALID.get(pod.status, ())), "image": "img", "args": "",
                "disk": 20, "mounts": {}, "ports": [], "env": {}, "registry": None,
                "cloud": "SECURE", "dataCenterId": "US-KS-2", "cudaVersion": None,
                "ssh": {}, "template": None, "cost": 0.0 if pod.status != "RUNNING" else 2.99,
                "locked": False, "runtime": None, "createdAt": "2026-11-27T00:00:00Z",
                "startedAt": None, "globalNetworking": {"enabled": False}}

    def _answer(self, method: str, path: str, authorization: str | None,
                body: Any) -> tuple[int, Any]:
        action_of = _ACTION.match(path)
        pod_of = action_of or _POD.match(path)
        pod_id = pod_of.group(1) if pod_of else None
        authorized = authorization == f"Bearer {self.expected_key}"
        action = body.get("action") if isinstance(body, dict) else None
        with self._lock:
            if self.fail_first > 0:
                self.fail_first -= 1
                status, answer = self.fail_status, _problem(self.fail_status, "injected fault")
            elif not authorized:
                status, answer = 401, _problem(401, "invalid api key")
            elif self.refuse_key:
                status, answer = 403, _problem(403, "access denied: a pod-scoped key")
            elif pod_id is None or (action_of is None and method != "GET") or (
                    action_of is not None and method != "POST"):
                status, answer = 404, _problem(404, "not found")
            elif action_of is None:
                status, answer = 200, self._pod_json(pod_id, self._pods.setdefault(pod_id,
                                                                                   _Pod()))
            else:
                status, answer = self._act(pod_id, body, action)
            self._calls.append(Call(method, path, pod_id, action if action_of else None,
                                    authorized, status))
        return status, answer

    def _act(self, pod_id: str, body: Any, action: Any) -> tuple[int, Any]:
        from tests.fakes.runpod_cloud import SCHEMAS

        errors = SCHEMAS.errors("PodActionRequest", body)
        if errors:
            return 422, {**_problem(422, "Request validation failed."), "errors": errors}
        pod = self._pods.setdefault(pod_id, _Pod())
        if action not in _VALID.get(pod.status, ()):
            return 409, _problem(409, f"action {action} is not valid for a pod that is "
                                      f"{pod.status}")
        pod.history.append(action)
        if action == "terminate":
            pod.status = "TERMINATED"
            return 204, None
        if action == "stop":
            pod.status = "EXITED"
            self.stopped.append(pod_id)
        elif action in ("start", "restart"):
            pod.status = "RUNNING"
        return 200, self._pod_json(pod_id, pod)

    def __enter__(self) -> FakeRunPodApi:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = None
                status, answer = fake._answer(self.command, self.path,
                                              self.headers.get("Authorization"), body)
                data = b"" if answer is None else json.dumps(answer).encode()
                self.send_response(status)
                if data:
                    self.send_header("Content-Type", "application/json" if status < 400
                                     else "application/problem+json")
                self.send_header("RateLimit", '"minute";r=59;t=60')
                self.send_header("RateLimit-Policy", '"minute";q=60;w=60')
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_POST = do_GET = do_PUT = do_DELETE = _handle

            def log_message(self, format: str, *args: Any) -> None:  # quiet: no stderr lines
                pass

        self._serve(Handler)
        return self
