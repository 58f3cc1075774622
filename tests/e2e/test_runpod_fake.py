"""The fake RunPod cloud (tests/fakes/runpod_cloud.py) over real HTTP: its pods are real test pods
with RunPod's environment, its log stream carries their output, terminating one leaves nothing
behind, and it refuses what RunPod refuses. Quick: tiny command images, no Ray."""

from __future__ import annotations

import datetime as dt
import json
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import dns.resolver
import pytest
import requests

from tests.fakes.runpod_cloud import FakeRunPodCloud, RequestRecord
from tests.harness.pods import DnsServer, PodNetwork, list_netns, wait_for

KEY = "rpa_" + "AccountKey" * 4
H100 = "NVIDIA H100 80GB HBM3"
BUSY = "print('hello', flush=True); import time; time.sleep(600)"
ONCE = "import sys; print('ran', flush=True); sys.exit(3)"
# Says goodbye on SIGTERM, as podagent does its teardown.
POLITE = ("import signal, sys, time\n"
          "def bye(*_): print('bye', flush=True); sys.exit(0)\n"
          "signal.signal(signal.SIGTERM, bye); print('up', flush=True); time.sleep(600)")
IMAGES = {"busy:1": [sys.executable, "-c", BUSY], "once:1": [sys.executable, "-c", ONCE],
          "polite:1": [sys.executable, "-c", POLITE]}


class Api:
    """What a client does: the base URL plus /v2/..., the Bearer key."""

    def __init__(self, cloud: FakeRunPodCloud, key: str = KEY) -> None:
        self.base = cloud.url + "/v2"
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Bearer {key}"

    def call(self, method: str, path: str, **kw: Any) -> requests.Response:
        kw.setdefault("timeout", 10)
        return self.session.request(method, self.base + path, **kw)

    def pod(self, pod_id: str) -> dict[str, Any]:
        r = self.call("GET", f"/pods/{pod_id}")
        assert r.status_code == 200, r.text
        return r.json()

    def wait_pod(self, pod_id: str, status: str, timeout: float = 20) -> dict[str, Any]:
        return wait_for(lambda: (p := self.pod(pod_id))["status"] == status and p,
                        timeout=timeout, what=f"pod {pod_id} {status}")


def events(api: Api, pod_id: str, until: Callable[[list[dict[str, Any]]], bool],
           timeout: float = 15, headers: dict[str, str] | None = None,
           then: Callable[[], object] | None = None, **params: Any) -> list[dict[str, Any]]:
    """The log stream's events ({"id", "data"}) until `until` holds for them; then it hangs up
    (the stream stays open while the pod lives). With `then`: calls it at that point and reads
    on until the server ends the stream."""
    got: list[dict[str, Any]] = []
    called = False
    deadline = time.monotonic() + timeout
    with api.call("GET", f"/pods/{pod_id}/logs", params=params, headers=headers, stream=True,
                  timeout=(5, timeout)) as r:
        assert r.status_code == 200, r.text
        assert r.headers["Content-Type"] == "text/event-stream"
        assert r.headers["Cache-Control"] == "no-cache"
        event: dict[str, Any] = {}
        # chunk_size=1: by default requests waits for 512 bytes, far more than one event.
        for line in r.iter_lines(chunk_size=1, decode_unicode=True):
            if line.startswith("id: "):
                event["id"] = line[4:]
            elif line.startswith("data: "):
                event["data"] = json.loads(line[6:])
            elif line == "" and event:
                got.append(event)
                event = {}
                if not called and until(got):
                    if then is None:
                        return got
                    then()
                    called = True
            if time.monotonic() > deadline:
                raise AssertionError(f"the log stream of {pod_id} stalled: {got}")
    if called:
        return got  # the server ended it
    raise AssertionError(f"the log stream of {pod_id} ended early: {got}")


def lines(got: list[dict[str, Any]], source: str = "container") -> list[str]:
    return [e["data"]["line"] for e in got if e["data"]["source"] == source]


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(x.decode().split("=", 1) for x in raw if b"=" in x)


