"""The head's own Ray: started (or adopted), proven healthy, watched while the job runs.

The GCS is what workers need, so `start` returns once it answers; the dashboard (Jobs API)
comes up seconds later and is awaited in a background thread while the workers join.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections.abc import Callable

import psutil
import requests

from podagent.cluster import ray_node, runstate
from podagent.cluster.jobs import JobRunner
from podagent.cluster.node import NodeSetup
from podagent.config import Settings
from podagent.errors import DashboardSilent, GcsLost, RayDied, RayStartError
from podagent.ray_access import ray_compat
from podagent.ray_access.gcs import GcsClient, GcsUnavailable, NodeInfo
from podagent.report import Reporter
from podagent.waiting import Backoff, NotYet, Signals, retry
from podagent.wire import Event

RAY_START_TIMEOUT = 180.0  # `ray start` plus the first healthy probes; Ray needs ~5-20 s
RAY_START_ATTEMPTS = 3
# Before Ray 2.52 the dashboard gets a fixed ~20 s to start, which a busy pod can miss more
# than once in a row (seen on two cores under load): more attempts where that deadline is fixed.
RAY_START_ATTEMPTS_FIXED_DEADLINE = 5
OWN_RAY_GRACE = 5.0  # a GCS busy for a moment is not dead
PROBE_MAX_WAIT = 0.1  # readiness probes of local ports: a refused connection costs nothing
WATCH_INTERVAL = 1.0
TEARDOWN_PROBE_TIMEOUT = 1.0  # a pod being stopped has seconds, not minutes
ANNOUNCE_TIMEOUT = 1.0


class HeadRay:
    """This pod's Ray as the head: started or adopted, proven healthy, watched, stopped."""

    def __init__(self, settings: Settings, setup: NodeSetup, reporter: Reporter,
                 signals: Signals, submission_id: str = ""):
        self.settings, self.setup = settings, setup
        self.reporter, self.signals = reporter, signals
        self.submission_id = submission_id or settings.run_name  # the job's id in Ray
        self.gcs: GcsClient | None = None
        self.adopted = False  # an earlier podagent of this run started it (see reattach)
        self.up = False  # its GCS has answered (started or adopted): it can be watched
        self._jobs_api: concurrent.futures.Future[JobRunner] | None = None
        self._giving_up = threading.Event()  # the run ends: the Jobs API probe gives up
        self._raylet: psutil.Process | None = None
        self._dashboard: psutil.Process | None = None
        self._unhealthy_since: float | None = None

    @property
    def address(self) -> str:
        return f"{self.setup.node_ip}:{self.settings.ray_port}"

    @property
    def dashboard_url(self) -> str:
        return f"http://{self.setup.node_ip}:{self.settings.dashboard_port}"

    # --- start or adopt ------------------------------------------------------------------------

    def start(self) -> None:
        # Importing Ray's job client and node messages takes ~1 s of CPU: do it while
        # `ray start` runs, instead of after the workers joined.
        threading.Thread(target=preload_ray_clients, name="preload", daemon=True).start()
        with self.reporter.step(Event.RAY_HEAD) as step:
            self._ray_start()
            gcs = self.gcs = GcsClient(self.address, metadata=self.settings.grpc_metadata())
            self._probe_until(lambda: gcs.check_alive(timeout=2.0), "the GCS health RPC",
                              self.signals.sleep)
            self._mark_start(gcs)
            self.up = True
            step.done(f"Ray head up at {self.address} (GCS answers)", address=self.address)
        self._connect_jobs_api_in_background()

    def _mark_start(self, gcs: GcsClient) -> None:
        """This start's id, for the workers to tell this Ray from an earlier one at the same
        address (runstate.KV_HEAD_START); a worker that joins before it is written takes the
        first id it sees."""
        try:
            gcs.kv_put(runstate.KV_NAMESPACE, runstate.KV_HEAD_START,
                            runstate.head_start(), timeout=ANNOUNCE_TIMEOUT * 5)
        except GcsUnavailable as exc:
            raise RayStartError(f"this pod's Ray GCS did not take the head's start id: {exc}"
                                ) from None

    def adopt(self, gcs: GcsClient) -> None:
        """Take over the Ray an earlier podagent of this run left running (the one place the
        head keeps that it re-attached)."""
        self.gcs, self.adopted, self.up = gcs, True, True
        # Ray's modules are imported here, before the Jobs API thread imports them too: two
        # threads importing Ray at once can see a partly initialised module (ImportError).
        preload_ray_clients()
        self._connect_jobs_api_in_background()

    def _ray_start(self) -> None:
        """`ray start --head`, retried a bounded number of times: on a busy pod Ray can miss a
        start-up deadline of its own (before 2.52 its dashboard gets a fixed 20 s) and succeed
        on the next attempt, as a worker's join does."""
        failures: list[RayStartError] = []
        ray = ray_compat.installed()
        allowed = (RAY_START_ATTEMPTS if ray is None or ray.has("dashboard_startup_timeout")
                   else RAY_START_ATTEMPTS_FIXED_DEADLINE)

        def attempt() -> None:
            try:
                ray_node.RayNode(self.setup.plan, self.settings.run_dir / "ray-start-head.log",
                                 RAY_START_TIMEOUT).start()
            except RayStartError as exc:
                failures.append(exc)
                if len(failures) < allowed:
                    last = str(exc).strip().splitlines()[-1] if str(exc).strip() else "?"
                    self.reporter.warn(f"starting Ray failed (attempt {len(failures)} of "
                                       f"{allowed}): {last}; stopping what it "
                                       f"started and trying again")
                    ray_node.RayNode.stop(self.settings.stop_timeout)
                raise

        # The last attempt's own error, when none succeeded.
        retry(attempt, awaited="`ray start --head` to succeed", backoff=Backoff.every(1.0),
              attempts=allowed, sleep=self.signals.sleep, on=(RayStartError,),
              expired=lambda _: failures[-1])

    # --- the Jobs API, awaited in the background -----------------------------------------------

    def _connect_jobs_api_in_background(self) -> None:
        self._jobs_api = concurrent.futures.ThreadPoolExecutor(1, "jobs-api").submit(
            self._connect_jobs_api)

    def _connect_jobs_api(self) -> JobRunner:
        self._probe_until(self._dashboard_answers, "the dashboard's /api/version",
                          self._sleep_unless_giving_up)
        try:
            return JobRunner(self.dashboard_url, self.submission_id, self.reporter,
                             self.settings.run_dir / "job.log",
                             headers=self.settings.auth_headers(),
                             check=not self.settings.job)
        except Exception as exc:  # Ray's client raises plain exceptions of several kinds
            raise RayStartError(f"the Jobs API at {self.dashboard_url} refused a client: "
                                f"{exc}") from None

    def jobs_api(self) -> JobRunner:
        """The job client, once the dashboard answers (a step only when it had to be awaited)."""
        connecting = self._jobs_api
        if connecting is None:
            raise RuntimeError("the Jobs API is asked for before this pod's Ray is up")
        if connecting.done():
            self.reporter.say(f"dashboard answers at {self.dashboard_url}")
            return connecting.result()
        with self.reporter.step(Event.DASHBOARD_READY) as step:
            while not connecting.done():
                self.signals.sleep(0.02)
            runner = connecting.result()
            step.done(f"dashboard answers at {self.dashboard_url}")
        return runner

    def _sleep_unless_giving_up(self, seconds: float) -> None:
        # The background probe must end with the run: Python joins its thread at exit.
        if self._giving_up.wait(seconds):
            raise RayStartError("the head is closing the run")

    # --- probes --------------------------------------------------------------------------------

    def _dashboard_answers(self) -> None:
        if self._dashboard_exited():  # it will never answer: no need to wait it out
            raise RayStartError(f"this pod's Ray dashboard exited before it answered at "
                                f"{self.dashboard_url}; see Ray's logs in its temp dir")
        reply = requests.get(f"{self.dashboard_url}/api/version", timeout=2.0,
                             headers=self.settings.auth_headers())
        reply.raise_for_status()

    def _dashboard_exited(self) -> bool:
        """The dashboard's process was seen and is gone (it has none yet while Ray starts)."""
        self._dashboard = self._dashboard or ray_node.RayNode.find_dashboard(
            adopted_from=self.settings.ray_temp_dir, adopted=self.adopted)
        return self._dashboard is not None and not ray_node.RayNode.running(self._dashboard)

    def _probe_until(self, probe: Callable[[], None], what: str,
                     sleep: Callable[[float], None]) -> None:
        """Retry a readiness probe until RAY_START_TIMEOUT; the error says what and why."""

        def attempt() -> None:
            try:
                probe()
            except (GcsUnavailable, requests.RequestException) as exc:
                raise NotYet(str(exc)) from None

        retry(attempt, awaited=what, backoff=Backoff(0.02, PROBE_MAX_WAIT),
              deadline=RAY_START_TIMEOUT, sleep=sleep,
              expired=lambda out: RayStartError(
                  f"Ray head started but {what} did not answer within {RAY_START_TIMEOUT:g} "
                  f"s; last error: {out.seen}"))

    # --- while it runs -------------------------------------------------------------------------

    def _answered(self) -> GcsClient:
        """The GCS client, once this pod's Ray was started or adopted."""
        if self.gcs is None:
            raise RuntimeError("this pod's Ray was neither started nor adopted")
        return self.gcs

    def nodes(self) -> list[NodeInfo]:
        """The node table; a GCS that stopped answering is GcsLost."""
        try:
            return self._answered().nodes(timeout=5.0)
        except GcsUnavailable as exc:
            raise GcsLost(f"this pod's Ray GCS stopped answering: {exc}") from None

    def registered(self) -> int:
        """How many nodes the table holds, alive and dead (one cheap read: the census asks it
        before each read of the table while the head waits)."""
        try:
            return self._answered().registered(timeout=2.0)
        except GcsUnavailable as exc:
            raise GcsLost(f"this pod's Ray GCS stopped answering: {exc}") from None

    def alive_workers(self) -> list[NodeInfo]:
        return [n for n in self.nodes() if n.alive and not n.is_head]

    def watch(self, now: float) -> set[str] | None:
        """One health check of this pod's Ray: the ids of the workers alive, or None when the
        GCS did not answer this time. Raises RayDied (DashboardSilent for the dashboard) once
        a part has been unwell for the grace. `now`: successive calls' monotonic time."""
        gcs = self._answered()
        error: type[RayDied] = RayDied
        try:
            gcs.check_alive(timeout=WATCH_INTERVAL)
            self._raylet = self._raylet or ray_node.RayNode.find_raylet(
                adopted_from=self.settings.ray_temp_dir, adopted=self.adopted)
            raylet_ok = self._raylet is not None and ray_node.RayNode.running(self._raylet)
            problem = "" if raylet_ok else "this pod's raylet exited"
            if not problem and self._dashboard_exited():
                # Ray does not start it again: the job could be neither followed nor stopped.
                problem, error = "this pod's Ray dashboard (the Jobs API) exited", DashboardSilent
            alive: set[str] | None = {n.node_id for n in self.alive_workers()}
        except (GcsUnavailable, GcsLost) as exc:
            problem, alive = f"the GCS does not answer ({exc})", None
        if not problem:
            self._unhealthy_since = None
        else:
            self._unhealthy_since = self._unhealthy_since or now
            if now - self._unhealthy_since > OWN_RAY_GRACE:
                raise error(f"this pod's Ray stopped working (for over {OWN_RAY_GRACE:g} s): "
                            f"{problem}")
        return alive

    # --- the end -------------------------------------------------------------------------------

    def silent(self) -> bool:
        """At the end: the GCS was started but does not answer now. Then the Jobs API cannot
        stop the job and the workers cannot be told (each call would only wait out its
        timeout): teardown goes straight to stopping Ray."""
        if self.gcs is None:
            return False
        try:
            self.gcs.check_alive(timeout=TEARDOWN_PROBE_TIMEOUT)
        except GcsUnavailable:
            return True
        return False

    def stop_awaiting_jobs_api(self) -> None:
        """The run ends: the background Jobs API probe gives up."""
        self._giving_up.set()

    def tell_workers_closing(self, outcome: str, job_status: str | None,
                             after_run: str) -> None:
        """Tell the workers this is an orderly end and what they do next."""
        with contextlib.suppress(GcsUnavailable):
            self._answered().kv_put(runstate.KV_NAMESPACE, runstate.KV_RUN_STATE,
                                    runstate.closing(outcome, job_status, after_run),
                                    timeout=ANNOUNCE_TIMEOUT)

    def close_gcs_client(self) -> None:
        if self.gcs:
            self.gcs.close()


def preload_ray_clients() -> None:
    with contextlib.suppress(Exception):
        import ray.core.generated.gcs_service_pb2
        import ray.job_submission  # noqa: F401
