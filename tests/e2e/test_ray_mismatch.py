"""A worker whose image has another Ray than the head's is refused before it joins.

The head runs the test environment's Ray (the newest tested); the worker runs podagent inside
the OpenRLHF field environment (Ray 2.48.0, tests/compat/fieldenv.py), as a pod started from
an older image would.
"""

from __future__ import annotations

import signal
import subprocess
import sys

from tests.harness.agents import form_cluster

EXIT_BAD_INPUT, EXIT_SIGTERM = 2, 143


def test_a_worker_on_another_ray_is_refused_naming_both_versions(
        make_pod, dns_server, tmp_path, agents, field_envs):
    old = field_envs["openrlhf"].result()
    head_ray = subprocess.run([sys.executable, "-c", "import ray; print(ray.__version__)"],
                              capture_output=True, text=True, timeout=120).stdout.strip()
    assert head_ray != old.after["ray"] == "2.48.0"
    head, (worker,) = form_cluster(make_pod, dns_server, tmp_path, agents, workers=1,
                                   head_env={"PODAGENT_REWARD": "none"})
    worker.argv = (str(old.env.bin / "python"), "-m", "podagent")
    head.start()
    worker.start()

    assert worker.wait_exit(180) == EXIT_BAD_INPUT, worker.output[-3000:]
    errors = [line for line in worker.output.splitlines() if "ERROR" in line]
    assert len(errors) == 1, worker.output[-3000:]
    assert f"runs Ray {head_ray} and this pod has Ray 2.48.0" in errors[0], errors[0]
    assert "joined the cluster" not in worker.output  # refused before `ray start`
    assert worker.pod.pids() == [], "the refused worker left processes in its pod"
    assert "worker joined" not in head.output

    head.proc.send_signal(signal.SIGTERM)
    assert head.wait_exit(60) == EXIT_SIGTERM, head.output[-3000:]
