"""Restarts of the job after a lost node (PODAGENT_ON_NODE_LOSS) or a failed job
(PODAGENT_RETRY_FAILED_JOB) on the Ray path: the kernel's policy (run/policy.py) carried
out, kept apart from the head's states as torch's elastic agent keeps its restart loop apart
from starting and watching its workers.

The head tells `Recovery` what it sees (losses while the job runs, the job's end) and asks it
whether the job runs again. A restart is counted against PODAGENT_RESTARTS across container
restarts (the ledger keeps them), said loudly and recorded; once the cluster is whole again
(the census pairs each join with a lost worker) the restart backs off, and its figures are
recorded when the job is submitted again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from podagent.choices import OnNodeLoss
from podagent.cluster.census import WorkerCensus
from podagent.cluster.job_spec import JobAttempt
from podagent.config import Settings
from podagent.ray_access.gcs import NodeInfo
from podagent.report import Reporter
from podagent.run import policy, restarts
from podagent.run.ledger import Ledger, record_or_warn
from podagent.waiting import Signals
from podagent.wire import Ending, Event

# What follows a worker lost while the job runs, by PODAGENT_ON_NODE_LOSS.
AFTER_LOSS = {OnNodeLoss.RESTART: "stopping the job to restart it",
              OnNodeLoss.WAIT: "the job decides whether it goes on (restarted if it fails)",
              OnNodeLoss.FAIL: "the job decides whether it goes on"}


class NodeLost(Exception):
    """While the job runs (PODAGENT_ON_NODE_LOSS=restart): a worker was lost; the head stops
    the job at once instead of waiting for NCCL's timeout."""


@dataclass(frozen=True)
class Restart:
    """The restart under way (the kernel's count and backoff), and the times its figures are
    measured from."""
    counted: restarts.Restart
    noticed: float  # wall clock: the run stopped making progress (a loss seen or the job ended)
    stopped: float  # wall clock: the restart began

    @property
    def n(self) -> int:
        return self.counted.n


class Recovery:
    """Carries out the restart policy for the head: what a loss means while the job runs,
    whether the job runs again, and the restart's count, backoff and figures."""

    def __init__(self, settings: Settings, ledger: Ledger, census: WorkerCensus,
                 reporter: Reporter, signals: Signals):
        self.settings, self.ledger, self.census = settings, ledger, census
        self.reporter, self.signals = reporter, signals
        self.under_way: Restart | None = None

    # --- while the job runs and when it ends ----------------------------------------------------

    def note_alive(self, alive: set[str]) -> None:
        """The workers alive now (one look at the node table while the job runs): a loss is
        reported once, and with PODAGENT_ON_NODE_LOSS=restart ends the job's follow."""
        policy = self.settings.on_node_loss
        if self.census.note_losses(alive, AFTER_LOSS[policy]) and policy is OnNodeLoss.RESTART:
            raise NodeLost()

    def losses(self, job_status: str | None) -> list[NodeInfo]:
        """The workers lost while the job ran. A job that failed with no loss seen yet: a
        killed pod breaks the collectives before Ray's health checks notice, so the workers'
        raylets are asked directly."""
        lost = self.census.lost_now()
        if (job_status != "SUCCEEDED" and not lost
                and self.settings.on_node_loss != OnNodeLoss.FAIL):
            lost = self.census.unreachable()
            self.census.mark_lost(lost, "its raylet does not answer", "the job failed meanwhile")
        return lost

    def restart_reason(self, job_status: str | None, lost: list[NodeInfo],
                       hung: str = "") -> str | None:
        return policy.restart_reason(self.settings,
                                     policy.Cause.of_job(job_status, [w.ip for w in lost], hung))

    # --- a restart ----------------------------------------------------------------------------

    def begin(self, why: str, lost: list[NodeInfo], job: JobAttempt,
              kind: Ending = Ending.LOST) -> Restart:
        """Counts the restart against PODAGENT_RESTARTS (across container restarts: the ledger
        keeps them), says it loudly and records it. Restarts used up raise (RunHung after a
        hang, else RestartsExhausted)."""
        now = time.time()
        # The run stopped making progress when the job ended or the loss was seen, if earlier.
        noticed = min(t for t in (self.census.first_noticed(), job.ended_at, now)
                      if t is not None)
        ended = "stopped" if job.stopped_by_us else f"ended {job.status or 'LOST'}"
        submission = job.submission_id
        counted = restarts.begin(
            self.settings, self.ledger, self.reporter, why,
            f"job {submission} {ended}; waiting for {self.settings.expected_workers} worker(s) "
            f"(a replacement pod counts), then the job is submitted again, resuming from the "
            f"newest checkpoint", kind, lost=[w.ip for w in lost], job=submission,
            job_status=job.status)
        self.census.begin_recovery()
        self.under_way = Restart(counted, noticed, now)
        return self.under_way

    def before_resubmitting(self) -> None:
        """The cluster is whole again (and Ray no longer lists the lost nodes: the census's
        gather waited for that): wait for what is left of the backoff."""
        if self.under_way:
            restarts.back_off(self.under_way.counted, self.reporter, self.signals)

    def resubmitted(self, submission_id: str) -> None:
        """The job of the restart under way was submitted: its figures, said and recorded."""
        restart = self.under_way
        if restart is None:
            return
        now = time.time()
        # Seconds without a running job: the job's own start-up and the steps it redoes from
        # its checkpoint come on top (podagent cannot see those; bench/recovery.py measures).
        figures = {"time_lost_s": round(now - restart.noticed, 3),
                   "waited_s": round(now - restart.stopped, 3),
                   "replaced": [list(pair) for pair in self.census.replaced]}
        record_or_warn(lambda: self.ledger.resubmitted(submission_id, **figures),
                       self.reporter)
        self.reporter.say(f"restart {restart.n}: job {submission_id} submitted "
                          f"{figures['time_lost_s']:.1f} s after the run stopped (the job's "
                          f"own start and the steps since its checkpoint come on top)")
        self.reporter.event(Event.RESTARTED, n=restart.n, submission_id=submission_id, **figures)
        self.under_way = None
