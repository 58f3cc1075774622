"""What the head's and the worker's lifecycles share: one loop over named states, teardown
from `finally` within a budget, each of its steps guarded. What a teardown stops (the job,
this pod's Ray: ray_node.stop_at_teardown) is the roles' own."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from typing import Any, ClassVar, Generic, TypeVar

from podagent.choices import AfterRun
from podagent.config import Settings
from podagent.errors import Interrupted, PodagentError
from podagent.platform.roles import RoleDecision
from podagent.report import Reporter
from podagent.run.ledger import INTERNAL_ERROR
from podagent.waiting import Deadline, Signals
from podagent.wire import Event

State = TypeVar("State", bound=enum.Enum)
T = TypeVar("T")
# A signal ends the run: RunPod sends SIGKILL about 5 s after SIGTERM on spot pods, so the
# whole teardown fits in this (each step gets what is left; the ledger and events come first).
TERM_BUDGET = 4.0
STEP_MINIMUM = 0.2  # however late, a step gets this long (to send SIGKILL, say)


class EndRequested(Exception):
    """An orderly end asked for from outside: teardown runs as for any ending. `podagent stop`'s
    counts as a success (exit 0), not as an error or a signal; one that carries `error` (the
    run's deadline: run/cap.py) ends with that error's code once the teardown is done."""

    def __init__(self, outcome: str, message: str, error: PodagentError | None = None):
        self.outcome, self.error = outcome, error
        super().__init__(message)


class Lifecycle(Generic[State]):
    """Subclasses name their first and last state, map each other state to a handler that
    returns the next one, and implement `_teardown(outcome)`."""

    FIRST: ClassVar[enum.Enum]
    LAST: ClassVar[enum.Enum]
    SUCCESS: ClassVar[str]

    def __init__(self, settings: Settings, decision: RoleDecision, reporter: Reporter,
                 signals: Signals):
        self.settings, self.decision = settings, decision
        self.reporter, self.signals = reporter, signals
        self.state: State = self.FIRST  # type: ignore[assignment]
        self.started = time.monotonic()
        self._ends_by: float | None = None  # set when a signal ends the run

    def handlers(self) -> dict[State, Callable[[], State]]:
        raise NotImplementedError

    @property
    def adopted_ray(self) -> bool:
        """Whether this start took over a Ray an earlier podagent of the run started: its
        daemons are not our descendants, so stopping them means finding them. Only a head
        re-attaches (its HeadRay knows)."""
        return False

    def run(self) -> None:
        handlers = self.handlers()
        outcome = INTERNAL_ERROR  # unless the loop ends otherwise
        try:
            while self.state is not self.LAST:
                self._check_signals()
                self.reporter.event(Event.STATE, state=self.state.value, **self._state_fields())
                self.state = handlers[self.state]()
            outcome = self._finished_outcome()
        except EndRequested as exc:
            outcome = exc.outcome
            if exc.error is not None:
                raise exc.error from None  # after the teardown below
        except Interrupted as exc:
            outcome = type(exc).__name__
            self._note_signal()
            raise
        except PodagentError as exc:
            outcome = type(exc).__name__
            raise
        finally:
            self.reporter.event(Event.TEARDOWN_STARTED, outcome=outcome)
            self._teardown(outcome)

    def _teardown(self, outcome: str) -> None:
        raise NotImplementedError

    def _check_signals(self) -> None:
        """Between states: a signal raises Interrupted here (a role whose handlers turn a
        signal into an orderly end of their own says so by overriding this)."""
        self.signals.check()

    def _finished_outcome(self) -> str:
        """The outcome of a run whose loop reached LAST (a role whose run can end badly
        without raising says which end it came to)."""
        return self.SUCCESS

    def _state_fields(self) -> dict[str, Any]:
        """What the `state` event says beside the state's name."""
        return {}

    # --- what the start asks once `run()` is over ----------------------------------------------

    def after_run(self) -> AfterRun | None:
        """What the pod does next once the run is over for good; None when it is not (a
        signal, a lost Ray: left to a restart, which resumes it)."""
        return None

    def over_word(self) -> tuple[str, list[str]] | None:
        """A head: its address, to say there that the run is over, and the workers that did
        not leave with it (they may come back and ask). None elsewhere."""
        return None

    # --- the teardown's time and steps --------------------------------------------------------

    def _note_signal(self) -> bool:
        """A signal ends the run, also one that arrives during an ordinary teardown: from
        then on every step, the one under way included, gets what is left of TERM_BUDGET."""
        if self._ends_by is None and self.signals.received is not None:
            self._ends_by = time.monotonic() + TERM_BUDGET
            self.reporter.event(Event.TERMINATING, signal=self.signals.received,
                                budget_s=TERM_BUDGET)
        return self._ends_by is not None

    @property
    def hurried(self) -> bool:
        """A signal ends the run: the pod has seconds before SIGKILL."""
        return self._note_signal()

    def _deadline(self, want: float, hurried: float | None = None) -> Deadline:
        """A teardown step's deadline: `want` seconds (`hurried` when a signal ends the run),
        and never past the end of TERM_BUDGET once a signal came, however late it comes."""
        seconds = hurried if hurried is not None and self.hurried else want

        def budget_end() -> float | None:
            self._note_signal()
            return self._ends_by

        return Deadline.after(seconds, cap=budget_end).at_least(STEP_MINIMUM)

    def _guarded(self, what: str, step: Callable[[], T]) -> T | None:
        """One step of a teardown: a failure (a full volume, an API that broke) is said, and
        the next step still runs; stopping the rest matters more than any one step."""
        try:
            return step()
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            self.reporter.warn(f"teardown: could not {what} ({error}); going on")
            self.reporter.event(Event.TEARDOWN_STEP_FAILED, step=what, error=error)
            return None
