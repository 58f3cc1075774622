"""A run without Ray, supervised on every pod: podagent's rendezvous, then each step (the data
check, the training) launched on every pod at once, and the run's end decided in one place.

Policy apart from mechanism: the kernel's policy (run/policy.py: `Cause`, `stronger`) says which
of several things that went wrong ends the run and how each pod exits (`Cause.error`); the
`Supervisor` moves through its phases, watches its launcher and its peers, and acts.

The head decides for everyone. A worker reports its step's end to the head and waits for the
head's word; only a head that is gone is decided by the worker itself. When several things go
wrong at once (a pod killed: its peers' collectives fail a moment later), the strongest cause
seen within SETTLE seconds of the first failure wins, so every pod names the pod that was lost,
not the failures that followed.
"""

from __future__ import annotations

import os
import queue
import shlex
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from podagent import process
from podagent.config import Settings
from podagent.config.policy import CLUSTER_TOKEN, child_environ
from podagent.errors import (
    DeadlineReached,
    InputError,
    Interrupted,
    PodagentError,
    RunHung,
)
from podagent.gang import datacheck, mesh
from podagent.gang.launchers import Launcher, Layout, Step, data_check_step
from podagent.platform.roles import RoleDecision
from podagent.report import JobOutput, Reporter
from podagent.run import cap, hangs, policy, restarts, resume, stacks
from podagent.run.hangs import DUMP_WAIT
from podagent.run.ledger import SUCCEEDED, Ledger
from podagent.run.lifecycle import Lifecycle
from podagent.run.policy import Cause, stronger
from podagent.run.progress import HEARTBEAT_FILE, HEARTBEAT_VARIABLE, ProgressWatch
from podagent.waiting import Deadline, Signals
from podagent.wire import Ending, Event, GangPhase

SETTLE = 1.0  # seconds a first failure waits for a stronger cause (a lost pod) to show
POLL = 0.1  # how often the launcher's exit is looked at between events
LOG_CHUNK = 1 << 18  # bytes of the training log per `podagent logs` answer
TRAINING_LOG = "training.log"
TRAINING = "training"  # the step that runs the user's script (the other: the data check)
END_WAIT = 5.0  # seconds beyond the stop timeout the head waits for its workers to be out
RESUME_WORDS, RESUME_WORD = 64, 4096  # what a head's resume word may hold


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


