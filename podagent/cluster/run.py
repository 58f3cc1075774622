"""Running this pod's role on the Ray engine: the head's or the worker's lifecycle in the run
kernel's shell (run/shell.py), with W&B's bring-up record; or a dry run of it, which touches
nothing.

Exit codes are chosen only by the command line, which hands its mapping in (`exit_code` for an
error, `outcome_code` for a finished run's recorded outcome); 0 is success.
"""

from __future__ import annotations

import os
import shlex
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from podagent import __version__, config, extras, process, trainers
from podagent.platform.head_location import head_location
from podagent.platform.roles import Role, RoleDecision, detect_role
from podagent.ray_access import ray_compat
from podagent.report import Reporter
from podagent.run import after_run
from podagent.run.shell import SUCCESS, install_signals, report_end, reporter_for, settle
from podagent.wire import Event

if TYPE_CHECKING:  # the lifecycles load only when a role runs
    from podagent.run.lifecycle import Lifecycle


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
    from podagent.cluster import node, ray_node, worker

    reporter = reporter_for(settings, decision.role.value, pod="dry-run")
    reporter.say(f"dry run: this pod would be the {decision.role.value} ({decision.reason}) "
                 f"with {ray}; run {settings.run_name}, logs in {settings.run_dir}")
    _say_untested(reporter, ray)
    if decision.role is Role.WORKER:
        where = head_location(settings)  # a worker has one: detect_role made sure
        reporter.say(f"would find the head at {where.target if where else None} within "
                     f"{settings.head_timeout:g} s, then join it (grace "
                     f"{settings.head_grace:g} s once joined, "
                     f"{max(settings.head_grace, worker.BUSY_HEAD_GRACE):g} s for a busy head)")
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
        if settings.profile:
            _say_profile(settings, settings.profile, setup.node_ip, reporter)


def _say_profile(settings: config.Settings, profile: trainers.Profile, node_ip: str,
                 reporter: Reporter) -> None:
    """The job's trainer and what podagent derived from its command line."""
    def origin(attr: str) -> str:
        source = settings.sources.get(attr, "default")
        return settings.source_name(attr) if source in ("flag", "env") else source

    reporter.say(f"the job: {profile.describe()}")
    where = (f"{settings.checkpoint_dir} ({origin('checkpoint_dir')})"
             if settings.checkpoint_dir else "no checkpoint directory (PODAGENT_CHECKPOINT_DIR)")
    if settings.resume_flag:
        reporter.say(f"after a lost pod: resubmitted with {shlex.join(settings.resume_flag)} "
                     f"({origin('resume_flag')}) when {where} holds a checkpoint")
        try:
            resumed = trainers.with_args(settings.job or (), settings.resume_flag,
                                         profile.trainer)
            reporter.say(f"  resumed, the job runs as: {shlex.join(resumed)}")
        except ValueError as exc:
            reporter.warn(f"the resume flag has no place in the job ({exc}): a resumed job "
                          f"would start without it")
    else:
        reporter.say(f"after a lost pod: resubmitted as it is "
                     f"({profile.trainer.resumes_itself or origin('resume_flag')}); "
                     f"checkpoints watched in {where}")
    served = settings.reward != "none"
    url = f"http://{node_ip}:{settings.reward_port}/get_reward"
    unasked = profile.reward_warning(served, url)
    if unasked:
        reporter.warn(unasked)


def _decide_ray_auth(settings: config.Settings, reporter: Reporter) -> None:
    """podagent's own Ray clients (the Jobs API's) take the run's auth mode, as its nodes do
    (ray_node.auth_env); a token file Ray would find by itself is said, and not used."""
    from podagent.cluster import ray_node

    mode = ray_node.auth_env(settings).get(ray_node.AUTH_MODE)
    if mode:
        os.environ[ray_node.AUTH_MODE] = mode
    stray = Path.home() / ".ray" / "auth_token"
    if mode == "disabled" and stray.is_file():
        reporter.say(f"a Ray token file is on this pod ({stray}) but the run has no cluster "
                     f"token: Ray's auth stays off on every node ({ray_node.AUTH_MODE}=disabled)"
                     f"; to use that token, set {config.TOKEN_PATH_VARIABLE} to it on every pod")


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
    _decide_ray_auth(settings, reporter)
    reporter.event(Event.ROLE, role=decision.role.value, reason=decision.reason,
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
        reporter.event(Event.EXIT, code=code)
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


