"""Runs without Ray: how fast every pod is out after one is lost, podagent beside the plain
launcher, with the same gloo DDP loop (tests/jobs/ddp_loop.py, one rank per pod, 0.1 s steps).

Each run is three fresh pods (head + two workers: network namespaces with a real DNS server, as
in the end-to-end tests: tests/harness/). Once every rank has made a step, worker w1 is lost:

* kill: every process of the pod gets SIGKILL (its address still answers, with refusals);
* cut: its link goes down (nothing answers at all); once measured, its processes are killed.

Measured: seconds from the loss (right after the kill or the link-down returned) to the exit of
the last other pod's process, polled every 50 ms: podagent's own process for
`podagent-torchrun` / `podagent-accelerate` (the same command on every pod), the launcher's
for `plain-torchrun` / `plain-accelerate` (`python -m torch.distributed.run ...` /
`python -m accelerate.commands.launch ...`, every per-machine value typed in). A plain launcher
still running after --cap seconds is recorded as capped (a cut leaves gloo waiting for its own
timeout, far longer) and killed.

Also, on the first run of each podagent method (before its fault): podagent's own process on the
head and on a worker (not its children) sampled for --sample-seconds of the healthy run: CPU
(cpu_times delta / wall) and RSS, with the launcher's RSS beside it for scale.

Needs root and iproute2. Run from the repository root with the project's virtual environment:

    python bench/no_ray.py [--runs 3] [--cap 60] [--methods ...] [--faults kill,cut]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from podagent import errors
from podagent.run import exits
from tests.harness import benchkit
from tests.harness import cluster as harness
from tests.harness.agents import Agent
from tests.harness.benchkit import RunFailed, last_lines, median, table
from tests.harness.pods import _ip, wait_for

METHODS = ("podagent-torchrun", "plain-torchrun", "podagent-accelerate", "plain-accelerate")
FAULTS = ("kill", "cut")
LOOP = Path(__file__).resolve().parents[1] / "tests" / "jobs" / "ddp_loop.py"
FOREVER = ("--steps", "100000", "--step-seconds", "0.1")  # outlives every measurement
TORCH_PORT = 29500  # torch's rendezvous / accelerate's main process port on the head
# torch looks up the host name of every TCPStore peer; pods reach no name server of this
# machine's resolv.conf, so one quick try instead of glibc's 2 x 5 s (as in the e2e tests).
QUICK_RESOLVER = {"RES_OPTIONS": "timeout:1 attempts:1"}
PEER_LOST = next(code for cls, code, _ in exits.EXIT_CODES if cls is errors.PeerLost)
SLOW_PODAGENT_S = 15.0  # the acceptance's bound on podagent's exits after a loss
POLL_S = 0.05


@dataclass
class Run(benchkit.RunRecord):
    method: str
    fault: str
    index: int
    capped: bool = False  # a pod's process still ran at --cap

    @property
    def label(self) -> str:
        return f"{self.method} {self.fault}"


# --- what runs in each pod -------------------------------------------------------------------


def podagent_agents(c: harness.Cluster, logdir: Path, launcher: str, out: Path) -> list[Agent]:
    """podagent in every pod, the same command on each (head first in the list)."""
    script = (str(LOOP), str(out), *(("--accelerate",) if launcher == "accelerate" else ()),
              *FOREVER)
    argv = (launcher, "--", *script) if launcher == "torchrun" else (launcher, *script)
    env = {"PATH": harness.pod_env()["PATH"], "PODAGENT_RUN_NAME": "bench",
           "HEAD_POD_ID": c.head.pod_id, "EXPECTED_WORKERS": str(len(c.workers)),
           **QUICK_RESOLVER}
    agents = [Agent(pod, c.dns, logdir, env, argv) for pod in c.pods]
    for a in agents:
        a.ray_tmp = c.tmp[a.pod.name]  # removed with the cluster
        a.env["PODAGENT_RAY_TEMP_DIR"] = a.ray_tmp
    return agents


def plain_argv(c: harness.Cluster, rank: int, launcher: str, out: Path) -> tuple[str, ...]:
    """The launcher's own command for pod `rank` (0: the head), every value typed in."""
    pod, nodes = c.pods[rank], str(len(c.pods))
    if launcher == "torchrun":
        return (sys.executable, "-m", "torch.distributed.run", "--nnodes", nodes,
                "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{c.head.ip}:{TORCH_PORT}", "--rdzv-id", "bench",
                "--rdzv-conf", f"is_host={1 if rank == 0 else 0}", "--local-addr", pod.ip,
                str(LOOP), str(out), *FOREVER)
    return (sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
            "--num_machines", nodes, "--machine_rank", str(rank), "--main_process_ip",
            c.head.ip, "--main_process_port", str(TORCH_PORT), "--num_processes", nodes,
            str(LOOP), str(out), "--accelerate", *FOREVER)


