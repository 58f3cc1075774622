"""Ray token authentication: with a cluster token set, the Jobs API and the GCS refuse anyone
without it, podagent's own clients carry it, and it never shows."""

from __future__ import annotations

import secrets
import signal
import sys

import pytest
import requests

from podagent.gcs import GcsAuthRefused, GcsClient
from tests.integration.conftest import PodagentRun, Runs, wait_for

LONG_JOB = "import time\nprint('started', flush=True)\ntime.sleep(600)\n"


@pytest.fixture(scope="module")
def guarded(podagent_runs: Runs) -> tuple[PodagentRun, dict[str, int]]:
    run = podagent_runs.new("auth")
    token = secrets.token_hex(32)
    script = run.scratch / "long_job.py"
    script.write_text(LONG_JOB)
    seen: dict[str, int] = {}
    with run.running(["head", "--", sys.executable, str(script)],
                     env={"PODAGENT_TOKEN": token, "PODAGENT_NODE_IP": "127.0.0.1",
                          "PODAGENT_REWARD": "none"}):
        wait_for(lambda: run.read("job.log"), lambda log: "started" in log, timeout=180,
                 what="the job's 'started' line (podagent's own clients carry the token)")
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