class Supervisor(Lifecycle[GangPhase]):
    """One pod's side of a run without Ray, as the kernel's named lifecycle: RENDEZVOUS ->
    RUNNING (once per step: the data check, then the training) -> ENDING -> DONE, its
    launcher's process stopped in the teardown within the lifecycle's budget; the head and
    the worker each add their part of the protocol. A signal is no error between states here:
    the handlers watch for it and end the run in order (the head tells every worker first),
    and `run()` below raises Interrupted once the run is over."""

    FIRST, LAST, SUCCESS = GangPhase.RENDEZVOUS, GangPhase.DONE, SUCCEEDED

    def __init__(self, settings: Settings, decision: RoleDecision, plan: Plan, me: mesh.Peer,
                 rv: mesh.Rendezvous, reporter: Reporter, signals: Signals, run_dir: Path,
                 deadline: float = 0.0, asked_rank: int | None = None,
                 ledger: Ledger | None = None, restarts_before: int = 0):
        super().__init__(settings, decision, reporter, signals)
        self.role, self.plan, self.me, self.rv = decision.role, plan, me, rv
        self.run_dir, self.deadline, self.asked_rank = run_dir, deadline, asked_rank
        self.events: queue.Queue[mesh.Event] = queue.Queue()
        self.cause: Cause | None = None  # how the run ended, once it has
        self._next: Step | None = None  # the step RUNNING runs next
        self._steps: list[Step] = []  # the head: every step, in order, once the layout is known
        self._by_name: dict[str, Step] = {}  # a worker: its steps, for the head's word
        self._link: mesh.Link | None = None  # a worker's
        self.step_name = ""
        self.training: process.ManagedProcess | None = None
        self.started = time.time()
        self.layout: Layout | None = None
        self.check_line = ""  # the data check's verdict, when it passed
        self._hub: mesh.Hub | None = None  # the head's
        self._said: set[str] = set()
        self.ledger, self.restarts_before = ledger, restarts_before
        checkpoints = settings.checkpoint_dir
        # The training's output reaches the watch as it comes (_Watched), not read back
        # from the training log: a volume that refuses the log must not make a run that
        # prints look hung.
        self.watch = ProgressWatch(settings.hang_timeout,
                                   checkpoints=Path(checkpoints) if checkpoints else None,
                                   heartbeat=run_dir / HEARTBEAT_FILE)
        self.hangs = 0  # hangs seen in this start
        self.cap = cap.DeadlineWatch(settings, reporter)  # the head's: PODAGENT_DEADLINE

    @property
    def log_path(self) -> Path:
        return self.run_dir / TRAINING_LOG

    @property
    def phase(self) -> GangPhase:
        return self.state

    def handlers(self) -> dict[GangPhase, Callable[[], GangPhase]]:
        """The same phases on every pod; the head's and a worker's handlers differ."""
        return {GangPhase.RENDEZVOUS: self._rendezvous, GangPhase.RUNNING: self._running,
                GangPhase.ENDING: self._end}

    def _rendezvous(self) -> GangPhase:
        raise NotImplementedError

    def _running(self) -> GangPhase:
        raise NotImplementedError

    def _end(self) -> GangPhase:
        raise NotImplementedError

    def _check_signals(self) -> None:
        pass  # every handler turns a signal into the run's end (`_signal_cause`)

    def _state_fields(self) -> dict[str, Any]:
        if self.state is GangPhase.RUNNING and self._next is not None:
            return {"step": self._next.name}
        if self.state is GangPhase.ENDING and self.cause is not None:
            return {"cause": self.cause.kind, "pod": self.cause.pod}
        return {}

    def _ending(self, cause: Cause) -> GangPhase:
        self.cause = cause
        return GangPhase.ENDING

    def error(self) -> PodagentError | None:
        """What this pod exits with once the run ended (None: success)."""
        assert self.cause is not None
        return self.cause.error(str(self.me), self.plan.launcher.name, self.settings)

    def _finished_outcome(self) -> str:
        if self.signals.received is not None and self.cause is not None \
                and self.cause.pod == str(self.me):
            return Interrupted.__name__  # `run()` raises it once the others were told
        error = self.error()
        return type(error).__name__ if error is not None else self.SUCCESS

    def _teardown(self, outcome: str) -> None:
        self._guarded("stop the training", lambda: self._stop_training(hurried=True))

    def steps(self, layout: Layout) -> list[Step]:
        plan, out = self.plan, []
        if plan.data_check:
            out.append(data_check_step(plan.launcher, layout, self.run_dir / "data-check",
                                       plan.loader, plan.nccl))
        if plan.script:
            out.append(plan.launcher.step(TRAINING, layout, plan.script, plan.nccl))
        return out

    def _layout(self, nodes: int, rank: int) -> Layout:
        from podagent.gang.launchers import wait_limit

        gpus = self.plan.gpus
        return Layout(self.role, nodes, rank, self.me.addr, self.rv.head_ip,
                      self.settings.rendezvous_port, gpus,
                      self.plan.launcher.procs_per_node(gpus), self.rv.rdzv_id,
                      wait_limit(self.settings, self.role))

    # --- one step's launcher -------------------------------------------------------------------

    def _as_it_starts(self, step: Step) -> Step:
        """The training as it starts now: with the resume arguments while the checkpoint
        directory holds a checkpoint (the kernel's rule, the same as for a Ray job), on its
        first start, after a restart and in a restarted container alike; the head decides
        for every pod (`_training_script`)."""
        if step.name != TRAINING or self.layout is None:
            return step
        script = self._training_script()
        if script == self.plan.script:
            return step
        return self.plan.launcher.step(step.name, self.layout, script, self.plan.nccl)

    def _training_script(self) -> tuple[str, ...]:
        raise NotImplementedError

    def _launch(self, step: Step) -> process.ManagedProcess:
        step = self._as_it_starts(step)
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
               **step.env, HEARTBEAT_VARIABLE: os.path.abspath(self.run_dir / HEARTBEAT_FILE),
               stacks.STACKS_VARIABLE: os.path.abspath(self.stacks_dir)}
        self.reporter.say(f"{step.name}: {shlex.join(step.argv)}")
        self.reporter.event(Event.STEP_STARTED, step=step.name, argv=list(step.argv))
        # Its output goes to the pod's screen and to the training log `podagent logs` reads.
        training = process.ManagedProcess(step.name, step.argv, env, self.log_path,
                                          tee=_Watched(self.reporter.job_output(), self.watch),
                                          whole_pod=True)
        training.start()
        self.training = training
        self.watch.reset(f"the start of the {step.name}")
        return training

    @property
    def stacks_dir(self) -> Path:
        return hangs.stacks_dir(self.run_dir)

    def _quiet(self) -> float | None:
        """Seconds since this pod's training last made progress (None: none runs, or no
        watch)."""
        return self.watch.quiet() if self.training is not None and self.watch.enabled else None

    def _dump(self, n: int) -> stacks.PodDump:
        """This pod's ranks' stacks, into the hang's folder."""
        launcher = self.training.pid if self.training is not None else None
        dumped = stacks.dump_pod(str(self.me), stacks.training_targets(launcher),
                                 hangs.folder(self.run_dir, n), self.stacks_dir)
        self.reporter.say(f"hang {n}: this pod's stacks dumped in {dumped.seconds:.1f} s to "
                          f"{dumped.folder}")
        return dumped

    def _clear_reports(self) -> None:
        folder = self.run_dir / "data-check"
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("rank-*.json"):
            old.unlink(missing_ok=True)

    def _reports(self) -> tuple[dict[str, Any], ...]:
        return tuple(datacheck.read_reports(self.run_dir / "data-check", str(self.me)))

    def _stop_training(self, hurried: bool) -> None:
        """TERM, then KILL at the stop timeout (at most 3 s when hurried: a signal came, or
        the run is broken, policy.hurried_stop; never past the lifecycle's budget then)."""
        if self.training is None:
            return
        want = self.settings.stop_timeout
        deadline = self._deadline(min(want, 3.0) if hurried else want,
                                  hurried=min(want, 3.0))
        termed, killed = self.training.stop(deadline)
        if termed or killed:
            self.reporter.event(Event.TRAINING_STOPPED, termed=termed, killed=killed)
        self.training = None

    def _signal_cause(self) -> Cause | None:
        if self.signals.received is None:
            return None
        name = signal.Signals(self.signals.received).name
        return Cause(Ending.LOST, str(self.me), f"its podagent was stopped by {name}")



