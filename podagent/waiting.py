"""Signals recorded by handlers and acted on by the loops; bounded, interruptible waits;
deadlines that a signal can bring earlier."""

from __future__ import annotations

import concurrent.futures
import signal
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from podagent.errors import Interrupted


class Signals:
    """Handlers only record the signal; the loops act on it. A second signal forces."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.received: int | None = None
        self.on_second: Callable[[int], None] | None = None

    def install(self, on_second: Callable[[int], None] | None = None) -> None:
        self.on_second = on_second
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, _frame: object) -> None:
        if self.received is not None and self.on_second:
            self.on_second(signum)
            return
        self.received = signum
        self.event.set()

    def check(self) -> None:
        if self.received is not None:
            raise Interrupted(self.received)

    def sleep(self, seconds: float) -> None:
        """A wait that a signal cuts short; used as tenacity's sleep."""
        if self.event.wait(seconds):
            raise Interrupted(self.received or signal.SIGTERM)


class Deadline:
    """When a step must be done by (monotonic time), which may move earlier while the step
    runs: a signal during a teardown gives every step at most what is left of its budget, the
    step already under way included."""

    def __init__(self, when: Callable[[], float]):
        self._when = when

    @classmethod
    def after(cls, seconds: float, cap: Callable[[], float | None] = lambda: None) -> Deadline:
        """`seconds` from now, or `cap()` when that is earlier (asked again at every look)."""
        own = time.monotonic() + seconds

        def when() -> float:
            limit = cap()
            return own if limit is None else min(own, limit)

        return cls(when)

    @classmethod
    def of(cls, timeout: float | Deadline) -> Deadline:
        return timeout if isinstance(timeout, Deadline) else cls.after(timeout)

    @property
    def at(self) -> float:
        return self._when()

    def left(self) -> float:
        return max(0.0, self.at - time.monotonic())

    @property
    def passed(self) -> bool:
        return self.left() <= 0.0

    def at_least(self, seconds: float) -> Deadline:
        """This deadline, but never sooner than `seconds` from now: a step that must still do
        something quick (send SIGKILL, say) when its time is up."""
        floor = time.monotonic() + seconds
        return Deadline(lambda: max(floor, self.at))


T = TypeVar("T")
WAIT_SLICE = 0.05  # how often a wait for another thread's call looks for a signal


def interruptible(call: Callable[[], T], signals: Signals) -> T:
    """`call()`, as a signal does not have to wait for it: a socket read ends only at its own
    timeout, whatever signal comes meanwhile. It runs on a thread of its own, and this waits for
    it in short sleeps that a signal ends (the thread is left to its timeout)."""
    done: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        try:
            done.set_result(call())
        except BaseException as exc:  # handed over whole: the caller sorts them out
            done.set_exception(exc)

    threading.Thread(target=run, name="interruptible", daemon=True).start()
    while not done.done():
        signals.sleep(WAIT_SLICE)
    return done.result()
