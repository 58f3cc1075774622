"""Restart benchmark: how fast a cluster runs again after its head pod died and came back.

A head and one worker (network namespaces with a real DNS server, as in the end-to-end tests:
tests/harness/) run a job that saved a checkpoint; the head pod is SIGKILLed; once the worker
has reacted, podagent is started again in the head pod (same environment and log dir, as
RunPod restarts a container). Two ways for the worker, each on a fresh pair of pods:

* rejoin: podagent's worker (PODAGENT_REJOIN=1, the default) stops its Ray and waits for the
  head again in the same process;
* restart (the baseline, as RunPod does it today): the worker exits (PODAGENT_REJOIN=0, exit 7)
  and a new podagent process is started in the same pod at once (a container restart without
  the container's own cost), which finds and joins the head.

Measured from the new head's start: the head's `worker_joined` event for that worker (and, of
that, the part after the head's own Ray was up: its `ray_head` event), and the resubmitted job's
first output line (it prints its own start time). The first bring-up of each run (every pod
started at once) is shown beside them.

Needs root and iproute2. Run from the repository root with the project's virtual environment:

    python bench/restart.py [--runs 3] [--grace 3] [--methods rejoin,restart] [--out DIR]
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.harness import benchkit
from tests.harness import cluster as harness
from tests.harness.agents import Agent
from tests.harness.benchkit import RunFailed, fmt, last_lines, reason_line, table
from tests.harness.pods import wait_for

METHODS = ("rejoin", "restart")
BASELINE = "restart"
REJOIN_LINE = "podagent waits for the head again"
# Its first line is its own start time; it saves a checkpoint unless resuming, then trains.
JOB = """
import os, sys, time
print("JOBSTART", time.time(), sys.argv[1:], flush=True)
step = os.path.join(os.environ["PODAGENT_CHECKPOINT_DIR"], "step-1")
if "--load_checkpoint" not in sys.argv:
    os.makedirs(step, exist_ok=True)
    with open(os.path.join(step, "model.txt"), "w") as f:
        f.write("weights")
    print("saved", flush=True)
