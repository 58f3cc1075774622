"""The cluster check on namespaced pods: a pod whose preset names an interface it lacks fails
the check, and the failure names that pod (the head exits with the job's outcome)."""

from __future__ import annotations

import re

from tests.e2e.test_cluster import FORM_TIMEOUT
from tests.harness.agents import form_cluster, wait_exits

EXIT_JOB_FAILED = 3


def test_wrong_preset_on_one_worker_fails_the_check_naming_it(make_pod, dns_server, tmp_path,
                                                               agents):
    head, (good, bad) = form_cluster(make_pod, dns_server, tmp_path, agents, workers=2,
                                 head_env={"EXPECTED_WORKERS": "2", "PODAGENT_REWARD": "none"})
    # InfiniBand's preset names ib0; this pod has only podnet1.
    bad.env["PODAGENT_NCCL_PRESET"] = "infiniband"
    for a in (head, good, bad):
        a.start()
    assert head.wait_exit(FORM_TIMEOUT) == EXIT_JOB_FAILED, head.output[-4000:]
    out = head.output
    failed = re.findall(r"^check: CHECK FAILED: (.*)$", out, re.M)
    assert len(failed) == 1, out[-4000:]
    assert failed[0].startswith(f"node setup on node {bad.pod.ip} (rank 2): "
                                f"NCCL_SOCKET_IFNAME=ib0 names no interface"), failed[0]
    assert "podnet1" in failed[0]  # what the pod has instead
    assert good.pod.ip not in failed[0]
    assert "ALL CHECKS PASSED" not in out
    errors = [line for line in out.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "failed" in errors[0], errors
    # The misconfigured pod said so at start, too.
    assert "NCCL_SOCKET_IFNAME=ib0 names no interface on this pod" in bad.output
    assert wait_exits((good, bad), 60) == [0, 0]
