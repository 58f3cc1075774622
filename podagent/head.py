"""The head's lifecycle as a named state machine driven by one loop."""

from __future__ import annotations

import concurrent.futures
import contextlib
import enum
import json
import sys
import threading
import time
from collections.abc import Callable

import psutil
import requests
from tenacity import (
    Retrying,
    retry_if_exception_type,
    retry_if_result,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
    wait_fixed,
)

from podagent import checkpoint, node, ray_compat, ray_node
from podagent.config import Settings, is_secret
from podagent.errors import RayDied, RayStartError, WorkersTimeout
from podagent.gcs import GcsClient, GcsUnavailable, NodeInfo
from podagent.jobs import JobRunner
from podagent.lifecycle import EndRequested, Lifecycle
from podagent.report import Progress, Reporter
from podagent.reward import RewardServer
from podagent.roles import Role, RoleDecision
from podagent.waiting import Signals

RAY_START_TIMEOUT = 180.0  # `ray start` plus the first healthy probes; Ray needs ~5-20 s
RAY_START_ATTEMPTS = 3
NODE_POLL = 0.1  # the node table is one cheap RPC: poll often so joins show at once
WATCH_INTERVAL = 1.0  # while the job runs: own Ray health and node losses
OWN_RAY_GRACE = 5.0  # a GCS busy for a moment is not dead
PROBE_MAX_WAIT = 0.1  # readiness probes of local ports: a refused connection costs nothing
STOP_POLL = 1.0  # a stop request is looked for at most this often (one tiny KV read)
STOP_LOOK_TIMEOUT = 0.5
REATTACH_PROBE_TIMEOUT = 15.0  # a live Ray's Jobs API gets this long to say what job it runs
LIVE_JOB = ("PENDING", "RUNNING")


class HeadState(str, enum.Enum):
    """PREPARING -> CLEANING -> STARTING_RAY -> STARTING_REWARD -> WAITING_WORKERS
    -> WAITING_REWARD -> SUBMITTING -> RUNNING -> DONE.

    The reward server loads while the workers join. Re-attaching (CLEANING finds this pod's Ray
    still running this run's job) skips STARTING_RAY: the reward server is kept if it answers,
    the workers are counted, not awaited, and SUBMITTING finds the job and follows it.
    Any state may raise (an error or a signal) or end on a stop request; teardown then runs
    from `finally`.
    """
    PREPARING = "preparing"
    CLEANING = "cleaning"
    STARTING_RAY = "starting_ray"
    STARTING_REWARD = "starting_reward"
    WAITING_WORKERS = "waiting_workers"
    WAITING_REWARD = "waiting_reward"
    SUBMITTING = "submitting"
    RUNNING = "running"
    DONE = "done"


