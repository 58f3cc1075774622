"""The fake RunPod cloud's schema checks (RunPod's published v2 schemas): what it refuses and
how it names it, what it accepts, and that every Pod and Cluster it can answer with is valid."""

from __future__ import annotations

import json
import time

import pytest

from tests.fakes.runpod_cloud import (
    ACTIONS,
    DEFAULT_DATA_CENTERS,
    DEFAULT_RATE_LIMITS,
    DEFAULT_RATE_WINDOWS,
    SCHEMAS,
    LogLine,
    RateLimiter,
    _ClusterState,
    _PodState,
    cluster_json,
    parse_rfc3339,
    parse_rfc3339_us,
    pod_json,
)

H100 = "NVIDIA H100 80GB HBM3"
POD = {"name": "head", "image": "podagent:test", "gpu": {"id": H100, "count": 2}}
CLUSTER = {"name": "c", "type": "TRAINING", "image": "podagent:test",
           "compute": {"gpuTypeId": H100, "gpuCountPerPod": 8, "podCount": 2}}


def _with(body: dict, **changes) -> dict:
    out = json.loads(json.dumps(body))
    out.update(changes)
    return out


def test_minimal_and_full_bodies_are_accepted():
    assert SCHEMAS.errors("CreatePodRequest", {"name": "p", "image": "i", "gpu": {"id": H100}}) \
        == []
    full = _with(POD, cloud="SECURE", globalNetworking=True, args="--x 1", disk=50,
                 env={"A": "1"}, ports=["8265/http"], dataCenterIds=["US-KS-2"],
                 mounts={"persistent": {"size": 20, "path": "/workspace"}}, startSsh=True,
                 registry=None)
    assert SCHEMAS.errors("CreatePodRequest", full) == []
    assert SCHEMAS.errors("CreatePodRequest", {"name": "p", "templateId": "t"}) == []
    assert SCHEMAS.errors("CreateClusterRequest", CLUSTER) == []
    assert SCHEMAS.errors("CreateClusterRequest", _with(
        CLUSTER, args="a", env={"K": "v"}, ports=["22/tcp"], disk=30, dataCenterIds=[],
        mounts={"network": [{"volumeId": "v1", "path": "/workspace"}]}, startSsh=True,
        startJupyter=False)) == []
    assert SCHEMAS.errors("PodActionRequest", {"action": "stop"}) == []


@pytest.mark.parametrize(("schema", "body", "expected"), [
    ("CreatePodRequest", _with(POD, bogus=1), "$: additional properties 'bogus' not allowed"),
    ("CreatePodRequest", _with(POD, gpu={"id": H100, "count": "2"}),
     "$.gpu.count: '2' is not of type 'integer'"),
    ("CreatePodRequest", _with(POD, cloud="CHEAP"),
     "$.cloud: 'CHEAP' is not one of ['SECURE', 'COMMUNITY']"),
    ("CreatePodRequest", {"image": "i", "gpu": {"id": H100}}, "$: missing property 'name'"),
    ("CreatePodRequest", {"name": "p", "gpu": {"id": H100}}, "$: missing property 'image'"),
    ("CreatePodRequest", _with(POD, gpu={"id": H100, "bogus": True}),
     "$.gpu: additional properties 'bogus' not allowed"),
    ("CreatePodRequest", _with(POD, env={"A": 1}), "$.env.A: 1 is not of type 'string'"),
    ("CreatePodRequest", _with(POD, mounts={"persistent": {"size": 5, "path": "/w"}}),
     "$.mounts.persistent.size: 5 is less than the minimum of 10"),
    ("CreateClusterRequest", _with(CLUSTER, compute={**CLUSTER["compute"], "podCount": 1}),
     "$.compute.podCount: 1 is less than the minimum of 2"),
    ("CreateClusterRequest", _with(CLUSTER, registry="r"),
     "$: additional properties 'registry' not allowed"),
    ("CreateClusterRequest", _with(CLUSTER, type="K8S"),
     "$.type: 'K8S' is not one of ['APPLICATION', 'TRAINING', 'SLURM', 'RAY']"),
    ("PodActionRequest", {"action": "stop", "force": True},
     "$: additional properties 'force' not allowed"),
])
def test_each_violation_is_refused_by_name_and_alone(schema, body, expected):
    # Alone: a field that is wrong does not also make its valid neighbours "unexpected".
    assert SCHEMAS.errors(schema, body) == [expected]


