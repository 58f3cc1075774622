"""Nothing bills past its run, on the fake RunPod cloud whose runtime starts a container again
whenever its process exits (as RunPod does): pods end stopped or terminated, never in a restart
loop, and never idle unless RunPod refuses them the stop.

* hand-made pods (the template's way) given bad input: stopped through v2's action with the key
  RunPod injects, after one start; when the fake refuses that key, idle, saying so;
* a run whose laptop is lost (`up` SIGKILLed once the pods run): the run ends by itself, every
  pod stops itself; a worker stopped mid-run and started again after its head closed the run
  hears from the head that the run is over (2 starts, then stopped); a stray worker with
  another cluster token is refused (exit 13) and stops itself after one start;
* a detached run whose pods hold an account key (a RunPod secret): re-attached to and left
  again, then at its end the head terminates every pod of the run.

Judged by the outcome: each pod's status at RunPod, how often its container started, that
nothing of a stopped pod runs, and which key made each stop."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.fakes.runpod_cloud import FakeRunPodCloud
from tests.harness.laptop import (
    H100,
    IMAGE,
    KEY,
    RUN_BOUND,
    laptop_env,
    of_run,
    run_cli,
    start_up,
    up_argv,
)
from tests.harness.pods import PodNetwork, wait_for

TOKEN = "t0ken-" + "a" * 26  # the run's cluster token, a RunPod secret
OTHER_TOKEN = "t0ken-" + "b" * 26
STOPPED = 60.0  # a pod told to stop itself is EXITED within this


@pytest.fixture
def make_cloud(runpod_cloud: Any, pod_network: PodNetwork) -> Any:
    """A fake cloud on the pods' network: a pod asks the API to stop itself."""
    return lambda **kw: runpod_cloud(stop_grace=5.0, host=pod_network.host_ip, **kw)


def create_pod(cloud: FakeRunPodCloud, name: str, env: dict[str, str]) -> str:
    """A pod deployed by hand, as from the template: podagent's image, Global Networking."""
    answer = requests.post(f"{cloud.url}/v2/pods", headers={"Authorization": f"Bearer {KEY}"},
                           json={"name": name, "image": IMAGE, "gpu": {"id": H100, "count": 1},
                                 "globalNetworking": True,
                                 "env": {"PODAGENT_REWARD": "none", "RUNPOD_API_URL": cloud.url,
                                         **env}}, timeout=30)
    assert answer.status_code == 201, answer.text
    return answer.json()["id"]


