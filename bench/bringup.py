"""Bring-up benchmark: podagent vs. the bare `ray start` floor vs. `ray symmetric-run`.

Pods are Linux network namespaces on one private bridge with a real DNS server, exactly as in
the end-to-end tests (tests/harness/pods.py). Needs root and iproute2. Run from the repository root
with the project's virtual environment:

    python bench/bringup.py [--workers 1,2,4] [--runs 3] [--methods podagent,floor,symmetric]
                            [--out DIR] [--quick]

See bench/README.md for what each method does and how the figures are taken.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import psutil  # noqa: E402
import tenacity  # noqa: E402

from podagent import __version__ as PODAGENT_VERSION  # noqa: E402
from podagent.gcs import GcsClient, GcsUnavailable  # noqa: E402
from tests.harness.agents import Agent, clean_environ  # noqa: E402
from tests.harness.pods import (  # noqa: E402
    DnsServer,
    Pod,
    PodNetwork,
    cleanup_stale,
    netns_pids,
    wait_for,
)

METHODS = ("podagent", "floor", "symmetric")
RAY_PORT, DASHBOARD_PORT = 6379, 8265
NET_PREFIX = "pb"  # distinct from the tests' "pa": cleanup_stale never touches the other's
TRIVIAL_JOB = "python -c pass"
LONG_JOB = "python -c 'import time; print(\"training\", flush=True); time.sleep(600)'"
ENTRY_MARKER = "ENTRY"
ENTRY_CODE = f"import time; print({ENTRY_MARKER!r}, repr(time.time()), flush=True)"
FOOTPRINT_WINDOW = 20.0
EXIT_HEAD_LOST = 7

# Targets printed next to the figures.
TARGET_OVERHEAD_S = 0.5
TARGET_JOIN_S = 0.3
TARGET_HEAD_LOSS_S = 10.0
TARGET_RSS_MB = 80.0
TARGET_CPU_PCT = 1.0

VENV_BIN = Path(sys.executable).parent
RAY = str(VENV_BIN / "ray")

# `ray symmetric-run` runs through this stand-in for the `ray` executable. All pods share one
# PID namespace (only the network is private), so Ray's process scans would see every pod's
# raylet and every other Ray on this machine: symmetric-run's "Ray is already started on this
# node" check would fire on a worker once any raylet runs anywhere, and its closing `ray stop`
# would kill every pod's Ray and any other test suite's Ray too. The stand-in limits psutil's
# process list to this pod's network namespace, which is what a separate machine would see.
# Nothing else changes: it then runs Ray's own CLI (`ray.scripts.scripts:main`).
_RAY_SHIM = """#!{python}
import os
import sys

import psutil

_own = os.stat("/proc/self/ns/net").st_ino
_all = psutil.process_iter


def _same_pod(pid):
    try:
        return os.stat(f"/proc/{{pid}}/ns/net").st_ino == _own
    except OSError:
        return False


def process_iter(*args, **kwargs):
    for proc in _all(*args, **kwargs):
        if _same_pod(proc.pid):
            yield proc


process_iter.cache_clear = getattr(_all, "cache_clear", lambda: None)
psutil.process_iter = process_iter

from ray.scripts.scripts import main  # noqa: E402

sys.argv[0] = "ray"
sys.exit(main())
"""


# --- records ------------------------------------------------------------------------------------


@dataclass
class Run:
    method: str  # podagent | floor | symmetric | headloss
    n: int  # workers
    index: int  # 1-based run number
    ok: bool = False
    seconds: float | None = None  # the method's metric (t0 -> job submitted / entrypoint)
    reason: str = ""  # why it failed (one line)
    tail: list[str] = field(default_factory=list)  # the head's last output lines on failure
    exit_codes: dict[str, int | None] = field(default_factory=dict)
    wall_s: float = 0.0  # the whole run, teardown included
    load_before: tuple[float, float, float] | None = None
    load_after: tuple[float, float, float] | None = None
    foreign_raylets: int = 0  # raylets on this machine not ours, at the start (other suites)
    extra: dict[str, Any] = field(default_factory=dict)
    logs: str = ""


class RunFailed(Exception):
    def __init__(self, reason: str, tail: list[str] | None = None):
        super().__init__(reason)
        self.reason, self.tail = reason, tail or []


ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def last_lines(text: str, count: int = 12) -> list[str]:
    return [ANSI.sub("", line) for line in text.splitlines() if line.strip()][-count:]


def read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def reason_line(text: str) -> str:
    """The most telling line of a failed program's output."""
    lines = [ANSI.sub("", line).strip() for line in text.splitlines() if line.strip()]
    # A program's own verdict first (click's "Error: ...", an exception's last line), then any
    # line that sounds like one; lines Ray forwards from other nodes' raylets come last.
    ranked = (lambda line: line.startswith(("Error:", "ERROR:", "podagent: error")),
              lambda line: re.match(r"^[A-Za-z_.]*(Error|Exception): ", line) is not None,
              lambda line: any(k in line for k in ("Error", "ERROR", "Timed out", "timed out",
                                                   "Failed", "failed", "Check failed")))
    for rank in ranked:
        for line in reversed(lines):
            if rank(line) and not line.startswith("Traceback"):
                return line[:300]
    return lines[-1][:300] if lines else "<no output>"


