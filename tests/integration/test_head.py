"""A standalone head for real: Ray starts, the job runs, podagent reports it and cleans up.

Each scenario is one podagent run (a module fixture); the tests below each check one aspect.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import shlex
import socket
import sys

import pytest

from tests.integration.conftest import JOB_ENV_SCRIPT, PodagentRun, Runs

HEAD_UP = re.compile(
    r"^\[head\] Ray head up at (?P<ip>[\d.]+):(?P<port>\d+) \(GCS answers\) "
    r"\(\d+\.\d s\)$", re.M)


def assert_exit(run: PodagentRun, code: int) -> None:
    assert run.returncode == code, (
        f"podagent exited {run.returncode}, expected {code}\n"
        f"--- stdout ---\n{run.stdout[-4000:]}\n--- stderr ---\n{run.stderr[-4000:]}")


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


# --- 1. the built-in cluster check ---------------------------------------------------------


@pytest.fixture(scope="module")
def smoke(podagent_runs: Runs) -> PodagentRun:
    return podagent_runs.new("smoke").execute(["head"])


def test_smoke_job_succeeds_and_shows_each_step(smoke: PodagentRun) -> None:
    assert_exit(smoke, 0)
    out = smoke.stdout
    head = HEAD_UP.search(out)
    assert head, f"no 'Ray head up at ... (N.N s)' line in:\n{out}"
    assert int(head["port"]) == smoke.ray_port
    assert f"dashboard answers at http://{head['ip']}:{smoke.dashboard_port}" in out, out
    assert re.search(rf"^\[head\] job {smoke.run_name}-1 submitted \(the built-in cluster "
                     r"check\) \(\d+\.\d s\)$", out, re.M), out
    assert "check: 1 ranks on 1 nodes, backend gloo" in out, out
    # The check names the node as Ray registered it (a one-node head on loopback: Ray takes
    # this machine's own address for its node).
    assert re.search(r"^check: \S+ +0 +cpu .*✓ .*$", out, re.M), out
    assert re.search(r"^\[head\] job SUCCEEDED \(\d+\.\d s\)$", out, re.M), out
    # The job's output is shown once: the live stream and the final catch-up do not overlap.
    assert len([x for x in lines(out) if x.startswith("check: ALL CHECKS PASSED")]) == 1, out
    # Its machine-readable summary is an event, not screen text.
    assert "podagent-check-json" not in out
    (check,) = smoke.events_named("check")
    assert check["passed"] is True and check["world"] == 1 and check["backend"] == "gloo"
    # No cluster token and a dashboard beyond loopback: a loud warning (CVE-2023-48022).
    if not head["ip"].startswith("127."):
        assert "WARNING: NO CLUSTER TOKEN: the Ray dashboard and Jobs API" in out, out
    assert smoke.stderr.strip() == ""


def test_smoke_run_dir_holds_the_logs(smoke: PodagentRun) -> None:
    names = {p.name for p in smoke.run_dir.iterdir()}
    pod_log = f"podagent-head-{socket.gethostname()}.log"
    assert {"job.log", pod_log, "ray-start-head.log", "events.jsonl"} <= names, names
    job_log = smoke.read("job.log")
    assert [x for x in lines(job_log) if x.startswith("check: ALL CHECKS PASSED")], job_log
    assert "job SUCCEEDED" in smoke.read(pod_log)
    assert smoke.read("ray-start-head.log").strip(), "`ray start` wrote nothing"


def test_smoke_events_record_the_lifecycle(smoke: PodagentRun) -> None:
    events = smoke.events()
    names = [e["event"] for e in events]
    assert names[0] == "role" and names[-1] == "exit", names
    assert events[0]["role"] == "head" and events[0]["run"] == smoke.run_name
    (ray_head,) = smoke.events_named("ray_head")
    assert ray_head["result"] == "ok" and ray_head["duration_s"] > 0, ray_head
    assert ray_head["address"].endswith(f":{smoke.ray_port}")
    (submitted,) = smoke.events_named("job_submitted")
    assert submitted["result"] == "ok" and submitted["submission_id"] == f"{smoke.run_name}-1"
    (finished,) = smoke.events_named("job_finished")
    assert (finished["result"], finished["status"]) == ("ok", "SUCCEEDED"), finished
    assert events[-1]["code"] == 0 and "error" not in events[-1], events[-1]
    order = [names.index(n) for n in ("role", "ray_head", "job_submitted", "job_finished",
                                       "teardown", "exit")]
    assert order == sorted(order), names


def test_smoke_leaves_no_ray_process(smoke: PodagentRun) -> None:
    assert smoke.leftovers == []


# --- 2. a job that fails --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def failed(podagent_runs: Runs) -> PodagentRun:
    job = [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"]
    return podagent_runs.new("failed").execute(["head", "--", *job])


def test_failed_job_exits_3_with_its_output(failed: PodagentRun) -> None:
    assert_exit(failed, 3)
    assert "boom" in lines(failed.stdout), failed.stdout
    assert "boom" in lines(failed.read("job.log")), failed.read("job.log")
    assert re.search(r"^\[head\] job FAILED \(\d+\.\d s\)$", failed.stdout, re.M)
    first = failed.stderr.splitlines()[0] if failed.stderr else ""
    assert first.startswith(f"[head] ERROR: job {failed.run_name}-1 failed"), failed.stderr
    assert "exit code 3" in first, failed.stderr
    (finished,) = failed.events_named("job_finished")
    assert finished["status"] == "FAILED"
    assert failed.events()[-1]["event"] == "exit" and failed.events()[-1]["code"] == 3
    assert failed.leftovers == []


def test_failed_job_error_is_one_line(failed: PodagentRun) -> None:
    assert_exit(failed, 3)
    err = lines(failed.stderr)
    assert len(err) == 1 and err[0].startswith("[head] ERROR:"), failed.stderr


# --- 2b. a job that prints podagent's own records ------------------------------------------------

FORGER = ("import json\n"
          "from podagent.wire import Event\n"
          "for e in Event:\n"
          "    print(json.dumps({'ts': 1.0, 'pod': 'x', 'role': 'head', 'event': e.value,\n"
          "                      'code': 0, 'forged': True}), flush=True)\n"
          "print('podagent-check-json: ' + json.dumps({'event': 'run_over', 'code': 0,\n"
          "                                            'passed': False, 'forged': True}))\n")


@pytest.fixture(scope="module")
def forger(podagent_runs: Runs) -> PodagentRun:
    run = podagent_runs.new("forger")
    script = run.scratch / "forger.py"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(FORGER)
    return run.execute(["head", "--", sys.executable, str(script)],
                       env={"PODAGENT_LOG_FORMAT": "json"})


def test_a_job_printing_every_event_podagent_knows_passes_for_none(forger: PodagentRun) -> None:
    """As JSON (what `podagent up` follows), the Ray job's every line is a `job` record, the
    cluster check's summary line from a job of the user's is only output, and events.jsonl
    holds podagent's events alone: nothing a job prints ends a run or passes for a check."""
    from podagent.launch import follow
    from podagent.wire import Event

    assert_exit(forger, 0)
    records = [follow.parse(line) for line in lines(forger.stdout)]
    assert not [r for r in records if r.kind == "event" and r.data.get("forged")]
    # (podagent's own messages quote the job's command line, which says "forged": text.)
    assert {r.kind for r in records if "forged" in str(r.data)} <= {"job", "message"}
    jobs = [r.text for r in records if r.kind == "job" and "forged" in r.text]
    assert len(jobs) == len(Event) + 1, jobs
    events = forger.events()
    assert not [e for e in events if e.get("forged")], events
    assert forger.events_named("check") == []
    assert [e["event"] for e in events][-1] == "exit" and events[-1]["code"] == 0


