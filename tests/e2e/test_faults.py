"""Faults on namespaced pods: a worker pod dies mid-job, the head's podagent gets SIGTERM
mid-job, and reward servers that fail at start. Each run is the real podagent in every pod."""

from __future__ import annotations

import json
import shlex
import signal
import socket
import sys
import time
from pathlib import Path

from tests.e2e.test_cluster import FORM_TIMEOUT
from tests.harness.agents import Agent, form_cluster, wait_exits
from tests.harness.pods import Pod, wait_for

NOTICE_WITHIN = 15.0  # the bound: worker pod killed -> the head has recorded it
EXIT_REWARD_FAILED, EXIT_REWARD_TIMEOUT, EXIT_SIGTERM = 11, 12, 143

# Prints "step 1", a line its own command line does not hold, then trains for 10 minutes.
LONG_JOB = "python -c 'import time; print(\"step\", 1, flush=True); time.sleep(600)'"
# Runs on the head only (the Ray driver): says it trains, then waits for the test's go-ahead.
WAIT_FOR_MARKER = """
import os, sys, time
print("training", flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.2)
print("marker seen: done", flush=True)
"""


def _run_dir(agent: Agent) -> Path:
    return agent.run_dir


def _events(agent: Agent) -> list[dict]:
    text = (_run_dir(agent) / "events.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_worker_pod_killed_mid_job_head_notices_and_the_job_decides(make_pod, dns_server,
                                                                    tmp_path, agents):
    """e) PODAGENT_ON_NODE_LOSS=fail (what podagent did before restarts existed): the worker's
    whole pod is SIGKILLed while the job runs: within 15 s the head warns, naming the worker,
    and records a worker_lost event; the job (on the head only) goes on and succeeds, so the
    head exits 0 and nothing is restarted."""
    script, marker = tmp_path / "job.py", tmp_path / "go"
    script.write_text(WAIT_FOR_MARKER)
    head, (worker,) = form_cluster(
        make_pod, dns_server, tmp_path, agents, workers=1,
        head_env={"EXPECTED_WORKERS": "1", "PODAGENT_REWARD": "none",
                  "PODAGENT_ON_NODE_LOSS": "fail",
                  "PODAGENT_JOB": shlex.join([sys.executable, str(script), str(marker)])})
    for a in (head, worker):
        a.start()
    head.wait_output("training", timeout=FORM_TIMEOUT)
    worker.wait_output("watching the head", timeout=30)

    killed_at, killed_wall = time.monotonic(), time.time()
    worker.kill_pod()
    warning = f"WARNING: worker {worker.pod.ip} left the cluster while the job ran"
    wait_for(lambda: warning in head.output, timeout=NOTICE_WITHIN + 60, interval=0.1,
             what="the head to notice the lost worker")
    took = time.monotonic() - killed_at
    assert took <= NOTICE_WITHIN, f"the head noticed the lost worker after {took:.1f} s"
    (lost,) = [e for e in _events(head) if e["event"] == "worker_lost"]
    assert lost["ip"] == worker.pod.ip
    assert killed_wall <= lost["at"] <= killed_wall + NOTICE_WITHIN, lost
    assert head.proc is not None and head.proc.poll() is None  # the job decides, not podagent
    assert "the job decides whether it goes on" in head.output

    marker.write_text("go")
    assert head.wait_exit(60) == 0, head.output[-3000:]
    assert "marker seen: done" in head.output and "[head] job SUCCEEDED" in head.output
    assert "RESTART" not in head.output and not [e for e in _events(head)
                                                if e["event"] == "restart"]
    assert worker.wait_exit(10) == -signal.SIGKILL
    assert head.pod.pids() == [], head.pod.pids()


def listening(pod: Pod) -> dict[int, set[str]]:
    """TCP port -> addresses something in the pod listens on (from the pod's /proc/net/tcp)."""
    found: dict[int, set[str]] = {}
    for pid in pod.pids():
        try:
            tables = {t: Path(f"/proc/{pid}/net/{t}").read_text() for t in ("tcp", "tcp6")}
        except OSError:
            continue  # it exited meanwhile: any process of the pod shows the same tables
        for name, table in tables.items():
            for line in table.splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state != "0A":  # LISTEN
                    continue
                address, port = local.split(":")
                if name == "tcp":
                    ip = socket.inet_ntoa(bytes.fromhex(address)[::-1])
                else:
                    ip = "::" if set(address) == {"0"} else f"v6:{address}"
                found.setdefault(int(port, 16), set()).add(ip)
        return found
    return found


