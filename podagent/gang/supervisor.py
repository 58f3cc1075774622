"""A run without Ray, supervised on every pod: podagent's rendezvous, then each step (the data
check, the training) launched on every pod at once, and the run's end decided in one place.

Policy apart from mechanism: `Cause` and `stronger` say which of several things that went wrong
ends the run and how each pod exits (`Cause.error`); the `Supervisor` moves through its
phases, watches its launcher and its peers, and acts.

The head decides for everyone. A worker reports its step's end to the head and waits for the
head's word; only a head that is gone is decided by the worker itself. When several things go
wrong at once (a pod killed: its peers' collectives fail a moment later), the strongest cause
seen within SETTLE seconds of the first failure wins, so every pod names the pod that was lost,
not the failures that followed.
"""

from __future__ import annotations

import queue
import shlex
import signal
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from podagent import process
from podagent.config import CLUSTER_TOKEN, Settings, child_environ
from podagent.errors import (
    DataOverlap,
    InputError,
    Interrupted,
    JobFailed,
    JobStopped,
    PeerLost,
    PodagentError,
)
from podagent.gang import datacheck, mesh
from podagent.gang.launchers import Launcher, Layout, Step, data_check_step
from podagent.platform.roles import Role
from podagent.report import Reporter
from podagent.waiting import Deadline, Signals
from podagent.wire import Event, GangPhase

SETTLE = 1.0  # seconds a first failure waits for a stronger cause (a lost pod) to show
POLL = 0.1  # how often the launcher's exit is looked at between events
LOG_CHUNK = 1 << 18  # bytes of the training log per `podagent logs` answer
TRAINING_LOG = "training.log"
END_WAIT = 5.0  # seconds beyond the stop timeout the head waits for its workers to be out


# --- policy ------------------------------------------------------------------------------

# Which cause ends the run when several show: a pod gone explains the failures after it.
_STRENGTH = {"lost": 3, "failed": 2, "overlap": 1, "stopped": 1, "succeeded": 0}


@dataclass(frozen=True)
class Cause:
    kind: str  # lost | failed | overlap | stopped | succeeded
    pod: str = ""  # the pod it happened on (as `str(Peer)`), or who asked to stop
    detail: str = ""  # why it was lost; the data check's line
    step: str = ""
    rc: int | None = None

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> Cause:
        rc = body.get("rc")
        return cls(str(body.get("kind", "lost")), str(body.get("pod", "")),
                   str(body.get("detail", ""))[:2000], str(body.get("step", "")),
                   rc if isinstance(rc, int) else None)

    def error(self, me: str, launcher: str) -> PodagentError | None:
        """What this pod exits with (None: success)."""
        if self.kind == "succeeded":
            return None
        if self.kind == "stopped":
            return JobStopped(f"the run was stopped by `podagent stop` from {self.pod}")
        if self.kind == "overlap":
            return DataOverlap(self.detail)
        if self.kind == "failed" and self.pod == me:
            return JobFailed(f"the {self.step} ({launcher}) exited {self.rc} on this pod; "
                             f"stopped it on every pod")
        if self.kind == "failed":  # the run failed, on every pod alike: none starts it again
            return JobFailed(f"the {self.step} failed on pod {self.pod} ({launcher} exited "
                             f"{self.rc}); stopped this pod's training")
        return PeerLost(f"pod {self.pod} was lost: {self.detail}; stopped this pod's training",
                        self.pod)


def stronger(current: Cause | None, new: Cause) -> Cause:
    if current is None or _STRENGTH[new.kind] > _STRENGTH[current.kind]:
        return new
    return current


# --- mechanism ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Plan:
    """What this pod runs, known before the rendezvous; steps follow once the layout is."""
    launcher: Launcher
    data_check: bool
    loader: str | None
    script: tuple[str, ...]  # the user's training script and its args (none: only the check)
    nccl: Mapping[str, str]
    gpus: int


