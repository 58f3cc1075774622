"""`podagent up` against RunPod's API as its document states it (the fake RunPod cloud,
tests/fakes/runpod_cloud.py: rate limits, bare-timestamp log ids, 2xx nonsense on cue):
what it leaves billing when it ends at each point, what it costs RunPod's quota to follow a
run, and how long creating a run takes, against the podagent of an earlier commit.

    python bench/up_api.py [--runs 3] [--follow 120] [--baseline REF] [--out DIR]

1. Every way out: a fault right after each API call of a 3-pod run's creation (SIGINT,
   SIGTERM, SIGKILL then `podagent down`, a refusal, a create answered 2xx with an empty body),
   a bug, and Ctrl-C during the final teardown: the exit code and the seconds from the fault
   until RunPod listed no pod of the run (median of --runs).
2. Following a 3-pod run for --follow seconds (the pods run a stand-in that prints the head's
   records: the laptop's side is that of any run): RunPod API calls a minute, the busiest
   minute and the headroom under RunPod's 60.
3. Creating 8 pods with RunPod-like latency (1 s a create): this podagent against the one at
   --baseline (default: the commit before `up` created workers in parallel), in turn, in the
   same run; the ratio.
Needs root and iproute2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.fakes.runpod_cloud import FakeRunPodCloud
from tests.harness import benchkit
from tests.harness.benchkit import fmt, median, table
from tests.harness.laptop import (
    HEAD_IMAGE,
    IMAGES,
    KEY,
    after_call,
    gone_within,
    laptop_env,
    listed,
    signal_to,
    start_up,
    up_argv,
)
from tests.harness.pods import DnsServer, PodNetwork

REPO = Path(__file__).resolve().parent.parent
LAVISH = {"minute": 100_000, "hour": 1_000_000, "day": 10_000_000}
CALLS = ("GPUs", "data centers", "list pods", "list clusters", "head create",
         "worker create", "worker create", "first look")
BASELINE = "cbbae7e"  # `up` before this work: workers created one after another


def cloud_for(net: PodNetwork, dns: DnsServer, root: Path, **kw: Any) -> FakeRunPodCloud:
    return FakeRunPodCloud(net, dns, root, api_key=KEY, images=IMAGES, stop_grace=2.0, **kw)


# --- 1. every way out ---------------------------------------------------------------------------

def fault_point(cloud: FakeRunPodCloud, root: Path, name: str, k: int, fault: str
                ) -> tuple[int, float]:
    """One `up` with the fault after its k-th call: (exit code, seconds until none listed)."""
    proc = start_up(cloud, root, up_argv(name, 3, "--timeout", "4"))
    marks: dict[str, float] = {}

    def act(record: Any) -> None:
        marks["at"] = time.time()
        if fault in ("SIGINT", "SIGTERM", "SIGKILL"):
            signal_to(proc, getattr(signal, fault))(record)
        elif fault == "refused":
            cloud.fail_next(1, 422)
        elif fault == "empty 2xx":
            cloud.garble_next(1, status=201, body=b"")

    if fault in ("refused", "empty 2xx") and k == 1:
        act(None)
    else:
        after_call(cloud, k - (1 if fault in ("refused", "empty 2xx") else 0), act)
    proc.communicate(timeout=180)
    cloud.clear_after_response()
    code = proc.returncode
    if fault == "SIGKILL":
        down = subprocess.run([sys.executable, "-m", "podagent", "down", name],
                              env=laptop_env(cloud, root), capture_output=True, text=True,
                              timeout=180)
        code = down.returncode
    took = gone_within(cloud, name, marks.get("at", time.time()), bound=180)
    if listed(cloud, name):
        raise RuntimeError(f"{fault} after call {k}: pods left at RunPod")
    return code, took


def every_way_out(net: PodNetwork, dns: DnsServer, root: Path, runs: int
                  ) -> list[list[str]]:
    cases = [(f, k) for f in ("SIGINT", "SIGTERM", "SIGKILL") for k in range(1, 9)]
    cases += [("refused", k) for k in (5, 6)] + [("empty 2xx", k) for k in (5, 6)]
    figures: dict[tuple[str, int], list[tuple[int, float]]] = {c: [] for c in cases}
    with cloud_for(net, dns, root / "cloud-ends", rate_limits=LAVISH) as cloud:
        cloud.hold_provisioning(".")
        for run in range(runs):
            for n, (fault, k) in enumerate(cases):
                figures[(fault, k)].append(fault_point(cloud, root, f"e{run}x{n}", k, fault))
            print(f"every way out: run {run + 1} of {runs} done", flush=True)
    rows = [[fault, CALLS[k - 1], str(by[0][0]), fmt(median([t for _, t in by]), 2),
             fmt(max(t for _, t in by), 2)]
            for (fault, k), by in figures.items()]
    rows.append(["a bug (planted)", "first look", *extra_case(net, dns, root, "bug", runs)])
    rows.append(["SIGINT during teardown", "first DELETE",
                 *extra_case(net, dns, root, "teardown", runs)])
    return rows


_BUG = ("import sys; import podagent.launch.watch as w\n"
        "def look(self): raise ZeroDivisionError('a planted bug')\n"
        "w.Watch.look = look\nsys.argv = ['podagent', *sys.argv[1:]]\n"
        "from podagent.cli import main; main()")


def extra_case(net: PodNetwork, dns: DnsServer, root: Path, case: str, runs: int
               ) -> list[str]:
    codes, took = [], []
    with cloud_for(net, dns, root / f"cloud-{case}", rate_limits=LAVISH) as cloud:
        cloud.hold_provisioning(".")
        for run in range(runs):
            name = f"{case}{run}"
            argv = up_argv(name, 3, "--timeout", "4")
            if case == "bug":
                argv = [sys.executable, "-c", _BUG, *argv[3:]]
            else:
                cloud.fail_next(2, 503, match=r"^DELETE ")
            proc = start_up(cloud, root, argv)
            at: list[float] = []

            def mark(record: Any, proc: subprocess.Popen = proc, at: list[float] = at) -> None:
                at.append(time.time())
                if case == "teardown":
                    signal_to(proc, signal.SIGINT)(record)

            if case == "teardown":
                after_call(cloud, 1, mark, counted=lambda r: r.method == "DELETE")
            else:
                after_call(cloud, 7, mark)  # the last create: the bug comes at the first look
            proc.communicate(timeout=180)
            cloud.clear_after_response()
            codes.append(proc.returncode)
            took.append(gone_within(cloud, name, at[0] if at else time.time(), bound=180))
    return [str(codes[0]), fmt(median(took), 2), fmt(max(took), 2)]


# --- 2. following a run ---------------------------------------------------------------------------

def following(net: PodNetwork, dns: DnsServer, root: Path, seconds: float) -> list[list[str]]:
    with cloud_for(net, dns, root / "cloud-follow", pod_key="own") as cloud:
        go = root / "go"
        go.unlink(missing_ok=True)
        proc = start_up(cloud, root, up_argv("follow", 3, "-e", f"POD_HEAD_GO={go}",
                                             image=HEAD_IMAGE))
        started = time.time()
        time.sleep(seconds)
        go.touch()
        out, _ = proc.communicate(timeout=180)
        if proc.returncode != 0:
            raise RuntimeError(f"up exited {proc.returncode}:\n{out[-3000:]}")
        calls = sorted(r.time for r in cloud.requests if r.key == "account")
        refused = sum(r.status == 429 for r in cloud.requests)
    steady = [t for t in calls if started + 30 <= t <= started + seconds]
    busiest = max(sum(1 for t in calls if s <= t < s + 60) for s in calls)
    per_min = len(steady) / max(1.0, seconds - 30) * 60
    return [["calls a minute while following (after the first 30 s)", fmt(per_min, 1)],
            ["busiest minute (creation included)", str(busiest)],
            ["headroom under RunPod's 60 a minute", fmt(60 - busiest, 0)],
            ["429s RunPod answered", str(refused)],
            ["calls in all", str(len(calls))]]


# --- 3. creating 8 pods ------------------------------------------------------------------------

def create_time(net: PodNetwork, dns: DnsServer, root: Path, pythonpath: str | None,
                name: str) -> float:
    """Seconds from `up`'s first call until RunPod answered its 8th create."""
    with cloud_for(net, dns, root / f"cloud-{name}", create_delay=1.0,
                   rate_limits=LAVISH) as cloud:
        cloud.hold_provisioning(".")
        env = laptop_env(cloud, root)
        if pythonpath:
            env["PYTHONPATH"] = pythonpath
        proc = subprocess.Popen(up_argv(name, 8, "--timeout", "600"), env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, cwd=root)
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                made = [r for r in cloud.requests if r.method == "POST" and r.status < 300]
                if len(made) >= 8:
                    break
                time.sleep(0.05)
            first = cloud.requests[0].time
            answered = sorted(r.time for r in cloud.requests
                              if r.method == "POST" and r.status < 300)
            if len(answered) < 8:
                raise RuntimeError(f"{name}: {len(answered)} of 8 pods created in 120 s")
            # A create is recorded when it arrives; its answer came create_delay later.
            return answered[7] + 1.0 - first
        finally:
            proc.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=180)
            cloud.terminate_all()


