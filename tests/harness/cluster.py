"""A cluster of pods for a benchmark: N+1 registered pods on a fresh network with its own DNS
server, podagent started in each (agents.py) or Ray run by hand in them, and every process of
a pod killed at the end.

All pods share this machine's PID namespace and file system; only the network is private. So
nothing here runs `ray stop` (it would stop every pod's Ray and any other Ray on the machine):
a pod's Ray is stopped by killing the processes of its namespace.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from podagent import errors
from podagent.run import exits
from tests.harness.agents import Agent, clean_environ
from tests.harness.pods import DnsServer, Pod, PodNetwork, _kill_netns_processes, wait_for

BENCH_PREFIX = "pb"  # the benches' networks; the tests' are "pa": cleanup_stale never mixes them
RAY_PORT, DASHBOARD_PORT = 6379, 8265
VENV_BIN = Path(sys.executable).parent
# The `ray` beside this Python; a system Python's Ray installed elsewhere has it on PATH.
RAY = str(VENV_BIN / "ray") if (VENV_BIN / "ray").exists() else (shutil.which("ray") or "ray")
EXIT_HEAD_LOST = next(code for cls, code, _ in exits.EXIT_CODES if cls is errors.HeadLost)


@dataclass
class Cluster:
    net: PodNetwork
    dns: DnsServer
    head: Pod
    workers: list[Pod]
    tmp: dict[str, str]  # pod name -> its own short Ray temp dir

    @property
    def pods(self) -> list[Pod]:
        return [self.head, *self.workers]

    def ray_start(self, pod: Pod, *extra: str) -> list[str]:
        """Plain `ray start` for a pod: the head's, or a worker's joining the head; no GPUs, no
        usage stats, the pod's own temp dir, then `extra`."""
        role = (["--head", "--port", str(RAY_PORT)] if pod is self.head
                else ["--address", f"{self.head.ip}:{RAY_PORT}"])
        return [RAY, "start", *role, "--node-ip-address", pod.ip, "--num-gpus", "0",
                "--disable-usage-stats", "--temp-dir", self.tmp[pod.name], *extra]


@contextlib.contextmanager
def cluster(n: int, prefix: str = BENCH_PREFIX, subnet: str | None = None) -> Iterator[Cluster]:
    """A fresh private network (`subnet`, or the first free /24), DNS server and N+1
    registered pods; all gone afterwards."""
    net = PodNetwork(subnet=subnet, prefix=prefix)
    dns: DnsServer | None = None
    tmp: dict[str, str] = {}
    try:
        dns = DnsServer(address=net.host_ip, port=0).start()
        head = net.add_pod("head")
        workers = [net.add_pod(f"w{i}") for i in range(1, n + 1)]
        tag = secrets.token_hex(3)
        for pod in (head, *workers):
            dns.set_record(pod.dns_name, pod.ip)
            # <= 40 bytes: Ray's unix sockets live there
            tmp[pod.name] = f"/tmp/{prefix}-{tag}-{pod.name}"
        yield Cluster(net, dns, head, workers, tmp)
    finally:
        try:
            net.close()  # SIGKILLs every process of every pod, then deletes the namespaces
        finally:
            if dns is not None:
                dns.stop()
            for path in tmp.values():
                shutil.rmtree(path, ignore_errors=True)


def pod_env(**extra: str) -> dict[str, str]:
    """This machine's environment without what would configure podagent or Ray, this virtual
    environment's bin first on PATH, unbuffered Python, and `extra`."""
    env = clean_environ()
    env["PATH"] = os.pathsep.join([str(VENV_BIN), env.get("PATH", os.defpath)])
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def kill_pod(pod: Pod, timeout: float = 10.0) -> None:
    """SIGKILL every process of one pod until none is left."""
    _kill_netns_processes(pod.netns, timeout)


def kill_everything(c: Cluster) -> None:
    """Stop Ray by killing each pod's processes (never `ray stop`: one PID namespace)."""
    for pod in c.pods:
        with contextlib.suppress(Exception):
            kill_pod(pod)


def run_in_pod(pod: Pod, argv: list[str], env: dict[str, str], log: Path, timeout: float) -> int:
    """argv to completion inside the pod, output appended to a file (never a pipe: daemons that
    `ray start` leaves behind could hold a pipe open). Killed at the deadline (exit -9)."""
    with open(log, "ab") as out:
        out.write(f"$ {' '.join(argv)}\n".encode())
        out.flush()
        proc = pod.popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            return proc.wait(timeout=max(0.1, timeout))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            return -9


def read_text(path: Path) -> str:
    """A file's text, empty when it cannot be read (not written yet, or gone)."""
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def read_events(path: Path) -> list[dict[str, Any]]:
    """podagent's events.jsonl; a line that is not JSON (one being written) is skipped."""
    events = []
    for line in read_text(path).splitlines():
        with contextlib.suppress(ValueError):
            events.append(json.loads(line))
    return events


# --- podagent in every pod ------------------------------------------------------------------------


def start_agents(c: Cluster, logdir: Path, head_env: Mapping[str, str],
                 worker_env: Mapping[str, str]) -> tuple[list[Agent], float]:
    """podagent on the head, then on each worker, all pointed at the head; returns the agents
    (head first) and t0, the moment just before the first one started."""
    common = {"PATH": pod_env()["PATH"], "PODAGENT_RUN_NAME": "bench"}
    head = {"HEAD_POD_ID": c.head.pod_id}
    agents = [Agent(c.head, c.dns, logdir, {**common, **head_env, **head})]
    agents += [Agent(w, c.dns, logdir, {**common, **worker_env, **head}) for w in c.workers]
    for a in agents:
        a.ray_tmp = c.tmp[a.pod.name]
        a.env["PODAGENT_RAY_TEMP_DIR"] = a.ray_tmp
    t0 = time.time()
    for a in agents:
        a.start()
    return agents, t0


def wait_agents_exit(agents: list[Agent], timeout: float) -> None:
    """Until every agent's podagent has exited; TimeoutError after `timeout` seconds."""
    wait_for(lambda: all(a.proc.poll() is not None for a in agents), timeout=timeout,
             interval=0.1, what=f"all {len(agents)} podagents to exit")


def close_agents(agents: list[Agent]) -> None:
    for a in agents:
        if a.proc is not None:
            with contextlib.suppress(Exception):
                a.close()


def exit_codes(agents: list[Agent]) -> dict[str, int | None]:
    """pod name -> its podagent's exit code (None: still running or never started)."""
    return {a.pod.name: (a.proc.poll() if a.proc else None) for a in agents}
