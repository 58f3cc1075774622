"""Bring-up benchmark: podagent vs. the bare `ray start` floor vs. `ray symmetric-run`.

Pods are Linux network namespaces on one private bridge with a real DNS server, exactly as in
the end-to-end tests (tests/harness/). Needs root and iproute2. Run from the repository root
with the project's virtual environment:

    python bench/bringup.py [--workers 1,2,4] [--runs 3] [--methods podagent,floor,symmetric]
                            [--out DIR] [--quick]

See bench/README.md for what each method does and how the figures are taken.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil
import requests
import tenacity

from podagent.ray_access.gcs import GcsClient, GcsUnavailable
from tests.harness import benchkit
from tests.harness import cluster as harness
from tests.harness.agents import Agent
from tests.harness.benchkit import RunFailed, fmt, last_lines, median, reason_line, table, verdict
from tests.harness.pods import Pod, wait_for

METHODS = ("podagent", "floor", "symmetric")
TRIVIAL_JOB = "python -c pass"
LONG_JOB = "python -c 'import time; print(\"training\", flush=True); time.sleep(600)'"
ENTRY_MARKER, EXIT_MARKER = "ENTRY", "EXIT"
FOOTPRINT_WINDOW = 20.0

# Targets printed next to the figures.
TARGET_OVERHEAD_S = 0.5
TARGET_JOIN_S = 0.3
TARGET_HEAD_LOSS_S = 10.0
TARGET_RSS_MB = 80.0
TARGET_CPU_PCT = 1.0

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


# --- what the pods are and run -----------------------------------------------------------------


class Observer(Protocol):
    """Watches one run from its start (`observe`, once the head's process exists: podagent's,
    or the floor's `ray start --head` done) to `finish(marks)`, called with the run's moments
    (time.time() values by name: t0, up, submitted, finished) after its figures are taken and
    while its pods still run; what it returns goes into the run's extra["observed"]."""

    def finish(self, marks: dict[str, float | None]) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Setup:
    """How a run's pods are made and what they run; the defaults are this bench's own."""
    prefix: str = harness.BENCH_PREFIX  # the network namespaces' prefix
    subnet: str | None = None  # None: the first free /24
    env: Mapping[str, str] = field(default_factory=dict)  # for every process of every pod
    job_seconds: float = 0.0  # how long the job runs (0: `python -c pass`)
    until_finished: bool = False  # the floor also waits for its job to end (t0 → finished)
    # Called with the cluster and the head pod's podagent process (None: the floor's run).
    observe: Callable[[harness.Cluster, int | None], Observer] | None = None

    @property
    def job(self) -> str:
        """podagent's and the floor's job, a command line: symmetric-run's entrypoint."""
        if not self.job_seconds:
            return TRIVIAL_JOB
        return shlex.join([sys.executable, "-c", self.entry_code])

    @property
    def entry_code(self) -> str:
        """symmetric-run's entrypoint: it says when it starts and ends, and sleeps between."""
        stamp = "repr(time.time()), flush=True"
        return (f"import time; print({ENTRY_MARKER!r}, {stamp}); time.sleep({self.job_seconds:g});"
                f" print({EXIT_MARKER!r}, {stamp})")


def marker_time(text: str, name: str) -> float | None:
    """The time.time() a job printed after `name` (first such line), None before it did."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def observe(setup: Setup, c: harness.Cluster, pid: int | None) -> Observer | None:
    return setup.observe(c, pid) if setup.observe else None


def finish(observer: Observer | None, run: Run, marks: dict[str, float | None]) -> None:
    if observer is not None:
        run.extra["observed"] = observer.finish(marks)


# --- records ------------------------------------------------------------------------------------


@dataclass
class Run(benchkit.RunRecord):
    # seconds: the method's metric (t0 -> job submitted / entrypoint)
    method: str  # podagent | floor | symmetric | headloss
    n: int  # workers
    index: int  # 1-based run number
    load_after: tuple[float, float, float] | None = None
    foreign_raylets: int = 0  # raylets on this machine not ours, at the start (other suites)


# --- method 1: podagent -------------------------------------------------------------------------


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


def run_podagent(run: Run, logdir: Path, timeout: float, setup: Setup = Setup()) -> None:
    n = run.n
    agents: list[Agent] = []
    with harness.cluster(n, setup.prefix, setup.subnet) as c:
        try:
            agents, t0 = harness.start_agents(
                c, logdir,
                # The floor starts no reward server: compare the bring-up alone.
                head_env={"EXPECTED_WORKERS": str(n), "PODAGENT_JOB": setup.job,
                          "PODAGENT_REWARD": "none",
                          "PODAGENT_WORKER_TIMEOUT": str(int(timeout - 30)), **setup.env},
                worker_env={"PODAGENT_HEAD_TIMEOUT": str(int(timeout - 30)), **setup.env})
            head = agents[0]
            observer = observe(setup, c, head.proc.pid)
            try:
                harness.wait_agents_exit(agents, timeout=max(1.0, t0 + timeout - time.time()))
            except TimeoutError as exc:
                run.exit_codes = harness.exit_codes(agents)
                raise RunFailed(str(exc), last_lines(head.output)) from None
            run.exit_codes = harness.exit_codes(agents)
            events = harness.read_events(benchkit.pod_events(logdir / "head" / "bench"))
            submitted = [e for e in events
                         if e.get("event") == "job_submitted" and e.get("result") == "ok"]
            run.extra["join_latency_s"], run.extra["join_after_polling_s"] = (
                join_latencies(events))
            run.extra["steps_s"] = {e["event"]: e.get("duration_s") for e in events
                                    if "duration_s" in e}
            if submitted:
                run.seconds = round(submitted[0]["ts"] - t0, 3)
            moments = {e["event"]: e["ts"] for e in events
                       if e.get("event") in ("ray_head", "job_submitted", "job_finished")}
            if "job_finished" in moments:
                run.extra["finished_s"] = round(moments["job_finished"] - t0, 3)
            ended = marker_time(harness.read_text(head.run_dir / "job.log"),
                                EXIT_MARKER)
            if ended is not None:  # the job's own last line
                run.extra["job_end_s"] = round(ended - t0, 3)
            finish(observer, run, {"t0": t0, "up": moments.get("ray_head"),
                                   "submitted": moments.get("job_submitted"),
                                   "finished": moments.get("job_finished")})
            bad = {k: v for k, v in run.exit_codes.items() if v != 0}
            if bad or not submitted:
                who = next(iter(bad), "head")
                agent = next(a for a in agents if a.pod.name == who)
                what = f"exit codes {bad}" if bad else "no job_submitted event"
                raise RunFailed(f"{what}: {who}: {reason_line(agent.output)}",
                                last_lines(head.output))
            run.ok = True
        finally:
            harness.close_agents(agents)


# --- method 2: the bare floor -------------------------------------------------------------------


def run_floor(run: Run, logdir: Path, timeout: float, setup: Setup = Setup()) -> None:
    n = run.n
    env = harness.pod_env(**setup.env)
    stop = threading.Event()
    joins: dict[str, dict[str, Any]] = {}
    threads: list[threading.Thread] = []
    with harness.cluster(n, setup.prefix, setup.subnet) as c:
        head = c.head
        head_log = logdir / "head.out"

        def join(pod: Pod, deadline: float) -> None:
            """The bare worker: `ray start --address` again until it exits 0 (bounded)."""
            state = joins[pod.name]
            argv = c.ray_start(pod)

            def attempt() -> int:
                state["attempts"] += 1
                return harness.run_in_pod(pod, argv, env, logdir / f"{pod.name}.out",
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
            head_argv = c.ray_start(head, "--dashboard-host", head.ip)
            t0 = time.time()
            deadline = t0 + timeout
            # The head's `ray start` first, then the workers' loops, all at once.
            head_rc: dict[str, int] = {}
            head_thread = threading.Thread(
                target=lambda: head_rc.setdefault(
                    "rc", harness.run_in_pod(head, head_argv, env, head_log,
                                             deadline - time.time())),
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
                                f"{reason_line(harness.read_text(head_log))}",
                                last_lines(harness.read_text(head_log)))

            run.extra["head_up_s"] = round(time.time() - t0, 3)
            observer = observe(setup, c, None)
            # The GCS is up now: a client made before that would sit in gRPC's reconnect
            # back-off and add up to a second to the floor.
            gcs = GcsClient(f"{head.ip}:{harness.RAY_PORT}")
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
                    tails = {p: reason_line(harness.read_text(logdir / f"{p}.out")) for p in joins}
                    raise RunFailed(f"{exc}; workers: {tails}",
                                    last_lines(harness.read_text(head_log))) from None
            finally:
                gcs.close()
            run.extra["nodes_alive_s"] = round(time.time() - t0, 3)

            dashboard = f"http://{head.ip}:{harness.DASHBOARD_PORT}"
            job_id = f"floor-{secrets.token_hex(4)}"
            submit = [harness.RAY, "job", "submit", "--address", dashboard, "--no-wait",
                      "--submission-id", job_id, "--", *shlex.split(setup.job)]
            attempts = {"n": 0}

            def submit_once() -> int:
                attempts["n"] += 1
                return harness.run_in_pod(head, submit, env, logdir / "submit.out",
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
                text = harness.read_text(logdir / "submit.out")
                raise RunFailed(f"`ray job submit` exit {rc}: {reason_line(text)}",
                                last_lines(text))
            run.seconds = round(submitted - t0, 3)
            ended = job_ended(dashboard, job_id, deadline) if setup.until_finished else None
            if ended is not None:
                run.extra["finished_s"] = round(ended - t0, 3)
                with contextlib.suppress(requests.RequestException, ValueError, TypeError):
                    logs = requests.get(f"{dashboard}/api/jobs/{job_id}/logs", timeout=5.0)
                    run.extra["job_end_s"] = round(
                        marker_time(logs.json()["logs"], EXIT_MARKER) - t0, 3)
            finish(observer, run, {"t0": t0, "submitted": submitted, "finished": ended})
            run.ok = True
        finally:
            stop.set()
            harness.kill_everything(c)
            for t in threads:
                t.join(timeout=15)


def job_ended(dashboard: str, job_id: str, deadline: float) -> float:
    """When the Jobs API first says the job succeeded (asked every 0.1 s)."""
    def status() -> str:
        reply = requests.get(f"{dashboard}/api/jobs/{job_id}", timeout=2.0)
        state = reply.json().get("status", "") if reply.ok else ""
        if state in ("FAILED", "STOPPED"):
            raise RunFailed(f"the floor's job ended {state}")
        return state == "SUCCEEDED"

    try:
        wait_for(status, timeout=max(1.0, deadline - time.time()), interval=0.1,
                 what=f"job {job_id} to succeed", ignore=(requests.RequestException, ValueError))
    except TimeoutError as exc:
        raise RunFailed(str(exc)) from None
    return time.time()


# --- method 3: ray symmetric-run ----------------------------------------------------------------


def write_shim(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    shim = directory / "ray"
    shim.write_text(_RAY_SHIM.format(python=sys.executable))
    shim.chmod(0o755)
    return shim


def run_symmetric(run: Run, logdir: Path, timeout: float, setup: Setup = Setup()) -> None:
    n = run.n
    procs: dict[str, subprocess.Popen[Any]] = {}
    files = []
    with harness.cluster(n, setup.prefix, setup.subnet) as c:
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
                    str(shim), "symmetric-run", "--address", f"{c.head.ip}:{harness.RAY_PORT}",
                    "--min-nodes", str(n + 1), "--num-gpus", "0", "--disable-usage-stats",
                    "--temp-dir", f"{c.tmp[pod.name]}/ray", "--", sys.executable, "-c",
                    setup.entry_code]
                path = os.pathsep.join([str(bindir), harness.pod_env()["PATH"]])
                envs[pod.name] = harness.pod_env(**setup.env, PATH=path,
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
                seen = marker_time(harness.read_text(outs[c.head.name]), ENTRY_MARKER)
                if seen is not None:
                    return seen
                if head.poll() is not None:
                    text = harness.read_text(outs[c.head.name])
                    raise RunFailed(f"head exited {head.returncode} before the entrypoint ran: "
                                    f"{reason_line(text)}", last_lines(text))
                return None

            try:
                entry = wait_for(marker, timeout=max(1.0, t0 + timeout - time.time()),
                                 interval=0.1, what="the head's entrypoint marker")
            except TimeoutError as exc:
                text = harness.read_text(outs[c.head.name])
                raise RunFailed(f"{exc}: {reason_line(text)}", last_lines(text)) from None
            except RunFailed as exc:
                failed = {p.name: reason_line(harness.read_text(outs[p.name])) for p in c.workers
                          if procs[p.name].poll() not in (None, 0)}
                if failed:
                    exc.reason += "; workers: " + "; ".join(f"{k}: {v}" for k, v in failed.items())
                raise
            run.seconds = round(entry - t0, 3)
            with contextlib.suppress(subprocess.TimeoutExpired):
                head.wait(timeout=60 + setup.job_seconds)
            run.exit_codes = {name: p.poll() for name, p in procs.items()}
            ended = marker_time(harness.read_text(outs[c.head.name]), EXIT_MARKER)
            if ended is not None:  # the entrypoint is the job: its end is when it ended
                run.extra["finished_s"] = run.extra["job_end_s"] = round(ended - t0, 3)
            if head.returncode != 0:
                text = harness.read_text(outs[c.head.name])
                raise RunFailed(f"head exit {head.returncode} after the entrypoint: "
                                f"{reason_line(text)}", last_lines(text))
            run.ok = True
        finally:
            if not run.exit_codes:
                run.exit_codes = {name: p.poll() for name, p in procs.items()}
            worker_errors = {}
            for pod in c.workers:
                text = harness.read_text(logdir / f"{pod.name}.out")
                if "Error" in text or "Timed out" in text or "Exception" in text:
                    worker_errors[pod.name] = reason_line(text)
            if worker_errors:
                run.extra["worker_errors"] = worker_errors
            harness.kill_everything(c)
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
    with harness.cluster(n) as c:
        try:
            agents, t0 = harness.start_agents(
                c, logdir,
                head_env={"EXPECTED_WORKERS": str(n), "PODAGENT_JOB": LONG_JOB,
                          "PODAGENT_WORKER_TIMEOUT": str(int(timeout - 30))},
                # exit 7 on the lost head (the measure), not wait for it to come back
                worker_env={"PODAGENT_HEAD_GRACE": f"{grace:g}", "PODAGENT_REJOIN": "0",
                            "PODAGENT_HEAD_TIMEOUT": str(int(timeout - 30))})
            head, workers = agents[0], agents[1:]
            try:
                head.wait_output("training", timeout=max(1.0, t0 + timeout - time.time()))
                for w in workers:
                    w.wait_output("watching the head", timeout=60)
            except (TimeoutError, AssertionError) as exc:
                run.exit_codes = harness.exit_codes(agents)
                raise RunFailed(str(exc).splitlines()[0], last_lines(head.output)) from None
            run.extra["formed_s"] = round(time.time() - t0, 3)
            events = harness.read_events(benchkit.pod_events(logdir / "head" / "bench"))
            run.extra["join_latency_s"], run.extra["join_after_polling_s"] = (
                join_latencies(events))
            if footprint:
                run.extra["footprint"] = sample_footprint(workers, FOOTPRINT_WINDOW)
            if any(w.proc.poll() is not None for w in workers):
                raise RunFailed(f"a worker exited while idle: {harness.exit_codes(workers)}")

            killed = time.monotonic()
            harness.kill_pod(c.head)
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
                run.exit_codes = harness.exit_codes(workers)
                raise RunFailed(str(exc), last_lines(workers[0].output)) from None
            run.exit_codes = harness.exit_codes(workers)
            run.extra["worker_exit_s"] = exited
            run.extra["leftover_pids"] = {w.pod.name: w.pod.pids() for w in workers}
            run.seconds = max(exited.values())
            bad = {k: v for k, v in run.exit_codes.items() if v != harness.EXIT_HEAD_LOST}
            if bad:
                who = next(iter(bad))
                agent = next(a for a in workers if a.pod.name == who)
                raise RunFailed(f"worker exit codes {bad} (expected {harness.EXIT_HEAD_LOST}): "
                                f"{reason_line(agent.output)}", last_lines(agent.output))
            run.ok = True
        finally:
            harness.close_agents(agents)


# --- driver -------------------------------------------------------------------------------------


def observed(body: benchkit.Body[Run]) -> benchkit.Body[Run]:
    """The body, with what else ran on the machine around it: other suites' raylets at its
    start, the load average at its end."""

    def run_body(run: Run, logdir: Path) -> None:
        run.foreign_raylets = benchkit.foreign_raylets()
        try:
            body(run, logdir)
        finally:
            run.load_after = os.getloadavg()

    return run_body


def log_name(run: Run) -> str:
    name = f"{run.method}-n{run.n}-r{run.index}"
    return name + (f"-g{run.extra['grace_s']:g}" if "grace_s" in run.extra else "")


def line(run: Run, total: int) -> str:
    label = run.method + (f" grace={run.extra['grace_s']:g}" if "grace_s" in run.extra else "")
    return benchkit.status_line(run, f"{label:<20} N={run.n} run {run.index}/{total}",
                                note=f", other raylets {run.foreign_raylets}")


# --- tables -------------------------------------------------------------------------------------


def median_of(runs: list[Run], method: str, n: int) -> float | None:
    values = [r.seconds for r in runs if r.method == method and r.n == n and r.ok]
    return median(values)


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
                         fmt(median(values)),
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
                         fmt(median(after), 3),
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
                         fmt(median([r.extra["head_up_s"] for r in floor])),
                         fmt(median([r.extra["nodes_alive_s"] for r in floor]))])
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
                     fmt(median(values)),
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


def rerender(directory: Path) -> int:
    saved = benchkit.saved_results(directory)
    runs = []
    for record in saved["runs"]:
        record["reason"] = benchkit.ANSI.sub("", record.get("reason", ""))
        run = Run(**record)
        logs = directory / run.logs
        if not run.ok and run.method == "symmetric" and logs.is_dir():
            # Reasons as the current reason_line picks them, from the saved outputs.
            head = reason_line(harness.read_text(logs / "head.out"))
            outputs = {p.stem: harness.read_text(p) for p in sorted(logs.glob("w*.out"))}
            workers = {name: reason_line(text) for name, text in outputs.items()
                       if "Exception" in text or "Error" in text}
            run.extra["worker_errors"] = workers
            run.reason = (run.reason.split(":", 1)[0] + ": " + head
                          + ("; workers: " + "; ".join(f"{k}: {v}" for k, v in workers.items())
                             if workers else ""))
        runs.append(run)
    return benchkit.rerender(directory, runs, saved, render)


def main(argv: list[str] | None = None) -> int:
    parser = benchkit.bench_parser(__doc__, per="method and N", methods=(*METHODS, "headloss"),
                                   run_timeout="each run")
    parser.add_argument("--workers", type=benchkit.parse_ints, default=[1, 2, 4],
                        help="worker counts N (default 1,2,4)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke check: N=1, one run each, head loss with the default grace")
    parser.add_argument("--head-loss-workers", type=benchkit.parse_ints, default=[1, 2],
                        help="N for the head-loss runs (default 1,2)")
    parser.add_argument("--head-loss-grace", type=benchkit.parse_floats, default=[8.0, 5.0],
                        help="PODAGENT_HEAD_GRACE values for the head-loss runs (default 8,5)")
    parser.add_argument("--report", type=Path, metavar="DIR",
                        help="print and rewrite DIR/results.md from DIR/results.json; run nothing")
    args = parser.parse_args(argv)
    if args.report:
        return rerender(args.report)
    if args.quick:
        args.workers, args.runs = [1], 1
        args.head_loss_workers, args.head_loss_grace = [1], [8.0]
    benchkit.require_root(parser)

    from ray.core.generated import gcs_pb2, gcs_service_pb2  # noqa: F401 - warm: no import in t

    outdir, meta = benchkit.begin(args.out)
    bodies: dict[str, benchkit.Body[Run]] = {
        "podagent": lambda r, d: run_podagent(r, d, args.run_timeout),
        "floor": lambda r, d: run_floor(r, d, args.run_timeout),
        "symmetric": lambda r, d: run_symmetric(r, d, args.run_timeout),
    }

    def plan() -> Iterator[tuple[Run, str, benchkit.Body[Run]]]:
        for n in args.workers:
            for i in range(1, args.runs + 1):
                for method in (m for m in args.methods if m in METHODS):
                    run = Run(method, n, i)
                    yield run, log_name(run), observed(bodies[method])
        if "headloss" in args.methods:
            for n in args.head_loss_workers:
                for g_index, grace in enumerate(args.head_loss_grace):
                    run = Run("headloss", n, 1, extra={"grace_s": grace})
                    yield run, log_name(run), observed(
                        lambda r, d, g=grace, fp=(g_index == 0): run_headloss(
                            r, d, args.run_timeout, g, fp))

    runs = benchkit.execute_all(plan(), outdir,
                                lambda r: line(r, 1 if r.method == "headloss" else args.runs))
    meta["foreign_max"] = max((r.foreign_raylets for r in runs), default=0)
    return benchkit.finish(runs, outdir, meta, args, render)


if __name__ == "__main__":
    sys.exit(main())