@pytest.fixture
def cloud(pod_network: PodNetwork, dns_server: DnsServer,
          tmp_path: Path) -> Iterator[FakeRunPodCloud]:
    with FakeRunPodCloud(pod_network, dns_server, tmp_path / "cloud", api_key=KEY,
                         images=IMAGES, max_restarts=2, stop_grace=2.0) as fake:
        yield fake
        assert fake.fake_errors == []


@pytest.fixture
def api(cloud: FakeRunPodCloud) -> Api:
    return Api(cloud)


def test_a_pod_runs_for_real_and_leaves_nothing_once_terminated(
        cloud: FakeRunPodCloud, api: Api, dns_server: DnsServer) -> None:
    r = api.call("POST", "/pods", json={
        "name": "solo", "image": "busy:1", "gpu": {"id": H100, "count": 2},
        "globalNetworking": True, "env": {"MY_SETTING": "x"},
        "mounts": {"persistent": {"size": 20, "path": "/workspace"}}})
    assert r.status_code == 201, r.text
    created = r.json()
    pod_id = created["id"]
    assert created["status"] == "PROVISIONING" and created["env"] == {"MY_SETTING": "x"}
    assert created["cost"] == pytest.approx(2 * 2.99)

    running = api.wait_pod(pod_id, "RUNNING")
    view = cloud.pods[pod_id]
    assert view.harness is not None and view.harness.ifname == "podnet1"
    assert running["globalNetworking"] == {
        "enabled": True, "ip": view.harness.ip, "internalDns": f"{pod_id}.runpod.internal"}
    assert running["startedAt"] and running["actions"] == ["stop", "restart", "terminate"]
    assert [p["id"] for p in api.call("GET", "/pods").json()["pods"]] == [pod_id]
    assert [p.id for p in cloud.billing()] == [pod_id]

    # Its process runs in its namespace with what RunPod injects, and no podagent defaults.
    assert view.harness.netns in list_netns()
    pids = view.harness.pids()
    assert len(pids) == 1
    env = environ(pids[0])
    assert env["RUNPOD_POD_ID"] == pod_id and env["RUNPOD_GPU_COUNT"] == "2"
    assert env["RUNPOD_API_KEY"] and env["RUNPOD_API_KEY"] != KEY
    assert env["RUNPOD_DC_ID"] == running["dataCenterId"]
    assert env["MY_SETTING"] == "x" and env["PYTHONUNBUFFERED"] == "1"
    assert env["PODAGENT_LOG_DIR"] == str(view.volume / "podagent" / "logs")
    assert not {"PODAGENT_AFTER_RUN", "PODAGENT_RUN_NAME", "NODE_RANK"} & set(env)
    # A pod's own key is not the account's.
    assert Api(cloud, env["RUNPOD_API_KEY"]).call("GET", "/pods").status_code == 403

    resolver = dns.resolver.Resolver(configure=False)
    resolver.nameservers, resolver.port = [dns_server.address], dns_server.port
    answer = resolver.resolve(f"{pod_id}.runpod.internal", "A", lifetime=5)
    assert [a.address for a in answer] == [view.harness.ip]

    got = events(api, pod_id, lambda got: "hello" in lines(got))
    hello = next(e for e in got if e["data"]["line"] == "hello")
    assert hello["data"]["source"] == "container"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT[\d:.]+Z/\d{12}", hello["id"])
    assert hello["id"].startswith(hello["data"]["ts"] + "/")
    assert "container started" in lines(got, "system")

    assert api.call("DELETE", f"/pods/{pod_id}").status_code == 204
    assert api.call("GET", f"/pods/{pod_id}").status_code == 404
    assert api.call("GET", "/pods").json() == {"pods": []}
    assert api.call("DELETE", f"/pods/{pod_id}").status_code == 404
    assert cloud.billing() == []
    cloud.wait_torn_down(timeout=15)
    assert view.harness.netns not in list_netns()
    assert cloud.leftover_processes() == []
    assert f"{pod_id}.runpod.internal" not in dns_server.records
    assert cloud.pods[pod_id].exits[-1].stopped_by == "terminate"
    assert cloud.invalid_requests() == []


