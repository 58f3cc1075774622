"""Field environments, built once per session and all at once (pip waits on the network)."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator

import pytest

from tests.compat.fieldenv import FIELDS, Installed, build_wheel, create


@pytest.fixture(scope="session")
def field_envs(tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[dict[str, concurrent.futures.Future[Installed]]]:
    """name -> the future of its environment: a test waits only for the one it reads, and a
    field whose install failed fails its own tests, with pip's output."""
    root = tmp_path_factory.mktemp("field-envs")
    wheel = build_wheel(root / "dist")
    with concurrent.futures.ThreadPoolExecutor(len(FIELDS)) as pool:
        futures = {name: pool.submit(create, field, root, wheel)
                   for name, field in FIELDS.items()}
        yield futures