def foreign_raylets() -> int:
    """Live raylets on this machine before a run starts: other suites' Ray (noise). Zombies
    do not count: the floor's and symmetric-run's daemons are orphans that the machine's init
    reaps a while after the bench killed them."""
    count = 0
    for proc in psutil.process_iter(["name", "status"]):
        if proc.info["name"] == "raylet" and proc.info["status"] != psutil.STATUS_ZOMBIE:
            count += 1
    return count


# --- pods ---------------------------------------------------------------------------------------


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


@contextlib.contextmanager
def cluster(n: int) -> Iterator[Cluster]:
    """A fresh private network, DNS server and N+1 registered pods; all gone afterwards."""
    net = PodNetwork(prefix=NET_PREFIX)
    dns: DnsServer | None = None
    tmp: dict[str, str] = {}
    try:
        dns = DnsServer(address=net.host_ip, port=0).start()
        head = net.add_pod("head")
        workers = [net.add_pod(f"w{i}") for i in range(1, n + 1)]
        tag = secrets.token_hex(3)
        for pod in (head, *workers):
            dns.set_record(pod.dns_name, pod.ip)
            tmp[pod.name] = f"/tmp/pb-{tag}-{pod.name}"  # <= 40 bytes: Ray's sockets live there
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
    env = clean_environ()
    env["PATH"] = os.pathsep.join([str(VENV_BIN), env.get("PATH", os.defpath)])
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def kill_pod(pod: Pod, timeout: float = 10.0) -> None:
    """SIGKILL every process of one pod until none is left (pods share one PID namespace, so
    `ray stop` would hit the other pods too: kill by namespace instead)."""

    def gone() -> bool:
        pids = netns_pids(pod.netns)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return not pids

    wait_for(gone, timeout=timeout, interval=0.02, what=f"every process of pod {pod.name} to die")


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


# --- method 1: podagent -------------------------------------------------------------------------


def read_events(path: Path) -> list[dict[str, Any]]:
    events = []
    for line in read_text(path).splitlines():
        with contextlib.suppress(ValueError):
            events.append(json.loads(line))
    return events


def start_agents(c: Cluster, logdir: Path, head_env: dict[str, str],
                 worker_env: dict[str, str]) -> tuple[list[Agent], float]:
    common = {"PATH": pod_env()["PATH"], "PODAGENT_RUN_NAME": "bench"}
    agents = [Agent(c.head, c.dns, logdir, {"HEAD_POD_ID": c.head.pod_id, **common, **head_env})]
    agents += [Agent(w, c.dns, logdir, {"HEAD_POD_ID": c.head.pod_id, **common, **worker_env})
               for w in c.workers]
    for a in agents:
        a.ray_tmp = c.tmp[a.pod.name]
        a.env["PODAGENT_RAY_TEMP_DIR"] = a.ray_tmp
    t0 = time.time()
    for a in agents:
        a.start()
    return agents, t0


def close_agents(agents: list[Agent]) -> None:
    for a in agents:
        if a.proc is not None:
            with contextlib.suppress(Exception):
                a.close()


def exit_codes(agents: list[Agent]) -> dict[str, int | None]:
    return {a.pod.name: (a.proc.poll() if a.proc else None) for a in agents}


