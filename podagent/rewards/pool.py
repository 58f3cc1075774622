"""Verification off the event loop: a pebble process pool with a time limit on every task.

sympy can run for minutes, or forever, on a hostile answer (`9^{9^{9^{9}}}`), and it does so
in C where no signal reaches it; so can a regular expression on a hostile response. A thread
cannot be stopped and `concurrent.futures` cannot kill a worker; pebble kills the worker
running a task past its limit and starts a new one, so one bad item costs one item's limit and
nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import resource
import signal
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any

import pebble

from podagent.config.names import REWARD_PRELOAD
from podagent.errors import PodagentError
from podagent.rewards import verify
from podagent.rewards.verify import short

log = logging.getLogger("podagent.rewards")

PRELOAD_ENV = REWARD_PRELOAD
# A task goes to its affinity's worker unless that worker has more than this many tasks beyond
# the least busy one's: a worker's caches are worth a short wait, not a queue.
AFFINITY_SLACK = 2
# A worker whose current task has run this long is stuck on it (a hostile item runs until the
# item timeout): no task goes there while another worker is not, affinity or not.
STUCK_AFTER = 0.5
# ...and a task goes to its affinity's worker only while that worker's current task has run
# less than this: one that has run longer may be a hostile item, and a task queued behind it
# would wait for it where another worker would not.
AFFINITY_WAIT = 0.05
_STUCK_LOAD = 1 << 20


class WorkersFailed(PodagentError):
    """The verifier processes could not start or could not verify a known-good pair."""


@dataclass(frozen=True)
class Outcome:
    correct: bool
    status: str  # "ok", "timeout" or "crashed"
    gold_parses: int = 0


@dataclass(frozen=True)
class Ran:
    """A task's result, or why there is none."""

    status: str  # "ok", "timeout" or "crashed"
    value: Any = None


def _init_worker(memory: int | None = None) -> None:
    # Ctrl-C in a terminal reaches the whole process group: only the server decides to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if memory:  # past it an allocation fails (MemoryError): that item's failure
        resource.setrlimit(resource.RLIMIT_DATA, (memory, memory))
    from podagent.rewards import openrlhf_m_verify

    verify.worker_warm()  # no-ops in a worker forked from the warm forkserver (`warm`)
    openrlhf_m_verify.worker_warm()


