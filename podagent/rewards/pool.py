"""Verification off the event loop: a pebble process pool with a time limit on every item.

sympy can run for minutes, or forever, on a hostile answer (`9^{9^{9^{9}}}`), and it does so
in C where no signal reaches it. A thread cannot be stopped and `concurrent.futures` cannot
kill a worker; pebble kills the worker running an item past its limit and starts a new one,
so one bad item costs one item's limit and nothing else.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import signal
from dataclasses import dataclass

import pebble

from podagent.errors import PodagentError
from podagent.rewards import verify

log = logging.getLogger("podagent.rewards")


class WorkersFailed(PodagentError):
    """The verifier processes could not start or could not verify a known-good pair."""


@dataclass(frozen=True)
class Outcome:
    correct: bool
    status: str  # "ok", "timeout" or "crashed"
    gold_parses: int = 0


def short(text: str, limit: int = 60) -> str:
    """A repr for one log line: long inputs are cut, with their length."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}…({len(text)} chars)"


def _init_worker() -> None:
    # Ctrl-C in a terminal reaches the whole process group: only the server decides to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    verify.worker_warm()


class VerifierPool:
    def __init__(self, workers: int, item_timeout: float):
        self.workers, self.item_timeout = workers, item_timeout
        # forkserver, not fork: the server has threads (pebble's, the event loop's executor)
        # and forking a threaded process can copy a held lock into the child. The preload
        # makes each new worker (also every replacement after a timeout) a cheap fork of a
        # process that has already imported and warmed sympy and math-verify.
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["podagent.rewards.warm"])
        self._pool = pebble.ProcessPool(max_workers=workers, initializer=_init_worker,
                                        context=context)
        self._closing = False

    async def warm(self, timeout: float = 300.0) -> None:
        """Waits until workers answer right; raises WorkersFailed if they cannot.

        A server whose workers cannot verify would score every item 0 and look healthy."""
        probes = [self.check(r"\frac{1}{\sqrt{2}}", r"\frac{\sqrt{2}}{2}")
                  for _ in range(self.workers)]
        try:
            outcomes = await asyncio.wait_for(asyncio.gather(*probes), timeout)
        except asyncio.TimeoutError:
            raise WorkersFailed(f"verifier workers did not answer within {timeout:g} s") from None
        if not all(o.status == "ok" and o.correct for o in outcomes):
            raise WorkersFailed("verifier workers failed their first item (see the log above)")

    async def check(self, answer: str, gold: str) -> Outcome:
        future = self._pool.schedule(verify.worker_check, args=(answer, gold),
                                     timeout=self.item_timeout)
        try:
            correct, parses = await asyncio.wrap_future(future)
        except Exception as exc:
            return self._failed(exc, answer, gold)
        return Outcome(bool(correct), "ok", parses)

    def _failed(self, exc: Exception, answer: str, gold: str) -> Outcome:
        if self._closing:  # the server is stopping: the item was abandoned, not failed
            return Outcome(False, "crashed")
        if isinstance(exc, TimeoutError):
            log.warning("item timed out after %g s and scored 0 (worker replaced): "
                        "answer=%s gold=%s", self.item_timeout, short(answer), short(gold))
            return Outcome(False, "timeout")
        if isinstance(exc, pebble.ProcessExpired):
            log.warning("worker died (exit %s) on an item, which scored 0: answer=%s gold=%s",
                        exc.exitcode, short(answer), short(gold))
        else:  # raised inside the worker (e.g. RecursionError in sympy)
            log.warning("item failed with %s and scored 0: answer=%s gold=%s",
                        type(exc).__name__, short(answer), short(gold))
        return Outcome(False, "crashed")

    def close(self) -> None:
        """Stops the workers now; whatever they were verifying is abandoned."""
        self._closing = True
        self._pool.stop()
        self._pool.join(timeout=10)
