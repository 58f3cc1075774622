"""The fault campaign's cells: pods as network namespaces, as in tests/e2e (needs root and
iproute2 or pyroute2)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.harness import campaign
from tests.harness.pods import cleanup_stale


@pytest.fixture(scope="session")
def campaign_host() -> None:
    # CI runs as root: a missing prerequisite is a broken setup, so fail, never skip.
    if os.geteuid() != 0:
        pytest.fail("the fault campaign needs root (network namespaces, tmpfs)", pytrace=False)
    cleanup_stale(campaign.CAMPAIGN_PREFIX)  # leftovers of a crashed earlier run


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.faults)
