"""The shell every run has, whatever runs its job: its reporter (secrets hidden), podagent's
signal handling, the one line an error ends a start with, and what the pod does once this
start is over (`settle`).

Exit codes come from the one table (run/exits.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import signal
import socket
import traceback
from pathlib import Path
from typing import IO, TextIO

import psutil

from podagent import config, process
from podagent.choices import AfterRun
from podagent.config.names import UP_RUN_LABEL
from podagent.config.policy import RUNPOD_ACCOUNT_KEY, is_secret, runpod_key
from podagent.errors import ConfigError, Interrupted
from podagent.report import Reporter
from podagent.run import after_run
from podagent.run.ledger import SUCCEEDED
from podagent.waiting import Backoff, Expired, Signals, retry
from podagent.wire import Event

SUCCESS = 0


def secret_values(settings: config.Settings) -> list[str]:
    """What the output must never show: secret variables' values, and the cluster token, which
    may come from a file (RAY_AUTH_TOKEN_PATH) rather than the environment."""
    values = [v for k, v in settings.environ.items() if is_secret(k) and v]
    return [*values, settings.auth_token] if settings.auth_token else values


def reporter_for(settings: config.Settings, who: str, pod: str | None = None,
                 run_dir: Path | None = None, stream: TextIO | None = None) -> Reporter:
    """A reporter that hides the secrets and speaks as the settings say; on screen only unless
    given the run's directory, which this process then holds as its own (`claim`). `pod`:
    this pod's id (or host name) unless given."""
    if run_dir is not None:
        claim(settings, run_dir)
    return Reporter(who, pod or settings.pod_name, run_dir,
                    secrets=secret_values(settings), stream=stream,
                    log_format=settings.log_format, quiet=settings.quiet)


CLAIM_FILE = "pod.lock"
_claims: dict[Path, IO[str]] = {}  # held open for the life of this process


def claim(settings: config.Settings, run_dir: Path) -> None:
    """This pod's run directory is this podagent's alone while it runs (an exclusive lock,
    which its end releases, however it ends): two pods whose directories coincide (the same
    host name without a RUNPOD_POD_ID each, on one volume) would write each other's ledger
    and data check. Where the volume has no locks, nothing is checked."""
    run_dir = run_dir.absolute()
    if run_dir in _claims:
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    held = open(run_dir / CLAIM_FILE, "a+")
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        held.seek(0)
        holder = held.read().strip()[:120] or "another process"
        held.close()
        raise ConfigError(
            settings.source_name("log_dir"), settings.log_dir,
            f"holds this pod's run directory {run_dir}, which another podagent holds "
            f"({holder}): pods that share a volume need a RUNPOD_POD_ID (or a "
            f"PODAGENT_LOG_DIR) each") from None
    except OSError:  # a volume without locks
        held.close()
        return
    held.seek(0)
    held.truncate()
    held.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    held.flush()
    _claims[run_dir] = held


def report_end(exc: Exception, settings: config.Settings, reporter: Reporter) -> int:
    """The code of a run an error ended (run/exits.py), said once: podagent's error as one
    line (none for a signal: whoever sent it knows), a bug as one line on screen and its
    traceback in the log."""
    from podagent.errors import Interrupted, PodagentError
    from podagent.run import exits

    code = exits.exit_code(exc)
    if isinstance(exc, PodagentError):
        if not isinstance(exc, Interrupted):
            reporter.error(str(exc))
        reporter.event(Event.EXIT, code=code, error=str(exc))
    else:
        reporter.error(f"internal error: {type(exc).__name__}: {exc} "
                       f"(traceback in {settings.run_dir})")
        reporter.event(Event.EXIT, code=code, error=traceback.format_exc())
    return code


def install_signals(reporter: Reporter) -> Signals:
    """podagent's handlers: a first SIGTERM/SIGINT is recorded for the loops to act on; a
    second kills every child and leaves at once."""
    signals = Signals()

    def force(signum: int) -> None:
        # A second signal: no more patience. Kill everything we started and leave. This runs
        # in the main thread, which may be anywhere (holding the reporter's lock in a stalled
        # write): so the children go first, and the last line takes no lock and cannot block.
        # Further signals are ignored from here: a handler run again inside this one (while it
        # waits for the log) would start over, and never reach the exit.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        for proc in process.descendants():
            with contextlib.suppress(psutil.Error):
                proc.kill()
        reporter.emergency(f"second {signal.Signals(signum).name}: killed all children")
        os._exit(128 + signum)

    signals.install(on_second=force)
    return signals


