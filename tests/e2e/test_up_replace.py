"""A worker pod lost at RunPod while `up` follows the run (terminated from outside, as RunPod
does with a pod whose host failed): `up` replaces it with a pod of the same spec under the same
name, the run takes it in (the Ray head's census; a run without Ray forms again at the same
world size), the training resumes from its checkpoint on the shared volume and finishes 0;
nothing bills at the end, and the record, `ls` and the cost line count the replacement.
The head lost, or a pod lost past --replacements, still ends the run (exit 24)."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.e2e.test_recovery import TRAIN
from tests.harness.laptop import (
    KEY,
    Output,
    creates,
    nothing_left,
    run_cli,
    start_up,
    up_argv,
)
from tests.harness.pods import wait_for

LOOP = Path(__file__).resolve().parents[1] / "jobs" / "hang_loop.py"  # checkpoints, resumes
STEPS, EVERY = 60, 5
VOLUME = "vol-shared"  # one network volume on every pod: the checkpoints outlive a pod


@pytest.fixture
def cloud(runpod_cloud: Any) -> Any:
    return runpod_cloud(pod_key="own", network_volumes={VOLUME: "US-KS-2"})


def _terminate_from_outside(cloud: Any, name: str) -> str:
    pod = next(p for p in cloud.pods.values() if p.name == name and p.status != "TERMINATED")
    answer = requests.delete(f"{cloud.url}/v2/pods/{pod.id}", timeout=30,
                             headers={"Authorization": f"Bearer {KEY}"})
    assert answer.status_code == 204, answer.text
    return pod.id


def _steps_seen(up: Output) -> list[int]:
    return [int(m.group(1)) for line in up.lines if (m := re.search(r"\bstep (\d+) loss", line))]


def _until_step(up: Output, step: int, after: int = 0) -> None:
    """Until the training said step `step` (among the lines after the first `after`)."""
    def there() -> bool:
        return any(int(m.group(1)) >= step for line in up.lines[after:]
                   if (m := re.search(r"\bstep (\d+) loss", line))) or up.proc.poll() is not None

    wait_for(there, timeout=300, what=f"training past step {step} (it said: {up.lines[-10:]})")
    assert up.proc.poll() is None, up.text[-5000:]


def _replaced(cloud: Any, tmp_path: Path, up: Output, run: str, lost: dict[str, str]) -> dict:
    """What replacements leave behind: a create of each lost pod's name again with the first
    one's body, the record, `ls` and the cost line counting them, nothing billing. `lost`:
    name -> the lost pod's id, in the order they were lost."""
    for name in lost:
        made = [r for r in creates(cloud) if r.body["name"] == name]
        assert len(made) >= 2, [r.body for r in made]
        assert made[-1].body["mounts"] == {"network": [{"volumeId": VOLUME,
                                                        "path": "/workspace"}]}
    n = len(lost)
    assert re.search(rf"run {run} succeeded \(exit 0\) .*; 2 pod\(s\) \({n} lost and "
                     rf"replaced\)", up.text), up.text[-3000:]
    nothing_left(cloud)
    record = json.loads((tmp_path / "state" / "podagent" / "runs" / f"{run}.json").read_text())
    assert [(r["name"], r["lost"]) for r in record["replacements"]] == list(lost.items())
    assert record["cost"]["replaced"] == n and record["outcome"]["code"] == 0
    listing = run_cli(cloud, tmp_path, "ls")
    assert f"{n} lost pod(s) replaced" in listing.stdout, listing.stdout
    return record


def test_a_lost_worker_is_replaced_then_a_lost_head_recreates_the_run(cloud, tmp_path):
    """Ray, 2 pods on one network volume: the worker lost mid-training is replaced (same
    body, the head's id) and the head resubmits the job resuming from its checkpoint; then
    the head lost: the run is created again under its name, and its new head's job resumes
    from the checkpoints on the volume."""
    run, head, worker = "swap", "podagent-swap-head", "podagent-swap-w1"
    job = (sys.executable, str(TRAIN), "--steps", str(STEPS), "--every", str(EVERY),
           "--step-time", "0.2")
    up = Output(start_up(cloud, tmp_path, up_argv(
        run, 2, "--network-volume", VOLUME, "--replacements", "2", job=job)))
    _until_step(up, 2 * EVERY)
    lost = {worker: _terminate_from_outside(cloud, worker)}
    lost_at = time.monotonic()
    up.wait(f"pod {worker} was terminated outside this run: replacing it (replacement 1 of 2, "
            f"--replacements)")
    up.wait("resumed from step-", timeout=300)
    back = time.monotonic() - lost_at
    first = [r for r in creates(cloud) if r.body["name"] == worker]
    assert first[0].body == first[1].body  # the same spec, the head's id included
    _until_step(up, 6 * EVERY, after=len(up.lines))
    lost[head] = _terminate_from_outside(cloud, head)
    up.wait(f"pod {head} was terminated outside this run: the run is created again under its "
            f"name (replacement 2 of 2")
    assert up.end(timeout=400) == 0, up.text[-5000:]
    _replaced(cloud, tmp_path, up, run, lost)
    # Resumed each time from a checkpoint: the worker's loss at step 10 or later, the
    # head's at step 30 or later.
    resumed = [int(m) for m in re.findall(r"resumed from step-(\d+)\.pt", up.text)]
    assert len(resumed) == 2 and resumed[0] >= 2 * EVERY and resumed[1] >= 6 * EVERY, resumed
    assert up.text.count(f"TRAINED steps={STEPS}") == 1, up.text[-3000:]
    print(f"worker lost -> the job resumed: {back:.1f} s; resumed at steps {resumed}")


def test_a_lost_worker_is_replaced_and_a_run_without_ray_forms_again(cloud, tmp_path):
    """torchrun on 2 pods: the lost pod's peer stops its training and its podagent starts
    again (exit 22, its container started again), the replacement joins the rendezvous at the
    same world size, and the loop resumes from its newest checkpoint (a directory both pods
    share, as the network volume's is)."""
    run, worker = "swapt", "podagent-swapt-w1"
    out, checkpoints = tmp_path / "ranks", tmp_path / "checkpoints"
    out.mkdir()
    job = ("--", str(LOOP), str(out), str(checkpoints), "--steps", "120",
           "--step-seconds", "0.1")
    up = Output(start_up(cloud, tmp_path, up_argv(
        run, 2, "--network-volume", VOLUME, "--replacements", "1", "--launcher", "torchrun",
        "-e", "RES_OPTIONS=timeout:1 attempts:1", job=job)))
    up.wait("step 20", timeout=300)
    lost = {worker: _terminate_from_outside(cloud, worker)}
    assert up.end(timeout=400) == 0, up.text[-5000:]
    assert f"pod {worker} was terminated outside this run: replacing it (replacement 1 of 1, " \
        "--replacements)" in up.text
    _replaced(cloud, tmp_path, up, run, lost)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["last"] == 120 and r["first"] > 20 for r in ranks), ranks  # resumed
