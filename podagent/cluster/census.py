"""The head's count of its workers, read from Ray's own node table (never parsed from text).

One census is one read of the table; the head calls it while it waits for the workers (joins
and workers that leave again), once on re-attach, while the job runs (losses) and at the end
(who is still connected). Every join and loss is a line and an event.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from tenacity import Retrying, retry_if_result, stop_after_delay, wait_fixed

from podagent.errors import RayStartError, WorkersTimeout
from podagent.gcs import NodeInfo
from podagent.report import Reporter


class WorkerCensus:
    def __init__(self, nodes: Callable[[], list[NodeInfo]], reporter: Reporter):
        self._nodes = nodes  # the head's node table; raises when its GCS does not answer
        self.reporter = reporter
        self.workers: dict[str, NodeInfo] = {}  # node id -> the worker as it joined
        self.lost: set[str] = set()  # node ids lost while the job ran

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
        alive = {w.node_id: w for w in self.alive()}
        for node_id in [n for n in self.workers if n not in alive]:
            gone = self.workers.pop(node_id)
            self.reporter.warn(f"worker {gone.ip} left again before the job started")
            self.reporter.event("worker_lost", ip=gone.ip, node_id=node_id)
        for worker in alive.values():
            if worker.node_id not in self.workers:
                self.workers[worker.node_id] = worker
                self.reporter.say(f"worker joined: {worker.ip} ({worker.gpus:g} GPUs) "
                                  f"[{len(self.workers)}/{expected}]")
                self.reporter.event("worker_joined", ip=worker.ip, gpus=worker.gpus,
                                    node_id=worker.node_id, registered_ms=worker.start_time_ms)
        return len(self.workers)

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

    def note_losses(self, alive: set[str]) -> None:
        """While the job runs: a worker no longer alive is reported once."""
        for node_id, worker in self.workers.items():
            if node_id not in alive and node_id not in self.lost:
                self.lost.add(node_id)
                # Ray marks a node dead after its health checks fail (ray_node.HEALTH_CHECK_ENV:
                # seconds, not a minute); the job decides whether it can go on without it.
                now = time.time()
                at = time.strftime("%H:%M:%S", time.gmtime(now))
                self.reporter.warn(f"worker {worker.ip} left the cluster while the job ran "
                                   f"(Ray marked its node dead; noticed {at} UTC); the job "
                                   f"decides whether it goes on")
                self.reporter.event("worker_lost", ip=worker.ip, node_id=node_id,
                                    at=round(now, 3))

    def await_departures(self, grace: float) -> None:
        """At the end, after the closing announcement: workers leave on it; give them a moment
        so they never see the head vanish."""
        if not self.workers:
            return

        def remaining() -> int:
            try:
                return len(self.alive())
            except RayStartError:
                return 0  # the GCS no longer answers: nobody is left to wait for

        left = Retrying(stop=stop_after_delay(grace), wait=wait_fixed(0.2),
                        retry=retry_if_result(lambda n: n > 0),
                        retry_error_callback=lambda state: state.outcome.result())(remaining)
        if left:
            self.reporter.warn(f"{left} worker(s) still connected; stopping Ray anyway")