class VerifierPool:
    """Scores items in worker processes, each task under a time limit (and, where set, an
    item's memory limit); a worker past either is killed and the item scores the default.

    Each worker has a queue of its own (a pebble pool of one process), so that a task can go
    to a chosen worker: tasks with the same `affinity` (a gold answer) go to the same worker
    while it is not much busier than the least busy one. A worker keeps what it parsed (golds,
    answers, verdicts) and math-verify parses a gold in tens of milliseconds: with a shared
    queue, a prompt's samples sent one per request met a different worker each and every
    worker parsed every gold (on 16 workers, 0.3 gold parses per item; the CPU per item was
    more than twice that of 2 workers)."""

    def __init__(self, workers: int, item_timeout: float, preload: str | None = None,
                 item_memory: int | None = None):
        """`preload`: a reward rule's source (`func`) the forkserver loads once, so that every
        worker, replacements included, starts with it loaded."""
        self.workers, self.item_timeout = workers, item_timeout
        if preload:  # read by `warm` in the forkserver, which starts with the first pool
            os.environ[PRELOAD_ENV] = preload
        # forkserver, not fork: the server has threads (pebble's, the event loop's executor)
        # and forking a threaded process can copy a held lock into the child. The preload
        # makes each new worker (also every replacement after a timeout) a cheap fork of a
        # process that has already imported and warmed sympy and math-verify.
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["podagent.rewards.warm"])
        self._pools = [pebble.ProcessPool(max_workers=1, initializer=_init_worker,
                                          initargs=(item_memory,), context=context)
                       for _ in range(workers)]
        # Each worker's tasks given and not yet done: token -> (when it was given, its future).
        self._given: list[dict[int, tuple[float, Future[Any]]]] = [{} for _ in range(workers)]
        self._tokens = itertools.count()
        self._freed = [0.0] * workers  # when each worker's last task ended
        self._closing = False

    @property
    def running(self) -> int:
        """Tasks scheduled and not yet done."""
        return sum(len(given) for given in self._given)

    def _running_for(self, index: int, now: float) -> float:
        """How long the worker's current task has run: a worker runs its tasks in the order
        given, so it began when the oldest was given or when the one before it ended."""
        given = self._given[index]
        if not given:
            return 0.0
        return now - max(min(t for t, _ in given.values()), self._freed[index])

    def _load(self, index: int, now: float) -> int:
        stuck = self._running_for(index, now) > STUCK_AFTER
        return len(self._given[index]) + (_STUCK_LOAD if stuck else 0)

    def _pick(self, affinity: str | None) -> int:
        """The worker for a task: the least busy, or the affinity's own while it has at most
        AFFINITY_SLACK more tasks than that one and its current task is young (AFFINITY_WAIT);
        a stuck worker counts as the busiest."""
        now = time.monotonic()
        loads = [self._load(index, now) for index in range(len(self._given))]
        least = min(range(len(loads)), key=loads.__getitem__)
        if affinity is None:
            return least
        home = hash(affinity) % len(loads)  # stable within this process, which is enough
        if loads[home] == 0:
            return home
        # A busy home only while no worker is idle: the task it has now may be a hostile item
        # that has only just begun.
        young = self._running_for(home, now) <= AFFINITY_WAIT
        return home if (loads[least] > 0 and young
                        and loads[home] <= loads[least] + AFFINITY_SLACK) else least

    def chunk_size(self, items: int, most: int) -> int:
        """Items per task for `items` new ones: spread over the idle workers, but when every
        worker is busy they would only queue, and fewer, bigger tasks cost less to send."""
        idle = max(1, self.workers - self.running)
        return max(1, min(most, -(-items // idle)))

    async def warm(self, probe: Callable[[], Any], timeout: float = 300.0) -> None:
        """Waits until every worker answers `probe` (a coroutine factory returning True when
        the answer is right); raises WorkersFailed if they cannot.

        A server whose workers cannot verify would score every item 0 and look healthy."""
        try:
            answers = await asyncio.wait_for(
                asyncio.gather(*(probe() for _ in range(self.workers))), timeout)
        except asyncio.TimeoutError:
            raise WorkersFailed(f"verifier workers did not answer within {timeout:g} s") from None
        if not all(answers):
            raise WorkersFailed("verifier workers failed their first item (see the log above)")

    async def run(self, function: Callable[..., Any], args: tuple[Any, ...],
                  what: str | None = None, affinity: str | None = None) -> Ran:
        """`function(*args)` in a worker, killed past the item timeout. A failure is logged
        with `what` (the item, briefly); `what=None`: the caller deals with it. `affinity`:
        tasks that name the same one go to the same worker when they can (`_pick`)."""
        index = self._pick(affinity)
        try:
            future = self._pools[index].schedule(function, args=args, timeout=self.item_timeout)
        except RuntimeError:  # the pool is not active: the server is stopping
            if self._closing:
                return Ran("crashed")
            raise
        try:
            return Ran("ok", await self._outcome(index, future))
        except asyncio.CancelledError:
            future.cancel()
            raise
        except BaseException as exc:  # a SystemExit from the worker is the item's failure
            return Ran(self._failed(exc, what))

    async def call(self, function: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        """`function(*args)` in a worker with no item limit (the caller bounds the wait): its
        value, or what it raised."""
        index = self._pick(None)
        return await self._outcome(index, self._pools[index].schedule(function, args=args))

    async def _outcome(self, index: int, future: Future[Any]) -> Any:
        """What worker `index` made of the task `future`, counted as given to it meanwhile
        (`_pick`, `close`)."""
        token = next(self._tokens)
        self._given[index][token] = (time.monotonic(), future)
        try:
            return await asyncio.wrap_future(future)
        finally:
            del self._given[index][token]
            self._freed[index] = time.monotonic()

    async def check(self, answer: str, gold: str, affinity: bool = True) -> Outcome:
        """The boxed profile's verdict for one canonical pair (`affinity`: sent to the gold's
        worker; the start-up probe, the same pair for every worker, goes to each)."""
        ran = await self.run(verify.worker_check, (answer, gold),
                             what=f"answer={short(answer)} gold={short(gold)}",
                             affinity=gold if affinity else None)
        if ran.status != "ok":
            return Outcome(False, ran.status)
        correct, parses = ran.value
        return Outcome(bool(correct), "ok", parses)

    def _failed(self, exc: BaseException, what: str | None) -> str:
        if self._closing:  # the server is stopping: the item was abandoned, not failed
            return "crashed"
        status = "timeout" if isinstance(exc, TimeoutError) else "crashed"
        if what is None:
            return status
        if status == "timeout":
            log.warning("item timed out after %g s and scored 0 (worker replaced): %s",
                        self.item_timeout, what)
        elif isinstance(exc, pebble.ProcessExpired):
            log.warning("worker died (exit %s) on an item, which scored 0: %s",
                        exc.exitcode, what)
        else:  # raised inside the worker (e.g. RecursionError in sympy)
            log.warning("item failed with %s and scored 0: %s", type(exc).__name__, what)
        return status

    def close(self) -> None:
        """Stops the workers now; whatever they were verifying is abandoned."""
        self._closing = True
        for pool in self._pools:
            pool.stop()
        deadline = time.monotonic() + 10
        for pool in self._pools:
            pool.join(timeout=max(0.0, deadline - time.monotonic()))
        # A stopped pebble pool can leave a task it had queued with no outcome: end each, so
        # that nothing waits for it (its item was abandoned).
        for given in self._given:
            for _, future in list(given.values()):
                with contextlib.suppress(InvalidStateError):
                    future.set_exception(RuntimeError("the verifier pool stopped"))
