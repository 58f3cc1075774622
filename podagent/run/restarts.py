"""The restart policy, one for both engines: whether a run that ended is started again, how
often (PODAGENT_RESTARTS, counted across container restarts by the ledger), and how long it
backs off first (PODAGENT_RESTART_BACKOFF, doubled each time). The engines only carry it out:
the Ray head resubmits the job (cluster/recovery.py); a run without Ray exits and its pods'
containers start it again (gang/run.py)."""

from __future__ import annotations

from podagent.choices import OnNodeLoss
from podagent.config import Settings
from podagent.errors import RestartsExhausted

RESTART_BACKOFF_MAX = 300.0


def restart_reason(settings: Settings, job_status: str | None, lost: list[str]) -> str | None:
    """Why the job that just ended is run again, or None: it succeeded, was stopped by someone
    else, or failed by itself (unless PODAGENT_RETRY_FAILED_JOB=1); with
    PODAGENT_ON_NODE_LOSS=fail a lost node changes nothing."""
    if job_status == "SUCCEEDED":
        return None
    if lost and settings.on_node_loss != OnNodeLoss.FAIL:
        return f"lost {', '.join(lost)}"
    if not lost and settings.retry_failed_job and job_status == "FAILED":
        return "the job failed (PODAGENT_RETRY_FAILED_JOB=1)"
    return None


def admit(settings: Settings, done: int, why: str) -> int:
    """The number of the restart `why` asks for, `done` having been made already; raises
    RestartsExhausted once PODAGENT_RESTARTS are used up (logs and checkpoints are kept)."""
    if done >= settings.restarts:
        raise RestartsExhausted(
            f"{why}; the run was already restarted {done} time(s) "
            f"(PODAGENT_RESTARTS={settings.restarts}): giving up; logs in "
            f"{settings.run_dir}" + (f", checkpoints kept in {settings.checkpoint_dir}"
                                     if settings.checkpoint_dir else ""))
    return done + 1


def backoff(settings: Settings, number: int) -> float:
    """Seconds before restart `number` starts the work again."""
    return min(RESTART_BACKOFF_MAX, settings.restart_backoff * 2 ** (number - 1))
