"""The head's lifecycle as a named state machine driven by one loop.

Each state is a short handler; the work is done by collaborators with one job each: HeadRay
(this pod's Ray), WorkerCensus (who joined, who left), StopWatch (`podagent stop`), the
reattach check, JobRunner (the job) and RewardServer.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from typing import Any

from tenacity import Retrying, retry_if_result, stop_after_delay, wait_fixed

from podagent import process, runstate
from podagent.choices import JOB_TERMINAL, AfterRun
from podagent.cluster import exposure, job_spec, node, ray_node, reattach
from podagent.cluster import ledger as ledger_mod
from podagent.cluster.census import WorkerCensus
from podagent.cluster.head_ray import WATCH_INTERVAL, HeadRay
from podagent.cluster.jobs import SUBMIT_TIMEOUT, JobRunner
from podagent.cluster.ledger import Ledger
from podagent.cluster.lifecycle import Lifecycle
from podagent.cluster.reward_server import RewardServer
from podagent.cluster.stop_watch import StopWatch, WatchedSignals
from podagent.config import Settings
from podagent.errors import LedgerError, RayDied, RestartsExhausted
from podagent.platform import pod
from podagent.platform.roles import Role, RoleDecision
from podagent.ray_access.gcs import NodeInfo
from podagent.report import Progress, Reporter
from podagent.waiting import Deadline, Signals

NODE_POLL = 0.1  # the node table is one cheap RPC: poll often so joins show at once
HURRIED_STEP = 1.0  # a signal ends the run: the job and the reward server get this long each
# ... and the workers this long to read the closing announcement (once a second) and leave
# before this pod's Ray, which holds it, is stopped.
HURRIED_DEPARTURES = 1.5
RESTART_BACKOFF_MAX = 300.0
# Ray marks a dead node after ray_node.HEALTH_CHECK_ENV's checks fail (about 5 s); more than
# twice that means Ray's own checks are configured otherwise.
DEPARTED_TIMEOUT = 15.0


class HeadState(str, enum.Enum):
    """RECALLING -> PREPARING -> CLEANING -> STARTING_RAY -> STARTING_REWARD -> WAITING_WORKERS
    -> WAITING_REWARD -> SUBMITTING -> RUNNING -> DONE, and RUNNING -> RECOVERING -> SUBMITTING
    when a node of the job is lost (PODAGENT_ON_NODE_LOSS).

    RECALLING reads the run's ledger: a run that finished earlier goes straight to DONE (a
    restarted container never runs it again); one interrupted mid-job is submitted again.
    The reward server loads while the workers join. Re-attaching (CLEANING finds this pod's Ray
    still running this run's job) skips STARTING_RAY: the reward server is kept if it answers,
    the workers are counted, not awaited, and SUBMITTING finds the job and follows it.
    Any state may raise (an error or a signal) or end on a stop request; teardown then runs
    from `finally`.
    """
    RECALLING = "recalling"
    PREPARING = "preparing"
    CLEANING = "cleaning"
    STARTING_RAY = "starting_ray"
    STARTING_REWARD = "starting_reward"
    WAITING_WORKERS = "waiting_workers"
    WAITING_REWARD = "waiting_reward"
    SUBMITTING = "submitting"
    RUNNING = "running"
    RECOVERING = "recovering"
    DONE = "done"


def restart_reason(settings: Settings, job_status: str | None, lost: list[str]) -> str | None:
    """Why the job that just ended is run again, or None: it succeeded, was stopped by someone
    else, or failed by itself (unless PODAGENT_RETRY_FAILED_JOB=1); with
    PODAGENT_ON_NODE_LOSS=fail a lost node changes nothing."""
    if job_status == "SUCCEEDED":
        return None
    if lost and settings.on_node_loss != "fail":
        return f"lost {', '.join(lost)}"
    if not lost and settings.retry_failed_job and job_status == "FAILED":
        return "the job failed (PODAGENT_RETRY_FAILED_JOB=1)"
    return None


class _NodeLost(Exception):
    """While the job runs (PODAGENT_ON_NODE_LOSS=restart): a worker was lost."""


class Head(Lifecycle[HeadState]):
    FIRST, LAST, SUCCESS = HeadState.RECALLING, HeadState.DONE, "succeeded"

    def __init__(self, settings: Settings, decision: RoleDecision, reporter: Reporter,
                 signals: Signals):
        self.stop_watch = StopWatch(reporter)
        # Every wait of the head sleeps through this: it also ends on a stop request.
        super().__init__(settings, decision, reporter, WatchedSignals(signals, self._look))
        self.setup: node.NodeSetup | None = None
        self.ray: HeadRay | None = None
        self.census: WorkerCensus | None = None
        self.job: JobRunner | None = None
        self.reward: RewardServer | None = None
        self.job_status: str | None = None
        self.ledger = Ledger.load(settings.run_dir, settings.run_name)
        self.finished_earlier: dict[str, Any] | None = None  # the ledger's, when it finished
        self._next_watch = 0.0
        self._next_own_look = 0.0
        self.follow_running_job = False  # re-attached: the job runs already, follow it
        self.restart: dict[str, Any] | None = None  # the restart under way: why, since when
        self.job_stopped_by_us = False  # the job was stopped for a restart (not ended by itself)
        self._job_ended_at: float | None = None

    def _look(self) -> None:
        """What every wait of the head looks at: a stop request, and (once it is up) this
        pod's own Ray, at most once a second. A raylet or dashboard that died is not waited
        past: joins, the reward server and the submission would each wait out their timeouts
        for nothing (the job's own watch does the same while it runs)."""
        self.stop_watch.look()
        if self.ray and self.ray.up and self.state is not HeadState.RUNNING:
            now = time.monotonic()
            if now >= self._next_own_look:
                self._next_own_look = now + WATCH_INTERVAL
                self.ray.watch(now)

    def handlers(self) -> dict[HeadState, Callable[[], HeadState]]:
        return {
            HeadState.RECALLING: self._recall,
            HeadState.PREPARING: self._prepare,
            HeadState.CLEANING: self._clean,
            HeadState.STARTING_RAY: self._start_ray,
            HeadState.STARTING_REWARD: self._start_reward,
            HeadState.WAITING_WORKERS: self._wait_workers,
            HeadState.WAITING_REWARD: self._wait_reward,
            HeadState.SUBMITTING: self._submit,
            HeadState.RUNNING: self._follow,
            HeadState.RECOVERING: self._recover,
        }

    # --- states --------------------------------------------------------------------------------

    def _recall(self) -> HeadState:
        finished = self.ledger.finished
        if finished:
            self.finished_earlier = finished
            at = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(finished["at"]))
            job = f", job {finished['job_status']}" if finished.get("job_status") else ""
            why = f": {finished['reason']}" if finished.get("reason") else ""
            self.reporter.say(f"run {self.s.run_name} finished earlier ({finished['outcome']}"
                              f"{job}, {at} UTC{why}): not running it again; logs in "
                              f"{self.s.run_dir} (a new PODAGENT_RUN_NAME starts a new run)")
            self.reporter.event("finished_earlier", **finished)
            return HeadState.DONE
        self.ledger.started(self.reporter.pod)
        interrupted = self.ledger.interrupted()
        if interrupted:
            self.reporter.say(f"run {self.s.run_name} was interrupted (job {interrupted['id']}: "
                              f"{interrupted.get('status') or 'running when its head stopped'}"
                              f"); it runs again, resuming from a checkpoint if there is one")
            self.reporter.event("run_interrupted_earlier", submission=interrupted["id"],
                                status=interrupted.get("status"))
        return HeadState.PREPARING

    def _prepare(self) -> HeadState:
        self.setup = node.prepare(self.s, Role.HEAD, self.reporter)
        node.raise_limits(self.s, Role.HEAD, self.reporter)
        self.ray = HeadRay(self.s, self.setup, self.reporter, self.signals,
                           self.ledger.current_submission_id())
        self.census = WorkerCensus(self.ray.nodes, self.reporter, self.ray.registered)
        return HeadState.CLEANING

    def _clean(self) -> HeadState:
        assert self.setup and self.ray
        # First: a Ray someone else started is never re-attached, and a head refused for it
        # has no dashboard to warn about.
        node.refuse_foreign_ray(self.s)
        listen = pod.listen_address(self.s, self.setup.node_ip)
        exposure.warn(self.s, listen, self.reporter)
        live = reattach.live_run(self.s, self.ray.submission_id, self.ray.address,
                                 self.ray.dashboard_url, self.reporter, self.signals)
        if live is not None:
            self.ray.adopt(live)
            self.stop_watch.gcs, self.adopted_ray = live, True
            self.follow_running_job = True
            return HeadState.STARTING_REWARD
        node.clean_stale_ray(self.s, self.reporter)
        # Ray's dashboard agent (its default port): without it the Jobs API accepts no job.
        # The dashboard and the reward server are checked where they will listen (with
        # PODAGENT_LISTEN=all, a holder on any address of the port is in the way).
        ports = [(self.setup.node_ip, self.s.ray_port), (listen, self.s.dashboard_port),
                 (self.setup.node_ip, ray_node.DASHBOARD_AGENT_PORT)]
        if self.s.reward != "none":
            ports.append((listen, self.s.reward_port))
        for address, port in ports:
            ray_node.check_port_free(address, port)
        ray_node.forget_last_cluster(self.s)
        return HeadState.STARTING_RAY

    def _start_ray(self) -> HeadState:
        assert self.ray
        self.ray.start()
        self.stop_watch.gcs = self.ray.gcs
        return HeadState.STARTING_REWARD

    def _start_reward(self) -> HeadState:
        assert self.setup
        if self.s.reward == "none":
            self.reporter.say("no reward server (PODAGENT_REWARD=none)")
            return HeadState.WAITING_WORKERS
        self.reward = RewardServer(self.s, self.setup.node_ip, self.s.run_dir, self.reporter,
                                   self.setup.nccl.variables)
        self.reward.keep_or_start(reattached=self.adopted_ray)
        return HeadState.WAITING_WORKERS

    def _wait_workers(self) -> HeadState:
        assert self.census
        expected = self.s.expected_workers
        if self.adopted_ray:
            self.census.count(expected)
            return HeadState.WAITING_REWARD
        if expected == 0:
            self.reporter.say("no workers expected: a single-node cluster")
            return HeadState.WAITING_REWARD
        self.reporter.say(f"waiting for {expected} worker(s) "
                          f"(timeout {self.s.worker_timeout:g} s)")
        with self.reporter.step("workers_joined") as step:
            joined = self._await_joins(expected, lambda: step.elapsed)
            if joined < expected:
                self.census.accept_shortfall(expected, self.s.min_workers,
                                             self.s.worker_timeout)
            step.done(self._census_line(), nodes=joined + 1, gpus=self._total_gpus())
        return HeadState.WAITING_REWARD

    def _await_joins(self, expected: int, elapsed: Callable[[], float]) -> int:
        assert self.census
        census, progress = self.census, Progress(self.reporter, every=10.0)

        def poll() -> int:
            joined = census.poll_joins(expected)
            progress(f"still waiting: {joined}/{expected} workers joined ({elapsed():.0f} s)")
            self._check_reward_alive()
            return joined

        Retrying(stop=stop_after_delay(self.s.worker_timeout), wait=wait_fixed(NODE_POLL),
                 retry=retry_if_result(lambda joined: joined < expected),
                 sleep=self.signals.sleep, retry_error_callback=lambda state: None)(poll)
        return len(census.workers)

    def _check_reward_alive(self) -> None:
        """Fail fast: a reward server that exits while the workers join is not waited for."""
        if self.reward:
            code = self.reward.exited()
            if code is not None:
                raise self.reward.died_error(code, "while starting")

    def _wait_reward(self) -> HeadState:
        if not self.reward:
            return HeadState.SUBMITTING
        with self.reporter.step("reward_ready") as step:
            self.reward.wait_healthy(self.signals)
            step.done(f"{self.reward.label} answers a real request at {self.reward.url}",
                      url=self.reward.url)
        self.reward.supervise()
        return HeadState.SUBMITTING

    def _submit(self) -> HeadState:
        assert self.ray and self.setup and self.census
        existing = self.follow_running_job
        runner = self.ray.jobs_api()
        if not existing:
            runner = runner.for_submission(self.ledger.next_submission_id())
        with self.reporter.step("job_submitted") as step:
            # Re-attached: the job runs already (no resume flag to work out, nothing to send).
            entrypoint = job_spec.entrypoint(self.s, self.reporter, resume=not existing)
            env = job_spec.env(self.s, self.setup.node_ip, len(self.census.workers) + 1,
                               self._total_gpus(), self.reward.url if self.reward else None,
                               bool(self.setup.plan.env_overrides.get("RAY_DEBUG")),
                               runner.submission_id,
                               len(self.ledger.submissions) + (0 if existing else 1))
            deadline = Deadline.after(SUBMIT_TIMEOUT)  # one for the whole submission
            if not existing:
                # Never two jobs of one run: an earlier attempt still alive is stopped first.
                runner.stop_earlier_attempts(self.s.run_name, self.s.stop_timeout,
                                             self.signals, deadline)
                interrupted = self.ledger.interrupted()  # recorded first: a head that dies
                self.ledger.submitted(runner.submission_id,  # now submits again
                                      interrupted["id"] if interrupted else None)
            new = runner.submit(entrypoint, env, self.s.working_dir,
                                {"podagent_run": self.s.run_name}, self.signals, deadline)
            self.job = runner  # from here on, teardown stops it
            if not new:
                self._set_aside_job_log()
            what = "submitted" if new else "already running: following it"
            label = "the built-in cluster check" if not self.s.job else " ".join(entrypoint)
            step.done(f"job {runner.submission_id} {what} ({label})",
                      submission_id=runner.submission_id, new=new)
        self.follow_running_job = False
        if self.restart and new:
            self._restarted(runner.submission_id)
        return HeadState.RUNNING

    def _set_aside_job_log(self) -> None:
        """Following a job again streams its log from the start: the earlier podagent's copy
        (a prefix of it) is kept beside, so job.log holds the job's output exactly once."""
        job_log = self.s.run_dir / "job.log"
        if job_log.exists() and job_log.stat().st_size:
            job_log.replace(self.s.run_dir / "job-before-reattach.log")

    def _follow(self) -> HeadState:
        assert self.job and self.census
        lost: list[NodeInfo] = []
        with self.reporter.step("job_finished") as step:
            try:
                self.job_status = self.job.follow(self.signals, on_tick=self._watch_cluster)
            except _NodeLost:
                # No waiting for NCCL's timeout: the job is stopped now and submitted again.
                self._stop_job(self.s.stop_timeout)
                self.job_stopped_by_us = True
                self.job.finish_log()
            self._job_ended_at = time.time()
            lost = [w for w in self.census.workers.values() if w.node_id in self.census.lost]
            if self.job_status != "SUCCEEDED" and not lost and self.s.on_node_loss != "fail":
                lost = self._losses_behind_failure()
            job = self.job
            self._record(lambda: self.ledger.job_ended(job.submission_id,
                                                       self.job_status or "LOST"))
            step.done(f"job {self.job_status or 'asked to stop (not yet confirmed)'}",
                      status=self.job_status, nodes_lost=[w.ip for w in lost])
        why = restart_reason(self.s, self.job_status, [w.ip for w in lost])
        if why:
            return self._begin_restart(why, lost)
        if self.job_status != "SUCCEEDED":
            self.job.outcome(self.job_status or "FAILED")
        return HeadState.DONE

    def _losses_behind_failure(self) -> list[NodeInfo]:
        """The job failed with no loss seen yet: a killed pod breaks the collectives before
        Ray's health checks notice, so ask the workers' raylets directly."""
        assert self.census
        gone = self.census.unreachable()
        self.census.mark_lost(gone, "its raylet does not answer", "the job failed meanwhile")
        return gone

    # --- restarts (PODAGENT_ON_NODE_LOSS) -----------------------------------------------------

    def _begin_restart(self, why: str, lost: list[NodeInfo]) -> HeadState:
        """Counts the restart against PODAGENT_RESTARTS (across container restarts: the ledger
        keeps them), says it loudly and records it."""
        assert self.census and self.job
        done = len(self.ledger.restarts)
        if done >= self.s.restarts:
            raise RestartsExhausted(
                f"{why}; the run was already restarted {done} time(s) "
                f"(PODAGENT_RESTARTS={self.s.restarts}): giving up; logs in {self.s.run_dir}"
                + (f", checkpoints kept in {self.s.checkpoint_dir}" if self.s.checkpoint_dir
                   else ""))
        number, now = done + 1, time.time()
        # The run stopped making progress when the job ended or the loss was seen, if earlier.
        noticed = min([*self.census.lost_at.values(), self._job_ended_at or now, now])
        self.census.begin_recovery()
        expected = self.s.expected_workers
        ended = "stopped" if self.job_stopped_by_us else f"ended {self.job_status or 'LOST'}"
        self.reporter.warn(f"RESTART {number}/{self.s.restarts}: {why}; job "
                           f"{self.job.submission_id} {ended}; waiting for {expected} worker(s) "
                           f"(a replacement pod counts), then the job is submitted again, "
                           f"resuming from the newest checkpoint")
        self.restart = {"n": number, "noticed": noticed, "stopped": now,
                        "earliest": time.monotonic() + min(
                            RESTART_BACKOFF_MAX, self.s.restart_backoff * 2 ** (number - 1))}
        entry = {"n": number, "reason": why, "lost": [w.ip for w in lost],
                 "job": self.job.submission_id, "job_status": self.job_status}
        self._record(lambda: self.ledger.restarting(entry))
        self.reporter.event("restart", n=number, of=self.s.restarts, reason=why,
                            lost=[w.ip for w in lost], job=self.job.submission_id)
        self.job, self.job_status, self.job_stopped_by_us = None, None, False
        return HeadState.RECOVERING

    def _recover(self) -> HeadState:
        """Wait until the cluster is whole again (a replacement pod counts), then the backoff."""
        assert self.census and self.restart
        expected = self.s.expected_workers
        with self.reporter.step("cluster_whole") as step:
            joined = self._await_joins(expected, lambda: step.elapsed)
            if joined < expected:
                self.census.accept_shortfall(expected, self.s.min_workers,
                                             self.s.worker_timeout)
            step.done(self._census_line(), nodes=joined + 1, gpus=self._total_gpus(),
                      replaced=[list(pair) for pair in self.census.replaced])
        self._await_departed_gone()
        wait = self.restart["earliest"] - time.monotonic()
        if wait > 0:
            self.reporter.say(f"restart {self.restart['n']}: backing off {wait:.1f} s "
                              f"(PODAGENT_RESTART_BACKOFF)")
            self.signals.sleep(wait)
        return HeadState.SUBMITTING

    def _await_departed_gone(self) -> None:
        """Ray lists a lost node as alive until its health checks fail (a few seconds): the
        job is submitted once it no longer does, so that it places nothing there."""
        assert self.census
        listed = Retrying(stop=stop_after_delay(DEPARTED_TIMEOUT), wait=wait_fixed(NODE_POLL),
                          retry=retry_if_result(bool), sleep=self.signals.sleep,
                          retry_error_callback=lambda state: state.outcome.result()
                          )(self.census.departed_still_listed)
        if listed:
            self.reporter.warn(f"Ray still lists the lost {', '.join(listed)} as alive after "
                               f"{DEPARTED_TIMEOUT:g} s; submitting anyway")

    def _restarted(self, submission_id: str) -> None:
        assert self.restart
        now = time.time()
        # Seconds without a running job: the job's own start-up and the steps it redoes from
        # its checkpoint come on top (podagent cannot see those; bench/recovery.py measures).
        figures = {"time_lost_s": round(now - self.restart["noticed"], 3),
                   "waited_s": round(now - self.restart["stopped"], 3),
                   "replaced": [list(pair) for pair in self.census.replaced]
                   if self.census else []}
        self._record(lambda: self.ledger.resubmitted(submission_id, **figures))
        self.reporter.say(f"restart {self.restart['n']}: job {submission_id} submitted "
                          f"{figures['time_lost_s']:.1f} s after the run stopped (the job's "
                          f"own start and the steps since its checkpoint come on top)")
        self.reporter.event("restarted", n=self.restart["n"], submission_id=submission_id,
                            **figures)
        self.restart = None

    def _watch_cluster(self) -> None:
        """While the job runs: is this pod's Ray still alive, and did a worker node leave?"""
        assert self.ray and self.census
        if self.reward and self.reward.failure:
            raise self.reward.failure
        now = time.monotonic()
        if now < self._next_watch:
            return
        self._next_watch = now + WATCH_INTERVAL
        alive = self.ray.watch(now)
        if alive is not None:
            then = {"restart": "stopping the job to restart it",
                    "wait": "the job decides whether it goes on (restarted if it fails)",
                    "fail": "the job decides whether it goes on"}[self.s.on_node_loss]
            if self.census.note_losses(alive, then) and self.s.on_node_loss == "restart":
                raise _NodeLost()

    def _record(self, write: Callable[[], None]) -> None:
        """A ledger entry while the run goes on: one the volume refuses is a warning, not the
        run's end (the job's own outcome matters more). The records that keep a job from
        running twice (the start, each submission) are not written through here: without
        them nothing is submitted (LedgerError)."""
        try:
            write()
        except LedgerError as exc:
            self.reporter.warn(str(exc))

    def _total_gpus(self) -> int:
        assert self.setup and self.census
        return self.setup.gpus + self.census.gpus

    def _census_line(self) -> str:
        assert self.census
        workers = len(self.census.workers)
        return (f"cluster ready: {workers + 1} nodes, {self._total_gpus()} GPUs "
                f"({workers} worker(s) joined)")

    # --- teardown ------------------------------------------------------------------------------

    def earlier_outcome(self) -> str | None:
        return self.finished_earlier["outcome"] if self.finished_earlier else None

    def record_exit(self, code: int) -> None:
        try:
            self.ledger.exit_code(code)
        except LedgerError as exc:
            self.reporter.warn(str(exc))

    def after_run(self) -> AfterRun | None:
        return AfterRun(self.s.after_run) if self.ledger.finished else None

    def _teardown(self, outcome: str) -> None:
        """Every step runs whatever the one before did: a full volume must not leave the job,
        the reward server or Ray running."""
        if self.finished_earlier:
            return  # nothing was started
        guarded = self._guarded
        # First: a pod being stopped has seconds, and a restarted head reads this.
        guarded("record the run's end in the ledger",
                lambda: self.ledger.ended(outcome, self.job_status))
        # With this pod's Ray dead there is no job to stop and nobody to tell: just clean up.
        ray_dead = outcome == RayDied.__name__ or bool(
            guarded("ask this pod's Ray whether it answers", self._ray_silent))
        if self.job and self.job_status is None and not ray_dead:
            guarded(f"stop job {self.job.submission_id}",
                    lambda: self._stop_job(self._deadline(self.s.stop_timeout, HURRIED_STEP)))
        if self.job:
            job = self.job
            guarded("record the job's end in the ledger",
                    lambda: self.ledger.job_ended(job.submission_id, self.job_status or "LOST"))
        if self.reward:
            reward = self.reward
            guarded("stop the reward server",
                    lambda: reward.stop(self._deadline(self.s.stop_timeout, HURRIED_STEP)))
        if self.ray and self.ray.gcs and not ray_dead:
            guarded("tell the workers the run is closing", lambda: self._announce_close(outcome))
        if self.ray:
            guarded("close the GCS client", self.ray.close)
        guarded("stop Ray", lambda: self._stop_ray(outcome, gcs_gone=ray_dead))
        elapsed = time.monotonic() - self.started
        reward_line = ""
        if self.reward:
            reward_line = (f"; REMOTE_RM_URL={self.reward.url} ({self.reward.restarts} "
                           f"restart(s))")
        self.reporter.say(f"run {self.s.run_name}: {outcome} after {elapsed:.1f} s"
                          f"{reward_line}; logs in {self.s.run_dir}")

    def _ray_silent(self) -> bool:
        """This pod's Ray was started but its GCS does not answer now (then the Jobs API and
        the workers cannot be reached either: each call would only wait out its timeout)."""
        if not self.ray:
            return False
        self.ray.closing()
        if not self.ray.silent():
            return False
        self.reporter.warn("this pod's Ray GCS does not answer: not stopping the job through "
                           "the Jobs API nor telling the workers; stopping Ray")
        return True

    def _announce_close(self, outcome: str) -> None:
        """The closing announcement, then a moment for the workers to leave on it."""
        assert self.ray
        over = outcome in ledger_mod.FINISHED
        self.ray.announce_close(outcome, self.job_status,
                                self.s.after_run if over else runstate.REJOIN)
        if self.census:
            self.census.await_departures(self._deadline(self.s.head_grace, HURRIED_DEPARTURES))

    def _stop_job(self, timeout: float | Deadline) -> None:
        assert self.job
        # Ray kills the job's shell and its children at once; a child that outlives its shell
        # by a moment is re-parented to podagent (a subreaper), and Ray, which waits until
        # every one of them is gone, counts it alive while it is an unreaped zombie: STOPPED
        # would come only after Ray's 3 s SIGKILL deadline. So reap them while waiting.
        own = [pid for pid in [self.reward.process.pid if self.reward else None] if pid]
        status = self.job.stop(timeout, while_waiting=lambda: process.reap_zombies(own))
        if status is None:
            self.reporter.warn(f"asked Ray to stop job {self.job.submission_id}; the dashboard "
                               f"did not confirm it (Ray is stopped next either way)")
        elif status not in JOB_TERMINAL:  # still going at the deadline: stopping Ray ends it
            self.reporter.warn(f"asked Ray to stop job {self.job.submission_id}; still {status} "
                               f"at the deadline (Ray is stopped next, which ends it)")
        else:
            self.reporter.say(f"job {self.job.submission_id} stopped (status {status})")
            self.job_status = status  # the workers' closing announcement carries it
        self.reporter.event("job_stopped", status=status)