class Supervisor:
    """One pod's side of a run without Ray: its phases, its launcher, the steps it runs and
    how they end; the head and the worker each add their part of the protocol."""

    def __init__(self, settings: Settings, role: Role, plan: Plan, me: mesh.Peer,
                 rv: mesh.Rendezvous, reporter: Reporter, signals: Signals, run_dir: Path):
        self.settings, self.role, self.plan, self.me, self.rv = settings, role, plan, me, rv
        self.reporter, self.signals, self.run_dir = reporter, signals, run_dir
        self.events: queue.Queue[mesh.Event] = queue.Queue()
        self.phase = GangPhase.RENDEZVOUS
        self.step_name = ""
        self.training: process.ManagedProcess | None = None
        self.started = time.time()
        self.layout: Layout | None = None
        self.check_line = ""  # the data check's verdict, when it passed
        self._hub: mesh.Hub | None = None  # the head's
        self._said: set[str] = set()

    @property
    def log_path(self) -> Path:
        return self.run_dir / TRAINING_LOG

    def _enter(self, phase: GangPhase, **fields: Any) -> None:
        self.phase = phase
        self.reporter.event(Event.STATE, state=phase.value, **fields)

    def steps(self, layout: Layout) -> list[Step]:
        plan, out = self.plan, []
        if plan.data_check:
            out.append(data_check_step(plan.launcher, layout, self.run_dir / "data-check",
                                       plan.loader, plan.nccl))
        if plan.script:
            out.append(plan.launcher.step("training", layout, plan.script, plan.nccl))
        return out

    def _layout(self, nodes: int, rank: int) -> Layout:
        from podagent.gang.launchers import wait_limit

        gpus = self.plan.gpus
        return Layout(self.role, nodes, rank, self.me.addr, self.rv.head_ip,
                      self.settings.rendezvous_port, gpus,
                      self.plan.launcher.procs_per_node(gpus), self.rv.rdzv_id,
                      wait_limit(self.settings, self.role))

    # --- one step's launcher -------------------------------------------------------------------

    def _launch(self, step: Step) -> process.ManagedProcess:
        self.step_name = step.name
        for said in step.lines:
            if said not in self._said:  # the same for every step: once is enough
                self._said.add(said)
                self.reporter.say(said)
        if step.name == "data check":
            self._clear_reports()
        # The training gets the pod's environment (its W&B key, say), not the cluster token:
        # that is the supervisors' own.
        env = {**child_environ(self.settings.environ, lambda k: k in CLUSTER_TOKEN),
               **step.env}
        self.reporter.say(f"{step.name}: {shlex.join(step.argv)}")
        self.reporter.event(Event.STEP_STARTED, step=step.name, argv=list(step.argv))
        # Its output goes to the pod's screen and to the training log `podagent logs` reads.
        training = process.ManagedProcess(step.name, step.argv, env, self.log_path, tee=True,
                                          whole_pod=True)
        training.start()
        self.training = training
        return training

    def _clear_reports(self) -> None:
        folder = self.run_dir / "data-check"
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("rank-*.json"):
            old.unlink(missing_ok=True)

    def _reports(self) -> tuple[dict[str, Any], ...]:
        return tuple(datacheck.read_reports(self.run_dir / "data-check", str(self.me)))

    def _stop_training(self, hurried: bool) -> None:
        if self.training is None:
            return
        seconds = min(self.settings.stop_timeout, 3.0) if hurried else self.settings.stop_timeout
        termed, killed = self.training.stop(Deadline.after(seconds))
        if termed or killed:
            self.reporter.event(Event.TRAINING_STOPPED, termed=termed, killed=killed)
        self.training = None

    def _signal_cause(self) -> Cause | None:
        if self.signals.received is None:
            return None
        name = signal.Signals(self.signals.received).name
        return Cause("lost", str(self.me), f"its podagent was stopped by {name}")

    def run(self, deadline: float, asked_rank: int | None) -> Cause:
        raise NotImplementedError


