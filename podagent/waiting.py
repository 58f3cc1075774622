"""Signals recorded by handlers and acted on by the loops; bounded, interruptible waits;
deadlines that a signal can bring earlier."""

from __future__ import annotations

import concurrent.futures
import signal
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    retry_if_result,
)

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


# --- the one retry helper -------------------------------------------------------------------


class NotYet(Exception):
    """What a probe raises while the thing awaited is not there yet; the message says what it
    saw. `retry_after`: how long the other side asked us to wait (an HTTP 429), if it did; it
    replaces the backoff's pause for that try."""

    def __init__(self, seen: str, retry_after: float | None = None):
        super().__init__(seen)
        self.retry_after = retry_after


@dataclass(frozen=True)
class Backoff:
    """The pause between tries: `first`, doubling up to `most` (both equal: a steady poll)."""

    first: float
    most: float

    @classmethod
    def every(cls, seconds: float) -> Backoff:
        return cls(seconds, seconds)

    def pause(self, tries: int) -> float:
        # The doubling stops at `most`: past 2**60 it would overflow a float (a fast-failing
        # probe makes thousands of tries within a long deadline).
        return min(self.most, self.first * 2 ** min(60, max(0, tries - 1)))


class Expired(Exception):
    """A wait ran out: what was awaited, for how long, and what was seen last (`last` is the
    probe's last answer, for a wait whose caller makes do with it; `tries`: how many)."""

    def __init__(self, awaited: str, waited: float, seen: str, last: Any = None,
                 tries: int = 0):
        self.awaited, self.waited, self.seen, self.last = awaited, waited, seen, last
        self.tries = tries
        super().__init__(f"gave up after {round(waited, 1):g} s waiting for {awaited}; "
                         f"last seen: {seen}")


def retry(probe: Callable[[], T], *, awaited: str, backoff: Backoff,
          deadline: Deadline | float | None = None, attempts: int | None = None,
          sleep: Callable[[float], None] = time.sleep,
          on: tuple[type[BaseException], ...] = (NotYet,),
          until: Callable[[T], bool] | None = None,
          seen: Callable[[T], str] = repr,
          expired: Callable[[Expired], BaseException] | None = None,
          before_pause: Callable[[str, float], None] | None = None) -> T:
    """Call `probe` until it gives an answer: it raises one of `on` (or returns a value that
    `until` rejects) while the thing `awaited` is not there, and is tried again after a pause
    from `backoff`, never past `deadline` (seconds or a Deadline) nor beyond `attempts` tries.

    When they run out: `expired(Expired(...))` is raised if given, else the `Expired` itself,
    naming what was awaited and what was seen last. `sleep` is where a signal ends the wait
    (`Signals.sleep`); any other exception of the probe ends it at once. `before_pause(seen,
    seconds)` hears of each try that failed, for a wait that says so as it goes."""
    policy = _policy(awaited, backoff, deadline, attempts, on, until, seen, expired,
                     before_pause)
    return Retrying(sleep=sleep, **policy)(probe)


async def retry_async(probe: Callable[[], Awaitable[T]], *, awaited: str, backoff: Backoff,
                      deadline: Deadline | float | None = None, attempts: int | None = None,
                      sleep: Callable[[float], Awaitable[None]] | None = None,
                      on: tuple[type[BaseException], ...] = (NotYet,),
                      expired: Callable[[Expired], BaseException] | None = None) -> T:
    """`retry` for a coroutine's probe, its pauses awaited (asyncio.sleep unless `sleep`):
    the same policy, on tenacity."""
    import asyncio  # only a coroutine's wait needs it

    policy = _policy(awaited, backoff, deadline, attempts, on, None, repr, expired, None)
    return await AsyncRetrying(sleep=sleep or asyncio.sleep, **policy)(probe)


def _policy(awaited: str, backoff: Backoff, deadline: Deadline | float | None,
            attempts: int | None, on: tuple[type[BaseException], ...],
            until: Callable[[Any], bool] | None, seen: Callable[[Any], str],
            expired: Callable[[Expired], BaseException] | None,
            before_pause: Callable[[str, float], None] | None) -> dict[str, Any]:
    """tenacity's arguments for a wait as `retry` describes it."""
    if deadline is None and attempts is None:
        raise ValueError(f"waiting for {awaited}: a wait needs a deadline or a number of tries")
    ends = None if deadline is None else Deadline.of(deadline)
    started = time.monotonic()

    def stop(state: RetryCallState) -> bool:
        return ((ends is not None and ends.passed)
                or (attempts is not None and state.attempt_number >= attempts))

    def pause(state: RetryCallState) -> float:
        failure = state.outcome.exception() if state.outcome else None
        asked = failure.retry_after if isinstance(failure, NotYet) else None
        wanted = backoff.pause(state.attempt_number) if asked is None else asked
        return wanted if ends is None else min(wanted, ends.left())

    def heard(state: RetryCallState) -> None:  # tenacity's before_sleep: a pause will follow
        if before_pause is not None and state.outcome is not None and state.next_action:
            before_pause(_said(state.outcome, seen), state.next_action.sleep)

    condition = retry_if_exception_type(on)
    if until is not None:
        condition = condition | retry_if_result(lambda answer: not until(answer))

    def give_up(state: RetryCallState) -> Any:
        outcome = state.outcome
        assert outcome is not None  # tenacity gives up only after a try
        last = None if outcome.failed else outcome.result()
        out = Expired(awaited, time.monotonic() - started, _said(outcome, seen), last,
                      tries=state.attempt_number)
        raise (expired(out) if expired is not None else out) from None

    return {"stop": stop, "wait": pause, "retry": condition, "before_sleep": heard,
            "retry_error_callback": give_up}


def _said(outcome: Any, seen: Callable[[Any], str]) -> str:
    """What a try saw: its exception's message, or its answer as `seen` puts it."""
    failure = outcome.exception()
    return seen(outcome.result()) if failure is None else (str(failure) or type(failure).__name__)
