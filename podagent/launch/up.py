"""`podagent up`: from the user's machine to a finished multi-node run, and nothing left billing.

A state machine (Phase) with its policy apart (`judge`, a pure function of what RunPod and the
head said): CHECKING (the key, the GPU type against RunPod's catalog, what of the run exists
already) → CREATING (the head first, then the workers with its id; or one cluster; each
create recorded before it goes out) → STARTING (every pod RUNNING, within --timeout) →
FORMING (the head's Ray up, the workers joining: the head's own events) → RUNNING (the job's
output) → FINISHED (the head's exit event: its code is ours) → CLEANING (every pod terminated
and gone from RunPod's list, unless --keep).

Whatever ends it early (an error, a pod in ERROR, Ctrl-C or SIGTERM) terminates what was
created; a second Ctrl-C leaves the pods and says how to clean up. Running it again with the
same --name re-attaches to the run's pods instead of creating more.
"""

from __future__ import annotations

import contextlib
import enum
import queue
import signal
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from podagent.errors import (
    ConfigError,
    Interrupted,
    NoCapacity,
    PodagentError,
    PodsNotReady,
)
from podagent.launch import down, state
from podagent.launch import spec as specs
from podagent.launch.follow import HeadLog, HeadRecord
from podagent.launch.spec import UpSpec
from podagent.launch.view import Board, LiveView, PlainView
from podagent.platform.runpod_api import Client

POLL = 2.0  # seconds between looks at the pods' statuses (one list call for all)
RECORD_WAIT = 0.25  # the loop's wait for the head's next record
# A head whose container keeps being started again is a crash loop, billing for nothing.
# (A run resumed after a lost node or a restarted head starts it a few times at most.)
MAX_HEAD_STARTS = 5


class Phase(str, enum.Enum):
    CHECKING = "checking"
    CREATING = "creating pods"
    STARTING = "starting pods"
    FORMING = "forming the cluster"
    RUNNING = "running the job"
    FINISHED = "finished"
    CLEANING = "terminating pods"


# The head's states (its `state` events) as phases of the whole run.
_HEAD_PHASES = {"waiting_workers": Phase.FORMING, "starting_reward": Phase.FORMING,
                "waiting_reward": Phase.FORMING, "submitting": Phase.RUNNING,
                "running": Phase.RUNNING, "recovering": Phase.FORMING}


@dataclass(frozen=True)
class Verdict:
    action: str  # "wait", "fail" or "done"
    why: str = ""


def judge(statuses: Mapping[str, str | None], started: float, now: float, timeout: float,
          head_exit: int | None, shape: str, head_starts: int = 1,
          ran: Collection[str] = ()) -> Verdict:
    """What to do next, from each pod's status (None: RunPod no longer lists it), the head's
    code once its run is over for good, how often the head's podagent has started, and which
    pods have been RUNNING (one restarting later is not one that never started)."""
    if head_exit is not None:
        return Verdict("done")
    if head_starts > MAX_HEAD_STARTS:
        return Verdict("fail", f"the head's podagent has started {head_starts} times without "
                               f"finishing the run (its container keeps exiting: a crash "
                               f"loop); its log above says why")
    for name, status in statuses.items():
        if status == "ERROR":
            return Verdict("fail", f"pod {name} is in ERROR at RunPod (its system log at "
                                   f"RunPod says why: an image that cannot be pulled, a host "
                                   f"fault)")
        if status in (None, "TERMINATED"):
            return Verdict("fail", f"pod {name} was terminated outside this run")
    waiting = {n: s for n, s in statuses.items() if s != "RUNNING" and n not in ran}
    if waiting and now - started > timeout:
        listed = ", ".join(f"{n} {s}" for n, s in sorted(waiting.items()))
        return Verdict("fail", f"{len(waiting)} of {len(statuses)} pod(s) not RUNNING after "
                               f"{timeout:g} s ({listed}) for {shape}: RunPod may have no "
                               f"capacity; try another GPU type or data center")
    return Verdict("wait")


