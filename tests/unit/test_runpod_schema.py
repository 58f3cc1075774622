"""The fake RunPod cloud's schema checks (RunPod's published v2 schemas): what it refuses and
how it names it, what it accepts, and that every Pod and Cluster it can answer with is valid."""

from __future__ import annotations

import json
import time

import pytest

from tests.fakes.runpod_cloud import (
    ACTIONS,
    SCHEMAS,
    LogLine,
    _ClusterState,
    _parse_event_id,
    _PodState,
    cluster_json,
    parse_rfc3339,
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
    pod = _PodState(id="abc123def456gh", name="head", created=time.time() - 60,
                    image="podagent:test", args="", env={"A": "1"}, ports=[], disk=20,
                    mounts={}, gpu={"id": H100, "count": 2}, cpu=None, cloud="SECURE",
                    dc="US-KS-2", price=5.98, hostname="abc123def456gh-0a1b2c3d")
    for k, v in changes.items():
        setattr(pod, k, v)
    return pod


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
    line = LogLine(7, parse_rfc3339("2026-06-01T12:02:03.5Z"), "container", "hello")
    assert line.event_id == "2026-06-01T12:02:03.500000Z/000000000007"
    event = line.sse().decode()
    assert event.startswith("id: 2026-06-01T12:02:03.500000Z/000000000007\ndata: ")
    assert event.endswith("\n\n")
    assert json.loads(event.split("data: ", 1)[1]) == {
        "ts": "2026-06-01T12:02:03.500000Z", "source": "container", "line": "hello"}
    assert _parse_event_id(line.event_id) == (line.ts, 7)
    assert _parse_event_id("2026-06-01T12:02:03+02:00") == (line.ts - 7200.5, None)
    assert _parse_event_id("yesterday") is None and _parse_event_id("2026-06-01/x") is None
