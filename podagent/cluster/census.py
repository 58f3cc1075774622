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
import socket
import time
from collections.abc import Callable

from tenacity import Retrying, retry_if_result, wait_fixed

from podagent.errors import RayStartError, WorkersTimeout
from podagent.ray_access.gcs import GcsUnavailable, NodeInfo
from podagent.report import Reporter
from podagent.waiting import Deadline

PROBES_AT_ONCE = 64  # raylet probes in flight when a failed job is looked into
RECOUNT_EVERY = 1.0  # seconds: a worker that leaves again while the head waits shows this late


class WorkerCensus:
    def __init__(self, nodes: Callable[[], list[NodeInfo]], reporter: Reporter,
                 registered: Callable[[], int] | None = None):
        self._nodes = nodes  # the head's node table; raises when its GCS does not answer
        self._registered = registered  # how many nodes the table holds (None: read every poll)
        self.reporter = reporter
        self.workers: dict[str, NodeInfo] = {}  # node id -> the worker as it joined
        self.lost: set[str] = set()  # node ids lost while the job ran
        # Workers lost by the job being restarted, oldest first: a pod that joins while the
        # census waits for the cluster to be whole again takes the place of the first one.
        self.missing: list[NodeInfo] = []
        self.replaced: list[tuple[str, str]] = []  # (lost ip, ip of the pod in its place)
        self.lost_at: dict[str, float] = {}  # node id -> when its loss was noticed
        self.departed: set[str] = set()  # node ids never counted again (Ray may list them a
        # few seconds more after a restart began)
        self._size: int | None = None  # the table's size before the last read
        self._read_at = float("-inf")

    def alive(self) -> list[NodeInfo]:
        return [n for n in self._nodes() if n.alive and not n.is_head]

    @property
    def gpus(self) -> int:
        return int(sum(w.gpus for w in self.workers.values()))

    def ips(self) -> list[str]:
        return sorted(w.ip for w in self.workers.values())

    def poll_joins(self, expected: int) -> int:
        """While waiting for the workers: record who joined and who left again; returns how
        many are in."""
        if not self._table_changed():
            return len(self.workers)
        alive = {w.node_id: w for w in self.alive() if w.node_id not in self.departed}
        for node_id in [n for n in self.workers if n not in alive]:
            gone = self.workers.pop(node_id)
            self.reporter.warn(f"worker {gone.ip} left again before the job started")
            self.reporter.event("worker_lost", ip=gone.ip, node_id=node_id)
        for worker in alive.values():
            if worker.node_id not in self.workers:
                self.workers[worker.node_id] = worker
                instead = self._in_place_of(worker)
                self.reporter.say(f"worker joined: {worker.ip} ({worker.gpus:g} GPUs) "
                                  f"[{len(self.workers)}/{expected}]{instead}")
                self.reporter.event("worker_joined", ip=worker.ip, gpus=worker.gpus,
                                    node_id=worker.node_id, registered_ms=worker.start_time_ms,
                                    replaces=self.replaced[-1][0] if instead else None)
        return len(self.workers)

    def _in_place_of(self, worker: NodeInfo) -> str:
        """A join while lost workers are missing replaces one: the same address first (the
        lost pod restarted), else the one lost first (a new pod). Returns the line's tail."""
        if not self.missing:
            return ""
        lost = next((m for m in self.missing if m.ip == worker.ip), self.missing[0])
        self.missing.remove(lost)
        self.replaced.append((lost.ip, worker.ip))
        if lost.ip == worker.ip:
            return f" (the lost pod {lost.ip} is back)"
        return f" (in place of the lost {lost.ip})"

    def _table_changed(self) -> bool:
        """Whether this poll reads the table: the size is asked first, so a node registering
        during the read is seen by the next poll."""
        now = time.monotonic()
        size = None
        if self._registered is not None:
            with contextlib.suppress(GcsUnavailable, RayStartError):  # the read says why
                size = self._registered()
        if size is not None and size == self._size and now - self._read_at < RECOUNT_EVERY:
            return False
        self._size, self._read_at = size, now
        return True

    def accept_shortfall(self, expected: int, minimum: int | None, timeout: float) -> None:
        """Fewer joined than expected within the timeout: raises WorkersTimeout unless
        PODAGENT_MIN_WORKERS says that many will do."""
        joined, who = len(self.workers), ", ".join(self.ips()) or "none"
        if minimum is None or joined < minimum:
            raise WorkersTimeout(f"only {joined} of {expected} workers joined within "
                                 f"{timeout:g} s; joined: {who}")
        self.reporter.warn(f"{joined} of {expected} workers joined ({who}); going on "
                           f"because PODAGENT_MIN_WORKERS={minimum}")

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
        self.reporter.event("workers_counted", workers=len(self.workers), expected=expected,
                            ips=self.ips())

    def begin_recovery(self) -> list[NodeInfo]:
        """The job is being restarted: the lost workers leave the census (a replacement will
        take their place) and the losses are forgotten. Returns the workers that left."""
        gone = [w for node_id, w in self.workers.items() if node_id in self.lost]
        alive = {w.node_id for w in self.alive()}
        gone += [w for node_id, w in self.workers.items()
                 if node_id not in alive and node_id not in self.lost]
        for worker in gone:
            del self.workers[worker.node_id]
            self.departed.add(worker.node_id)
        self.missing += gone
        self.lost.clear()
        self.lost_at.clear()
        return gone

    def departed_still_listed(self) -> list[str]:
        """Addresses of departed workers that Ray's node table still lists as alive (its
        health checks take seconds): a job submitted now would place ranks on them."""
        return [w.ip for w in self.alive() if w.node_id in self.departed]

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
            self.lost.add(worker.node_id)
            now = self.lost_at[worker.node_id] = time.time()
            at = time.strftime("%H:%M:%S", time.gmtime(now))
            self.reporter.warn(f"worker {worker.ip} left the cluster while the job ran ({how}; "
                               f"noticed {at} UTC); {then}")
            self.reporter.event("worker_lost", ip=worker.ip, node_id=worker.node_id,
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
            except RayStartError:
                return 0  # the GCS no longer answers: nobody is left to wait for

        deadline = Deadline.of(grace)
        left = Retrying(stop=lambda _state: deadline.passed, wait=wait_fixed(0.2),
                        retry=retry_if_result(lambda n: n > 0),
                        retry_error_callback=lambda state: state.outcome.result())(remaining)
        if left:
            self.reporter.warn(f"{left} worker(s) still connected; stopping Ray anyway")
