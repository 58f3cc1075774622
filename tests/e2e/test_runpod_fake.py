"""The fake RunPod cloud (tests/fakes/runpod_cloud.py) over real HTTP: its pods are real test pods
with RunPod's environment, its log stream carries their output, terminating one leaves nothing
behind, and it refuses what RunPod refuses. Quick: tiny command images, no Ray."""

from __future__ import annotations

import collections
import contextlib
import datetime as dt
import json
import re
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import dns.resolver
import pytest
import requests

from tests.fakes.runpod_cloud import (
    DEFAULT_DATA_CENTERS,
    DEFAULT_GPUS,
    FakeRunPodCloud,
    RequestRecord,
)
from tests.harness.pods import DnsServer, PodNetwork, list_netns, wait_for

KEY = "rpa_" + "AccountKey" * 4
H100 = "NVIDIA H100 80GB HBM3"
BUSY = "print('hello', flush=True); import time; time.sleep(600)"
ONCE = "import sys; print('ran', flush=True); sys.exit(3)"
# Says goodbye on SIGTERM, as podagent does its teardown.
POLITE = ("import signal, sys, time\n"
          "def bye(*_): print('bye', flush=True); sys.exit(0)\n"
          "signal.signal(signal.SIGTERM, bye); print('up', flush=True); time.sleep(600)")
