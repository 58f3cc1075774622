"""Failover benchmark: how fast podagent reacts to a lost node, beside plain Ray in the same run.

Two faults, each on a fresh pair of pods (network namespaces with a real DNS server, as in the
end-to-end tests and bench/bringup.py: tests/harness/):

* head loss: the head pod is SIGKILLed; seconds until the worker leaves. podagent's worker
  (PODAGENT_REJOIN=0: exit 7 after PODAGENT_HEAD_GRACE) beside a plain `ray start --address ...
  --block` worker, which Ray ends on its own schedule (about a minute); its wait is capped
  (--baseline-cap).
* worker loss: the worker pod is SIGKILLed; seconds until the head knows. podagent's head
  (its `worker_lost` event) beside plain Ray's GCS with Ray's default health checks (the bench
  polls the node table until the node is dead).
* worker cut off: the worker pod's link is taken down instead (a pod gone from the network:
  its processes live on, packets to it vanish, so Ray's health checks time out rather than
  being refused); the same two measurements.

Needs root and iproute2. Run from the repository root with the project's virtual environment:

    python bench/failover.py [--runs 3] [--grace 8,5] [--baseline-cap 120] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from podagent.ray_access.gcs import GcsClient, GcsUnavailable
from tests.harness import benchkit
from tests.harness import cluster as harness
from tests.harness.benchkit import RunFailed, fmt, last_lines, median, reason_line, table, verdict
from tests.harness.pods import Pod, run_cmd, wait_for

METHODS = ("podagent-headloss", "ray-headloss", "podagent-workerloss", "ray-workerloss",
           "podagent-workercut", "ray-workercut")
# A job that outlives every measurement; "step 1" is its own line (not in its command line).
LONG_JOB = "python -c 'import time; print(\"step\", 1, flush=True); time.sleep(600)'"
TARGET_HEAD_LOSS_S = 10.0
TARGET_WORKER_LOSS_S = 15.0
# Ray health-checks a node first 5 s after it registered (health_check_initial_delay_ms): every
# method holds this long after its cluster formed, so each fault hits a steady state.
STEADY_HOLD_S = 8.0


@dataclass
class Run(benchkit.RunRecord):
    method: str
    index: int
    grace: float | None = None  # PODAGENT_HEAD_GRACE for podagent-headloss
    capped: bool = False  # the baseline did not react within --baseline-cap

    @property
    def label(self) -> str:
        return self.method + (f" grace={self.grace:g}" if self.grace is not None else "")


def worker_fault(pod: Pod, fault: str) -> None:
    """kill: every process of the pod gets SIGKILL (its address still answers, with refusals);
    cut: its link goes down on the bridge (nothing answers at all, as for a vanished pod)."""
    if fault == "kill":
        harness.kill_pod(pod)
    else:
        run_cmd(["ip", "link", "set", pod.host_veth, "down"])


def steady() -> None:
    """A fixed hold, not a readiness wait: what it lets pass is Ray's first health check, which
    has no probe, and it is the same for every method."""
    time.sleep(STEADY_HOLD_S)


# --- podagent ------------------------------------------------------------------------------------


def podagent_pair(c: harness.Cluster, logdir: Path, timeout: float,
                  worker_env: dict[str, str] | None = None) -> list:
    agents, t0 = harness.start_agents(
        c, logdir,
        head_env={"EXPECTED_WORKERS": "1", "PODAGENT_JOB": LONG_JOB, "PODAGENT_REWARD": "none",
                  "PODAGENT_WORKER_TIMEOUT": str(int(timeout))},
        worker_env={"PODAGENT_HEAD_TIMEOUT": str(int(timeout)), **(worker_env or {})})
    head, worker = agents
    try:
        head.wait_output("\nstep 1\n", timeout=max(1.0, t0 + timeout - time.time()))
        worker.wait_output("watching the head", timeout=60)
    except (TimeoutError, AssertionError) as exc:
        raise RunFailed(str(exc).splitlines()[0], last_lines(head.output)) from None
    return agents


def run_podagent_headloss(run: Run, logdir: Path, timeout: float, cap: float) -> None:
    assert run.grace is not None
    with harness.cluster(1) as c:
        agents = []
        try:
            agents = podagent_pair(c, logdir, timeout,
                                   # exit 7 on a lost head, not wait for it to come back
                                   worker_env={"PODAGENT_HEAD_GRACE": f"{run.grace:g}",
                                               "PODAGENT_REJOIN": "0"})
            worker = agents[1]
            steady()
            killed = time.monotonic()
            harness.kill_pod(c.head)
            try:
                wait_for(lambda: worker.proc.poll() is not None, timeout=run.grace + cap,
                         interval=0.02, what="the worker's podagent to exit")
            except TimeoutError as exc:
                raise RunFailed(str(exc), last_lines(worker.output)) from None
            run.seconds = round(time.monotonic() - killed, 3)
            run.exit_codes = harness.exit_codes(agents[1:])
            run.extra["leftover_pids"] = worker.pod.pids()
            if worker.proc.returncode != harness.EXIT_HEAD_LOST:
                raise RunFailed(f"worker exit {worker.proc.returncode} (expected "
                                f"{harness.EXIT_HEAD_LOST}): {reason_line(worker.output)}",
                                last_lines(worker.output))
            run.ok = True
        finally:
            harness.close_agents(agents)


def run_podagent_workerloss(run: Run, logdir: Path, timeout: float, cap: float,
                            fault: str) -> None:
    with harness.cluster(1) as c:
        agents = []
        try:
            agents = podagent_pair(c, logdir, timeout)
            head = agents[0]
            steady()
            killed = time.time()
            worker_fault(c.workers[0], fault)
            events_path = benchkit.pod_events(logdir / "head" / "bench")

            noticed = float(benchkit.await_event(
                events_path, head, lambda e: e.get("event") == "worker_lost", cap,
                "the head's worker_lost event")["ts"])
            run.seconds = round(noticed - killed, 3)
            run.extra["head_still_running"] = head.proc.poll() is None
            if not run.extra["head_still_running"]:
                raise RunFailed("the head exited on a lost worker; the job should decide")
            run.ok = True
        finally:
            harness.close_agents(agents)


# --- plain Ray -----------------------------------------------------------------------------------


def plain_ray(c: harness.Cluster, logdir: Path, timeout: float, block: bool
              ) -> tuple[subprocess.Popen[Any] | None, Any]:
    """`ray start --head` and a worker joined to it, Ray's defaults throughout."""
    env = harness.pod_env()
    head, worker = c.head, c.workers[0]
    rc = harness.run_in_pod(head, c.ray_start(head), env, logdir / "head.out", timeout)
    if rc != 0:
        text = harness.read_text(logdir / "head.out")
        raise RunFailed(f"`ray start --head` exit {rc}: {reason_line(text)}", last_lines(text))
    argv = c.ray_start(worker)
    proc = None
    out = open(logdir / "w1.out", "ab")  # closed by the caller
    if block:
        proc = worker.popen([*argv, "--block"], env=env, stdout=out, stderr=subprocess.STDOUT)
    else:
        rc = harness.run_in_pod(worker, argv, env, logdir / "w1.out", timeout)
        if rc != 0:
            text = harness.read_text(logdir / "w1.out")
            raise RunFailed(f"worker `ray start` exit {rc}: {reason_line(text)}",
                            last_lines(text))
    return proc, out


