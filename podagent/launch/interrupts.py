"""The signals of the commands that run on the user's machine (up, down, ls).

The first SIGINT, SIGTERM or SIGHUP (Ctrl-C, a closed terminal, a cancelled CI job) ends what
the command is doing (KeyboardInterrupt where it is), unless it is terminating pods already:
then it is only noted, and the termination goes on. A second one, anywhere, is `Leave`: the
pods are left as they are, and the command says how to clean up. Python raises a handler's
exception in the main thread between two bytecodes, so a blocking call there ends at once.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import queue
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from podagent.waiting import WAIT_SLICE, Deadline

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
T = TypeVar("T")


class Leave(BaseException):
    """A second interrupt: leave everything as it is, now. A BaseException, so that no
    `except Exception` on the way out takes it for a failure to handle."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


class Interrupts:
    def __init__(self) -> None:
        self.first: int | None = None
        self.left = False  # a second signal came: the command leaves now
        self._shielded = 0

    def install(self) -> Interrupts:
        # SIGINT too: a process started in the background inherits it ignored, and Python
        # then leaves it so; Ctrl-C must always reach the clean-up.
        for signum in SIGNALS:
            signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, _frame: object) -> None:
        if self.first is not None:
            self.left = True
            raise Leave(signum)
        self.first = signum
        if not self._shielded:
            raise KeyboardInterrupt(signum)

    def hold(self) -> None:
        """From now on a first signal is only noted (the command is ending and terminates
        what it created either way); a second one is still `Leave`."""
        self._shielded += 1

    @contextlib.contextmanager
    def shielded(self) -> Iterator[None]:
        """While pods are being terminated: a first signal does not stop it."""
        self._shielded += 1
        try:
            yield
        finally:
            self._shielded -= 1

    @property
    def name(self) -> str:
        return signal.Signals(self.first or signal.SIGINT).name


def signum_of(exc: BaseException) -> int:
    """The signal a KeyboardInterrupt came from (SIGINT when Python raised it itself)."""
    if isinstance(exc, Leave):
        return exc.signum
    if exc.args and isinstance(exc.args[0], int):
        return exc.args[0]
    return int(signal.SIGINT)


# The main thread, which the handler above interrupts, never blocks in threading's
# Condition.wait (Future.result, as_completed, Queue.get with a timeout, Event.wait): a
# KeyboardInterrupt raised between two of its bytecodes can leave a waiter's lock released and
# still queued, and the thread that notifies next fails with "release unlocked lock" (a
# traceback after Ctrl-C, seen in `up`). A sleep ends cleanly on a signal; the looks between
# sleeps hold a lock only for a moment.


def wait_until(done: Callable[[], bool], timeout: float | None = None) -> bool:
    """Until done() (True) or `timeout` seconds (False), in sleeps of WAIT_SLICE."""
    deadline = None if timeout is None else Deadline.after(timeout)
    while not done():
        if deadline is not None and deadline.passed:
            return False
        time.sleep(WAIT_SLICE)
    return True


def result(call: concurrent.futures.Future[T]) -> T:
    """A future's result (or its exception), waited for as wait_until waits."""
    wait_until(call.done)
    return call.result()


def as_completed(calls: Iterable[concurrent.futures.Future[T]]
                 ) -> Iterator[concurrent.futures.Future[T]]:
    """Each future as it finishes, waited for as wait_until waits."""
    pending = list(calls)
    while pending:
        wait_until(lambda: any(c.done() for c in pending))
        for call in [c for c in pending if c.done()]:
            pending.remove(call)
            yield call


def next_item(from_queue: queue.Queue[T], timeout: float) -> T:
    """The queue's next item within `timeout` (else queue.Empty), waited for as wait_until
    waits."""
    got: list[T] = []

    def taken() -> bool:
        with contextlib.suppress(queue.Empty):
            got.append(from_queue.get_nowait())
        return bool(got)

    if not wait_until(taken, timeout):
        raise queue.Empty
    return got[0]
