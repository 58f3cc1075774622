"""The run's deadline (PODAGENT_DEADLINE): a cap on what a run nobody watches may cost.

`podagent up --max-duration/--max-cost` turns its limits into one point in time, counted from
the run's creation, and gives it to every pod: a detached run and a restarted container are
held to it as well as a followed one. On the pods the head ends the run there in order: the
job gets SIGTERM and PODAGENT_STOP_TIMEOUT to checkpoint, the workers hear that the run is
over, and every pod does what PODAGENT_AFTER_RUN says (stops, or is terminated). Nothing
starts it again: a start after the deadline ends at once with the same code, and so do the
pods of a run whose head is gone.

Both engines ask here: the Ray head at every wait (cluster/head.py, beside `podagent stop`'s
request), the head without Ray in its run's loop (gang/supervisor.py), every start before its
engine runs (run/start.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from podagent.config import Settings
from podagent.errors import DeadlineReached
from podagent.report import Reporter
from podagent.wire import Event


def when(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at))


# A worker ends by itself only this long after the deadline and the job's grace: the head
# ends the run in order before (the job's ranks on the worker are checkpointing meanwhile); a
# worker whose head is gone does not wait for it past this.
WORKER_LATE = 60.0


def passed(settings: Settings, clock: Callable[[], float] = time.time
           ) -> DeadlineReached | None:
    """The run's end when its deadline has passed (None: no deadline, or not yet)."""
    at = settings.deadline
    if at is None or clock() < at:
        return None
    return DeadlineReached(f"the run reached its deadline, {when(at)} (PODAGENT_DEADLINE): "
                           f"its job was stopped (SIGTERM, up to "
                           f"{settings.stop_timeout:g} s to checkpoint) and every pod ended")


def check_at_start(settings: Settings) -> None:
    """A start after the deadline does nothing but end (a restarted container, a worker that
    comes back): raises DeadlineReached."""
    if settings.deadline is not None and time.time() >= settings.deadline:
        raise DeadlineReached(f"the run is past its deadline, {when(settings.deadline)} "
                              f"(PODAGENT_DEADLINE): not starting it again")


def check_late(settings: Settings) -> None:
    """A worker's waits: past the deadline, the job's grace and WORKER_LATE, its head did
    not end the run (gone, say): raises DeadlineReached."""
    at = settings.deadline
    if at is not None and time.time() >= at + settings.stop_timeout + WORKER_LATE:
        raise DeadlineReached(f"the run passed its deadline, {when(at)} (PODAGENT_DEADLINE), "
                              f"and its head did not end it: this pod leaves")


class DeadlineWatch:
    """Looked at from the head's loops, as often as they like: once the deadline has passed,
    every look gives the run's end, and the first says that the run is ending for it (with
    the job's grace: `up` waits that long before it ends the run itself)."""

    def __init__(self, settings: Settings, reporter: Reporter,
                 clock: Callable[[], float] = time.time):
        self.settings, self.reporter, self._clock = settings, reporter, clock
        self._said = False

    def reached(self) -> DeadlineReached | None:
        over = passed(self.settings, self._clock)
        if over is not None and not self._said:
            self._said = True
            at = self.settings.deadline
            self.reporter.warn(f"DEADLINE: the run reached {when(at)} (PODAGENT_DEADLINE): "
                               f"stopping its job (SIGTERM, up to "
                               f"{self.settings.stop_timeout:g} s to checkpoint) and ending it "
                               f"on every pod")
            self.reporter.event(Event.DEADLINE, at=at, grace_s=self.settings.stop_timeout)
        return over