def test_a_training_cluster_of_two(cloud: FakeRunPodCloud, api: Api) -> None:
    r = api.call("POST", "/clusters", json={
        "name": "tc", "type": "TRAINING", "image": "busy:1", "env": {"K": "v"},
        "compute": {"gpuTypeId": H100, "gpuCountPerPod": 2, "podCount": 2}})
    assert r.status_code == 201, r.text
    cluster = r.json()
    assert cluster["pods"]["total"] == 2 and cluster["compute"]["podCount"] == 2

    def both_running() -> list[dict[str, Any]] | None:
        pods = api.call("GET", f"/clusters/{cluster['id']}/pods").json()["pods"]
        return pods if [p["status"] for p in pods] == ["RUNNING"] * 2 else None

    pods = wait_for(both_running, timeout=20, what="both members RUNNING")
    assert [p["cluster"]["rank"] for p in pods] == [0, 1]
    primary_ip = pods[0]["cluster"]["ip"]
    for p in pods:
        view = cloud.pods[p["id"]]
        assert view.harness is not None and view.harness.ifname == "ens1"
        assert p["cluster"]["ip"] == view.harness.ip
        env = environ(view.harness.pids()[0])
        assert env["PRIMARY_ADDR"] == primary_ip and env["NODE_ADDR"] == view.harness.ip
        assert env["NODE_RANK"] == str(p["cluster"]["rank"]) and env["NUM_NODES"] == "2"
        assert (env["NUM_TRAINERS"], env["WORLD_SIZE"]) == ("2", "4")
        assert env["HOST_NODE_ADDR"] == f"{primary_ip}:{env['PRIMARY_PORT']}"
        assert env["K"] == "v"
    got = api.call("GET", f"/clusters/{cluster['id']}").json()
    assert got["pods"]["byStatus"] == {"RUNNING": 2}
    assert got["primary"] == {"podId": pods[0]["id"], "status": "RUNNING"}

    # Members are managed through the cluster only.
    assert api.call("GET", "/pods").json()["pods"] == []
    listed = api.call("GET", "/pods", params={"includeClusterPods": "true"}).json()["pods"]
    assert {p["id"] for p in listed} == {p["id"] for p in pods}
    assert api.call("DELETE", f"/pods/{pods[1]['id']}").status_code == 409
    assert api.call("POST", f"/pods/{pods[1]['id']}/action",
                    json={"action": "stop"}).status_code == 409

    assert api.call("DELETE", f"/clusters/{cluster['id']}").status_code == 204
    assert api.call("GET", f"/clusters/{cluster['id']}").status_code == 404
    assert api.call("GET", "/clusters").json() == {"clusters": []}
    assert all(api.call("GET", f"/pods/{p['id']}").status_code == 404 for p in pods)
    cloud.wait_torn_down(timeout=15)
    assert cloud.leftover_processes() == [] and cloud.billing() == []
    assert cloud.invalid_requests() == []


