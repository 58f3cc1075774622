"""A real head logs its bring-up as a W&B run (offline): read back from the run's own files.

One podagent run with real Ray; W&B in offline mode with a fake key. The job holds the run
open until the test has looked at every process's command line, wandb's service included.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import psutil
import pytest

from podagent.cluster.runstate import CHECK_JSON_PREFIX as JSON_PREFIX
from podagent.report import wandb_run
from tests.integration.conftest import PodagentRun, Runs, wait_for
from tests.unit.test_wandb_run import OfflineRun

KEY = "1tk3y" * 8  # a fake key of a real key's length (40 characters)
GATE_TIMEOUT = 120.0

# The job: prints a passed cluster check's line the way the built-in check does (from a job
# of the user's it is only output: no check event, nothing in W&B), shows whether wandb's
# service address leaked into it, then waits (bounded) until the test opens the gate.
JOB = f"""
import json, os, pathlib, sys, time
print({JSON_PREFIX!r} + json.dumps({{"passed": True, "backend": "gloo", "world": 1,
      "failures": [], "busbw": 2.5, "transport": ["gloo/TCP via lo"],
      "nodes": [{{"node": "127.0.0.1", "ranks": [0], "all_reduce": True}}]}}), flush=True)
print("ENV WANDB_SERVICE=" + os.environ.get("{wandb_run.SERVICE_TOKEN}", "<unset>"), flush=True)
gate, deadline = pathlib.Path(sys.argv[1]), time.monotonic() + {GATE_TIMEOUT}
while not gate.exists():
    if time.monotonic() > deadline:
        sys.exit("the test never opened the gate")
    time.sleep(0.05)
print("job done", flush=True)
"""


def _cmdlines(root: psutil.Process) -> dict[int, str]:
    found = {}
    for proc in [root, *root.children(recursive=True)]:
        try:
            found[proc.pid] = "\0".join(proc.cmdline())
        except psutil.Error:  # gone meanwhile
            continue
    return found


def _program(cmdline: str) -> str:
    return Path(cmdline.split("\0")[0]).name


@pytest.fixture(scope="module")
def logged(podagent_runs: Runs) -> tuple[PodagentRun, dict[int, str]]:
    run = podagent_runs.new("wandb")
    script, gate = run.scratch / "job.py", run.scratch / "gate"
    run.scratch.mkdir(parents=True, exist_ok=True)
    script.write_text(JOB)
    wandb_state = run.scratch / "wandb-state"
    env = {
        "WANDB_MODE": "offline", "WANDB_API_KEY": KEY, "WANDB_PROJECT": "it-bringup",
        "WANDB_CACHE_DIR": str(wandb_state / "cache"),
        "WANDB_CONFIG_DIR": str(wandb_state / "config"),
        "WANDB_DATA_DIR": str(wandb_state / "data"),
        "EXPECTED_WORKERS": "0", "PODAGENT_REWARD": "none",
        "PODAGENT_JOB": shlex.join([sys.executable, str(script), str(gate)]),
    }
    with run.running(["head"], env):
        assert run.proc is not None
        # podagent says what it does with W&B before it starts Ray.
        out = wait_for(lambda: run.stdout, lambda text: "Ray head up" in text or
                       "W&B:" in text or run.proc.poll() is not None, 120,
                       "podagent's W&B line or its Ray head")
        assert "[head] W&B: logging bring-up" in out, f"podagent does not log to W&B:\n{out}"
        podagent = psutil.Process(run.proc.pid)
        # While the job waits at the gate, wandb's service and the job both run: record every
        # command line of podagent's process tree then.
        wait_for(lambda: sorted({_program(c) for c in _cmdlines(podagent).values()}),
                 lambda names: wandb_run.SERVICE_NAME in names
                 and "ENV WANDB_SERVICE=" in run.read("job.log"),
                 timeout=120, what="wandb's service, and the job waiting at its gate")
        seen = _cmdlines(podagent)
        gate.touch()
        run.wait()
    return run, seen


def test_head_says_it_logs_to_wandb_and_succeeds(logged: tuple[PodagentRun, dict]) -> None:
    run, _ = logged
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    line = (f"[head] W&B: logging bring-up to project it-bringup (offline; files in "
            f"{run.run_dir}/wandb)")
    assert line in run.stdout.splitlines(), run.stdout
    assert "wandb:" not in run.stdout + run.stderr
    assert run.stderr.strip() == "", run.stderr
    print(f"podagent head with W&B offline: {run.elapsed:.1f} s")


def test_bringup_run_holds_stages_cluster_check_and_outcome(
        logged: tuple[PodagentRun, dict]) -> None:
    run, _ = logged
    wb = OfflineRun(run.run_dir)
    assert (wb.run.project, wb.run.run_group, wb.run.display_name) == (
        "it-bringup", run.run_name, f"{run.run_name}-bringup")
    for stage in ("ray_head", "job_submitted", "job_finished"):
        assert len(wb.values(f"stage/{stage}_s")) == 1, (stage, wb.history)
    (ray_head,) = [e for e in run.events() if e["event"] == "ray_head"]
    assert wb.values("stage/ray_head_s") == [ray_head["duration_s"]]
    assert wb.values("cluster/nodes")[-1] == 1
    # The cluster check's summary counts from podagent's own check only (test_wandb_run.py
    # turns one into W&B's check/*); the user's job printing its line is output.
    assert wb.values("check/passed") == [] and "check/busbw" not in wb.summary
    assert wb.summary["job_status"] == "SUCCEEDED"
    assert wb.summary["exit_code"] == 0 and wb.exit.exit_code == 0
    assert [(n["role"], n["ip"]) for n in wb.table("cluster/node_table")] == [
        ("head", ray_head["address"].rsplit(":", 1)[0])]


def test_the_key_is_in_no_argv_file_or_job_environment(logged: tuple[PodagentRun, dict]) -> None:
    run, seen = logged
    names = {_program(c) for c in seen.values()}
    assert wandb_run.SERVICE_NAME in names, names
    assert not [c for c in seen.values() if KEY in c], "the key is on a command line"
    assert KEY not in run.stdout and KEY not in run.stderr
    holding = [str(p) for p in run.scratch.rglob("*")
               if p.is_file() and not p.is_symlink() and KEY.encode() in p.read_bytes()]
    assert holding == [], f"the W&B key appears in {holding}"
    # wandb's service is podagent's alone: the job was not pointed at it.
    assert run.job_env().get(wandb_run.SERVICE_TOKEN) == "<unset>", run.read("job.log")


def test_nothing_is_left_running(logged: tuple[PodagentRun, dict]) -> None:
    run, _ = logged
    # wandb's service inherited the run's Ray temp dir in its environment: it counts too.
    assert run.leftovers == []
    events = [json.loads(line) for line in run.read("events.jsonl").splitlines()]
    assert events[-1]["event"] == "exit" and events[-1]["code"] == 0
