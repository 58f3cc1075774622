"""`podagent status` shows the hang watch: without Ray the seconds since the run's last
progress and the hangs of this start; with Ray the last hang's verdict (Ray's key-value store
holds it)."""

from __future__ import annotations

from podagent.cluster import runstate
from podagent.control import no_ray, status


def _no_ray(**fields) -> dict:
    return {"run": "r", "launcher": "torchrun", "head": {"supervisor": "10.0.0.1:29510"},
            "uptime_s": 60.0, "phase": "running", "step": "training", "nodes": 2, "pods": [],
            **fields}


def test_without_ray_status_says_the_last_progress_and_the_hangs():
    text = no_ray.render(_no_ray(quiet_s=3.5, hangs=1))
    assert "last progress 3.5 s ago; 1 hang(s) in this start" in text


def test_without_ray_status_of_an_older_head_says_nothing_of_it():
    assert "progress" not in no_ray.render(_no_ray())


def _ray(last_hang: dict | None) -> dict:
    return {"role": "worker", "uptime_s": 30.0, "run_state": {"state": "running"},
            "head": {"ip": "10.0.0.1", "ray": "10.0.0.1:6379", "ray_version": "2.60.0",
                     "dashboard": "http://10.0.0.1:8265"},
            "nodes": [], "jobs_api": "answers", "job": None,
            "reward": {"state": "none"}, "last_hang": last_hang}


def test_with_ray_status_says_the_last_hangs_verdict():
    hang = runstate.read_state(runstate.dump_request(2, "likely culprit: rank 3 on pod w3"))
    assert "last hang: 2: likely culprit: rank 3 on pod w3" in status.render_status(_ray(hang))
    asked = runstate.read_state(runstate.dump_request(3))  # the stacks still coming
    assert "last hang: 3: stacks being dumped" in status.render_status(_ray(asked))
    assert "last hang" not in status.render_status(_ray(None))