class Up:
    def __init__(self, spec: UpSpec, client: Client, view: PlainView | LiveView,
                 calls: Callable[[], int] = lambda: 0,
                 explain: Callable[[int], str] = lambda code: f"exit {code}"):
        self.spec, self.client, self.view = spec, client, view
        self.calls = calls  # how many API calls so far (the summary says it)
        self.explain = explain  # an exit code's meaning (the CLI's table)
        self.board = Board(spec.run, spec.shape(), expected=spec.workers)
        self.record: state.RunRecord | None = None
        self.records: queue.Queue[HeadRecord] = queue.Queue()
        self.head_log: HeadLog | None = None
        self.head_id: str | None = None
        self.cluster_id: str | None = None
        self.pod_ids: dict[str, str] = {}  # name -> id
        self.ran: set[str] = set()  # pods seen RUNNING at least once
        self.started = time.monotonic()
        self.head = HeadProgress(spec.run, self.board, view, self.say, self._phase,
                                 self._head_name, self.started)

    # --- output ---------------------------------------------------------------------------

    def say(self, text: str) -> None:
        self.view.line(f"[up] {text}")

    def _phase(self, phase: Phase) -> None:
        if self.board.set_phase(phase.value):
            self.view.update(self.board)

    # --- the machine ----------------------------------------------------------------------

    def run(self) -> int:
        created = False
        try:
            self._phase(Phase.CHECKING)
            gpu = self._check()
            self._phase(Phase.CREATING)
            created = True
            self._create(gpu)
            self._phase(Phase.STARTING)
            code = self._follow()
        except KeyboardInterrupt as exc:
            signum = exc.args[0] if exc.args and isinstance(exc.args[0], int) else signal.SIGINT
            self._interrupted(int(signum), created)
            raise Interrupted(int(signum)) from None
        except ConfigError:
            raise  # nothing was created: a bad input is found before the first create
        except PodagentError:
            if created:
                self._clean_up()
            raise
        self._phase(Phase.FINISHED)
        self._finish(code)
        return code

    def _check(self) -> Mapping[str, Any]:
        gpu = specs.check_gpu(self.spec, self.client.gpu_types())
        self.record = state.load(self.spec.state_dir, self.spec.run)
        found = down.find(self.client, self.spec.run, self.record)
        alive = [p for p in found.pods if p.get("status") != "TERMINATED"]
        if self.record is None or (self.record.status == state.DOWN and not found):
            self.record = state.new(self.spec.state_dir, self.spec.run, self.spec.api_url,
                                    self.spec.shape())
        if alive or found.clusters:
            self.say(f"run {self.spec.run} exists at RunPod ({len(alive)} pod(s)): "
                     f"re-attaching to it, creating only what is missing")
        for pod in alive:
            self.pod_ids[str(pod["name"])] = str(pod["id"])
        if found.clusters:
            self.cluster_id = str(found.clusters[0]["id"])
        price = specs.price_per_hour(self.spec, gpu)
        priced = f" at about ${price:.2f}/h (RunPod's list price)" if price is not None else ""
        self.say(f"run {self.spec.run}: {self.spec.shape()}{priced}; state in "
                 f"{state.path_of(self.spec.state_dir, self.spec.run)}")
        return gpu

    def _create(self, gpu: Mapping[str, Any]) -> None:
        assert self.record is not None
        try:
            if self.spec.cluster:
                self._create_cluster()
            else:
                self._create_pods()
        except NoCapacity as exc:
            where = ", ".join(self.spec.data_centers) or "any data center"
            raise NoCapacity(f"RunPod could not place {self.spec.gpus_per_pod} x "
                             f"{gpu.get('id')} ({self.spec.cloud} cloud) in {where}: {exc}"
                             ) from None
        self.record.mark(state.RUNNING)

    def _create_pods(self) -> None:
        assert self.record is not None
        head_name = specs.pod_name(self.spec.run, 0)
        if head_name not in self.pod_ids and len(self.pod_ids) > 0:
            raise PodsNotReady(f"run {self.spec.run} has workers at RunPod but no head (it "
                               f"was terminated): they are terminated too; up again starts "
                               f"the run afresh")
        for rank, name in enumerate(self.spec.names()):
            row = self.board.row(name)
            if name not in self.pod_ids:
                asked = self.record.asking("pod", name, rank)
                self.view.update(self.board)
                pod = self.client.create_pod(specs.pod_body(self.spec, rank, self.head_id))
                self.record.got(asked, str(pod["id"]))
                self.pod_ids[name] = str(pod["id"])
                row.show(pod)
            if rank == 0:
                self.head_id = self.pod_ids[name]
            row.id = self.pod_ids[name]
            self.view.update(self.board)

    def _create_cluster(self) -> None:
        assert self.record is not None
        if self.cluster_id is None:
            name = specs.cluster_name(self.spec.run)
            asked = self.record.asking("cluster", name, None)
            cluster = self.client.create_cluster(specs.cluster_body(self.spec))
            self.record.got(asked, str(cluster["id"]))
            self.cluster_id = str(cluster["id"])

    def _look(self) -> dict[str, str | None]:
        """Every pod's status now (one API call), onto the board."""
        if self.spec.cluster:
            assert self.cluster_id is not None
            listed = self.client.cluster_pods(self.cluster_id)
            if not listed:  # gone (None), or its pods not placed yet (RunPod adds them)
                name = specs.cluster_name(self.spec.run)
                return {name: None if listed is None else "PROVISIONING"}
            pods = listed
            for pod in pods:
                rank = (pod.get("cluster") or {}).get("rank")
                if rank == 0:
                    self.head_id = str(pod["id"])
                self.pod_ids[str(pod["name"])] = str(pod["id"])
        else:
            listed = {str(p.get("id")): p for p in self.client.list_pods()}
            pods = [listed[i] for i in self.pod_ids.values() if i in listed]
        by_id = {str(p["id"]): p for p in pods}
        statuses: dict[str, str | None] = {}
        for name, pod_id in self.pod_ids.items():
            pod = by_id.get(pod_id)
            row = self.board.row(name)
            row.id = pod_id
            if pod is None:
                row.status = "GONE"
                statuses[name] = None
            else:
                row.show(pod)
                statuses[name] = row.status
        self.view.update(self.board)
        return statuses

    def _follow(self) -> int:
        """From the pods' creation until the head's run is over for good: the pods'
        statuses every POLL seconds, the head's records as they come."""
        next_look = 0.0
        statuses: dict[str, str | None] = {}
        while True:
            now = time.monotonic()
            if now >= next_look:
                statuses = self._look()
                self.ran |= {name for name, status in statuses.items() if status == "RUNNING"}
                next_look = now + POLL
                if self.head_log is None and self.head_id and statuses.get(
                        self._head_name()) in ("STARTING", "RUNNING"):
                    self.head_log = HeadLog(self.client, self.head_id, self.records).start()
                if statuses and all(s == "RUNNING" for s in statuses.values()) and (
                        self.board.phase == Phase.STARTING.value):
                    self._phase(Phase.FORMING)
            verdict = judge(statuses, self.started, time.monotonic(), self.spec.timeout,
                            self.head.exit, self.spec.shape(), self.head.starts, self.ran)
            if verdict.action == "done":
                assert self.head.exit is not None
                return self.head.exit
            if verdict.action == "fail":
                raise PodsNotReady(f"run {self.spec.run}: {verdict.why}")
            with contextlib.suppress(queue.Empty):
                self.head.take(self.records.get(timeout=RECORD_WAIT))
                while True:  # what else has come meanwhile
                    self.head.take(self.records.get_nowait())

    def _head_name(self) -> str:
        for name, pod_id in self.pod_ids.items():
            if pod_id == self.head_id:
                return name
        return specs.pod_name(self.spec.run, 0)

    # --- the end --------------------------------------------------------------------------

    def _stop_following(self) -> None:
        if self.head_log is not None:
            self.head_log.stop()

    def _finish(self, code: int) -> None:
        assert self.record is not None
        self._stop_following()
        took = time.monotonic() - self.started
        outcome = "succeeded" if code == 0 else f"ended: {self.explain(code)}"
        first = (f"; the job's first line after {self.head.first_job_line - self.started:.1f}"
                 f" s" if self.head.first_job_line else "")
        self.say(f"run {self.spec.run} {outcome} (exit {code}) after {took:.1f} s{first}; "
                 f"{self.calls()} RunPod API calls")
        self.record.mark(state.FINISHED, code=code, took=round(took, 1))
        if self.spec.keep:
            self.say(f"--keep: the pods stay up (and bill): `podagent down {self.spec.run}` "
                     f"terminates them")
            return
        self._terminate()

    def _terminate(self) -> None:
        """Every pod of the run terminated and gone from RunPod's list (else an error)."""
        self._phase(Phase.CLEANING)
        down.terminate(self.client, self.spec.run, self.record, self.say)
        for row in self.board.pods.values():
            row.status, row.cost, row.since = "TERMINATED", 0.0, time.monotonic()
        self.view.update(self.board)

    def _clean_up(self) -> None:
        self._stop_following()
        try:
            self._terminate()
        except PodagentError as exc:
            self.say(f"clean-up failed: {exc}; `podagent down {self.spec.run}` tries again")

    def _interrupted(self, signum: int, created: bool) -> None:
        """The first Ctrl-C (or SIGTERM): terminate what was created. A second one, wherever
        it lands, leaves the pods and says how to clean up."""
        name = signal.Signals(signum).name
        try:
            self._stop_following()
            if not created:
                return
            if self.spec.keep:
                self.say(f"{name}: leaving run {self.spec.run} running (--keep): `podagent up "
                         f"--name {self.spec.run} ...` re-attaches, `podagent down "
                         f"{self.spec.run}` terminates it")
                return
            self.say(f"{name}: stopping run {self.spec.run} and terminating its pods "
                     f"(Ctrl-C again to leave them running)")
            self._terminate()
        except KeyboardInterrupt:
            self.say(f"left the pods of run {self.spec.run} as they are; they bill until "
                     f"`podagent down {self.spec.run}` terminates them")
        except PodagentError as exc:
            self.say(f"clean-up failed: {exc}; `podagent down {self.spec.run}` tries again")


