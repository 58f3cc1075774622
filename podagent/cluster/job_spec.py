"""What the head submits: the job's entrypoint (with a resume flag when a checkpoint is there)
and the environment it gets from podagent."""

from __future__ import annotations

import sys

from podagent.cluster import checkpoint
from podagent.config import FIELD_BY_ATTR, Settings, is_secret
from podagent.report import Reporter

CLUSTER_CHECK = (sys.executable, "-m", "podagent.checks.clustercheck")


def entrypoint(settings: Settings, reporter: Reporter, resume: bool = True) -> tuple[str, ...]:
    """The job's argv: the user's, or the built-in cluster check. With `resume`, a checkpoint
    of the run adds the trainer's resume flag (and says so)."""
    if not settings.job:
        return CLUSTER_CHECK
    if not resume:
        return settings.job
    found = checkpoint.resume_args(settings)
    if found.args:
        reporter.say(found.reason)
        reporter.event("resume", checkpoint_dir=settings.checkpoint_dir, args=list(found.args))
    elif found.reason:
        reporter.say(found.reason)
    return (*settings.job, *found.args)


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
    }
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
