"""The reward-model server the head runs for the trainers: started, proven healthy with a real
protocol request, supervised while the job runs (restarted with backoff), stopped in teardown.

Trainers run on every node, so the URL they get is the head's cluster address, never loopback.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import requests
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_exponential

from podagent.config import Settings
from podagent.errors import RewardServerFailed, RewardServerTimeout
from podagent.process import ManagedProcess
from podagent.report import Progress, Reporter
from podagent.waiting import Signals

# A request a real trainer could send: one query whose response boxes the right answer.
PROBE_BODY = {
    "query": ["What is 1 + 1? The answer is \\boxed{2}"],
    "prompts": ["What is 1 + 1?"],
    "labels": ["2"],
}
PROBE_TIMEOUT = 30.0  # a busy server answering trainers may be slow: slow is not dead
SUPERVISE_INTERVAL = 5.0
FAILED_PROBES_BEFORE_RESTART = 3
TAIL_LINES = 30


class _NotYet(Exception):
    pass


class RewardServer:
    def __init__(self, settings: Settings, host_ip: str, run_dir: Path, reporter: Reporter,
                 env: Mapping[str, str]):
        self.s, self.host_ip, self.reporter = settings, host_ip, reporter
        self.url = f"http://{host_ip}:{settings.reward_port}/get_reward"
        argv = settings.reward_cmd if settings.reward == "cmd" else (
            sys.executable, "-m", "podagent.rewards",
            "--host", host_ip, "--port", str(settings.reward_port))
        env = {**os.environ, **env, "PODAGENT_REWARD_HOST": host_ip,
               "PODAGENT_REWARD_PORT": str(settings.reward_port)}
        self.process = ManagedProcess("reward", tuple(argv or ()), env, run_dir / "reward.log")
        self.restarts = 0
        self.failure: RewardServerFailed | None = None
        self._stop = threading.Event()
        self._supervisor: threading.Thread | None = None

    @property
    def label(self) -> str:
        return "built-in reward server" if self.s.reward == "builtin" else "reward server"

    def start(self) -> None:
        self.process.start()

    def exited(self) -> int | None:
        return self.process.poll()

    def died_error(self, code: int, when: str) -> RewardServerFailed:
        return RewardServerFailed(
            f"{self.label} exited with code {code} {when}; last lines of "
            f"{self.process.log_path}:\n{self.process.tail(TAIL_LINES)}")

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
        last = {"error": "not probed yet"}

        def attempt() -> None:
            code = self.exited()
            if code is not None:
                raise self.died_error(code, "while starting")
            try:
                self.probe(timeout=min(PROBE_TIMEOUT, 10.0))
            except (requests.RequestException, ValueError) as exc:
                last["error"] = str(exc)
                progress(f"waiting for the {self.label} at {self.url}: {exc} "
                         f"({time.monotonic() - started:.0f} s)")
                raise _NotYet(str(exc)) from None

        try:
            Retrying(stop=stop_after_delay(self.s.reward_timeout),
                     wait=wait_exponential(multiplier=0.1, max=2.0),
                     retry=retry_if_exception_type(_NotYet), sleep=signals.sleep,
                     reraise=True)(attempt)
        except _NotYet:
            raise RewardServerTimeout(
                f"the {self.label} did not answer a real request at {self.url} within "
                f"{self.s.reward_timeout:g} s; last error: {last['error']}; last lines of "
                f"{self.process.log_path}:\n{self.process.tail(TAIL_LINES)}") from None

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
                        self.reporter.event("reward_recovered", restarts=self.restarts)
                    failed_probes, loading_until = 0, 0.0
                    continue
            else:
                why = f"exited with code {code}"
            failed_probes = 0
            if not self._restart(why):
                return
            loading_until = time.monotonic() + self.s.reward_timeout

    def _restart(self, why: str) -> bool:
        if self.restarts >= self.s.reward_restarts:
            self.failure = RewardServerFailed(
                f"the {self.label} {why}, and all {self.s.reward_restarts} restarts are spent; "
                f"last lines of {self.process.log_path}:\n{self.process.tail(TAIL_LINES)}")
            self.reporter.error(f"{self.label} {why}: no restarts left, failing the run")
            self.reporter.event("reward_failed", why=why, restarts=self.restarts)
            return False
        self.restarts += 1
        backoff = min(30.0, 2.0 ** self.restarts)
        self.reporter.error(f"{self.label} {why}: restarting it in {backoff:g} s "
                            f"(restart {self.restarts} of {self.s.reward_restarts})")
        self.reporter.event("reward_restart", why=why, restart=self.restarts)
        self.process.stop(self.s.stop_timeout)
        if self._stop.wait(backoff):
            return False
        self.process.start()
        return True

    def stop(self) -> None:
        self._stop.set()
        if self._supervisor:
            self._supervisor.join(timeout=self.s.stop_timeout + PROBE_TIMEOUT)
        self.process.stop(self.s.stop_timeout)
