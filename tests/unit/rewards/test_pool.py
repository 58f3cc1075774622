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


def _two_homes(workers: int) -> tuple[str, str]:
    """Two golds whose workers differ (by the pool's own hash, in this process)."""
    golds = [f"${n}$" for n in range(64)]
    first = golds[0]
    return first, next(g for g in golds if hash(g) % workers != hash(first) % workers)


def test_one_affinity_goes_to_one_worker_and_others_spread(three):
    a, b = _two_homes(three.workers)

    async def main() -> tuple[set[int], set[int], set[int]]:
        # Taken in turn, one at a time: with no affinity each would go to the same idle worker.
        pids: dict[str, list[int]] = {a: [], b: []}
        for gold in (a, b) * 3:
            pids[gold].append((await three.run(_pid_after, (0.0,), affinity=gold)).value)
        # No affinity, all at once: the least busy worker each time, so every worker.
        spread = await asyncio.gather(*(three.run(_pid_after, (0.3,)) for _ in range(3)))
        return set(pids[a]), set(pids[b]), {r.value for r in spread}

    on_a, on_b, spread = asyncio.run(main())
    assert len(on_a) == 1 and len(on_b) == 1
    assert on_a != on_b
    assert len(spread) == 3


def test_a_busy_home_worker_spills_to_idle_ones_and_takes_the_rest(three):
    """While a worker is idle, a task whose home is busy goes there (what the home runs may be
    a hostile item just begun); once every worker is busy, the home takes up to
    AFFINITY_SLACK more than the least busy."""
    async def main() -> list[int]:
        runs = [three.run(_pid_after, (0.5,), affinity="$x^2$")
                for _ in range(three.workers + pool_module.AFFINITY_SLACK)]
        return [r.value for r in await asyncio.gather(*runs)]

    pids = asyncio.run(main())
    home = pids[0]
    assert len(set(pids[: three.workers])) == three.workers  # the idle ones first
    assert pids[three.workers:] == [home] * pool_module.AFFINITY_SLACK
    assert three.running == 0


def test_no_task_goes_to_a_worker_stuck_on_one(three):
    """A worker whose task has run past STUCK_AFTER (a hostile item, until the item timeout)
    gets nothing more while another worker is free, even its own affinity's tasks."""
    async def main() -> tuple[int, set[int]]:
        stuck = asyncio.ensure_future(three.run(_pid_after, (3.0,), affinity="$y$"))
        await asyncio.sleep(pool_module.STUCK_AFTER + 0.2)  # the policy's own threshold
        others = [await three.run(_pid_after, (0.0,), affinity="$y$") for _ in range(4)]
        return (await stuck).value, {r.value for r in others}

    stuck_pid, others = asyncio.run(main())
    assert stuck_pid not in others
    assert len(others) == 1  # the affinity still holds among the free workers


def test_closing_ends_every_task_given_running_or_queued():
    """Stopping the pool (the server is stopping) gives every task an outcome at once, those
    still queued behind a running one too: nothing waits for an item that was abandoned."""
    p = VerifierPool(workers=2, item_timeout=30.0)

    async def main() -> list[str]:
        await asyncio.gather(*(p.run(_pid_after, (0.05,), affinity="$1$") for _ in range(8)))
        tasks = [asyncio.ensure_future(p.run(_pid_after, (30.0,))) for _ in range(5)]
        while p.running < 5:  # given to the workers (synchronously, at their first step)
            await asyncio.sleep(0)
        await asyncio.get_running_loop().run_in_executor(None, p.close)
        done, pending = await asyncio.wait(tasks, timeout=20)
        assert not pending
        return [t.result().status for t in done]

    assert asyncio.run(main()) == ["crashed"] * 5
    assert p.running == 0
