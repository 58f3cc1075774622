"""A head on this image's own Ray, whatever its version.

One bring-up (ray_matrix: run on every tested Ray): Ray head, the built-in reward server, a job
that reports the Ray its driver and a task run and calls the reward server, teardown with
nothing left behind. The retry of a failed `ray start` is podagent's own logic and runs here
only: on a loaded machine Ray 2.48's own fixed dashboard deadline can fail further attempts,
which is what the retry is for, not what this test counts.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.integration.conftest import Runs, wait_for

JOB = """
import json, os, urllib.request
import ray

ray.init(address="auto", logging_level="ERROR")

@ray.remote(num_cpus=0)
def task_version():
    import ray
    return ray.__version__

print("VERSIONS", ray.__version__, ray.get(task_version.remote()), flush=True)
body = {"query": ["What is 1 + 1? The answer is \\\\boxed{2}"], "prompts": ["What is 1 + 1?"],
        "labels": ["2"]}
request = urllib.request.Request(os.environ["REMOTE_RM_URL"], json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
with urllib.request.urlopen(request, timeout=60) as reply:
    rewards = json.load(reply)["rewards"]
print("REWARD", reply.status, len(rewards), all(isinstance(r, float) for r in rewards),
      flush=True)
"""


@pytest.mark.ray_matrix
def test_bring_up_job_and_teardown_on_the_images_ray(podagent_runs: Runs) -> None:
    expected = subprocess.run([sys.executable, "-c", "import ray; print(ray.__version__)"],
                              capture_output=True, text=True, timeout=120).stdout.strip()
    run = podagent_runs.new("ray-version").execute(["head", "--", sys.executable, "-c", JOB])
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    first = run.stdout.splitlines()[0]
    assert f"podagent {__import__('podagent').__version__} (Ray {expected}): this pod is the " \
           f"head" in first, first
    (role,) = run.events_named("role")
    assert role["ray"] == expected
    job_log = run.read("job.log")
    # The job's driver and its task run the image's Ray: the one podagent started.
    assert f"VERSIONS {expected} {expected}" in job_log, job_log
    assert "REWARD 200 1 True" in job_log, job_log
    assert "job SUCCEEDED" in run.stdout
    assert run.leftovers == [], run.leftovers


def test_a_failed_ray_start_is_retried_and_the_second_attempt_runs(podagent_runs: Runs) -> None:
    """A real transient fault: Ray's temp dir cannot be made while a file sits where its parent
    should be (Ray's own error); the file goes, and the next attempt of `ray start` succeeds.
    (A busy pod's Ray 2.48 fails the same way when its dashboard misses a fixed 20 s.)"""
    run = podagent_runs.new("retry")
    # The run's own temp dir becomes the file in the way: its leftovers are still found there.
    blocker = run.temp_dir
    shutil.rmtree(blocker)
    with open(blocker, "w") as f:
        f.write("not a directory")
    with run.running(["head", "--", sys.executable, "-c", "print('after the retry')"],
                     {"PODAGENT_RAY_TEMP_DIR": f"{blocker}/ray", "PODAGENT_REWARD": "none"}):
        def start_log() -> str:
            if run.proc and run.proc.poll() is not None:
                raise AssertionError(f"podagent exited {run.proc.returncode} before its first "
                                     f"`ray start` failed:\n{run.stdout[-3000:]}")
            return run.read("ray-start-head.log")

        wait_for(start_log, lambda log: "Not a directory" in log, 120,
                 "the first `ray start` to fail")
        os.remove(blocker)
        run.wait()
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    warnings = [line for line in run.stdout.splitlines() if "starting Ray failed" in line]
    assert len(warnings) == 1, run.stdout
    assert "(attempt 1 of 3): NotADirectoryError" in warnings[0], warnings[0]
    assert "after the retry" in run.read("job.log")
    assert run.leftovers == [], run.leftovers