def settle(settings: config.Settings, reporter: Reporter, signals: Signals, end: after_run.End,
           started: float, policy: AfterRun | None = None,
           over_word: tuple[str, list[str]] | None = None) -> None:
    """This start of podagent is over: leave it to RunPod to start the pod again, or (the run
    over, or an end a new start cannot mend) stop the pod, stay or exit as PODAGENT_AFTER_RUN
    says (a worker: as its head said). A head first says on its supervisor port that the run
    is over, for workers that did not leave with it, and waits a while for them to ask.
    A signal (RunPod stopping the pod) ends it at once."""
    if signals.received:
        return
    policy = policy or settings.after_run
    summary = (f"run {settings.run_name} is over (exit {end.code}); logs in {settings.run_dir}"
               if end.over else f"exit {end.code}; logs in {settings.run_dir}")
    pod = after_run.Pod(settings.pod_id, settings.runpod_api_key, settings.runpod_api_url)
    if not settings.pod_id:  # not on RunPod: nothing starts podagent again
        if end.over:
            after_run.settle(policy, pod, reporter, signals, summary, "the run is over")
        return
    kept = after_run.persistent(settings.log_dir, settings.sources.get("log_dir") != "default")
    why = after_run.ended(end, started, settings.run_dir, reporter.pod, kept)
    if why is None:
        reporter.say(f"exit {end.code}: RunPod starts this pod's container again, and podagent "
                     f"with it ({after_run.CRASH_LOOP} such quick ends in a row stop the pod)")
        return
    if over_word is not None:  # `podagent up` reads the head's: the run's code, for good
        reporter.event(Event.RUN_OVER, code=end.code, over=end.over, why=why, policy=policy.value)
    if over_word is not None and end.over and policy is not AfterRun.EXIT:
        _say_over(settings, reporter, signals, end, policy, *over_word)
    if over_word is not None and end.over:  # an `up` run's head may terminate the whole run
        pod = dataclasses.replace(
            pod, account_key=runpod_key(settings.environ, from_file=False,
                                        names=(RUNPOD_ACCOUNT_KEY,)),
            up_run=settings.environ.get(UP_RUN_LABEL, "").strip() or None)
    after_run.settle(policy, pod, reporter, signals, summary, why)


def _say_over(settings: config.Settings, reporter: Reporter, signals: Signals,
              end: after_run.End, policy: AfterRun, addr: str, stragglers: list[str]) -> None:
    """Answer "over" on the supervisor port until this process ends; before the pod stops,
    wait for the workers that did not leave with the head to ask (PODAGENT_OVER_LINGER at
    most)."""
    from podagent.run import beacon

    word = beacon.Over(settings.run_name, SUCCEEDED if end.code == 0 else "ended",
                       end.code, policy.value)
    told = beacon.Beacon(word, addr, settings.supervisor_port, settings.auth_token).start()
    if told is None:
        reporter.warn(f"cannot say on {addr}:{settings.supervisor_port} that the run is over "
                      f"(the port is taken): workers that come back will not hear it")
        return
    waiting = set(stragglers)
    # Staying, the head answers for as long as it stays: only a pod about to stop waits.
    if not waiting or settings.over_linger <= 0 or policy is not AfterRun.STOP_POD:
        return
    reporter.say(f"waiting up to {settings.over_linger:g} s for worker(s) "
                 f"{', '.join(sorted(waiting))}, which did not leave with the head, to hear "
                 f"that the run is over")
    try:
        retry(lambda: waiting - told.heard_from(), awaited="the workers to ask",
              backoff=Backoff.every(0.5), deadline=settings.over_linger, sleep=signals.sleep,
              until=lambda left: not left)
        reporter.say("every worker that was away has heard that the run is over")
    except Expired as exc:
        reporter.say(f"worker(s) {', '.join(sorted(exc.last or waiting))} did not come back "
                     f"within {settings.over_linger:g} s")
    except Interrupted:
        return