class Head(Lifecycle[HeadState]):
    FIRST, LAST, SUCCESS = HeadState.PREPARING, HeadState.DONE, "succeeded"

    def __init__(self, settings: Settings, decision: RoleDecision, reporter: Reporter,
                 signals: Signals):
        # Every wait of the head sleeps through this: it also ends on a stop request.
        super().__init__(settings, decision, reporter, _Waits(signals, self._look_for_stop))
        self.setup: node.NodeSetup | None = None
        self.gcs: GcsClient | None = None
        self.job: JobRunner | None = None
        self.reward: RewardServer | None = None
        self._jobs_api: concurrent.futures.Future[JobRunner] | None = None
        self._closing = threading.Event()
        self._raylet: psutil.Process | None = None
        self.job_status: str | None = None
        self.workers: dict[str, NodeInfo] = {}
        self.lost: set[str] = set()
        self._next_watch = 0.0
        self._unhealthy_since: float | None = None
        self._next_stop_look = 0.0
        self._stop_seen = False

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
        }

    # --- states --------------------------------------------------------------------------------

    def _prepare(self) -> HeadState:
        self.setup = node.prepare(self.s, Role.HEAD, self.reporter)
        return HeadState.CLEANING

    def _clean(self) -> HeadState:
        assert self.setup
        self._warn_exposure()
        if self._reattach():
            return HeadState.STARTING_REWARD
        node.clean_stale_ray(self.s, self.reporter)
        # Ray's dashboard agent (its default port): without it the Jobs API accepts no job.
        # The dashboard and the reward server are checked where they will listen (with
        # PODAGENT_LISTEN=all, a holder on any address of the port is in the way).
        node_ip, listen = self.setup.node_ip, ray_node.listen_address(self.s, self.setup.node_ip)
        ports = [(node_ip, self.s.ray_port), (listen, self.s.dashboard_port),
                 (node_ip, ray_node.DASHBOARD_AGENT_PORT)]
        if self.s.reward != "none":
            ports.append((listen, self.s.reward_port))
        for address, port in ports:
            ray_node.check_port_free(address, port)
        return HeadState.STARTING_RAY

    def _warn_exposure(self) -> None:
        """Say loudly who can reach the dashboard (and so run code here) and the reward server."""
        assert self.setup
        listen = ray_node.listen_address(self.s, self.setup.node_ip)
        dashboard = f"{listen}:{self.s.dashboard_port}"
        if self.s.listen == "all":
            reward = ("" if self.s.reward == "none"
                      else f" and the reward server on port {self.s.reward_port}")
            if self.s.auth_token:
                self.reporter.say(f"PODAGENT_LISTEN=all: the dashboard{reward} listen on every "
                                  f"interface ({dashboard}); the Jobs API asks for the token, "
                                  f"the reward server asks for nothing")
            else:
                self.reporter.warn(
                    f"PODAGENT_LISTEN=all WITHOUT A CLUSTER TOKEN: the Ray dashboard{reward} "
                    f"listen on EVERY interface of this pod ({dashboard}), public ones too: "
                    f"anyone who reaches port {self.s.dashboard_port} can run any code here. "
                    f"Set PODAGENT_TOKEN on every pod, or use PODAGENT_LISTEN=private")
            self.reporter.event("listen_all", dashboard=dashboard, token=bool(self.s.auth_token))
        if not self.s.auth_token and not listen.startswith("127."):
            # An open Jobs API is remote code execution for anyone who reaches it
            # (CVE-2023-48022).
            if self.s.listen != "all":  # that warning said it already, louder
                self.reporter.warn(
                    f"NO CLUSTER TOKEN: the Ray dashboard and Jobs API on {dashboard} will run "
                    f"jobs for anyone who can reach them; {_token_advice()}")
            self.reporter.event("auth_off", dashboard=dashboard)

    def _reattach(self) -> bool:
        """This pod's Ray still runs this run's job (an earlier podagent of the run died and
        its Ray lived on): adopt both instead of cleaning up, so the job is never submitted
        twice. Needs the run name set explicitly; anything else is cleaned as a stale Ray."""
        if self.s.sources.get("run_name", "default") == "default":
            return False  # a generated name never matches an earlier podagent's job
        gcs = GcsClient(self.address, metadata=self.s.grpc_metadata())
        try:
            gcs.check_alive(timeout=2.0)
        except GcsUnavailable:  # no Ray here, or one of another cluster (another token)
            gcs.close()
            return False
        status = self._live_job_status()
        if status not in LIVE_JOB:
            gcs.close()
            self.reporter.say(f"a Ray from an earlier run answers at {self.address} without a "
                              f"running job {self.s.run_name} ({status}): cleaning it up")
            return False
        self.gcs, self.adopted_ray = gcs, True
        self.reporter.say(f"re-attaching: this pod's Ray at {self.address} still runs job "
                          f"{self.s.run_name} ({status}); following it, not submitting again")
        self.reporter.event("reattached", address=self.address, job_status=status)
        # Ray's modules are imported here, before the Jobs API thread imports them too: two
        # threads importing Ray at once can see a partly initialised module (ImportError).
        _preload_ray_clients()
        self._jobs_api = concurrent.futures.ThreadPoolExecutor(1, "jobs-api").submit(
            self._connect_jobs_api)
        return True

    def _live_job_status(self) -> str:
        """This run's job status in the Jobs API on this pod ('no such job', 'no answer: ...')."""
        url = f"{self.dashboard_url}/api/jobs/{self.s.run_name}"
        last = {"answer": "no answer"}

        def attempt() -> str:
            try:
                reply = requests.get(url, timeout=5.0, headers=self.s.auth_headers())
            except requests.RequestException as exc:
                last["answer"] = f"the Jobs API does not answer: {exc}"
                raise _NotReady(str(exc)) from None
            if reply.status_code == 404:
                return "no such job"
            if reply.status_code >= 400:
                return f"the Jobs API answered HTTP {reply.status_code}"
            try:
                return str(reply.json()["status"])
            except (ValueError, KeyError, TypeError):
                return "the Jobs API's answer has no status"

        try:
            # A dashboard busy for a moment must not get its job killed: retry a little.
            return Retrying(stop=stop_after_delay(REATTACH_PROBE_TIMEOUT),
                            wait=wait_exponential(multiplier=0.2, max=2.0),
                            retry=retry_if_exception_type(_NotReady), sleep=self.signals.sleep,
                            reraise=True)(attempt)
        except _NotReady:
            return last["answer"]

    @property
    def address(self) -> str:
        assert self.setup
        return f"{self.setup.node_ip}:{self.s.ray_port}"

    @property
    def dashboard_url(self) -> str:
        assert self.setup
        return f"http://{self.setup.node_ip}:{self.s.dashboard_port}"

    def _start_ray(self) -> HeadState:
        assert self.setup
        # Importing Ray's job client and node messages takes ~1 s of CPU: do it while
        # `ray start` runs, instead of after the workers joined.
        threading.Thread(target=_preload_ray_clients, name="preload", daemon=True).start()
        with self.reporter.step("ray_head") as step:
            self._ray_start()
            self.gcs = GcsClient(self.address, metadata=self.s.grpc_metadata())
            self._probe_until(self._gcs_answers, "the GCS health RPC", self.signals.sleep)
            step.done(f"Ray head up at {self.address} (GCS answers)", address=self.address)
        # The dashboard (Jobs API) comes up seconds after the GCS; workers only need the GCS.
        # So it is awaited, and the job client made, in the background while workers join.
        self._jobs_api = concurrent.futures.ThreadPoolExecutor(1, "jobs-api").submit(
            self._connect_jobs_api)
        return HeadState.STARTING_REWARD

    def _ray_start(self) -> None:
        """`ray start --head`, retried a bounded number of times: on a busy pod Ray can miss a
        start-up deadline of its own (before 2.52 its dashboard gets a fixed 20 s) and succeed
        on the next attempt, as a worker's join does."""
        assert self.setup
        attempts = {"n": 0}

        def attempt() -> None:
            attempts["n"] += 1
            try:
                ray_node.RayNode(self.setup.plan, self.s.run_dir / "ray-start-head.log",
                                 RAY_START_TIMEOUT).start()
            except RayStartError as exc:
                if attempts["n"] < RAY_START_ATTEMPTS:
                    last = str(exc).strip().splitlines()[-1] if str(exc).strip() else "?"
                    self.reporter.warn(f"starting Ray failed (attempt {attempts['n']} of "
                                       f"{RAY_START_ATTEMPTS}): {last}; stopping what it "
                                       f"started and trying again")
                    ray_node.RayNode.stop(self.s.stop_timeout)
                raise

        Retrying(stop=stop_after_attempt(RAY_START_ATTEMPTS), wait=wait_fixed(1.0),
                 retry=retry_if_exception_type(RayStartError), sleep=self.signals.sleep,
                 reraise=True)(attempt)

    def _connect_jobs_api(self) -> JobRunner:
        self._probe_until(self._dashboard_answers, "the dashboard's /api/version",
                          self._sleep_unless_closing)
        try:
            return JobRunner(self.dashboard_url, self.s.run_name, self.reporter,
                             self.s.run_dir / "job.log", headers=self.s.auth_headers())
        except Exception as exc:  # Ray's client raises plain exceptions of several kinds
            raise RayStartError(f"the Jobs API at {self.dashboard_url} refused a client: "
                                f"{exc}") from None

    def _sleep_unless_closing(self, seconds: float) -> None:
        # The background probe must end with the run: Python joins its thread at exit.
        if self._closing.wait(seconds):
            raise RayStartError("the head is closing the run")

    def _gcs_answers(self) -> None:
        assert self.gcs
        self.gcs.check_alive(timeout=2.0)

    def _dashboard_answers(self) -> None:
        reply = requests.get(f"{self.dashboard_url}/api/version", timeout=2.0,
                             headers=self.s.auth_headers())
        reply.raise_for_status()

    def _probe_until(self, probe: Callable[[], None], what: str,
                     sleep: Callable[[float], None]) -> None:
        """Retry a readiness probe until RAY_START_TIMEOUT; the error says what and why."""
        last = {"error": "not probed yet"}

        def attempt() -> None:
            try:
                probe()
            except (GcsUnavailable, requests.RequestException) as exc:
                last["error"] = str(exc)
                raise _NotReady(str(exc)) from None

        try:
            Retrying(stop=stop_after_delay(RAY_START_TIMEOUT),
                     wait=wait_exponential(multiplier=0.02, max=PROBE_MAX_WAIT),
                     retry=retry_if_exception_type(_NotReady), sleep=sleep,
                     reraise=True)(attempt)
        except _NotReady:
            raise RayStartError(
                f"Ray head started but {what} did not answer within {RAY_START_TIMEOUT:g} s; "
                f"last error: {last['error']}") from None

    def _await_jobs_api(self) -> JobRunner:
        assert self._jobs_api is not None
        if self._jobs_api.done():
            self.reporter.say(f"dashboard answers at {self.dashboard_url}")
            return self._jobs_api.result()
        with self.reporter.step("dashboard_ready") as step:
            while not self._jobs_api.done():
                self.signals.sleep(0.02)
            runner = self._jobs_api.result()
            step.done(f"dashboard answers at {self.dashboard_url}")
        return runner

    def _start_reward(self) -> HeadState:
        assert self.setup
        if self.s.reward == "none":
            self.reporter.say("no reward server (PODAGENT_REWARD=none)")
            return HeadState.WAITING_WORKERS
        self.reward = RewardServer(self.s, self.setup.node_ip, self.s.run_dir, self.reporter,
                                   self.setup.nccl.variables)
        if self.adopted_ray and self.reward.adopt():
            if self.reward.adopted:
                self.reporter.say(f"{self.reward.label} still answers at {self.reward.url} "
                                  f"(pid {self.reward.adopted.pid}): keeping it")
            else:
                self.reporter.warn(f"{self.reward.label} still answers at {self.reward.url}, "
                                   f"but its process is not visible from here: keeping it; "
                                   f"podagent cannot stop it at the end")
            return HeadState.WAITING_WORKERS
        self.reward.start()
        self.reporter.say(f"{self.reward.label} starting for {self.reward.url} "
                          f"(log: {self.reward.process.log_path})")
        return HeadState.WAITING_WORKERS

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

    def _alive_workers(self) -> list[NodeInfo]:
        assert self.gcs
        try:
            nodes = self.gcs.nodes(timeout=5.0)
        except GcsUnavailable as exc:
            raise RayStartError(f"this pod's Ray GCS stopped answering: {exc}") from None
        return [n for n in nodes if n.alive and not n.is_head]

    def _count_workers(self) -> HeadState:
        """On re-attach: the job runs already, so the workers are counted, never awaited."""
        expected = self.s.expected_workers
        self.workers = {w.node_id: w for w in self._alive_workers()}
        for worker in self.workers.values():
            self.reporter.say(f"worker still joined: {worker.ip} ({worker.gpus:g} GPUs)")
        counted = f"{len(self.workers)} of {expected} expected worker(s) alive in the node table"
        if len(self.workers) < expected:
            self.reporter.warn(f"re-attached with {counted}; following the job anyway")
        else:
            self.reporter.say(f"re-attached: {counted}")
        self.reporter.event("workers_counted", workers=len(self.workers), expected=expected,
                            ips=sorted(w.ip for w in self.workers.values()))
        return HeadState.WAITING_REWARD

    def _wait_workers(self) -> HeadState:
        if self.adopted_ray:
            return self._count_workers()
        expected = self.s.expected_workers
        if expected == 0:
            self.reporter.say("no workers expected: a single-node cluster")
            return HeadState.WAITING_REWARD
        self.reporter.say(f"waiting for {expected} worker(s) "
                          f"(timeout {self.s.worker_timeout:g} s)")
        progress = Progress(self.reporter, every=10.0)
        with self.reporter.step("workers_joined") as step:

            def poll() -> int:
                alive = {w.node_id: w for w in self._alive_workers()}
                for node_id in [n for n in self.workers if n not in alive]:
                    gone = self.workers.pop(node_id)
                    self.reporter.warn(f"worker {gone.ip} left again before the job started")
                    self.reporter.event("worker_lost", ip=gone.ip, node_id=node_id)
                for worker in alive.values():
                    if worker.node_id not in self.workers:
                        self.workers[worker.node_id] = worker
                        self.reporter.say(
                            f"worker joined: {worker.ip} ({worker.gpus:g} GPUs) "
                            f"[{len(self.workers)}/{expected}]")
                        self.reporter.event("worker_joined", ip=worker.ip, gpus=worker.gpus,
                                            node_id=worker.node_id,
                                            registered_ms=worker.start_time_ms)
                progress(f"still waiting: {len(self.workers)}/{expected} workers joined "
                         f"({step.elapsed:.0f} s)")
                self._check_reward_alive()
                return len(self.workers)

            Retrying(stop=stop_after_delay(self.s.worker_timeout), wait=wait_fixed(NODE_POLL),
                     retry=retry_if_result(lambda joined: joined < expected),
                     sleep=self.signals.sleep, retry_error_callback=lambda state: None)(poll)
            joined = len(self.workers)
            if joined < expected:
                who = ", ".join(sorted(w.ip for w in self.workers.values())) or "none"
                minimum = self.s.min_workers
                if minimum is None or joined < minimum:
                    raise WorkersTimeout(
                        f"only {joined} of {expected} workers joined within "
                        f"{self.s.worker_timeout:g} s; joined: {who}")
                self.reporter.warn(f"{joined} of {expected} workers joined ({who}); going on "
                                   f"because PODAGENT_MIN_WORKERS={minimum}")
            step.done(self._census(), nodes=joined + 1, gpus=self._total_gpus())
        return HeadState.WAITING_REWARD

    def _total_gpus(self) -> int:
        assert self.setup
        return self.setup.gpus + int(sum(w.gpus for w in self.workers.values()))

    def _census(self) -> str:
        return (f"cluster ready: {len(self.workers) + 1} nodes, {self._total_gpus()} GPUs "
                f"({len(self.workers)} worker(s) joined)")

    def _job_env(self) -> dict[str, str]:
        assert self.setup
        # No NCCL variables here: Ray would impose the head's on every node, while each pod's Ray
        # node already carries its own pod's (its interface may be named differently).
        env: dict[str, str] = {}
        env.update(
            PODAGENT_NUM_NODES=str(len(self.workers) + 1),
            PODAGENT_NUM_GPUS=str(self._total_gpus()),
            PODAGENT_HEAD_ADDR=self.setup.node_ip,
            PODAGENT_RUN_NAME=self.s.run_name,
        )
        if self.reward:
            env["REMOTE_RM_URL"] = self.reward.url
        if self.setup.plan.env_overrides.get("RAY_DEBUG"):
            env["RAY_DEBUG"] = "legacy"
        # W&B settings travel with the job; the key itself does not go through the Jobs API
        # (anyone who can read the dashboard could read it): the job inherits it from the
        # environment of the Ray processes podagent started.
        env.update({k: v for k, v in self.s.environ.items()
                    if k.startswith("WANDB_") and not is_secret(k)})
        return env

    def _entrypoint(self) -> tuple[str, ...]:
        if not self.s.job:
            return (sys.executable, "-m", "podagent.clustercheck")
        resume = checkpoint.resume_args(self.s)
        if resume.args:
            self.reporter.say(resume.reason)
            self.reporter.event("resume", checkpoint_dir=self.s.checkpoint_dir,
                                args=list(resume.args))
        elif resume.reason:
            self.reporter.say(resume.reason)
        return (*self.s.job, *resume.args)

    def _submit(self) -> HeadState:
        runner = self._await_jobs_api()
        with self.reporter.step("job_submitted") as step:
            # Re-attached: the job runs already (no resume flag to work out, nothing to send).
            entrypoint = (self._entrypoint() if not self.adopted_ray else
                          self.s.job or (sys.executable, "-m", "podagent.clustercheck"))
            new = runner.submit(entrypoint, self._job_env(), self.s.working_dir,
                                {"podagent_run": self.s.run_name}, self.signals)
            self.job = runner  # from here on, teardown stops it
            if not new:
                self._set_aside_job_log()
            what = "submitted" if new else "already running: following it"
            label = "the built-in cluster check" if not self.s.job else " ".join(entrypoint)
            step.done(f"job {self.s.run_name} {what} ({label})", submission_id=self.s.run_name,
                      new=new)
        return HeadState.RUNNING

    def _set_aside_job_log(self) -> None:
        """Following a job again streams its log from the start: the earlier podagent's copy
        (a prefix of it) is kept beside, so job.log holds the job's output exactly once."""
        job_log = self.s.run_dir / "job.log"
        if job_log.exists() and job_log.stat().st_size:
            job_log.replace(self.s.run_dir / "job-before-reattach.log")

    def _follow(self) -> HeadState:
        assert self.job
        with self.reporter.step("job_finished") as step:
            self.job_status = self.job.follow(self.signals, on_tick=self._watch_cluster)
            step.done(f"job {self.job_status}", status=self.job_status)
        self.job.outcome(self.job_status)
        return HeadState.DONE

    def _watch_cluster(self) -> None:
        """While the job runs: is this pod's Ray still alive, and did a worker node leave?"""
        assert self.gcs
        if self.reward and self.reward.failure:
            raise self.reward.failure
        now = time.monotonic()
        if now < self._next_watch:
            return
        self._next_watch = now + WATCH_INTERVAL
        try:
            self.gcs.check_alive(timeout=WATCH_INTERVAL)
            self._raylet = self._raylet or ray_node.RayNode.find_raylet(
                adopted_from=self.s.ray_temp_dir, adopted=self.adopted_ray)
            raylet_ok = self._raylet is not None and ray_node.RayNode.running(self._raylet)
            problem = "" if raylet_ok else "this pod's raylet exited"
            alive: set[str] | None = {n.node_id for n in self._alive_workers()}
        except (GcsUnavailable, RayStartError) as exc:
            problem, alive = f"the GCS does not answer ({exc})", None
        if not problem:
            self._unhealthy_since = None
        else:
            self._unhealthy_since = self._unhealthy_since or now
            if now - self._unhealthy_since > OWN_RAY_GRACE:
                raise RayDied(f"this pod's Ray stopped working while the job ran: {problem}")
        for node_id, worker in self.workers.items():
            if alive is not None and node_id not in alive and node_id not in self.lost:
                self.lost.add(node_id)
                # Ray marks a node dead after its health checks fail (ray_node.HEALTH_CHECK_ENV:
                # seconds, not a minute); the job decides whether it can go on without it.
                now_s = time.time()
                at = time.strftime("%H:%M:%S", time.gmtime(now_s))
                self.reporter.warn(f"worker {worker.ip} left the cluster while the job ran "
                                   f"(Ray marked its node dead; noticed {at} UTC); the job "
                                   f"decides whether it goes on")
                self.reporter.event("worker_lost", ip=worker.ip, node_id=node_id,
                                    at=round(now_s, 3))

    # --- teardown ------------------------------------------------------------------------------

    def _teardown(self, outcome: str) -> None:
        self._closing.set()
        # With this pod's Ray dead there is no job to stop and nobody to tell: just clean up.
        ray_dead = outcome == RayDied.__name__
        if self.job and self.job_status is None and not ray_dead:
            status = self.job.stop(self.s.stop_timeout)
            if status is None:
                self.reporter.warn(f"asked Ray to stop job {self.s.run_name}; the dashboard "
                                   f"did not confirm it (Ray is stopped next either way)")
            else:
                self.reporter.say(f"job {self.s.run_name} stopped (status {status})")
                self.job_status = status  # the workers' closing announcement carries it
            self.reporter.event("job_stopped", status=status)
        if self.reward:
            self.reward.stop()
        if self.gcs and not ray_dead:
            self._announce_close(outcome)
            self._wait_workers_left()
        if self.gcs:
            self.gcs.close()
        self._stop_ray(outcome, gcs_gone=ray_dead)
        elapsed = time.monotonic() - self.started
        reward = ""
        if self.reward:
            reward = f"; REMOTE_RM_URL={self.reward.url} ({self.reward.restarts} restart(s))"
        self.reporter.say(f"run {self.s.run_name}: {outcome} after {elapsed:.1f} s{reward}; "
                          f"logs in {self.s.run_dir}")

    def _announce_close(self, outcome: str) -> None:
        """Tell the workers this is an orderly end, so they leave with exit 0."""
        assert self.gcs
        state = json.dumps({"state": "closing", "outcome": outcome,
                            "job_status": self.job_status}).encode()
        with contextlib.suppress(GcsUnavailable):
            self.gcs.kv_put(node.KV_NAMESPACE, node.KV_RUN_STATE, state)

    def _wait_workers_left(self) -> None:
        """Workers leave on the announcement; give them a moment so they never see us vanish."""
        if not self.workers:
            return

        def remaining() -> int:
            try:
                return len(self._alive_workers())
            except RayStartError:
                return 0

        left = Retrying(stop=stop_after_delay(self.s.head_grace), wait=wait_fixed(0.2),
                        retry=retry_if_result(lambda n: n > 0),
                        retry_error_callback=lambda state: state.outcome.result())(remaining)
        if left:
            self.reporter.warn(f"{left} worker(s) still connected; stopping Ray anyway")

    # --- a stop request (`podagent stop`) --------------------------------------------------------

    def _look_for_stop(self) -> None:
        """Called from every wait: at most once a second, one KV read; raises EndRequested."""
        if self.gcs is None or self._stop_seen:
            return
        now = time.monotonic()
        if now < self._next_stop_look:
            return
        self._next_stop_look = now + STOP_POLL
        try:
            raw = self.gcs.kv_get(node.KV_NAMESPACE, node.KV_STOP_REQUEST,
                                  timeout=STOP_LOOK_TIMEOUT)
        except GcsUnavailable:
            return  # the GCS is watched elsewhere; a stop request needs one that answers
        if raw is None:
            return
        self._stop_seen = True
        by, at = _parse_stop_request(raw)
        when = f" at {time.strftime('%H:%M:%S', time.gmtime(at))} UTC" if at else ""
        self.reporter.say(f"stop requested by {by}{when}: ending the run in order (job, "
                          f"workers, Ray)")
        self.reporter.event("stop_requested", by=by, at=at)
        raise EndRequested("StopRequested", f"stop requested by {by}")


