"""Fixtures for the container suite: the Docker engine (installed and started when missing,
stopped when this run started it), the bases and podagent's image built on each (cached), and
a fresh pod network per test."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.container import engine as engine_module
from tests.container.engine import images
from tests.container.pods import PodContainer, PodNet, Session, pod_net

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Every test under tests/container gets the `container` marker (select with -m container).
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.container)


@pytest.fixture(scope="package")
def engine() -> Iterator[engine_module.Engine]:
    try:
        with engine_module.engine() as running:
            yield running
    except engine_module.EngineUnavailable as exc:
        pytest.skip(f"Docker cannot run on this machine: {exc}")


@pytest.fixture(scope="package")
def built(engine: engine_module.Engine, container_images) -> dict[str, images.Built]:
    """podagent's image on every base (base name -> Built); bases come from the cache. They
    are made from the session's start on (tests/conftest.py), so this mostly waits for that."""
    started = time.monotonic()
    rootfs, made = container_images.result()

    def took(m: images.Made) -> str:
        return "cached" if m.cached else f"made in {m.seconds:.0f} s"

    print(f"\nimages ready in {time.monotonic() - started:.1f} s (root filesystem "
          f"{took(rootfs)}): " + "; ".join(
              f"{b.image.tag} ({b.image.seconds:.0f} s) adds {images.mib(b.added)} to "
              f"{b.base_image.tag} ({took(b.base_image)})" for b in made))
    return {b.base.name: b for b in made}


@pytest.fixture(scope="package")
def session(engine: engine_module.Engine) -> Iterator[Session]:
    s = Session(engine.docker)
    s.cleanup_stale()  # leftovers of a crashed earlier run
    yield s
    s.close()


@pytest.fixture
def net(session: Session) -> Iterator[PodNet]:
    with pod_net(session) as network:
        yield network


MakePod = Callable[..., PodContainer]


@pytest.fixture
def pods(net: PodNet) -> Iterator[list[PodContainer]]:
    """Pods a test made; each container and its volume is removed afterwards."""
    made: list[PodContainer] = []
    yield made
    for pod in made:
        pod.remove()
        net.docker("volume", "rm", "--force", pod.volume, check=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    # A failed test shows every pod's output: the containers are still there until teardown.
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed:
        for pod in item.funcargs.get("pods") or []:
            report.sections.append((f"{pod.role_name} ({pod.pod_id}) output", pod.logs[-5000:]))
