"""The verifier pool's routing: tasks that name the same affinity (a gold) go to one worker,
which keeps what it parsed, until that worker is busier than the others by more than the
slack; then they go to the least busy. Real worker processes."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from podagent.rewards import pool as pool_module
from podagent.rewards.pool import VerifierPool


def _pid_after(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


@pytest.fixture(scope="module")
def three():
    p = VerifierPool(workers=3, item_timeout=30.0)
    yield p
    p.close()


def test_one_affinity_goes_to_one_worker_and_others_spread(three):
    async def main() -> tuple[set[int], set[int]]:
        same = [await three.run(_pid_after, (0.0,), affinity="$\\frac{1}{2}$") for _ in range(6)]
        # No affinity, all at once: the least busy worker each time, so every worker.
        spread = await asyncio.gather(*(three.run(_pid_after, (0.3,)) for _ in range(3)))
        return {r.value for r in same}, {r.value for r in spread}

    same, spread = asyncio.run(main())
    assert len(same) == 1
    assert len(spread) == 3


def test_a_busy_home_worker_spills_to_the_least_busy(three):
    async def main() -> list[int]:
        runs = [three.run(_pid_after, (0.5,), affinity="$x^2$")
                for _ in range(pool_module.AFFINITY_SLACK + 3)]
        return [r.value for r in await asyncio.gather(*runs)]

    pids = asyncio.run(main())
    home = pids[0]
    # The home worker takes tasks until it has AFFINITY_SLACK more than the least busy one.
    assert pids[: pool_module.AFFINITY_SLACK + 1] == [home] * (pool_module.AFFINITY_SLACK + 1)
    assert pids[pool_module.AFFINITY_SLACK + 1] != home
    assert three.running == 0