def test_refusals_as_runpod_words_them(cloud: FakeRunPodCloud, api: Api) -> None:
    r = api.call("POST", "/pods", json={"name": "x", "image": "busy:1",
                                        "gpu": {"id": H100}, "bogus": 1})
    assert r.status_code == 422 and r.headers["Content-Type"] == "application/problem+json"
    assert r.json()["errors"] == ["$: additional properties 'bogus' not allowed"]
    assert cloud.pods == {}
    assert [x.schema_errors for x in cloud.invalid_requests()] == [r.json()["errors"]]

    assert Api(cloud, "wrong").call("GET", "/pods").status_code == 401
    assert requests.get(cloud.url + "/v2/pods", timeout=5).json()["detail"] == \
        "missing bearer token"

    cloud.fail_next(1, 429, retry_after=7)
    r = api.call("GET", "/catalog/gpus")
    assert r.status_code == 429 and r.headers["Retry-After"] == "7"
    assert r.json()["status"] == 429
    cloud.fail_next(1, 503, match=r"^POST /v2/pods$")
    gpus = api.call("GET", "/catalog/gpus")  # does not match: answered
    assert gpus.status_code == 200 and H100 in [g["id"] for g in gpus.json()["gpus"]]
    body = {"name": "x", "image": "busy:1", "gpu": {"id": H100, "count": 2}}
    assert api.call("POST", "/pods", json=body).status_code == 503
    assert [x.fault for x in cloud.requests[-3:]] == [True, False, True]

    def refused(changes: dict[str, Any]) -> str:
        r = api.call("POST", "/pods", json={**body, **changes})
        assert r.status_code == 400, r.text
        return r.json()["detail"]

    cloud.no_capacity(H100)
    assert refused({}) == f"no capacity for 2 x {H100} in any data center"
    cloud.no_capacity(H100, on=False)
    assert "unknown GPU type 'NVIDIA B300'" in refused({"gpu": {"id": "NVIDIA B300"}})
    assert "exceeds the maximum of 8" in refused({"gpu": {"id": H100, "count": 9}})
    assert "exactly one of gpu or cpu" in refused({"cpu": {"id": "cpu3c", "vcpuCount": 2}})
    assert "at most one of persistent or network" in refused({"mounts": {
        "persistent": {"size": 10, "path": "/a"},
        "network": [{"volumeId": "v", "path": "/b"}]}})
    r = api.call("POST", "/clusters", json={
        "name": "c", "type": "RAY", "image": "busy:1",
        "compute": {"gpuTypeId": H100, "gpuCountPerPod": 1, "podCount": 2}})
    assert r.status_code == 400 and "not supported by the fake" in r.json()["detail"]
    assert cloud.pods == {}

    r = api.call("POST", "/pods", json={**body, "name": "p"})
    pod_id = r.json()["id"]
    r = api.call("GET", f"/pods/{pod_id}/logs", params={"tail": 9000})
    assert r.status_code == 422
    assert r.json()["errors"] == ["$.tail: 9000 is greater than the maximum of 5000"]
    api.wait_pod(pod_id, "RUNNING")
    r = api.call("POST", f"/pods/{pod_id}/action", json={"action": "start"})
    assert r.status_code == 409 and "not valid for a pod that is RUNNING" in r.json()["detail"]
    assert api.call("GET", "/pods/nope").status_code == 404


def test_held_provisioning_bills_until_released(cloud: FakeRunPodCloud, api: Api) -> None:
    cloud.hold_provisioning(r"^held-")
    r = api.call("POST", "/pods", json={"name": "held-1", "image": "busy:1",
                                        "gpu": {"id": H100}})
    pod_id = r.json()["id"]
    time.sleep(1.0)
    held = api.pod(pod_id)
    assert held["status"] == "PROVISIONING" and held["cost"] == pytest.approx(2.99)
    assert [p.id for p in cloud.billing()] == [pod_id] and cloud.pods[pod_id].harness is None
    cloud.release_provisioning(r"^held-")
    api.wait_pod(pod_id, "RUNNING")
    assert cloud.invalid_requests() == []


