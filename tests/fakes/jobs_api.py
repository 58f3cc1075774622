"""FakeJobsApi: the routes of Ray's Jobs API that podagent's JobRunner uses, over real HTTP,
with trouble scripted per request: an answer of 503, a reply that never comes, a connection
dropped without an answer. Only for what a real dashboard cannot be made to do on cue (Ray's
own dashboard answers 503 only in its first seconds, "No available agent").

    with FakeJobsApi(trouble=[("POST /api/jobs/", "503"), ("GET /api/jobs/r-1", "hang")]) as api:
        runner = JobRunner(api.url, "r-1", ...)

Each request takes the first trouble entry whose route matches it (entries are used once, in
order). Every POST /api/jobs/ body is checked against the fields of Ray's JobSubmitRequest
(ray/dashboard/modules/job/common.py): a body a real dashboard would refuse is answered 400.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any

from tests.fakes.served import ServedFake

RAY_VERSION = "2.60.0"
# JobSubmitRequest's fields and the types a dashboard accepts (None: not sent when unset).
SUBMIT_FIELDS = {"entrypoint": str, "submission_id": str, "runtime_env": dict,
                 "metadata": dict, "entrypoint_num_cpus": (int, float),
                 "entrypoint_num_gpus": (int, float), "entrypoint_memory": int,
                 "entrypoint_resources": dict, "entrypoint_label_selector": dict}
TROUBLE = ("503", "hang", "drop")


@dataclass(frozen=True)
class Request:
    route: str  # "METHOD /path"
    answered: str  # the status sent, or the trouble that replaced it


class FakeJobsApi(ServedFake):
    name = "fake-jobs-api"

    def __init__(self, trouble: list[tuple[str, str]] | None = None, hang_for: float = 3.0):
        super().__init__()
        for _route, kind in trouble or []:
            assert kind in TROUBLE, kind
        self.trouble = list(trouble or [])
        self.hang_for = hang_for  # how long a "hang" holds its request before dropping it
        self.jobs: dict[str, dict[str, Any]] = {}
        self._requests: list[Request] = []

    @property
    def requests(self) -> list[Request]:
        return self._copy(self._requests)

    @property
    def url(self) -> str:
        return self.origin

    def _take_trouble(self, route: str) -> str | None:
        with self._lock:
            for i, (wanted, kind) in enumerate(self.trouble):
                if wanted == route:
                    del self.trouble[i]
                    return kind
        return None

    def _record(self, route: str, answered: str) -> None:
        with self._lock:
            self._requests.append(Request(route, answered))

    def __enter__(self) -> FakeJobsApi:
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _reply(self, route: str, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                api._record(route, str(status))  # before the answer: the client may look at once
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _troubled(self, route: str) -> bool:
                kind = api._take_trouble(route)
                if kind is None:
                    return False
                api._record(route, kind)
                if kind == "503":
                    data = b"No available agent to submit job, please try again later."
                    self.send_response(503)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return True
                if kind == "hang":
                    time.sleep(api.hang_for)
                self.close_connection = True  # "hang" and "drop": no answer at all
                return True

            def do_GET(self) -> None:
                route = f"GET {self.path}"
                if self._troubled(route):
                    return
                if self.path == "/api/version":
                    return self._reply(route, 200, {"ray_version": RAY_VERSION, "version": "4",
                                                    "ray_commit": "fake"})
                if self.path == "/api/jobs/":
                    with api._lock:
                        listed = list(api.jobs.values())
                    return self._reply(route, 200, listed)
                job = api.jobs.get(self.path.removeprefix("/api/jobs/"))
                if self.path.startswith("/api/jobs/") and job is not None:
                    return self._reply(route, 200, job)
                self._reply(route, 404, {"error": "no such job"})

            def do_POST(self) -> None:
                route = f"POST {self.path}"
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self._troubled(route):
                    return
                if self.path != "/api/jobs/":
                    return self._reply(route, 404, {"error": "no such route"})
                request = json.loads(body)
                wrong = [k for k, v in request.items()
                         if k not in SUBMIT_FIELDS or not isinstance(v, SUBMIT_FIELDS[k])]
                if wrong or "entrypoint" not in request:
                    return self._reply(route, 400, {"error": f"bad fields {wrong}"})
                sid = request.get("submission_id") or "raysubmit_fake"
                with api._lock:
                    if sid in api.jobs:
                        exists = True
                    else:
                        exists = False
                        api.jobs[sid] = {"submission_id": sid, "job_id": None,
                                         "status": "PENDING", "entrypoint": request["entrypoint"],
                                         "metadata": request.get("metadata") or {}}
                if exists:
                    return self._reply(route, 400, {"error": f"Job with submission_id {sid} "
                                                             f"already exists."})
                self._reply(route, 200, {"job_id": sid, "submission_id": sid})

        self._serve(Handler)
        return self
