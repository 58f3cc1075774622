"""PODAGENT_LISTEN=private on a pod whose only address is public: the head of a cluster refuses
(exit 2, one line naming the address) before anything starts; a Ray dashboard there would run
jobs for anyone who reaches it. (The head of a one-node cluster listens on loopback.)"""

from __future__ import annotations

import subprocess
import sys

from tests.harness.agents import clean_environ
from tests.harness.pods import PodNetwork

PUBLIC_SUBNET = "203.0.113.0/24"  # documentation addresses: reachable as far as podagent knows


def test_a_head_whose_only_address_is_public_refuses_to_listen_there(_e2e_host, tmp_path):
    with PodNetwork(subnet=PUBLIC_SUBNET) as net:
        pod = net.add_pod("pub", ifname="eth0")
        env = {**clean_environ(), "PODAGENT_LOG_DIR": str(tmp_path / "logs"),
               "EXPECTED_WORKERS": "1",  # a cluster: the workers must reach the head
               "PODAGENT_REWARD": "none", "PODAGENT_JOB": f"{sys.executable} -c pass"}
        proc = pod.popen([sys.executable, "-m", "podagent", "head"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = proc.communicate(timeout=60)
        leftovers = pod.pids()
    assert proc.returncode == 2, out + err
    (line,) = err.strip().splitlines()
    assert line.startswith("[head] ERROR: PODAGENT_LISTEN='private' needs a private "
                           f"address to listen on, and this pod's cluster address {pod.ip} "
                           f"(first non-loopback address (eth0)) is not one"), line
    assert "set PODAGENT_NODE_IP" in line
    assert leftovers == []  # no Ray was started
    assert "Ray head up" not in out


def test_a_dry_run_refuses_it_the_same_way(_e2e_host, tmp_path):
    with PodNetwork(subnet=PUBLIC_SUBNET) as net:
        pod = net.add_pod("pub", ifname="eth0")
        proc = pod.popen([sys.executable, "-m", "podagent", "head", "--dry-run"],
                         env={**clean_environ(), "PODAGENT_REWARD": "none",
                              "EXPECTED_WORKERS": "1"},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, out + err
    (line,) = err.strip().splitlines()
    assert line.startswith("podagent: error: PODAGENT_LISTEN='private' needs a private "), line
