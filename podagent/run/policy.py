"""The run's policy, one for both engines: which of several things that went wrong ends a run
(`Cause`, `stronger`), whether the run is started again (`restart_reason`), how often
(PODAGENT_RESTARTS, counted across container restarts by the ledger: `admit`) and after how
long (PODAGENT_RESTART_BACKOFF, doubled each time: `backoff`).

The engines only carry it out, as torch's elastic agent keeps its restart policy apart from
starting and watching its workers: the Ray head turns its job's end into a `Cause`
(`Cause.of_job`) and resubmits the job (cluster/recovery.py); a run without Ray gathers its
causes from every pod, exits with the winner's code, and its pods' containers start it again
(gang/run.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from podagent.choices import OnNodeLoss
from podagent.config import Settings
from podagent.errors import (
    DataOverlap,
    DeadlineReached,
    JobFailed,
    JobStopped,
    PeerLost,
    PodagentError,
    RestartsExhausted,
    RunHung,
)
from podagent.wire import Ending

RESTART_BACKOFF_MAX = 300.0

# Which cause ends the run when several show: a pod gone explains the hang and the failures
# after it; a hang explains the failures of the ranks podagent stopped for it. The deadline is
# the user's cap on what the run costs: past it nothing is started again, whatever else showed.
STRENGTH = {Ending.DEADLINE: 5, Ending.LOST: 4, Ending.HUNG: 3, Ending.FAILED: 2,
            Ending.OVERLAP: 1, Ending.STOPPED: 1, Ending.SUCCEEDED: 0}


@dataclass(frozen=True)
class Cause:
    """How a run ended, or one thing that would end it."""
    kind: Ending
    pod: str = ""  # the pod(s) it happened on, or who asked to stop
    detail: str = ""  # why it was lost; the data check's line; the job's status
    step: str = ""
    rc: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", Ending(self.kind))

    def to_wire(self) -> dict[str, Any]:
        return {**asdict(self), "kind": self.kind.value}

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> Cause:
        """A peer's cause; a kind this podagent does not know is a lost pod (the strongest:
        the run ends either way)."""
        try:
            kind = Ending(str(body.get("kind", Ending.LOST)))
        except ValueError:
            kind = Ending.LOST
        rc = body.get("rc")
        return cls(kind, str(body.get("pod", "")), str(body.get("detail", ""))[:2000],
                   str(body.get("step", "")), rc if isinstance(rc, int) else None)

    @classmethod
    def of_job(cls, status: str | None, lost: list[str], hung: str = "") -> Cause:
        """A Ray job's end: its status (None: asked to stop, not yet confirmed), the nodes
        lost while it ran and, when podagent stopped it for a hang, what was seen (`hung`).
        A job that succeeded did, whatever was lost meanwhile."""
        if status == "SUCCEEDED":
            return cls(Ending.SUCCEEDED)
        if lost:
            return cls(Ending.LOST, ", ".join(lost), detail=status or "")
        if hung:
            return cls(Ending.HUNG, detail=hung)
        if status == "FAILED":
            return cls(Ending.FAILED, detail=status)
        return cls(Ending.STOPPED, detail=status or "")

    def error(self, me: str, launcher: str, settings: Settings | None = None
              ) -> PodagentError | None:
        """What a pod of a run without Ray exits with (None: success). A lost pod is a
        restartable exit unless the policy starts nothing again (PODAGENT_ON_NODE_LOSS=fail:
        the run fails, as on the Ray path, where the training decides and a lost pod breaks
        it)."""
        if self.kind is Ending.SUCCEEDED:
            return None
        if self.kind is Ending.STOPPED:
            return JobStopped(f"the run was stopped by `podagent stop` from {self.pod}")
        if self.kind is Ending.OVERLAP:
            return DataOverlap(self.detail)
        if self.kind is Ending.HUNG:  # a hang restarted is never an end: this one is final
            return RunHung(self.detail)
        if self.kind is Ending.DEADLINE:
            return DeadlineReached(self.detail)
        if self.kind is Ending.FAILED and self.pod == me:
            return JobFailed(f"the {self.step} ({launcher}) exited {self.rc} on this pod; "
                             f"stopped it on every pod")
        if self.kind is Ending.FAILED:  # the run failed, on every pod alike: none starts it again
            return JobFailed(f"the {self.step} failed on pod {self.pod} ({launcher} exited "
                             f"{self.rc}); stopped this pod's training")
        lost = PeerLost(f"pod {self.pod} was lost: {self.detail}; stopped this pod's training",
                        self.pod)
        if settings is not None and restart_reason(settings, self) is None:
            return JobFailed(f"{lost}; PODAGENT_ON_NODE_LOSS=fail: the run is not started "
                             f"again")
        return lost


# Ends after which ranks wait on a pod that is gone, or hang: a rank inside a collective runs
# no SIGTERM handler, so the grace mostly waits for the KILL while every pod bills; the whole
# stop timeout is for the ends a trainer can act on (a stop asked for, a failure of its own).
BROKEN = frozenset({Ending.LOST, Ending.HUNG})


def hurried_stop(settings: Settings, cause: Cause | None, signalled: bool) -> bool:
    """Whether the training is given the short stop (TERM, KILL within 3 s): a signal came
    (the pod has seconds before SIGKILL), or the run is broken and PODAGENT_STOP_TIMEOUT is
    left at its default (one set by hand is for a trainer that saves on SIGTERM: it holds)."""
    if signalled:
        return True
    return (cause is not None and cause.kind in BROKEN
            and settings.sources.get("stop_timeout", "default") == "default")


def stronger(current: Cause | None, new: Cause) -> Cause:
    """The cause that ends the run of two (of two alike, the first: it happened first)."""
    if current is None or STRENGTH[new.kind] > STRENGTH[current.kind]:
        return new
    return current


def restart_reason(settings: Settings, cause: Cause) -> str | None:
    """Why a run that ended so is started again, or None: it succeeded, was stopped by someone
    else, or failed by itself (unless PODAGENT_RETRY_FAILED_JOB=1); with
    PODAGENT_ON_NODE_LOSS=fail a lost node changes nothing."""
    if cause.kind is Ending.LOST and settings.on_node_loss != OnNodeLoss.FAIL:
        return f"lost {cause.pod}"
    if cause.kind is Ending.HUNG:
        return (f"the run made no progress for {settings.hang_timeout:g} s "
                f"(PODAGENT_HANG_TIMEOUT)")
    if cause.kind is Ending.FAILED and settings.retry_failed_job:
        return "the job failed (PODAGENT_RETRY_FAILED_JOB=1)"
    return None


def admit(settings: Settings, done: int, why: str, kind: Ending = Ending.LOST) -> int:
    """The number of the restart `why` asks for, `done` having been made already; once
    PODAGENT_RESTARTS are used up raises RestartsExhausted, or RunHung for a hang (its own
    code): logs and checkpoints are kept."""
    if done >= settings.restarts:
        error = RunHung if kind is Ending.HUNG else RestartsExhausted
        raise error(
            f"{why}; the run was already restarted {done} time(s) "
            f"(PODAGENT_RESTARTS={settings.restarts}): giving up; logs in "
            f"{settings.run_dir}" + (f", checkpoints kept in {settings.checkpoint_dir}"
                                     if settings.checkpoint_dir else ""))
    return done + 1


def backoff(settings: Settings, number: int) -> float:
    """Seconds before restart `number` starts the work again."""
    return min(RESTART_BACKOFF_MAX, settings.restart_backoff * 2 ** (number - 1))
