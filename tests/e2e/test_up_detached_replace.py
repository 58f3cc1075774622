"""A detached run (`up --detach`, nobody following) whose worker RunPod loses: its head, given
the account key (a RunPod secret), terminates nothing it need not, creates a pod of the same
spec under the lost one's name, takes it in and resumes the job from its checkpoint on the
network volume; at the run's end it terminates every pod. `up --name RUN` following such a run
follows the head's replacement instead of ending the run. Judged at the fake RunPod: what was
created and with what, what bills at the end, the job's steps."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from typing import Any

import pytest
import requests

from tests.e2e.test_recovery import TRAIN
from tests.harness.laptop import (
    KEY,
    RUN_BOUND,
    Output,
    creates,
    laptop_env,
    nothing_left,
    of_run,
    start_up,
    up_argv,
)
from tests.harness.pods import wait_for

VOLUME = "vol-shared"
STEPS, EVERY = 80, 5


@pytest.fixture
def cloud(runpod_cloud: Any, pod_network: Any) -> Any:
    """The account key as a RunPod secret; the API where the pods reach it."""
    return runpod_cloud(pod_key="own", secrets={"acct": KEY},
                        network_volumes={VOLUME: "US-KS-2"}, host=pod_network.host_ip)


def _said(cloud: Any, pod_id: str) -> str:
    return "\n".join(x.line for x in cloud.logs(pod_id))


def _steps(text: str) -> list[int]:
    return [int(s) for s in re.findall(r"\bstep (\d+) loss", text)]


def _detach(cloud: Any, tmp_path: Any, run: str) -> subprocess.CompletedProcess[str]:
    """`up --detach` of a 2-pod Ray training run on the volume, the head given the account
    key and one replacement; it leaves once the pods run."""
    job = (sys.executable, str(TRAIN), "--steps", str(STEPS), "--every", str(EVERY),
           "--step-time", "0.2")
    argv = up_argv(run, 2, "--detach", "--network-volume", VOLUME, "--replacements", "1",
                   "--secret", "PODAGENT_RUNPOD_API_KEY=acct", job=job)
    detached = subprocess.run(argv, env=laptop_env(cloud, tmp_path), capture_output=True,
                              text=True, timeout=RUN_BOUND, stdin=subprocess.DEVNULL)
    assert detached.returncode == 0, detached.stdout[-3000:] + detached.stderr
    return detached


def _terminate_from_outside(cloud: Any, run: str, name: str) -> str:
    """Pod `name` of the run terminated at RunPod, as a host's failure does: its id."""
    lost = next(p.id for p in of_run(cloud, run) if p.name == name)
    answer = requests.delete(f"{cloud.url}/v2/pods/{lost}", timeout=30,
                             headers={"Authorization": f"Bearer {KEY}"})
    assert answer.status_code == 204, answer.text
    return lost


def test_a_detached_runs_head_replaces_a_lost_worker_and_resumes(cloud, tmp_path):
    run, worker = "detr", "podagent-detr-w1"
    detached = _detach(cloud, tmp_path, run)
    assert ("a worker RunPod loses is replaced by the run's head (up to 1, --replacements)"
            in detached.stdout), detached.stdout[-3000:]
    head = next(p.id for p in of_run(cloud, run) if p.name.endswith("-head"))
    wait_for(lambda: any(s >= 2 * EVERY for s in _steps(_said(cloud, head))), timeout=RUN_BOUND,
             what="the training past its second checkpoint")
    lost = _terminate_from_outside(cloud, run, worker)
    said = (f"pod {worker} ({lost}) is no longer listed at RunPod: replacing it (replacement 1 "
            f"of 1, PODAGENT_REPLACEMENTS)")
    wait_for(lambda: said in _said(cloud, head), timeout=RUN_BOUND,
             what=f"the head's replacement ({_said(cloud, head)[-2000:]})")
    wait_for(lambda: not [p for p in of_run(cloud, run) if p.status != "TERMINATED"],
             timeout=RUN_BOUND * 2, what=f"the run's end ({_said(cloud, head)[-3000:]})")
    text = _said(cloud, head)
    resumed = [int(m) for m in re.findall(r"resumed from step-(\d+)\.pt", text)]
    assert resumed and resumed[0] >= 2 * EVERY, text[-3000:]
    assert text.count(f"TRAINED steps={STEPS}") == 1, text[-3000:]
    # The same spec, made by the head with the account key: the image, the GPU, the env (the
    # head's id in it, secrets as references), the volume, the data center.
    made = [r for r in creates(cloud) if r.body["name"] == worker]
    assert len(made) == 2 and made[1].key == "account", [(r.key, r.body) for r in made]
    for key in ("image", "gpu", "env", "mounts", "cloud", "globalNetworking"):
        assert made[1].body[key] == made[0].body[key], key
    assert made[1].body["dataCenterIds"] == ["US-KS-2"]
    assert KEY not in str(made[1].body)
    assert cloud.invalid_requests() == []
    nothing_left(cloud)


def test_following_a_detached_run_again_follows_the_heads_replacement(cloud, tmp_path):
    """`up --name RUN` alone creates nothing: a worker lost meanwhile is the head's to replace,
    and `up` follows the new pod instead of ending the run."""
    run, worker = "detf", "podagent-detf-w1"
    _detach(cloud, tmp_path, run)
    up = Output(start_up(cloud, tmp_path, [sys.executable, "-m", "podagent", "up", "--name",
                                           run]))
    up.wait("step 10 loss", timeout=RUN_BOUND)
    lost = _terminate_from_outside(cloud, run, worker)
    try:
        code = up.end(timeout=RUN_BOUND * 2)
    except subprocess.TimeoutExpired:
        up.proc.send_signal(signal.SIGABRT)
        raise AssertionError(up.text[-5000:]) from None
    assert code == 0, up.text[-5000:]
    assert f"pod {worker} ({lost}) was replaced by the run's head: following " in up.text
    assert up.text.count(f"TRAINED steps={STEPS}") == 1, up.text[-3000:]
    assert len([r for r in creates(cloud) if r.body["name"] == worker]) == 2
    nothing_left(cloud)
