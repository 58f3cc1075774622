"""The head's collaborators, each with scripted inputs: the worker census (scripted node
tables), the stop watch (a scripted KV store and clock), the job's spec, and the own-Ray
watch (a scripted GCS and clock)."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from podagent import config
from podagent.cluster import census as census_mod
from podagent.cluster import exposure, job_spec, runstate
from podagent.cluster.census import RECOUNT_EVERY, WorkerCensus
from podagent.cluster.head_ray import OWN_RAY_GRACE, HeadRay
from podagent.cluster.stop_watch import StopWatch
from podagent.errors import RayDied, RayStartError, WorkersTimeout
from podagent.ray_access.gcs import GcsUnavailable, NodeInfo
from podagent.report import Reporter
from podagent.run.lifecycle import EndRequested


class Heard:
    """A reporter whose lines and events the test reads."""

    def __init__(self) -> None:
        self.out = io.StringIO()
        self.events: list[dict] = []
        self.reporter = Reporter("head", "pod", None, stream=self.out)
        self.reporter.add_listener(self.events.append)

    def named(self, name: str) -> list[dict]:
        return [e for e in self.events if e["event"] == name]

    @property
    def text(self) -> str:
        return self.out.getvalue()


def node(ip: str, alive: bool = True, head: bool = False, gpus: float = 1.0) -> NodeInfo:
    return NodeInfo(f"id-{ip}", ip, alive, gpus, 2.0, head, 0)


def scripted(*tables: list[NodeInfo]) -> Iterator[list[NodeInfo]]:
    """Each read returns the next table; the last one stays."""
    yield from tables
    while True:
        yield tables[-1]


# --- the census ----------------------------------------------------------------------------------

def test_census_records_joins_and_a_worker_that_leaves_before_the_job():
    heard = Heard()
    head = node("10.0.0.1", head=True)
    tables = scripted([head], [head, node("10.0.0.2")],
                      [head, node("10.0.0.2"), node("10.0.0.3", gpus=2)],
                      [head, node("10.0.0.3", gpus=2), node("10.0.0.4", alive=False)])
    census = WorkerCensus(lambda: next(tables), heard.reporter)
    assert [census.poll_joins(2) for _ in range(4)] == [0, 1, 2, 1]
    assert census.ips() == ["10.0.0.3"] and census.gpus == 2
    assert "worker joined: 10.0.0.2 (1 GPUs) [1/2]" in heard.text
    assert "worker 10.0.0.2 left again before the job started" in heard.text
    assert [e["ip"] for e in heard.named("worker_joined")] == ["10.0.0.2", "10.0.0.3"]
    assert [e["ip"] for e in heard.named("worker_lost")] == ["10.0.0.2"]


def test_a_pod_whose_ray_started_again_counts_once_and_its_earlier_node_never_again():
    """A worker's raylet exited and it joined again before Ray marked its earlier node dead:
    two live nodes at one address are one pod; the job waits until the earlier one is gone."""
    heard = Heard()
    head, w3 = node("10.0.0.1", head=True), node("10.0.0.3")
    first = dataclasses.replace(node("10.0.0.2"), start_time_ms=1_000)
    again = dataclasses.replace(node("10.0.0.2"), node_id="id-again", start_time_ms=9_000)
    dead = dataclasses.replace(first, alive=False)
    tables = scripted([head, first], [head, again, first], [head, first, again, w3],
                      [head, first, again, w3], [head, dead, again, w3])
    census = WorkerCensus(lambda: next(tables), heard.reporter)
    assert [census.poll_joins(2) for _ in range(3)] == [1, 1, 2]
    assert sorted(census.workers) == ["id-10.0.0.3", "id-again"]
    assert ("worker 10.0.0.2 left again before the job started (its Ray started again: the "
            "new node counts)") in heard.text
    assert [e["node_id"] for e in heard.named("worker_joined")] == [
        "id-10.0.0.2", "id-again", "id-10.0.0.3"]
    slept: list[float] = []
    census.await_departed_gone(slept.append)  # .2's earlier node listed once more, then dead
    assert slept and census.departed_still_listed() == []
    assert census.poll_joins(2) == 2 and "submitting anyway" not in heard.text


def test_a_superseded_node_still_listed_is_waited_for_within_a_bound(monkeypatch):
    heard = Heard()
    monkeypatch.setattr(census_mod, "DEPARTED_TIMEOUT", 0.3)
    first = dataclasses.replace(node("10.0.0.2"), start_time_ms=1_000)
    again = dataclasses.replace(node("10.0.0.2"), node_id="id-again", start_time_ms=9_000)
    census = WorkerCensus(lambda: [again, first], heard.reporter)
    assert census.poll_joins(1) == 1 and list(census.workers) == ["id-again"]
    census.await_departed_gone(time.sleep)
    assert ("Ray still lists the departed 10.0.0.2 as alive after 0.3 s; submitting anyway"
            in heard.text)


class Gcs:
    """A scripted node table and its size, counting the reads; `size` None: no answer."""

    def __init__(self, table: list[NodeInfo], size: int | None) -> None:
        self.table, self.size, self.reads = table, size, 0

    def nodes(self) -> list[NodeInfo]:
        self.reads += 1
        return self.table

    def registered(self) -> int:
        if self.size is None:
            raise RayStartError("this pod's Ray GCS stopped answering: UNAVAILABLE")
        return self.size


def test_census_reads_the_table_only_when_its_size_changed_or_a_second_passed(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(census_mod.time, "monotonic", lambda: clock[0])
    heard = Heard()
    head = node("10.0.0.1", head=True)
    gcs = Gcs([head], size=1)
    census = WorkerCensus(gcs.nodes, heard.reporter, gcs.registered)
    assert census.poll_joins(2) == 0 and gcs.reads == 1  # the first poll reads
    clock[0] += 0.1
    assert census.poll_joins(2) == 0 and gcs.reads == 1  # same size, 0.1 s later: no read
    gcs.table, gcs.size = [head, node("10.0.0.2")], 2  # a worker registered
    clock[0] += 0.1
    assert census.poll_joins(2) == 1 and gcs.reads == 2
    gcs.table = [head, node("10.0.0.2", alive=False)]  # it died: the size stays
    clock[0] += RECOUNT_EVERY - 0.05
    assert census.poll_joins(2) == 1 and gcs.reads == 2
    clock[0] += 0.05  # a second after the last read: read anyway
    assert census.poll_joins(2) == 0 and gcs.reads == 3
    assert "worker 10.0.0.2 left again before the job started" in heard.text


def test_census_reads_the_table_when_its_size_is_not_answered():
    heard = Heard()
    gcs = Gcs([node("10.0.0.2")], size=None)
    census = WorkerCensus(gcs.nodes, heard.reporter, gcs.registered)
    assert [census.poll_joins(1) for _ in range(3)] == [1, 1, 1] and gcs.reads == 3


def test_census_shortfall_fails_unless_the_minimum_is_met():
    heard = Heard()
    census = WorkerCensus(lambda: [node("10.0.0.2")], heard.reporter)
    census.poll_joins(3)
    with pytest.raises(WorkersTimeout, match=r"only 1 of 3 workers joined within 60 s; "
                                             r"joined: 10\.0\.0\.2"):
        census.accept_shortfall(3, None, 60.0)
    with pytest.raises(WorkersTimeout):
        census.accept_shortfall(3, 2, 60.0)
    census.accept_shortfall(3, 1, 60.0)
    assert "going on because PODAGENT_MIN_WORKERS=1" in heard.text


def test_census_on_reattach_counts_and_warns_when_short():
    heard = Heard()
    census = WorkerCensus(lambda: [node("10.0.0.1", head=True), node("10.0.0.2")],
                          heard.reporter)
    census.count(2)
    assert "re-attached with 1 of 2 expected worker(s) alive" in heard.text
    counted = heard.named("workers_counted")[0]
    assert (counted["workers"], counted["expected"], counted["ips"]) == (1, 2, ["10.0.0.2"])


def test_census_reports_each_loss_once_while_the_job_runs():
    heard = Heard()
    census = WorkerCensus(lambda: [node("10.0.0.2"), node("10.0.0.3")], heard.reporter)
    census.poll_joins(2)
    assert [w.ip for w in census.note_losses({"id-10.0.0.3"}, "the job decides")] == [
        "10.0.0.2"]
    assert census.note_losses({"id-10.0.0.3"}, "the job decides") == []
    census.note_losses(set(), "the job decides")
    assert [e["ip"] for e in heard.named("worker_lost")] == ["10.0.0.2", "10.0.0.3"]
    assert "left the cluster while the job ran (Ray marked its node dead; noticed " in heard.text
    assert "); the job decides" in heard.text


def test_a_pod_joining_while_a_restart_waits_takes_the_lost_ones_place():
    """The same address back is the lost pod restarted; a new address replaces the lost pod
    that left first. A lost node Ray still lists as alive is never counted again."""
    heard = Heard()
    tables = scripted(
        [node("10.0.0.2"), node("10.0.0.3")],  # the job's workers
        [node("10.0.0.3")],  # .2 lost while the job ran
        [node("10.0.0.2"), node("10.0.0.3")],  # begin_recovery: Ray still lists .2 alive
        [node("10.0.0.2"), node("10.0.0.3")],  # poll: .2's old node is not a join
        [node("10.0.0.3"), node("10.0.0.9")],  # a new pod in its place
    )
    census = WorkerCensus(lambda: next(tables), heard.reporter)
    assert census.poll_joins(2) == 2
    census.note_losses({w.node_id for w in census.alive()}, "stopping the job")
    assert [w.ip for w in census.begin_recovery()] == ["10.0.0.2"]
    assert census.poll_joins(2) == 1
    assert census.poll_joins(2) == 2
    assert "worker joined: 10.0.0.9 (1 GPUs) [2/2] (in place of the lost 10.0.0.2)" in heard.text
    assert census.replaced == [("10.0.0.2", "10.0.0.9")]
    assert heard.named("worker_joined")[-1]["replaces"] == "10.0.0.2"


def test_the_lost_pod_restarted_is_said_to_be_back():
    heard = Heard()
    first, again = node("10.0.0.2"), dataclasses.replace(node("10.0.0.2"), node_id="id-new")
    tables = scripted([first], [], [], [again])
    census = WorkerCensus(lambda: next(tables), heard.reporter)
    census.poll_joins(1)
    census.note_losses({w.node_id for w in census.alive()}, "stopping the job")
    census.begin_recovery()
    census.poll_joins(1)
    assert "(the lost pod 10.0.0.2 is back)" in heard.text


def test_an_unreachable_raylet_is_a_lost_pod_before_ray_says_so():
    """The job failed because a pod was killed: its raylet refuses connections at once."""
    heard = Heard()
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        up = dataclasses.replace(node("127.0.0.1"), node_manager_port=listening.getsockname()[1])
        with socket.socket() as closed:
            closed.bind(("127.0.0.2", 0))
            gone_port = closed.getsockname()[1]
        gone = dataclasses.replace(node("127.0.0.2"), node_manager_port=gone_port)
        census = WorkerCensus(lambda: [up, gone], heard.reporter)
        census.poll_joins(2)
        assert [w.node_id for w in census.unreachable()] == ["id-127.0.0.2"]


def test_census_awaits_departures_and_names_who_stayed():
    heard = Heard()
    tables = scripted([node("10.0.0.2"), node("10.0.0.3")], [node("10.0.0.3")], [])
    census = WorkerCensus(lambda: next(tables), heard.reporter)
    census.poll_joins(2)
    census.await_departures(grace=5.0)
    assert "still connected" not in heard.text

    stuck = WorkerCensus(lambda: [node("10.0.0.2")], heard.reporter)
    stuck.poll_joins(1)
    stuck.await_departures(grace=0.3)
    assert "1 worker(s) still connected; stopping Ray anyway" in heard.text


def test_census_stops_waiting_for_departures_when_the_gcs_is_gone():
    heard = Heard()
    reads = iter([[node("10.0.0.2")]])

    def nodes() -> list[NodeInfo]:
        for table in reads:
            return table
        raise RayStartError("this pod's Ray GCS stopped answering")

    census = WorkerCensus(nodes, heard.reporter)
    census.poll_joins(1)
    census.await_departures(grace=30.0)  # returns at once: nobody is left to wait for
    assert "still connected" not in heard.text


# --- the stop watch ------------------------------------------------------------------------------

class ScriptedKv:
    def __init__(self, *answers: bytes | Exception | None):
        self.answers, self.reads = list(answers), 0

    def kv_get(self, namespace: str, key: str, timeout: float) -> bytes | None:
        assert (namespace, key) == (runstate.KV_NAMESPACE, runstate.KV_STOP_REQUEST)
        self.reads += 1
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_stop_watch_reads_at_most_once_a_second_and_ends_the_run_on_a_request():
    heard, now = Heard(), [100.0]
    kv = ScriptedKv(None, GcsUnavailable("busy"), runstate.stop_request("pod-7", 1.7e9))
    watch = StopWatch(heard.reporter, clock=lambda: now[0])
    watch.look()  # no GCS yet: nothing to read
    watch.gcs = kv  # type: ignore[assignment]
    watch.look()
    watch.look()  # within the second: no read
    assert kv.reads == 1
    now[0] += 1.0
    watch.look()  # the GCS did not answer this time: not a stop
    now[0] += 1.0
    with pytest.raises(EndRequested) as ended:
        watch.look()
    assert ended.value.outcome == "StopRequested" and kv.reads == 3
    assert "stop requested by pod-7 at " in heard.text
    assert heard.named("stop_requested")[0]["by"] == "pod-7"
    now[0] += 5.0
    watch.look()  # seen once: the run is already ending
    assert kv.reads == 3


# --- the job's spec ------------------------------------------------------------------------------

def test_job_env_carries_wandb_settings_never_the_key():
    settings = config.build({}, {"WANDB_PROJECT": "p", "WANDB_API_KEY": "k" * 40,
                                 "PODAGENT_RUN_NAME": "r1"})
    env = job_spec.env(settings, "10.0.0.1", nodes=3, gpus=24,
                       reward_url="http://10.0.0.1:5000/get_reward", ray_debug=True,
                       submission_id="r1-2", attempt=2)
    assert env == {"PODAGENT_NUM_NODES": "3", "PODAGENT_NUM_GPUS": "24",
                   "PODAGENT_HEAD_ADDR": "10.0.0.1", "PODAGENT_RUN_NAME": "r1",
                   "PODAGENT_SUBMISSION_ID": "r1-2", "PODAGENT_ATTEMPT": "2",
                   "REMOTE_RM_URL": "http://10.0.0.1:5000/get_reward", "RAY_DEBUG": "legacy",
                   "WANDB_PROJECT": "p",
                   # the hang watch's, absolute: the job's working directory is its own
                   "PODAGENT_HEARTBEAT": os.path.abspath(settings.run_dir / "heartbeat"),
                   "PODAGENT_STACKS": os.path.abspath(settings.run_dir / "stacks"),
                   # Ray's SIGKILL after PODAGENT_STOP_TIMEOUT (10 s), not its own 3 s
                   "RAY_JOB_STOP_WAIT_TIME_S": "10"}
    assert settings.run_dir.parent == Path("podagent-logs", "r1")  # this pod's own


@pytest.mark.parametrize(("environ", "wait"), [({"PODAGENT_STOP_TIMEOUT": "2.5"}, "3"),
                                               ({"PODAGENT_STOP_TIMEOUT": "0.2"}, "1"),
                                               ({"RAY_JOB_STOP_WAIT_TIME_S": "90"}, "90")])
def test_the_jobs_stop_grace_is_podagents_in_whole_seconds_unless_set(environ, wait):
    env = job_spec.env(config.build({}, environ), "10.0.0.1", nodes=1, gpus=0,
                       reward_url=None, ray_debug=False, submission_id="r-1", attempt=1)
    assert env["RAY_JOB_STOP_WAIT_TIME_S"] == wait


def test_entrypoint_is_the_cluster_check_without_a_job_and_unchanged_on_reattach():
    heard = Heard()
    assert job_spec.entrypoint(config.build({}, {}), heard.reporter) == job_spec.CLUSTER_CHECK
    settings = config.build({"job": "python train.py"}, {})
    assert job_spec.entrypoint(settings, heard.reporter, resume=False) == ("python", "train.py")


# --- the own-Ray watch ---------------------------------------------------------------------------

class ScriptedGcs:
    def __init__(self, answers: list[bool], workers: list[NodeInfo]):
        self.answers, self.workers = answers, workers

    def check_alive(self, timeout: float) -> str:
        if not (self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]):
            raise GcsUnavailable("deadline exceeded")
        return "2.60.0"

    def nodes(self, timeout: float) -> list[NodeInfo]:
        return [node("10.0.0.1", head=True), *self.workers]


def test_own_ray_watch_tolerates_a_busy_moment_then_calls_it_dead():
    settings = config.build({}, {})
    ray = HeadRay(settings, None, Heard().reporter, None)  # type: ignore[arg-type]
    ray.gcs = ScriptedGcs([True, False, True, False], [node("10.0.0.2")])  # type: ignore
    ray._raylet = psutil.Process()  # a process that runs: the raylet is fine
    assert ray.watch(0.0) == {"id-10.0.0.2"}
    assert ray.watch(1.0) is None  # silent once: not dead yet
    assert ray.watch(2.0) == {"id-10.0.0.2"}  # answered again: the grace starts over
    assert ray.watch(3.0) is None
    assert ray.watch(3.0 + OWN_RAY_GRACE) is None
    with pytest.raises(RayDied, match="the GCS does not answer"):
        ray.watch(3.1 + OWN_RAY_GRACE)


def test_own_ray_silent_at_teardown_only_when_started_and_not_answering():
    ray = HeadRay(config.build({}, {}), None, Heard().reporter, None)  # type: ignore[arg-type]
    assert ray.silent() is False  # never started: nothing to call silent
    ray.gcs = ScriptedGcs([False], [])  # type: ignore[assignment]
    assert ray.silent() is True
    ray.gcs = ScriptedGcs([True], [])  # type: ignore[assignment]
    assert ray.silent() is False
    assert json.loads(runstate.closing("Interrupted", "STOPPED")) == {
        "state": "closing", "outcome": "Interrupted", "job_status": "STOPPED",
        "after_run": "exit"}


def test_a_published_port_of_the_head_is_said_loudly_unless_the_token_guards_it():
    """RunPod sets RUNPOD_TCP_PORT_<port> for each TCP port its template publishes."""
    out = io.StringIO()
    env = {"RUNPOD_TCP_PORT_6379": "40123", "RUNPOD_TCP_PORT_5000": "40124"}
    exposure.warn(config.build({}, env), "10.0.0.2", Reporter("head", "p", None, stream=out))
    text = out.getvalue()
    assert "PORT 6379 (RAY'S GCS) IS PUBLISHED TO THE INTERNET (RUNPOD_TCP_PORT_6379=40123)" \
        in text
    assert "PORT 5000 (THE REWARD SERVER) IS PUBLISHED" in text
    out = io.StringIO()
    exposure.warn(config.build({}, {**env, "PODAGENT_TOKEN": "t" * 32}), "10.0.0.2",
                  Reporter("head", "p", None, stream=out))
    assert "port 6379 (Ray's GCS) is published to the internet" in out.getvalue()
    assert "the cluster token guards it" in out.getvalue()
    assert "PORT 5000 (THE REWARD SERVER) IS PUBLISHED" in out.getvalue()  # no token there
