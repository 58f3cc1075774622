"""Small requests gathered into one batch: upstream OpenRLHF's per-sample load at batch cost.

Upstream OpenRLHF posts one sample per request, hundreds in flight. Handled one by one, each
request pays for its own hop to the prep thread and its own pool task (pickling, a pipe write,
a result read, a thread switch each way), and that overhead, not verification, becomes the
server's cost. Here a request whose body is small waits at most `wait` seconds for others; the
batch is prepared in one pass and its verifications start together (equal items verified once,
a few items per pool task); each request is answered as soon as its own items are, so one slow
item holds up its own request, not the batch. Under load the wait is seldom spent: a batch
goes as soon as it is full.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger("podagent.rewards")

# A body this small is a few items at most (one item of a long chain of thought is ~16 KB);
# bigger requests are batches already and go on their own.
SMALL_BODY = 64 << 10
# Requests in one batch at most: enough to give every worker of a large pool several items.
MAX_BATCH = 256

Answer = dict[str, Any]
# A batch's bodies in, one reply per body out: each an awaitable of its own (a request is
# answered as soon as its own items are, not when the batch's slowest one is), or why not.
Run = Callable[[list[bytes]], Awaitable[list["Awaitable[Answer] | BaseException"]]]


class Batcher:
    """Gathers bodies for up to `wait` seconds (or MAX_BATCH of them) and runs them as one."""

    def __init__(self, run: Run, wait: float):
        self.run, self.wait = run, wait
        self._waiting: list[tuple[bytes, asyncio.Future[Answer]]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.batches = 0  # batches run, for /health

    async def submit(self, body: bytes) -> Answer:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Answer] = loop.create_future()
        self._waiting.append((body, future))
        if len(self._waiting) >= MAX_BATCH:
            self._flush()
        elif self._timer is None:
            self._timer = loop.call_later(self.wait, self._flush)
        return await future

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._waiting = self._waiting, []
        if batch:
            task = asyncio.ensure_future(self._run(batch))
            self._tasks.add(task)  # the loop keeps only a weak reference
            task.add_done_callback(self._tasks.discard)

    async def _run(self, batch: list[tuple[bytes, asyncio.Future[Answer]]]) -> None:
        self.batches += 1
        try:
            answers = await self.run([body for body, _ in batch])
        except BaseException as exc:  # every request of the batch gets it (a 500 each)
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        for (_, future), answer in zip(batch, answers, strict=True):
            if isinstance(answer, BaseException):
                if not future.done():
                    future.set_exception(answer)
                continue
            # Run even when its client gave up: the verifications it started serve others.
            task = asyncio.ensure_future(answer)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            task.add_done_callback(lambda done, future=future: _hand_over(done, future))


def _hand_over(done: asyncio.Future[Answer], future: asyncio.Future[Answer]) -> None:
    """A request's answer (or what stopped it) to the request waiting for it."""
    if done.cancelled():
        if not future.done():
            future.cancel()
        return
    exc = done.exception()  # read even when nobody waits: no "never retrieved" warning
    if future.done():  # its client gave up
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(done.result())


def split(reply: Answer, sizes: list[int]) -> list[Answer]:
    """A batch's reply cut into one reply per request (lists, and dicts of lists, by item)."""
    replies, start = [], 0
    for size in sizes:
        end = start + size
        replies.append({key: ({k: v[start:end] for k, v in value.items()}
                              if isinstance(value, dict) else value[start:end])
                        for key, value in reply.items()})
        start = end
    return replies
