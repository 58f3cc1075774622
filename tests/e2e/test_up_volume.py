"""A run of several pods gets a network volume of its own by default: `up` creates it (recorded
first, as every create) in a data center that offers network volumes, Global Networking and
the GPU type, mounts it at /workspace on every pod (placed with it), and keeps it after the
run, saying its size, its price a month and how to delete it; `ls` lists it and `down RUN
--volume` deletes it (asked, or --yes). A run none of whose pods ever ran leaves no volume."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.harness.laptop import (
    HEAD_IMAGE,
    billing,
    creates,
    run_cli,
    run_up,
    up_argv,
)


@pytest.fixture
def cloud(runpod_cloud: Any) -> Any:
    return runpod_cloud(pod_key="own")


def _volume_creates(cloud: Any) -> list:
    return [r for r in cloud.requests if r.method == "POST" and r.path == "/v2/network-volumes"]


def test_a_run_keeps_its_results_on_a_network_volume_of_its_own(cloud, tmp_path):
    (tmp_path / "go").touch()
    argv = up_argv("kept", 2, "-e", f"POD_HEAD_GO={tmp_path / 'go'}", image=HEAD_IMAGE,
                   shared=True)
    result = run_up(cloud, tmp_path, argv)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    [asked] = _volume_creates(cloud)
    assert asked.body["name"] == "podagent-kept-volume" and asked.body["size"] == 100, asked.body
    [volume] = cloud.volumes
    where = volume["dataCenter"]
    assert asked.body["dataCenter"] == where
    pods = creates(cloud)
    assert len(pods) == 2
    for made in pods:  # every pod mounts it, and goes where it is
        assert made.body["mounts"] == {"network": [{"volumeId": volume["id"],
                                                    "path": "/workspace"}]}
        assert made.body["dataCenterIds"] == [where]
    assert f"kept: network volume podagent-kept-volume ({volume['id']}), 100 GB in {where}, " \
           f"about $7.00/month" in result.stdout, result.stdout[-3000:]
    assert "`podagent down kept --volume` deletes it" in result.stdout
    assert billing(cloud, "kept") == 0
    record = json.loads((tmp_path / "state" / "podagent" / "runs" / "kept.json").read_text())
    assert [r["id"] for r in record["resources"] if r["kind"] == "volume"] == [volume["id"]]
    listing = run_cli(cloud, tmp_path, "ls")
    assert "podagent-kept-volume" in listing.stdout and "$7.00" in listing.stdout, listing.stdout
    # `down` without --volume leaves it, and says so.
    plain = run_cli(cloud, tmp_path, "down", "kept")
    assert plain.returncode == 0, plain.stdout + plain.stderr
    kept = f"kept: network volume podagent-kept-volume ({volume['id']}"
    assert kept in plain.stdout, plain.stdout
    # No terminal and no --yes: the pods are seen to (none here), the deletion refused in one
    # line, nothing deleted.
    asked_only = run_cli(cloud, tmp_path, "down", "kept", "--volume")
    assert asked_only.returncode == 2, asked_only.stdout + asked_only.stderr
    assert "add --yes" in asked_only.stderr and "Traceback" not in asked_only.stderr
    assert "nothing of it at RunPod" in asked_only.stdout, asked_only.stdout
    assert len(cloud.volumes) == 1
    gone = run_cli(cloud, tmp_path, "down", "kept", "--volume", "--yes")
    assert gone.returncode == 0, gone.stdout + gone.stderr
    assert f"deleted network volume podagent-kept-volume ({volume['id']}" in gone.stdout
    assert cloud.volumes == []
    assert cloud.invalid_requests() == []


def test_a_run_none_of_whose_pods_ran_leaves_no_volume(cloud, tmp_path):
    """The image cannot be pulled: the pods are in ERROR before they ran (exit 21), and the
    volume created for them, which nothing was ever written to, is deleted."""
    argv = up_argv("nopull", 2, image="ghcr.io/podagent/missing:1", shared=True)
    result = run_up(cloud, tmp_path, argv)
    assert result.returncode == 21, (result.stdout + result.stderr)[-4000:]
    assert len(_volume_creates(cloud)) == 1
    assert "no pod ran, so it held nothing" in result.stdout, result.stdout[-3000:]
    assert cloud.volumes == [] and billing(cloud, "nopull") == 0


def test_an_opt_out_gets_no_volume_and_is_told(cloud, tmp_path):
    (tmp_path / "go").touch()
    argv = up_argv("bare", 2, "-e", f"POD_HEAD_GO={tmp_path / 'go'}", image=HEAD_IMAGE)
    result = run_up(cloud, tmp_path, argv)  # up_argv opts out (--no-shared-volume)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "WARNING: no network volume" in result.stdout
    assert _volume_creates(cloud) == [] and cloud.volumes == []
    assert all("mounts" not in r.body for r in creates(cloud))