class HeadSupervisor(Supervisor):
    """The head: holds the rendezvous, starts each step everywhere and decides the end."""

    def run(self, deadline: float, asked_rank: int | None) -> Cause:
        hub = mesh.Hub(self.rv, self.me, self.settings.peer_grace, self.settings.auth_token,
                       self.reporter, self.events)
        self._hub = hub
        hub.status, hub.logs = self.status, self.logs
        try:
            members = hub.gather(self.settings.worker_timeout, self.signals.check,
                                 self.settings.min_workers)
            self.layout = layout = self._layout(len(members) + 1, 0)
            steps = self.steps(layout)
            hub.start(lambda m: {"rank": m.rank, "nodes": layout.nodes, "head": self.me.pod,
                                 "step": steps[0].name if steps else ""})
            self._say_layout(members)
            cause: Cause | None = None
            for i, step in enumerate(steps):
                if i:
                    hub.broadcast({"go": {"step": step.name, "check": self.check_line}})
                self._enter(GangPhase.RUNNING, step=step.name)
                cause = self._head_step(step, hub)
                if cause is not None:
                    break
            cause = cause or Cause("succeeded")
            self._head_end(hub, cause)
            return cause
        finally:
            hub.close()

    def _say_layout(self, members: list[mesh.Member]) -> None:
        ranks = ", ".join([f"0 {self.me}", *(f"{m.rank} {m.peer}" for m in members)])
        came = "all" if len(members) == self.rv.workers else "only"
        self.reporter.say(f"{self.rv}: {came} {len(members) + 1} node(s) came; machine ranks: "
                          f"{ranks}")
        self.reporter.event(Event.RENDEZVOUS_DONE, nodes=len(members) + 1,
                            ranks={str(self.me): 0, **{str(m.peer): m.rank for m in members}})

    def _head_step(self, step: Step, hub: mesh.Hub) -> Cause | None:
        training = self._launch(step)
        running = [m for m in hub.members.values() if m.state in mesh.AT_WORK]
        waiting = {str(m.peer) for m in running}
        reports: list[dict[str, Any]] = []
        own_rc: int | None = None
        cause: Cause | None = None
        settle_until: float | None = None
        while True:
            signalled = self._signal_cause()
            if signalled:
                return signalled
            if own_rc is None and (rc := training.poll()) is not None:
                own_rc = rc
                training.finish_output()
                if rc:
                    cause = stronger(cause, Cause("failed", str(self.me), step=step.name, rc=rc))
                elif step.name == "data check":
                    reports.extend(self._reports())
            try:
                event = self.events.get(timeout=POLL)
            except queue.Empty:
                event = None
            if isinstance(event, mesh.Lost):
                cause = stronger(cause, Cause("lost", str(event.peer), event.why))
            elif isinstance(event, mesh.StopAsked):
                cause = stronger(cause, Cause("stopped", event.by))
            elif isinstance(event, mesh.Done) and event.step == step.name:
                waiting.discard(str(event.peer))
                if event.rc:
                    cause = stronger(cause, Cause("failed", str(event.peer), step=step.name,
                                                  rc=event.rc))
                reports.extend(event.reports)
            if cause is not None:
                if cause.kind in ("lost", "stopped"):
                    return cause
                settle_until = settle_until or time.monotonic() + SETTLE
                if time.monotonic() >= settle_until:
                    return cause
                continue
            if own_rc == 0 and not waiting:
                self.training = None
                return self._judge(step, reports)

    def _judge(self, step: Step, reports: list[dict[str, Any]]) -> Cause | None:
        if step.name != "data check":
            return None
        assert self.layout is not None
        verdict = datacheck.judge(reports, self.layout.nodes * self.layout.procs_per_node)
        self.reporter.event(Event.DATA_CHECK, ok=verdict.ok, line=verdict.line,
                            **dict(verdict.figures))
        if not verdict.ok:
            return Cause("overlap", str(self.me), verdict.line)
        self.reporter.say(verdict.line)
        self.check_line = verdict.line
        return None

    def _head_end(self, hub: mesh.Hub, cause: Cause) -> None:
        self._enter(GangPhase.ENDING, cause=cause.kind, pod=cause.pod)
        if cause.kind != "succeeded":
            self.reporter.say(f"ending the run on every pod: {self._describe(cause)}")
        hub.end(cause.to_wire())
        self._stop_training(hurried=self.signals.received is not None)
        left = hub.wait_out(Deadline.after(self.settings.stop_timeout + END_WAIT))
        if left:
            self.reporter.warn(f"worker(s) still there after the end: "
                               f"{', '.join(map(str, left))}")
        hub.answer_stoppers({"stopped": {"pods": len(hub.members) + 1,
                                         "left": [str(p) for p in left]}})
        self._enter(GangPhase.DONE, cause=cause.kind)

    def _describe(self, cause: Cause) -> str:
        error = cause.error("", self.plan.launcher.name)
        return str(error) if error else "succeeded"

    # --- what `podagent status` and `logs` are told ----------------------------------------------

    def status(self) -> dict[str, Any]:
        hub = self._hub
        now = time.monotonic()
        pods = [{"pod": self.me.pod, "addr": self.me.addr, "role": "head", "rank": 0,
                 "state": self.phase.value, "silent_s": 0.0}]
        for m in (hub.members.values() if hub else ()):
            pods.append({"pod": m.peer.pod, "addr": m.peer.addr, "role": "worker",
                         "rank": m.rank, "state": m.state,
                         "silent_s": round(now - m.last_seen, 1)})
        return {"kind": "no-ray", "run": self.settings.run_name,
                "launcher": self.plan.launcher.name, "phase": self.phase.value,
                "step": self.step_name, "uptime_s": round(time.time() - self.started, 1),
                "nodes": self.layout.nodes if self.layout else self.rv.workers + 1,
                "pods": sorted(pods, key=lambda p: p["rank"])}

    def logs(self, offset: int) -> dict[str, Any]:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, offset))
                chunk = f.read(LOG_CHUNK)
        except OSError:
            chunk = b""
        return {"text": chunk.decode(errors="replace"), "offset": max(0, offset) + len(chunk),
                "over": self.phase in (GangPhase.ENDING, GangPhase.DONE), "step": self.step_name}