def plain_agents(c: harness.Cluster, logdir: Path, launcher: str, out: Path) -> list[Agent]:
    """The plain launcher in every pod, in an Agent's clothes (its start, output, kill and
    close), with no podagent variable: this machine's environment, the venv first on PATH,
    the quick resolver, and the interface gloo must use (podagent sets it for its own runs; the
    host name here resolves to loopback)."""
    agents = []
    for rank, pod in enumerate(c.pods):
        a = Agent(pod, c.dns, logdir, {})
        a.env = harness.pod_env(**QUICK_RESOLVER, GLOO_SOCKET_IFNAME=pod.ifname,
                                **({"ACCELERATE_USE_CPU": "true"}
                                   if launcher == "accelerate" else {}))
        a.argv = plain_argv(c, rank, launcher, out)
        agents.append(a)
    return agents


def start(agents: list[Agent], logdir: Path) -> None:
    for a in reversed(agents):  # the workers first: they wait for the head
        a.start()
        with open(logdir / f"{a.pod.name}.argv", "w") as f:
            f.write(" ".join(a.argv) + "\n")


def under_way(agents: list[Agent], out: Path, timeout: float) -> None:
    """Every rank has made a step (each writes its file after its first)."""
    def started() -> bool:
        for a in agents:
            if a.proc is not None and a.proc.poll() is not None:
                raise RunFailed(f"{a.pod.name} exited {a.proc.returncode} before the run was "
                                f"under way", last_lines(a.output))
        return all((out / f"rank{r}.json").exists() for r in range(len(agents)))

    try:
        wait_for(started, timeout=timeout, interval=0.2, what="every rank's first step")
    except TimeoutError as exc:
        raise RunFailed(str(exc), last_lines(agents[0].output)) from None


# --- the healthy run's cost ----------------------------------------------------------------------


def launcher_of(proc: psutil.Process) -> psutil.Process | None:
    """podagent's child that is the launcher (the ranks are the launcher's children)."""
    for child in proc.children():
        try:
            cmdline = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "torch.distributed.run" in cmdline or "accelerate" in cmdline:
            return child
    return None


def rss_mib(proc: psutil.Process | None) -> float | None:
    if proc is None:
        return None
    try:
        return proc.memory_info().rss / 2**20
    except psutil.Error:
        return None


def sample(agents: list[Agent], seconds: float) -> dict[str, dict[str, Any]]:
    """podagent's own process of each agent (not its children) over `seconds`: CPU % of a core
    (cpu_times user + system delta / wall), RSS (median, max) and the launcher's RSS (median),
    read every 0.5 s."""
    procs = {a.pod.name: psutil.Process(a.proc.pid) for a in agents}
    cpu0 = {n: sum(p.cpu_times()[:2]) for n, p in procs.items()}
    rss: dict[str, list[float]] = {n: [] for n in procs}
    launcher_rss: dict[str, list[float]] = {n: [] for n in procs}
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        for name, p in procs.items():
            for into, value in ((rss, rss_mib(p)), (launcher_rss, rss_mib(launcher_of(p)))):
                if value is not None:
                    into[name].append(value)
        time.sleep(0.5)  # a sampling period, not a readiness wait
    wall = time.monotonic() - t0
    return {name: {"cpu_pct": round(100 * (sum(p.cpu_times()[:2]) - cpu0[name]) / wall, 2),
                   "rss_median_mib": median(rss[name], 1), "rss_max_mib":
                   round(max(rss[name]), 1) if rss[name] else None,
                   "launcher_rss_mib": median(launcher_rss[name], 1), "seconds": round(wall, 1)}
            for name, p in procs.items()}