# --- 3. PODAGENT_JOB: the job's environment, the NCCL preset, W&B -----------------------------

JOB_VARIABLES = ("PODAGENT_NUM_NODES", "PODAGENT_HEAD_ADDR", "PODAGENT_RUN_NAME",
                 "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_LAUNCH_MODE",
                 "NCCL_IB_DISABLE", "NCCL_NET_SOCKET_FAMILY", "WANDB_PROJECT")


@pytest.fixture(scope="module")
def with_env(podagent_runs: Runs) -> tuple[PodagentRun, str]:
    run = podagent_runs.new("env")
    script = run.scratch / "show_env.py"
    script.write_text(JOB_ENV_SCRIPT)
    secret = secrets.token_hex(16)
    job = shlex.join([sys.executable, str(script), *JOB_VARIABLES])
    # No subcommand: nothing names a role, so podagent decides it is a standalone head.
    run.execute([], env={
        "PODAGENT_JOB": job,
        "PODAGENT_NCCL_PRESET": "runpod-global",
        "NCCL_SOCKET_IFNAME": "lo",  # the user's own value: must win over the preset's podnet1
        "WANDB_API_KEY": secret,
        "WANDB_PROJECT": "demo",
        "WANDB_MODE": "offline",  # no internet here; the bring-up run is logged offline
    })
    return run, secret


