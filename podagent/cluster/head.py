"""The head's lifecycle as a named state machine driven by one loop.

Each state is a short handler; the work is done by collaborators with one job each: HeadRay
(this pod's Ray), WorkerCensus (who joined, who left), Recovery (whether and when the job runs
again), StopWatch (`podagent stop`), the reattach check, JobRunner (the job) and RewardServer.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from podagent.choices import AfterRun
from podagent.cluster import exposure, hang, job_spec, node, ray_node, reattach, runstate
from podagent.cluster.census import NODE_POLL, WorkerCensus
from podagent.cluster.head_ray import WATCH_INTERVAL, HeadRay
from podagent.cluster.jobs import SUBMIT_TIMEOUT
from podagent.cluster.recovery import JobAttempt, NodeLost, Recovery
from podagent.cluster.replacer import PodReplacer
from podagent.cluster.reward_server import RewardServer
from podagent.cluster.stop_watch import StopWatch, WatchedSignals
from podagent.config import Settings
from podagent.errors import DeadlineReached, RayDied
from podagent.platform import pod
from podagent.platform.roles import Role, RoleDecision
from podagent.ray_access.gcs import GcsClient
from podagent.report import Progress, Reporter
from podagent.run import cap, hangs, pod_setup
from podagent.run import ledger as ledger_mod
from podagent.run.ledger import SUCCEEDED, Ledger, record_or_warn
from podagent.run.lifecycle import EndRequested, Lifecycle
from podagent.waiting import Backoff, Deadline, Expired, Signals, retry
from podagent.wire import Ending, Event, HeadState

HURRIED_STEP = 1.0  # a signal ends the run: the job and the reward server get this long each
# ... and the workers this long to read the closing announcement (once a second) and leave
# before this pod's Ray, which holds it, is stopped.
HURRIED_DEPARTURES = 1.5


class HeadNode:
    """This pod as the cluster's head, made by PREPARING: its setup, its Ray, the census of its
    workers and the restart policy that reads the census. Head's states say when; this
    does the waiting for workers and the telling at the end."""

    def __init__(self, settings: Settings, reporter: Reporter, signals: Signals,
                 ledger: Ledger):
        self.settings, self.reporter, self.signals = settings, reporter, signals
        self.setup = node.prepare(settings, Role.HEAD, reporter)
        pod_setup.check_gpus(settings, reporter, signals, self.setup.nccl)
        node.raise_limits(settings, Role.HEAD, reporter)
        self.ray = HeadRay(settings, self.setup, reporter, signals,
                           ledger.current_submission_id())
        self.census = WorkerCensus(self.ray.nodes, reporter, self.ray.registered)
        self.recovery = Recovery(settings, ledger, self.census, reporter, signals)
        self.replacer = PodReplacer.of(settings, ledger, reporter)

    @property
    def gpus(self) -> int:
        return self.setup.gpus + self.census.gpus

    def clean(self) -> GcsClient | None:
        """Before Ray starts: a client of this pod's Ray when it still runs this run's job (to
        re-attach to); otherwise a clean slate for a new one, and None."""
        settings, ray = self.settings, self.ray
        # First: a Ray someone else started is never re-attached, and a head refused for it
        # has no dashboard to warn about.
        node.refuse_foreign_ray(settings)
        listen = pod.listen_address(settings, self.setup.node_ip)
        exposure.warn(settings, listen, self.reporter)
        live = reattach.live_run(settings, ray.submission_id, ray.address, ray.dashboard_url,
                                 self.reporter, self.signals)
        if live is None:
            node.make_room_for_head(settings, self.setup.node_ip, listen, self.reporter)
        return live

    def gather(self, step_name: Event, still_fine: Callable[[], None],
               extra: Callable[[], dict[str, Any]] = dict) -> None:
        """Wait until the expected workers joined (a replacement pod counts), for up to
        PODAGENT_WORKER_TIMEOUT; fewer will do only down to PODAGENT_MIN_WORKERS.
        `still_fine()` raises when waiting on is pointless (the reward server died)."""
        settings, census = self.settings, self.census
        expected = settings.expected_workers
        progress = Progress(self.reporter, every=10.0)
        with self.reporter.step(step_name) as step:

            def poll() -> int:
                joined = census.poll_joins(expected)
                progress(f"still waiting: {joined}/{expected} workers joined "
                         f"({step.elapsed:.0f} s)")
                still_fine()
                return joined

            with contextlib.suppress(Expired):  # then the census says who came
                retry(poll, awaited=f"{expected} worker(s)", backoff=Backoff.every(NODE_POLL),
                      deadline=settings.worker_timeout, sleep=self.signals.sleep,
                      until=lambda joined: joined >= expected)
            joined = len(census.workers)
            if joined < expected:
                census.accept_shortfall(expected, settings.min_workers, settings.worker_timeout)
            step.done(f"cluster ready: {joined + 1} nodes, {self.gpus} GPUs ({joined} "
                      f"worker(s) joined)", nodes=joined + 1, gpus=self.gpus, **extra())
        census.await_departed_gone(self.signals.sleep)

    def job_env(self, reward_url: str | None, submission_id: str,
                attempt: int) -> dict[str, str]:
        return job_spec.env(self.settings, self.setup.node_ip, len(self.census.workers) + 1,
                            self.gpus, reward_url,
                            bool(self.setup.plan.env_overrides.get("RAY_DEBUG")),
                            submission_id, attempt)

    def silent_at_end(self) -> bool:
        """This pod's Ray was started but its GCS does not answer now (then the Jobs API and
        the workers cannot be reached either: each call would only wait out its timeout)."""
        self.ray.stop_awaiting_jobs_api()
        if not self.ray.silent():
            return False
        self.reporter.warn("this pod's Ray GCS does not answer: not stopping the job through "
                           "the Jobs API nor telling the workers; stopping Ray")
        return True

    def over_word(self) -> tuple[str, list[str]]:
        """Where this head tells returning workers that the run is over (its cluster
        address), and the workers that did not leave with it."""
        return self.setup.node_ip, self.census.stragglers()

    def announce_close(self, outcome: str, job_status: str | None,
                       departures: Callable[[], Deadline]) -> None:
        """The closing announcement, then a moment (from then on) for the workers to leave."""
        over = outcome in ledger_mod.FINISHED
        self.ray.tell_workers_closing(outcome, job_status,
                                      self.settings.after_run if over else runstate.REJOIN)
        self.census.await_departures(departures())


class Head(Lifecycle[HeadState]):
    """The head's lifecycle: start Ray and the reward server, gather the workers, run and
    follow the job (restarting it as the policy says), and end in order. The run's ledger is
    the start's (run/start.py recalled it and recorded this start)."""

    FIRST, LAST, SUCCESS = HeadState.PREPARING, HeadState.DONE, SUCCEEDED

    def __init__(self, settings: Settings, decision: RoleDecision, reporter: Reporter,
                 signals: Signals, ledger: Ledger):
        self.stop_watch = StopWatch(reporter)
        self.deadline = cap.DeadlineWatch(settings, reporter)
        self._capped = False
        self._node: HeadNode | None = None  # from PREPARING on
        # Every wait of the head sleeps through this: it also ends on a stop request.
        super().__init__(settings, decision, reporter, WatchedSignals(signals, self._look))
        self.ledger = ledger
        self.reward: RewardServer | None = None
        self.job: JobAttempt | None = None  # from SUBMITTING until it ends or is restarted
        self._next_watch = self._next_own_look = 0.0
        self.progress = hang.watch_for(settings)  # the job's, started again at each submission

    @property
    def node(self) -> HeadNode:
        if self._node is None:
            raise RuntimeError(f"state {self.state.value}: the head was not prepared")
        return self._node

    @property
    def adopted_ray(self) -> bool:
        return self._node is not None and self._node.ray.adopted

    def _look(self) -> None:
        """What every wait of the head looks at: a stop request, the run's deadline, and (once
        it is up) this pod's own Ray, at most once a second. A raylet or dashboard that died is
        not waited past: joins, the reward server and the submission would each wait out their
        timeouts for nothing (the job's own watch does the same while it runs)."""
        self.stop_watch.look()
        capped = None if self._capped else self.deadline.reached()
        if capped is not None:  # once: its teardown's waits look too
            self._capped = True
            raise EndRequested(DeadlineReached.__name__, str(capped), capped)
        ray = self._node.ray if self._node else None
        if ray and ray.up and self.state is not HeadState.RUNNING:
            now = time.monotonic()
            if now >= self._next_own_look:
                self._next_own_look = now + WATCH_INTERVAL
                ray.watch(now)

    def handlers(self) -> dict[HeadState, Callable[[], HeadState]]:
        return {
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

    def _prepare(self) -> HeadState:
        self._node = HeadNode(self.settings, self.reporter, self.signals, self.ledger)
        return HeadState.CLEANING

    def _clean(self) -> HeadState:
        live = self.node.clean()
        if live is None:
            return HeadState.STARTING_RAY
        self.node.ray.adopt(live)
        self.stop_watch.gcs = live
        return HeadState.STARTING_REWARD

    def _start_ray(self) -> HeadState:
        self.node.ray.start()
        self.stop_watch.gcs = self.node.ray.gcs
        return HeadState.STARTING_REWARD

    def _start_reward(self) -> HeadState:
        if self.settings.reward == "none":
            self.reporter.say("no reward server (PODAGENT_REWARD=none)")
            return HeadState.WAITING_WORKERS
        setup = self.node.setup
        self.reward = RewardServer(self.settings, setup.node_ip, self.settings.run_dir,
                                   self.reporter, setup.nccl.variables)
        self.reward.keep_or_start(reattached=self.adopted_ray)
        return HeadState.WAITING_WORKERS

    def _wait_workers(self) -> HeadState:
        expected = self.settings.expected_workers
        if self.adopted_ray:
            self.node.census.count(expected)
        elif expected == 0:
            self.reporter.say("no workers expected: a single-node cluster")
        else:
            self.reporter.say(f"waiting for {expected} worker(s) "
                              f"(timeout {self.settings.worker_timeout:g} s)")
            self.node.gather(Event.WORKERS_JOINED, self._check_reward_alive)
        if self.node.replacer:  # what each worker was created with, while RunPod lists it
            self.node.replacer.remember()
        return HeadState.WAITING_REWARD

    def _check_reward_alive(self) -> None:
        """Fail fast: a reward server that exits while the workers join is not waited for."""
        if self.reward:
            code = self.reward.exited()
            if code is not None:
                raise self.reward.died_error(code, "while starting")

    def _wait_reward(self) -> HeadState:
        if not self.reward:
            return HeadState.SUBMITTING
        with self.reporter.step(Event.REWARD_READY) as step:
            self.reward.wait_healthy(self.signals)
            step.done(f"{self.reward.label} answers a real request at {self.reward.url}",
                      url=self.reward.url)
        self.reward.supervise()
        profile = self.settings.profile  # does the job ask this server? (trainers.py)
        unasked = profile.reward_warning(True, self.reward.url) if profile else None
        if unasked:
            self.reporter.warn(unasked)
        return HeadState.SUBMITTING

    def _submit(self) -> HeadState:
        head, settings, ledger = self.node, self.settings, self.ledger
        # Re-attached, and not submitting again after a restart: the job runs already (no
        # resume flag to work out, nothing to send): it is found and followed.
        existing = self.adopted_ray and head.recovery.under_way is None
        runner = head.ray.jobs_api()
        if not existing:
            runner = runner.for_submission(ledger.next_submission_id())
        with self.reporter.step(Event.JOB_SUBMITTED) as step:
            entrypoint = job_spec.entrypoint(settings, self.reporter, resume=not existing)
            env = head.job_env(self.reward.url if self.reward else None,
                               runner.submission_id,
                               len(ledger.submissions) + (0 if existing else 1))
            deadline = Deadline.after(SUBMIT_TIMEOUT)  # one for the whole submission
            if not existing:
                # Never two jobs of one run: an earlier attempt still alive is stopped first.
                runner.stop_earlier_attempts(settings.run_name, settings.stop_timeout,
                                             self.signals, deadline)
                interrupted = ledger.interrupted()  # recorded first: a head that dies now
                ledger.submitted(runner.submission_id,  # submits again
                                 interrupted["id"] if interrupted else None)
            new = runner.submit(entrypoint, env, settings.working_dir,
                                {"podagent_run": settings.run_name}, self.signals, deadline)
            self.job = JobAttempt(runner)  # from here on, teardown stops it
            self.progress = hang.watch_for(settings)
            if not new:
                job_spec.set_aside_job_log(settings.run_dir)
            what = "submitted" if new else "already running: following it"
            label = "the built-in cluster check" if not settings.job else " ".join(entrypoint)
            step.done(f"job {runner.submission_id} {what} ({label})",
                      submission_id=runner.submission_id, new=new)
        if new:
            head.recovery.resubmitted(runner.submission_id)  # when a restart is under way
        return HeadState.RUNNING

    def _follow(self) -> HeadState:
        job, recovery = self.job, self.node.recovery
        if job is None:
            raise RuntimeError("RUNNING without a submitted job")
        hung = ""  # what a hang's stacks showed, when the job hung
        with self.reporter.step(Event.JOB_FINISHED) as step:
            try:
                job.status = job.runner.follow(self.signals, on_tick=self._watch_cluster,
                                               on_output=self.progress.saw_output)
            except (NodeLost, hang.Hung) as stopped:
                if isinstance(stopped, hang.Hung):
                    hung = self._dump_everywhere(stopped.quiet)
                # No waiting for NCCL's timeout: the job is stopped now and submitted again.
                job.stop(self.settings.stop_timeout, self.reporter, self._own_pids())
                job.stopped_by_us = True
                job.runner.finish_log()
            job.ended_at = time.time()
            lost = recovery.losses(job.status)
            record_or_warn(lambda: self.ledger.job_ended(job.submission_id,
                                                         job.status or "LOST"), self.reporter)
            step.done(f"job {job.status or 'asked to stop (not yet confirmed)'}",
                      status=job.status, nodes_lost=[w.ip for w in lost])
        why = recovery.restart_reason(job.status, lost, hung)
        if why:
            kind = Ending.HUNG if hung and not lost else Ending.LOST
            recovery.begin(f"{why}; {hung}" if kind is Ending.HUNG else why, lost, job, kind)
            self.job = None  # ended or stopped: nothing left for teardown to stop
            return HeadState.RECOVERING
        if job.status != "SUCCEEDED":
            job.runner.outcome(job.status or "FAILED")
        return HeadState.DONE

    def _recover(self) -> HeadState:
        """Wait until the cluster is whole again (a replacement pod counts), then back off."""
        head = self.node
        replacer = head.replacer
        if replacer and not replacer.workers:  # a head started again since they joined
            replacer.remember()

        def still_fine() -> None:
            self._check_reward_alive()
            if replacer:  # a detached run's: the lost pod replaced at RunPod
                replacer.tick()

        head.gather(Event.CLUSTER_WHOLE, still_fine,
                    lambda: {"replaced": [list(pair) for pair in head.census.replaced]})
        head.recovery.before_resubmitting()
        return HeadState.SUBMITTING

    def _watch_cluster(self) -> None:
        """While the job runs: is this pod's Ray still alive, and did a worker node leave?"""
        if self.reward and self.reward.failure:
            raise self.reward.failure
        now = time.monotonic()
        if now < self._next_watch:
            return
        self._next_watch = now + WATCH_INTERVAL
        alive = self.node.ray.watch(now)
        if alive is not None:
            self.node.recovery.note_alive(alive)
        quiet = self.progress.hung()
        if quiet is not None:
            raise hang.Hung(quiet)

    def _dump_everywhere(self, quiet: float) -> str:
        """Every pod's stacks of the hung job, its culprit named: the line for the restart or
        the run's end."""
        head = self.node
        gcs = head.ray.gcs
        assert gcs is not None  # the job runs: this pod's Ray answered
        verdict = hang.dump_everywhere(
            self.settings, gcs, hang.pod_name(self.settings, Role.HEAD, head.setup.node_ip),
            list(head.census.workers.values()), hangs.next_number(self.settings.run_dir),
            quiet, self.progress.last_seen, self.reporter, self.signals.sleep)
        return verdict.line

    # --- what the CLI asks, and teardown -------------------------------------------------------

    def after_run(self) -> AfterRun | None:
        return self.settings.after_run if self.ledger.finished else None

    def over_word(self) -> tuple[str, list[str]] | None:
        return self._node.over_word() if self._node else None

    def _teardown(self, outcome: str) -> None:
        """Every step runs whatever the one before did: a full volume must not leave the job,
        the reward server or Ray running."""
        guarded, settings, head, job, reward = (self._guarded, self.settings, self._node,
                                                self.job, self.reward)
        # First: a pod being stopped has seconds, and a restarted head reads this.
        guarded("record the run's end in the ledger",
                lambda: self.ledger.ended(outcome, job.status if job else None))
        # With this pod's Ray dead there is no job to stop and nobody to tell: just clean up.
        ray_dead = outcome == RayDied.__name__ or bool(
            head and guarded("ask this pod's Ray whether it answers", head.silent_at_end))
        if job and job.status is None and not ray_dead:
            guarded(f"stop job {job.submission_id}", lambda: job.stop(
                self._deadline(settings.stop_timeout, HURRIED_STEP), self.reporter,
                self._own_pids()))
        if job:
            guarded("record the job's end in the ledger", lambda: self.ledger.job_ended(
                job.submission_id, job.status or "LOST"))
        if reward:
            guarded("stop the reward server",
                    lambda: reward.stop(self._deadline(settings.stop_timeout, HURRIED_STEP)))
        if head and head.ray.gcs and not ray_dead:
            guarded("tell the workers the run is closing", lambda: head.announce_close(
                outcome, job.status if job else None,
                lambda: self._deadline(settings.head_grace, HURRIED_DEPARTURES)))
        if head:
            guarded("close the GCS client", head.ray.close_gcs_client)
        guarded("stop Ray", lambda: ray_node.stop_at_teardown(
            settings, self.reporter, self._deadline, outcome, gcs_gone=ray_dead,
            adopted=self.adopted_ray))
        # The reward server's restarts, not the run's: said so, or it reads as the run's count.
        reward_line = (f"; REMOTE_RM_URL={reward.url} (reward server restarted "
                       f"{reward.restarts} time(s))" if reward else "")
        self.reporter.say(f"run {settings.run_name}: {outcome} after "
                          f"{time.monotonic() - self.started:.1f} s{reward_line}; logs in "
                          f"{settings.run_dir}")

    def _own_pids(self) -> list[int]:  # podagent's children beside the job's: Popen reaps
        return [self.reward.process.pid] if self.reward and self.reward.process.pid else []
