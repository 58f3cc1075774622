"""Ray's authentication is decided by podagent, never inherited (the case marked ray_auth also
runs on Ray 2.59).

From Ray 2.59 `ray start --head` turns token authentication on by itself whenever it finds a
token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token), and so does a worker's
`ray start`: a token file left on one pod would make its node one the others cannot talk to.
podagent tells every node and every client which mode the run has (a cluster token: token;
none: disabled), so a stray file changes nothing.

Ray 2.59 and this session's Ray do alike here; on 2.59, the first Ray that does, runs the case
that split a cluster before podagent decided (a token file on the head): the other two would
run the same code on the same Ray behaviour again, for 2 of the suite's 45 minutes.
"""

from __future__ import annotations

import sys

import pytest

from tests.harness.agents import form_cluster

FORM_TIMEOUT = 240.0

JOB = """
import ray
ray.init(address="auto", logging_level="ERROR")
print("NODES", len([n for n in ray.nodes() if n["Alive"]]), flush=True)
print("SUM", sum(ray.get([ray.remote(lambda x: x).options(num_cpus=0).remote(i)
                          for i in range(8)])), flush=True)
"""


def _home_with_a_token_file(tmp_path):
    home = tmp_path / "home-with-a-ray-token"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("stray-token-" + "7" * 32 + "\n")
    return str(home)


@pytest.mark.parametrize("where", ["worker", pytest.param("head", marks=pytest.mark.ray_auth)])
def test_a_ray_token_file_on_one_pod_splits_no_cluster(where, make_pod, dns_server, tmp_path,
                                                       agents):
    script = tmp_path / "nodes.py"
    script.write_text(JOB)
    stray = {"HOME": _home_with_a_token_file(tmp_path)}
    head, (worker,) = form_cluster(
        make_pod, dns_server, tmp_path, agents, workers=1,
        head_env={"PODAGENT_REWARD": "none", "PODAGENT_JOB": f"{sys.executable} {script}",
                  **(stray if where == "head" else {})},
        worker_env=stray if where == "worker" else {})
    head.start()
    worker.start()
    assert head.wait_exit(FORM_TIMEOUT) == 0, head.said()
    assert "NODES 2" in head.output and "SUM 28" in head.output, head.said()
    assert worker.wait_exit(60) == 0, worker.said()
    stray = head if where == "head" else worker
    assert "(Ray " in stray.output.splitlines()[0]  # the role line stays first
    assert "a Ray token file is on this pod" in stray.output


def test_a_single_pod_with_a_ray_token_file_runs_the_default_job(make_pod, dns_server,
                                                                 tmp_path, agents):
    """The README's first command: one pod, the built-in cluster check, a token file in ~/.ray."""
    head, _ = form_cluster(make_pod, dns_server, tmp_path, agents, workers=0,
                           head_env={"EXPECTED_WORKERS": "0",
                                     "HOME": _home_with_a_token_file(tmp_path)})
    head.start()
    assert head.wait_exit(FORM_TIMEOUT) == 0, head.said()
    assert "ALL CHECKS PASSED" in head.output, head.said()