# --- a run ---------------------------------------------------------------------------------------


def lose(agent: Agent, fault: str) -> float:
    """The fault on the pod; the moment it returned (monotonic)."""
    if fault == "kill":
        agent.kill_pod()
    else:
        _ip("link", "set", agent.pod.host_veth, "down")
    return time.monotonic()


def await_exits(agents: list[Agent], since: float, cap: float) -> dict[str, float | None]:
    """Seconds from `since` to each agent's process exit (None: still running at `cap`)."""
    exits: dict[str, float | None] = {a.pod.name: None for a in agents}
    while time.monotonic() - since < cap:
        for a in agents:
            if exits[a.pod.name] is None and a.proc.poll() is not None:
                exits[a.pod.name] = round(time.monotonic() - since, 3)
        if all(v is not None for v in exits.values()):
            break
        time.sleep(POLL_S)
    return exits


def run_one(run: Run, logdir: Path, timeout: float, cap: float, sample_s: float) -> None:
    kind, launcher = run.method.split("-")
    out = logdir / "ranks"
    out.mkdir()
    with harness.cluster(2) as c:
        make = podagent_agents if kind == "podagent" else plain_agents
        agents = make(c, logdir, launcher, out)
        try:
            start(agents, logdir)
            under_way(agents, out, timeout)
            if kind == "podagent" and sample_s > 0 and run.index == 1 and run.fault == "kill":
                run.extra["footprint"] = sample(agents[:2], sample_s)
                under_way(agents, out, 1.0)  # still healthy after the sampling
            lost, others = agents[1], [agents[0], *agents[2:]]
            since = lose(lost, run.fault)
            exits = await_exits(others, since, cap)
            run.extra["exit_s"] = exits
            run.exit_codes = harness.exit_codes(agents)
            run.capped = any(v is None for v in exits.values())
            run.seconds = cap if run.capped else max(v for v in exits.values() if v is not None)
            if kind == "podagent":
                check_podagent(run, others)
            run.ok = True
        finally:
            for a in agents:  # nothing may outlive the run: every pod's processes, then ours
                a.kill_pod()
            harness.close_agents(agents)


def check_podagent(run: Run, others: list[Agent]) -> None:
    """podagent's pods must all be out, with the lost pod's exit code; a slow exit keeps the
    pods' last lines (a bug to look at)."""
    if run.seconds is not None and run.seconds > SLOW_PODAGENT_S:
        run.extra["slow_tails"] = {a.pod.name: last_lines(a.output, 30) for a in others}
    wrong = {a.pod.name: a.proc.poll() for a in others if a.proc.poll() != PEER_LOST}
    if wrong:
        raise RunFailed(f"exit codes {wrong}, expected {PEER_LOST} (pod lost)",
                        last_lines(others[0].output))


# --- tables --------------------------------------------------------------------------------------


def seconds_of(runs: list[Run], method: str, fault: str) -> list[float]:
    """The runs' figures; a capped run counts as infinity (it never exited)."""
    return [math.inf if r.capped else r.seconds for r in runs
            if r.method == method and r.fault == fault and r.ok and r.seconds is not None]


def shown(value: float | None, cap: float) -> str:
    if value is None:
        return "-"
    return f"> {cap:g}" if math.isinf(value) else f"{value:.2f}"


def loss_rows(runs: list[Run], args: argparse.Namespace) -> list[list[str]]:
    rows = []
    for fault in args.faults:
        for method in args.methods:
            values = seconds_of(runs, method, fault)
            if not values:
                continue
            mid = median(values)
            versus = ""
            if method.startswith("podagent"):
                plain = median(seconds_of(runs, method.replace("podagent", "plain"), fault))
                if plain is not None and math.isinf(plain):
                    versus = f"capped (plain > {args.cap:g} s)"
                elif plain is not None and mid:
                    versus = f"{plain / mid:.1f}×"
            rows.append([method, fault, str(len(values)), shown(mid, args.cap),
                         shown(min(values), args.cap), shown(max(values), args.cap), versus])
    return rows


