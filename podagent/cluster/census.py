"""The head's count of its workers, read from Ray's own node table (never parsed from text).

One census is one read of the table; the head calls it while it waits for the workers (joins
and workers that leave again), once on re-attach, while the job runs (losses) and at the end
(who is still connected). Every join and loss is a line and an event.

While it waits the head polls ten times a second. The table is then read only when a node
registered since the last read (its size changed: a constant-cost read) or the last read is
RECOUNT_EVERY old (a departure leaves the size as it was), so the GCS's cost of the wait does not
grow with the cluster (docs/benchmarks.md, "The head's census at 1,000 nodes").
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import enum
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from podagent.errors import RayUnhealthy
from podagent.ray_access.gcs import GcsUnavailable, NodeInfo
from podagent.report import Reporter
from podagent.run.workers import accept_shortfall
from podagent.waiting import Backoff, Deadline, Expired, retry
from podagent.wire import Event

NODE_POLL = 0.1  # the node table is one cheap RPC: poll often so joins show at once
PROBES_AT_ONCE = 64  # raylet probes in flight when a failed job is looked into
RECOUNT_EVERY = 1.0  # seconds: a worker that leaves again while the head waits shows this late
DEPARTURES_POLL = 0.2  # at the end: how often the head looks whether the workers left
# Ray marks a dead node after ray_node.HEALTH_CHECK_ENV's checks fail (about 5 s); more than
# twice that means Ray's own checks are configured otherwise.
DEPARTED_TIMEOUT = 15.0


class Loss(str, enum.Enum):
    """What became of a worker that left: LOST while the job ran -> MISSING once a restart
    takes it out of the census -> REPLACED when a pod joins in its place."""
    LOST = "lost"
    MISSING = "missing"
    REPLACED = "replaced"


@dataclass
class LostWorker:
    worker: NodeInfo  # as it joined
    state: Loss
    noticed: float | None = None  # wall clock: when its loss was seen while the job ran
    replaced_by: str | None = None  # the address of the pod in its place

    @property
    def departed(self) -> bool:
        """Out of the census for good: Ray may list its node as alive a few seconds more."""
        return self.state is not Loss.LOST


class WorkerCensus:
    """Who joined, who left and who was lost, from reads of Ray's node table; each change
    said once and recorded as an event."""

    def __init__(self, nodes: Callable[[], list[NodeInfo]], reporter: Reporter,
                 registered: Callable[[], int] | None = None):
        self._nodes = nodes  # the head's node table; raises when its GCS does not answer
        self._registered = registered  # how many nodes the table holds (None: read every poll)
        self.reporter = reporter
        self.workers: dict[str, NodeInfo] = {}  # node id -> the worker as it joined
        # Node id -> every worker that left while the job ran or was taken out for a restart.
        # Kept in order: the MISSING ones in the order they left (a pod that joins while the
        # census waits for the cluster to be whole again takes the place of the first), the
        # REPLACED ones in the order they were replaced (moved to the end then).
        self.lost: dict[str, LostWorker] = {}
        # Nodes of a pod that has a newer node now (its raylet exited and it joined again):
        # never counted again, though Ray lists them as alive until its health checks fail.
        self._superseded: set[str] = set()
        self._size: int | None = None  # the table's size before the last read
        self._read_at = float("-inf")
        self.still_there: list[str] = []  # workers still connected when the head left

    def stragglers(self) -> list[str]:
        """Addresses of the workers that did not leave with the head at the end: lost while
        the job ran (and not replaced), or still connected when it stopped waiting."""
        lost = [g.worker.ip for g in self.lost.values() if g.state is not Loss.REPLACED]
        return sorted(set(lost) | set(self.still_there))

    def alive(self) -> list[NodeInfo]:
        return [n for n in self._nodes() if n.alive and not n.is_head]

    @property
    def gpus(self) -> int:
        return int(sum(w.gpus for w in self.workers.values()))

    def ips(self) -> list[str]:
        return sorted(w.ip for w in self.workers.values())

    def _in(self, state: Loss) -> list[LostWorker]:
        return [g for g in self.lost.values() if g.state is state]

    def _departed(self, node_id: str) -> bool:
        return (node_id in self._superseded
                or (node_id in self.lost and self.lost[node_id].departed))

    def _newest_per_pod(self, nodes: list[NodeInfo]) -> dict[str, NodeInfo]:
        """node id -> worker, one per address: a pod has one address, and a second node there
        is its Ray started again (a raylet that exited, a container started again) while Ray
        still lists the earlier one. The newest counts; the earlier ones are superseded."""
        newest: dict[str, NodeInfo] = {}
        for worker in sorted(nodes, key=lambda w: w.start_time_ms):
            earlier = newest.get(worker.ip)
            if earlier is not None:
                self._superseded.add(earlier.node_id)
            newest[worker.ip] = worker
        return {w.node_id: w for w in newest.values() if not self._departed(w.node_id)}

    def lost_now(self) -> list[NodeInfo]:
        """The workers lost while this job ran, in the census's order."""
        return [w for node_id, w in self.workers.items()
                if node_id in self.lost and self.lost[node_id].state is Loss.LOST]

    def first_noticed(self) -> float | None:
        """When the first loss of this job was seen (wall clock), if one was."""
        return min((g.noticed for g in self._in(Loss.LOST) if g.noticed is not None),
                   default=None)

    @property
    def replaced(self) -> list[tuple[str, str]]:
        """(lost ip, ip of the pod in its place), in the order they were replaced."""
        return [(g.worker.ip, g.replaced_by or "") for g in self._in(Loss.REPLACED)]

    def poll_joins(self, expected: int) -> int:
        """While waiting for the workers: record who joined and who left again; returns how
        many are in."""
        if not self._table_changed():
            return len(self.workers)
        alive = self._newest_per_pod(self.alive())
        for node_id in [n for n in self.workers if n not in alive]:
            gone = self.workers.pop(node_id)
            how = (" (its Ray started again: the new node counts)"
                   if node_id in self._superseded else "")
            self.reporter.warn(f"worker {gone.ip} left again before the job started{how}")
            self.reporter.event(Event.WORKER_LOST, ip=gone.ip, node_id=node_id)
        for worker in alive.values():
            if worker.node_id not in self.workers:
                self.workers[worker.node_id] = worker
                lost = self._in_place_of(worker)
                instead = ("" if lost is None else f" (the lost pod {lost.ip} is back)"
                           if lost.ip == worker.ip else f" (in place of the lost {lost.ip})")
                self.reporter.say(f"worker joined: {worker.ip} ({worker.gpus:g} GPUs) "
                                  f"[{len(self.workers)}/{expected}]{instead}")
                self.reporter.event(Event.WORKER_JOINED, ip=worker.ip, gpus=worker.gpus,
                                    node_id=worker.node_id, registered_ms=worker.start_time_ms,
                                    replaces=lost.ip if lost else None)
        return len(self.workers)

    def _in_place_of(self, worker: NodeInfo) -> NodeInfo | None:
        """A join while lost workers are missing replaces one: the same address first (the
        lost pod restarted), else the one lost first (a new pod). Returns the one replaced."""
        missing = self._in(Loss.MISSING)
        if not missing:
            return None
        lost = next((m for m in missing if m.worker.ip == worker.ip), missing[0])
        lost.state, lost.replaced_by = Loss.REPLACED, worker.ip
        self.lost[lost.worker.node_id] = self.lost.pop(lost.worker.node_id)  # to the end
        return lost.worker

    def _table_changed(self) -> bool:
        """Whether this poll reads the table: the size is asked first, so a node registering
        during the read is seen by the next poll."""
        now = time.monotonic()
        size = None
        if self._registered is not None:
            with contextlib.suppress(GcsUnavailable, RayUnhealthy):  # the read says why
                size = self._registered()
        if size is not None and size == self._size and now - self._read_at < RECOUNT_EVERY:
            return False
        self._size, self._read_at = size, now
        return True

    def accept_shortfall(self, expected: int, minimum: int | None, timeout: float) -> None:
        """Fewer joined than expected within the timeout: the kernel's rule decides."""
        accept_shortfall(self.reporter, self.ips(), expected, minimum, timeout)

    def count(self, expected: int) -> None:
        """On re-attach: the job runs already, so the workers are counted, never awaited."""
        self.workers = {w.node_id: w for w in self.alive()}
        for worker in self.workers.values():
            self.reporter.say(f"worker still joined: {worker.ip} ({worker.gpus:g} GPUs)")
        counted = f"{len(self.workers)} of {expected} expected worker(s) alive in the node table"
        if len(self.workers) < expected:
            self.reporter.warn(f"re-attached with {counted}; following the job anyway")
        else:
            self.reporter.say(f"re-attached: {counted}")
        self.reporter.event(Event.WORKERS_COUNTED, workers=len(self.workers), expected=expected,
                            ips=self.ips())

    def begin_recovery(self) -> list[NodeInfo]:
        """The job is being restarted: the lost workers, and any other no longer alive, leave
        the census as MISSING (a replacement will take their place). Returns them."""
        gone = self.lost_now()
        alive = {w.node_id for w in self.alive()}
        gone += [w for node_id, w in self.workers.items()
                 if node_id not in alive and node_id not in self.lost]
        for worker in gone:
            del self.workers[worker.node_id]
            entry = self.lost.pop(worker.node_id, None) or LostWorker(worker, Loss.MISSING)
            entry.state = Loss.MISSING
            self.lost[worker.node_id] = entry  # in the order they left the census
        return gone

    def departed_still_listed(self) -> list[str]:
        """Addresses of departed workers that Ray's node table still lists as alive (its
        health checks take seconds): a job submitted now would place ranks on them."""
        return [w.ip for w in self.alive() if self._departed(w.node_id)]

    def await_departed_gone(self, sleep: Callable[[float], None]) -> None:
        """Before a job is submitted: Ray lists a lost or superseded node as alive until its
        health checks fail (a few seconds), and the job would place ranks there."""
        try:
            retry(self.departed_still_listed, awaited="Ray to mark the departed nodes dead",
                  backoff=Backoff.every(NODE_POLL), deadline=DEPARTED_TIMEOUT, sleep=sleep,
                  until=lambda listed: not listed)
        except Expired as expired:
            self.reporter.warn(f"Ray still lists the departed {', '.join(expired.last)} as "
                               f"alive after {DEPARTED_TIMEOUT:g} s; submitting anyway")

    def unreachable(self, timeout: float = 1.0) -> list[NodeInfo]:
        """Workers whose raylet refuses or ignores a connection now. A killed pod breaks the
        job's collectives at once, seconds before Ray's health checks mark its node dead: this
        tells a job that failed because a pod went away from one that failed by itself."""
        asked = [w for w in self.workers.values()
                 if w.node_id not in self.lost and w.node_manager_port]

        def gone(worker: NodeInfo) -> bool:
            try:
                socket.create_connection((worker.ip, worker.node_manager_port), timeout).close()
            except OSError:
                return True
            return False

        if not asked:
            return []
        # All at once: pods cut off the network each take the whole timeout.
        with concurrent.futures.ThreadPoolExecutor(min(len(asked), PROBES_AT_ONCE)) as pool:
            return [w for w, lost in zip(asked, pool.map(gone, asked), strict=True) if lost]

    def mark_lost(self, workers: list[NodeInfo], how: str, then: str) -> None:
        for worker in workers:
            if worker.node_id in self.lost:
                continue
            now = time.time()
            self.lost[worker.node_id] = LostWorker(worker, Loss.LOST, noticed=now)
            at = time.strftime("%H:%M:%S", time.gmtime(now))
            self.reporter.warn(f"worker {worker.ip} left the cluster while the job ran ({how}; "
                               f"noticed {at} UTC); {then}")
            self.reporter.event(Event.WORKER_LOST, ip=worker.ip, node_id=worker.node_id,
                                at=round(now, 3), how=how)

    def note_losses(self, alive: set[str], then: str) -> list[NodeInfo]:
        """While the job runs: a worker no longer alive is reported once (`then` says what
        follows); returns the workers newly lost."""
        newly = [w for node_id, w in self.workers.items()
                 if node_id not in alive and node_id not in self.lost]
        # Ray marks a node dead after its health checks fail (ray_node.HEALTH_CHECK_ENV:
        # seconds, not a minute).
        self.mark_lost(newly, "Ray marked its node dead", then)
        return newly

    def await_departures(self, grace: float | Deadline) -> None:
        """At the end, after the closing announcement: workers leave on it; give them a moment
        so they never see the head vanish."""
        if not self.workers:
            return

        def remaining() -> int:
            try:
                return len(self.alive())
            except RayUnhealthy:
                return 0  # the GCS no longer answers: nobody is left to wait for

        try:
            left = retry(remaining, awaited="the workers to leave",
                         backoff=Backoff.every(DEPARTURES_POLL), deadline=grace,
                         until=lambda n: n == 0)
        except Expired as expired:
            left = expired.last
        if left:
            with contextlib.suppress(RayUnhealthy, GcsUnavailable):
                self.still_there = sorted(w.ip for w in self.alive())
            self.reporter.warn(f"{left} worker(s) still connected; stopping Ray anyway")