time.sleep(600)
"""
JOBSTART = re.compile(r"^JOBSTART ([\d.]+) (.*)$", re.M)
# Under the table: what the two methods do, told the way its columns name them.
METHODS_NOTE = (
    "rejoin: the worker's podagent stops its Ray and waits for the head again in the same "
    "process. restarted: the worker's podagent exits 7 and a new one is started in the same pod "
    "at once (RunPod's container restart, without the container's own cost). The new head is "
    "started once the worker has reacted; the head's job is submitted again as bench-2 with the "
    "resume flag (its checkpoint is there).")


@dataclass
class Run(benchkit.RunRecord):
    # seconds: new head started -> its worker_joined event for the worker
    method: str
    index: int
    job_s: float | None = None  # new head started -> the resubmitted job's first line
    after_ray_s: float | None = None  # the new head's Ray up (ray_head) -> worker_joined
    cold_job_s: float | None = None  # every pod started -> the first job's first line
    reaction_s: float | None = None  # head killed -> the worker waits (rejoin) or exited


def job_started(agent: Agent) -> tuple[float, str] | None:
    """(the wall time the job printed, its arguments) once its first line is in the output."""
    found = JOBSTART.search(agent.output)
    return (float(found.group(1)), found.group(2)) if found else None


def wait_job(agent: Agent, timeout: float) -> tuple[float, str]:
    def started() -> tuple[float, str] | None:
        if agent.proc is not None and agent.proc.poll() is not None:
            raise RunFailed(f"{agent.pod.name} exited {agent.proc.returncode} before its job "
                            f"started: {reason_line(agent.output)}", last_lines(agent.output))
        return job_started(agent)

    try:
        return wait_for(started, timeout=timeout, interval=0.05, what="the job's first line")
    except TimeoutError as exc:
        raise RunFailed(str(exc), last_lines(agent.output)) from None


def run_restart(run: Run, logdir: Path, timeout: float, grace: float) -> None:
    script = logdir / "job.py"
    script.write_text(JOB)
    checkpoints = logdir / "checkpoints"
    checkpoints.mkdir()
    worker_env = {"PODAGENT_HEAD_GRACE": f"{grace:g}",
                  "PODAGENT_HEAD_TIMEOUT": str(int(timeout)),
                  "PODAGENT_REJOIN": "1" if run.method == "rejoin" else "0"}
    with harness.cluster(1) as c:
        agents: list[Agent] = []
        try:
            agents, t0 = harness.start_agents(
                c, logdir,
                head_env={"EXPECTED_WORKERS": "1", "PODAGENT_REWARD": "none",
                          "PODAGENT_JOB": f"{sys.executable} {script}",
                          "PODAGENT_CHECKPOINT_DIR": str(checkpoints),
                          "PODAGENT_WORKER_TIMEOUT": str(int(timeout))},
                worker_env=worker_env)
            head, worker = agents
            first_ts, _ = wait_job(head, max(1.0, t0 + timeout - time.time()))
            run.cold_job_s = round(first_ts - t0, 3)
            try:
                head.wait_output("\nsaved\n", timeout=60)
                worker.wait_output("watching the head", timeout=60)
            except (TimeoutError, AssertionError) as exc:
                raise RunFailed(str(exc).splitlines()[0], last_lines(head.output)) from None

            killed = time.monotonic()
            harness.kill_pod(c.head)
            worker = react(run, worker, agents, grace)
            run.reaction_s = round(time.monotonic() - killed, 3)

            new_head = head.restarted()
            agents.append(new_head)
            started = time.time()
            new_head.start()
            events_path = benchkit.pod_events(logdir / "head" / "bench")

            joined_ts = float(benchkit.await_event(
                events_path, new_head, lambda e: e.get("event") == "worker_joined"
                and e.get("ip") == c.workers[0].ip and float(e["ts"]) >= started,
                timeout, "the new head's worker_joined event")["ts"])
            run.seconds = round(joined_ts - started, 3)
            ray_up = [float(e["ts"]) for e in harness.read_events(events_path)
                      if e.get("event") == "ray_head" and e.get("result") == "ok"
                      and float(e["ts"]) >= started]
            run.after_ray_s = round(joined_ts - ray_up[0], 3) if ray_up else None
            job_ts, args = wait_job(new_head, timeout)
            run.job_s = round(job_ts - started, 3)
            run.extra["resumed_with"] = args
            run.exit_codes = harness.exit_codes(agents)
            if "--load_checkpoint" not in args or "job bench-2 submitted" not in new_head.output:
                raise RunFailed(f"the job was not resubmitted as bench-2 with the resume flag "
                                f"(arguments {args})", last_lines(new_head.output))
            run.ok = True
        finally:
            harness.close_agents(agents)


def react(run: Run, worker: Agent, agents: list[Agent], grace: float) -> Agent:
    """Until the worker has reacted to the lost head; returns the worker's podagent then: the
    same one (rejoin), or a new one started in the pod after it exited 7 (restart)."""
    def exited() -> bool:
        return worker.proc.poll() is not None

    try:
        if run.method == "rejoin":
            worker.wait_output(REJOIN_LINE, timeout=grace + 60)
            return worker
        wait_for(exited, timeout=grace + 60, interval=0.02, what="the worker's podagent to exit")
    except (TimeoutError, AssertionError) as exc:
        raise RunFailed(str(exc).splitlines()[0], last_lines(worker.output)) from None
    if worker.proc.returncode != harness.EXIT_HEAD_LOST:
        raise RunFailed(f"worker exit {worker.proc.returncode} (expected "
                        f"{harness.EXIT_HEAD_LOST}): {reason_line(worker.output)}",
                        last_lines(worker.output))
    again = worker.restarted()
    agents.append(again)
    return again.start()


# --- driver and tables ---------------------------------------------------------------------------


def line(run: Run, total: int) -> str:
    note = (f", job {run.job_s:.2f} s, reacted {run.reaction_s:.2f} s"
            if run.job_s is not None and run.reaction_s is not None else "")
    return benchkit.status_line(run, f"{run.method:<8} run {run.index}/{total}", note=note)


def render(runs: list[Run], args: argparse.Namespace, meta: dict[str, Any]) -> str:
    out = [f"### Restart benchmark ({meta['started']})", "",
           f"{meta['machine']}; Ray {meta['ray']}, podagent {meta['podagent']} "
           f"(commit {meta['commit']}); {args.runs} run(s) each; worker "
           f"PODAGENT_HEAD_GRACE {args.grace:g} s; load average "
           f"{meta['load_min']:.1f}-{meta['load_max']:.1f} at run starts.", ""]
    rows = []
    for what, attr in (("new head started → worker joined it", "seconds"),
                       ("… of which: the new head's Ray up → worker joined it", "after_ray_s"),
                       ("new head started → resubmitted job's first line", "job_s"),
                       ("head killed → worker waits again / exited", "reaction_s"),
                       ("first bring-up: every pod started → job's first line", "cold_job_s")):
        get = attrgetter(attr)
        ours, base = benchkit.figures(runs, "rejoin", get), benchkit.figures(runs, BASELINE, get)
        rows.append([what, benchkit.spread(ours), benchkit.spread(base),
                     fmt(benchkit.median_ratio(base, ours), 2)])
    out += ["Seconds, median (min-max).", "",
            table(["measure", "podagent rejoin (worker process kept)",
                   "worker restarted (REJOIN=0: exit 7, new podagent)", "restarted / rejoin"],
                  rows), "", METHODS_NOTE, ""]
    return benchkit.join_report(out, runs)


def plan(args: argparse.Namespace) -> Iterator[tuple[Run, str, benchkit.Body[Run]]]:
    for i, method in benchkit.rounds(args.runs, args.methods):
        yield (Run(method, i), f"{method}-r{i}",
               lambda r, d: run_restart(r, d, args.run_timeout, args.grace))


def main(argv: list[str] | None = None) -> int:
    parser = benchkit.bench_parser(__doc__, methods=METHODS)
    parser.add_argument("--grace", type=float, default=3.0,
                        help="the worker's PODAGENT_HEAD_GRACE in seconds (default 3)")
    return benchkit.run_all(parser, argv, "restart-", plan, line, render)


if __name__ == "__main__":
    sys.exit(main())
