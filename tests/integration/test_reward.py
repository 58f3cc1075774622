"""The reward server on the head: started, proven by a real request, URL in the job's
environment, supervised (restarted, then the run fails), and failures at start."""

from __future__ import annotations

import shlex
import sys

import psutil
import pytest

from tests.integration.conftest import PodagentRun, Runs, wait_for

# The job calls the reward server the way a trainer does, from the URL podagent gave it.
JOB_CALLS_REWARD = """
import json, os, urllib.request
url = os.environ["REMOTE_RM_URL"]
body = {"query": ["What is 2 + 2? So the answer is \\\\boxed{4}", "What is 2 + 2? \\\\boxed{5}"],
        "prompts": ["What is 2 + 2?", "What is 2 + 2?"], "labels": ["4", "4"]}
request = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
reply = json.load(urllib.request.urlopen(request, timeout=60))
print("URL", url, flush=True)
print("REWARDS", json.dumps(reply["rewards"]), flush=True)
"""

LONG_JOB = "import time\nprint('started', flush=True)\ntime.sleep(600)\n"
EXIT_REWARD_FAILED, EXIT_REWARD_TIMEOUT = 11, 12


def reward_processes(run: PodagentRun) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            cmdline = proc.cmdline()
        except psutil.Error:
            continue
        if "podagent.rewards" in cmdline and str(run.reward_port) in cmdline:
            found.append(proc)
    return found


@pytest.fixture(scope="module")
def called(podagent_runs: Runs) -> PodagentRun:
    run = podagent_runs.new("rewardjob")
    script = run.scratch / "job.py"
    script.write_text(JOB_CALLS_REWARD)
    return run.execute(["head", "--", sys.executable, str(script)])


def test_builtin_server_is_probed_and_the_job_reads_its_url(called: PodagentRun) -> None:
    run = called
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr}"
    assert "built-in reward server answers a real request at http://" in run.stdout
    (ready,) = run.events_named("reward_ready")
    url = ready["url"]
    # The head's own address: a one-node cluster's head takes loopback (nobody else calls it);
    # with workers it is the cluster address (tests/e2e: the reward server listens there).
    assert url == f"http://127.0.0.1:{run.reward_port}/get_reward", url
    assert "this pod: 127.0.0.1 (loopback: a one-node cluster (no workers expected))" \
        in run.stdout
    job_log = run.read("job.log")
    assert f"URL {url}" in job_log
    # The default openrlhf-m profile: accuracy 1 for the boxed right answer, 0 for the wrong
    # one; no <think>/<answer> structure, so no format bonus.
    assert "REWARDS [1.0, 0.0]" in job_log
    assert "listening on" in run.read("reward.log")
    assert f"REMOTE_RM_URL={url}" in run.stdout  # the summary names it
    assert run.leftovers == []


def test_cmd_server_that_exits_at_start_fails_fast(podagent_runs: Runs) -> None:
    run = podagent_runs.new("rewardexit")
    server = [sys.executable, "-c",
              "import sys; print('cannot load the reward model', flush=True); sys.exit(7)"]
    run.execute(["head"], env={"PODAGENT_REWARD": "cmd",
                               "PODAGENT_REWARD_CMD": shlex.join(server)})
    assert run.returncode == EXIT_REWARD_FAILED, f"{run.stdout[-3000:]}\n{run.stderr}"
    assert "exited with code 7 while starting" in run.stderr
    assert "cannot load the reward model" in run.stderr  # the log tail
    assert not run.events_named("job_submitted")
    assert run.read("job.log") == ""
    assert run.leftovers == []


def test_cmd_server_that_never_answers_times_out(podagent_runs: Runs) -> None:
    run = podagent_runs.new("rewardmute")
    server = [sys.executable, "-c", "import time; print('loading', flush=True); time.sleep(600)"]
    run.execute(["head"], env={"PODAGENT_REWARD": "cmd", "PODAGENT_REWARD_TIMEOUT": "5",
                               "PODAGENT_REWARD_CMD": shlex.join(server)})
    assert run.returncode == EXIT_REWARD_TIMEOUT, f"{run.stdout[-3000:]}\n{run.stderr}"
    assert "did not answer a real request" in run.stderr
    assert "loading" in run.stderr  # the log tail
    assert not run.events_named("job_submitted")
    assert run.leftovers == []


def test_killed_server_is_restarted_then_the_run_fails(podagent_runs: Runs) -> None:
    run = podagent_runs.new("rewardkill")
    script = run.scratch / "long_job.py"
    script.write_text(LONG_JOB)
    with run.running(["head", "--", sys.executable, str(script)],
                     env={"PODAGENT_REWARD_RESTARTS": "1"}):
        wait_for(lambda: run.read("job.log"), lambda log: "started" in log, timeout=180,
                 what="the job's 'started' line")
        (first,) = wait_for(lambda: reward_processes(run), lambda p: len(p) == 1, timeout=10,
                            what="the reward server process")
        first.kill()
        wait_for(lambda: run.events_named("reward_recovered"), bool, timeout=60,
                 what="the reward server to be restarted and answer again")
        (second,) = wait_for(lambda: reward_processes(run), lambda p: len(p) == 1, timeout=10,
                             what="the restarted reward server process")
        assert second.pid != first.pid
        second.kill()  # the budget of one restart is spent: the run fails
        code = run.wait(timeout=90)
    assert code == EXIT_REWARD_FAILED, f"{run.stdout[-3000:]}\n{run.stderr}"
    (restart,) = run.events_named("reward_restart")
    assert "exited with code -9" in restart["why"]
    assert run.events_named("reward_failed")
    assert "restarts are spent" in run.stderr
    (stopped,) = run.events_named("job_stopped")
    assert stopped["status"] == "STOPPED"
    assert run.leftovers == []
