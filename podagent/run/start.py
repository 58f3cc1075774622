"""One start of podagent on a pod, whatever runs the job: the sequence every role of every
engine goes through once, written here only.

    warn early -> the engine checks its input (exit 2 before anything starts) -> dry run, or:
    the pod's log -> who this pod is -> signals, subreaper -> the ledger (a finished run is not
    run again) -> the run's deadline (run/cap.py: past it, nothing starts) -> the engine's run
    -> its end as one line and one code (run/exits.py) -> the ledger's end -> what the pod
    does next (run/shell.py's `settle`)

An engine (the Ray head or worker: cluster/run.py; a run without Ray: gang/run.py) is an
adapter: it checks, dry-runs, and runs its role's lifecycle; it keeps no start sequence, exit
code or restart count of its own (run/restarts.py counts every restart).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from podagent import __version__, config, process
from podagent.choices import AfterRun
from podagent.config.policy import RUNPOD_ACCOUNT_KEY, RUNPOD_API_KEY
from podagent.errors import PodagentError
from podagent.platform.roles import RoleDecision
from podagent.report import Reporter
from podagent.run import after_run, cap, exits
from podagent.run.ledger import INTERNAL_ERROR, SUCCEEDED, Ledger, recall, record_or_warn
from podagent.run.shell import SUCCESS, install_signals, report_end, reporter_for, settle
from podagent.waiting import Signals
from podagent.wire import Event


@dataclass(frozen=True)
class Start:
    """What an engine's run is handed: this start's reporter, signals and (where the role
    keeps one) the run's ledger, already recalled and this start recorded in it."""
    settings: config.Settings
    decision: RoleDecision
    reporter: Reporter
    signals: Signals
    ledger: Ledger | None


@dataclass
class Ending:
    """What the engine says once its run is over, however it ended (an error too)."""
    # What the pod does next when the head said the run is over (a worker); None: the
    # settings' PODAGENT_AFTER_RUN, if the run is over.
    after_run: AfterRun | None = None
    # A head: its address, to say there that the run is over, and the workers that did not
    # leave with it (they may come back and ask).
    over_word: tuple[str, list[str]] | None = None
    finish: list[Callable[[int], None]] = field(default_factory=list)  # told the exit code


class Engine(Protocol):
    """One role of one engine, as a start sees it."""

    decision: RoleDecision

    @property
    def keeps_ledger(self) -> bool:
        """Whether this role keeps the run's ledger on its volume (a Ray worker does not: its
        head does)."""

    def check(self) -> None:
        """What the role needs, checked before anything starts: bad input raises (exit 2)."""

    def dry_run(self) -> None:
        """Say what this pod would do, touching nothing."""

    def greeting(self) -> tuple[str, dict[str, Any]]:
        """What the first line says after podagent's version, and the role event's fields."""

    def begin(self, reporter: Reporter) -> None:
        """The engine's own lines once the pod's log is open, before the role event."""

    def run(self, start: Start, ending: Ending) -> None:
        """Run the role; fill `ending` as it goes (it is read after an error too)."""


def warn_early(settings: config.Settings) -> None:
    """What a run and a dry run say first, before anything can fail: a misspelt variable may
    be why a part is missing or a role is unclear."""
    if not settings.warnings:
        return
    early = reporter_for(settings, "podagent")
    for warning in settings.warnings:  # e.g. a PODAGENT_* variable with a typo in its name
        early.warn(warning)


def start(settings: config.Settings, engine: Callable[[], Engine], *, dry_run: bool) -> int:
    """Work out the role (`engine` makes it), check what it needs, and run it (or say what it
    would do): the exit code. Bad input raises before anything starts."""
    warn_early(settings)
    role = engine()
    role.check()
    if dry_run:
        role.dry_run()
        return SUCCESS
    return _run(settings, role)


def _run(settings: config.Settings, engine: Engine) -> int:
    decision = engine.decision
    reporter = reporter_for(settings, decision.role.value, run_dir=settings.run_dir)
    # podagent alone talks to RunPod's API: no child (Ray, the job, the reward server, W&B's
    # service) inherits a key. The settings keep their own copy of the environment; until the
    # pod's directory is this process's (reporter_for claims it), an error ends the start at
    # the command line's boundary, which stops the pod with the key from the environment.
    for key in (RUNPOD_API_KEY, RUNPOD_ACCOUNT_KEY):
        os.environ.pop(key, None)
    for warning in settings.warnings:  # on screen already: the pod's log file keeps them too
        reporter.log_only(f"WARNING: {warning}")
    words, fields = engine.greeting()
    reporter.say(f"podagent {__version__} {words}: this pod is the {decision.role.value} "
                 f"({decision.reason}); run {settings.run_name}")
    engine.begin(reporter)
    reporter.event(Event.ROLE, role=decision.role.value, reason=decision.reason,
                   run=settings.run_name, version=__version__, **fields)
    signals = install_signals(reporter)
    process.become_subreaper()  # what the role starts stays ours when its parent dies
    started = time.monotonic()
    ending = Ending()
    code = SUCCESS
    ledger: Ledger | None = None
    finished: dict[str, Any] | None = None  # the run's end, when an earlier start finished it
    outcome = SUCCEEDED
    try:
        if engine.keeps_ledger:
            ledger = Ledger.load(settings.run_dir, settings.run_name)
            finished = recall(ledger, settings.run_name, settings.run_dir, reporter)
        signals.check()  # a signal already: it ends the start, as between a lifecycle's states
        if finished is None:
            cap.check_at_start(settings)  # past the run's deadline: nothing starts again
            engine.run(Start(settings, decision, reporter, signals, ledger), ending)
        else:  # it ends as it did: the code follows from the outcome, so a head killed
            code = exits.finished_code(finished["outcome"])  # before writing it reads right
    except Exception as exc:
        outcome = type(exc).__name__ if isinstance(exc, PodagentError) else INTERNAL_ERROR
        code = report_end(exc, settings, reporter)
    else:
        reporter.event(Event.EXIT, code=code)
    finally:
        for finish in ending.finish:
            finish(code)
    if ledger is not None and finished is None:
        if not ledger.start_ended:  # the role's teardown records it first where time is short
            record_or_warn(lambda: ledger.ended(outcome, None), reporter)
        record_or_warn(lambda: ledger.exit_code(code), reporter)
    elif ledger is not None and finished is not None and finished.get("exit_code") is None:
        # A head killed before it wrote the run's code: the code its outcome gives, never
        # this start's (a signal now), and no earlier start's record touched.
        run_code = exits.finished_code(finished["outcome"])
        record_or_warn(lambda: ledger.finished_code(run_code), reporter)
    over = ending.after_run is not None or bool(ledger and ledger.finished)
    end = after_run.End(code, over=over, restartable=exits.restartable(code))
    settle(settings, reporter, signals, end, started,
           ending.after_run or (settings.after_run if over else None),
           ending.over_word)
    reporter.close()
    return code
