"""One start for every role (run/start.py), tested where its order matters to the bill: a start
refused before its pod's directory is its own still stops the pod with RunPod's key, which the
start takes out of the environment only after that; and the exit codes' words for `up`."""

from __future__ import annotations

import fcntl
import signal
import subprocess
import sys

import pytest

from podagent.run import exits
from tests.fakes.runpod_api import FakeRunPodApi
from tests.harness.agents import clean_environ
from tests.harness.pods import wait_for

KEY = "rpa_" + "S" * 40


@pytest.mark.parametrize("command", [("torchrun", "train.py"), ("head",)])
def test_a_start_refused_for_a_held_pod_directory_still_stops_its_pod(tmp_path, command):
    """Another podagent holds this pod's run directory (two containers, one volume): the start
    ends at once with exit 2, and the pod, which RunPod would otherwise keep billing while it
    idles, is stopped through RunPod's API with the key from the environment."""
    run_dir = tmp_path / "logs" / "r1" / "pod-1"
    run_dir.mkdir(parents=True)
    with open(run_dir / "pod.lock", "a+") as held, \
            FakeRunPodApi("127.0.0.1", 0, expected_key=KEY) as api:
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("pid 1 on another-container\n")
        held.flush()
        env = {**clean_environ(), "RUNPOD_POD_ID": "pod-1", "RUNPOD_API_KEY": KEY,
               "RUNPOD_API_URL": api.url, "PODAGENT_RUN_NAME": "r1",
               "PODAGENT_LOG_DIR": str(tmp_path / "logs"), "PODAGENT_REWARD": "none",
               "PODAGENT_JOB": "true"}
        proc = subprocess.Popen([sys.executable, "-m", "podagent", *command], env=env,
                                cwd=tmp_path, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        try:
            wait_for(lambda: api.calls or None, timeout=60,
                     what="the refused start to ask RunPod to stop its pod")
            proc.send_signal(signal.SIGTERM)  # what RunPod does once it stops the pod
            out, _ = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 2, out
    assert "another podagent holds (pid 1 on another-container)" in out, out
    assert [(c.method, c.pod_id, c.action, c.authorized) for c in api.calls] == [
        ("POST", "pod-1", "stop", True)], out
    assert KEY not in out


def test_every_code_has_words_for_up_even_one_no_table_names():
    assert exits.meaning(143) == "stopped by SIGTERM"
    assert exits.meaning(200) == "exit 200"  # no signal 72: a code the job chose
    assert exits.meaning(70) == "internal error in podagent"
    assert exits.meaning(3) == next(m for _, c, m in exits.EXIT_CODES if c == 3)


def test_the_restart_backoff_counts_from_where_the_engine_says(monkeypatch):
    """The Ray head's backoff runs while it waits for the pods (from the restart's start); a run
    without Ray's hang restart counts it from the training's stop on every pod."""
    from podagent.run import restarts

    slept: list[float] = []

    class Sleeps:
        def sleep(self, seconds: float) -> None:
            slept.append(seconds)

    class Says:
        def say(self, _line: str) -> None:
            pass

    clock = iter([100.0, 100.0])
    monkeypatch.setattr(restarts.time, "monotonic", lambda: next(clock))
    restart = restarts.Restart(n=1, backoff=5.0, began=97.0)
    restarts.back_off(restart, Says(), Sleeps())  # 3 s of it spent waiting for pods
    restarts.back_off(restart, Says(), Sleeps(), since=100.0)  # the stop just ended
    assert slept == [pytest.approx(2.0), pytest.approx(5.0)]