class HeadProgress:
    """What the head's records tell `up`: its phase and who joined (onto the board), the job's
    output and podagent's messages (onto the view), how often its podagent started, and the
    run's code once the head stays after its exit."""

    def __init__(self, run: str, board: Board, view: PlainView | LiveView,
                 say: Callable[[str], None], phase: Callable[[Phase], None],
                 head_name: Callable[[], str], started: float):
        self.run, self.board, self.view, self.say = run, board, view, say
        self.phase, self.head_name, self.started = phase, head_name, started
        self.exit: int | None = None  # the run's code, once it is over for good
        self.last_exit: int | None = None  # the code of the head's podagent's last start
        self.starts = 0
        self.first_job_line: float | None = None

    def take(self, record: HeadRecord) -> None:
        data = record.data
        if record.kind == "job":
            if self.first_job_line is None:
                self.first_job_line = time.monotonic()
                self.say(f"the job's first line came {self.first_job_line - self.started:.1f}"
                         f" s after `up` started")
            self.view.line(record.text)
        elif record.kind == "message":
            label = {"warning": "WARNING: ", "error": "ERROR: "}.get(str(data.get("level")), "")
            self.view.line(f"[{data.get('role', 'head')}] {label}{record.text}")
        elif record.kind == "text":
            self.view.line(record.text)
        elif record.kind == "lost":
            raise PodsNotReady(f"run {self.run}: the head's log stream was refused: "
                               f"{data.get('why')}")
        elif record.kind == "event":
            self._event(data)

    def _event(self, data: Mapping[str, Any]) -> None:
        event = data.get("event")
        if event == "state" and data.get("state") in _HEAD_PHASES:
            if data["state"] == "waiting_workers":  # the head's Ray is up
                self.board.row(self.head_name()).joined = True
            self.phase(_HEAD_PHASES[str(data["state"])])
        elif event == "worker_joined":
            self.board.joined += 1
            self.board.mark_joined(str(data.get("ip")), True)
            self.view.update(self.board)
        elif event == "worker_lost":
            self.board.joined = max(0, self.board.joined - 1)
            self.board.mark_joined(str(data.get("ip")), False)
            self.view.update(self.board)
        elif event == "workers_counted":
            self.board.joined = int(data.get("workers") or 0)
            self.view.update(self.board)
        elif event == "role":  # the head's podagent started (again): its workers join anew
            self.starts += 1
            self.board.joined = 0
            self.board.mark_joined(None, False)
            self.view.update(self.board)
        elif event == "exit" and isinstance(data.get("code"), int):
            # Not the end yet: a start cut short (a lost Ray, a signal) is started again by
            # RunPod and resumes the run. The run is over when the head stays (after_run).
            self.last_exit = int(data["code"])
        elif event == "staying" and self.last_exit is not None:
            self.exit = self.last_exit