def test_query_parameters_of_the_log_stream():
    assert SCHEMAS.parameter_errors("tail", 100) == []
    assert SCHEMAS.parameter_errors("tail", 9000) == ["$.tail: 9000 is greater than the "
                                                      "maximum of 5000"]
    assert SCHEMAS.parameter_errors("tail", "ten") == ["$.tail: 'ten' is not of type 'integer'"]
    assert SCHEMAS.parameter_errors("source", "system") == []
    assert SCHEMAS.parameter_errors("source", "stdout") == [
        "$.source: 'stdout' is not one of ['container', 'system']"]


def _pod(**changes) -> _PodState:
    fields = dict(id="abc123def456gh", name="head", created=time.time() - 60,
                  image="podagent:test", args="", env={"A": "1"}, ports=[], disk=20,
                  mounts={}, gpu={"id": H100, "count": 2}, cpu=None, cloud="SECURE",
                  dc="US-KS-2", price=5.98, hostname="abc123def456gh-0a1b2c3d")
    return _PodState(**{**fields, **changes})


@pytest.mark.parametrize("status", list(ACTIONS))
def test_every_pod_the_fake_renders_is_a_pod(status):
    variants = [
        _pod(status=status),
        _pod(status=status, started_at=time.time() - 5, global_networking=True, ip="10.0.0.1",
             mounts={"persistent": {"size": 20, "path": "/workspace"}}),
        _pod(status=status, global_networking=True),  # its address not assigned yet
        _pod(status=status, cluster={"id": "cl1", "rank": 1, "ip": "10.0.0.2"},
             mounts={"network": [{"volumeId": "v1", "path": "/workspace"}]}),
        _pod(status=status, gpu=None, cpu={"id": "cpu3c", "vcpuCount": 4}, price=0.12),
    ]
    for pod in variants:
        body = pod_json(pod)
        assert SCHEMAS.errors("Pod", body) == [], body
        assert body["actions"] == ACTIONS[status]
        assert (body["cost"] > 0) == (status in ("PROVISIONING", "STARTING", "RUNNING"))
        assert (body["runtime"] is not None) == (status == "RUNNING" and bool(pod.started_at))
    gn = pod_json(variants[1])["globalNetworking"]
    assert gn == {"enabled": True, "ip": "10.0.0.1",
                  "internalDns": "abc123def456gh.runpod.internal"}
    assert pod_json(variants[0])["globalNetworking"] == {"enabled": False}
    assert SCHEMAS.errors("ListPodsResponse", {"pods": [pod_json(p) for p in variants]}) == []


def test_every_cluster_the_fake_renders_is_a_cluster():
    members = [_pod(cluster={"id": "cl1", "rank": r}, status="PROVISIONING") for r in range(2)]
    cluster = _ClusterState("cl1", "c", "TRAINING", dict(CLUSTER["compute"]), "US-KS-2",
                            time.time(), members)
    fresh = cluster_json(cluster, "10.213.0.0/24")
    assert SCHEMAS.errors("Cluster", fresh) == []
    assert "network" not in fresh and fresh["primary"]["podId"] == members[0].id
    members[0].ip, members[0].status = "10.213.0.1", "RUNNING"
    members[1].gone, members[1].status = True, "TERMINATED"
    later = cluster_json(cluster, "10.213.0.0/24")
    assert SCHEMAS.errors("Cluster", later) == []
    assert later["pods"] == {"total": 1, "byStatus": {"RUNNING": 1}}
    assert later["network"] == {"cidr": "10.213.0.0/24"}
    assert SCHEMAS.errors("ListClustersResponse", {"clusters": [fresh, later]}) == []


def test_log_events_and_their_ids():
    # The document: "Log-event `id` values are the event `ts` timestamp".
    line = LogLine(7, parse_rfc3339("2026-06-01T12:02:03.5Z"), "container", "hello")
    assert line.event_id == "2026-06-01T12:02:03.500000Z"
    event = line.sse().decode()
    assert event.startswith("id: 2026-06-01T12:02:03.500000Z\ndata: ")
    assert event.endswith("\n\n")
    assert json.loads(event.split("data: ", 1)[1]) == {
        "ts": "2026-06-01T12:02:03.500000Z", "source": "container", "line": "hello"}
    # Last-Event-ID and since: any RFC 3339 date-time, compared in whole microseconds.
    assert parse_rfc3339_us(line.event_id) == line.us
    assert parse_rfc3339_us("2026-06-01T14:02:03.5000009+02:00") == line.us
    assert parse_rfc3339_us("2026-06-01T12:02:03.000001Z") == line.us - 499_999
    for bad in ("yesterday", "2026-06-01", "2026-06-01T12:02:03.500000Z/000000000007"):
        assert parse_rfc3339_us(bad) is None
    whole = LogLine(1, parse_rfc3339("2026-06-01T12:02:03Z"), "system", "x")
    assert whole.event_id == "2026-06-01T12:02:03.000000Z"


