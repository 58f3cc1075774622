"""The default job on head + 2 worker pods, on this image's own Ray (ray_matrix: every tested Ray).

No job is given, so the head runs the built-in cluster check (with the built-in reward server):
one rank on each of the three pods. On Ray 2.48 this failed on every rank (ActorDiedError, the
driver's "SchedulingCancelled: Actor creation cancelled"): see clustercheck.own_node_address.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.e2e.test_cluster import FORM_TIMEOUT, _check_passed_on
from tests.harness.agents import form_cluster

pytestmark = pytest.mark.ray_matrix


def test_default_job_passes_on_head_and_two_workers(make_pod, dns_server, tmp_path, agents):
    expected = subprocess.run([sys.executable, "-c", "import ray; print(ray.__version__)"],
                              capture_output=True, text=True, timeout=120).stdout.strip()
    head, workers = form_cluster(make_pod, dns_server, tmp_path, agents, workers=2,
                                 head_env={"EXPECTED_WORKERS": "2"})
    for agent in (head, *workers):
        agent.start()
    codes = [a.wait_exit(FORM_TIMEOUT) for a in (head, *workers)]
    assert codes == [0, 0, 0], "\n\n".join(a.output[-2500:] for a in (head, *workers))

    out = head.output
    assert f"(Ray {expected}): this pod is the head" in out.splitlines()[0], out[:500]
    assert "CHECK FAILED" not in out, out[-4000:]
    _check_passed_on(out, [head, *workers])
    for w in workers:
        assert "the head is closing the run" in w.output, w.output[-2000:]
