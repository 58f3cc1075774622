"""`podagent status`, `logs`, `check --cluster` and `stop` from a worker pod of a running
three-pod cluster."""

from __future__ import annotations

import json
import signal
import sys

from tests.e2e.test_cluster import FORM_TIMEOUT, LONG_JOB
from tests.harness.agents import form_cluster, wait_exits
from tests.harness.pods import wait_for


def test_status_logs_and_stop_from_a_worker(make_pod, dns_server, tmp_path, agents):
    """... and after the stop, every podagent does what PODAGENT_AFTER_RUN says: here `stay`
    (RunPod's default), so each stays up idle, with no Ray left, until its pod is stopped."""
    head, workers = form_cluster(make_pod, dns_server, tmp_path, agents, workers=2,
                                 head_env={"EXPECTED_WORKERS": "2", "PODAGENT_JOB": LONG_JOB,
                                           "PODAGENT_AFTER_RUN": "stay"})
    for a in (head, *workers):
        a.start()
    head.wait_output("training", timeout=FORM_TIMEOUT)
    asker = workers[0]

    def ask(*args: str, timeout: float = 60):
        return asker.pod.run([sys.executable, "-m", "podagent", *args], env=asker.env,
                             timeout=timeout)

    def status_when_running():
        shown = ask("status", "--json")
        assert shown.returncode == 0, shown.stderr
        status = json.loads(shown.stdout)
        # Ray marks the job RUNNING a moment after its driver starts printing.
        return status if status["job"] and status["job"]["status"] == "RUNNING" else None

    status = wait_for(status_when_running, timeout=60, interval=1.0,
                      what="`podagent status` to show the job RUNNING")
    assert status["role"] == "worker" and status["head"]["ip"] == head.pod.ip
    assert {n["ip"] for n in status["nodes"] if n["alive"]} == {
        head.pod.ip, *(w.pod.ip for w in workers)}
    # each node named by its pod's label
    assert {n["ip"]: n["pod"] for n in status["nodes"] if n["alive"]} == {
        a.pod.ip: a.pod.pod_id for a in (head, *workers)}
    assert status["job"]["submission_id"] == "e2e-1" and status["job"]["status"] == "RUNNING"
    assert status["reward"]["state"] == "healthy"
    assert status["uptime_s"] > 0

    text = ask("status")
    assert text.returncode == 0 and "nodes: 3 alive of 3" in text.stdout, text.stdout
    assert f"pod {workers[0].pod.pod_id}" in text.stdout, text.stdout
    logs = ask("logs")
    assert logs.returncode == 0 and "training" in logs.stdout, logs.stdout + logs.stderr
    health = ask("status", "--local")
    assert health.returncode == 0 and "podagent runs" in health.stdout, health.stdout

    # The cluster check, submitted to the running cluster from the worker beside the job.
    checked = ask("check", "--cluster", timeout=240)
    assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-3000:]
    assert "check: 3 ranks on 3 nodes, backend gloo" in checked.stdout
    assert "check: ALL CHECKS PASSED" in checked.stdout

    stopped = ask("stop", timeout=180)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert "the cluster is down" in stopped.stderr
    for a in (head, *workers):  # the head's announcement carried its policy to the workers
        a.wait_output("staying up (PODAGENT_AFTER_RUN=stay)", timeout=60)
        assert a.proc is not None and a.pod.pids() == [a.proc.pid], (
            f"{a.pod.name}: {a.pod.pids()}")  # podagent alone: no Ray, no job
    assert f"stop requested by {asker.pod.pod_id}" in head.output
    # Nothing answers any more: status says so in one line, with the documented exit code.
    after = ask("status")
    assert after.returncode == 6 and after.stderr.count("\n") == 1, after.stderr
    for a in (head, *workers):  # the pod is stopped: SIGTERM, and the run's own code
        assert a.proc is not None
        a.proc.send_signal(signal.SIGTERM)
    codes = wait_exits((head, *workers), 60)
    assert codes == [0, 0, 0], "\n\n".join(a.output[-2000:] for a in (head, *workers))
    for a in (head, *workers):
        assert a.pod.pids() == [], f"{a.pod.name} left processes behind"
