"""Signals recorded by handlers and acted on by the loops; bounded, interruptible waits."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

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
