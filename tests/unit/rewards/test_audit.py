"""The dataset audit stops at its deadline whatever the dataset's size: chunks start one per
worker while time is left, and one still running then is given up, unchecked."""

from __future__ import annotations

import asyncio
import time

from podagent.rewards import audit


class Counted:
    """The real pool, noting when each chunk was given to it."""

    def __init__(self, pool):
        self.pool, self.workers, self.starts = pool, pool.workers, []

    async def run(self, *args, **kwargs):
        self.starts.append(time.monotonic())
        return await self.pool.run(*args, **kwargs)


def test_the_audit_of_a_large_dataset_ends_at_its_deadline(pool):
    answers = [f"\\frac{{{i}}}{{{i + 1}}} + x^{{{i % 7}}}" for i in range(20_000)]
    counted = Counted(pool)
    deadline = time.monotonic() + 1.0
    bad, checked = asyncio.run(audit._unparsed_by_seed(answers, counted, deadline))
    ended = time.monotonic()
    chunks = -(-len(answers) // audit.CHUNK)
    # A chunk of 32 golds takes half a second on an idle machine and past the second on a
    # loaded one, so how many are done by the deadline is the machine's pace (none at all is
    # a right answer: the audit then says it checked 0). What the deadline decides is not:
    # the audit ran until it, stopped then, and said how far it got.
    assert checked < len(answers), checked
    assert ended >= deadline  # nothing but the deadline ended it
    # It spent its time checking (the first chunk went to the pool at once), and the rest
    # never reached the pool (which would check them all, the server's start waiting)...
    assert counted.starts and counted.starts[0] < deadline, (counted.starts, deadline)
    assert len(counted.starts) < chunks / 4, (len(counted.starts), chunks)
    # ...nor did it wait for them: the whole dataset is hundreds of chunks, minutes of work.
    assert ended - deadline < 30, ended - deadline
    # Whole chunks, each one the pool finished: only the one a worker was still checking at
    # the deadline was given up, uncounted.
    assert checked % audit.CHUNK == 0
    assert len(counted.starts) - pool.workers <= checked // audit.CHUNK <= len(counted.starts)
    assert bad == []


def test_a_small_dataset_is_audited_whole(pool):
    answers = ["7", "$1\n2$", "\\frac{1}{2}", "$$", "x^2"]
    bad, checked = asyncio.run(audit._unparsed_by_seed(answers, pool,
                                                       time.monotonic() + 60))
    assert checked == len(answers)
    assert bad == ["$1\n2$", "$$"]  # as the head's audit finds (test_head_reward)
