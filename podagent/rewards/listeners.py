"""Several server processes on one port: one sample per request, at the rate many cores verify.

With upstream OpenRLHF's load (one sample per request, a new connection each) a server
process spends about 0.3 to 0.5 ms of its one interpreter per request on HTTP and dispatch,
so one process answers some 2,000 requests/s however many verifier workers it has (measured
on 16 cores: its workers were idle half the time). `--listeners N` runs N processes, each
accepting on the same port (SO_REUSEPORT: the kernel spreads connections among them) with its
share of the workers. This process is the first and the parent: it checks the port is free,
starts the others, and stops them all; one that dies stops the server (exit 1), so whoever
supervises it (the head) starts it again whole. Each answers /health with its own counters.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import multiprocessing.connection
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from multiprocessing.process import BaseProcess
from typing import Any

from podagent.rewards.pool import WorkersFailed
from podagent.rewards.settings import RewardSettings

log = logging.getLogger("podagent.rewards")

# A listener that does not stop on SIGTERM within this long is killed.
STOP_GRACE = 10.0
# How long an exited listener's status may take to be readable after its sentinel closed.
EXIT_STATUS_WAIT = 1.0
# Listeners get this long to start (their workers import sympy), as the pool's warm-up.
START_DEADLINE = 300.0
# How often a listener checks that its parent is still there (it stops when it is gone).
ORPHAN_CHECK = 1.0


def shares(workers: int, listeners: int) -> list[int]:
    """Verifier workers per listener, as even as they come (the first ones get the rest)."""
    base, rest = divmod(workers, listeners)
    return [base + (1 if index < rest else 0) for index in range(listeners)]


def check_port_free(host: str, port: int) -> None:
    """OSError(EADDRINUSE) when something listens there already: with SO_REUSEPORT our own
    bind would not say so, and two servers would share the port's traffic."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))


@dataclass
class Members:
    """Listeners 2..N, and the events each sets once it listens."""

    processes: list[BaseProcess] = field(default_factory=list)
    # The read ends of pipes each writes to once it listens (a pipe, not an Event: no
    # semaphore for the resource tracker to find leaked when a listener is killed).
    listening: list[Any] = field(default_factory=list)

    def wait_listening(self, deadline: float = START_DEADLINE) -> None:
        """Blocks until each listens (the first listens after them, so that ready means all
        of them); WorkersFailed when one exits first or the deadline passes."""
        until = time.monotonic() + deadline
        for process, event in zip(self.processes, self.listening, strict=True):
            while not event.poll(0.2):
                if not process.is_alive():
                    raise WorkersFailed(f"{process.name} exited with {process.exitcode} while "
                                        f"starting (its log lines are above)")
                if time.monotonic() > until:
                    raise WorkersFailed(f"{process.name} did not listen within {deadline:g} s")


def start_members(settings: RewardSettings, target: Callable[..., None]
                  ) -> tuple[RewardSettings, Members]:
    """Starts listeners 2..N (spawned: a fresh interpreter each), each running
    `target(settings, index, parent pid, listening pipe)`; this process's settings (its share
    of the workers) and the others."""
    count = settings.listeners
    check_port_free(settings.host, settings.port)
    split = shares(settings.workers, count)
    context = multiprocessing.get_context("spawn")
    members = Members()
    for index in range(1, count):
        ready, listening = context.Pipe(duplex=False)
        member = context.Process(target=target, name=f"reward-listener-{index + 1}",
                                 args=(replace(settings, workers=split[index]), index,
                                       os.getpid(), listening))
        member.start()
        listening.close()  # the member has its own copy
        members.processes.append(member)
        members.listening.append(ready)
    return replace(settings, workers=split[0]), members


async def watch_members(members: list[BaseProcess], stop: asyncio.Event) -> str | None:
    """Until `stop` is set or a member exits; what went wrong, or None. (A process's sentinel
    becomes readable when it exits: no thread blocks on a join the loop would wait for.)"""
    loop = asyncio.get_running_loop()
    exited = asyncio.Event()
    for member in members:
        loop.add_reader(member.sentinel, exited.set)
    waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(exited.wait())]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
        for member in members:
            loop.remove_reader(member.sentinel)
    if stop.is_set():
        return None
    # The sentinel closes as the process exits, a moment before its status can be read.
    for member in members:
        if member.sentinel in multiprocessing.connection.wait([member.sentinel], timeout=0):
            member.join(EXIT_STATUS_WAIT)
            return f"listener {member.name} exited with {member.exitcode}"
    return None


def stop_members(members: list[BaseProcess]) -> None:
    for member in members:
        if member.is_alive():
            member.terminate()
    for member in members:
        member.join(STOP_GRACE)
        if member.is_alive():
            log.warning("%s did not stop within %g s: killed", member.name, STOP_GRACE)
            member.kill()
            member.join()


async def orphaned(parent: int) -> None:
    """Returns once this process's parent is gone (it was killed without stopping us)."""
    while os.getppid() == parent:
        await asyncio.sleep(ORPHAN_CHECK)