def test_sigterm_to_the_head_mid_job_closes_every_pod(make_pod, dns_server, tmp_path, agents):
    """h) SIGTERM to the head's podagent while the job runs on 2 workers' cluster: the job is
    STOPPED, the reward server and Ray are stopped, the head exits 143, the workers got the
    closing announcement and exit 0 (PODAGENT_REJOIN=0: they do not wait for the head to come
    back), no process is left in any pod, and the logs stay.
    Also: the dashboard and the reward server listen on the head's cluster address only."""
    head, workers = form_cluster(make_pod, dns_server, tmp_path, agents, workers=2,
                                 head_env={"EXPECTED_WORKERS": "2", "PODAGENT_JOB": LONG_JOB},
                                 worker_env={"PODAGENT_REJOIN": "0"})
    for a in (head, *workers):
        a.start()
    head.wait_output("\nstep 1\n", timeout=FORM_TIMEOUT)
    for w in workers:
        w.wait_output("watching the head", timeout=30)

    ports = listening(head.pod)
    assert ports.get(8265) == {head.pod.ip}, ports  # the dashboard (Jobs API)
    assert ports.get(5000) == {head.pod.ip}, ports  # the reward server

    assert head.proc is not None
    head.proc.send_signal(signal.SIGTERM)
    assert head.wait_exit(90) == EXIT_SIGTERM, head.output[-3000:]
    assert wait_exits(workers, 60) == [0, 0], "\n\n".join(
        w.output[-2000:] for w in workers)

    out = head.output
    assert "[head] job e2e-1 stopped (status STOPPED)" in out, out[-3000:]
    assert "Ray stopped (" in out
    assert "ERROR" not in out  # a signal is no error
    for w in workers:
        assert "the head is closing the run (Interrupted, job STOPPED)" in w.output
        assert "Ray stopped (" in w.output
    for a in (head, *workers):
        assert a.pod.pids() == [], f"{a.pod.name} left processes behind: {a.pod.pids()}"
    # The logs survive the teardown: each pod's log, the events, the job's and reward's output.
    run_dir = _run_dir(head)
    assert "step 1" in (run_dir / "job.log").read_text()
    assert (run_dir / "reward.log").exists()
    names = [e["event"] for e in _events(head)]
    assert "job_stopped" in names and names[-1] == "exit"
    for a in (head, *workers):
        log = _run_dir(a) / f"podagent-{'head' if a is head else 'worker'}-{a.pod.pod_id}.log"
        assert "Ray stopped (" in log.read_text(), log


def _lone_head(make_pod, dns_server, tmp_path, agents, server: list[str],
               **env: str) -> Agent:
    head, _ = form_cluster(make_pod, dns_server, tmp_path, agents, workers=0,
                           head_env={"EXPECTED_WORKERS": "0", "PODAGENT_REWARD": "cmd",
                                     "PODAGENT_REWARD_CMD": shlex.join(server),
                                     "PODAGENT_JOB": LONG_JOB, **env})
    return head.start()


def test_reward_server_that_exits_at_start_fails_the_head_fast(make_pod, dns_server, tmp_path,
                                                               agents):
    """f) a reward server that exits at start: exit 11 with its log tail, no job submitted."""
    server = [sys.executable, "-c",
              "import sys; print('cannot load the reward model', flush=True); sys.exit(7)"]
    head = _lone_head(make_pod, dns_server, tmp_path, agents, server)
    assert head.wait_exit(FORM_TIMEOUT) == EXIT_REWARD_FAILED, head.output[-3000:]
    errors = [line for line in head.output.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "reward server exited with code 7 while starting" in errors[0]
    assert "cannot load the reward model" in head.output  # the tail of reward.log
    assert "job_submitted" not in [e["event"] for e in _events(head)]
    assert not (_run_dir(head) / "job.log").exists()
    assert head.pod.pids() == []


def test_reward_server_that_never_answers_times_out(make_pod, dns_server, tmp_path, agents):
    """g) a reward server that never answers: exit 12 after PODAGENT_REWARD_TIMEOUT, with its
    log tail, no job submitted."""
    server = [sys.executable, "-c",
              "import time; print('loading the model', flush=True); time.sleep(600)"]
    head = _lone_head(make_pod, dns_server, tmp_path, agents, server,
                      PODAGENT_REWARD_TIMEOUT="5")
    assert head.wait_exit(FORM_TIMEOUT) == EXIT_REWARD_TIMEOUT, head.output[-3000:]
    errors = [line for line in head.output.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "did not answer a real request" in errors[0]
    assert "within 5 s" in errors[0]
    assert "loading the model" in head.output
    assert "job_submitted" not in [e["event"] for e in _events(head)]
    assert head.pod.pids() == []