def await_two_alive(gcs: GcsClient, timeout: float) -> str:
    """Until the head's node table holds two alive nodes; returns the worker's node id."""
    def worker_alive() -> str | None:
        nodes = [n for n in gcs.nodes(timeout=2.0) if n.alive]
        workers = [n.node_id for n in nodes if not n.is_head]
        return workers[0] if len(nodes) >= 2 and workers else None

    try:
        return wait_for(worker_alive, timeout=timeout, interval=0.1,
                        what="2 alive nodes in the head's node table", ignore=(GcsUnavailable,))
    except TimeoutError as exc:
        raise RunFailed(str(exc)) from None


def run_ray_headloss(run: Run, logdir: Path, timeout: float, cap: float) -> None:
    with harness.cluster(1) as c:
        proc, out = None, None
        try:
            proc, out = plain_ray(c, logdir, timeout, block=True)
            gcs = GcsClient(f"{c.head.ip}:{harness.RAY_PORT}")
            try:
                await_two_alive(gcs, timeout)
            finally:
                gcs.close()
            steady()
            assert proc is not None
            if proc.poll() is not None:
                raise RunFailed(f"`ray start --block` exited {proc.returncode} before the fault")
            killed = time.monotonic()
            harness.kill_pod(c.head)
            try:
                wait_for(lambda: proc.poll() is not None, timeout=cap, interval=0.05,
                         what="`ray start --block` to exit")
                run.seconds = round(time.monotonic() - killed, 3)
            except TimeoutError:
                run.seconds, run.capped = cap, True  # a lower bound: it was still running
            run.exit_codes = {"w1": proc.poll()}
            run.ok = True
        finally:
            harness.kill_everything(c)
            if proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)
            if out is not None:
                out.close()


def run_ray_workerloss(run: Run, logdir: Path, timeout: float, cap: float,
                       fault: str) -> None:
    with harness.cluster(1) as c:
        out = None
        gcs = GcsClient(f"{c.head.ip}:{harness.RAY_PORT}")
        try:
            _, out = plain_ray(c, logdir, timeout, block=False)
            node_id = await_two_alive(gcs, timeout)
            steady()
            killed = time.monotonic()
            worker_fault(c.workers[0], fault)

            def dead() -> bool:
                return not any(n.alive for n in gcs.nodes(timeout=2.0) if n.node_id == node_id)

            try:
                wait_for(dead, timeout=cap, interval=0.05, ignore=(GcsUnavailable,),
                         what="the GCS to mark the worker's node dead")
                run.seconds = round(time.monotonic() - killed, 3)
            except TimeoutError:
                run.seconds, run.capped = cap, True
            run.ok = True
        finally:
            gcs.close()
            harness.kill_everything(c)
            if out is not None:
                out.close()