def join_latencies(events: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
    """Per `worker_joined` event: ts - the node's start_time_ms (as specified), and the same
    counted from when the head began polling the node table (a worker that registered while
    the head still waited for its own dashboard cannot be seen earlier than that)."""
    polling = next((e["ts"] for e in events
                    if e.get("event") == "state" and e.get("state") == "waiting_workers"), None)
    raw, after = [], []
    for e in events:
        if e.get("event") == "worker_joined" and e.get("registered_ms"):
            registered = e["registered_ms"] / 1000.0
            raw.append(round(e["ts"] - registered, 3))
            if polling is not None:
                after.append(round(e["ts"] - max(registered, polling), 3))
    return raw, after


def run_podagent(run: Run, logdir: Path, timeout: float) -> None:
    n = run.n
    agents: list[Agent] = []
    with cluster(n) as c:
        try:
            agents, t0 = start_agents(
                c, logdir,
                # The floor starts no reward server: compare the bring-up alone.
                head_env={"EXPECTED_WORKERS": str(n), "PODAGENT_JOB": TRIVIAL_JOB,
                          "PODAGENT_REWARD": "none",
                          "PODAGENT_WORKER_TIMEOUT": str(int(timeout - 30))},
                worker_env={"PODAGENT_HEAD_TIMEOUT": str(int(timeout - 30))})
            head = agents[0]
            try:
                wait_for(lambda: all(a.proc.poll() is not None for a in agents),
                         timeout=max(1.0, t0 + timeout - time.time()), interval=0.1,
                         what=f"all {n + 1} podagents to exit")
            except TimeoutError as exc:
                run.exit_codes = exit_codes(agents)
                raise RunFailed(str(exc), last_lines(head.output)) from None
            run.exit_codes = exit_codes(agents)
            events = read_events(logdir / "head" / "bench" / "events.jsonl")
            submitted = [e for e in events
                         if e.get("event") == "job_submitted" and e.get("result") == "ok"]
            run.extra["join_latency_s"], run.extra["join_after_polling_s"] = (
                join_latencies(events))
            run.extra["steps_s"] = {e["event"]: e.get("duration_s") for e in events
                                    if "duration_s" in e}
            if submitted:
                run.seconds = round(submitted[0]["ts"] - t0, 3)
            bad = {k: v for k, v in run.exit_codes.items() if v != 0}
            if bad or not submitted:
                who = next(iter(bad), "head")
                agent = next(a for a in agents if a.pod.name == who)
                what = f"exit codes {bad}" if bad else "no job_submitted event"
                raise RunFailed(f"{what}: {who}: {reason_line(agent.output)}",
                                last_lines(head.output))
            run.ok = True
        finally:
            close_agents(agents)


# --- method 2: the bare floor -------------------------------------------------------------------


def run_floor(run: Run, logdir: Path, timeout: float) -> None:
    n = run.n
    env = pod_env()
    stop = threading.Event()
    joins: dict[str, dict[str, Any]] = {}
    threads: list[threading.Thread] = []
    with cluster(n) as c:
        head = c.head
        head_log = logdir / "head.out"

        def join(pod: Pod, deadline: float) -> None:
            """The bare worker: `ray start --address` again until it exits 0 (bounded)."""
            state = joins[pod.name]
            argv = [RAY, "start", "--address", f"{head.ip}:{RAY_PORT}", "--node-ip-address",
                    pod.ip, "--num-gpus", "0", "--disable-usage-stats", "--temp-dir",
                    c.tmp[pod.name]]

            def attempt() -> int:
                state["attempts"] += 1
                return run_in_pod(pod, argv, env, logdir / f"{pod.name}.out",
                                  deadline - time.time())

            try:
                state["rc"] = tenacity.Retrying(
                    stop=tenacity.stop_after_delay(max(1.0, deadline - time.time()))
                    | tenacity.stop_when_event_set(stop),
                    wait=tenacity.wait_fixed(0.5),
                    retry=tenacity.retry_if_result(lambda rc: rc != 0),
                    retry_error_callback=lambda s: s.outcome.result())(attempt)
            except Exception as exc:  # the pod vanished under it at teardown
                state["error"] = f"{type(exc).__name__}: {exc}"
            state["done"] = time.time()

        try:
            head_argv = [RAY, "start", "--head", "--node-ip-address", head.ip, "--port",
                         str(RAY_PORT), "--dashboard-host", head.ip, "--num-gpus", "0",
                         "--disable-usage-stats", "--temp-dir", c.tmp[head.name]]
            t0 = time.time()
            deadline = t0 + timeout
            # The head's `ray start` first, then the workers' loops, all at once.
            head_rc: dict[str, int] = {}
            head_thread = threading.Thread(
                target=lambda: head_rc.setdefault(
                    "rc", run_in_pod(head, head_argv, env, head_log, deadline - time.time())),
                daemon=True)
            head_thread.start()
            for pod in c.workers:
                joins[pod.name] = {"attempts": 0, "rc": None}
                t = threading.Thread(target=join, args=(pod, deadline), daemon=True)
                t.start()
                threads.append(t)
            head_thread.join(max(0.1, deadline - time.time()))
            if head_rc.get("rc") != 0:
                raise RunFailed(f"head `ray start --head` exit {head_rc.get('rc')}: "
                                f"{reason_line(read_text(head_log))}",
                                last_lines(read_text(head_log)))

            run.extra["head_up_s"] = round(time.time() - t0, 3)
            # The GCS is up now: a client made before that would sit in gRPC's reconnect
            # back-off and add up to a second to the floor.
            gcs = GcsClient(f"{head.ip}:{RAY_PORT}")
            try:
                def all_alive() -> bool:
                    if joins and all("done" in s for s in joins.values()) and any(
                            s["rc"] != 0 for s in joins.values()):
                        raise RunFailed(f"a worker gave up joining: {joins}")
                    alive = [x for x in gcs.nodes(timeout=2.0) if x.alive]
                    return len(alive) >= n + 1

                try:
                    wait_for(all_alive, timeout=max(1.0, deadline - time.time()), interval=0.1,
                             what=f"{n + 1} alive nodes in the head's node table",
                             ignore=(GcsUnavailable,))
                except TimeoutError as exc:
                    tails = {p: reason_line(read_text(logdir / f"{p}.out")) for p in joins}
                    raise RunFailed(f"{exc}; workers: {tails}",
                                    last_lines(read_text(head_log))) from None
            finally:
                gcs.close()
            run.extra["nodes_alive_s"] = round(time.time() - t0, 3)

            submit = [RAY, "job", "submit", "--address", f"http://{head.ip}:{DASHBOARD_PORT}",
                      "--no-wait", "--", *TRIVIAL_JOB.split()]
            attempts = {"n": 0}

            def submit_once() -> int:
                attempts["n"] += 1
                return run_in_pod(head, submit, env, logdir / "submit.out",
                                  deadline - time.time())

            rc = tenacity.Retrying(
                stop=tenacity.stop_after_delay(max(1.0, deadline - time.time())),
                wait=tenacity.wait_fixed(0.2),
                retry=tenacity.retry_if_result(lambda rc: rc != 0),
                retry_error_callback=lambda s: s.outcome.result())(submit_once)
            submitted = time.time()
            run.extra["submit_attempts"] = attempts["n"]
            run.extra["join_attempts"] = {p: s["attempts"] for p, s in joins.items()}
            run.exit_codes = {"head": head_rc.get("rc"), "submit": rc,
                              **{p: s["rc"] for p, s in joins.items()}}
            if rc != 0:
                text = read_text(logdir / "submit.out")
                raise RunFailed(f"`ray job submit` exit {rc}: {reason_line(text)}",
                                last_lines(text))
            run.seconds = round(submitted - t0, 3)
            run.ok = True
        finally:
            stop.set()
            kill_everything(c)
            for t in threads:
                t.join(timeout=15)


def kill_everything(c: Cluster) -> None:
    """Stop Ray by killing each pod's processes (never `ray stop`: one PID namespace)."""
    for pod in c.pods:
        with contextlib.suppress(Exception):
            kill_pod(pod)


# --- method 3: ray symmetric-run ----------------------------------------------------------------


def write_shim(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    shim = directory / "ray"
    shim.write_text(_RAY_SHIM.format(python=sys.executable))
    shim.chmod(0o755)
    return shim


def run_symmetric(run: Run, logdir: Path, timeout: float) -> None:
    n = run.n
    procs: dict[str, subprocess.Popen[Any]] = {}
    files = []
    with cluster(n) as c:
        bindir = Path(c.tmp[c.head.name] + "-bin")
        try:
            shim = write_shim(bindir)
            argvs, envs = {}, {}
            for pod in c.pods:
                Path(c.tmp[pod.name]).mkdir(parents=True, exist_ok=True)
                # Both RAY_TMPDIR and --temp-dir: symmetric-run's own ray.init() on the head
                # finds the cluster through <RAY_TMPDIR>/ray/ray_current_cluster (with only
                # --temp-dir it looks in /tmp/ray and starts a second, local Ray), and a worker
                # without --temp-dir takes the head's temp dir from the GCS (one file system
                # here: the pods would share it).
                argvs[pod.name] = [
                    str(shim), "symmetric-run", "--address", f"{c.head.ip}:{RAY_PORT}",
                    "--min-nodes", str(n + 1), "--num-gpus", "0", "--disable-usage-stats",
                    "--temp-dir", f"{c.tmp[pod.name]}/ray", "--", "python", "-c", ENTRY_CODE]
                envs[pod.name] = pod_env(PATH=os.pathsep.join([str(bindir), pod_env()["PATH"]]),
                                         RAY_TMPDIR=c.tmp[pod.name])
            outs = {pod.name: logdir / f"{pod.name}.out" for pod in c.pods}
            t0 = time.time()
            for pod in c.pods:
                f = open(outs[pod.name], "wb")  # closed in finally
                files.append(f)
                procs[pod.name] = pod.popen(argvs[pod.name], env=envs[pod.name], stdout=f,
                                            stderr=subprocess.STDOUT)
            head = procs[c.head.name]

            def marker() -> float | None:
                for line in read_text(outs[c.head.name]).splitlines():
                    if line.startswith(ENTRY_MARKER + " "):
                        return float(line.split()[1])
                if head.poll() is not None:
                    text = read_text(outs[c.head.name])
                    raise RunFailed(f"head exited {head.returncode} before the entrypoint ran: "
                                    f"{reason_line(text)}", last_lines(text))
                return None

            try:
                entry = wait_for(marker, timeout=max(1.0, t0 + timeout - time.time()),
                                 interval=0.1, what="the head's entrypoint marker")
            except TimeoutError as exc:
                text = read_text(outs[c.head.name])
                raise RunFailed(f"{exc}: {reason_line(text)}", last_lines(text)) from None
            except RunFailed as exc:
                failed = {p.name: reason_line(read_text(outs[p.name])) for p in c.workers
                          if procs[p.name].poll() not in (None, 0)}
                if failed:
                    exc.reason += "; workers: " + "; ".join(f"{k}: {v}" for k, v in failed.items())
                raise
            run.seconds = round(entry - t0, 3)
            with contextlib.suppress(subprocess.TimeoutExpired):
                head.wait(timeout=60)
            run.exit_codes = {name: p.poll() for name, p in procs.items()}
            if head.returncode != 0:
                text = read_text(outs[c.head.name])
                raise RunFailed(f"head exit {head.returncode} after the entrypoint: "
                                f"{reason_line(text)}", last_lines(text))
            run.ok = True
        finally:
            if not run.exit_codes:
                run.exit_codes = {name: p.poll() for name, p in procs.items()}
            worker_errors = {}
            for pod in c.workers:
                text = read_text(logdir / f"{pod.name}.out")
                if "Error" in text or "Timed out" in text or "Exception" in text:
                    worker_errors[pod.name] = reason_line(text)
            if worker_errors:
                run.extra["worker_errors"] = worker_errors
            kill_everything(c)
            for f in files:
                f.close()
            shutil.rmtree(bindir, ignore_errors=True)


# --- extra: head loss and the idle worker's footprint -------------------------------------------


def sample_footprint(agents: list[Agent], window: float) -> dict[str, dict[str, float]]:
    """RSS and CPU of each worker's podagent process itself (not its Ray children)."""
    procs = {a.pod.name: psutil.Process(a.proc.pid) for a in agents if a.proc}
    first = {k: p.cpu_times() for k, p in procs.items()}
    rss: dict[str, list[int]] = {k: [] for k in procs}
    started = time.monotonic()
    deadline = started + window
    while True:
        for k, p in procs.items():
            rss[k].append(p.memory_info().rss)
        now = time.monotonic()
        if now >= deadline:
            break
        time.sleep(min(1.0, deadline - now))  # the measurement window itself, not a readiness wait
    elapsed = time.monotonic() - started
    result = {}
    for k, p in procs.items():
        last = p.cpu_times()
        cpu = (last.user + last.system) - (first[k].user + first[k].system)
        result[k] = {"rss_mb": round(max(rss[k]) / 2**20, 1),
                     "rss_mb_end": round(rss[k][-1] / 2**20, 1),
                     "cpu_pct": round(100.0 * cpu / elapsed, 3),
                     "window_s": round(elapsed, 1)}
    return result


def run_headloss(run: Run, logdir: Path, timeout: float, grace: float,
                 footprint: bool) -> None:
    n = run.n
    agents: list[Agent] = []
    run.extra["grace_s"] = grace
    with cluster(n) as c:
        try:
            agents, t0 = start_agents(
                c, logdir,
                head_env={"EXPECTED_WORKERS": str(n), "PODAGENT_JOB": LONG_JOB,
                          "PODAGENT_WORKER_TIMEOUT": str(int(timeout - 30))},
                worker_env={"PODAGENT_HEAD_GRACE": f"{grace:g}",
                            "PODAGENT_HEAD_TIMEOUT": str(int(timeout - 30))})
            head, workers = agents[0], agents[1:]
            try:
                head.wait_output("training", timeout=max(1.0, t0 + timeout - time.time()))
                for w in workers:
                    w.wait_output("watching the head", timeout=60)
            except (TimeoutError, AssertionError) as exc:
                run.exit_codes = exit_codes(agents)
                raise RunFailed(str(exc).splitlines()[0], last_lines(head.output)) from None
            run.extra["formed_s"] = round(time.time() - t0, 3)
            events = read_events(logdir / "head" / "bench" / "events.jsonl")
            run.extra["join_latency_s"], run.extra["join_after_polling_s"] = (
                join_latencies(events))
            if footprint:
                run.extra["footprint"] = sample_footprint(workers, FOOTPRINT_WINDOW)
            if any(w.proc.poll() is not None for w in workers):
                raise RunFailed(f"a worker exited while idle: {exit_codes(workers)}")

            killed = time.monotonic()
            kill_pod(c.head)
            exited: dict[str, float] = {}

            def all_exited() -> bool:
                now = time.monotonic()
                for w in workers:
                    if w.pod.name not in exited and w.proc.poll() is not None:
                        exited[w.pod.name] = round(now - killed, 3)
                return len(exited) == len(workers)

            try:
                wait_for(all_exited, timeout=grace + 60, interval=0.02,
                         what="every worker's podagent to exit after the head died")
            except TimeoutError as exc:
                run.exit_codes = exit_codes(workers)
                raise RunFailed(str(exc), last_lines(workers[0].output)) from None
            run.exit_codes = exit_codes(workers)
            run.extra["worker_exit_s"] = exited
            run.extra["leftover_pids"] = {w.pod.name: w.pod.pids() for w in workers}
            run.seconds = max(exited.values())
            bad = {k: v for k, v in run.exit_codes.items() if v != EXIT_HEAD_LOST}
            if bad:
                who = next(iter(bad))
                agent = next(a for a in workers if a.pod.name == who)
                raise RunFailed(f"worker exit codes {bad} (expected {EXIT_HEAD_LOST}): "
                                f"{reason_line(agent.output)}", last_lines(agent.output))
            run.ok = True
        finally:
            close_agents(agents)


# --- driver -------------------------------------------------------------------------------------


def execute(run: Run, logroot: Path, body: Callable[[Run, Path], None], total: int,
            sink: Path) -> Run:
    logdir = logroot / f"{run.method}-n{run.n}-r{run.index}"
    if "grace_s" in run.extra:
        logdir = logdir.with_name(f"{logdir.name}-g{run.extra['grace_s']:g}")
    logdir.mkdir(parents=True, exist_ok=True)
    run.logs = str(logdir.relative_to(logroot.parent))
    run.load_before = os.getloadavg()
    run.foreign_raylets = foreign_raylets()
    started = time.monotonic()
    try:
        body(run, logdir)
    except RunFailed as exc:
        run.ok, run.reason, run.tail = False, exc.reason, exc.tail
    except Exception as exc:  # the harness itself failed: record it, go on with the next run
        run.ok, run.reason = False, f"bench error: {type(exc).__name__}: {exc}"
    run.wall_s = round(time.monotonic() - started, 1)
    run.load_after = os.getloadavg()
    label = run.method + (f" grace={run.extra['grace_s']:g}" if "grace_s" in run.extra else "")
    figure = f"{run.seconds:.2f} s" if run.seconds is not None else "-"
    status = "ok" if run.ok else f"FAILED: {run.reason}"
    print(f"[{label:<20} N={run.n} run {run.index}/{total}] {figure:>9}  {status}  "
          f"(wall {run.wall_s:.0f} s, load {run.load_before[0]:.1f}, "
          f"other raylets {run.foreign_raylets})", flush=True)
    if not run.ok and run.tail:
        for line in run.tail:
            print(f"    | {line}", flush=True)
    with open(sink, "a") as f:
        f.write(json.dumps(asdict(run)) + "\n")
    return run


# --- tables -------------------------------------------------------------------------------------


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "FAIL")


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def median_of(runs: list[Run], method: str, n: int) -> float | None:
    values = [r.seconds for r in runs if r.method == method and r.n == n and r.ok]
    return statistics.median(values) if values else None


def render(runs: list[Run], args: argparse.Namespace, meta: dict[str, Any]) -> str:
    out = [f"### Bring-up benchmark ({meta['started']})", "",
           f"{meta['machine']}; Ray {meta['ray']}, podagent {meta['podagent']} "
           f"(commit {meta['commit']}); {args.runs} run(s) per method and N; "
           f"load average {meta['load_min']:.1f}-{meta['load_max']:.1f} during the runs; "
           f"other Ray instances seen on the machine at run starts: {meta['foreign_max']} "
           f"raylet(s) at most.", ""]

    bring = [r for r in runs if r.method in METHODS]
    what = {"podagent": "t0 → job_submitted event", "floor": "t0 → `ray job submit` returned 0",
            "symmetric": "t0 → entrypoint marker"}
    rows = []
    for method in (m for m in args.methods if m in METHODS):
        for n in args.workers:
            mine = [r for r in bring if r.method == method and r.n == n]
            values = [r.seconds for r in mine if r.ok and r.seconds is not None]
            rows.append([method, what[method], str(n), f"{len(values)}/{len(mine)}",
                         fmt(statistics.median(values) if values else None),
                         fmt(min(values) if values else None),
                         fmt(max(values) if values else None)])
    out += ["#### Time to a running job (seconds; median, min, max over successful runs)", "",
            table(["method", "metric", "N workers", "ok/runs", "median", "min", "max"], rows), ""]

    rows = []
    for n in args.workers:
        pa, fl, sy = (median_of(bring, m, n) for m in METHODS)
        over = None if pa is None or fl is None else pa - fl
        rows.append([str(n), fmt(pa), fmt(fl), fmt(over), f"≤ {TARGET_OVERHEAD_S:g} s",
                     verdict(None if over is None else over <= TARGET_OVERHEAD_S),
                     fmt(pa / fl if pa and fl else None), fmt(sy / fl if sy and fl else None)])
    out += ["#### podagent overhead over the bare floor (medians)", "",
            table(["N workers", "podagent s", "floor s", "overhead s", "target", "result",
                   "podagent/floor", "symmetric/floor"], rows), ""]

    podagent_like = [r for r in runs if r.method in ("podagent", "headloss")]
    rows = []
    for n in sorted({r.n for r in podagent_like}):
        lat = [x for r in podagent_like if r.n == n for x in r.extra.get("join_latency_s", [])]
        after = [x for r in podagent_like if r.n == n
                 for x in r.extra.get("join_after_polling_s", [])]
        if lat:
            rows.append([str(n), str(len(lat)), fmt(statistics.median(lat), 3),
                         fmt(max(lat), 3), f"≤ {TARGET_JOIN_S:g} s (every join)",
                         verdict(max(lat) <= TARGET_JOIN_S),
                         fmt(statistics.median(after) if after else None, 3),
                         fmt(max(after) if after else None, 3),
                         verdict(max(after) <= TARGET_JOIN_S) if after else "n/a"])
    if rows:
        out += ["#### Join detection latency (head's `worker_joined` ts − the node's "
                "start_time_ms; podagent and head-loss runs)", "",
                "The last three columns count from max(start_time_ms, the moment the head "
                "entered waiting_workers): a worker that registers while the head still waits "
                "for its own dashboard cannot be seen before the head starts polling.", "",
                table(["N workers", "joins", "median s", "max s", "target", "result",
                       "after polling: median s", "max s", "result"], rows), ""]

    steps = ["ray_head", "workers_joined", "job_submitted"]
    rows = []
    for n in args.workers:
        mine = [r for r in runs if r.method == "podagent" and r.n == n and r.ok]
        if mine:
            medians = [statistics.median([r.extra["steps_s"].get(s) or 0.0 for r in mine])
                       for s in steps]
            floor = [r for r in runs if r.method == "floor" and r.n == n and r.ok]
            rows.append([str(n), *(fmt(m) for m in medians),
                         fmt(statistics.median([r.extra["head_up_s"] for r in floor])
                             if floor else None),
                         fmt(statistics.median([r.extra["nodes_alive_s"] for r in floor])
                             if floor else None)])
    if rows:
        out += ["#### Where the time goes (medians, seconds)", "",
                "podagent columns are its own step durations from events.jsonl; floor columns "
                "are t0 → the head's `ray start` returned and t0 → N+1 nodes alive.", "",
                table(["N workers", "podagent ray_head", "workers_joined", "job_submitted",
                       "floor head up (t0→)", "floor all alive (t0→)"], rows), ""]

    loss = [r for r in runs if r.method == "headloss"]
    rows = []
    for r in loss:
        exits = r.extra.get("worker_exit_s", {})
        values = list(exits.values())
        rows.append([str(r.n), f"{r.extra['grace_s']:g}", str(r.index),
                     ", ".join(f"{k}={v}" for k, v in r.exit_codes.items()) or "-",
                     fmt(statistics.median(values) if values else None),
                     fmt(max(values) if values else None), f"≤ {TARGET_HEAD_LOSS_S:g} s",
                     verdict(r.ok and max(values) <= TARGET_HEAD_LOSS_S) if values else "FAIL"])
    if rows:
        out += ["#### Head loss → worker exit (head pod SIGKILLed; seconds until each worker's "
                "podagent exits)", "",
                table(["N workers", "grace s", "run", "exit codes", "median s", "max s",
                       "target", "result"], rows), ""]

    rows = []
    for r in loss:
        for name, fp in sorted(r.extra.get("footprint", {}).items()):
            ok = fp["rss_mb"] <= TARGET_RSS_MB and fp["cpu_pct"] <= TARGET_CPU_PCT
            rows.append([str(r.n), name, fmt(fp["rss_mb"], 1), fmt(fp["cpu_pct"], 2),
                         f"{fp['window_s']:g}",
                         f"≤ {TARGET_RSS_MB:g} MB, ≤ {TARGET_CPU_PCT:g} %", verdict(ok)])
    if rows:
        out += ["#### Idle worker footprint (the worker's podagent process alone, joined and "
                "watching)", "",
                table(["N workers", "worker", "RSS MB (max)", "CPU % of a core", "window s",
                       "target", "result"], rows), ""]

    failed = [r for r in runs if not r.ok]
    if failed:
        rows = [[r.method + (f" (grace {r.extra['grace_s']:g})" if "grace_s" in r.extra else ""),
                 str(r.n), str(r.index), r.reason.replace("|", "/")[:400]] for r in failed]
        out += ["#### Failed runs", "", table(["method", "N workers", "run", "reason"], rows), ""]
    return "\n".join(out)


# --- main ---------------------------------------------------------------------------------------


def parse_ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,2,4, not {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("expected numbers >= 1")
    return values


def parse_floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,2,4, not {text!r}") from None


def parse_methods(text: str) -> list[str]:
    methods = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in methods if m not in (*METHODS, "headloss")]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown method(s) {unknown}; "
                                         f"choose from {', '.join((*METHODS, 'headloss'))}")
    return methods