def _token_advice() -> str:
    ray = ray_compat.installed()
    feature = ray_compat.FEATURES["token_auth"]
    if ray and not ray.has(feature.name):
        return (f"this image's {ray} has no cluster tokens (Ray {feature.since} or newer has "
                f"them): keep the pods' network private")
    return "set PODAGENT_TOKEN on every pod (`podagent token` makes one)"


def _parse_stop_request(raw: bytes) -> tuple[str, float | None]:
    """(who asked, when); a request that is not the expected JSON still stops the run."""
    try:
        request = json.loads(raw)
    except ValueError:
        return "an unnamed pod", None
    if not isinstance(request, dict):
        return "an unnamed pod", None
    by = str(request.get("by") or "an unnamed pod")[:100]
    at = request.get("at")
    # Epoch seconds up to the year 5000; anything else is not a time (and would not format).
    valid = isinstance(at, (int, float)) and not isinstance(at, bool) and 0 < at < 95e9
    return by, float(at) if valid else None


class _Waits(Signals):
    """The head's view of Signals: every check and sleep also looks for a stop request."""

    def __init__(self, signals: Signals, look: Callable[[], None]):  # no super(): a view
        self._inner, self._look = signals, look

    @property  # type: ignore[override]
    def received(self) -> int | None:
        return self._inner.received

    @property  # type: ignore[override]
    def event(self) -> threading.Event:
        return self._inner.event

    def install(self, on_second: Callable[[int], None] | None = None) -> None:
        self._inner.install(on_second)

    def check(self) -> None:
        self._inner.check()
        self._look()

    def sleep(self, seconds: float) -> None:
        self._inner.check()
        self._look()
        self._inner.sleep(seconds)


class _NotReady(Exception):
    pass


def _preload_ray_clients() -> None:
    with contextlib.suppress(Exception):
        import ray.core.generated.gcs_service_pb2
        import ray.job_submission  # noqa: F401