class _Watched:
    """The training's output as it comes: on the pod's screen (the reporter's JobOutput) and,
    as progress, to the hang watch."""

    def __init__(self, screen: JobOutput, watch: ProgressWatch):
        self.screen, self.watch = screen, watch

    def write(self, chunk: bytes) -> None:
        self.screen.write(chunk)
        self.watch.saw_output(chunk.decode(errors="replace"))

    def close(self) -> None:
        self.screen.close()

    def warn(self, message: str) -> None:
        self.screen.warn(message)


class HeadSupervisor(Supervisor):
    """The head: holds the rendezvous, starts each step everywhere and decides the end; it
    also watches the whole run's progress (its own and what each worker's beats say) and,
    on a hang, has every pod dump its stacks, then restarts the step or ends the run."""

    _again = False  # the step runs again (a restart after a hang)
    _resumed: tuple[str, ...] | None = None  # the training as decided for its next start

    def _rendezvous(self) -> GangPhase:
        hub = mesh.Hub(self.rv, self.me, self.settings.peer_grace, self.settings.auth_token,
                       self.reporter, self.events)
        self._hub = hub
        hub.status, hub.logs = self.status, self.logs
        try:
            members = hub.gather(self.settings.worker_timeout, self._check_gathering,
                                 self.settings.min_workers)
        except DeadlineReached as capped:  # the pods that came were told (Hub.gather)
            return self._ending(Cause(Ending.DEADLINE, str(self.me), str(capped)))
        self.layout = layout = self._layout(len(members) + 1, 0)
        self._steps = list(self.steps(layout))
        first = self._steps[0].name if self._steps else ""
        told = self._resume_word() if first == TRAINING else {}
        hub.start(lambda m: {"rank": m.rank, "nodes": layout.nodes, "head": self.me.pod,
                             "step": first, **told})
        self._say_layout(members)
        return self._after(-1)

    def _after(self, index: int) -> GangPhase:
        """The step after the one at `index`, or the run's success."""
        if index + 1 < len(self._steps):
            self._next = self._steps[index + 1]
            return GangPhase.RUNNING
        return self._ending(Cause(Ending.SUCCEEDED))

    def _running(self) -> GangPhase:
        hub, step = self._hub, self._next
        assert hub is not None and step is not None
        capped = self._capped()  # no pod is told to start a step past the deadline
        if capped is not None:
            return self._ending(capped)
        index = self._steps.index(step)
        if index or self._again:
            told = self._resume_word() if step.name == TRAINING else {}
            hub.broadcast({"go": {"step": step.name, "check": self.check_line, **told}})
        self._again = False
        cause = self._head_step(step, hub)
        if self._again:  # restarted after a hang: the same step again, on every pod
            return GangPhase.RUNNING
        return self._ending(cause) if cause is not None else self._after(index)

    def _end(self) -> GangPhase:
        assert self._hub is not None and self.cause is not None
        self._head_end(self._hub, self.cause)
        return GangPhase.DONE

    def _resume_word(self) -> dict[str, Any]:
        """Whether the training about to start resumes, decided once for every pod (a
        worker's checkpoint directory may be its own, and ranks of one run must never start
        at different steps): the head's word in the `go` that starts it."""
        found = resume.starting(self.settings, self.plan.script, self.reporter)
        self._resumed = found.command
        return {"resume": list(found.args)}

    def _training_script(self) -> tuple[str, ...]:
        return self._resumed if self._resumed is not None else self.plan.script

    def _teardown(self, outcome: str) -> None:
        super()._teardown(outcome)
        if self._hub is not None:
            self._guarded("close the supervisor port", self._hub.close)

    def _say_layout(self, members: list[mesh.Member]) -> None:
        ranks = ", ".join([f"0 {self.me}", *(f"{m.rank} {m.peer}" for m in members)])
        came = "all" if len(members) == self.rv.workers else "only"
        self.reporter.say(f"{self.rv}: {came} {len(members) + 1} node(s) came; machine ranks: "
                          f"{ranks}")
        self.reporter.event(Event.RENDEZVOUS_DONE, nodes=len(members) + 1,
                            ranks={str(self.me): 0, **{str(m.peer): m.rank for m in members}})

    def _check_gathering(self) -> None:
        """The rendezvous's waits: a signal, or the run's deadline (nothing launched past it)."""
        self.signals.check()
        capped = self.cap.reached()
        if capped is not None:
            raise capped

    def _capped(self) -> Cause | None:
        capped = self.cap.reached()
        return None if capped is None else Cause(Ending.DEADLINE, str(self.me), str(capped))

    def _head_step(self, step: Step, hub: mesh.Hub) -> Cause | None:
        capped = self._capped()  # a step (a restart after a hang too) never starts past it
        if capped is not None:
            return capped
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
                    cause = stronger(cause, Cause(Ending.FAILED, str(self.me), step=step.name,
                                                  rc=rc))
                elif step.name == "data check":
                    reports.extend(self._reports())
            try:
                event = self.events.get(timeout=POLL)
            except queue.Empty:
                event = None
            if isinstance(event, mesh.Lost):
                cause = stronger(cause, Cause(Ending.LOST, str(event.peer), event.why))
            elif isinstance(event, mesh.StopAsked):
                cause = stronger(cause, Cause(Ending.STOPPED, event.by))
            elif isinstance(event, mesh.Done) and event.step == step.name:
                waiting.discard(str(event.peer))
                if event.rc:
                    cause = stronger(cause, Cause(Ending.FAILED, str(event.peer), step=step.name,
                                                  rc=event.rc))
                reports.extend(event.reports)
            capped = self._capped()
            if capped is not None:
                cause = stronger(cause, capped)
            if cause is not None:
                if cause.kind in (Ending.LOST, Ending.STOPPED, Ending.DEADLINE):
                    return cause
                settle_until = settle_until or time.monotonic() + SETTLE
                if time.monotonic() >= settle_until:
                    return cause
                continue
            if own_rc == 0 and not waiting:
                self.training = None
                return self._judge(step, reports)
            quiet = self._run_quiet(hub)
            if quiet is not None and quiet >= self.settings.hang_timeout:
                return self._hang(hub, quiet, waiting)

    def _run_quiet(self, hub: mesh.Hub) -> float | None:
        """Seconds since any pod's training last made progress, as the head's own watch
        judges a hang: None when the head does not watch (PODAGENT_HANG_TIMEOUT=0 on the
        head), whatever a worker with a watch of its own reports in its beats."""
        return hub.quiet(self._quiet()) if self.watch.enabled else None

    # --- a hang ------------------------------------------------------------------------------

    def _hang(self, hub: mesh.Hub, quiet: float, waiting: set[str]) -> Cause | None:
        """No progress on any pod for PODAGENT_HANG_TIMEOUT: every pod dumps its ranks' stacks
        and the culprit is named; then the step is restarted on every pod (None) or, with
        restarts off or used up, the run ends (its cause). A pod lost or a stop asked for
        meanwhile ends it so instead."""
        self.hangs += 1
        n = hangs.next_number(self.run_dir)
        started = hangs.announce(self.settings, self.reporter, n, quiet, self.watch.last_seen)
        hub.broadcast({"dump": {"n": n}})
        dumps = {str(self.me): self._dump(n)}
        asked = [str(m.peer) for m in hub.members.values() if m.state in mesh.AT_WORK]
        deadline = Deadline.after(DUMP_WAIT)
        while any(pod not in dumps for pod in asked) and deadline.left() > 0:
            event = self._next_event()
            if isinstance(event, mesh.Dumped):
                dumps[str(event.peer)] = stacks.PodDump.from_wire(event.body, str(event.peer))
            elif isinstance(event, mesh.Done):  # its training ended meanwhile: none to halt
                waiting.discard(str(event.peer))
            elif (ended := self._ends_run(event)) is not None:  # a signal too, between events
                return ended
        for pod in asked:
            dumps.setdefault(pod, hangs.missing(pod))
        verdict = hangs.conclude(self.settings, self.reporter, n, quiet, self.watch.last_seen,
                                 dumps, started)
        cause = Cause(Ending.HUNG, ", ".join(verdict.pods), verdict.line)
        return self._restart_after_hang(hub, cause, waiting)

    def _next_event(self) -> mesh.Event | None:
        try:
            return self.events.get(timeout=POLL)
        except queue.Empty:
            return None

    def _ends_run(self, event: mesh.Event | None) -> Cause | None:
        """A signal, a lost pod, a stop asked for or the run's deadline, while the head
        handles a hang."""
        signalled = self._signal_cause() or self._capped()
        if signalled:
            return signalled
        if isinstance(event, mesh.Lost):
            return Cause(Ending.LOST, str(event.peer), event.why)
        if isinstance(event, mesh.StopAsked):
            return Cause(Ending.STOPPED, event.by)
        return None

    def _restart_after_hang(self, hub: mesh.Hub, cause: Cause, waiting: set[str]
                            ) -> Cause | None:
        settings = self.settings
        why = policy.restart_reason(settings, cause) or ""
        try:  # the ledger's restarts are every restart of the run, a lost pod's too: one budget
            restart = restarts.begin(
                settings, self.ledger, self.reporter, why,
                "stopping the training on every pod and starting it again (it resumes from "
                "its newest checkpoint)", Ending.HUNG,
                done=self.restarts_before + self.hangs - 1, culprits=cause.pod)
        except RunHung as final:
            return replace(cause, detail=f"{final}; {cause.detail}")
        hub.broadcast({"halt": {"n": self.hangs}})
        self._stop_training(hurried=policy.hurried_stop(settings, cause, False))
        deadline = Deadline.after(settings.stop_timeout + END_WAIT)
        while waiting and deadline.left() > 0:
            event = self._next_event()
            if isinstance(event, mesh.Done):
                waiting.discard(str(event.peer))
            elif (ended := self._ends_run(event)) is not None:  # a signal too, between events
                return ended
        if waiting:
            return Cause(Ending.LOST, ", ".join(sorted(waiting)),
                         f"its training did not stop within "
                         f"{settings.stop_timeout + END_WAIT:g} s of the head's halt")
        # Counted from the training's stop on every pod: stopping it is no pause.
        restarts.back_off(restart, self.reporter, self.signals, since=time.monotonic())
        self._again = True
        self.watch.reset(f"restart {restart.n}")
        return None

    def _judge(self, step: Step, reports: list[dict[str, Any]]) -> Cause | None:
        if step.name != "data check":
            return None
        assert self.layout is not None
        verdict = datacheck.judge(reports, self.layout.nodes * self.layout.procs_per_node)
        self.reporter.event(Event.DATA_CHECK, ok=verdict.ok, line=verdict.line,
                            **dict(verdict.figures))
        if not verdict.ok:
            return Cause(Ending.OVERLAP, str(self.me), verdict.line)
        self.reporter.say(verdict.line)
        self.check_line = verdict.line
        return None

    def _head_end(self, hub: mesh.Hub, cause: Cause) -> None:
        if cause.kind is not Ending.SUCCEEDED:
            self.reporter.say(f"ending the run on every pod: {self._describe(cause)}")
        hub.end(cause.to_wire())
        self._stop_training(hurried=policy.hurried_stop(self.settings, cause,
                                                        self.signals.received is not None))
        left = hub.wait_out(Deadline.after(self.settings.stop_timeout + END_WAIT))
        if left:
            self.reporter.warn(f"worker(s) still there after the end: "
                               f"{', '.join(map(str, left))}")
        hub.answer_stoppers({"stopped": {"pods": len(hub.members) + 1,
                                         "left": [str(p) for p in left]}})

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
                "hangs": self.hangs, "quiet_s": _rounded(self._run_quiet(hub) if hub else None),
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

    _told: list[str] | None = None  # the head's resume arguments for the next training

    def _resume_told(self, body: Mapping[str, Any]) -> list[str] | None:
        """The resume arguments in the head's `go`; None where it says none (a head of an
        earlier podagent: this pod decides as it did) or says it so that it is not a list of
        at most RESUME_WORDS short strings (said once: this pod decides then)."""
        told = body.get("resume")
        if told is None:
            return None
        if isinstance(told, list) and len(told) <= RESUME_WORDS and all(
                isinstance(w, str) and len(w) <= RESUME_WORD for w in told):
            return told
        self.reporter.warn("the head's resume word is not a list of short strings: this pod "
                           "decides by its own checkpoint directory")
        return None

    def _training_script(self) -> tuple[str, ...]:
        if self._told is None:
            return resume.starting(self.settings, self.plan.script, self.reporter).command
        return resume.as_told(self.settings, self.plan.script, self._told, self.reporter)

    def _check_joining(self) -> None:
        """The rendezvous's waits: a signal, or a head that never came past the deadline."""
        self.signals.check()
        cap.check_late(self.settings)

    def _rendezvous(self) -> GangPhase:
        link = mesh.Link(self.rv, self.me, self.settings.peer_grace, self.settings.auth_token,
                         self.reporter, self.events)
        link.quiet = self._quiet
        self._link = link
        go = link.join(self.deadline, self.settings.head_timeout, self.asked_rank,
                       self.signals.sleep, self._check_joining)
        link.head = mesh.Peer(self.rv.head_ip, str(go.get("head") or ""))
        self.layout = layout = self._layout(int(go["nodes"]), int(go["rank"]))
        self.reporter.say(f"{self.rv}: this pod is machine {layout.machine_rank} of "
                          f"{layout.nodes}")
        self.reporter.event(Event.RENDEZVOUS_DONE, nodes=layout.nodes,
                            rank=layout.machine_rank)
        self._by_name = {s.name: s for s in self.steps(layout)}
        self._next = self._step_named(self._by_name, go.get("step"))
        self._told = self._resume_told(go)
        return GangPhase.RUNNING

    def _running(self) -> GangPhase:
        assert self._link is not None and self._next is not None
        cause, next_name = self._worker_step(self._next, self._link)
        if cause is not None:
            return self._ending(cause)
        if not next_name:
            return self._ending(Cause(Ending.SUCCEEDED))
        self._next = self._step_named(self._by_name, next_name)
        return GangPhase.RUNNING

    def _end(self) -> GangPhase:
        self._stop_training(hurried=policy.hurried_stop(self.settings, self.cause,
                                                        self.signals.received is not None))
        return GangPhase.DONE

    def _teardown(self, outcome: str) -> None:
        super()._teardown(outcome)
        if self._link is not None:
            self._guarded("close the link to the head", self._link.close)

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
                return Cause(Ending.LOST, str(link.head), event.why), None
            if isinstance(event, mesh.FromHead) and event.kind == "end":
                return Cause.from_wire(event.body), None
            if isinstance(event, mesh.FromHead) and event.kind == "dump":
                n = event.body.get("n")
                link.send({"dumped": self._dump(n if isinstance(n, int) else 0).to_wire()})
            if isinstance(event, mesh.FromHead) and event.kind == "halt" and not reported:
                # The head restarts the step after a hang: this pod's part stops first.
                self._stop_training(hurried=policy.hurried_stop(
                    self.settings, Cause(Ending.HUNG), self.signals.received is not None))
                rc = training.poll()
                link.send({"done": {"step": step.name, "rc": -9 if rc is None else rc}})
                reported = True
            if isinstance(event, mesh.FromHead) and event.kind == "go" and reported:
                if event.body.get("check"):
                    self.reporter.say(str(event.body["check"]))
                self._told = self._resume_told(event.body)
                return None, str(event.body.get("step"))


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 1)


def run(supervisor: Supervisor) -> Cause:
    """Run this pod's part, whatever its role; the cause the run ended with. A signal's own
    pod raises Interrupted once its training is stopped and the others are told."""
    supervisor.run()
    cause = supervisor.cause
    assert cause is not None  # the lifecycle reached DONE through ENDING
    if supervisor.signals.received is not None and cause.pod == str(supervisor.me):
        raise Interrupted(supervisor.signals.received)
    return cause
