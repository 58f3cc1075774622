"""This pod's Ray node: how to start it (argv and environment), prove it healthy, stop it."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil

from podagent import process
from podagent.cluster import runstate
from podagent.config import Settings
from podagent.config.names import RAY_OWNER, ray_owner
from podagent.config.policy import RAY_AUTH_MODE, child_environ
from podagent.errors import PortInUse, RayStartError
from podagent.platform import pod
from podagent.platform.roles import Role
from podagent.ray_access import ray_compat
from podagent.report import Reporter
from podagent.waiting import Deadline
from podagent.wire import Event


def ray_executable() -> str:
    # The `ray` next to our interpreter, so Ray and podagent share one environment.
    beside = Path(sys.executable).parent / "ray"
    return str(beside) if beside.exists() else (shutil.which("ray") or "ray")


# How fast the head's GCS declares a worker node dead (Ray 2.60, ray_config_def.h; read by the
# gcs_server from RAY_<name>). Ray's defaults (a check every 3 s, 10 s timeout, 5 failures)
# let a SIGKILLed worker look alive for ~15 s, and a pod that vanished from the network (its
# checks time out instead of being refused) for ~65 s. The GCS checks each raylet with gRPC's
# standard health service, answered by the raylet's gRPC threads rather than its busy main
# loop, and checks run one after another: a node is dead after `failure_threshold` failures in
# a row, each failure taking `timeout` (or less when refused) plus `period`. With these values
# a killed node is dead after ~4 s, a vanished one after ~12 s; a live node is marked dead only
# if four checks in a row each go unanswered for 2 s (~12 s without a CPU slice for its gRPC
# threads), which a busy two-core pod does not come near. A user's own RAY_health_check_* wins.
HEALTH_CHECK_ENV = {
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "2000",
    "RAY_health_check_failure_threshold": "4",
}


# How long `ray start --head` waits for its dashboard before it fails (Ray >= 2.52 reads this;
# its default is 60 s, and before 2.52 a fixed ~20 s applies, which the head's retry covers).
# A busy pod's dashboard can take longer; podagent bounds the whole start itself.
DASHBOARD_STARTUP_ENV = "RAY_DASHBOARD_STARTUP_TIMEOUT_S"
DASHBOARD_STARTUP_TIMEOUT = "150"
AUTH_MODE = RAY_AUTH_MODE  # token or disabled (Ray 2.52 on)


@dataclass(frozen=True)
class RayPlan:
    """Everything needed to start this pod's Ray node; built once, shown, then run."""
    argv: tuple[str, ...]
    env_overrides: Mapping[str, str]  # what podagent adds to the inherited environment


def node_labels(settings: Settings, role: Role) -> dict[str, str]:
    """The labels of this pod's Ray node (`ray start --labels`, hidden while beta, with this
    syntax in every supported Ray): its RunPod pod id (else its host name) and its role. A
    label value is at most 63 letters, digits, `-`, `_` and `.`, starting and ending with a
    letter or digit (Ray's rule, Kubernetes'): one that cannot be made so is left out."""
    labels = {runstate.LABEL_ROLE: role.value}
    pod = re.sub(r"[^A-Za-z0-9_.-]", "-", settings.pod_name)[:63]
    pod = pod.strip("-_.")
    if pod:
        labels[runstate.LABEL_POD] = pod
    return labels


def auth_env(settings: Settings) -> dict[str, str]:
    """Ray's authentication for every node and client of the run, decided here and never left
    to Ray: from 2.59 a `ray start --head` that finds a token of its own (RAY_AUTH_TOKEN, a
    token file, ~/.ray/auth_token) turns token auth on by itself, so a file left on one pod
    would make its node one the others cannot reach. A cluster token: token auth (Ray 2.52 on:
    the GCS, dashboard and Jobs API refuse anyone without it); none: auth off, said so."""
    if settings.auth_token:
        return {AUTH_MODE: "token", "RAY_AUTH_TOKEN": settings.auth_token}
    ray = ray_compat.installed()
    if ray is not None and ray.has("token_auth"):
        return {AUTH_MODE: "disabled"}
    return {}  # a Ray without tokens has no mode to set