def test_rate_limit_headers_as_the_document_writes_them():
    now = [1000.0]
    limiter = RateLimiter(DEFAULT_RATE_LIMITS, DEFAULT_RATE_WINDOWS, clock=lambda: now[0])
    assert limiter.admit("account") == (None, {
        "RateLimit": '"minute";r=59;t=60, "hour";r=2999;t=3600, "day";r=49999;t=86400',
        "RateLimit-Policy": '"minute";q=60;w=60, "hour";q=3000;w=3600, "day";q=50000;w=86400'})
    for key in ("account", "pod:abc"):  # SCHEMAS: both headers are the document's strings
        for value in limiter.admit(key)[1].values():
            assert SCHEMAS.errors("RateLimitHeader", value) == []


def test_rate_limits_count_per_key_in_fixed_windows():
    now = [0.0]
    limiter = RateLimiter({"minute": 2, "hour": 3}, {"minute": 10, "hour": 100},
                          clock=lambda: now[0])
    assert limiter.admit("account")[0] is None
    now[0] = 4.2
    window, headers = limiter.admit("account")
    assert window is None and headers["RateLimit"] == '"minute";r=0;t=6, "hour";r=1;t=96'
    assert limiter.admit("pod:p1")[0] is None  # a key of its own
    window, headers = limiter.admit("account")
    assert window == "minute" and headers["Retry-After"] == "6"
    assert limiter.used("account") == {"minute": 2, "hour": 2}  # the refused one not counted
    now[0] = 10.0  # the minute is over: a new one starts with the next request
    assert limiter.admit("account")[0] is None
    window, headers = limiter.admit("account")
    assert window == "hour" and headers["Retry-After"] == "90"
    assert headers["RateLimit"] == '"minute";r=1;t=10, "hour";r=0;t=90'
    now[0] = 99.5
    window, headers = limiter.admit("account")
    assert window == "hour" and headers["Retry-After"] == "1"  # at least 1
    with pytest.raises(ValueError, match="no window length"):
        RateLimiter({"week": 1}, DEFAULT_RATE_WINDOWS)
    # "Optional — omitted for rate-limit-exempt callers".
    assert RateLimiter({}, DEFAULT_RATE_WINDOWS).admit("account") == (None, {})


def test_the_catalogs_and_what_pods_echo():
    assert SCHEMAS.errors("ListDataCentersResponse",
                          {"dataCenters": list(DEFAULT_DATA_CENTERS)}) == []
    assert SCHEMAS.errors("DataCenter", {**DEFAULT_DATA_CENTERS[0], "region": "MARS"}) == [
        "$.region: 'MARS' is not one of ['NORTH_AMERICA', 'SOUTH_AMERICA', 'EUROPE', 'ASIA', "
        "'MIDDLE_EAST', 'AFRICA', 'OCEANIA', 'ANTARCTICA', 'UNKNOWN']"]
    assert SCHEMAS.errors("ListRegistriesResponse",
                          {"registries": [{"id": "reg_1", "name": "ghcr"}]}) == []
    assert SCHEMAS.errors("Registry", {"id": "reg_1"}) == ["$: missing property 'name'"]
    body = pod_json(_pod(registry="reg_1"))
    assert body["registry"] == "reg_1" and SCHEMAS.errors("Pod", body) == []


def test_billed_time_follows_the_status():
    pod = _pod(created=100.0)  # PROVISIONING, billing since it was created
    assert pod.billed_seconds(now=110.0) == 10.0
    pod.set_status("RUNNING", now=130.0)
    pod.set_status("EXITED", now=160.0)
    assert pod.billed_seconds(now=500.0) == 60.0
    pod.set_status("STARTING", now=600.0)
    pod.set_status("ERROR", now=605.0)
    pod.set_status("TERMINATED", now=700.0)
    assert pod.billed_seconds(now=900.0) == 65.0
    assert pod_json(pod)["cost"] == 0.0
