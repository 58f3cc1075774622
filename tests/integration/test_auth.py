"""Ray token authentication: with a cluster token set, the Jobs API and the GCS refuse anyone
without it, podagent's own clients carry it, and it never shows."""

from __future__ import annotations

import secrets
import signal
import sys
from typing import Any

import psutil
import pytest
import requests

from podagent.ray_access.gcs import GcsAuthRefused, GcsClient
from tests.integration.conftest import PodagentRun, Runs, wait_for

LONG_JOB = "import time\nprint('started', flush=True)\ntime.sleep(600)\n"
RUNPOD_KEY = "rpa_" + "K" * 40
WANDB_KEY = "w" * 40
SECRETS = ("RUNPOD_API_KEY", "WANDB_API_KEY", "PODAGENT_TOKEN", "RAY_AUTH_TOKEN")


def _environments(run: PodagentRun, job_script: str) -> dict[str, dict[str, str]]:
    """The secrets each child of podagent has: by role (raylet, gcs_server, dashboard, reward
    server, job, W&B's service, ...), every process of the run."""
    found: dict[str, dict[str, str]] = {}
    for proc in run.processes():
        try:
            cmdline, name, environ = " ".join(proc.cmdline()), proc.name(), proc.environ()
        except psutil.Error:
            continue
        role = ("reward server" if "podagent.rewards" in cmdline else
                "job" if job_script in cmdline else
                "dashboard" if "dashboard/dashboard.py" in cmdline else name)
        found[f"{role} {proc.pid}"] = {k: v for k, v in environ.items() if k in SECRETS}
    return found


@pytest.fixture(scope="module")
def guarded(podagent_runs: Runs) -> tuple[PodagentRun, dict[str, Any]]:
    run = podagent_runs.new("auth")
    token = secrets.token_hex(32)
    script = run.scratch / "long_job.py"
    script.write_text(LONG_JOB)
    seen: dict[str, Any] = {}
    with run.running(["head", "--", sys.executable, str(script)],
                     env={"PODAGENT_TOKEN": token, "PODAGENT_NODE_IP": "127.0.0.1",
                          "RUNPOD_API_KEY": RUNPOD_KEY, "WANDB_API_KEY": WANDB_KEY,
                          "WANDB_MODE": "offline"}):
        wait_for(lambda: run.read("job.log"), lambda log: "started" in log, timeout=180,
                 what="the job's 'started' line (podagent's own clients carry the token)")
        seen["environ"] = _environments(run, str(script))
        url = f"http://127.0.0.1:{run.dashboard_port}/api/jobs/"
        seen["jobs_without_token"] = requests.get(url, timeout=10).status_code
        seen["jobs_with_wrong_token"] = requests.get(
            url, timeout=10, headers={"Authorization": "Bearer " + "0" * 64}).status_code
        seen["jobs_with_token"] = requests.get(
            url, timeout=10, headers={"Authorization": f"Bearer {token}"}).status_code
        gcs = GcsClient(f"127.0.0.1:{run.ray_port}")
        try:
            gcs.check_alive(timeout=5)
            seen["gcs_without_token"] = 0
        except GcsAuthRefused:
            seen["gcs_without_token"] = 1
        finally:
            gcs.close()
        assert run.proc is not None
        run.proc.send_signal(signal.SIGTERM)
        run.wait(timeout=60)
    seen["token_leaks"] = sum(
        token in text for text in [run.stdout, run.stderr]
        + [p.read_text(errors="replace") for p in run.run_dir.rglob("*") if p.is_file()])
    return run, seen


def test_jobs_api_refuses_requests_without_the_token(guarded) -> None:
    _, seen = guarded
    assert seen["jobs_without_token"] in (401, 403)
    assert seen["jobs_with_wrong_token"] in (401, 403)
    assert seen["jobs_with_token"] == 200


def test_gcs_refuses_a_client_without_the_token(guarded) -> None:
    _, seen = guarded
    assert seen["gcs_without_token"] == 1


def test_token_never_shows_and_no_open_dashboard_warning(guarded) -> None:
    run, seen = guarded
    assert run.returncode == 143, f"{run.stdout[-2000:]}\n{run.stderr}"
    assert seen["token_leaks"] == 0
    assert "NO CLUSTER TOKEN" not in run.stdout
    assert run.leftovers == []


def test_each_child_gets_only_the_secrets_it_needs(guarded) -> None:
    """RUNPOD_API_KEY is podagent's alone: no child has it (Ray, the job, W&B's service, the
    reward server). The built-in reward server, which runs sympy on untrusted model output,
    gets no secret at all. The job keeps what it needs: the W&B key and the cluster token."""
    _, seen = guarded
    environ = seen["environ"]
    roles = {name.rsplit(" ", 1)[0] for name in environ}
    assert {"raylet", "gcs_server", "dashboard", "reward server", "job"} <= roles, roles
    assert not [name for name, env in environ.items() if "RUNPOD_API_KEY" in env], environ
    for name, env in environ.items():
        if name.startswith("reward server"):
            assert env == {}, (name, sorted(env))
        if name.startswith("job"):
            assert env.get("WANDB_API_KEY") == WANDB_KEY and env.get("RAY_AUTH_TOKEN"), name
