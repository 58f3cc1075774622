"""A pod whose GPUs fail their check before the job, under `podagent up` against the fake
RunPod (its pods real network-namespace pods running podagent; a stand-in nvidia-smi on their
PATH answers for GPUs these machines do not have: tests/fakes/nvidia_smi.py): the worker
says why, exits 28 and stops itself after one start; `up` prints its reason and replaces it
before the job starts (--replacements), the run forms at full size with the replacement and
finishes 0; nothing bills at the end, and the record and the cost line count it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.fakes import nvidia_smi
from tests.harness.laptop import (
    H100,
    KEY,
    Output,
    creates,
    nothing_left,
    run_cli,
    start_up,
    up_argv,
)

LOOP = Path(__file__).resolve().parents[1] / "jobs" / "hang_loop.py"
VOLUME = "vol-shared"
NODES = ("import ray; ray.init(); "
         "print('ALIVE NODES', sum(n['Alive'] for n in ray.nodes()))")
ECC = "3 uncorrected ECC error(s) since the driver loaded"


def _end(up: Output, timeout: float, cloud: Any) -> int:
    try:
        return up.end(timeout=timeout)
    except subprocess.TimeoutExpired:
        pods = "\n".join(f"{p.name} {p.id} {p.status} starts={p.starts}: " + " | ".join(
            x.line for x in cloud.logs(p.id)[-15:]) for p in cloud.pods.values())
        up.proc.send_signal(signal.SIGABRT)  # its threads' stacks, into its output
        with contextlib.suppress(subprocess.TimeoutExpired):
            up.end(timeout=30)
        raise AssertionError(f"up did not end in {timeout:g} s: {up.text[-6000:]}\n"
                             f"the pods:\n{pods}") from None


@pytest.fixture
def cloud(runpod_cloud: Any, pod_network: Any) -> Any:
    """Its API where the pods reach it: a pod whose GPUs fail stops itself."""
    return runpod_cloud(pod_key="own", network_volumes={VOLUME: "US-KS-2"},
                        host=pod_network.host_ip)


def test_a_worker_whose_gpu_fails_its_check_is_replaced_before_the_job(cloud, tmp_path):
    run, worker = "gpuchk", "podagent-gpuchk-w1"
    bin_dir = tmp_path / "bin"
    # Every pod's GPU is a healthy H100, but for the first worker's, which has ECC errors.
    nvidia_smi.install(bin_dir, {"gpus": [{"name": H100, "ecc": 0, "retire_pending": False,
                                           "remap_pending": False, "remap_failed": False}],
                                 "bad_once": {"ecc": 3}})
    out, checkpoints = tmp_path / "ranks", tmp_path / "checkpoints"
    out.mkdir()
    job = ("--", str(LOOP), str(out), str(checkpoints), "--steps", "20",
           "--step-seconds", "0.05")
    up = Output(start_up(cloud, tmp_path, up_argv(
        run, 2, "--network-volume", VOLUME, "--replacements", "1", "--launcher", "torchrun",
        "-e", "PODAGENT_GPU_CHECK=smi",
        "-e", f"PATH={bin_dir}{os.pathsep}{os.environ['PATH']}",
        "-e", "RES_OPTIONS=timeout:1 attempts:1", job=job)))
    assert _end(up, 400, cloud) == 0, up.text[-5000:]
    said = (f"pod {worker}'s GPUs failed their check before the job: GPU 0 "
            f"(GPU-00000000-standin): {ECC}: replacing it (replacement 1 of 1, --replacements)")
    assert said in up.text, up.text[-5000:]
    # The bad pod: one start, its exit 28 with the reason, stopped by itself.
    bad = next(p for p in cloud.pods.values() if p.name == worker and p.starts and any(
        '"code": 28' in x.line for x in cloud.logs(p.id)))
    assert bad.starts == 1
    exits = [json.loads(x.line) for x in cloud.logs(bad.id) if '"event": "exit"' in x.line]
    assert [(e["code"], ECC in e["error"]) for e in exits] == [(28, True)]
    # Replaced with the same body; the job ran once, at full size, from its start.
    made = [r for r in creates(cloud) if r.body["name"] == worker]
    assert len(made) == 2 and made[0].body == made[1].body
    assert made[0].body["env"]["PODAGENT_GPU_TYPE"] == H100
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["first"] == 1 and r["last"] == 20 for r in ranks), ranks
    nothing_left(cloud)
    assert re.search(rf"run {run} succeeded \(exit 0\) .*; 2 pod\(s\) \(1 lost and replaced\)",
                     up.text), up.text[-3000:]
    record = json.loads((tmp_path / "state" / "podagent" / "runs" / f"{run}.json").read_text())
    assert [(r["name"], ECC in r["why"]) for r in record["replacements"]] == [(worker, True)]
    assert "1 lost pod(s) replaced" in run_cli(cloud, tmp_path, "ls").stdout


def test_past_the_budget_a_failed_gpu_check_ends_the_run_with_28(cloud, tmp_path):
    bin_dir = tmp_path / "bin"
    nvidia_smi.install(bin_dir, {"gpus": [{"name": H100, "ecc": 0}],
                                 "bad_once": {"name": "NVIDIA A100-SXM4-80GB"}})
    up = Output(start_up(cloud, tmp_path, up_argv(
        "gpuend", 2, "--replacements", "0", "--launcher", "torchrun",
        "-e", "PODAGENT_GPU_CHECK=smi",
        "-e", f"PATH={bin_dir}{os.pathsep}{os.environ['PATH']}",
        job=("--", str(LOOP), str(tmp_path), str(tmp_path / "c"), "--steps", "5"))))
    assert _end(up, 300, cloud) == 28, up.text[-5000:]
    assert (f"pod podagent-gpuend-w1's GPUs failed their check before the job: GPU type "
            f"NVIDIA A100-SXM4-80GB where {H100} was asked for (PODAGENT_GPU_TYPE)") in up.text
    nothing_left(cloud)
    assert KEY not in up.text


def test_on_ray_the_head_waits_for_the_replacement_of_a_worker_whose_gpu_failed(cloud, tmp_path):
    """The Ray worker checks its GPUs before it joins: the head's census waits for the
    replacement, and only then submits the job (a Ray job counting the nodes it runs on)."""
    run, worker = "gpuray", "podagent-gpuray-w1"
    bin_dir = tmp_path / "bin"
    nvidia_smi.install(bin_dir, {"gpus": [{"name": H100, "ecc": 0}],
                                 "bad_once": {"remap_pending": True}})
    up = Output(start_up(cloud, tmp_path, up_argv(
        run, 2, "--replacements", "1", "-e", "PODAGENT_GPU_CHECK=smi",
        "-e", f"PATH={bin_dir}{os.pathsep}{os.environ['PATH']}",
        job=(sys.executable, "-c", NODES))))
    assert _end(up, 400, cloud) == 0, up.text[-5000:]
    assert "ALIVE NODES 2" in up.text
    assert (f"pod {worker}'s GPUs failed their check before the job: GPU 0 "
            f"(GPU-00000000-standin): a row remapping is pending (it needs a GPU reset): "
            f"replacing it (replacement 1 of 1, --replacements)") in up.text, up.text[-5000:]
    assert len([r for r in creates(cloud) if r.body["name"] == worker]) == 2
    nothing_left(cloud)


def test_a_head_whose_gpu_fails_its_check_has_the_run_created_again(cloud, tmp_path):
    """The head's own exit 28 (in the log `up` follows) is not the run's end: every pod is
    terminated and the run created again under its name, whose new head passes."""
    run, head = "gpuhead", "podagent-gpuhead-head"
    bin_dir = tmp_path / "bin"
    nvidia_smi.install(bin_dir, {"gpus": [{"name": H100, "ecc": 0}], "bad_role": "head",
                                 "bad_once": {"ecc": 3}})
    (tmp_path / "o").mkdir()
    up = Output(start_up(cloud, tmp_path, up_argv(
        run, 2, "--replacements", "1", "--launcher", "torchrun", "-e", "PODAGENT_GPU_CHECK=smi",
        "-e", f"PATH={bin_dir}{os.pathsep}{os.environ['PATH']}",
        "-e", "RES_OPTIONS=timeout:1 attempts:1",
        job=("--", str(LOOP), str(tmp_path / "o"), str(tmp_path / "c"), "--steps", "5"))))
    assert _end(up, 400, cloud) == 0, up.text[-5000:]
    assert (f"pod {head}'s GPUs failed their check before the job: GPU 0 "
            f"(GPU-00000000-standin): {ECC}: the run is created again under its name "
            f"(replacement 1 of 1, --replacements)") in up.text, up.text[-5000:]
    assert [r.body["name"] for r in creates(cloud)].count(head) == 2
    nothing_left(cloud)