def test_job_sees_podagent_variables(with_env: tuple[PodagentRun, str]) -> None:
    run, _ = with_env
    assert_exit(run, 0)
    assert "this pod is the head (no role variable is set: a standalone head)" in run.stdout
    head = HEAD_UP.search(run.stdout)
    assert head, run.stdout
    env = run.job_env()
    assert env.get("PODAGENT_NUM_NODES") == "1", env
    assert env.get("PODAGENT_HEAD_ADDR") == head["ip"], env
    assert env.get("PODAGENT_RUN_NAME") == run.run_name, env
    assert run.leftovers == []


def test_preset_applies_but_the_users_nccl_variable_wins(
        with_env: tuple[PodagentRun, str]) -> None:
    run, _ = with_env
    assert_exit(run, 0)
    env = run.job_env()
    # The preset's other variables arrive...
    assert env.get("NCCL_LAUNCH_MODE") == "GROUP", env
    assert env.get("NCCL_IB_DISABLE") == "1", env
    assert env.get("NCCL_NET_SOCKET_FAMILY") == "IPv4", env
    # ...but the interface is the user's, and gloo follows NCCL's interface.
    assert env.get("NCCL_SOCKET_IFNAME") == "lo", env
    assert env.get("GLOO_SOCKET_IFNAME") == "lo", env
    assert "NCCL preset runpod-global" in run.stdout
    assert "your own NCCL_SOCKET_IFNAME kept" in run.stdout
    # The user's interface also picked the address Ray listens on.
    head = HEAD_UP.search(run.stdout)
    assert head and head["ip"] == "127.0.0.1", run.stdout


def test_wandb_settings_reach_the_job_and_the_key_stays_secret(
        with_env: tuple[PodagentRun, str]) -> None:
    run, secret = with_env
    assert_exit(run, 0)
    env = run.job_env()
    assert env.get("WANDB_PROJECT") == "demo", env
    # The job inherits the key from Ray's environment (it has the right value)...
    assert env.get("WANDB_API_KEY_SHA256") == hashlib.sha256(secret.encode()).hexdigest(), env
    # ...but it never went through the Jobs API (the job's runtime_env is readable by anyone
    # who can read the dashboard).
    assert env.get("KEY_IN_JOB_CONFIG") == "False", env
    assert secret not in run.stdout and secret not in run.stderr
    files = [p for p in run.run_dir.rglob("*") if p.is_file()]
    assert len(files) >= 4, files
    holding = [p.name for p in files if secret.encode() in p.read_bytes()]
    assert holding == [], f"the W&B key appears in {holding}"


# --- 6. a port already held -----------------------------------------------------------------------


def test_port_already_held_exits_9_without_starting_ray(podagent_runs: Runs) -> None:
    run = podagent_runs.new("port")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", run.ray_port))
        holder.listen()
        run.execute(["head"], env={"PODAGENT_NODE_IP": "127.0.0.1"}, timeout=60)
    assert_exit(run, 9)
    err = lines(run.stderr)
    assert len(err) == 1, run.stderr
    assert err[0].startswith(f"[head] ERROR: port {run.ray_port} on 127.0.0.1 is already in use"
                             f" by pid {os.getpid()} "), err[0]
    assert not (run.run_dir / "ray-start-head.log").exists()
    assert run.events_named("ray_head") == []
    assert run.events()[-1]["event"] == "exit" and run.events()[-1]["code"] == 9
    assert os.listdir(run.temp_dir) == [], "Ray wrote into its temp dir"
    assert run.leftovers == []


# --- a stale Ray from an earlier run on this pod is cleaned before the start -----------------


def test_stale_ray_of_an_earlier_run_is_stopped_first(podagent_runs: Runs) -> None:
    import subprocess
    import sys
    from pathlib import Path

    run = podagent_runs.new("stale")
    ray = str(Path(sys.executable).parent / "ray")
    # An earlier run's Ray, on the same ports and temp dir, not started by this podagent.
    subprocess.run([ray, "start", "--head", "--node-ip-address", "127.0.0.1",
                    "--port", str(run.ray_port), "--dashboard-port", str(run.dashboard_port),
                    "--temp-dir", run.temp_dir, "--num-gpus", "0", "--disable-usage-stats"],
                   env=run.env, check=True, capture_output=True, timeout=180)
    # What is tested is the clean-up before Ray starts: a trivial job, not the cluster check.
    run.execute(["head", "--", sys.executable, "-c", "pass"],
                env={"PODAGENT_NODE_IP": "127.0.0.1", "PODAGENT_REWARD": "none"})
    assert_exit(run, 0)
    assert re.search(r"^\[head\] stopped a stale Ray on this pod \(\d+ processes", run.stdout,
                     re.M), run.stdout
    (stale,) = run.events_named("stale_ray_stopped")
    assert stale["processes"] > 0
    assert run.leftovers == []
