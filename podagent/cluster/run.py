"""The Ray engine's adapter of a start (run/start.py): the head's or the worker's lifecycle,
with W&B's bring-up record; its checks; or a dry run of it, which touches nothing.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

from podagent import config, extras, trainers
from podagent.config.policy import REDACTED_VALUE, TOKEN_PATH_VARIABLE, is_secret
from podagent.platform.head_location import head_location
from podagent.platform.roles import Role, RoleDecision, detect_role
from podagent.ray_access import ray_compat
from podagent.report import Reporter
from podagent.run import pod_setup
from podagent.run import start as run_start
from podagent.run.shell import reporter_for

if TYPE_CHECKING:  # the lifecycles load only when a role runs
    from podagent.run.lifecycle import Lifecycle


class RayRole:
    """The head or a worker of a Ray cluster, as a start runs it."""

    def __init__(self, settings: config.Settings, explicit: Role | None = None):
        self.settings = settings
        self.decision: RoleDecision = detect_role(settings, explicit)
        self.ray = ray_compat.require()

    @property
    def keeps_ledger(self) -> bool:
        return self.decision.role is Role.HEAD  # the run's ledger is the head's

    def check(self) -> None:
        ray_compat.check(self.settings, self.ray)
        _require_parts(self.settings, self.decision.role)

    def dry_run(self) -> None:
        _dry_run(self.settings, self.decision, self.ray)

    def greeting(self) -> tuple[str, dict[str, Any]]:
        return f"({self.ray})", {"ray": self.ray.version}

    def begin(self, reporter: Reporter) -> None:
        _say_untested(reporter, self.ray)
        _decide_ray_auth(self.settings, reporter)

    def run(self, start: run_start.Start, ending: run_start.Ending) -> None:
        from podagent.cluster.head import Head
        from podagent.cluster.worker import Worker
        from podagent.report import wandb_run

        bringup = wandb_run.attach(start.reporter, self.settings, self.decision.role)
        if bringup:
            ending.finish.append(bringup.finish)
        lifecycle: Lifecycle = (Head(self.settings, self.decision, start.reporter,
                                     start.signals, start.ledger)
                                if self.decision.role is Role.HEAD else
                                Worker(self.settings, self.decision, start.reporter,
                                       start.signals))
        try:
            lifecycle.run()
        finally:
            ending.after_run = lifecycle.after_run()
            ending.over_word = lifecycle.over_word()


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
    pod_setup.say_gpu_check(settings, reporter)
    # A worker learns the head's address only by looking it up, which a dry run does not do.
    plan = ray_node.plan(settings, decision.role, setup.node_ip, setup.gpus,
                         setup.nccl.variables, head_ip="HEAD")
    reporter.say(f"would run: {shlex.join(plan.argv)}")
    for key in sorted(plan.env_overrides):
        value = REDACTED_VALUE if is_secret(key) else plan.env_overrides[key]
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
                     f"; to use that token, set {TOKEN_PATH_VARIABLE} to it on every pod")
