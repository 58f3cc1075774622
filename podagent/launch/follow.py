"""Following the head pod from afar: its container log through RunPod's log stream (Server-Sent
Events), each line one of podagent's JSON records (the head runs with PODAGENT_LOG_FORMAT=json:
messages, events and the job's own lines), handed on as HeadRecords."""

from __future__ import annotations

import json
import queue
import threading
from dataclasses import dataclass
from typing import Any

from podagent.errors import RunPodApiError, RunPodAuthError
from podagent.platform.runpod_api import Client

RECONNECT_PAUSE = 1.0  # seconds between a stream that ended and the next (it resumes by id)
IDLE = 30.0  # a stream silent this long is opened again (a proxy may have dropped it)


@dataclass(frozen=True)
class HeadRecord:
    kind: str  # "event", "job" (a line of the job's output), "message", "text", "lost"
    data: dict[str, Any]

    @property
    def text(self) -> str:
        return str(self.data.get("message", self.data.get("line", "")))


def parse(line: str) -> HeadRecord:
    """One line of the head's output. Anything that is not one of podagent's records (the
    image's entrypoint, a crash's traceback) is text, shown as it is."""
    try:
        data = json.loads(line)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        return HeadRecord("text", {"line": line})
    if "event" in data:
        return HeadRecord("event", data)
    if data.get("level") == "job":
        return HeadRecord("job", data)
    if "message" in data:
        return HeadRecord("message", data)
    return HeadRecord("text", {"line": line})


class HeadLog:
    """A thread that streams pod `pod_id`'s container log into `records`, resuming after the
    last event it saw whenever the stream ends, until stop(). A refused key ends it with a
    'lost' record naming why."""

    def __init__(self, client: Client, pod_id: str, records: queue.Queue[HeadRecord]):
        self.client, self.pod_id, self.records = client, pod_id, records
        self.last_id: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"log-{pod_id}", daemon=True)

    def start(self) -> HeadLog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                for event_id, payload in self.client.stream_logs(self.pod_id, self.last_id,
                                                                 idle=IDLE):
                    self.last_id = event_id or self.last_id
                    if payload.get("source", "container") == "container":
                        self.records.put(parse(str(payload.get("line", ""))))
                    if self._stop.is_set():
                        return
            except RunPodAuthError as exc:
                self.records.put(HeadRecord("lost", {"why": str(exc)}))
                return
            except RunPodApiError:
                pass  # no answer, or the pod is not there (yet): the caller watches the pods
            self._stop.wait(RECONNECT_PAUSE)
