"""The reward-model server the head runs for the trainers: started, proven healthy with a real
protocol request, supervised while the job runs (restarted with backoff), stopped in teardown.

Trainers run on every node, so the URL they get is the head's cluster address, never loopback.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil
import requests

from podagent import process
from podagent.config import Settings
from podagent.config.fields import FIELD_BY_ATTR, FIELDS, REWARD_FIELD_BY_ATTR
from podagent.config.policy import CLUSTER_TOKEN, child_environ, is_secret
from podagent.errors import RewardServerFailed, RewardServerTimeout
from podagent.platform import pod
from podagent.process import ManagedProcess, stop_processes
from podagent.report import Progress, Reporter
from podagent.waiting import Backoff, Deadline, Expired, NotYet, Signals, interruptible, retry
from podagent.wire import Event

# A request a real trainer could send: one query whose response boxes the right answer.
PROBE_BODY = {
    "query": ["What is 1 + 1? The answer is \\boxed{2}"],
    "prompts": ["What is 1 + 1?"],
    "labels": ["2"],
}
PROBE_TIMEOUT = 30.0  # a busy server answering trainers may be slow: slow is not dead
SUPERVISE_INTERVAL = 5.0
FAILED_PROBES_BEFORE_RESTART = 3
SUPERVISOR_JOIN = 1.0  # its probe may be in flight; the process is stopped either way
TAIL_LINES = 30
ADOPTED_EXIT_UNKNOWN = -1000  # an adopted server's exit status cannot be read (not our child)


def _listener(port: int) -> psutil.Process | None:
    """The process that listens on `port` in this network namespace (the oldest, if a server
    forked workers that share its socket)."""
    with contextlib.suppress(psutil.Error, OSError):
        pids = {c.pid for c in psutil.net_connections(kind="tcp")
                if c.pid and c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN}
        procs = []
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                procs.append(psutil.Process(pid))
        roots = [p for p in procs if p.ppid() not in pids]
        return min(roots or procs, key=lambda p: p.create_time(), default=None)
    return None


def forwarded(settings: Settings, listen_host: str) -> dict[str, str]:
    """The head's settings of the reward server as the server's own variables: every field the
    two share (Field.server), by its variable, so that a flag given to the head reaches the
    server (a custom PODAGENT_REWARD=cmd server may read them as well); and where to listen."""
    env = {REWARD_FIELD_BY_ATTR["host"].env: listen_host}
    for f in FIELDS:
        value = getattr(settings, f.attr)
        if f.server is None or value is None:
            continue
        if f.attr == "reward_func" and settings.reward != "func":
            continue  # only PODAGENT_REWARD=func serves a file, whatever the environment says
        env[f.env] = ("1" if value else "0") if isinstance(value, bool) else str(value)
    return env


def asked(settings: Settings) -> dict[str, Any]:
    """How this run asks the built-in server to score, as the server's /health says it."""
    if settings.reward == "func":
        return {"scoring": "func", "func": str(Path(str(settings.reward_func)).resolve())}
    if settings.reward_scoring == "openrlhf-m":
        return {"scoring": "openrlhf-m", "template": settings.reward_template,
                "strict": settings.reward_strict}
    return {"scoring": settings.reward_scoring}


