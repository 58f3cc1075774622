"""A pod whose Ray podagent did not start (as a RunPod cluster of type RAY brings one): refused,
left running; and a Ray podagent left on its pod: stopped by the next start. Both without
PODAGENT_RAY_TEMP_DIR, as on a pod, where podagent's mark alone tells its Ray from another."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import uuid
from pathlib import Path

import psutil

from podagent import process
from podagent.config.names import RAY_OWNER
from podagent.ray_access.gcs import GcsClient
from tests.harness.agents import Agent, clean_environ
from tests.harness.pods import Pod, wait_for

START_TIMEOUT = 180.0
EXIT_BAD_INPUT, EXIT_STOP_TIMEOUT = 2, 15
GCS_PORT = 6379  # podagent's default, where a RunPod cluster's own Ray has its GCS too


def as_on_a_pod(agent: Agent) -> Agent:
    """No Ray temp dir of podagent's own (the harness sets one); Ray's files still go to the
    agent's own directory, not the machine's /tmp/ray."""
    del agent.env["PODAGENT_RAY_TEMP_DIR"]
    agent.env["RAY_TMPDIR"] = agent.ray_tmp
    return agent


def daemons(pod: Pod) -> dict[str, psutil.Process]:
    found = {}
    for pid in pod.pids():
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            if proc.name() in ("gcs_server", "raylet"):
                found[proc.name()] = proc
    return found


def kill_everything_in(pod: Pod) -> None:
    for pid in pod.pids():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    wait_for(lambda: pod.pids() == [], timeout=30, interval=0.2, what=f"{pod.name} to be empty")


def test_a_ray_podagent_did_not_start_is_refused_and_left_running(make_pod, dns_server,
                                                                 tmp_path, agents):
    pod = make_pod("head", register=True)
    their_tmp = f"/tmp/paf-{uuid.uuid4().hex[:6]}"
    ray = str(Path(sys.executable).parent / "ray")
    try:
        started = pod.run([ray, "start", "--head", "--port", str(GCS_PORT), "--node-ip-address",
                           pod.ip, "--temp-dir", their_tmp, "--num-gpus", "0",
                           "--include-dashboard", "false", "--disable-usage-stats"],
                          env=clean_environ(), timeout=START_TIMEOUT)
        assert started.returncode == 0, started.stdout + started.stderr
        theirs = wait_for(lambda: len(daemons(pod)) == 2 and daemons(pod), timeout=30,
                          interval=0.2, what="their gcs_server and raylet")
        gcs = theirs["gcs_server"]

        head = as_on_a_pod(Agent(pod, dns_server, tmp_path, {"PODAGENT_REWARD": "none"}))
        agents.append(head)
        head.start()
        assert head.wait_exit(START_TIMEOUT) == EXIT_BAD_INPUT, head.output[-3000:]
        worker = head.restarted({"RAY_WORKER": "1", "PODAGENT_HEAD_ADDR": pod.ip})
        agents.append(worker)
        worker.start()
        assert worker.wait_exit(START_TIMEOUT) == EXIT_BAD_INPUT, worker.output[-3000:]
        for agent in (head, worker):
            (error,) = [line for line in agent.output.splitlines() if "ERROR" in line]
            assert "Traceback" not in agent.output, agent.output[-3000:]
            assert f"ERROR: a Ray that podagent did not start runs on this pod: pid {gcs.pid} " \
                   f"(gcs_server), pid {theirs['raylet'].pid} (raylet)" in error, error
            assert f"GCS at {pod.ip}:{GCS_PORT}; podagent will neither start a second Ray nor " \
                   f"stop that one" in error, error
            assert "with type TRAINING, not RAY" in error, error
            assert "stopped a stale Ray" not in agent.output
            # Nothing else: not even the warning about a dashboard it will not start.
            assert [line for line in agent.output.splitlines() if "WARNING" in line] == []
        assert "waiting for its Ray" not in worker.output  # refused at once, not after a wait

        # `podagent stop` stops no Ray itself: that one ignores its request, and it says so.
        stop = pod.run([sys.executable, "-m", "podagent", "stop", "--timeout", "2"],
                       env=head.env, timeout=60)
        assert stop.returncode == EXIT_STOP_TIMEOUT, stop.stdout + stop.stderr
        assert "its Ray holds no podagent run" in stop.stderr, stop.stderr

        # Their Ray lives on, whole, and answers.
        assert all(process.alive(proc) for proc in theirs.values())
        client = GcsClient(f"{pod.ip}:{GCS_PORT}")
        try:
            client.check_alive(timeout=10)
        finally:
            client.close()
    finally:
        kill_everything_in(pod)  # their Ray: the test's own to stop
        shutil.rmtree(their_tmp, ignore_errors=True)


SORT = """
import json
from podagent import process
found = process.pod_ray()
print(json.dumps({"ours": [p.pid for p in found.ours], "foreign": [p.pid for p in found.foreign]}))
"""


def test_the_ray_podagent_left_on_its_pod_is_stopped_by_the_next_start(make_pod, dns_server,
                                                                      tmp_path, agents):
    pod = make_pod("head", register=True)
    first = as_on_a_pod(Agent(pod, dns_server, tmp_path, {"PODAGENT_REWARD": "none",
                                                          "EXPECTED_WORKERS": "1"}))
    agents.append(first)
    first.start()
    first.wait_output("waiting for 1 worker(s)", timeout=START_TIMEOUT)
    ray = daemons(pod)
    # The mark reaches Ray's daemons through the environment of `ray start`...
    for name in ("gcs_server", "raylet"):
        assert ray[name].environ().get(RAY_OWNER) == "podagent run e2e", name
    # ...and every Ray process of the pod is podagent's (none someone else's), the agents
    # that renamed themselves included.
    sorted_out = pod.run([sys.executable, "-c", SORT], env=first.env, timeout=60)
    assert sorted_out.returncode == 0, sorted_out.stderr
    seen = json.loads(sorted_out.stdout)
    assert seen["foreign"] == [] and {p.pid for p in ray.values()} <= set(seen["ours"]), seen

    first.proc.send_signal(signal.SIGKILL)  # podagent dies; its Ray lives on
    first.proc.wait(timeout=10)
    assert all(process.alive(proc) for proc in ray.values())

    # Its GCS on another port: whether the leftover still runs this run's job is not asked
    # (that waits for the leftover's Jobs API, up to 15 s), so it is cleaned at once; and what
    # of a Ray killed mid-start ignores SIGTERM gets SIGKILL after 2 s, not 10.
    second = first.restarted({"EXPECTED_WORKERS": "0", "PODAGENT_RAY_PORT": "6390",
                              "PODAGENT_STOP_TIMEOUT": "2",
                              "PODAGENT_JOB": f"{sys.executable} -c pass"})
    agents.append(second)
    second.start()
    assert second.wait_exit(START_TIMEOUT) == 0, second.output[-3000:]
    assert "stopped a stale Ray on this pod (" in second.output, second.output[-3000:]
    assert "ERROR:" not in second.output, second.output
    assert "job SUCCEEDED" in second.output
    assert not any(process.alive(proc) for proc in ray.values())
    wait_for(lambda: pod.pids() == [], timeout=10, interval=0.2,
             what="nothing left in the pod")
