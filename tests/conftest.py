"""Test-wide hooks and the field environments (tests/compat/fieldenv.py)."""

from __future__ import annotations

import compileall
import concurrent.futures
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.compat.fieldenv import FIELDS, ROOT, Installed, build_wheel, create

# Set by tests/compat when it runs the suite again inside an environment holding another Ray:
# there only the tests marked ray_matrix ("1") or the marker it names (ray_auth) are collected,
# so modules that need what such an environment lacks (torch, wandb) are never imported.
RAY_MATRIX_ONLY = "PODAGENT_RAY_MATRIX_ONLY"

# Every process the suite starts (podagent in each pod, the jobs, the reward servers, the field
# environments' own pytest) imports podagent and the test helpers from this tree. Where the
# machine sets PYTHONDONTWRITEBYTECODE (the CI machine does), each of those thousands of
# processes compiled them from source again: 7% of the CPU of a fault cell and a two-pod test
# on this CPU-bound suite. Here they
# share the bytecode instead (git ignores __pycache__; the image's build context leaves it out).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # once, before the lanes start their processes
        for package in ("podagent", "tests"):
            compileall.compile_dir(ROOT / package, quiet=1)


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    only = os.environ.get(RAY_MATRIX_ONLY)
    if not only:
        return None
    marker = "ray_matrix" if only == "1" else only  # the tests of another Ray: their marker
    if collection_path.name == "compat":  # the matrix is run from there: never recurse
        return True
    if collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        return f"pytest.mark.{marker}" not in collection_path.read_text(errors="replace")
    return None


@pytest.fixture(scope="session")
def field_envs(tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[dict[str, concurrent.futures.Future[Installed]]]:
    """name -> the future of its environment, all built at once (pip waits on the network):
    a test waits only for the one it reads, and a field whose install failed fails its own
    tests, with pip's output. Session-wide: the compat tests and an e2e test with a worker on
    another Ray share them."""
    root = tmp_path_factory.mktemp("field-envs")
    with concurrent.futures.ThreadPoolExecutor(len(FIELDS) + 1) as pool:
        wheel = pool.submit(build_wheel, root / "dist")
        yield {name: pool.submit(lambda field=field: create(field, root, wheel.result()))
               for name, field in FIELDS.items()}


NEEDS_FIELDS = pytest.StashKey[bool]()
NEEDS_IMAGES = pytest.StashKey[bool]()
PREBUILT = pytest.StashKey[bool]()
CONTAINER_TESTS = Path(__file__).parent / "container"

# The README's test command runs three lanes at once (pytest-xdist, `-n 3`) on two cores: a
# multi-pod test alone keeps them busy under half of its time (its pods wait on timeouts,
# graces, a job's steps), so a third lane fills what two left idle. Each group below runs
# whole, in order, on one lane (`pytest_xdist_make_scheduler`); a lane nearly done takes the
# next group. Pods in network namespaces (each e2e module its own group, the campaign) and
# containers never meet another test's processes (each network is locked and named apart);
# what starts Ray or looks for Ray processes in this machine's own namespace (unit,
# integration, compat, and an e2e test beside a field environment's Ray) is one group, one
# test at a time, as without lanes. The reward server's and the Ray-less engine's unit tests
# start neither Ray nor anything that looks like it (podagent's foreign-Ray check would see
# it): a group of their own, so that the host group does not end the run alone.
HOST = "host"
LANES = (("tests/e2e/", "pods"), ("tests/container/", "pods"), ("tests/faults/", "faults"),
         ("tests/unit/rewards/", "no-ray"), ("tests/unit/gang/", "no-ray"))
HOST_MODULES = ("tests/e2e/test_ray_mismatch.py",)  # they use the field environments
E2E = "tests/e2e/"


def lane(nodeid: str) -> str:
    """Which background build a group's first test starts (_built_from_the_start)."""
    if nodeid.startswith(HOST_MODULES):
        return HOST
    return next((name for prefix, name in LANES if nodeid.startswith(prefix)), HOST)


def group(nodeid: str) -> str:
    """What runs whole on one lane: an e2e module, else the test's lane."""
    named = lane(nodeid)
    return nodeid.split("::")[0] if named == "pods" and nodeid.startswith(E2E) else named


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook; a field environment has no xdist
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class Lanes(LoadScopeScheduling):
        """Whole groups to a lane (the largest first); a lane nearly done takes the next."""

        def _split_scope(self, nodeid: str) -> str:
            return group(nodeid)

    return Lanes(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    config.stash[NEEDS_FIELDS] = any("field_envs" in item.fixturenames for item in items)
    config.stash[NEEDS_IMAGES] = any(CONTAINER_TESTS in item.path.parents for item in items)
    strays = [item.nodeid for item in items
              if "field_envs" in item.fixturenames and lane(item.nodeid) != HOST]
    if strays:
        raise pytest.UsageError(f"{strays[0]} uses the field environments: add its module to "
                                f"HOST_MODULES in tests/conftest.py (its lane builds them)")


@pytest.fixture(autouse=True)
def _built_from_the_start(request: pytest.FixtureRequest) -> None:
    """Installing the field environments and making the container suite's images wait mostly
    on the network and the disk: when selected tests need them, they are started from the
    session's first test on (tests/compat and tests/container run late), so that the wait
    overlaps the other tests instead of adding to them. In a lane (xdist), each is started by
    the lane whose first group needs it: the field environments by the host lane, the images
    by every lane whose first group holds pods (one makes them, the others wait for it); any
    other need builds them when it comes."""
    config = request.config
    if config.stash.get(PREBUILT, False):
        return
    config.stash[PREBUILT] = True
    first = lane(request.node.nodeid) if os.environ.get("PYTEST_XDIST_WORKER") else None
    if config.stash.get(NEEDS_FIELDS, False) and first in (None, HOST):
        request.getfixturevalue("field_envs")
    if config.stash.get(NEEDS_IMAGES, False) and first in (None, "pods"):
        request.getfixturevalue("container_images")


@pytest.fixture(scope="session")
def container_images() -> Iterator[concurrent.futures.Future[tuple[Any, list[Any]]]]:
    """The container suite's images (docker/images.py: the root filesystem, the bases,
    podagent's image on each), made on a thread of their own: on a fresh machine that is
    debootstrap, apt and pip for minutes, mostly waiting on the network and the disk."""
    def make() -> tuple[Any, list[Any]]:
        from tests.container import engine
        from tests.harness.pods import file_lock

        # Every lane whose first group holds pods starts this: the first makes the images,
        # the others wait for it and find them made (a base is made once per hash).
        with engine.engine() as running, file_lock(engine.STATE_DIR / "images.lock"):
            return engine.images.ensure_all(docker=running.docker)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        yield pool.submit(make)
