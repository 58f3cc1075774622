"""A stop request in Ray's key-value store (what `podagent stop` writes) ends the run in order:
the job is stopped, Ray is stopped, podagent exits 0 — while the job runs, and while the head
still waits for its workers."""

from __future__ import annotations

import json
import sys
import time

import pytest

from podagent.cluster import runstate
from podagent.ray_access.gcs import GcsClient
from tests.integration.conftest import PodagentRun, Runs, wait_for

LONG_JOB = "import time\nprint('started', flush=True)\ntime.sleep(600)\n"


def _await_output(run: PodagentRun, read, text: str) -> None:
    """Until text appears; a podagent that exits first fails the wait at once."""
    def seen() -> str:
        if run.proc is not None and run.proc.poll() is not None and text not in read():
            raise AssertionError(f"podagent exited {run.proc.returncode} before {text!r}:\n"
                                 f"{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
        return read()

    wait_for(seen, lambda out: text in out, timeout=180, what=repr(text))


def _request_stop(run: PodagentRun, by: str) -> None:
    (head,) = [e for e in run.events() if e["event"] == "ray_head" and e["result"] == "ok"]
    gcs = GcsClient(head["address"])
    try:
        request = json.dumps({"by": by, "at": time.time()}).encode()
        gcs.kv_put(runstate.KV_NAMESPACE, runstate.KV_STOP_REQUEST, request, timeout=10)
    finally:
        gcs.close()


@pytest.fixture(scope="module")
def stopped_while_running(podagent_runs: Runs) -> PodagentRun:
    run = podagent_runs.new("stopreq")
    script = run.scratch / "long_job.py"
    script.write_text(LONG_JOB)
    with run.running(["head", "--", sys.executable, str(script)],
                     env={"PODAGENT_REWARD": "none"}):
        _await_output(run, lambda: run.read("job.log"), "started")
        _request_stop(run, "pod-operator")
        run.wait(timeout=90)
    return run


def test_a_stop_request_stops_the_job_and_exits_0(stopped_while_running: PodagentRun) -> None:
    run = stopped_while_running
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr}"
    assert "stop requested by pod-operator at " in run.stdout
    assert f"job {run.run_name}-1 stopped (status STOPPED)" in run.stdout
    assert run.stderr.strip() == ""  # an orderly end is no error
    (requested,) = run.events_named("stop_requested")
    assert requested["by"] == "pod-operator" and requested["at"] > 0
    (job_stopped,) = run.events_named("job_stopped")
    assert job_stopped["status"] == "STOPPED"
    (teardown,) = run.events_named("teardown")
    assert teardown["outcome"] == "StopRequested"
    assert run.events()[-1] == {**run.events()[-1], "event": "exit", "code": 0}
    assert run.leftovers == []


def test_a_stop_request_ends_the_wait_for_workers(podagent_runs: Runs) -> None:
    run = podagent_runs.new("stopwait")
    # Loopback: this machine's own address may be public, which a head of workers refuses.
    with run.running(["head"], env={"EXPECTED_WORKERS": "2", "PODAGENT_REWARD": "none",
                                    "PODAGENT_NODE_IP": "127.0.0.1"}):
        _await_output(run, lambda: run.stdout, "waiting for 2 worker(s)")
        _request_stop(run, "pod-b")
        run.wait(timeout=60)
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr}"
    assert "stop requested by pod-b" in run.stdout
    assert not run.events_named("job_submitted")
    assert run.leftovers == []