# Takes the whole grace to stop: SIGTERM does nothing.
STUBBORN = ("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "print('up', flush=True); time.sleep(600)")
IMAGES = {"busy:1": [sys.executable, "-c", BUSY], "once:1": [sys.executable, "-c", ONCE],
          "polite:1": [sys.executable, "-c", POLITE],
          "stubborn:1": [sys.executable, "-c", STUBBORN]}
# The quick tests poll every 50 ms: far more than RunPod's 60 a minute, which only the tests of
# rate limits and pod keys keep.
LAVISH = {"minute": 1_000_000}
DOC_POLICY = '"minute";q=60;w=60, "hour";q=3000;w=3600, "day";q=50000;w=86400'


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


MakeCloud = Callable[..., FakeRunPodCloud]


@pytest.fixture
def make_cloud(pod_network: PodNetwork, dns_server: DnsServer,
               tmp_path: Path) -> Iterator[MakeCloud]:
    """make_cloud(**arguments of FakeRunPodCloud) -> a started cloud; one per test (its pods'
    namespaces are named after a count of its own)."""
    with contextlib.ExitStack() as stack:
        made: list[FakeRunPodCloud] = []

        def make(**kw: Any) -> FakeRunPodCloud:
            kw = {"images": IMAGES, "max_restarts": 2, "stop_grace": 2.0,
                  "rate_limits": LAVISH, **kw}
            fake = FakeRunPodCloud(pod_network, dns_server, tmp_path / f"cloud{len(made)}",
                                   api_key=KEY, **kw)
            made.append(stack.enter_context(fake))
            return fake

        yield make
        for fake in made:
            assert fake.fake_errors == []


@pytest.fixture
def cloud(make_cloud: MakeCloud) -> FakeRunPodCloud:
    return make_cloud()


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
    assert env["RUNPOD_DC_ID"] == running["dataCenterId"] == cloud.data_center == "US-KS-2"
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
    # The document: "Log-event `id` values are the event `ts` timestamp".
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", hello["id"])
    assert hello["id"] == hello["data"]["ts"]
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
    # Its whole hello first: unbuffered, print writes "hello" and "\n" apart.
    wait_for(lambda: "hello" in [x.line for x in cloud.logs(busy)], timeout=10, what="hello")
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


# --------------------------------------------------------------------------------------------
# rules the document states beyond its schema


def _dc(dc_id: str) -> dict[str, Any]:
    return next(dict(dc) for dc in DEFAULT_DATA_CENTERS if dc["id"] == dc_id)


AMD = {"id": "AMD Instinct MI300X OAM", "name": "MI300X", "pool": None, "manufacturer": "AMD",
       "memory": 192, "secure": True, "community": False,
       "price": {"secure": 2.49, "community": 0.0}, "maxCount": {"secure": 8, "community": 0}}


def test_data_centers_and_where_global_networking_goes(make_cloud: MakeCloud) -> None:
    # The default (the catalog's first) has no Global Networking here.
    cloud = make_cloud(gpus=[*DEFAULT_GPUS, AMD],
                       data_centers=[_dc("EUR-IS-1"), _dc("US-KS-2"), _dc("EU-RO-1")])
    api = Api(cloud)
    assert cloud.data_center == "EUR-IS-1"

    def ids(**params: str) -> list[str]:
        r = api.call("GET", "/catalog/datacenters", params=params)
        assert r.status_code == 200, r.text
        return [dc["id"] for dc in r.json()["dataCenters"]]

    assert ids() == ["EUR-IS-1", "US-KS-2", "EU-RO-1"]
    assert ids(globalNetwork="true") == ["US-KS-2", "EU-RO-1"]
    assert ids(globalNetwork="false") == ["EUR-IS-1"]
    assert ids(regions="EUROPE,ASIA", globalNetwork="true") == ["EU-RO-1"]
    assert ids(networkVolumeTypes="STANDARD,HIGH_PERFORMANCE") == ["EU-RO-1"]
    assert ids(compliance="GDPR") == ["EUR-IS-1", "EU-RO-1"]
    one = api.call("GET", "/catalog/datacenters/EU-RO-1",
                   params={"include": "GPU_AVAILABILITY"}).json()
    assert one["globalNetwork"] is True and one["name"] == "EU Romania 1"
    assert {g["id"]: g["availability"] for g in one["gpuAvailability"]}[H100] == "HIGH"
    assert api.call("GET", "/catalog/datacenters/NOPE-1").status_code == 404
    r = api.call("GET", "/catalog/datacenters", params={"globalNetwork": "yes",
                                                        "regions": "MARS"})
    assert r.status_code == 422
    errors = r.json()["errors"]
    assert errors[0] == "$.globalNetwork: 'yes' is not of type 'boolean'"
    assert errors[1].startswith("$.regions[0]: 'MARS' is not one of ['NORTH_AMERICA', ")

    body = {"name": "gn", "image": "busy:1", "gpu": {"id": H100}, "globalNetworking": True}

    def refused(**changes: Any) -> str:
        r = api.call("POST", "/pods", json={**body, **changes})
        assert r.status_code == 400, r.text
        return r.json()["detail"]

    assert refused(cloud="COMMUNITY") == "global networking requires Secure Cloud"
    assert refused(gpu={"id": AMD["id"]}) == (
        "global networking requires an NVIDIA GPU (AMD Instinct MI300X OAM is AMD)")
    cpu = {k: v for k, v in body.items() if k != "gpu"}
    r = api.call("POST", "/pods", json={**cpu, "cpu": {"id": "cpu3c", "vcpuCount": 2}})
    assert r.json()["detail"] == "global networking requires an NVIDIA GPU"
    assert refused(dataCenterIds=["EUR-IS-1"]) == (
        "data center EUR-IS-1 does not support global networking (see GET "
        "/v2/catalog/datacenters?globalNetwork=true)")
    assert refused(dataCenterIds=["NOPE-1", "EU-RO-1"]).startswith(
        "unknown data center 'NOPE-1': dataCenterIds must be ids from GET "
        "/v2/catalog/datacenters, one of 'EUR-IS-1', 'US-KS-2', 'EU-RO-1'")
    assert "unknown data center 'NOPE-1'" in refused(globalNetworking=False,
                                                      dataCenterIds=["NOPE-1"])

    cloud.hold_provisioning("^held-")  # placement is what is looked at: they need not run
    placed = {name: api.call("POST", "/pods", json={**body, "name": name, **changes}).json()
              ["dataCenterId"] for name, changes in {
                  "held-gn": {"dataCenterIds": ["EUR-IS-1", "EU-RO-1", "US-KS-2"]},
                  "held-plain": {"globalNetworking": False,
                                 "dataCenterIds": ["EUR-IS-1", "EU-RO-1"]},
                  "held-default": {"globalNetworking": False}}.items()}
    assert placed == {"held-gn": "EU-RO-1", "held-plain": "EUR-IS-1",
                      "held-default": "EUR-IS-1"}
    # Without dataCenterIds: the first data center that has Global Networking.
    pod = api.call("POST", "/pods", json=body).json()
    assert pod["dataCenterId"] == "US-KS-2"
    view = cloud.wait_status(pod["id"], "RUNNING")
    assert view.process_env["RUNPOD_DC_ID"] == "US-KS-2" == view.data_center

    cluster = {"name": "held-c", "type": "TRAINING", "image": "busy:1",
               "compute": {"gpuTypeId": H100, "gpuCountPerPod": 1, "podCount": 2}}
    r = api.call("POST", "/clusters", json={**cluster, "dataCenterIds": ["NOPE-1"]})
    assert r.status_code == 400 and "unknown data center 'NOPE-1'" in r.json()["detail"]
    r = api.call("POST", "/clusters", json={**cluster, "dataCenterIds": ["EU-RO-1", "US-KS-2"]})
    assert r.status_code == 201 and r.json()["dataCenterId"] == "EU-RO-1"
    members = api.call("GET", f"/clusters/{r.json()['id']}/pods").json()["pods"]
    assert [p["dataCenterId"] for p in members] == ["EU-RO-1"] * 2
    assert api.call("DELETE", f"/clusters/{r.json()['id']}").status_code == 204
    assert [x.schema_errors for x in cloud.invalid_requests()] == [errors]


def test_gpu_ids_only_from_the_catalog(cloud: FakeRunPodCloud, api: Api) -> None:
    r = api.call("POST", "/pods", json={"name": "x", "image": "busy:1",
                                        "gpu": {"id": "H100 SXM"}})
    assert r.status_code == 400
    assert r.json()["detail"] == (
        "unknown GPU type 'H100 SXM': gpu.id must be a GPU type id from GET /v2/catalog/gpus, "
        "one of 'NVIDIA H100 80GB HBM3', 'NVIDIA A100 80GB PCIe', 'NVIDIA GeForce RTX 4090'")
    r = api.call("POST", "/clusters", json={
        "name": "c", "type": "TRAINING", "image": "busy:1",
        "compute": {"gpuTypeId": "H100 SXM", "gpuCountPerPod": 1, "podCount": 2}})
    assert r.status_code == 400
    assert r.json()["detail"].startswith("unknown GPU type 'H100 SXM': compute.gpuTypeId must "
                                         "be a GPU type id from GET /v2/catalog/gpus, one of")
    assert cloud.pods == {} and cloud.invalid_requests() == []


SECRET = "ghcr.io/me/secret:1"


def test_private_images_pull_only_with_their_registry_credential(make_cloud: MakeCloud) -> None:
    registries = [{"id": "reg_1", "name": "ghcr-me"}, {"id": "reg_2", "name": "dockerhub"}]
    cloud = make_cloud(images={**IMAGES, SECRET: IMAGES["busy:1"]}, registries=registries,
                       private_images={SECRET: "reg_1"})
    api = Api(cloud)
    assert api.call("GET", "/registries").json() == {"registries": registries}
    assert api.call("GET", "/registries/reg_2").json() == registries[1]
    assert api.call("GET", "/registries/reg_9").status_code == 404

    body = {"name": "s", "image": SECRET, "gpu": {"id": H100}}
    r = api.call("POST", "/pods", json={**body, "registry": "reg_9"})
    assert r.status_code == 400
    assert r.json()["detail"] == "registry credential 'reg_9' not found (see GET /v2/registries)"
    made = {}
    for name, registry in (("with", "reg_1"), ("without", None), ("wrong", "reg_2")):
        r = api.call("POST", "/pods", json={**body, "name": name, "registry": registry})
        assert r.status_code == 201 and r.json()["registry"] == registry
        made[name] = r.json()["id"]
    cluster = api.call("POST", "/clusters", json={
        "name": "c", "type": "TRAINING", "image": SECRET,
        "compute": {"gpuTypeId": H100, "gpuCountPerPod": 1, "podCount": 2}}).json()
    members = [p["id"] for p in api.call("GET", f"/clusters/{cluster['id']}/pods").json()["pods"]]

    api.wait_pod(made["with"], "RUNNING")
    for pod_id in (made["without"], made["wrong"], *members):
        assert cloud.wait_status(pod_id, "ERROR").starts == 0
        assert f"failed to pull image {SECRET}: unauthorized: authentication required" in [
            x.line for x in cloud.logs(pod_id)]
        assert api.pod(pod_id)["cost"] == 0.0
    # Clusters take no registry (CreateClusterRequest has none).
    r = api.call("POST", "/clusters", json={
        "name": "c2", "type": "TRAINING", "image": SECRET, "registry": "reg_1",
        "compute": {"gpuTypeId": H100, "gpuCountPerPod": 1, "podCount": 2}})
    assert r.status_code == 422
    assert r.json()["errors"] == ["$: additional properties 'registry' not allowed"]


@pytest.mark.parametrize("resume", ["after", "again"])
def test_log_event_ids_are_timestamps_and_resuming_plays_either_way(
        make_cloud: MakeCloud, resume: str) -> None:
    cloud = make_cloud(log_resolution=1.0, log_resume=resume)
    api = Api(cloud)
    pod_id = api.call("POST", "/pods", json={"name": "p", "image": "busy:1",
                                             "gpu": {"id": H100}}).json()["id"]
    wait_for(lambda: "hello" in [x.line for x in cloud.logs(pod_id)], timeout=20,
             what="hello")
    logs = cloud.logs(pod_id)
    assert all(x.us % 1_000_000 == 0 for x in logs)
    # A second of several lines ("pod placed", "pulling image", ... come together).
    shared = next(i for i, n in collections.Counter(x.event_id for x in logs).items() if n > 1)
    first = next(x for x in logs if x.event_id == shared)
    # A client got the first line of that second, and then its connection broke.
    got = events(api, pod_id, lambda got: got[-1]["id"] == shared, tail=5000)
    assert got[-1]["data"] == {"ts": shared, "source": first.source, "line": first.line}
    # Something after that second, for the resumed stream to end on.
    time.sleep(max(0.0, first.ts + 1.05 - time.time()))
    assert api.call("POST", f"/pods/{pod_id}/action", json={"action": "stop"}).ok
    wait_for(lambda: cloud.logs(pod_id)[-1].line.endswith("(stop)"), timeout=10,
             what="the container stopped")
    logs = cloud.logs(pod_id)
    resumed = events(api, pod_id, lambda got: got[-1]["data"]["line"].endswith("(stop)"),
                     headers={"Last-Event-ID": shared})
    sent = [(e["id"], e["data"]["line"]) for e in resumed]
    if resume == "after":  # what that second had not sent yet is lost
        assert sent == [(x.event_id, x.line) for x in logs if x.us > first.us]
        assert shared not in [i for i, _ in sent]
    else:  # what that second had sent comes again
        assert sent == [(x.event_id, x.line) for x in logs if x.us >= first.us]
        assert sent[0] == (shared, first.line)

    # Last-Event-ID is a date-time: any one, but the old "<ts>/<seq>" is none.
    r = api.call("GET", f"/pods/{pod_id}/logs", headers={"Last-Event-ID": f"{shared}/000001"})
    assert r.status_code == 422
    assert r.json()["errors"] == [f"$.Last-Event-ID: '{shared}/000001' is not a 'date-time'"]
    got = events(api, pod_id, lambda got: True,
                 headers={"Last-Event-ID": "2000-01-01T01:00:00.123456+01:00"})
    assert got[0]["id"] == logs[0].event_id
    # A proxy drops the stream: the server ends it, the client must connect again.
    got = events(api, pod_id, lambda got: True, tail=1, then=cloud.drop_log_streams)
    assert [e["data"]["line"] for e in got] == [logs[-1].line]
    assert cloud.log_connections(pod_id) == 4


def _limits(r: requests.Response) -> dict[str, tuple[int, int]]:
    """RateLimit: window -> (requests left, seconds until it resets)."""
    return {m[0]: (int(m[1]), int(m[2]))
            for m in re.findall(r'"(\w+)";r=(\d+);t=(\d+)', r.headers["RateLimit"])}


def test_rate_limits_per_window(make_cloud: MakeCloud) -> None:
    cloud = make_cloud(rate_limits={"minute": 5, "hour": 9},
                       rate_windows={"minute": 2, "hour": 30})
    cloud.hold_provisioning(".")
    api = Api(cloud)
    r = api.call("POST", "/pods", json={"name": "p", "image": "busy:1", "gpu": {"id": H100}})
    assert r.status_code == 201 and r.headers["RateLimit-Policy"] == \
        '"minute";q=5;w=2, "hour";q=9;w=30'
    left = [_limits(r)]
    with api.call("GET", f"/pods/{r.json()['id']}/logs", stream=True) as stream:  # one request
        assert stream.status_code == 200
        left.append(_limits(stream))
    left += [_limits(api.call("GET", "/pods")) for _ in range(3)]
    assert [x["minute"][0] for x in left] == [4, 3, 2, 1, 0]
    assert [x["hour"][0] for x in left] == [8, 7, 6, 5, 4]
    assert all(1 <= x["minute"][1] <= 2 and x["hour"][1] <= 30 for x in left)

    # Over the minute's quota: 429, and nothing is done.
    r = api.call("POST", "/pods", json={"name": "q", "image": "busy:1", "gpu": {"id": H100}})
    assert r.status_code == 429
    assert r.json()["detail"] == "rate limit exceeded for the minute window"
    assert 1 <= int(r.headers["Retry-After"]) <= 2 and _limits(r)["minute"][0] == 0
    assert len(cloud.pods) == 1
    # Neither a 401 nor a fault counts, and neither carries the headers.
    r401 = Api(cloud, "rpa_wrong").call("GET", "/pods")
    assert r401.status_code == 401 and "RateLimit" not in r401.headers
    cloud.fail_next(1, 503)
    r503 = api.call("GET", "/pods")
    assert r503.status_code == 503 and "RateLimit" not in r503.headers
    assert cloud.calls_per_window() == {"minute": 5, "hour": 5}

    time.sleep(int(r.headers["Retry-After"]))  # a new minute, the same hour
    left = [_limits(api.call("GET", "/pods")) for _ in range(4)]
    assert [x["hour"][0] for x in left] == [3, 2, 1, 0]
    r = api.call("GET", "/pods")
    assert r.status_code == 429 and r.json()["detail"] == "rate limit exceeded for the hour window"
    assert 2 < int(r.headers["Retry-After"]) <= 30
    assert cloud.requests[-1].headers["Retry-After"] == r.headers["Retry-After"]


@pytest.mark.parametrize("mode", ["refuse", "own", "account"])
def test_what_a_pod_scoped_key_may_do(make_cloud: MakeCloud, mode: str) -> None:
    cloud = make_cloud(pod_key=mode, rate_limits=None)  # the document's quotas: a few calls
    cloud.hold_provisioning(".")
    api = Api(cloud)
    mine, other = [api.call("POST", "/pods", json={"name": n, "image": "busy:1",
                                                   "gpu": {"id": H100}}).json()["id"]
                   for n in ("mine", "other")]
    pod = Api(cloud, cloud.pods[mine].api_key)
    answers = [pod.call("GET", f"/pods/{mine}"), pod.call("GET", f"/pods/{other}"),
               pod.call("GET", "/pods"),
               pod.call("POST", f"/pods/{mine}/action", json={"action": "stop"})]
    assert [r.status_code for r in answers] == {
        "refuse": [403] * 4, "own": [200, 403, 403, 200], "account": [200] * 4}[mode]
    # A 403 answers an authenticated request too: it carries the rate limit headers.
    assert all(r.headers["RateLimit-Policy"] == DOC_POLICY for r in answers)
    if mode != "refuse":
        assert answers[3].json()["status"] == "EXITED"
        again = pod.call("POST", f"/pods/{mine}/action", json={"action": "stop"})
        assert again.status_code == 409
        assert "not valid for a pod that is EXITED" in again.json()["detail"]
    # Whose key made each request; each key is counted apart.
    keys = [r.key for r in cloud.requests]
    assert keys[:2] == ["account", "account"] and set(keys[2:]) == {f"pod:{mine}"}
    assert cloud.calls_per_window(f"pod:{mine}")["minute"] == len(keys) - 2
    assert cloud.calls_per_window() == {"minute": 2, "hour": 2, "day": 2}
    assert Api(cloud, "rpa_unknown").call("GET", "/pods").status_code == 401
    assert cloud.requests[-1].key is None


# --------------------------------------------------------------------------------------------
# fault injection and measurement


def test_garbled_answers_are_carried_out(cloud: FakeRunPodCloud, api: Api) -> None:
    body = {"name": "g", "image": "busy:1", "gpu": {"id": H100}}
    cloud.hold_provisioning(".")
    cloud.garble_next(1, match=r"^POST /v2/pods$")  # 200, no body
    r = api.call("POST", "/pods", json=body)
    assert (r.status_code, r.content) == (200, b"") and "Content-Type" not in r.headers
    [pod_id] = cloud.pods  # created all the same
    cloud.garble_next(1, 201, b"not json", match=r"^GET /v2/pods/")
    r = api.call("GET", f"/pods/{pod_id}")
    assert (r.status_code, r.content) == (201, b"not json")
    assert r.headers["Content-Type"] == "application/json"
    cloud.garble_next(2, body=b'{"id": 5}')  # whatever comes
    got = [api.call("GET", p) for p in ("/pods", "/catalog/gpus", "/pods")]
    assert [r.content for r in got[:2]] == [b'{"id": 5}'] * 2
    assert [p["id"] for p in got[2].json()["pods"]] == [pod_id]  # answered as ever
    cloud.garble_next(1, body=b"{}")
    r = api.call("DELETE", f"/pods/{pod_id}")
    assert (r.status_code, r.content) == (200, b"{}")
    assert cloud.pods[pod_id].status == "TERMINATED"
    assert [x.fault for x in cloud.requests] == [True, True, True, True, False, True]
    assert cloud.invalid_requests() == []


def test_creates_take_their_time_in_parallel_and_pods_bill_by_the_second(
        make_cloud: MakeCloud) -> None:
    cloud = make_cloud(create_delay=1.0)
    cloud.hold_provisioning("^held-")

    def create(name: str, image: str = "busy:1") -> requests.Response:
        return Api(cloud).call("POST", "/pods", json={"name": name, "image": image,
                                                       "gpu": {"id": H100}})

    t0 = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        made = list(pool.map(create, [f"held-{i}" for i in range(4)]))
    took = time.monotonic() - t0
    assert [r.status_code for r in made] == [201] * 4
    assert 1.0 <= took < 2.5, took  # in turn: 4 seconds

    pod_id = create("s", "stubborn:1").json()["id"]
    wait_for(lambda: "up" in [x.line for x in cloud.logs(pod_id)], timeout=20,
             what="SIGTERM ignored")
    time.sleep(0.3)
    api = Api(cloud)
    stopped = api.call("POST", f"/pods/{pod_id}/action", json={"action": "stop"})
    assert stopped.json()["status"] == "EXITED" and stopped.json()["cost"] == 0.0
    # EXITED at once, though the container has its grace (2 s): stopping again is 409.
    again = api.call("POST", f"/pods/{pod_id}/action", json={"action": "stop"})
    assert again.status_code == 409 and cloud.pods[pod_id].exits == ()
    view = cloud.pods[pod_id]
    assert view.price == 2.99 and 0.3 <= view.billed_seconds < 30
    assert view.billed_dollars == pytest.approx(view.billed_seconds * 2.99 / 3600)
    exit_ = wait_for(lambda: cloud.pods[pod_id].exits, timeout=10, what="the exit")[0]
    assert (exit_.code, exit_.stopped_by) == (128 + 9, "stop")
    assert cloud.pods[pod_id].billed_seconds == view.billed_seconds  # no more since the stop
    held = cloud.pods[made[0].json()["id"]]
    assert held.status == "PROVISIONING"
    assert cloud.pods[held.id].billed_seconds > held.billed_seconds  # still billing
