"""Following the head pod from afar: its container log through RunPod's log stream (Server-Sent
Events), each line one of podagent's JSON records (the head runs with PODAGENT_LOG_FORMAT=json:
messages, events and the job's own lines), handed on as HeadRecords.

The stream is never trusted to stay up: it is opened again whenever it ends, drops or fails,
resuming where it was (runpod_api.LogCursor: no line twice, none lost, whatever RunPod does
with a repeated timestamp), with a growing pause while it keeps failing. A stream broken for
BROKEN_SAY seconds is reported once ("broken"), and again when it is back ("restored"): `up`
keeps judging the pods' statuses meanwhile, so a head that is gone is noticed all the same.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

from podagent.errors import RunPodAuthError
from podagent.platform.runpod_api import Client, LogCursor
from podagent.waiting import Backoff

RECONNECT_PAUSE = 1.0  # seconds between a stream that ended and the next (it resumes)
BROKEN_BACKOFF = Backoff(1.0, 8.0)  # between tries while the stream keeps failing
BROKEN_SAY = 5.0  # a stream failing this long is reported (a moment's failure is not)
IDLE = 30.0  # a stream silent this long is opened again (a proxy may have dropped it)


@dataclass(frozen=True)
class HeadRecord:
    kind: str  # "event", "job" (the job's output), "message", "text", "lost", "broken",
    # "restored"
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
    """A thread that streams pod `pod_id`'s container log into `records` until stop(). A
    refused key ends it with a 'lost' record naming why; anything else is tried again."""

    def __init__(self, client: Client, pod_id: str, records: queue.Queue[HeadRecord]):
        self.client, self.pod_id, self.records = client, pod_id, records
        self.cursor = LogCursor()
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"log-{pod_id}", daemon=True)

    def start(self) -> HeadLog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        failures = 0
        broken_since: float | None = None
        said = False

        def opened() -> None:
            nonlocal failures, broken_since, said
            failures, broken_since = 0, None
            if said:
                said = False
                self.records.put(HeadRecord("restored", {}))

        while not self._stop.is_set():
            why = None
            try:
                self.connections += 1
                for payload in self.client.stream_logs(self.pod_id, self.cursor, idle=IDLE,
                                                       opened=opened):
                    self.records.put(parse(str(payload.get("line", ""))))
                    if self._stop.is_set():
                        return
            except RunPodAuthError as exc:
                self.records.put(HeadRecord("lost", {"why": str(exc)}))
                return
            except Exception as exc:  # an API error, a dropped stream, a reading bug: again
                why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if why is None:
                self._stop.wait(RECONNECT_PAUSE)
                continue
            failures += 1
            now = time.monotonic()
            broken_since = broken_since or now
            if not said and now - broken_since >= BROKEN_SAY:
                said = True
                self.records.put(HeadRecord("broken", {"why": why}))
            self._stop.wait(BROKEN_BACKOFF.pause(failures))


# --- a stopped pod's last words ----------------------------------------------------------------

LAST_LINES = 300  # of a stopped pod's log: its last start's end is among them
LAST_IDLE = 3.0  # a stopped pod's stream says nothing new: what it had is read
LAST_WITHIN = 10.0  # one look at a stopped pod's log, at most


@dataclass(frozen=True)
class Words:
    """What a stopped pod's podagent said last: its exit code and why, and whether its GPUs
    failed their check (exit 28, the GPU check's failures)."""
    code: int | None
    error: str
    gpu_failure: str = ""

    def suffix(self) -> str:
        if self.code is None:
            return ""
        why = f": {self.error}" if self.error else ""
        return f" (its podagent last exited {self.code}{why})"


WORDS_LIMIT = 500  # characters of a pod's own words `up` repeats


def plain(text: Any, limit: int = WORDS_LIMIT) -> str:
    """A pod's words as one line fit for a terminal and a record: no control characters
    (escape sequences, bells), whitespace collapsed, at most `limit` characters."""
    text = "".join(c if c.isprintable() else " " for c in str(text))
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


def last_words(records: list[HeadRecord], gpu_code: int) -> Words | None:
    """From a pod's last lines (each one of podagent's JSON records): its last start's exit."""
    found: Words | None = None
    for record in records:
        data = record.data
        if record.kind != "event" or data.get("event") != "exit":
            continue
        code = data.get("code")
        code = code if isinstance(code, int) and not isinstance(code, bool) else None
        error = plain(data.get("error") or "")
        found = Words(code, error, error if code == gpu_code else "")
    return found


class LastWords:
    """Each stopped pod's log read once, in a thread of its own, for its last exit (a worker's
    GPU check that failed, or why it stopped): `up` judges the pods meanwhile."""

    def __init__(self, client: Client, gpu_code: int):
        self.client, self.gpu_code = client, gpu_code
        self._words: dict[str, Words] = {}  # by pod id
        self._asked_at: dict[str, float] = {}
        self._done: set[str] = set()
        self._lock = threading.Lock()

    def ask(self, pod_id: str) -> None:
        with self._lock:
            if pod_id in self._asked_at:
                return
            self._asked_at[pod_id] = time.monotonic()
        threading.Thread(target=self._read, args=(pod_id,), name=f"last-{pod_id}",
                         daemon=True).start()

    def of(self, pod_id: str) -> Words | None:
        with self._lock:
            return self._words.get(pod_id)

    def pending(self, pod_id: str) -> bool:
        """Whether its log is still being read, within LAST_WITHIN: its loss waits for it."""
        with self._lock:
            asked = self._asked_at.get(pod_id)
            done = pod_id in self._done
        return asked is not None and not done and time.monotonic() - asked < LAST_WITHIN

    def _read(self, pod_id: str) -> None:
        """Each exit heard is kept at once; the last one stands. A stream kept alive long
        after the pod's last line ends by its idle timeout, or when the pod is terminated;
        `pending` stops waiting for it after LAST_WITHIN whatever it does."""
        until = time.monotonic() + LAST_WITHIN
        try:
            for payload in self.client.stream_logs(pod_id, LogCursor(), idle=LAST_IDLE,
                                                   tail=LAST_LINES):
                words = last_words([parse(str(payload.get("line", "")))], self.gpu_code)
                if words is not None:
                    with self._lock:
                        self._words[pod_id] = words
                if time.monotonic() > until:
                    return
        except Exception:  # a pod gone, an API error: nothing more is known
            return
        finally:
            with self._lock:
                self._done.add(pod_id)