# --- driver and tables ---------------------------------------------------------------------------


def log_name(run: Run) -> str:
    return f"{run.method}-r{run.index}" + (f"-g{run.grace:g}" if run.grace is not None else "")


def line(run: Run, total: int) -> str:
    figure = f"≥{run.seconds:.0f} s" if run.capped and run.seconds is not None else None
    return benchkit.status_line(run, f"{run.label:<28} run {run.index}/{total}", figure)


def summary(runs: list[Run], method: str, grace: float | None = None
            ) -> tuple[float | None, str, bool]:
    """(median, 'median (min-max)' text, any capped) over the successful runs."""
    mine = [r for r in runs if r.method == method and r.ok and r.seconds is not None
            and (grace is None or r.grace == grace)]
    if not mine:
        return None, "-", False
    values = [r.seconds for r in mine]
    capped = any(r.capped for r in mine)
    return median(values), benchkit.spread(values, capped), capped


def render(runs: list[Run], args: argparse.Namespace, meta: dict[str, Any]) -> str:
    out = [f"### Failover benchmark ({meta['started']})", "",
           f"{meta['machine']}; Ray {meta['ray']}, podagent {meta['podagent']} "
           f"(commit {meta['commit']}); {args.runs} run(s) each; load average "
           f"{meta['load_min']:.1f}-{meta['load_max']:.1f} at run starts.", ""]
    rows = []
    ray_head, ray_head_text, _ = summary(runs, "ray-headloss")
    for grace in args.grace if any(r.method.endswith("headloss") for r in runs) else []:
        pa, pa_text, _ = summary(runs, "podagent-headloss", grace)
        rows.append([f"head pod killed → worker exits (podagent grace {grace:g} s)", pa_text,
                     ray_head_text, fmt(ray_head / pa if pa and ray_head else None, 1),
                     f"≤ {TARGET_HEAD_LOSS_S:g} s",
                     verdict(None if pa is None else pa <= TARGET_HEAD_LOSS_S)])
    for what, fault in (("worker pod killed", "loss"), ("worker pod cut off the network",
                                                          "cut")):
        pa, pa_text, _ = summary(runs, f"podagent-worker{fault}")
        ray_w, ray_w_text, _ = summary(runs, f"ray-worker{fault}")
        if pa is None and ray_w is None:
            continue
        rows.append([f"{what} → head knows", pa_text, ray_w_text,
                     fmt(ray_w / pa if pa and ray_w else None, 1),
                     f"≤ {TARGET_WORKER_LOSS_S:g} s",
                     verdict(None if pa is None else pa <= TARGET_WORKER_LOSS_S)])
    out += ["Seconds, median (min-max); plain Ray waits are capped at "
            f"{args.baseline_cap:g} s (≥ marks a capped median).", "",
            table(["fault", "podagent", "plain Ray", "plain Ray / podagent", "target",
                   "result"], rows), "",
            "plain Ray: head loss = a `ray start --address … --block` worker until it exits; "
            "worker loss = the head's GCS (Ray's default health checks) until the node table "
            "shows the node dead. podagent: head loss = the worker's podagent until it exits "
            "(code 7); worker loss = the head's `worker_lost` event (its job keeps running). "
            "Killed: every process of the pod SIGKILLed; cut off: its link taken down.",
            ""]
    return benchkit.join_report(out, runs, label=lambda r: r.label)


def plan(args: argparse.Namespace) -> Iterator[tuple[Run, str, benchkit.Body[Run]]]:
    timeout, cap = args.run_timeout, args.baseline_cap
    bodies: dict[str, benchkit.Body[Run]] = {
        "podagent-headloss": lambda r, d: run_podagent_headloss(r, d, timeout, cap),
        "ray-headloss": lambda r, d: run_ray_headloss(r, d, timeout, cap),
        "podagent-workerloss":
            lambda r, d: run_podagent_workerloss(r, d, timeout, cap, "kill"),
        "ray-workerloss": lambda r, d: run_ray_workerloss(r, d, timeout, cap, "kill"),
        "podagent-workercut": lambda r, d: run_podagent_workerloss(r, d, timeout, cap, "cut"),
        "ray-workercut": lambda r, d: run_ray_workerloss(r, d, timeout, cap, "cut"),
    }
    for i, method in benchkit.rounds(args.runs, args.methods):
        for grace in args.grace if method == "podagent-headloss" else [None]:
            run = Run(method, i, grace=grace)
            yield run, log_name(run), bodies[method]


def main(argv: list[str] | None = None) -> int:
    parser = benchkit.bench_parser(__doc__, methods=METHODS, run_timeout="each cluster's bring-up")
    parser.add_argument("--grace", type=benchkit.parse_floats, default=[8.0, 5.0],
                        help="PODAGENT_HEAD_GRACE values for podagent's head loss (default 8,5)")
    benchkit.add_baseline_cap(parser, 120.0, "plain Ray to react")
    return benchkit.run_all(parser, argv, "failover-", plan, line, render)


if __name__ == "__main__":
    sys.exit(main())