def act(cloud: FakeRunPodCloud, pod_id: str, action: str) -> None:
    answer = requests.post(f"{cloud.url}/v2/pods/{pod_id}/action", json={"action": action},
                           headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert answer.status_code in (200, 204), answer.text


def output(cloud: FakeRunPodCloud, pod_id: str) -> str:
    return "\n".join(line.line for line in cloud.logs(pod_id) if line.source == "container")


def stopped_itself(cloud: FakeRunPodCloud, pod_id: str) -> bool:
    """The pod asked for its own stop, with its own key, and got it."""
    return any(r.key == f"pod:{pod_id}" and r.path == f"/v2/pods/{pod_id}/action"
               and r.status == 200 and r.body == {"action": "stop"} for r in cloud.requests)


def nothing_runs_in(cloud: FakeRunPodCloud, *pod_ids: str) -> None:
    running = [left for left in cloud.leftover_processes() if left.pod_id in pod_ids]
    assert running == [], running


@pytest.mark.parametrize("pod_key", ["own", "refuse"])
def test_a_hand_made_pod_given_bad_input_stops_after_one_start(make_cloud, pod_key):
    cloud = make_cloud(pod_key=pod_key)
    pod_id = create_pod(cloud, "handmade", {"EXPECTED_WORKERS": "two"})
    said = "EXPECTED_WORKERS='two' must be a whole number"
    wait_for(lambda: said in output(cloud, pod_id), timeout=60, what="the bad input's line")
    if pod_key == "own":
        view = cloud.wait_status(pod_id, "EXITED", timeout=STOPPED)
        assert stopped_itself(cloud, pod_id)
        # RunPod lists the pod EXITED as soon as it takes the stop, before its answer reaches
        # the pod: the pod's line about it follows within the container's grace.
        wait_for(lambda: "asked RunPod's API to stop pod" in output(cloud, pod_id), timeout=30,
                 what="the pod's line that it asked for its stop")
        wait_for(lambda: not [x for x in cloud.leftover_processes() if x.pod_id == pod_id],
                 timeout=30, what="the stopped pod's processes gone")
    else:
        refused = "RunPod refused to stop pod"
        wait_for(lambda: "staying up idle, not exiting" in output(cloud, pod_id), timeout=60,
                 what="the idle line")
        time.sleep(3)  # long enough for a restart loop to show, were there one
        view = cloud.pods[pod_id]
        assert view.status == "RUNNING" and refused in output(cloud, pod_id)
        assert "stop the pod yourself" in output(cloud, pod_id)
        assert [x.pod_id for x in cloud.leftover_processes()] == [pod_id]  # idle podagent
    assert view.starts == 1, output(cloud, pod_id)
    assert output(cloud, pod_id).count(said) == 1


def _job(go: Path) -> tuple[str, ...]:
    return (sys.executable, "-c", "import os, time\nprint('job started', flush=True)\n"
            f"while not os.path.exists({str(go)!r}): time.sleep(0.2)\nprint('job done')")


def _head_says(cloud: FakeRunPodCloud, head_id: str, text: str, timeout: float = RUN_BOUND
               ) -> None:
    wait_for(lambda: text in output(cloud, head_id), timeout=timeout,
             what=f"the head to say {text!r}")


def _wait_terminated(cloud: FakeRunPodCloud, run: str, pods: dict[str, str]) -> None:
    """Every pod of the run TERMINATED; else what each pod was, said and asked for."""
    try:
        wait_for(lambda: not [p for p in of_run(cloud, run) if p.status != "TERMINATED"],
                 timeout=RUN_BOUND, what="every pod of the run terminated")
    except TimeoutError as exc:
        views = cloud.pods
        told = [f"{r.method} {r.path} {r.body} by {r.key}: {r.status}" for r in cloud.requests
                if r.method != "GET"]
        raise AssertionError("\n".join([str(exc), *told, *(
            f"--- {name} ({views[pod_id].status}, {views[pod_id].starts} start(s)):\n"
            f"{output(cloud, pod_id)[-2500:]}" for name, pod_id in pods.items())])) from None


def test_a_lost_laptop_leaves_a_run_that_stops_every_pod_itself(make_cloud, tmp_path):
    cloud = make_cloud(pod_key="own", secrets={"tok": TOKEN})
    go = tmp_path / "go"
    argv = up_argv("lost", 3, "--secret", "PODAGENT_TOKEN=tok", "-e", "PODAGENT_RESTARTS=0",
                   "-e", "PODAGENT_OVER_LINGER=120", job=_job(go))
    laptop = start_up(cloud, tmp_path, argv)
    head = wait_for(lambda: next((p for p in of_run(cloud, "lost") if p.name.endswith("-head")),
                                 None), timeout=60, what="the head")
    _head_says(cloud, head.id, "job started")
    laptop.send_signal(signal.SIGKILL)  # the laptop is lost: nobody terminates the pods
    laptop.communicate(timeout=30)
    pods = {p.name.rsplit("-", 1)[1]: p.id for p in of_run(cloud, "lost")}

    # A stray worker with another token: refused by the head's Ray, stopped after one start.
    stray = create_pod(cloud, "stray", {"HEAD_POD_ID": head.id, "PODAGENT_TOKEN": OTHER_TOKEN,
                                        "PODAGENT_RUN_NAME": "stray"})
    # w2 is stopped mid-run (its host taken away, say): the job goes on without it.
    act(cloud, pods["w2"], "stop")
    cloud.wait_status(pods["w2"], "EXITED")
    _head_says(cloud, head.id, "left the cluster while the job ran")
    go.touch()  # the job ends: the head closes the run, w2 away
    _head_says(cloud, head.id, "did not leave with the head")
    act(cloud, pods["w2"], "start")  # w2 comes back: the head tells it the run is over
    for pod_id in (*pods.values(), stray):
        cloud.wait_status(pod_id, "EXITED", timeout=STOPPED)
    views = cloud.pods
    for name, pod_id in pods.items():
        assert stopped_itself(cloud, pod_id), (name, output(cloud, pod_id)[-3000:])
    assert views[pods["w2"]].starts == 2, output(cloud, pods["w2"])[-3000:]
    assert "says run lost is over" in output(cloud, pods["w2"])
    assert views[pods["head"]].starts == views[pods["w1"]].starts == 1
    assert "every worker that was away has heard that the run is over" in output(cloud,
                                                                                 head.id)
    assert views[stray].starts == 1 and stopped_itself(cloud, stray)
    assert "refused this pod: it has a different cluster token" in output(cloud, stray)
    assert TOKEN not in "".join(output(cloud, p) for p in (*pods.values(), stray))
    wait_for(lambda: not cloud.leftover_processes(), timeout=30, what="nothing running")


def test_a_detached_run_is_terminated_by_its_head_with_an_account_key(make_cloud, tmp_path):
    cloud = make_cloud(pod_key="refuse", secrets={"acct": KEY})
    go = tmp_path / "go"
    argv = up_argv("det", 3, "--detach", "--secret", "PODAGENT_RUNPOD_API_KEY=acct",
                   job=_job(go))
    detached = subprocess.run(argv, env=laptop_env(cloud, tmp_path), capture_output=True,
                              text=True,
                              timeout=RUN_BOUND, stdin=subprocess.DEVNULL)
    assert detached.returncode == 0, detached.stdout[-3000:] + detached.stderr
    assert "detached: run det goes on without this machine" in detached.stdout
    pods = {p.name.rsplit("-", 1)[1]: p.id for p in of_run(cloud, "det")}
    assert all(cloud.pods[p].status == "RUNNING" for p in pods.values())
    # The account key reached the head alone (a RunPod secret: never its value in a body).
    bodies = [r.body for r in cloud.requests if r.method == "POST" and r.path == "/v2/pods"]
    assert KEY not in str(bodies)
    assert [b["name"] for b in bodies if "PODAGENT_RUNPOD_API_KEY" in b["env"]] == [
        "podagent-det-head"]
    listing = run_cli(cloud, tmp_path, "ls")
    assert "det" in listing.stdout and "detached, 3 pod(s)" in listing.stdout, listing.stdout
    # Re-attached by name alone, then left again (the laptop closed).
    again = start_up(cloud, tmp_path, [sys.executable, "-m", "podagent", "up", "--name", "det"])
    wait_for(lambda: "job started" in output(cloud, pods["head"]), timeout=RUN_BOUND,
             what="the job")
    time.sleep(2)
    again.send_signal(signal.SIGKILL)
    seen, _ = again.communicate(timeout=30)
    assert "re-attaching to it" in seen and "creating" not in seen.split("re-attaching")[1]
    go.touch()
    _wait_terminated(cloud, "det", pods)
    head_said = output(cloud, pods["head"])
    assert "terminating the 3 pod(s) of run det: the others are gone, this one goes last" \
        in head_said, head_said[-3000:]
    # The workers' own stop was refused (the pod-scoped key may do nothing here): they stayed
    # idle, saying so, until the head terminated them.
    assert "RunPod refused to stop pod" in output(cloud, pods["w1"])
    deletes = [r for r in cloud.requests if r.method == "DELETE"]
    assert {r.path.rsplit("/", 1)[1] for r in deletes} == set(pods.values())
    assert all(r.key == "account" for r in deletes) and deletes[-1].path.endswith(pods["head"])
    cloud.wait_torn_down()
    assert cloud.leftover_processes() == []


def test_a_hand_made_pod_whose_gpus_fail_their_check_exits_28_and_stops_after_one_start(
        make_cloud, tmp_path):
    """Its GPUs would fail again on every start (a failed row remapping needs the GPU
    serviced): it says which and why, exits 28 and stops itself, never restart-looping."""
    from tests.fakes import nvidia_smi

    cloud = make_cloud(pod_key="own")
    bin_dir = tmp_path / "bin"
    nvidia_smi.install(bin_dir, {"gpus": [{"name": H100, "ecc": 0, "remap_failed": True}]})
    pod_id = create_pod(cloud, "badgpu", {"PODAGENT_GPU_CHECK": "smi",
                                          "PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin"})
    view = cloud.wait_status(pod_id, "EXITED", timeout=STOPPED)
    assert stopped_itself(cloud, pod_id)
    wait_for(lambda: "exit 28" in output(cloud, pod_id), timeout=30, what="its exit line")
    said = output(cloud, pod_id)
    assert "GPU 0 (GPU-00000000-standin): a row remapping failed (the GPU needs servicing)" \
        in said, said[-3000:]
    assert "Traceback" not in said
    time.sleep(3)  # long enough for a restart loop to show, were there one
    assert cloud.pods[pod_id].status == "EXITED" and view.starts == cloud.pods[pod_id].starts == 1
    wait_for(lambda: not [x for x in cloud.leftover_processes() if x.pod_id == pod_id],
             timeout=30, what="the stopped pod's processes gone")
