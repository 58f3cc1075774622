"""Hung ranks and lost pods on K pods of one host, one GPU each (bench/gpu_pods.py's pods: a
network namespace per pod, NCCL over sockets): how long from the hang (or the kill) until
podagent found it, dumped every rank's stack, and every GPU was free again, on both paths;
and what the watch costs a healthy run.

    python bench/gpu_hang.py --pods 4                 # root, K GPUs, torch, Ray, pyroute2
    python bench/gpu_hang.py --pods 3 --cpu           # the same flow with gloo, without GPUs

Scenarios (--scenarios, all by default):
  torchrun-hang  `podagent torchrun` on every pod, a DDP loop (tests/jobs/hang_loop.py) whose
                 last rank sleeps before its all-reduce on the first attempt: found, every
                 rank dumped, the sleeping rank named, every GPU free, the loop restarted from
                 its checkpoint and finished (exit 0 everywhere).
  torchrun-kill  the same loop, the sleeping rank's pod SIGKILLed while the others wait in
                 NCCL: every other pod out (PeerLost, 22) within 15 s, every GPU free.
  ray-hang       `podagent head/worker` and the cluster check with its hang drill on the last
                 rank: found, dumped on every pod, the actor named, every GPU free, the check
                 run again and passing (exit 0).
  ray-kill       the drill with the watch off, the drill rank's pod SIGKILLed while the others
                 wait in NCCL (PODAGENT_RESTARTS=0): the head out (16) and the workers out
                 within 15 s, every GPU free.
  healthy        the loop without a hang, the watch off then on (a short timeout): never
                 tripped; podagent's own CPU seconds and memory on the head, off vs on.
  check          the cluster check with a short hang timeout: passes, never tripped.

"found": the hang began (the sleeping rank's mark; for the drill, its line in the job's log)
→ the head's `hang` event; "dump": that event's own time for every pod's stacks; "free": the
hang (or the kill) → no process left with a GPU open (with --cpu: no rank left).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import gpu_pods as pods  # noqa: E402

from tests.harness import benchkit  # noqa: E402
from tests.harness.benchkit import RunFailed, fmt, last_lines, median  # noqa: E402

HANG_LOOP = ROOT / "tests" / "jobs" / "hang_loop.py"
SCENARIOS = ("torchrun-hang", "torchrun-kill", "ray-hang", "ray-kill", "healthy", "check")
OUT_WITHIN = 15.0  # the bound: every other pod out this soon after a kill
EXIT = {"PeerLost": 22, "RestartsExhausted": 16, "RunHung": 25}
NVIDIA = re.compile(r"/dev/nvidia\d+$")
POLL = 0.1


@dataclass
class Case(benchkit.RunRecord):
    scenario: str
    index: int
    found_s: float | None = None  # the hang → the hang event
    quiet_s: float | None = None  # the silence the watch saw when it fired
    dump_s: float | None = None  # every pod's stacks, as the event says
    free_s: float | None = None  # the hang or the kill → no process on any GPU
    out_s: float | None = None  # the kill → the last other pod's podagent out
    culprit: str = ""
    resumed: bool | None = None
    cpu_s: float | None = None  # healthy: the head's podagent, CPU seconds (watch on)
    cpu_off_s: float | None = None  # ... with the watch off
    rss_mb: float | None = None
    rss_off_mb: float | None = None


# --- watching the pods from outside ------------------------------------------------------------


def gpu_holders(cpu: bool) -> list[int]:
    """Processes with a GPU open (with --cpu: the run's ranks, which hold none)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if cpu:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd = f.read()
                rank = b"hang_loop.py" in cmd and b"podagent" not in cmd \
                    and b"torch.distributed.run" not in cmd  # not the launcher or podagent
                if rank or cmd.startswith(b"ray::CheckRank"):
                    found.append(int(entry))
                continue
            for fd in os.listdir(f"/proc/{entry}/fd"):
                with contextlib.suppress(OSError):
                    if NVIDIA.match(os.readlink(f"/proc/{entry}/fd/{fd}")):
                        found.append(int(entry))
                        break
        except OSError:
            continue
    return found


def wait(until: Callable[[], Any], timeout: float, what: str, tail: Callable[[], str]) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = until()
        if value:
            return value
        time.sleep(POLL)
    raise RunFailed(f"{what}: not within {timeout:g} s", last_lines(tail()))


def events(logs: Path, i: int, name: str) -> list[dict[str, Any]]:
    path = benchkit.pod_events(logs / pods.pod_name(i) / pods.RUN_NAME)
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if record.get("event") == name:
                out.append(record)
    return out


def output(logs: Path, i: int) -> str:
    path = logs / f"{pods.pod_name(i)}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def proc_figures(pid: int) -> tuple[float, float] | None:
    """(CPU seconds, RSS MiB) of one process, now."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/status") as f:
            rss = next(int(x.split()[1]) for x in f if x.startswith("VmRSS:"))
    except (OSError, StopIteration, IndexError, ValueError):
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks, rss / 1024


# --- one cluster -------------------------------------------------------------------------------


class Cluster:
    """K pods started for one scenario: torchrun everywhere, or a Ray head and workers."""

    def __init__(self, k: int, cpu: bool, logs: Path, ray: bool, env: dict[str, str],
                 job: list[str] | None = None):
        self.k, self.cpu, self.logs = k, cpu, logs
        self.outs = [open(logs / f"{pods.pod_name(i)}.out", "w") for i in range(k)]
        self.procs: list[subprocess.Popen] = []
        for i in range(k):
            extra = {"EXPECTED_WORKERS": str(k - 1), **env}
            if i:
                extra.update(PODAGENT_HEAD_ADDR=pods.pod_ip(0), RAY_WORKER="1")
            else:
                extra["RAY_WORKER"] = "0"
            if cpu:
                extra["PODAGENT_CHECK_BACKEND"] = "gloo"
            argv = [sys.executable, "-m", "podagent"]
            argv += (["head" if i == 0 else "worker"] if ray
                     else ["torchrun", "--", *(job or [])])
            self.procs.append(pods.in_pod(pods.pod_name(i), argv,
                                          pods.pod_env(i, cpu, logs, extra),
                                          stdout=self.outs[i], stderr=subprocess.STDOUT))

    def head_output(self) -> str:
        return output(self.logs, 0)

    def wait_all(self, timeout: float) -> dict[str, int | None]:
        deadline = time.monotonic() + timeout
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
        return self.codes()

    def codes(self) -> dict[str, int | None]:
        return {pods.pod_name(i): p.poll() for i, p in enumerate(self.procs)}

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
        for out in self.outs:
            out.close()


def loop_job(out: Path, ckpt: Path, cpu: bool, hang_rank: int, steps: int) -> list[str]:
    return [str(HANG_LOOP), str(out), str(ckpt), "--steps", str(steps), "--hang-rank",
            str(hang_rank), "--hang-at", "8", "--step-seconds", "0.2",
            "--backend", "gloo" if cpu else "nccl"]


def first_free(cpu: bool, since: float, timeout: float, tail: Callable[[], str]) -> float:
    """Seconds from `since` (wall clock) until no process holds a GPU."""
    wait(lambda: not gpu_holders(cpu), timeout, "every GPU free", tail)
    return round(time.time() - since, 2)


def read_hang(case: Case, logs: Path, began: float) -> dict[str, Any]:
    [hang] = events(logs, 0, "hang")[:1] or [{}]
    if not hang:
        raise RunFailed("no hang event", last_lines(output(logs, 0)))
    case.found_s = round(hang["ts"] - began, 2)
    case.quiet_s, case.dump_s = hang.get("quiet_s"), hang.get("dump_s")
    case.culprit = ", ".join(f"{c['name']} on {c['pod']}" for c in hang.get("culprits", []))
    dumped = [s for d in hang.get("pods", {}).values() for s in d.get("stacks", [])]
    case.extra["stacks"] = len(dumped)
    case.extra["pods_dumped"] = len(hang.get("pods", {}))
    if len(hang.get("culprits", [])) != 1:
        raise RunFailed(f"culprits named: {hang.get('culprits')}", last_lines(output(logs, 0)))
    return hang


# --- the scenarios -----------------------------------------------------------------------------


def torchrun_hang(case: Case, logs: Path, args: argparse.Namespace) -> None:
    k, out, ckpt = args.pods, logs / "out", logs / "ckpt"
    out.mkdir()
    cluster = Cluster(k, args.cpu, logs, False, {
        "PODAGENT_HANG_TIMEOUT": f"{args.torchrun_timeout:g}",
        "PODAGENT_RESTART_BACKOFF": "5"}, loop_job(out, ckpt, args.cpu, k - 1, 30))
    try:
        marker = wait(lambda: (out / "hung").exists(), 240, "the rank's hang",
                      cluster.head_output)
        assert marker
        began = json.loads((out / "hung").read_text())["at"]
        wait(lambda: events(logs, 0, "hang"), args.torchrun_timeout + 60, "the hang event",
             cluster.head_output)
        case.free_s = first_free(args.cpu, began, 60, cluster.head_output)
        read_hang(case, logs, began)
        case.exit_codes = cluster.wait_all(300)
        case.resumed = "starting at step 8 (checkpoint: 7)" in cluster.head_output()
    finally:
        cluster.close()
    if set(case.exit_codes.values()) != {0} or not case.resumed:
        raise RunFailed(f"exit codes {case.exit_codes}, resumed {case.resumed}",
                        last_lines(output(logs, 0)))
    if f"rank {k - 1}" not in case.culprit:
        raise RunFailed(f"culprit {case.culprit}", last_lines(output(logs, 0)))
    case.seconds = case.found_s


def torchrun_kill(case: Case, logs: Path, args: argparse.Namespace) -> None:
    k, out, ckpt = args.pods, logs / "out", logs / "ckpt"
    out.mkdir()
    cluster = Cluster(k, args.cpu, logs, False, {"PODAGENT_HANG_TIMEOUT": "0"},
                      loop_job(out, ckpt, args.cpu, k - 1, 30))
    try:
        wait(lambda: (out / "hung").exists(), 240, "the rank's hang", cluster.head_output)
        time.sleep(2.0)  # the others are inside the step's all-reduce by now (0.2 s a step)
        killed = time.time()
        pods.kill_pod(pods.pod_name(k - 1))
        others = cluster.procs[:-1]
        wait(lambda: all(p.poll() is not None for p in others), 60, "every other pod out",
             cluster.head_output)
        case.out_s = round(time.time() - killed, 2)
        case.free_s = first_free(args.cpu, killed, 60, cluster.head_output)
        case.exit_codes = {n: c for n, c in cluster.codes().items()
                           if n != pods.pod_name(k - 1)}
    finally:
        cluster.close()
    if set(case.exit_codes.values()) != {EXIT["PeerLost"]} or case.out_s > OUT_WITHIN:
        raise RunFailed(f"exit codes {case.exit_codes} after {case.out_s} s",
                        last_lines(output(logs, 0)))
    case.seconds = case.out_s


def ray_hang(case: Case, logs: Path, args: argparse.Namespace) -> None:
    k = args.pods
    cluster = Cluster(k, args.cpu, logs, True, {
        "PODAGENT_HANG_TIMEOUT": f"{args.ray_timeout:g}", "PODAGENT_RESTART_BACKOFF": "5",
        "PODAGENT_CHECK_HANG_RANK": str(k - 1)})
    try:
        wait(lambda: events(logs, 0, "hang"), 300, "the hang event", cluster.head_output)
        [hang] = events(logs, 0, "hang")
        began = hang["ts"] - hang["quiet_s"]  # the drill's line: the last progress
        case.free_s = first_free(args.cpu, began, 60, cluster.head_output)
        read_hang(case, logs, began)
        case.exit_codes = cluster.wait_all(300)
        case.resumed = "ALL CHECKS PASSED" in cluster.head_output()
    finally:
        cluster.close()
    if set(case.exit_codes.values()) != {0} or not case.resumed:
        raise RunFailed(f"exit codes {case.exit_codes}, check passed on the restart: "
                        f"{case.resumed}", last_lines(output(logs, 0)))
    if "CheckRank" not in case.culprit:
        raise RunFailed(f"culprit {case.culprit}", last_lines(output(logs, 0)))
    case.seconds = case.found_s


def ray_kill(case: Case, logs: Path, args: argparse.Namespace) -> None:
    k = args.pods
    cluster = Cluster(k, args.cpu, logs, True, {
        "PODAGENT_HANG_TIMEOUT": "0", "PODAGENT_RESTARTS": "0",
        "PODAGENT_ON_NODE_LOSS": "restart", "PODAGENT_CHECK_HANG_RANK": str(k - 1)})
    try:
        wait(lambda: "hang drill" in cluster.head_output(), 300, "the drill rank's line",
             cluster.head_output)
        time.sleep(5.0)  # the ranks are inside the check's collectives by now
        killed = time.time()
        pods.kill_pod(pods.pod_name(k - 1))
        others = cluster.procs[:-1]
        wait(lambda: all(p.poll() is not None for p in others), 60, "every other pod out",
             cluster.head_output)
        case.out_s = round(time.time() - killed, 2)
        case.free_s = first_free(args.cpu, killed, 60, cluster.head_output)
        case.exit_codes = {n: c for n, c in cluster.codes().items()
                           if n != pods.pod_name(k - 1)}
    finally:
        cluster.close()
    head = case.exit_codes.get(pods.pod_name(0))
    if head != EXIT["RestartsExhausted"] or case.out_s > OUT_WITHIN:
        raise RunFailed(f"exit codes {case.exit_codes} after {case.out_s} s",
                        last_lines(output(logs, 0)))
    case.seconds = case.out_s


def healthy(case: Case, logs: Path, args: argparse.Namespace) -> None:
    """The same healthy loop twice, the watch off then on: podagent's own cost on the head."""
    for timeout, cpu_attr, rss_attr in (("0", "cpu_off_s", "rss_off_mb"),
                                        (f"{args.torchrun_timeout:g}", "cpu_s", "rss_mb")):
        run_logs = logs / f"watch-{'off' if timeout == '0' else 'on'}"
        (run_logs / "out").mkdir(parents=True)
        cluster = Cluster(args.pods, args.cpu, run_logs, False,
                          {"PODAGENT_HANG_TIMEOUT": timeout},
                          loop_job(run_logs / "out", run_logs / "ckpt", args.cpu, -1, 150))
        last: tuple[float, float] | None = None
        try:
            head = cluster.procs[0]
            while head.poll() is None:  # the in_pod wrapper execs podagent: same pid
                last = proc_figures(head.pid) or last
                time.sleep(0.5)
            case.exit_codes.update({f"{n} (watch {timeout})": c
                                    for n, c in cluster.wait_all(120).items()})
        finally:
            cluster.close()
        if events(run_logs, 0, "hang"):
            raise RunFailed(f"a healthy loop tripped the watch (timeout {timeout} s)",
                            last_lines(output(run_logs, 0)))
        if last:
            setattr(case, cpu_attr, round(last[0], 2))
            setattr(case, rss_attr, round(last[1], 1))
    if set(case.exit_codes.values()) != {0}:
        raise RunFailed(f"exit codes {case.exit_codes}", [])
    case.seconds = case.cpu_s


def check(case: Case, logs: Path, args: argparse.Namespace) -> None:
    cluster = Cluster(args.pods, args.cpu, logs, True,
                      {"PODAGENT_HANG_TIMEOUT": f"{args.ray_timeout:g}"})
    try:
        case.exit_codes = cluster.wait_all(300)
    finally:
        cluster.close()
    if set(case.exit_codes.values()) != {0} or events(logs, 0, "hang"):
        raise RunFailed(f"exit codes {case.exit_codes}, hang events "
                        f"{len(events(logs, 0, 'hang'))}", last_lines(output(logs, 0)))
    case.seconds = 0.0


BODIES = {"torchrun-hang": torchrun_hang, "torchrun-kill": torchrun_kill,
          "ray-hang": ray_hang, "ray-kill": ray_kill, "healthy": healthy, "check": check}


def one(case: Case, logs: Path, args: argparse.Namespace) -> None:
    pods.make_network(args.pods)
    try:
        BODIES[case.scenario](case, logs, args)
        case.ok = True
    finally:
        pods.remove_network()


# --- report -------------------------------------------------------------------------------------


def line(case: Case, total: int) -> str:
    figure = (f"found {fmt(case.found_s, 1)} s, dump {fmt(case.dump_s, 2)} s, free "
              f"{fmt(case.free_s, 1)} s, out {fmt(case.out_s, 1)} s")
    if case.scenario == "healthy":
        figure = (f"head podagent CPU {fmt(case.cpu_off_s)} s off / {fmt(case.cpu_s)} s on, "
                  f"RSS {fmt(case.rss_off_mb, 0)} / {fmt(case.rss_mb, 0)} MiB")
    return benchkit.status_line(case, f"{case.scenario} {case.index}/{total}", figure,
                                f"; {case.culprit}" if case.culprit else "")


def render(cases: list[Case], args: argparse.Namespace, meta: dict[str, Any]) -> str:
    backend = "gloo on CPUs" if args.cpu else "NCCL over sockets, one GPU per pod"
    out = [f"### {args.host or meta['machine']}: hangs and lost pods, K={args.pods} "
           f"({meta['started']})", "",
           f"{backend}; {meta['machine']}; Ray {meta['ray']}, torch {meta['torch']}, podagent "
           f"{meta['podagent']} (commit {meta['commit']}); {args.runs} run(s) per scenario, "
           f"medians; hang timeout {args.torchrun_timeout:g} s (torchrun), "
           f"{args.ray_timeout:g} s (Ray).", ""]
    rows = []
    for name in args.scenarios:
        mine = [c for c in cases if c.scenario == name and c.ok]

        def mid(attr: str, digits: int = 1, mine: list[Case] = mine) -> str:
            return fmt(median([getattr(c, attr) for c in mine
                               if getattr(c, attr) is not None]), digits)

        total = len([c for c in cases if c.scenario == name])
        culprit = sorted({c.culprit for c in mine if c.culprit})
        rows.append([name, mid("found_s"), mid("quiet_s"), mid("dump_s", 2), mid("free_s"),
                     mid("out_s"), "; ".join(culprit) or "-",
                     ", ".join(sorted({str(v) for c in mine for v in c.exit_codes.values()}))
                     or "-", f"{len(mine)}/{total}"])
    out += [benchkit.table(["scenario", "found s", "silence at fire s", "dump s", "GPUs free s",
                            "others out s", "named", "exit codes", "runs passed"], rows), ""]
    cost = [c for c in cases if c.scenario == "healthy" and c.ok]
    if cost:
        off = median([c.cpu_off_s for c in cost if c.cpu_off_s is not None])
        on = median([c.cpu_s for c in cost if c.cpu_s is not None])
        out += [f"healthy loop, the head's podagent: CPU {fmt(off)} s with the watch off, "
                f"{fmt(on)} s on (ratio {fmt(on / off if on and off else None)}); RSS "
                f"{fmt(median([c.rss_off_mb for c in cost if c.rss_off_mb]), 0)} / "
                f"{fmt(median([c.rss_mb for c in cost if c.rss_mb]), 0)} MiB; no hang event.",
                ""]
    out += ["found: the hang began (the rank's mark; the drill's line) → the head's `hang` "
            "event; silence at fire: what the watch had seen; dump: every pod's stacks; GPUs "
            "free: the hang or the kill → no process with a GPU open; others out: the kill → "
            "every other pod's podagent exited.", ""]
    return benchkit.join_report(out, cases, label=lambda c: c.scenario, what="scenario")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=4, help="K pods (default 4)")
    parser.add_argument("--runs", type=int, default=1, help="runs per scenario (default 1)")
    parser.add_argument("--scenarios", type=benchkit.parse_methods(SCENARIOS),
                        default=list(SCENARIOS), help=f"of {', '.join(SCENARIOS)}")
    parser.add_argument("--cpu", action="store_true", help="gloo on CPUs instead of GPUs")
    parser.add_argument("--torchrun-timeout", type=float, default=20.0,
                        help="PODAGENT_HANG_TIMEOUT for the loop (default 20)")
    parser.add_argument("--ray-timeout", type=float, default=40.0,
                        help="PODAGENT_HANG_TIMEOUT for the check (default 40: its sweeps "
                             "print nothing until the end)")
    parser.add_argument("--host", default="", help="the host's name for the table's title")
    parser.add_argument("--out", type=Path, default=benchkit.RESULTS,
                        help="results directory (default bench/results/, git-ignored)")
    args = parser.parse_args(argv)
    benchkit.require_root(parser)
    if args.pods < 2:
        parser.error("K must be at least 2")
    if not args.cpu and args.pods > pods.gpu_count():
        parser.error(f"one GPU per pod: K={args.pods} needs {args.pods} GPUs")
    outdir, meta = benchkit.begin(args.out, "gpu-hang-", clean=False)
    meta["torch"] = importlib.metadata.version("torch")

    def plan() -> Iterator[tuple[Case, str, benchkit.Body[Case]]]:
        for i, name in benchkit.rounds(args.runs, args.scenarios):
            yield (Case(name, i), f"{name}-r{i}", lambda c, d: one(c, d, args))

    cases = benchkit.execute_all(plan(), outdir, lambda c: line(c, args.runs))
    benchkit.write_results(outdir, render(cases, args, meta), meta, args, cases)
    return 0 if cases and all(c.ok for c in cases) else 1


if __name__ == "__main__":
    sys.exit(main())
