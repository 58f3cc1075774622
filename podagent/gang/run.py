"""`podagent torchrun` and `podagent accelerate` on this pod: the role, the run's directory,
events and ledger as for a Ray run, the supervised run, and what the pod does once it is over.

Exit codes are the command line's: it hands its mapping in, as for the Ray path.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable, Sequence

from podagent import __version__, process
from podagent.choices import AfterRun
from podagent.config import AFTER_RUN, Settings
from podagent.errors import HeadUnreachable, PodagentError
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
from podagent.run import beacon, policy, resume
from podagent.run.ledger import INTERNAL_ERROR, SUCCEEDED, Ledger, recall, record_or_warn
from podagent.run.policy import Cause
from podagent.waiting import Signals
from podagent.wire import Event

LAUNCHERS: dict[str, type[Torchrun] | type[Accelerate]] = {"torchrun": Torchrun,
                                                           "accelerate": Accelerate}


def launcher_for(name: str, user_args: Sequence[str]) -> Launcher:
    """The launcher with the user's arguments split and checked (bad input raises here,
    before anything starts)."""
    return LAUNCHERS[name](user_args)


def run(settings: Settings, launcher: Launcher, *, data_check: bool, loader: str | None,
        dry_run: bool, exit_code: Callable[[BaseException], int],
        outcome_code: Callable[[str], int],
        restartable: Callable[[int], bool] = lambda code: False) -> int:
    from podagent.run import after_run
    from podagent.run.shell import SUCCESS, install_signals, report_end, reporter_for, settle

    decision = detect_role(settings)
    role = decision.role
    asked_rank = launcher.requested_rank(settings, role)  # a contradiction: exit 2, now
    if dry_run:
        _dry_run(settings, launcher, role, decision.reason, data_check, loader)
        return SUCCESS
    reporter = reporter_for(settings, role.value, run_dir=settings.run_dir)
    reporter.say(f"podagent {__version__} {launcher.name}: this pod is the {role.value} "
                 f"({decision.reason}); run {settings.run_name}")
    reporter.event(Event.ROLE, role=role.value, reason=decision.reason, run=settings.run_name,
                   version=__version__, launcher=launcher.name)
    signals = install_signals(reporter)
    process.become_subreaper()  # the launcher's workers stay ours when it dies
    started = time.monotonic()
    ledger = Ledger.load(settings.run_dir, settings.run_name)
    finished = recall(ledger, settings.run_name, settings.run_dir, reporter)
    code = SUCCESS
    policy: AfterRun | None = None  # a worker told by its head that the run is over
    head_addr: str | None = None
    if finished:
        code = outcome_code(finished["outcome"])
    else:
        outcome = SUCCEEDED
        try:
            number = check_restarts(settings, ledger, reporter)
            if number:
                _back_off(settings, number, reporter, signals)
            cause, me, head_addr = _supervised(settings, launcher, decision, reporter, signals,
                                               data_check, loader, asked_rank, ledger, number)
            error = cause.error(me, launcher.name, settings)
            if error is not None:
                raise error
        except mesh.HeadSaysOver as said:
            over = beacon.read(said.line, settings.run_name, settings.auth_token)
            if over is None:
                outcome = HeadUnreachable.__name__
                code = report_end(HeadUnreachable(f"{said}: not this run's head, or not "
                                                  f"proven with the cluster token"),
                                  settings, reporter, exit_code)
            else:
                reporter.say(f"the head says run {over.run} is over ({over.outcome}, exit "
                             f"{over.code}): this pod was away when it closed; leaving")
                reporter.event(Event.EXIT, code=code)
                policy = AfterRun(over.after_run) if over.after_run in AFTER_RUN else None
                policy = policy or AfterRun(settings.after_run)
        except Exception as exc:
            outcome = type(exc).__name__ if isinstance(exc, PodagentError) else INTERNAL_ERROR
            code = report_end(exc, settings, reporter, exit_code)
        else:
            reporter.event(Event.EXIT, code=code)
        record_or_warn(lambda: ledger.ended(outcome, None), reporter)
        record_or_warn(lambda: ledger.exit_code(code), reporter)
    over = policy is not None or bool(ledger.finished)
    end = after_run.End(code, over=over, restartable=restartable(code))
    settle(settings, reporter, signals, end, started, policy,
           (head_addr, []) if head_addr else None)
    reporter.close()
    return code


# How a start ends when a pod of the run was lost or never came: the run is not over (the
# restarted containers start it again), but only so often.
LOSSES = ("PeerLost", "WorkersTimeout", "HeadUnreachable")


def check_restarts(settings: Settings, ledger: Ledger,
                   reporter: Reporter | None = None) -> int:
    """A run whose pods keep getting lost is restarted (RunPod starts the containers again,
    the script resumes from its checkpoint) as the kernel's restart policy allows: a pod
    gone for good must not keep the others restarting, billing, for ever. Each earlier start
    that ended so is one restart in the ledger's `restarts`, where a hang's restart is one too
    (the supervisor's): one PODAGENT_RESTARTS budget, whatever the mix of causes. The number
    of the restart this start is (0: none)."""
    counted = {entry.get("after_start") for entry in ledger.restarts}
    number = losses = 0
    for index, start in enumerate(ledger.data["starts"][:-1]):
        if start.get("outcome") not in LOSSES:
            continue
        losses += 1
        if index in counted:
            continue
        why = f"a pod was lost or missing ({start['outcome']})"
        number = policy.admit(settings, len(ledger.restarts),
                              f"run {settings.run_name}: a pod was lost or missing {losses} "
                              f"time(s)")
        entry = {"n": number, "reason": why, "after_start": index}
        if reporter is None:
            ledger.restarting(entry)
        else:  # counted in memory either way; a volume that refuses is a warning
            record_or_warn(lambda entry=entry: ledger.restarting(entry), reporter)
    return number


def _back_off(settings: Settings, number: int, reporter: Reporter, signals: Signals) -> None:
    wait = policy.backoff(settings, number)
    reporter.warn(f"RESTART {number}/{settings.restarts}: a pod of the run was lost; starting "
                  f"it again" + (f" after {wait:g} s (PODAGENT_RESTART_BACKOFF)" if wait else ""))
    reporter.event(Event.RESTART, n=number, of=settings.restarts, backoff_s=wait)
    if wait:
        signals.sleep(wait)


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
        head_ip = setup.node_ip
    else:
        finder = discovery.HeadFinder(settings, reporter, signals)
        where = finder.locate()
        reporter.say(f"head found at {where.ip} ({where.how})")
        setup = pod_setup.prepare(settings, Role.WORKER, reporter, head_ip=where.ip)
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