def test_stop_and_start_and_an_exiting_container(cloud: FakeRunPodCloud, api: Api) -> None:
    seen: list[RequestRecord] = []
    cloud.after_response(seen.append)
    busy = api.call("POST", "/pods", json={"name": "b", "image": "busy:1",
                                           "gpu": {"id": H100}}).json()["id"]
    once = api.call("POST", "/pods", json={"name": "o", "image": "once:1",
                                           "gpu": {"id": H100}}).json()["id"]
    missing = api.call("POST", "/pods", json={"name": "m", "image": "nowhere:1",
                                              "gpu": {"id": H100}}).json()["id"]
    api.wait_pod(busy, "RUNNING")
    stopped = api.call("POST", f"/pods/{busy}/action", json={"action": "stop"}).json()
    assert stopped["status"] == "EXITED" and stopped["cost"] == 0.0
    wait_for(lambda: cloud.pods[busy].exits, timeout=10, what="the stopped container's exit")
    exit_ = cloud.pods[busy].exits[0]
    assert exit_.stopped_by == "stop" and exit_.code == 128 + 15
    assert exit_.output.read_text() == "hello\n"
    started = api.call("POST", f"/pods/{busy}/action", json={"action": "start"}).json()
    assert started["status"] == "STARTING"
    api.wait_pod(busy, "RUNNING")
    assert cloud.pods[busy].starts == 2

    # Started again after each exit, max_restarts (2) times, then ERROR.
    api.wait_pod(once, "ERROR")
    exits = cloud.pods[once].exits
    assert [(e.start, e.code, e.stopped_by) for e in exits] == [(1, 3, None), (2, 3, None),
                                                                (3, 3, None)]
    got = events(api, once, lambda got: len(got) >= 3, source="system", tail=3)
    assert [e["data"]["source"] for e in got] == ["system"] * 3
    assert "container exited with code 3" in lines(got, "system")
    # Resuming after an event id gives what followed it, across the container's starts.
    everything = events(api, once, lambda got: len(lines(got)) == 3, tail=5000)
    assert lines(everything) == ["ran"] * 3
    after = events(api, once, lambda got: len(lines(got)) == 2,
                   headers={"Last-Event-ID": next(
                       e["id"] for e in everything if e["data"]["line"] == "ran")})
    assert lines(after) == ["ran"] * 2

    api.wait_pod(missing, "ERROR")
    assert any("failed to pull image nowhere:1" in x.line for x in cloud.logs(missing))
    assert cloud.pods[missing].starts == 0

    # Each after its response: the log streams once their client hung up.
    wait_for(lambda: len(seen) == len(cloud.requests), timeout=5, what="every response reported")
    assert [(x.method, x.path, x.status) for x in seen][:3] == [("POST", "/v2/pods", 201)] * 3
    assert cloud.invalid_requests() == []


def test_a_log_stream_ends_with_the_pod_and_carries_its_last_words(
        cloud: FakeRunPodCloud, api: Api) -> None:
    pod_id = api.call("POST", "/pods", json={"name": "p", "image": "polite:1",
                                             "gpu": {"id": H100}}).json()["id"]
    api.wait_pod(pod_id, "RUNNING")
    got = events(api, pod_id, lambda got: "up" in lines(got),
                 then=lambda: api.call("DELETE", f"/pods/{pod_id}"))
    assert lines(got) == ["up", "bye"]
    assert lines(got, "system")[-2:] == ["container exited with code 0 (terminate)",
                                         "pod terminated"]
    assert cloud.pods[pod_id].torn_down
    assert api.call("GET", f"/pods/{pod_id}/logs").status_code == 404


def test_restart_and_resuming_the_stream_from_a_time(cloud: FakeRunPodCloud, api: Api) -> None:
    pod_id = api.call("POST", "/pods", json={"name": "p", "image": "busy:1",
                                             "gpu": {"id": H100}}).json()["id"]
    api.wait_pod(pod_id, "RUNNING")
    wait_for(lambda: any(x.line == "hello" for x in cloud.logs(pod_id)), timeout=10,
             what="the first hello")
    middle = cloud.logs(pod_id)[-1].ts + 0.001
    r = api.call("POST", f"/pods/{pod_id}/action", json={"action": "restart"})
    assert r.status_code == 200 and r.json()["status"] == "STARTING"
    api.wait_pod(pod_id, "RUNNING")
    assert [(e.start, e.stopped_by) for e in cloud.pods[pod_id].exits] == [(1, "restart")]
    since = dt.datetime.fromtimestamp(middle, dt.timezone.utc).isoformat()
    got = events(api, pod_id, lambda got: "hello" in lines(got), since=since)
    assert lines(got) == ["hello"] and cloud.pods[pod_id].starts == 2
    assert lines(got, "system")[0] == "container exited with code 143 (restart)"

    # A parameter the document does not have is answered, and recorded as the client's slip.
    assert api.call("GET", "/pods", params={"limit": 10}).status_code == 200
    assert [x.schema_errors for x in cloud.invalid_requests()] == [
        ["unknown query parameter 'limit' for GET /v2/pods"]]
