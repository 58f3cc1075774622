"""Running this pod's role: the head's or the worker's lifecycle under podagent's signal
handling, with its report, W&B's bring-up record and what the pod does once the run is over;
or a dry run of it, which touches nothing.

Exit codes are chosen only by the command line, which hands its mapping in (`exit_code` for an
error, `outcome_code` for a finished run's recorded outcome); 0 is success.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import signal
import socket
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import psutil

from podagent import __version__, config, extras, process
from podagent.choices import AfterRun
from podagent.cluster import after_run
from podagent.errors import Interrupted
from podagent.platform.head_location import head_location
from podagent.platform.roles import Role, RoleDecision, detect_role
from podagent.ray_access import ray_compat
from podagent.report import Reporter
from podagent.waiting import Backoff, Expired, Signals, retry

if TYPE_CHECKING:  # the lifecycles load only when a role runs
    from podagent.cluster.lifecycle import Lifecycle

SUCCESS = 0


def secret_values(settings: config.Settings) -> list[str]:
    """What the output must never show: secret variables' values, and the cluster token, which
    may come from a file (RAY_AUTH_TOKEN_PATH) rather than the environment."""
    values = [v for k, v in settings.environ.items() if config.is_secret(k) and v]
    return [*values, settings.auth_token] if settings.auth_token else values


def reporter_for(settings: config.Settings, who: str, pod: str | None = None,
                 run_dir: Path | None = None, stream: TextIO | None = None) -> Reporter:
    """A reporter that hides the secrets and speaks as the settings say; on screen only unless
    given the run's directory. `pod`: this pod's id (or host name) unless given."""
    return Reporter(who, pod or settings.pod_id or socket.gethostname(), run_dir,
                    secrets=secret_values(settings), stream=stream,
                    log_format=settings.log_format, quiet=settings.quiet)


def report_end(exc: Exception, settings: config.Settings, reporter: Reporter,
               exit_code: Callable[[BaseException], int]) -> int:
    """The code of a run an error ended, said once: podagent's error as one line (none for a
    signal: whoever sent it knows), a bug as one line on screen and its traceback in the log."""
    from podagent.errors import Interrupted, PodagentError

    code = exit_code(exc)
    if isinstance(exc, PodagentError):
        if not isinstance(exc, Interrupted):
            reporter.error(str(exc))
        reporter.event("exit", code=code, error=str(exc))
    else:
        reporter.error(f"internal error: {type(exc).__name__}: {exc} "
                       f"(traceback in {settings.run_dir})")
        reporter.event("exit", code=code, error=traceback.format_exc())
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


def run_role(settings: config.Settings, explicit: Role | None, *, dry_run: bool,
             exit_code: Callable[[BaseException], int],
             outcome_code: Callable[[str], int],
             restartable: Callable[[int], bool] = lambda code: False) -> int:
    """Work out the role, check what it needs, and run it (or say what it would do); the exit
    code. Bad input raises before anything starts."""
    _warn_early(settings)
    decision = detect_role(settings, explicit)
    ray = ray_compat.require()
    ray_compat.check(settings, ray)
    _require_parts(settings, decision.role)
    if dry_run:
        _dry_run(settings, decision, ray)
        return SUCCESS
    return _run(settings, decision, ray, exit_code, outcome_code, restartable)


def _warn_early(settings: config.Settings) -> None:
    """What a run and a dry run say first, before anything can fail: a misspelt variable may
    be why a part is missing or a role is unclear."""
    if not settings.warnings:
        return
    early = reporter_for(settings, "podagent")
    for warning in settings.warnings:  # e.g. a PODAGENT_* variable with a typo in its name
        early.warn(warning)


def _say_untested(reporter: Reporter, ray: ray_compat.RayVersion) -> None:
    note = ray_compat.untested_note(ray)
    if note:
        reporter.warn(note)


def _require_parts(settings: config.Settings, role: Role) -> None:
    """The optional parts this run will need, checked before anything starts (exit 2)."""
    if role is not Role.HEAD:
        return
    if settings.reward == "builtin":
        default = " (the default)" if settings.sources.get("reward") == "default" else ""
        extras.require("reward", f"{settings.source_name('reward')}=builtin{default}",
                       instead="set PODAGENT_REWARD=none to run without it")
    if not settings.job:
        extras.require_torch("the built-in cluster check (the default job)",
                             "give your own job (PODAGENT_JOB or `podagent head -- CMD`)")


def _dry_run(settings: config.Settings, decision: RoleDecision,
             ray: ray_compat.RayVersion) -> None:
    """What podagent would do on this pod, touching nothing: no Ray, no files, no network."""
    from podagent.cluster import node, ray_node

    reporter = reporter_for(settings, decision.role.value, pod="dry-run")
    reporter.say(f"dry run: this pod would be the {decision.role.value} ({decision.reason}) "
                 f"with {ray}; run {settings.run_name}, logs in {settings.run_dir}")
    _say_untested(reporter, ray)
    if decision.role is Role.WORKER:
        where = head_location(settings)  # a worker has one: detect_role made sure
        reporter.say(f"would find the head at {where.target if where else None} within "
                     f"{settings.head_timeout:g} s, then join it (grace "
                     f"{settings.head_grace:g} s once joined)")
    setup = node.prepare(settings, decision.role, reporter)  # e.g. a head with only a public IP
    # A worker learns the head's address only by looking it up, which a dry run does not do.
    plan = ray_node.plan(settings, decision.role, setup.node_ip, setup.gpus,
                         setup.nccl.variables, head_ip="HEAD")
    reporter.say(f"would run: {shlex.join(plan.argv)}")
    for key in sorted(plan.env_overrides):
        value = config.REDACTED_VALUE if config.is_secret(key) else plan.env_overrides[key]
        reporter.say(f"  with {key}={value}")
    if decision.role is Role.HEAD:
        job = shlex.join(settings.job) if settings.job else "the built-in cluster check"
        reward = settings.reward if settings.reward != "cmd" else shlex.join(
            settings.reward_cmd or ())
        reporter.say(f"would wait for {settings.expected_workers} worker(s) "
                     f"(timeout {settings.worker_timeout:g} s), start reward server: {reward}, "
                     f"then run the job: {job}")


def _run(settings: config.Settings, decision: RoleDecision, ray: ray_compat.RayVersion,
         exit_code: Callable[[BaseException], int], outcome_code: Callable[[str], int],
         restartable: Callable[[int], bool]) -> int:
    from podagent.cluster.head import Head
    from podagent.cluster.worker import Worker

    # podagent alone talks to RunPod's API: no child (Ray, the job, the reward server, W&B's
    # service) inherits the key. The settings keep their own copy of the environment.
    os.environ.pop(config.RUNPOD_API_KEY, None)
    reporter = reporter_for(settings, decision.role.value, run_dir=settings.run_dir)
    for warning in settings.warnings:  # on screen already: the pod's log file keeps them too
        reporter.log_only(f"WARNING: {warning}")
    reporter.say(f"podagent {__version__} ({ray}): this pod is the {decision.role.value} "
                 f"({decision.reason}); run {settings.run_name}")
    _say_untested(reporter, ray)
    reporter.event("role", role=decision.role.value, reason=decision.reason,
                   run=settings.run_name, version=__version__, ray=ray.version)
    from podagent.report import wandb_run

    bringup = wandb_run.attach(reporter, settings, decision.role)

    signals = install_signals(reporter)
    process.become_subreaper()
    started = time.monotonic()
    lifecycle: Lifecycle | None = None
    code = SUCCESS
    try:
        lifecycle = (Head if decision.role is Role.HEAD else Worker)(
            settings, decision, reporter, signals)
        lifecycle.run()
        # A head that found its run finished earlier exits as that run did.
        earlier = lifecycle.earlier_outcome()
        code = outcome_code(earlier) if earlier else SUCCESS
    except Exception as exc:
        code = report_end(exc, settings, reporter, exit_code)
    else:
        reporter.event("exit", code=code)
    finally:
        if bringup:
            bringup.finish(code)
    if lifecycle is not None:
        lifecycle.record_exit(code)
        policy = lifecycle.after_run()
        end = after_run.End(code, over=policy is not None, restartable=restartable(code))
        settle(settings, reporter, signals, end, started, policy, lifecycle.over_word())
    reporter.close()
    return code


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
    policy = policy or AfterRun(settings.after_run)
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
        reporter.event("run_over", code=end.code, over=end.over, why=why, policy=policy.value)
    if over_word is not None and end.over and policy is not AfterRun.EXIT:
        _say_over(settings, reporter, signals, end, policy, *over_word)
    if over_word is not None and end.over:  # an `up` run's head may terminate the whole run
        pod = dataclasses.replace(
            pod, account_key=config.runpod_key(settings.environ, from_file=False,
                                               names=(config.RUNPOD_ACCOUNT_KEY,)),
            up_run=settings.environ.get(config.UP_RUN_LABEL, "").strip() or None)
    after_run.settle(policy, pod, reporter, signals, summary, why)


def _say_over(settings: config.Settings, reporter: Reporter, signals: Signals,
              end: after_run.End, policy: AfterRun, addr: str, stragglers: list[str]) -> None:
    """Answer "over" on the supervisor port until this process ends; before the pod stops,
    wait for the workers that did not leave with the head to ask (PODAGENT_OVER_LINGER at
    most)."""
    from podagent.cluster import beacon

    word = beacon.Over(settings.run_name, "succeeded" if end.code == 0 else "ended",
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
