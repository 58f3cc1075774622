"""The dataset audit stops at its deadline whatever the dataset's size: chunks start one per
worker while time is left, and one still running then is given up, unchecked."""

from __future__ import annotations

import asyncio
import time

from podagent.rewards import audit


class Counted:
    """The real pool, counting the chunks given to it."""

    def __init__(self, pool):
        self.pool, self.workers, self.chunks = pool, pool.workers, 0

    async def run(self, *args, **kwargs):
        self.chunks += 1
        return await self.pool.run(*args, **kwargs)


def test_the_audit_of_a_large_dataset_ends_at_its_deadline(pool):
    answers = [f"\\frac{{{i}}}{{{i + 1}}} + x^{{{i % 7}}}" for i in range(20_000)]
    counted = Counted(pool)
    bad, checked = asyncio.run(audit._unparsed_by_seed(answers, counted,
                                                       time.monotonic() + 1.0))
    chunks = -(-len(answers) // audit.CHUNK)
    # Far from all of them in a second on one worker, and the rest never given to the pool
    # (which would check them all, the server's start waiting, whatever the deadline).
    assert 0 < checked < len(answers), checked
    assert counted.chunks < chunks / 4, (counted.chunks, chunks)
    assert checked % audit.CHUNK == 0  # whole chunks: none counted half done
    assert bad == []


def test_a_small_dataset_is_audited_whole(pool):
    answers = ["7", "$1\n2$", "\\frac{1}{2}", "$$", "x^2"]
    bad, checked = asyncio.run(audit._unparsed_by_seed(answers, pool,
                                                       time.monotonic() + 60))
    assert checked == len(answers)
    assert bad == ["$1\n2$", "$$"]  # as the head's audit finds (test_head_reward)
