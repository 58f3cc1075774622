"""Where a run's network volume ends, against the fake RunPod's API in this process (its pods
never get a machine: their statuses are set by the test, as RunPod would change them): deleted
only when this `up` made it, no pod of the run ever ran and every pod is gone; kept when pods
ran (a run created again after its head was lost included), when the pods are kept, and placed
for a cluster as for pods."""

from __future__ import annotations

import io
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from podagent.errors import Interrupted, PodsNotReady
from podagent.launch import spec as specs
from podagent.launch.create import check
from podagent.launch.interrupts import SIGNALS, Interrupts
from podagent.launch.up import Up
from podagent.launch.view import PlainView
from podagent.platform.runpod_api import Client
from tests.fakes.runpod_cloud import FakeRunPodCloud
from tests.harness.pods import wait_for

KEY = "rpa_" + "VolumeKey" * 4
H100 = "NVIDIA H100 80GB HBM3"
IMAGE = "busy:1"


@pytest.fixture
def cloud(tmp_path: Path) -> Iterator[FakeRunPodCloud]:
    # No pod gets a machine (provisioning held): the network and DNS are never used.
    net = SimpleNamespace(subnet="10.99.0.0/24")
    dns = SimpleNamespace(address="127.0.0.1", port=53)
    with FakeRunPodCloud(net, dns, tmp_path / "cloud", api_key=KEY,  # type: ignore[arg-type]
                         images={IMAGE: [sys.executable, "-c", "pass"]},
                         rate_limits={"minute": 1_000_000}, stop_grace=0.5) as fake:
        fake.hold_provisioning(".*")
        yield fake
        assert fake.invalid_requests() == []


def _spec(cloud: FakeRunPodCloud, tmp_path: Path, **over: Any) -> specs.UpSpec:
    args: dict[str, Any] = dict(
        run="demo", gpu_type=H100, gpus_per_pod=1, pods=2, image=IMAGE, template=None,
        cluster=False, cloud="SECURE", data_centers=(), volume_gb=None, network_volume=None,
        disk_gb=None, env=(), secrets=(), job=(), keep=False, timeout=900.0,
        api_url=cloud.url, state_dir=tmp_path / "state", detach=False, registry_auth=None,
        api_timeout=10.0)
    args.update(over)
    return specs.build(**args)


def _client(cloud: FakeRunPodCloud) -> Client:
    return Client(KEY, cloud.url, timeout=10.0)


def _set(cloud: FakeRunPodCloud, name: str, status: str) -> None:
    """RunPod changes a pod's status (a pod placed and running, a host that is lost)."""
    for pod in cloud._pods.values():  # the fake's own state: what RunPod would do
        if pod.name.startswith(name) and pod.status != "TERMINATED":
            with cloud._lock:
                pod.set_status(status)


def _live(cloud: FakeRunPodCloud) -> int:
    return len([p for p in cloud.pods.values() if p.status != "TERMINATED"])


def test_a_cluster_gets_its_volume_where_volumes_are_offered(cloud, tmp_path):
    spec = _spec(cloud, tmp_path, cluster=True)
    assert spec.shared_volume_gb == specs.SHARED_DEFAULT
    checked = check(spec, _client(cloud), False, lambda line: None)
    dc = checked.volume_data_center
    assert dc and checked.placement.data_centers == (dc,)


def test_a_run_created_again_after_its_head_was_lost_keeps_the_volume(cloud, tmp_path):
    """Both pods ran (the job wrote to the volume), the head is lost, the run is created
    again and its new pods never start: the run ends (21) and the volume is kept."""
    up = Up(_spec(cloud, tmp_path, timeout=6.0), _client(cloud),
            PlainView(io.StringIO()))

    def rund() -> None:
        wait_for(lambda: _live(cloud) == 2, timeout=30, what="the pods")
        _set(cloud, "podagent-demo", "RUNNING")
        wait_for(lambda: len(up.ran) == 2, timeout=30, what="up to see them run")
        _set(cloud, "podagent-demo-head", "TERMINATED")

    threading.Thread(target=rund, daemon=True).start()
    with pytest.raises(PodsNotReady):
        up.run()
    assert len(up.record.replacements) == 1  # type: ignore[union-attr]
    assert [v["name"] for v in cloud.volumes] == ["podagent-demo-volume"]
    assert _live(cloud) == 0


def test_pods_kept_by_keep_keep_their_volume(cloud, tmp_path):
    """--keep, Ctrl-C while the pods start: they are left as they are, and so is the volume
    they mount."""
    before = {signum: signal.getsignal(signum) for signum in SIGNALS}
    try:
        up = Up(_spec(cloud, tmp_path, keep=True), _client(cloud), PlainView(io.StringIO()),
                Interrupts().install())

        def interrupt() -> None:
            wait_for(lambda: _live(cloud) == 2, timeout=30, what="the pods")
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGINT)

        threading.Thread(target=interrupt, daemon=True).start()
        with pytest.raises(Interrupted):
            up.run()
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
    assert len(cloud.volumes) == 1 and _live(cloud) == 2


def test_a_run_none_of_whose_pods_ran_leaves_no_volume(cloud, tmp_path):
    up = Up(_spec(cloud, tmp_path, timeout=3.0), _client(cloud), PlainView(io.StringIO()))
    with pytest.raises(PodsNotReady):
        up.run()
    assert cloud.volumes == [] and _live(cloud) == 0


def test_a_cluster_and_its_volume_are_two_resources_of_the_record(cloud, tmp_path):
    """An Instant Cluster run makes its volume, then its cluster (never one record entry for
    both); its pods never start: 21, the cluster deleted, the volume too (nothing ran)."""
    up = Up(_spec(cloud, tmp_path, cluster=True, timeout=3.0), _client(cloud),
            PlainView(io.StringIO()))
    with pytest.raises(PodsNotReady):
        up.run()
    kinds = sorted((r.kind, r.name, bool(r.id)) for r in up.record.resources)  # type: ignore
    assert kinds == [("cluster", "podagent-demo", True),
                     ("volume", "podagent-demo-volume", True)], kinds
    [body] = [r.body for r in cloud.requests if r.method == "POST" and r.path == "/v2/clusters"]
    assert body["mounts"]["network"][0]["volumeId"] == up.record.ids("volume")[0]  # type: ignore
    assert cloud.volumes == [] and _live(cloud) == 0
