"""A stop request (`podagent stop`) seen from every wait of the head.

The request is a key in the head's GCS (runstate.KV_STOP_REQUEST). `StopWatch.look` reads it at
most once a second (one tiny KV read) and raises EndRequested: the run then ends in order with
exit 0. `WatchedSignals` is the head's view of Signals whose every check and sleep also looks,
so no wait of the head can miss a request.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from podagent.cluster import runstate
from podagent.ray_access.gcs import GcsClient, GcsUnavailable
from podagent.report import Reporter
from podagent.run.lifecycle import EndRequested
from podagent.waiting import Signals
from podagent.wire import Event

STOP_POLL = 1.0  # a stop request is looked for at most this often
STOP_LOOK_TIMEOUT = 0.5


class StopWatch:
    def __init__(self, reporter: Reporter, clock: Callable[[], float] = time.monotonic):
        self.reporter, self._clock = reporter, clock
        self.gcs: GcsClient | None = None  # set once this pod's Ray answers
        self._next_look = 0.0
        self._seen = False

    def look(self) -> None:
        """Raises EndRequested when a stop request is there; otherwise returns at once."""
        if self.gcs is None or self._seen:
            return
        now = self._clock()
        if now < self._next_look:
            return
        self._next_look = now + STOP_POLL
        try:
            raw = self.gcs.kv_get(runstate.KV_NAMESPACE, runstate.KV_STOP_REQUEST,
                                  timeout=STOP_LOOK_TIMEOUT)
        except GcsUnavailable:
            return  # the GCS is watched elsewhere; a stop request needs one that answers
        if raw is None:
            return
        self._seen = True
        by, at = runstate.parse_stop_request(raw)
        when = f" at {time.strftime('%H:%M:%S', time.gmtime(at))} UTC" if at else ""
        self.reporter.say(f"stop requested by {by}{when}: ending the run in order (job, "
                          f"workers, Ray)")
        self.reporter.event(Event.STOP_REQUESTED, by=by, at=at)
        raise EndRequested("StopRequested", f"stop requested by {by}")


class WatchedSignals(Signals):
    """Signals whose every check and sleep also looks for a stop request."""

    def __init__(self, signals: Signals, look: Callable[[], None]):  # no super(): a view
        self._inner, self._look = signals, look

    @property  # type: ignore[override]
    def received(self) -> int | None:
        return self._inner.received

    @property  # type: ignore[override]
    def event(self) -> threading.Event:
        return self._inner.event

    def install(self, on_second: Callable[[int], None] | None = None) -> None:
        self._inner.install(on_second)

    def check(self) -> None:
        self._inner.check()
        self._look()

    def sleep(self, seconds: float) -> None:
        self._inner.check()
        self._look()
        self._inner.sleep(seconds)
