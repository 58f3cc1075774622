"""Fixtures for end-to-end tests on fake pods (see tests/harness/pods.py)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.runpod_cloud import FakeRunPodCloud
from tests.harness import laptop
from tests.harness.agents import Agent
from tests.harness.pods import DnsServer, Pod, PodNetwork, cleanup_stale


@pytest.fixture(scope="session")
def _e2e_host() -> None:
    # CI runs as root: a missing prerequisite is a broken setup, so fail, never skip.
    problems = []
    if os.geteuid() != 0:
        problems.append("must run as root (network namespaces, bridges)")
    if shutil.which("ip") is None:
        problems.append("iproute2 `ip` not found on PATH")
    if problems:
        pytest.fail("e2e tests cannot run: " + "; ".join(problems), pytrace=False)
    cleanup_stale()  # leftovers of a crashed earlier run


@pytest.fixture
def pod_network(_e2e_host: None) -> Iterator[PodNetwork]:
    """A fresh private network (bridge + host address); closed even if the test fails."""
    with PodNetwork() as net:
        yield net


@pytest.fixture
def dns_server(pod_network: PodNetwork) -> Iterator[DnsServer]:
    """DNS server for runpod.internal on the bridge's host address, free port."""
    with DnsServer(address=pod_network.host_ip, port=0) as server:
        yield server


MakePod = Callable[..., Pod]


@pytest.fixture
def make_pod(pod_network: PodNetwork, dns_server: DnsServer) -> MakePod:
    """make_pod(name, ifname="podnet1", register=False, pod_id=None) -> Pod.

    register=True publishes <pod_id>.runpod.internal -> pod.ip right away;
    it is off by default because some tests want the name to appear later.
    """

    def make(
        name: str, ifname: str = "podnet1", register: bool = False, pod_id: str | None = None
    ) -> Pod:
        pod = pod_network.add_pod(name, ifname=ifname, pod_id=pod_id)
        if register:
            dns_server.set_record(pod.dns_name, pod.ip)
        return pod

    return make


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Every test under tests/e2e gets the `e2e` marker (select with -m e2e).
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture
def agents() -> Iterator[list[Agent]]:
    """podagent processes a test started; each is killed (if still running) and closed."""
    started: list[Agent] = []
    yield started
    for agent in started:
        agent.close()


@pytest.fixture
def runpod_cloud(pod_network: PodNetwork, dns_server: DnsServer,
                 tmp_path: Path) -> Iterator[Callable[..., FakeRunPodCloud]]:
    """runpod_cloud(**arguments of FakeRunPodCloud) -> a started fake RunPod for `podagent
    up`'s tests: the laptop's key, podagent's images (tests/harness/laptop.py). One per test;
    at its end every request it saw must have followed RunPod's document."""
    made: list[FakeRunPodCloud] = []

    def make(**kw: Any) -> FakeRunPodCloud:
        assert not made, "one fake RunPod per test (its pods' names would collide)"
        kw = {"api_key": laptop.KEY, "images": laptop.IMAGES, "stop_grace": 2.0, **kw}
        made.append(FakeRunPodCloud(pod_network, dns_server, tmp_path / "cloud", **kw)
                    .__enter__())
        return made[-1]

    yield make
    for fake in made:
        fake.__exit__(None, None, None)
        assert fake.invalid_requests() == []
