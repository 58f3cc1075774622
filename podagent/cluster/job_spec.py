"""What the head submits: the job's entrypoint (with a resume flag when a checkpoint is there)
and the environment it gets from podagent; one submission of it (JobAttempt), stopped when
the run ends or restarts."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from podagent import process
from podagent.choices import JOB_TERMINAL
from podagent.cluster.jobs import JobRunner
from podagent.config import Settings
from podagent.config.fields import FIELD_BY_ATTR
from podagent.config.policy import is_secret
from podagent.report import Reporter
from podagent.run import hangs
from podagent.run import resume as resuming
from podagent.run.progress import HEARTBEAT_FILE, HEARTBEAT_VARIABLE
from podagent.run.stacks import STACKS_VARIABLE
from podagent.waiting import Deadline
from podagent.wire import Event

CLUSTER_CHECK = (sys.executable, "-m", "podagent.checks.clustercheck")
RAY_STOP_WAIT = "RAY_JOB_STOP_WAIT_TIME_S"


def entrypoint(settings: Settings, reporter: Reporter, resume: bool = True) -> tuple[str, ...]:
    """The job's argv: the user's, or the built-in cluster check. With `resume`, a checkpoint
    of the run adds the trainer's resume flag where the trainer gets it (and says so)."""
    if not settings.job:
        return CLUSTER_CHECK
    if not resume:
        return settings.job
    return resuming.starting(settings, settings.job, reporter).command


def env(settings: Settings, head_ip: str, nodes: int, gpus: int, reward_url: str | None,
        ray_debug: bool, submission_id: str, attempt: int) -> dict[str, str]:
    # No NCCL variables here: Ray would impose the head's on every node, while each pod's Ray
    # node already carries its own pod's (its interface may be named differently).
    variables = {
        "PODAGENT_NUM_NODES": str(nodes),
        "PODAGENT_NUM_GPUS": str(gpus),
        FIELD_BY_ATTR["head_addr"].env: head_ip,  # as a worker's own setting names it
        "PODAGENT_RUN_NAME": settings.run_name,
        "PODAGENT_SUBMISSION_ID": submission_id,
        # 1 for the first job of the run, then one more for each submission after a restart.
        "PODAGENT_ATTEMPT": str(attempt),
        # The hang watch's heartbeat file and where a job's faulthandler writes its stacks
        # (podagent.job): on the head, where the driver runs; absolute, as the job's working
        # directory is its own.
        HEARTBEAT_VARIABLE: os.path.abspath(settings.run_dir / HEARTBEAT_FILE),
        STACKS_VARIABLE: os.path.abspath(hangs.stacks_dir(settings.run_dir)),
    }
    # Ray's job supervisor sends the job SIGTERM on a stop and SIGKILL after this (Ray's own
    # default is 3 s): the job gets PODAGENT_STOP_TIMEOUT to checkpoint, as every child does.
    # Ray reads a whole number; a user's own value stands.
    variables[RAY_STOP_WAIT] = settings.environ.get(RAY_STOP_WAIT) or str(
        max(1, math.ceil(settings.stop_timeout)))
    if reward_url:
        variables["REMOTE_RM_URL"] = reward_url
    if ray_debug:
        variables["RAY_DEBUG"] = "legacy"
    # W&B settings travel with the job; the key itself does not go through the Jobs API
    # (anyone who can read the dashboard could read it): the job inherits it from the
    # environment of the Ray processes podagent started.
    variables.update({k: v for k, v in settings.environ.items()
                      if k.startswith("WANDB_") and not is_secret(k)})
    return variables


def set_aside_job_log(run_dir: Path) -> None:
    """Following a job again streams its log from the start: the earlier podagent's copy
    (a prefix of it) is kept beside, so job.log holds the job's output exactly once."""
    job_log = run_dir / "job.log"
    if job_log.exists() and job_log.stat().st_size:
        job_log.replace(run_dir / "job-before-reattach.log")


@dataclass
class JobAttempt:
    """One submission of the job, from SUBMITTING until it ends (or a restart drops it)."""
    runner: JobRunner
    status: str | None = None  # Ray's status once it ended or was stopped
    stopped_by_us: bool = False  # stopped for a restart, not ended by itself
    ended_at: float | None = None  # wall clock

    @property
    def submission_id(self) -> str:
        return self.runner.submission_id

    def stop(self, timeout: float | Deadline, reporter: Reporter,
             own: Collection[int] = ()) -> None:
        """Ask Ray to stop it and wait (bounded); `own`: the pids of podagent's own children
        that are no part of the job (the reward server's)."""
        # Ray kills the job's shell and its children at once; a child that outlives its shell
        # by a moment is re-parented to podagent (a subreaper), and Ray, which waits until
        # every one of them is gone, counts it alive while it is an unreaped zombie: STOPPED
        # would come only after Ray's 3 s SIGKILL deadline. So reap them while waiting.
        status = self.runner.stop(timeout, while_waiting=lambda: process.reap_zombies(own))
        name = self.submission_id
        if status is None:
            reporter.warn(f"asked Ray to stop job {name}; the dashboard did not confirm it "
                          f"(Ray is stopped next either way)")
        elif status not in JOB_TERMINAL:  # still going at the deadline: stopping Ray ends it
            reporter.warn(f"asked Ray to stop job {name}; still {status} at the deadline (Ray "
                          f"is stopped next, which ends it)")
        else:
            reporter.say(f"job {name} stopped (status {status})")
            self.status = status  # the workers' closing announcement carries it
        reporter.event(Event.JOB_STOPPED, status=status)
