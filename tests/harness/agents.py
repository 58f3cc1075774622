"""Run the real podagent entrypoint inside a test pod, configured only by environment variables,
as a RunPod template would set them."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import BinaryIO

from podagent.config.fields import path_component
from tests.harness.pods import DnsServer, Pod, wait_for

OWN_LINE = re.compile(r"\[[a-z][\w-]*\] ")  # podagent's lines start with its role
# Variables a test must not inherit from the machine it runs on.
_SCRUB_PREFIXES = ("RAY_", "PODAGENT_", "RUNPOD_", "NCCL_", "GLOO_", "WANDB_")
_SCRUB_NAMES = {"HEAD_POD_ID", "NODE_RANK", "PRIMARY_ADDR", "NUM_NODES", "NODE_ADDR",
                "EXPECTED_WORKERS", "DEBUG_RAY", "CUDA_VISIBLE_DEVICES"}


def pod_run_dir(log_dir: Path | str, run: str, pod: str) -> Path:
    """A pod's own directory of a run, by podagent's rule (config.Settings.run_dir): under
    the run's, named after the pod (its RUNPOD_POD_ID, else its host name)."""
    return Path(log_dir) / run / path_component(pod)


def clean_environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if not k.startswith(_SCRUB_PREFIXES) and k not in _SCRUB_NAMES}


class Agent:
    """One podagent process in one pod; output goes to a file the test can read while it runs."""

    def __init__(self, pod: Pod, dns: DnsServer, log_root: Path, env: Mapping[str, str],
                 argv: tuple[str, ...] = ()):
        self.pod, self.dns = pod, dns
        self.start_no = 1  # the how-manieth podagent of this pod (see restarted)
        self.out_path = log_root / f"{pod.name}.out"
        # Short and unique: Ray puts unix sockets under its temp dir (108-byte limit).
        self.ray_tmp = f"/tmp/pae-{uuid.uuid4().hex[:6]}-{pod.name[:8]}"
        self.env = {
            **clean_environ(),
            "RUNPOD_POD_ID": pod.pod_id,
            "PODAGENT_DNS_SERVER": f"{dns.address}:{dns.port}",
            "PODAGENT_RAY_TEMP_DIR": self.ray_tmp,
            "PODAGENT_LOG_DIR": str(log_root / pod.name),
            "PODAGENT_RUN_NAME": "e2e",
            # RUNPOD_POD_ID is set, so podagent's default would be to stay up after the run
            # (as on RunPod, where an exit restarts the container): tests expect exits.
            "PODAGENT_AFTER_RUN": "exit",
            "PYTHONUNBUFFERED": "1",
            **env,
        }
        self.argv = (sys.executable, "-m", "podagent", *argv)
        self.cwd: str | None = None  # where podagent starts (None: this process's own)
        self.proc: subprocess.Popen | None = None
        self._out: BinaryIO | None = None

    def restarted(self, env: Mapping[str, str] | None = None) -> Agent:
        """podagent started again in the same pod, as RunPod restarts a container: the same
        environment (plus `env`), log dir and Ray temp dir; its output goes to a file of its
        own (<pod>.out.2, .3, ...). Not started."""
        again = Agent(self.pod, self.dns, self.out_path.parent, {})
        again.env = {**self.env, **(env or {})}
        again.ray_tmp = self.ray_tmp
        again.argv = self.argv
        again.cwd = self.cwd
        again.start_no = self.start_no + 1
        again.out_path = self.out_path.with_name(f"{self.pod.name}.out.{again.start_no}")
        return again

    def start(self) -> Agent:
        self._out = open(self.out_path, "wb")
        self.proc = self.pod.popen(list(self.argv), env=self.env, stdout=self._out,
                                   stderr=subprocess.STDOUT, cwd=self.cwd)
        return self

    @property
    def run_dir(self) -> Path:
        """This pod's own directory of the run."""
        return pod_run_dir(self.env["PODAGENT_LOG_DIR"], self.env["PODAGENT_RUN_NAME"],
                           self.env["RUNPOD_POD_ID"])

    @property
    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def said(self, limit: int = 3000) -> str:
        """podagent's own lines (`[<role>] ...`), then the output's tail: a failure's line
        is not lost behind the many lines a Ray or a job printed after it."""
        output = self.output
        own = [line for line in output.splitlines() if OWN_LINE.match(line)]
        return ("\n".join(own)[-limit:] + f"\n--- last of the output ---\n{output[-limit:]}")

    def wait_output(self, text: str, timeout: float) -> None:
        def seen() -> bool:
            if text in self.output:
                return True
            if self.proc and self.proc.poll() is not None:
                raise AssertionError(f"{self.pod.name} exited {self.proc.returncode} before "
                                     f"printing {text!r}:\n{self.said()}")
            return False

        wait_for(seen, timeout=timeout, interval=0.2,
                 what=f"{self.pod.name} to print {text!r}")

    def wait_exit(self, timeout: float) -> int:
        assert self.proc
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.pod.name} still running after {timeout} s:\n"
                                 f"{self.output[-3000:]}") from None

    def kill_pod(self) -> None:
        """The pod dies: every process in its namespace gets SIGKILL at once."""
        for pid in self.pod.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def pod_processes(self, name: str) -> list[int]:
        """This pod's processes named `name` (their comm, as `ps` shows it)."""
        found = []
        for pid in self.pod.pids():
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/comm").read_text().strip() == name:
                    found.append(pid)
        return found

    def freeze_pod(self, frozen: bool = True) -> None:
        """The pod stops getting any CPU (SIGSTOP to every process in it), as a host too loaded
        to run it, or running again (SIGCONT)."""
        for pid in self.pod.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP if frozen else signal.SIGCONT)

    def close(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        if self._out is not None:
            self._out.close()
        shutil.rmtree(self.ray_tmp, ignore_errors=True)


def wait_exits(agents: Sequence[Agent], timeout: float) -> list[int]:
    """Each agent's exit code, all within one deadline. One still running fails the test with
    what every pod said: the pod that hangs is often waiting on another that went wrong."""
    deadline = time.monotonic() + timeout
    codes = []
    for agent in agents:
        assert agent.proc
        try:
            codes.append(agent.proc.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{agent.pod.name} still running after {timeout} s; what each pod said:\n"
                + "\n\n".join(f"=== {a.pod.name} (exit {a.proc.poll() if a.proc else None})"
                                f" ===\n{a.said(2000)}" for a in agents)) from None
    return codes


def form_cluster(make_pod, dns_server, tmp_path: Path, agents: list[Agent], workers: int,
                 head_env: Mapping[str, str] | None = None,
                 worker_env: Mapping[str, str] | None = None,
                 register_head: bool = True) -> tuple[Agent, list[Agent]]:
    """A head pod and N worker pods, each with an Agent (not started) sharing HEAD_POD_ID."""
    head_pod = make_pod("head", register=register_head)
    worker_pods = [make_pod(f"w{i}", register=True) for i in range(1, workers + 1)]

    def agent(pod: Pod, env: Mapping[str, str]) -> Agent:
        a = Agent(pod, dns_server, tmp_path, {"HEAD_POD_ID": head_pod.pod_id, **env})
        agents.append(a)
        return a

    head = agent(head_pod, head_env or {})
    return head, [agent(p, worker_env or {}) for p in worker_pods]