def plan(settings: Settings, role: Role, node_ip: str, num_gpus: int,
         nccl_vars: Mapping[str, str], head_ip: str | None = None) -> RayPlan:
    argv = [ray_executable(), "start"]
    if role is Role.HEAD:
        # The dashboard runs jobs for whoever reaches it: only on the cluster-private address
        # unless PODAGENT_LISTEN=all asks for every interface.
        argv += ["--head", "--port", str(settings.ray_port),
                 "--dashboard-host", pod.listen_address(settings, node_ip),
                 "--dashboard-port", str(settings.dashboard_port),
                 "--include-dashboard", "true"]
    else:
        argv += ["--address", f"{head_ip}:{settings.ray_port}"]
    argv += ["--node-ip-address", node_ip, "--num-gpus", str(num_gpus), "--disable-usage-stats"]
    if settings.ray_temp_dir:
        argv += ["--temp-dir", settings.ray_temp_dir]
    labels = node_labels(settings, role)
    if labels:
        argv += ["--labels", ",".join(f"{key}={value}" for key, value in labels.items())]
    env = dict(nccl_vars)
    if role is Role.HEAD:
        env.update({k: v for k, v in HEALTH_CHECK_ENV.items() if k not in settings.environ})
        if DASHBOARD_STARTUP_ENV not in settings.environ:
            env[DASHBOARD_STARTUP_ENV] = DASHBOARD_STARTUP_TIMEOUT
    env.update(auth_env(settings))
    if settings.debug_ray:
        # An environment entry, not a word on a shell line: the seed's `${VAR} ray start` ran a
        # command literally named RAY_DEBUG=legacy and never started Ray.
        env["RAY_DEBUG"] = "legacy"
        argv.append("--ray-debugger-external")
    # Inherited by every process this Ray starts: a later podagent on this pod tells its own
    # leftovers (stopped) from a Ray someone else started (refused, never stopped).
    env[RAY_OWNER] = ray_owner(settings)
    return RayPlan(tuple(argv), env)


# Where `ray start` records the GCS address of the last cluster it started on this machine
# (in Ray's temp dir; Ray reads it back as its "bootstrap address").
RAY_ADDRESS_FILE = "ray_current_cluster"


def forget_last_cluster(settings: Settings) -> None:
    """`ray start --head` refuses to start ("already running at ...") when that record names
    the address it is about to take and any process it can see mentions that GCS address: a
    worker of the same run that has not left yet where pods share one process table, with Ray's
    temp dir kept across a restart of the head. The head has checked that its ports are free
    itself (check_port_free), so the record of an earlier start only stands in its way."""
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(temp_dir(settings), RAY_ADDRESS_FILE))


def temp_dir(settings: Settings) -> str:
    """Ray's temp dir on this pod, as `ray start` picks it."""
    return settings.ray_temp_dir or os.path.join(
        os.environ.get("RAY_TMPDIR") or tempfile.gettempdir(), "ray")


# A Ray log line: "[2026-11-28 10:00:00,123 E 1234 1234] (raylet) file.cc:56: message"; E
# and C are errors and fatal ones.
_RAY_LOG_ERROR = re.compile(r"^\[[^\]]* [EC] \d+ \d+\] (?:\(\w+\) )?(?:\S+:\d+: )?(.+)$")
LAST_WORDS_READ = 64 * 1024  # a raylet's log can be large: only its end is read
LAST_WORDS_MAX = 300


def raylet_last_words(settings: Settings) -> str:
    """The last error line of this pod's raylet log ('' when there is none): why a raylet
    exited, as it said it (the GCS marked its node dead, a check failed)."""
    path = os.path.join(temp_dir(settings), "session_latest", "logs", "raylet.out")
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - LAST_WORDS_READ))
            text = f.read(LAST_WORDS_READ).decode(errors="replace")
    except OSError:
        return ""
    errors = [m[1] for m in map(_RAY_LOG_ERROR.match, text.splitlines()) if m]
    if not errors:
        return ""
    return "".join(c if c.isprintable() else " " for c in errors[-1]).strip()[:LAST_WORDS_MAX]


