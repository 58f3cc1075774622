"""A restarted head re-attaches to its run's job instead of submitting it again.

podagent is SIGKILLed while its job runs (its Ray, the job and the reward server live on: they
are daemons, re-parented when podagent dies); a new podagent with the same PODAGENT_RUN_NAME
finds this pod's Ray still running that job, follows it, and cleans everything up at the end.
One head on one machine (no workers): the re-attach logic is the head's alone.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass

import psutil
import pytest
import requests

from tests.integration.conftest import PodagentRun, Runs, wait_for

# Says it started, then waits for the test's go-ahead (a marker file) and succeeds.
JOB = """
import os, sys, time
print("started", os.getpid(), flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.2)
print("finished", flush=True)
"""


@dataclass
class Reattached:
    first: PodagentRun
    second: PodagentRun
    survivors: list[str]  # Ray and reward processes alive after the first podagent was killed
    jobs_listed: list[dict]  # the Jobs API's job list while the second podagent followed it


def _names(run: PodagentRun) -> list[str]:
    names = []
    for proc in run.processes():
        try:
            names.append(proc.name())
        except psutil.Error:
            continue
    return sorted(names)


def _same_run(first: PodagentRun, second: PodagentRun) -> None:
    """The second podagent is the first one restarted: same run name, ports, dirs."""
    second.temp_dir, second.log_dir, second.run_name = first.temp_dir, first.log_dir, \
        first.run_name
    second.ray_port, second.dashboard_port, second.reward_port = (
        first.ray_port, first.dashboard_port, first.reward_port)
    second.env = dict(first.env)


@pytest.fixture(scope="module")
def reattached(podagent_runs: Runs, tmp_path_factory: pytest.TempPathFactory) -> Reattached:
    scratch = tmp_path_factory.mktemp("reattach-job")
    script, marker = scratch / "job.py", scratch / "go"
    script.write_text(JOB)
    argv = ["head", "--", sys.executable, str(script), str(marker)]
    first = podagent_runs.new("reattach")
    first.start(argv)
    wait_for(lambda: first.read("job.log"), lambda log: "started" in log, timeout=180,
             what="the job's 'started' line in job.log")
    assert first.proc is not None
    os.kill(first.proc.pid, signal.SIGKILL)  # podagent alone, as an OOM kill would
    first.proc.wait(timeout=10)
    survivors = _names(first)

    second = podagent_runs.new("reattach-again")
    _same_run(first, second)
    second.start(argv)
    try:
        wait_for(lambda: second.stdout, lambda out: "already running: following it" in out,
                 timeout=120, what="the second podagent to follow the job")
        (head,) = [e for e in first.events() if e["event"] == "ray_head"]
        reply = requests.get(f"http://{head['address'].split(':')[0]}:{first.dashboard_port}"
                             f"/api/jobs/", timeout=10)
        reply.raise_for_status()
        jobs = reply.json()
    finally:
        marker.write_text("go")
    second.wait(timeout=120)
    second.leftovers = second.settle()
    return Reattached(first, second, survivors, jobs)


def test_killing_podagent_leaves_its_ray_and_job_running(reattached: Reattached) -> None:
    survivors = reattached.survivors
    assert "gcs_server" in survivors and "raylet" in survivors, survivors


def test_the_restarted_head_follows_the_same_job_and_exits_0(reattached: Reattached) -> None:
    run = reattached.second
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr}"
    out = run.stdout
    assert ("re-attaching: this pod's Ray at " in out
            and f"still runs job {run.run_name}-1 (RUNNING)" in out), out[-3000:]
    assert f"job {run.run_name}-1 already running: following it" in out
    assert "stale Ray" not in out and "Ray head up at" not in out  # no cleaning, no new Ray
    assert "built-in reward server still answers" in out and "keeping it" in out
    assert "[head] job SUCCEEDED" in out


def test_the_job_was_submitted_exactly_once(reattached: Reattached) -> None:
    run = reattached.second
    ours = [job for job in reattached.jobs_listed
            if job.get("submission_id") == f"{run.run_name}-1"]
    assert len(ours) == 1, reattached.jobs_listed
    submitted = [e for e in run.events() if e["event"] == "job_submitted" and "new" in e]
    assert [e["new"] for e in submitted] == [True, False], submitted
    log = run.read("job.log")
    assert log.count("started") == 1 and "finished" in log, log
    # What the first podagent had streamed is kept beside (a prefix of the full log).
    assert "started" in run.read("job-before-reattach.log")


def test_the_restarted_head_stops_the_adopted_ray_and_reward_server(
        reattached: Reattached) -> None:
    run = reattached.second
    assert "Ray stopped (" in run.stdout
    assert run.leftovers == [], run.leftovers  # Ray, the job and the reward server: all gone
