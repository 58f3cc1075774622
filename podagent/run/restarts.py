"""One restart of a run, whatever its cause (a lost pod, a hang, a failed job) and whichever
engine carries it out: admitted against PODAGENT_RESTARTS (one budget per run, counted in the
ledger across container restarts: run/policy.py's `admit`), said once as "RESTART n/N", kept in
the ledger and as an event, then backed off (PODAGENT_RESTART_BACKOFF, doubled each time).

The engines only say what they do about it: the Ray head resubmits its job
(cluster/recovery.py), a run without Ray halts the training on every pod and starts it again
after a hang (gang/supervisor.py), or ends this start so that RunPod starts the pods again after
a lost pod (`after_lost_starts`, which counts those starts when the next one begins).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from podagent.config import Settings
from podagent.report import Reporter
from podagent.run import policy
from podagent.run.ledger import Ledger, record_or_warn
from podagent.waiting import Signals
from podagent.wire import Ending, Event

# How a start of a run without Ray ends when a pod of the run was lost or never came: the run
# is not over (the restarted containers start it again), but only so often.
LOSSES = ("PeerLost", "WorkersTimeout", "HeadUnreachable")


@dataclass(frozen=True)
class Restart:
    n: int
    backoff: float  # seconds from `began` before the work starts again
    began: float  # monotonic


def begin(settings: Settings, ledger: Ledger | None, reporter: Reporter, why: str, then: str,
          kind: Ending = Ending.LOST, done: int = 0, **record: Any) -> Restart:
    """Restart the run for `why` (doing `then`): its number, counted against
    PODAGENT_RESTARTS from the ledger's restarts (or `done`, where this pod keeps no ledger);
    said, recorded (`record` goes in the ledger's entry and the event) and timed. Restarts used
    up raise RestartsExhausted, or RunHung after a hang (its own code); logs and checkpoints are
    kept."""
    number = policy.admit(settings, len(ledger.restarts) if ledger is not None else done, why,
                          kind)
    restart = Restart(number, policy.backoff(settings, number), time.monotonic())
    reporter.warn(f"RESTART {number}/{settings.restarts}: {why}; {then}")
    if ledger is not None:  # counted in memory either way; a volume that refuses is a warning
        record_or_warn(lambda: ledger.restarting({"n": number, "reason": why, **record}),
                       reporter)
    reporter.event(Event.RESTART, n=number, of=settings.restarts, reason=why,
                   backoff_s=restart.backoff, **record)
    return restart


def back_off(restart: Restart, reporter: Reporter, signals: Signals,
             since: float | None = None) -> None:
    """Wait for what is left of the restart's backoff, counted from `since` (monotonic; by
    default from the restart's start: the Ray head spends it waiting for the pods); a signal
    ends the wait."""
    wait = (restart.began if since is None else since) + restart.backoff - time.monotonic()
    if wait > 0:
        reporter.say(f"restart {restart.n}: backing off {wait:.1f} s (PODAGENT_RESTART_BACKOFF)")
        signals.sleep(wait)


def after_lost_starts(settings: Settings, ledger: Ledger, reporter: Reporter) -> Restart | None:
    """A run whose pods keep getting lost is started again by RunPod (the containers start
    again, the training resumes from its checkpoint) as the policy allows: a pod gone for good
    must not keep the others restarting, billing, for ever. Each earlier start that ended so
    is one restart in the ledger's `restarts`, where a hang's restart is one too: one
    PODAGENT_RESTARTS budget, whatever the mix of causes. The restart this start is, if it is
    one (None: none)."""
    counted = {entry.get("after_start") for entry in ledger.restarts}
    restart: Restart | None = None
    losses = 0
    for index, start in enumerate(ledger.data["starts"][:-1]):
        if start.get("outcome") not in LOSSES:
            continue
        losses += 1
        if index in counted:
            continue
        why = f"run {settings.run_name}: a pod was lost or missing {losses} time(s)"
        record = {"after_start": index, "outcome": start["outcome"]}
        restart = begin(settings, ledger, reporter, why, "starting it again", **record)
    return restart