def check_port_free(address: str, port: int) -> None:
    """Bind it ourselves: the only test that cannot miss a holder."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((address, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUse(port, address, process.port_holder(port)) from None
            raise RayStartError(f"cannot bind {address}:{port}: {exc.strerror}") from None


# Without its GCS a raylet cannot shut down gracefully and ignores SIGTERM until it gives up
# (measured: still there after 10 s), so a node whose GCS is gone gets a short deadline.
DEAD_GCS_STOP_TIMEOUT = 1.0
WATCH_EVERY = 1.0  # how often a running `ray start` is watched
DASHBOARD_AGENT_PORT = 52365  # Ray's default --dashboard-agent-listen-port
# Raylets first, then everything but the GCS, then the GCS (see RayNode.stop).
RAY_STOP_ORDER = (lambda p: p.name() == "raylet", lambda p: p.name() != "gcs_server")


class RayNode:
    """`ray start` as a managed step; its daemons stay our descendants (subreaper)."""

    def __init__(self, ray_plan: RayPlan, log_path: Path, start_timeout: float):
        self.plan, self.log_path, self.start_timeout = ray_plan, log_path, start_timeout

    def start(self, watch: Callable[[float], None] | None = None) -> None:
        """Run `ray start` to its end. `watch(seconds so far)` is called every WATCH_EVERY
        while it runs; whatever it raises stops the attempt at once (the caller then stops
        what Ray had started) and is raised again."""
        env = {**child_environ(os.environ), **self.plan.env_overrides}
        started = time.monotonic()
        # Ray's daemons stay in podagent's process group, as they always have: whoever ends
        # the group (a supervisor's kill of it) ends them with podagent.
        ray_start = process.ManagedProcess("ray-start", self.plan.argv, env, self.log_path,
                                           own_session=False)
        ray_start.start()
        try:
            code = self._await(ray_start, started, watch)
        finally:
            ray_start.kill()  # given up on (timeout, or the watch said so); else a no-op
        if code is None:
            raise RayStartError(
                f"`ray start` did not finish in {self.start_timeout:g} s; "
                f"last output:\n{self.tail()}")
        if code:
            raise RayStartError(f"`ray start` exited {code}; last output:\n{self.tail()}")

    def _await(self, ray_start: process.ManagedProcess, started: float,
               watch: Callable[[float], None] | None) -> int | None:
        """The exit code, or None when the start timeout ran out."""
        while True:
            elapsed = time.monotonic() - started
            if elapsed >= self.start_timeout:
                return None
            code = ray_start.wait(min(WATCH_EVERY, self.start_timeout - elapsed))
            if code is not None:
                return code
            if watch is not None:
                watch(time.monotonic() - started)

    def tail(self, lines: int = 15) -> str:
        return process.log_tail(self.log_path, lines)

    @staticmethod
    def find_raylet(adopted_from: str | None = None, adopted: bool = False
                    ) -> psutil.Process | None:
        """This pod's raylet (one scan of the process table; then watch it by pid).

        A Ray adopted from an earlier podagent is not our descendant: it is found among this
        pod's Ray processes (those of the Ray temp dir `adopted_from`, if one is set).
        """
        return _find(lambda proc: proc.name() == "raylet", adopted_from, adopted)

    @staticmethod
    def find_dashboard(adopted_from: str | None = None, adopted: bool = False
                       ) -> psutil.Process | None:
        """This pod's Ray dashboard (the Jobs API), found as the raylet is."""
        return _find(lambda proc: process.DASHBOARD_SCRIPT in " ".join(proc.cmdline()),
                     adopted_from, adopted)

    @staticmethod
    def running(proc: psutil.Process) -> bool:
        return process.alive(proc)

    @staticmethod
    def stop(timeout: float | Deadline, adopted_from: str | None = None,
             adopted: bool = False) -> tuple[int, int]:
        """Every process this podagent started (Ray's daemons, drivers, workers), and with
        `adopted` also the Ray an earlier podagent of this run started on this pod.

        Order matters: a raylet that gets SIGTERM while its GCS still runs exits at once and
        takes its workers and agents along; signalled all together, raylet and GCS each wait
        for the other and needed SIGKILL after the deadline (measured: 0.8 s vs 10 s).
        """
        if not adopted:
            return process.stop_in_phases(RAY_STOP_ORDER, timeout, candidates=_stoppable)

        def candidates() -> list[psutil.Process]:
            found = {p.pid: p for p in _stoppable()}
            found.update({p.pid: p for p in process.pod_ray_processes(adopted_from)})
            return list(found.values())

        return process.stop_in_phases(RAY_STOP_ORDER, timeout, candidates=candidates)


def stop_timeout(settings: Settings, gcs_gone: bool) -> float:
    """How long stopping this pod's Ray may take: a node without its GCS gets a short deadline
    (DEAD_GCS_STOP_TIMEOUT)."""
    return min(settings.stop_timeout, DEAD_GCS_STOP_TIMEOUT) if gcs_gone else settings.stop_timeout


def stop_at_teardown(settings: Settings, reporter: Reporter,
                     deadline: Callable[[float], Deadline], outcome: str, gcs_gone: bool,
                     adopted: bool = False) -> None:
    """The last step of a head's or worker's teardown: stop every process podagent started
    (and with `adopted` the Ray an earlier podagent of the run left), with a report.
    `deadline(seconds)` is the teardown's: it may be shorter once a signal ends the run."""
    termed, killed = RayNode.stop(deadline(stop_timeout(settings, gcs_gone)),
                                  adopted_from=settings.ray_temp_dir, adopted=adopted)
    if termed or killed:
        extra = f", {killed} needed SIGKILL" if killed else ""
        reporter.say(f"Ray stopped ({termed + killed} processes{extra})")
    reporter.event(Event.TEARDOWN, outcome=outcome, processes=termed + killed, killed=killed)


def _find(wanted: Callable[[psutil.Process], bool], adopted_from: str | None,
          adopted: bool) -> psutil.Process | None:
    procs = (process.pod_ray_processes(adopted_from) if adopted
             else process.descendants())
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            if proc.status() != psutil.STATUS_ZOMBIE and wanted(proc):
                return proc
    return None


def _stoppable() -> list[psutil.Process]:
    """Our descendants but W&B's service: the bring-up run logs the teardown and the exit code
    through it, and stops it itself when it finishes (wandb_run.BringupRun.finish)."""

    def is_wandb_service(proc: psutil.Process) -> bool:
        try:
            return proc.name() == "wandb-core"
        except psutil.Error:
            return False

    return [p for p in process.descendants() if not is_wandb_service(p)]
