"""`podagent torchrun` and `podagent accelerate` on this pod: the engine without Ray, as a start
(run/start.py) runs it (the command line picks it by PODAGENT_LAUNCHER). Its role keeps the
run's ledger on every pod (each pod's own): a start after lost pods is a restart of the run
(run/restarts.py), and the supervised run.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import Any

from podagent import extras
from podagent.config import Settings
from podagent.errors import HeadUnreachable, InputError
from podagent.gang import mesh
from podagent.gang.launchers import (
    Accelerate,
    Launcher,
    Torchrun,
    rendezvous_id,
    wait_limit,
)
from podagent.gang.supervisor import TRAINING, HeadSupervisor, Plan, WorkerSupervisor
from podagent.gang.supervisor import run as supervise
from podagent.platform.roles import Role, RoleDecision, detect_role
from podagent.report import Reporter
from podagent.run import beacon, restarts, resume
from podagent.run import start as run_start
from podagent.run.ledger import Ledger
from podagent.run.policy import Cause
from podagent.waiting import Signals

LAUNCHERS: dict[str, type[Torchrun] | type[Accelerate]] = {"torchrun": Torchrun,
                                                           "accelerate": Accelerate}


def launcher_for(name: str, user_args: Sequence[str]) -> Launcher:
    """The launcher with the user's arguments split and checked (bad input raises here,
    before anything starts)."""
    return LAUNCHERS[name](user_args)


class GangRole:
    """The head or a worker of a run without Ray (torchrun or accelerate: PODAGENT_LAUNCHER, the
    launcher's arguments the job's), as a start runs it."""

    keeps_ledger = True  # each pod its own: its starts, its restarts, its end

    def __init__(self, settings: Settings, launcher_args: Sequence[str],
                 data_check: bool = False, loader: str | None = None):
        self.settings, self.data_check, self.loader = settings, data_check, loader
        # The command's own (`podagent torchrun ARGS`), none included; PODAGENT_JOB only for
        # a bare `podagent` with PODAGENT_LAUNCHER set.
        self.launcher_args = tuple(launcher_args)
        self.name = settings.launcher
        self.decision: RoleDecision = detect_role(settings)
        self.asked_rank: int | None = None
        self._launcher: Launcher | None = None

    @property
    def launcher(self) -> Launcher:
        if self._launcher is None:
            raise RuntimeError("the launcher is made by check()")
        return self._launcher

    def check(self) -> None:
        """The optional parts, the data check's loader, the launcher's arguments and the
        machine rank asked: bad input is one line and exit 2, now."""
        name, settings = self.name, self.settings
        extras.require_torch(f"podagent {name}")
        if name == "accelerate":
            extras.require("accelerate", "podagent accelerate")
        if self.loader is not None:
            if not self.data_check:
                raise InputError("--loader goes with --data-check")
            from podagent.gang import datacheck

            datacheck.check_loader_spec(self.loader)
        launcher = self._launcher = launcher_for(name, self.launcher_args)
        if not launcher.script and not self.data_check:
            raise InputError(f"podagent {name} needs a training script: podagent {name} "
                             f"[OPTIONS] [--] SCRIPT ARGS (or --data-check)")
        self.asked_rank = launcher.requested_rank(settings, self.decision.role)

    def dry_run(self) -> None:
        _dry_run(self.settings, self.launcher, self.decision.role, self.decision.reason,
                 self.data_check, self.loader)

    def greeting(self) -> tuple[str, dict[str, Any]]:
        return self.launcher.name, {"launcher": self.launcher.name}

    def begin(self, reporter: Reporter) -> None:
        pass

    def run(self, start: run_start.Start, ending: run_start.Ending) -> None:
        settings, reporter, ledger = self.settings, start.reporter, start.ledger
        assert ledger is not None  # keeps_ledger
        restart = restarts.after_lost_starts(settings, ledger, reporter)
        if restart:
            restarts.back_off(restart, reporter, start.signals)
        try:
            cause, me, head_addr = _supervised(
                settings, self.launcher, self.decision, reporter, start.signals,
                self.data_check, self.loader, self.asked_rank, ledger,
                restart.n if restart else 0)
        except mesh.HeadSaysOver as said:
            over = beacon.read(said.line, settings.run_name, settings.auth_token)
            if over is None:
                raise HeadUnreachable(f"{said}: not this run's head, or not proven with the "
                                      f"cluster token") from None
            ending.after_run = over.heard(reporter, said.head, settings.after_run)
            return
        if head_addr:
            ending.over_word = (head_addr, [])
        error = cause.error(me, self.launcher.name, settings)
        if error is not None:
            raise error


def _supervised(settings: Settings, launcher: Launcher, decision: RoleDecision,
                reporter: Reporter, signals: Signals, data_check: bool, loader: str | None,
                asked_rank: int | None, ledger: Ledger, restarts_before: int
                ) -> tuple[Cause, str, str | None]:
    """The cause the run ended with, this pod as its peers name it, and (the head) its
    address."""
    from podagent.platform import discovery
    from podagent.run import pod_setup

    role = decision.role
    name = settings.pod_name
    deadline = 0.0
    if role is Role.HEAD:
        setup = pod_setup.prepare(settings, Role.HEAD, reporter)
        pod_setup.check_gpus(settings, reporter, signals, setup.nccl)
        head_ip = setup.node_ip
    else:
        finder = discovery.HeadFinder(settings, reporter, signals)
        where = finder.locate()
        reporter.say(f"head found at {where.ip} ({where.how})")
        setup = pod_setup.prepare(settings, Role.WORKER, reporter, head_ip=where.ip)
        pod_setup.check_gpus(settings, reporter, signals, setup.nccl)
        head_ip, deadline = where.ip, finder.deadline
    me = mesh.Peer(setup.node_ip, name)
    rv = mesh.Rendezvous(rendezvous_id(settings, head_ip), head_ip, settings.supervisor_port,
                         settings.expected_workers)
    reporter.say(f"{rv}: {settings.expected_workers + 1} node(s) x "
                 f"{launcher.procs_per_node(setup.gpus)} "
                 f"process(es); torch's rendezvous at {head_ip}:{settings.rendezvous_port}")
    plan = Plan(launcher, data_check, loader, tuple(launcher.script),
                dict(setup.nccl.variables), setup.gpus)
    kind = HeadSupervisor if role is Role.HEAD else WorkerSupervisor
    supervisor = kind(settings, decision, plan, me, rv, reporter, signals, settings.run_dir,
                      deadline, asked_rank, ledger, restarts_before)
    return (supervise(supervisor), str(me),
            head_ip if role is Role.HEAD else None)


def _dry_run(settings: Settings, launcher: Launcher, role: Role, reason: str,
             data_check: bool, loader: str | None) -> None:
    from podagent.gang.launchers import Layout, data_check_step
    from podagent.run import pod_setup
    from podagent.run.shell import reporter_for

    reporter = reporter_for(settings, role.value, pod="dry-run")
    reporter.say(f"dry run: this pod would be the {role.value} ({reason}) of run "
                 f"{settings.run_name} without Ray ({launcher.name}), logs in "
                 f"{settings.run_dir}")
    setup = pod_setup.prepare(settings, role, reporter)
    pod_setup.say_gpu_check(settings, reporter)
    head = setup.node_ip if role is Role.HEAD else "HEAD"
    nodes = settings.expected_workers + 1
    rank = 0 if role is Role.HEAD else (launcher.requested_rank(settings, role) or 1)
    layout = Layout(role, nodes, rank, setup.node_ip, head, settings.rendezvous_port,
                    setup.gpus, launcher.procs_per_node(setup.gpus),
                    rendezvous_id(settings, head), wait_limit(settings, role))
    steps = []
    if data_check:
        steps.append(data_check_step(launcher, layout, settings.run_dir / "data-check",
                                     loader, setup.nccl.variables))
    if launcher.script:
        script = resume.starting(settings, launcher.script, reporter).command
        steps.append(launcher.step(TRAINING, layout, script, setup.nccl.variables))
    reporter.say(f"would hold podagent's rendezvous at {head}:{settings.supervisor_port} for "
                 f"{nodes} node(s), then run" + ("" if role is Role.HEAD else
                                                 f" (machine rank {rank} as an example)"))
    for said in dict.fromkeys(line for step in steps for line in step.lines):
        reporter.say(f"  {said}")
    for step in steps:
        reporter.say(f"  {step.name}: {shlex.join(step.argv)}")