def footprint_rows(runs: list[Run]) -> list[list[str]]:
    rows = []
    for run in runs:
        for pod, f in run.extra.get("footprint", {}).items():
            rows.append([run.method, pod, f"{f['seconds']:g}", f"{f['cpu_pct']:.2f}",
                         benchkit.fmt(f["rss_median_mib"], 1), benchkit.fmt(f["rss_max_mib"], 1),
                         benchkit.fmt(f["launcher_rss_mib"], 1)])
    return rows


def render(runs: list[Run], args: argparse.Namespace, meta: dict[str, Any]) -> str:
    out = [f"### Runs without Ray: a lost pod ({meta['started']})", "",
           f"{meta['machine']}; podagent {meta['podagent']} (commit {meta['commit']}); "
           f"{args.runs} run(s) each; load average {meta['load_min']:.1f}-"
           f"{meta['load_max']:.1f} at run starts.", "",
           "Seconds from worker w1's loss to the last other pod's process exit (podagent's, "
           "or the plain launcher's); 3 pods, a gloo DDP loop, one rank per pod. "
           f"`> {args.cap:g}`: still running at the cap, then killed.", "",
           table(["method", "fault", "runs", "median s from loss to last exit", "min", "max",
                  "vs plain (plain / podagent)"], loss_rows(runs, args)), ""]
    prints = footprint_rows(runs)
    if prints:
        out += ["podagent's own process (not its children) during a healthy run; the "
                "launcher's RSS beside it for scale.", "",
                table(["method", "pod", "window s", "podagent CPU % of a core",
                       "podagent RSS MiB (median)", "max", "launcher RSS MiB"], prints), ""]
    slow = [r for r in runs if r.extra.get("slow_tails")]
    for r in slow:
        out += [f"podagent run {r.label} #{r.index} took {r.seconds:.1f} s "
                f"(> {SLOW_PODAGENT_S:g} s); the pods' last lines are in results.json.", ""]
    return benchkit.join_report(out, runs, label=lambda r: r.label)


def line(run: Run, total: int) -> str:
    figure = f"> {run.seconds:g} s" if run.capped and run.seconds is not None else None
    return benchkit.status_line(run, f"{run.label:<26} run {run.index}/{total}", figure)


def report(runs: list[Run], args: argparse.Namespace, meta: dict[str, Any]) -> str:
    """The report, after the pods' last lines of each slow podagent run: those go on screen
    only, ahead of the table that names the slow runs."""
    for r in runs:
        for pod, tail in r.extra.get("slow_tails", {}).items():
            print(f"--- {r.label} #{r.index}: {pod}'s last lines", *tail, sep="\n", flush=True)
    return render(runs, args, meta)


def plan(args: argparse.Namespace) -> Iterator[tuple[Run, str, benchkit.Body[Run]]]:
    for i, fault, method in benchkit.rounds(args.runs, args.faults, args.methods):
        yield (Run(method, fault, i), f"{method}-{fault}-r{i}",
               lambda r, d: run_one(r, d, args.run_timeout, args.cap, args.sample_seconds))


def main(argv: list[str] | None = None) -> int:
    parser = benchkit.bench_parser(__doc__, methods=METHODS, run_timeout="each run's start")
    parser.add_argument("--faults", type=benchkit.parse_methods(FAULTS), default=list(FAULTS),
                        help="kill,cut (default: both)")
    parser.add_argument("--cap", type=float, default=60.0,
                        help="longest wait for the pods to exit after the loss (default 60)")
    parser.add_argument("--sample-seconds", type=float, default=20.0,
                        help="the healthy run's sampling window (default 20; 0: none)")
    return benchkit.run_all(parser, argv, "no-ray-", plan, line, report)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