class WorkerSupervisor(Supervisor):
    """A worker: joins, runs each step the head starts, and follows the head's word."""

    def run(self, deadline: float, asked_rank: int | None) -> Cause:
        link = mesh.Link(self.rv, self.me, self.settings.peer_grace, self.settings.auth_token,
                         self.reporter, self.events)
        try:
            go = link.join(deadline, self.settings.head_timeout, asked_rank, self.signals.sleep,
                           self.signals.check)
            link.head = mesh.Peer(self.rv.head_ip, str(go.get("head") or ""))
            self.layout = layout = self._layout(int(go["nodes"]), int(go["rank"]))
            self.reporter.say(f"{self.rv}: this pod is machine {layout.machine_rank} of "
                              f"{layout.nodes}")
            self.reporter.event(Event.RENDEZVOUS_DONE, nodes=layout.nodes,
                                rank=layout.machine_rank)
            steps = {s.name: s for s in self.steps(layout)}
            step: Step | None = self._step_named(steps, go.get("step"))
            cause: Cause | None = None
            while step is not None and cause is None:
                self._enter(GangPhase.RUNNING, step=step.name)
                cause, next_name = self._worker_step(step, link)
                step = self._step_named(steps, next_name) if next_name else None
            cause = cause or Cause("succeeded")
            self._enter(GangPhase.ENDING, cause=cause.kind, pod=cause.pod)
            self._stop_training(hurried=self.signals.received is not None)
            self._enter(GangPhase.DONE, cause=cause.kind)
            return cause
        finally:
            link.close()

    @staticmethod
    def _step_named(steps: Mapping[str, Step], name: object) -> Step:
        if name not in steps:
            raise InputError(f"the head runs the {name} step, which this pod's command has not: "
                             f"every pod must run the same podagent command (this one: "
                             f"{', '.join(steps) or 'no step'})")
        return steps[str(name)]

    def _worker_step(self, step: Step, link: mesh.Link) -> tuple[Cause | None, str | None]:
        """(the run's end, or None and the next step's name)."""
        training = self._launch(step)
        reported = False
        while True:
            signalled = self._signal_cause()
            if signalled:
                link.send({"leaving": signalled.detail})
                return signalled, None
            if not reported and (rc := training.poll()) is not None:
                training.finish_output()
                reports = self._reports() if step.name == "data check" and rc == 0 else ()
                link.send({"done": {"step": step.name, "rc": rc,
                                    "reports": datacheck.compact(reports)}})
                reported = True
                self.training = None if rc == 0 else training
            try:
                event = self.events.get(timeout=POLL)
            except queue.Empty:
                continue
            if isinstance(event, mesh.Lost):
                return Cause("lost", str(link.head), event.why), None
            if isinstance(event, mesh.FromHead) and event.kind == "end":
                return Cause.from_wire(event.body), None
            if isinstance(event, mesh.FromHead) and event.kind == "go" and reported:
                if event.body.get("check"):
                    self.reporter.say(str(event.body["check"]))
                return None, str(event.body.get("step"))


def run(supervisor: Supervisor, deadline: float, asked_rank: int | None) -> Cause:
    """Run this pod's part, whatever its role; the cause the run ended with. A signal's own
    pod raises Interrupted once its training is stopped and the others are told."""
    try:
        cause = supervisor.run(deadline, asked_rank)
    finally:
        supervisor._stop_training(hurried=True)
    if supervisor.signals.received is not None and cause.pod == str(supervisor.me):
        raise Interrupted(supervisor.signals.received)
    return cause