def rerender(directory: Path) -> int:
    saved = json.loads((directory / "results.json").read_text())
    runs = []
    for record in saved["runs"]:
        record["reason"] = ANSI.sub("", record.get("reason", ""))
        for key in ("load_before", "load_after"):
            record[key] = tuple(record[key]) if record.get(key) else None
        run = Run(**record)
        logs = directory / run.logs
        if not run.ok and run.method == "symmetric" and logs.is_dir():
            # Reasons as the current reason_line picks them, from the saved outputs.
            head = reason_line(read_text(logs / "head.out"))
            workers = {p.stem: reason_line(read_text(p)) for p in sorted(logs.glob("w*.out"))
                       if "Exception" in read_text(p) or "Error" in read_text(p)}
            run.extra["worker_errors"] = workers
            run.reason = (run.reason.split(":", 1)[0] + ": " + head
                          + ("; workers: " + "; ".join(f"{k}: {v}" for k, v in workers.items())
                             if workers else ""))
        runs.append(run)
    report = render(runs, argparse.Namespace(**saved["args"]), saved["meta"])
    print(report)
    (directory / "results.md").write_text(report + "\n")
    return 0


def git_commit() -> str:
    proc = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=False)
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--",
                            "podagent"], capture_output=True, text=True, check=False)
    return (proc.stdout.strip() or "?") + ("+dirty" if dirty.stdout.strip() else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=parse_ints, default=[1, 2, 4],
                        help="worker counts N (default 1,2,4)")
    parser.add_argument("--runs", type=int, default=3, help="runs per method and N (default 3)")
    parser.add_argument("--methods", type=parse_methods,
                        default=[*METHODS, "headloss"],
                        help="podagent,floor,symmetric,headloss (default: all)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results",
                        help="results directory (default bench/results/, git-ignored)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke check: N=1, one run each, head loss with the default grace")
    parser.add_argument("--run-timeout", type=float, default=300.0,
                        help="bound on each run in seconds (default 300)")
    parser.add_argument("--head-loss-workers", type=parse_ints, default=[1, 2],
                        help="N for the head-loss runs (default 1,2)")
    parser.add_argument("--head-loss-grace", type=parse_floats, default=[8.0, 5.0],
                        help="PODAGENT_HEAD_GRACE values for the head-loss runs (default 8,5)")
    parser.add_argument("--report", type=Path, metavar="DIR",
                        help="print and rewrite DIR/results.md from DIR/results.json; run nothing")
    args = parser.parse_args(argv)
    if args.report:
        return rerender(args.report)
    if args.quick:
        args.workers, args.runs = [1], 1
        args.head_loss_workers, args.head_loss_grace = [1], [8.0]
    if os.geteuid() != 0 or shutil.which("ip") is None:
        parser.error("needs root and iproute2's `ip` (pods are network namespaces)")

    import ray
    from ray.core.generated import gcs_pb2, gcs_service_pb2  # noqa: F401 - warm: no import in t

    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    outdir = args.out.resolve() / stamp
    logroot = outdir / "logs"
    logroot.mkdir(parents=True, exist_ok=True)
    sink = outdir / "runs.jsonl"
    cleanup_stale(prefix=NET_PREFIX)  # what a crashed earlier bench left (never a live one)

    meta = {"started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"{os.cpu_count()} CPU(s), {platform.machine()}, "
                       f"{psutil.virtual_memory().total / 2**30:.0f} GiB, "
                       f"Python {platform.python_version()}",
            "ray": ray.__version__, "podagent": PODAGENT_VERSION, "commit": git_commit()}
    print(f"bench: {meta['machine']}; Ray {meta['ray']}; results in {outdir}", flush=True)

    bodies: dict[str, Callable[[Run, Path], None]] = {
        "podagent": lambda r, d: run_podagent(r, d, args.run_timeout),
        "floor": lambda r, d: run_floor(r, d, args.run_timeout),
        "symmetric": lambda r, d: run_symmetric(r, d, args.run_timeout),
    }
    runs: list[Run] = []
    try:
        for n in args.workers:
            for i in range(1, args.runs + 1):
                for method in (m for m in args.methods if m in METHODS):
                    runs.append(execute(Run(method, n, i), logroot, bodies[method], args.runs,
                                        sink))
        if "headloss" in args.methods:
            for n in args.head_loss_workers:
                for g_index, grace in enumerate(args.head_loss_grace):
                    run = Run("headloss", n, 1, extra={"grace_s": grace})
                    runs.append(execute(
                        run, logroot,
                        lambda r, d, g=grace, fp=(g_index == 0): run_headloss(
                            r, d, args.run_timeout, g, fp),
                        1, sink))
    except KeyboardInterrupt:
        print("bench: interrupted; writing what was measured so far", flush=True)

    loads = [x for r in runs for x in (r.load_before, r.load_after) if x]
    meta.update(load_min=min((x[0] for x in loads), default=0.0),
                load_max=max((x[0] for x in loads), default=0.0),
                foreign_max=max((r.foreign_raylets for r in runs), default=0))
    write_results(outdir, render(runs, args, meta), meta, args, runs)
    return 0 if runs and all(r.ok for r in runs) else 1


def write_results(outdir: Path, report: str, meta: dict, args: argparse.Namespace,
                  runs: list) -> None:
    """The table on screen and in results.md; every run's figures in results.json."""
    print("\n" + report, flush=True)
    (outdir / "results.md").write_text(report + "\n")
    (outdir / "results.json").write_text(json.dumps(
        {"meta": meta, "args": {k: (str(v) if isinstance(v, Path) else v)
                                for k, v in vars(args).items()},
         "runs": [asdict(r) for r in runs]}, indent=2) + "\n")
    print(f"\nbench: wrote {outdir / 'results.md'} and {outdir / 'results.json'}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
