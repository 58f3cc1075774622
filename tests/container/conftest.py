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
def built(engine: engine_module.Engine) -> dict[str, images.Built]:
    """podagent's image on every base (base name -> Built); bases come from the cache."""
    started = time.monotonic()
    _, made = images.ensure_all(docker=engine.docker)
    print(f"\nimages ready in {time.monotonic() - started:.1f} s: "
          + "; ".join(f"{b.image.tag} adds {images.mib(b.added)} to {b.base_image.tag}"
                      for b in made))
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
