"""The fake RunPod cloud's network volumes (tests/fakes/runpod_cloud.py): RunPod's v2
/v2/network-volumes endpoints and what a pod's or cluster's mounts.network must name. Quick: only
the HTTP API, and pods held in PROVISIONING (no network namespace is ever made)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import requests

from tests.fakes.runpod_cloud import DEFAULT_DATA_CENTERS, FakeRunPodCloud
from tests.harness.pods import DnsServer, PodNetwork

KEY = "rpa_" + "AccountKey" * 4
H100 = "NVIDIA H100 80GB HBM3"
IMAGES = {"busy:1": [sys.executable, "-c", "import time; time.sleep(600)"]}
LAVISH = {"minute": 1_000_000}
# A data center without network volumes ("Empty = none"), after the default ones.
NO_VOLUMES = {"id": "US-NV-1", "name": "US Nevada 1", "region": "NORTH_AMERICA",
              "globalNetwork": False, "networkVolumeTypes": [], "compliance": []}


def make(root: Path, **kw: Any) -> FakeRunPodCloud:
    # Nothing here provisions a pod, so neither the network nor DNS is ever used.
    net = cast(PodNetwork, SimpleNamespace(subnet="10.99.0.0/24"))
    dns = cast(DnsServer, SimpleNamespace(address="127.0.0.1", port=53))
    kw = {"api_key": KEY, "images": IMAGES, "rate_limits": LAVISH, "stop_grace": 0.5,
          "data_centers": [*DEFAULT_DATA_CENTERS, NO_VOLUMES], **kw}
    return FakeRunPodCloud(net, dns, root, **kw)


@pytest.fixture
def cloud(tmp_path: Path) -> Iterator[FakeRunPodCloud]:
    fake = make(tmp_path / "cloud", network_volumes={"vol-us": "US-KS-2", "vol-eu": "EU-RO-1"})
    fake.hold_provisioning(".*")  # a created pod never gets a machine
    with fake:
        yield fake
    assert fake.fake_errors == []


def call(cloud: FakeRunPodCloud, method: str, path: str, key: str = KEY,
         **kw: Any) -> requests.Response:
    return requests.request(method, cloud.url + "/v2" + path, timeout=10,
                            headers={"Authorization": f"Bearer {key}"}, **kw)


def refused(cloud: FakeRunPodCloud, method: str, path: str, body: dict[str, Any],
            status: int = 400) -> str:
    r = call(cloud, method, path, json=body)
    assert r.status_code == status, r.text
    assert r.headers["Content-Type"] == "application/problem+json"
    return r.json()["detail"]


def test_a_volume_is_created_listed_got_and_deleted(cloud: FakeRunPodCloud) -> None:
    given = [{"id": "vol-us", "name": "vol-us", "size": 50, "dataCenter": "US-KS-2",
              "type": "STANDARD"},
             {"id": "vol-eu", "name": "vol-eu", "size": 50, "dataCenter": "EU-RO-1",
              "type": "STANDARD"}]  # the data center's first networkVolumeTypes entry
    assert cloud.volumes == given
    r = call(cloud, "GET", "/network-volumes")
    assert r.status_code == 200 and r.json() == {"networkVolumes": given}
    assert "RateLimit" in r.headers and "RateLimit-Policy" in r.headers

    r = call(cloud, "POST", "/network-volumes", json={
        "name": "data", "size": 100, "dataCenter": "EU-RO-1", "type": "HIGH_PERFORMANCE"})
    assert r.status_code == 201, r.text
    made = r.json()
    assert set(made) == {"id", "name", "size", "dataCenter", "type"}
    assert made["id"].isalnum() and made["id"].islower() and len(made["id"]) == 14
    assert {k: v for k, v in made.items() if k != "id"} == {
        "name": "data", "size": 100, "dataCenter": "EU-RO-1", "type": "HIGH_PERFORMANCE"}
    # Without type: the data center's default (its first networkVolumeTypes entry).
    r = call(cloud, "POST", "/network-volumes", json={
        "name": "data", "size": 10, "dataCenter": "EU-RO-1"})
    assert r.status_code == 201 and r.json()["type"] == "STANDARD"
    other = r.json()
    assert other["id"] != made["id"]  # names need not be unique, ids are

    listed = call(cloud, "GET", "/network-volumes").json()["networkVolumes"]
    assert listed == [*given, made, other] == cloud.volumes
    r = call(cloud, "GET", f"/network-volumes/{made['id']}")
    assert r.status_code == 200 and r.json() == made

    assert call(cloud, "DELETE", f"/network-volumes/{made['id']}").status_code == 204
    assert refused(cloud, "GET", f"/network-volumes/{made['id']}", {}, 404) == \
        "network volume not found"
    r = call(cloud, "DELETE", f"/network-volumes/{made['id']}")
    assert r.status_code == 404
    assert call(cloud, "GET", "/network-volumes/nope").status_code == 404
    assert cloud.volumes == [*given, other]
    assert cloud.invalid_requests() == []


def test_a_volume_only_where_the_data_center_offers_its_type(cloud: FakeRunPodCloud) -> None:
    body = {"name": "data", "size": 50}
    assert refused(cloud, "POST", "/network-volumes", {**body, "dataCenter": "XX-1"}) == (
        "unknown data center 'XX-1': dataCenter must be an id from GET "
        "/v2/catalog/datacenters, one of 'US-KS-2', 'EU-RO-1', 'EUR-IS-1', 'US-NV-1'")
    assert refused(cloud, "POST", "/network-volumes", {**body, "dataCenter": "US-NV-1"}) == (
        "data center US-NV-1 offers no network volumes (its networkVolumeTypes is empty)")
    assert refused(cloud, "POST", "/network-volumes", {
        **body, "dataCenter": "US-KS-2", "type": "HIGH_PERFORMANCE"}) == (
        "data center US-KS-2 offers no HIGH_PERFORMANCE network volumes (its "
        "networkVolumeTypes: STANDARD)")
    # Refused, but the client followed the document.
    assert cloud.invalid_requests() == []
    assert len(cloud.volumes) == 2


@pytest.mark.parametrize(("change", "error"), [
    ({"size": 5}, "$.size: 5 is less than the minimum of 10"),
    ({"size": 4097}, "$.size: 4097 is greater than the maximum of 4096"),
    ({"bogus": 1}, "$: additional properties 'bogus' not allowed"),
    ({"type": "FAST"}, "$.type: 'FAST' is not one of ['STANDARD', 'HIGH_PERFORMANCE']"),
    ({"name": ""}, "$.name: '' should be non-empty"),
    ({"dataCenter": None}, "$: missing property 'dataCenter'"),
])
def test_a_request_that_breaks_the_schema_is_422_and_the_clients_error(
        cloud: FakeRunPodCloud, change: dict[str, Any], error: str) -> None:
    body = {"name": "data", "size": 50, "dataCenter": "US-KS-2", **change}
    body = {k: v for k, v in body.items() if v is not None}
    r = call(cloud, "POST", "/network-volumes", json=body)
    assert r.status_code == 422, r.text
    assert r.json()["errors"] == [error]
    [bad] = cloud.invalid_requests()
    assert (bad.method, bad.path, bad.status, bad.schema_errors) == (
        "POST", "/v2/network-volumes", 422, [error])
    assert len(cloud.volumes) == 2


def test_patch_is_not_served_and_its_body_still_checked(cloud: FakeRunPodCloud) -> None:
    r = call(cloud, "PATCH", "/network-volumes/vol-us", json={"size": 60})
    assert r.status_code == 501
    assert r.json()["detail"] == "PATCH /v2/network-volumes/vol-us is not supported by the fake"
    assert cloud.invalid_requests() == []
    assert call(cloud, "PATCH", "/network-volumes/vol-us", json={}).status_code == 501
    [bad] = cloud.invalid_requests()
    assert bad.schema_errors == ["$: {} should be non-empty"]
    assert call(cloud, "PUT", "/network-volumes/vol-us", json={}).status_code == 405


def test_auth_and_rate_limits_hold_for_volumes(tmp_path: Path) -> None:
    with make(tmp_path, rate_limits={"minute": 2}, network_volumes={"v": "US-KS-2"}) as cloud:
        r = call(cloud, "GET", "/network-volumes", key="rpa_wrong")
        assert r.status_code == 401 and "RateLimit" not in r.headers
        assert call(cloud, "GET", "/network-volumes").status_code == 200
        r = call(cloud, "DELETE", "/network-volumes/v")
        assert r.status_code == 204 and r.headers["RateLimit"] == '"minute";r=0;t=60'
        r = call(cloud, "POST", "/network-volumes",
                 json={"name": "x", "size": 10, "dataCenter": "US-KS-2"})
        assert r.status_code == 429 and "Retry-After" in r.headers
        assert cloud.volumes == []  # nothing was done
        assert [x.key for x in cloud.requests] == [None, "account", "account", "account"]


def pod_body(**changes: Any) -> dict[str, Any]:
    return {"name": "p", "image": "busy:1", "gpu": {"id": H100, "count": 1}, **changes}


def volume_mount(volume_id: str) -> dict[str, Any]:
    return {"network": [{"volumeId": volume_id, "path": "/workspace"}]}


def test_a_pod_key_may_not_touch_volumes(tmp_path: Path) -> None:
    for pod_key, allowed in (("own", False), ("refuse", False), ("account", True)):
        cloud = make(tmp_path / pod_key, pod_key=pod_key, network_volumes={"v": "US-KS-2"})
        cloud.hold_provisioning(".*")
        with cloud:
            r = call(cloud, "POST", "/pods", json=pod_body())
            assert r.status_code == 201, r.text
            key = cloud.pods[r.json()["id"]].api_key
            answers = [call(cloud, "GET", "/network-volumes", key=key).status_code,
                       call(cloud, "GET", "/network-volumes/v", key=key).status_code,
                       call(cloud, "POST", "/network-volumes", key=key, json={
                           "name": "x", "size": 10, "dataCenter": "US-KS-2"}).status_code,
                       call(cloud, "DELETE", "/network-volumes/v", key=key).status_code]
            assert answers == ([200, 200, 201, 204] if allowed else [403] * 4), pod_key
            assert [v["name"] for v in cloud.volumes] == (["x"] if allowed else ["v"])
        assert cloud.fake_errors == []


def test_a_pod_goes_where_its_volume_is(cloud: FakeRunPodCloud) -> None:
    assert refused(cloud, "POST", "/pods", pod_body(mounts=volume_mount("nope"))) == (
        "network volume 'nope' not found (see GET /v2/network-volumes)")
    assert refused(cloud, "POST", "/pods", pod_body(
        mounts=volume_mount("vol-eu"), dataCenterIds=["US-KS-2", "EUR-IS-1"])) == (
        "network volume 'vol-eu' is in data center EU-RO-1, which dataCenterIds "
        "(US-KS-2, EUR-IS-1) does not include")
    # A deleted volume is no longer there to mount.
    assert call(cloud, "DELETE", "/network-volumes/vol-us").status_code == 204
    assert "'vol-us' not found" in refused(cloud, "POST", "/pods",
                                           pod_body(mounts=volume_mount("vol-us")))
    assert cloud.pods == {}

    # Not the first listed nor the default data center: the volume's.
    for ids in (None, ["US-KS-2", "EU-RO-1"]):
        body = pod_body(mounts=volume_mount("vol-eu"), globalNetworking=True)
        if ids:
            body["dataCenterIds"] = ids
        r = call(cloud, "POST", "/pods", json=body)
        assert r.status_code == 201, r.text
        assert r.json()["dataCenterId"] == "EU-RO-1"
        view = cloud.pods[r.json()["id"]]
        assert view.data_center == "EU-RO-1"
        assert view.volume == cloud.root / "network-volumes" / "vol-eu" and view.volume.is_dir()
    assert cloud.invalid_requests() == []


def test_global_networking_needs_the_volumes_data_center_to_have_it(tmp_path: Path) -> None:
    with make(tmp_path, network_volumes={"vol-is": "EUR-IS-1"}) as cloud:
        assert refused(cloud, "POST", "/pods", pod_body(
            mounts=volume_mount("vol-is"), globalNetworking=True)) == (
            "network volume 'vol-is' is in data center EUR-IS-1, which does not support "
            "global networking")
        assert cloud.pods == {}


def test_a_cluster_goes_where_its_volume_is(cloud: FakeRunPodCloud) -> None:
    body = {"name": "c", "type": "TRAINING", "image": "busy:1",
            "compute": {"gpuTypeId": H100, "gpuCountPerPod": 1, "podCount": 2}}
    assert "'nope' not found" in refused(cloud, "POST", "/clusters",
                                         {**body, "mounts": volume_mount("nope")})
    assert "which dataCenterIds (US-KS-2) does not include" in refused(
        cloud, "POST", "/clusters",
        {**body, "mounts": volume_mount("vol-eu"), "dataCenterIds": ["US-KS-2"]})
    r = call(cloud, "POST", "/clusters", json={**body, "mounts": volume_mount("vol-eu")})
    assert r.status_code == 201, r.text
    assert r.json()["dataCenterId"] == "EU-RO-1"
    volumes = {p.volume for p in cloud.pods.values()}
    assert volumes == {cloud.root / "network-volumes" / "vol-eu"}
    assert cloud.invalid_requests() == []


def test_the_volumes_given_at_the_start_must_be_possible(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'v': unknown data center 'XX-1'"):
        make(tmp_path, network_volumes={"v": "XX-1"})
    with pytest.raises(ValueError, match="'v': data center US-NV-1 offers no network volumes"):
        make(tmp_path, network_volumes={"v": "US-NV-1"})
