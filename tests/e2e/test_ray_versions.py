"""Two pods on this image's own Ray, whatever its version (ray_matrix: every tested Ray).

A head and one worker form the cluster; the job reports the Ray its driver and a task on each
node run; then the head pod dies and the worker (PODAGENT_REJOIN=0) leaves with the documented
code in time.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from tests.harness.agents import form_cluster
from tests.harness.pods import wait_for

pytestmark = pytest.mark.ray_matrix

FORM_TIMEOUT = 240.0
EXIT_HEAD_LOST = 7
GRACE = 8.0  # PODAGENT_HEAD_GRACE's default

JOB = """
import time
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

ray.init(address="auto", logging_level="ERROR")

@ray.remote(num_cpus=0)
def where():
    import ray
    return ray.util.get_node_ip_address(), ray.__version__

nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
placed = [where.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False))
          .remote() for n in nodes]
print("DRIVER", ray.__version__, flush=True)
for ip, version in sorted(ray.get(placed)):
    print("NODE", ip, version, flush=True)
print("training", flush=True)
time.sleep(600)
"""


def test_head_and_worker_run_the_images_ray_and_the_worker_leaves_a_lost_head(
        make_pod, dns_server, tmp_path, agents):
    expected = subprocess.run([sys.executable, "-c", "import ray; print(ray.__version__)"],
                              capture_output=True, text=True, timeout=120).stdout.strip()
    script = tmp_path / "versions.py"
    script.write_text(JOB)
    head, (worker,) = form_cluster(
        make_pod, dns_server, tmp_path, agents, workers=1,
        head_env={"PODAGENT_REWARD": "none", "PODAGENT_JOB": f"{sys.executable} {script}"},
        worker_env={"PODAGENT_REJOIN": "0"})
    head.start()
    worker.start()
    head.wait_output("training", timeout=FORM_TIMEOUT)

    for agent, role in ((head, "head"), (worker, "worker")):
        first = agent.output.splitlines()[0]
        assert f"(Ray {expected}): this pod is the {role}" in first, first
    assert f"DRIVER {expected}" in head.output, head.output[-3000:]
    nodes = dict(re.findall(r"^NODE ([\d.]+) (\S+)$", head.output, re.M))
    assert nodes == {head.pod.ip: expected, worker.pod.ip: expected}, head.output[-3000:]

    lost = time.monotonic()
    head.kill_pod()
    assert worker.wait_exit(GRACE + 60) == EXIT_HEAD_LOST, worker.output[-3000:]
    took = time.monotonic() - lost
    assert took <= GRACE + 5, f"the worker left {took:.1f} s after the head died"
    assert "has been unreachable" in worker.output
    wait_for(lambda: worker.pod.pids() == [], timeout=10, what="the worker pod to be empty")