def creating(net: PodNetwork, dns: DnsServer, root: Path, runs: int, ref: str
             ) -> list[list[str]]:
    worktree = Path(tempfile.mkdtemp(prefix="podagent-base-"))
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(worktree), ref],
                   check=True, capture_output=True)
    try:
        now, then = [], []
        for run in range(runs):
            then.append(create_time(net, dns, root, str(worktree), f"base{run}"))
            now.append(create_time(net, dns, root, None, f"now{run}"))
            print(f"creating 8 pods: run {run + 1}: before {then[-1]:.1f} s, now "
                  f"{now[-1]:.1f} s", flush=True)
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force",
                        str(worktree)], capture_output=True)
    return [[f"{ref} (workers one after another)", fmt(median(then), 1)],
            ["now (the workers at once)", fmt(median(now), 1)],
            ["ratio now / before", fmt(median(now) / median(then), 2)]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--follow", type=float, default=120.0)
    parser.add_argument("--baseline", default=BASELINE)
    parser.add_argument("--out", type=Path, default=Path("bench/results/up_api"))
    args = parser.parse_args()
    benchkit.require_root(parser)
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    report: list[str] = []
    sections: list[tuple[str, list[str], Callable[..., list[list[str]]], tuple[Any, ...]]] = [
        ("Every way out of `up`: seconds from the fault until RunPod lists no pod of the run",
         ["fault", "right after", "exit", "median (s)", "max (s)"], every_way_out,
         (args.runs,)),
        (f"Following a 3-pod run for {args.follow:g} s", ["figure", "value"], following,
         (args.follow,)),
        ("Creating 8 pods, RunPod-like latency (1 s a create)", ["podagent", "seconds"],
         creating, (args.runs, args.baseline)),
    ]
    with PodNetwork(prefix="pu") as net, DnsServer(address=net.host_ip, port=0) as dns:
        for title, header, body, extra in sections:
            rows = body(net, dns, args.out, *extra)
            report += [f"### {title}", "", table(header, rows), ""]
            print("\n".join(report[-4:]), flush=True)
    (args.out / "up_api.md").write_text("\n".join(report) + "\n")
    (args.out / "up_api.json").write_text(json.dumps({"args": vars(args) | {
        "out": str(args.out)}, "python": sys.version, "cpus": os.cpu_count()}, indent=1))


if __name__ == "__main__":
    main()