class RewardServer:
    """The built-in reward server as the head's child process: started with the head's
    reward settings, proven with a real request, watched, and stopped (TERM, deadline, KILL)."""

    def __init__(self, settings: Settings, host_ip: str, run_dir: Path, reporter: Reporter,
                 env: Mapping[str, str]):
        self.settings, self.host_ip, self.reporter = settings, host_ip, reporter
        # Trainers call the cluster address; the server listens there only, unless
        # PODAGENT_LISTEN=all opens every interface.
        self.url = f"http://{host_ip}:{settings.reward_port}/get_reward"
        self.listen_host = pod.listen_address(settings, host_ip)
        server = REWARD_FIELD_BY_ATTR
        argv = settings.reward_cmd if settings.reward == "cmd" else (
            sys.executable, "-m", "podagent.rewards", server["host"].flag, self.listen_host,
            server["port"].flag, str(settings.reward_port))
        # Built-in: no secret at all (it runs sympy on model output); the user's own code (a
        # reward_func file, a server) may need theirs (a model hub's token, a judge's key),
        # never the cluster token.
        drop = is_secret if settings.reward == "builtin" else CLUSTER_TOKEN.__contains__
        inherited = child_environ(os.environ, drop)
        # Only PODAGENT_REWARD=func serves a file, whatever the environment says.
        inherited.pop(FIELD_BY_ATTR["reward_func"].env, None)
        env = {**inherited, **env, **forwarded(settings, self.listen_host)}
        self.process = ManagedProcess("reward", tuple(argv or ()), env, run_dir / "reward.log")
        # A server an earlier podagent of this run started, kept on re-attach (not our child).
        self.adopted: psutil.Process | None = None
        self.restarts = 0
        self.failure: RewardServerFailed | None = None
        self._stop = threading.Event()
        self._supervisor: threading.Thread | None = None

    @property
    def label(self) -> str:
        return {"builtin": "built-in reward server",
                "func": "reward server (reward_func file)"}.get(self.settings.reward,
                                                                "reward server")

    @property
    def scoring(self) -> str:
        """What the built-in server scores by, in a few words."""
        from podagent.rewards.settings import describe

        settings = self.settings
        return describe(settings.reward_scoring, settings.reward_template, settings.reward_strict,
                        settings.reward_func if settings.reward == "func" else None)

    def start(self) -> None:
        if self.settings.reward in ("builtin", "func"):
            self.reporter.say(f"{self.label} scoring: {self.scoring}")
            self.reporter.event(Event.REWARD_SCORING, **asked(self.settings))
        self.process.start()

    def keep_or_start(self, reattached: bool) -> None:
        """On re-attach, keep a server of this run that still answers; otherwise start one."""
        if reattached and self.adopt():
            if self.adopted:
                self.reporter.say(f"{self.label} still answers at {self.url} "
                                  f"(pid {self.adopted.pid}): keeping it")
            else:
                self.reporter.warn(f"{self.label} still answers at {self.url}, "
                                   f"but its process is not visible from here: keeping it; "
                                   f"podagent cannot stop it at the end")
            return
        self.start()
        self.reporter.say(f"{self.label} starting for {self.url} "
                          f"(log: {self.process.log_path})")

    def adopt(self) -> bool:
        """Keep a server that still answers a real request (an earlier podagent of this run
        started it and it outlived that podagent). False when nothing answers."""
        try:
            self.probe(timeout=10.0)
        except (requests.RequestException, ValueError):
            return False
        self.adopted = _listener(self.settings.reward_port)
        if self.settings.reward in ("builtin", "func"):
            self._say_adopted_scoring()
        return True

    def _say_adopted_scoring(self) -> None:
        """The kept server scores as it was started: say how, and whether that is what this
        run asks for."""
        try:
            health = requests.get(self.url.replace("/get_reward", "/health"), timeout=10).json()
        except (requests.RequestException, ValueError):
            return
        if not isinstance(health, dict):
            return
        kept = health.get("scoring")
        if all(health.get(key) == value for key, value in asked(self.settings).items()):
            self.reporter.say(f"{self.label} scoring: {self.scoring}")
        else:
            self.reporter.warn(f"{self.label} kept from before scores with {kept} "
                               f"(template {health.get('template')}, strict "
                               f"{health.get('strict')}), not {self.scoring}: "
                               f"stop the run to change it")

    def exited(self) -> int | None:
        if self.adopted is not None:
            # Not our child: its exit status is not ours to read.
            return None if process.alive(self.adopted) else ADOPTED_EXIT_UNKNOWN
        return self.process.poll()

    def _exit_text(self, code: int) -> str:
        return "exited" if code == ADOPTED_EXIT_UNKNOWN else f"exited with code {code}"

    def died_error(self, code: int, when: str) -> RewardServerFailed:
        return RewardServerFailed(
            f"{self.label} {self._exit_text(code)} {when}; last lines of "
            f"{self.process.log_path}:\n{self.process.tail(TAIL_LINES)}")

    def _stop_process(self, timeout: float | Deadline) -> None:
        if self.adopted is not None:
            tree = [self.adopted]
            with contextlib.suppress(psutil.Error):
                tree += self.adopted.children(recursive=True)
            stop_processes(tree, timeout)
            self.adopted = None
        self.process.stop(timeout)

    def probe(self, timeout: float = PROBE_TIMEOUT) -> None:
        """One real protocol request: 200, JSON, one numeric reward per query."""
        reply = requests.post(self.url, json=PROBE_BODY, timeout=timeout)
        if reply.status_code != 200:
            raise ValueError(f"HTTP {reply.status_code}: {reply.text[:200]}")
        rewards = reply.json().get("rewards")
        if not (isinstance(rewards, list) and len(rewards) == len(PROBE_BODY["query"])
                and all(isinstance(r, (int, float)) for r in rewards)):
            raise ValueError(f"'rewards' is not one number per query: {rewards!r:.200}")

    def wait_healthy(self, signals: Signals) -> None:
        """Until a real request succeeds; an exit while starting fails at once."""
        progress = Progress(self.reporter, every=10.0)
        started = time.monotonic()

        def attempt() -> None:
            code = self.exited()
            if code is not None:
                raise self.died_error(code, "while starting")
            try:
                # A reward server that hangs must not hold a signal up for the probe's timeout.
                interruptible(lambda: self.probe(timeout=min(PROBE_TIMEOUT, 10.0)), signals)
            except (requests.RequestException, ValueError) as exc:
                progress(f"waiting for the {self.label} at {self.url}: {exc} "
                         f"({time.monotonic() - started:.0f} s)")
                raise NotYet(str(exc)) from None

        def timed_out(expired: Expired) -> RewardServerTimeout:
            return RewardServerTimeout(
                f"the {self.label} did not answer a real request at {self.url} within "
                f"{self.settings.reward_timeout:g} s; last error: {expired.seen}; last lines of "
                f"{self.process.log_path}:\n{self.process.tail(TAIL_LINES)}")

        retry(attempt, awaited=f"the {self.label} to answer a real request",
              backoff=Backoff(0.1, 2.0), deadline=self.settings.reward_timeout,
              sleep=signals.sleep, expired=timed_out)
        self._report_dataset()

    def _report_dataset(self) -> None:
        """The built-in server's audit of the dataset's gold answers (rewards/audit.py): an
        event always, a warning when some cannot be read."""
        if self.settings.reward == "cmd":
            return
        try:
            health = requests.get(self.url.replace("/get_reward", "/health"),
                                  timeout=PROBE_TIMEOUT).json()
        except (requests.RequestException, ValueError):
            return  # the server answered a real request: its audit is a nicety, not a gate
        found = health.get("dataset_audit") if isinstance(health, dict) else None
        if not isinstance(found, dict):
            return
        self.reporter.event(Event.REWARD_DATASET, **{k: v for k, v in found.items() if k != "line"})
        if found.get("line"):
            self.reporter.warn(str(found["line"]))

    # --- while the job runs --------------------------------------------------------------------

    def supervise(self) -> None:
        """Watch it in a thread; the head's loop raises `failure` once restarts are spent."""
        self._supervisor = threading.Thread(target=self._watch, name="reward", daemon=True)
        self._supervisor.start()

    def _watch(self) -> None:
        failed_probes = 0
        loading_until = 0.0  # a restarted server gets reward_timeout to load before probes count
        while not self._stop.wait(SUPERVISE_INTERVAL):
            code = self.exited()
            if code is None:
                try:
                    self.probe()
                except (requests.RequestException, ValueError) as exc:
                    if time.monotonic() < loading_until:
                        continue
                    failed_probes += 1
                    if failed_probes < FAILED_PROBES_BEFORE_RESTART:
                        continue
                    why = f"stopped answering ({failed_probes} probes failed; last: {exc})"
                else:
                    if loading_until:
                        self.reporter.say(f"{self.label} answers again at {self.url}")
                        self.reporter.event(Event.REWARD_RECOVERED, restarts=self.restarts)
                    failed_probes, loading_until = 0, 0.0
                    continue
            else:
                why = self._exit_text(code)
            failed_probes = 0
            if not self._restart(why):
                return
            loading_until = time.monotonic() + self.settings.reward_timeout

    def _restart(self, why: str) -> bool:
        if self.restarts >= self.settings.reward_restarts:
            self.failure = RewardServerFailed(
                f"the {self.label} {why}, and all {self.settings.reward_restarts} restarts are "
                f"spent; "
                f"last lines of {self.process.log_path}:\n{self.process.tail(TAIL_LINES)}")
            self.reporter.error(f"{self.label} {why}: no restarts left, failing the run")
            self.reporter.event(Event.REWARD_FAILED, why=why, restarts=self.restarts)
            return False
        self.restarts += 1
        backoff = min(30.0, 2.0 ** self.restarts)
        self.reporter.error(f"{self.label} {why}: restarting it in {backoff:g} s "
                            f"(restart {self.restarts} of {self.settings.reward_restarts})")
        self.reporter.event(Event.REWARD_RESTART, why=why, restart=self.restarts)
        self._stop_process(self.settings.stop_timeout)
        if self._stop.wait(backoff):
            return False
        self.process.start()
        return True

    def stop(self, timeout: float | Deadline | None = None) -> None:
        """TERM -> deadline (PODAGENT_STOP_TIMEOUT, or `timeout` when the pod is being
        stopped and has seconds) -> KILL."""
        deadline = Deadline.of(self.settings.stop_timeout if timeout is None else timeout)
        self._stop.set()
        if self._supervisor:  # a daemon thread, mid-probe perhaps: not waited for long
            self._supervisor.join(timeout=min(deadline.left(), SUPERVISOR_JOIN))
        self._stop_process(deadline)
