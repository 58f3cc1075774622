"""The census's reads against a real Ray: a head that waits for one worker, and a plain
`ray start` worker joining it. What nodes() reads (liveness, then each new node's record) is what
the whole table says, registered() counts the table, and the head's census, which reads the
table only when its size changed, sees the join."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from podagent.cluster.ray_node import ray_executable
from podagent.ray_access.gcs import GcsClient
from tests.integration.conftest import (
    PodagentRun,
    Runs,
    clean_environ,
    free_ports,
    kill_processes_under,
    short_temp_dir,
    wait_for,
)

LONG_JOB = f"{sys.executable} -c 'import time; time.sleep(600)'"


def _reads(gcs: GcsClient) -> tuple[int, list, list]:
    return gcs.registered(), sorted(gcs.nodes(), key=str), sorted(gcs.node_table(), key=str)


@pytest.fixture(scope="module")
def joined(podagent_runs: Runs) -> tuple[PodagentRun, tuple, tuple]:
    run = podagent_runs.new("census")
    worker_tmp = short_temp_dir()
    try:
        # A head that waits for a worker listens on its private address: on this machine that
        # is loopback (its own address may be public, which a head refuses).
        with run.running(["head"], env={"EXPECTED_WORKERS": "1", "PODAGENT_REWARD": "none",
                                        "PODAGENT_JOB": LONG_JOB,
                                        "PODAGENT_NODE_IP": "127.0.0.1"}):
            wait_for(lambda: run.stdout, lambda out: "waiting for 1 worker(s)" in out, 180,
                     "the head to wait for its worker")
            (head,) = [e for e in run.events() if e["event"] == "ray_head"]
            gcs = GcsClient(head["address"])
            try:
                before = _reads(gcs)
                agent, metrics = free_ports(2)
                subprocess.run(
                    [ray_executable(), "start", "--address", head["address"],
                     "--node-ip-address", head["address"].rsplit(":", 1)[0],
                     "--num-cpus", "1", "--num-gpus", "0", "--disable-usage-stats",
                     "--temp-dir", worker_tmp, "--dashboard-agent-listen-port", str(agent),
                     "--metrics-export-port", str(metrics)],
                    env=clean_environ(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                    stderr=subprocess.STDOUT, timeout=120, check=True)
                wait_for(lambda: run.stdout, lambda out: "cluster ready: 2 nodes" in out, 60,
                         "the head to count the worker")
                after = _reads(gcs)
            finally:
                gcs.close()
    finally:
        kill_processes_under(worker_tmp)
        shutil.rmtree(worker_tmp, ignore_errors=True)
    return run, before, after


def test_nodes_reads_what_the_whole_table_says(joined) -> None:
    _, (size, nodes, table), (size_after, nodes_after, table_after) = joined
    assert (size, size_after) == (1, 2)
    assert nodes == table and [n.is_head for n in nodes] == [True]
    assert nodes_after == table_after
    assert sorted((n.is_head, n.alive) for n in nodes_after) == [(False, True), (True, True)]


def test_the_census_sees_the_join_with_its_registration_time(joined) -> None:
    run, _, (_, nodes, _) = joined
    (worker,) = [n for n in nodes if not n.is_head]
    (event,) = run.events_named("worker_joined")
    assert (event["node_id"], event["registered_ms"]) == (worker.node_id, worker.start_time_ms)
