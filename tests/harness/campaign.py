"""The fault campaign: a real cluster of pods (network namespaces on a bridge, a real DNS server
for `*.runpod.internal`, the real podagent in each pod) is driven to one state of its
lifecycle, one fault of a catalogue is injected there, the run is let go to its end, and the
outcome is checked against invariants, never against a log line:

  (a) every podagent ends (or, with PODAGENT_AFTER_RUN=stay, stays up idle) within a bound;
  (b) its exit code is one the README's table documents, and agrees with what it recorded
      (the `exit` event, the ledger's start entry, the outcome it gave the run);
  (c) when a podagent ends by itself, nothing of its run is left in its pod;
  (d) never two live jobs of the run at once (the job's processes, sampled all along);
  (e) the checkpoint, the logs and the ledger survive: whole, parseable, never shorter.

A pod is a container as RunPod runs one: podagent is its main process, and when it ends the
runtime kills what is left in the pod (tini's exit) and starts it again with the same volume
while the run is not over (the head's ledger does not say it finished, a worker left with an
error, podagent was killed), at most MAX_RESTARTS times a cell after the fault
(PODAGENT_AFTER_RUN=exit stands in for `stay`: a finished run stays finished); before the
fault, only a pod that gave up waiting for the other (exit 5 or 6: a slow bring-up), as often.
A pod sent SIGTERM is being stopped: it is not started again. A pod cut off the network is a
host that vanished: a worker is replaced by a new pod, a head is not.

A seed picks each cell's schedule (where a fault has several targets or variants, which one;
the pauses between the steps after the fault). The same seed runs the same schedule again.
Plain module (no pytest): tests/faults runs a sample, bench/faults.py the whole matrix.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from podagent.run import exits
from tests.fakes import reward_cmd
from tests.harness.agents import Agent, pod_run_dir
from tests.harness.pods import DnsServer, Pod, PodNetwork, _ip, _kill_netns_processes

CAMPAIGN_PREFIX = "pf"  # the campaign's networks (the e2e tests' are "pa", the benches' "pb")
RUN = "camp"
# Every podagent ends within this many seconds of the fault (invariant a): the slowest
# legitimate path is a worker that waits PODAGENT_HEAD_TIMEOUT for a head that vanished.
BOUND = 150.0
HEAD_TIMEOUT = WORKER_TIMEOUT = 45.0
FORM_TIMEOUT = 240.0  # a loaded 2-core machine: bring-up to the state of the cell
LEFTOVER_GRACE = 3.0  # after podagent exits, what it stopped gets this long to be gone
PROCESS_TIMEOUT = 30.0  # a process the fault kills is awaited this long (it may be starting)
MAX_RESTARTS = 2  # a pod's container started again after its process ended, in one cell
GAVE_UP_WAITING = (5, 6)  # the head's workers, a worker's head: not there within the timeout
CELL_BOUND = BOUND * (1 + MAX_RESTARTS)  # each start of a pod gets BOUND
VOLUME_SIZE = "16m"  # the tmpfs of a cell whose fault fills the volume
CHECKPOINT = "weights"
REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"

MISSING = object()  # the ledger does not say

STATES = ("discovering", "joining", "waiting", "reward", "submitting", "running", "recovering",
          "tearing_down", "staying")
# Which podagents run when the fault comes: the worker is not started yet while the head waits
# for it, and has been lost while the head recovers.
BOTH, HEAD_ONLY = ("head", "worker"), ("head",)
UP = {state: HEAD_ONLY if state in ("waiting", "recovering") else BOTH for state in STATES}

# The job: checkpoints once (or reads its checkpoint back when resumed), says it started, and
# trains until the cell's marker file appears.
JOB = """
import os, sys, time
CHECKPOINT = sys.argv[2]
marker, ckpt = sys.argv[1], os.path.join(os.environ["PODAGENT_CHECKPOINT_DIR"], "step-1")
if "--load_checkpoint" in sys.argv:
    with open(os.path.join(ckpt, "model.txt")) as f:
        assert f.read() == CHECKPOINT, "the checkpoint changed"
else:
    os.makedirs(ckpt + ".tmp", exist_ok=True)
    with open(os.path.join(ckpt + ".tmp", "model.txt"), "w") as f:
        f.write(CHECKPOINT)
    os.replace(ckpt + ".tmp", ckpt)
print("started", os.environ.get("PODAGENT_ATTEMPT"), flush=True)
while not os.path.exists(marker):
    time.sleep(0.2)
print("done", flush=True)
"""
# The reward server (PODAGENT_REWARD=cmd): listens once its marker file is there.
REWARD = reward_cmd.script(before="""
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.1)
""")


# --- the catalogue ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Fault:
    name: str
    what: str  # one line for the table
    targets: tuple[str, ...]  # "head", "worker": whom it can hit (where it runs then)
    variants: tuple[str, ...] = ("",)
    process: str = ""  # the process it kills, if one: it must run in the pod then


def runs(process: str, pod: str, state: str) -> bool:
    """Whether `process` runs in `pod` when the cluster is in `state`. Nothing of Ray runs on a
    pod that stays after its run; the reward server is the teardown's first stop; a worker's
    raylet starts with its join."""
    if state in GANG_STATES:
        if pod not in GANG_UP[state]:
            return False
        return not process or state in ("data_check", "training")
    if pod not in UP[state]:
        return False
    if not process:
        return True
    if state == "staying" or (process == "reward" and state == "tearing_down"):
        return False
    if process != "raylet":
        return pod == "head"
    return pod == "head" or state != "discovering"


FAULTS = {f.name: f for f in (
    Fault("kill-pod", "SIGKILL of every process of a pod (it is started again)", BOTH),
    Fault("kill-podagent", "SIGKILL of podagent alone (the container ends with it and is "
                           "started again)", BOTH),
    Fault("kill-raylet", "SIGKILL of a pod's raylet", BOTH, process="raylet"),
    Fault("kill-gcs", "SIGKILL of the head's GCS", HEAD_ONLY, process="gcs"),
    Fault("kill-dashboard", "SIGKILL of the head's dashboard (the Jobs API)", HEAD_ONLY,
          process="dashboard"),
    Fault("kill-reward", "SIGKILL of the reward server", HEAD_ONLY, process="reward"),
    Fault("cut-network", "a pod's link down, then its processes killed: a host that vanished "
                         "(a worker is replaced by a new pod)", BOTH),
    Fault("sigterm", "SIGTERM to a podagent", BOTH),
    Fault("sigterm-twice", "SIGTERM to a podagent, and again half a second later", BOTH),
    Fault("disk-full", "the pod's volume (logs, ledger, checkpoints) fills up", BOTH),
    Fault("dns", "the head's DNS name: no answer, a stale address, or a stale address beside "
                 "the head's (for 10 s)", HEAD_ONLY, ("gone", "stale", "several")),
    Fault("jobs-api", "the head's Jobs API stops answering (its dashboard frozen) for 5 or 40 s",
          HEAD_ONLY, ("5", "40")),
    Fault("head-restart", "the head's pod restarted (SIGTERM, then started again) at the same "
                          "address, or replaced at a new one (same pod id)", HEAD_ONLY,
          ("same", "new")),
)}


# Runs without Ray (`podagent torchrun`, tests/harness/gang_campaign.py): the gang's lifecycle
# and the faults that apply to it, under the same invariants. A training process stands for the
# job: (d) is never two trainings in one pod, nor more than one per pod in all.
GANG_STATES = ("rendezvous", "data_check", "training", "stopping", "after_run")
GANG_UP = {state: HEAD_ONLY if state == "rendezvous" else BOTH for state in GANG_STATES}
GANG_FAULTS = {f.name: f for f in (
    FAULTS["kill-pod"], FAULTS["kill-podagent"],
    Fault("kill-training", "SIGKILL of a pod's training (the launcher's rank process)", BOTH,
          process="training"),
    Fault("cut-network", "a pod's link down (no reset reaches anyone), then its processes "
                         "killed: a host that vanished (a worker is replaced by a new pod)",
          BOTH),
    FAULTS["sigterm"], FAULTS["sigterm-twice"],
    Fault("head-restart", "the head's pod restarted (SIGTERM, then started again) at the same "
                          "address", HEAD_ONLY, ("same",)),
    Fault("stranger", "a stranger on the head's supervisor port: hostile lines, a stop with a "
                      "wrong token, 20 connections that never finish their first line",
          HEAD_ONLY),
    FAULTS["disk-full"],
)}


def catalogue(state: str) -> dict[str, Fault]:
    """The faults of the lifecycle the state belongs to (a Ray run's, or a run without Ray)."""
    return GANG_FAULTS if state in GANG_STATES else FAULTS


@dataclass(frozen=True)
class Cell:
    fault: str
    state: str
    seed: int
    target: str = ""
    variant: str = ""
    pause: float = 0.0  # seconds between the fault and letting the run go on

    @property
    def name(self) -> str:
        extra = f"-{self.variant}" if self.variant else ""
        return f"{self.fault}{extra}@{self.state}:{self.target}"


def targets(fault: str, state: str) -> list[str]:
    """Whom the fault can hit in that state (none: nothing of its kind runs then)."""
    spec = catalogue(state).get(fault)
    return [t for t in spec.targets if runs(spec.process, t, state)] if spec else []


def plan(fault: str, state: str, seed: int) -> Cell:
    """The cell's schedule, from the seed alone."""
    rng = random.Random(f"{seed}/{fault}/{state}")
    spec = catalogue(state)[fault]
    return Cell(fault, state, seed, rng.choice(targets(fault, state) or [""]),
                rng.choice(spec.variants), round(rng.uniform(0.5, 3.0), 2))


def matrix(seed: int, states: tuple[str, ...] = STATES + GANG_STATES) -> list[Cell]:
    """Every fault at every state (of a Ray run and of a run without Ray) where it can hit
    something."""
    return [plan(f, s, seed) for group in (STATES, GANG_STATES) for f in catalogue(group[0])
            for s in group if s in states and targets(f, s)]


# What CI runs: every fault and every state at least once, each where it hurts most (the seed
# still picks the pauses).
SAMPLE = ("kill-pod@running:head", "kill-podagent@recovering:head", "kill-raylet@joining:worker",
          "kill-gcs@waiting:head", "kill-dashboard@submitting:head", "kill-reward@reward:head",
          "cut-network@running:worker", "sigterm@tearing_down:head",
          "sigterm-twice@staying:worker", "disk-full@running:head",
          "dns-several@discovering:head", "jobs-api-5@running:head",
          "head-restart-new@running:head",
          # runs without Ray: every fault and every state of theirs
          "stranger@rendezvous:head", "kill-podagent@data_check:head",
          "kill-training@data_check:worker", "kill-pod@training:head",
          "cut-network@training:worker", "head-restart-same@training:head",
          "disk-full@training:worker", "sigterm@stopping:head",
          "sigterm-twice@after_run:worker")


def parse(name: str, seed: int) -> Cell:
    """A cell from its name: fault[-variant]@state[:target]; what the name leaves open, the
    seed picks."""
    spec, _, rest = name.partition("@")
    state, _, target = rest.partition(":")
    faults = catalogue(state)
    fault = next((f for f in sorted(faults, key=len, reverse=True)
                  if spec == f or spec.startswith(f + "-")), None)
    if fault is None or state not in STATES + GANG_STATES:
        raise ValueError(f"{name!r} is not fault[-variant]@state[:target] (faults: "
                         f"{', '.join(faults)}; states: {', '.join(STATES + GANG_STATES)})")
    cell = plan(fault, state, seed)
    variant = spec[len(fault) + 1:] or cell.variant
    possible = targets(fault, state)
    if variant not in faults[fault].variants or not possible or (target and
                                                                 target not in possible):
        raise ValueError(f"{name!r}: {fault} has variants {faults[fault].variants}, and in "
                         f"{state} it can hit {possible or 'nothing'}")
    return Cell(fault, state, seed, target or cell.target, variant, cell.pause)


def sample(seed: int) -> list[Cell]:
    return [parse(name, seed) for name in SAMPLE]


# --- one pod, as RunPod runs it -------------------------------------------------------------------

@dataclass
class Exit:
    pod: str
    code: int
    at: float  # monotonic
    leftovers: list[str]  # what was still running in the pod after podagent ended
    killed: bool  # podagent was SIGKILLed (by the fault): invariant (c) is not its to keep
    forced: bool  # the second signal's forced exit: no ledger or event was written
    output: str
    start_pid: int
    started: float  # monotonic: when this podagent was started


class Container:
    """podagent as a pod's main process: on its exit the runtime kills what is left (after
    recording it), and starts it again as RunPod does when the run is not over (`restarts()`);
    `restart()` starts it with the same volume (and Ray temp dir, which a restart may keep)."""

    def __init__(self, name: str, pod: Pod, dns: DnsServer, volume: Path, env: dict[str, str],
                 root: Path, argv: tuple[str, ...] = ()):
        self.name, self.pod, self.dns, self.volume, self.root = name, pod, dns, volume, root
        self.env, self.argv = env, argv  # podagent's arguments (none: its entrypoint)
        self.agent: Agent | None = None
        self.exits: list[Exit] = []
        self.killed_by_fault = False
        self.started_at = self.started_wall = 0.0
        self.restarted = 0
        # False once the pod is stopped (SIGTERM from outside, the cell's end) or gone.
        self.restart_on_exit = True

    def start(self) -> None:
        if self.agent is None:
            self.agent = Agent(self.pod, self.dns, self.root, self.env, self.argv)
            self.agent.cwd = str(self.root)
        else:
            self.agent = self.agent.restarted()
            self.agent.pod = self.pod
        self.agent.env.update(self.env)
        self.killed_by_fault = False
        self.started_at = time.monotonic()
        self.started_wall = time.time()  # podagent writes its first event a second later
        self.agent.start()

    def restart(self, pod: Pod | None = None) -> None:
        if pod is not None:
            self.pod = pod
            self.env["RUNPOD_POD_ID"] = pod.pod_id
        self.restarted += 1
        self.start()

    def restarts(self, done: Exit) -> bool:
        """Would RunPod start it again? Whenever its process ended and the run is not over:
        the head's ledger does not say it finished; a worker left with an error; or podagent
        was killed. (PODAGENT_AFTER_RUN=exit stands in for `stay`: a run over stays over.)"""
        if not self.restart_on_exit or self.restarted >= MAX_RESTARTS:
            return False
        if done.killed:
            return True
        if self.name == "head":
            return not (_json(self.run_dir() / "ledger.json") or {}).get("finished")
        return done.code != 0

    @property
    def running(self) -> bool:
        return bool(self.agent and self.agent.proc and self.agent.proc.poll() is None)

    @property
    def pid(self) -> int | None:
        return self.agent.proc.pid if self.agent and self.agent.proc else None

    def poll(self) -> Exit | None:
        """Notices podagent's exit once: records it, then clears the pod as a runtime does."""
        if not self.agent or not self.agent.proc or self.agent.proc.poll() is None:
            return None
        if self.exits and self.exits[-1].start_pid == self.agent.proc.pid:
            return None
        code = self.agent.proc.returncode
        deadline = time.monotonic() + LEFTOVER_GRACE
        while self.pod.pids() and time.monotonic() < deadline:
            time.sleep(0.1)  # what podagent stopped may still be exiting: a bounded look
        leftovers = _describe(self.pod.pids())
        with contextlib.suppress(Exception):
            _kill_netns_processes(self.pod.netns, 10.0)
        out = self.agent.output
        done = Exit(self.name, code, time.monotonic(), leftovers,
                    # A negative code: a signal ended it before podagent could act on one (a
                    # runtime reports 128 + n); it could neither record nor clean up.
                    killed=code < 0 or self.killed_by_fault,
                    forced="killed all children" in out, output=out,
                    start_pid=self.agent.proc.pid, started=self.started_at)
        self.exits.append(done)
        return done

    def run_dir(self) -> Path:
        """This pod's own directory of the run (podagent's rule)."""
        return pod_run_dir(self.volume / "logs", RUN, self.pod.pod_id)

    def events(self, this_start: bool = False) -> list[dict[str, Any]]:
        """events.jsonl (every start's), or only the current start's."""
        events = _json_lines(self.run_dir() / "events.jsonl")
        if this_start:
            return [e for e in events if e.get("ts", 0) >= self.started_wall]
        return events

    def states(self) -> list[str]:
        """The current start's states (and the events that stand for one)."""
        return [e.get("state") or e["event"] for e in self.events(this_start=True)
                if e["event"] in ("state", "job_finished", "teardown_started", "staying",
                                  "exit")]

    def signal_podagent(self, signum: int) -> None:
        if self.running and self.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def find(self, wanted: Callable[[list[str]], bool]) -> list[psutil.Process]:
        found = []
        for pid in self.pod.pids():
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                if wanted(proc.cmdline()):
                    found.append(proc)
        return found

    def close(self) -> None:
        if self.agent:
            self.agent.close()


def _describe(pids: list[int]) -> list[str]:
    out = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            out.append(f"{pid} {proc.name()}: {' '.join(proc.cmdline())[:120]}")
    return out


def _json_lines(path: Path) -> list[dict[str, Any]]:
    """Whole lines only: the last may be cut short by a SIGKILL mid-write."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    records = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            records.append(json.loads(line))
    return records


def documented_codes() -> set[int]:
    """The exit codes the README's table documents."""
    codes: set[int] = set()
    text = README.read_text()
    table = text[text.index("| code | meaning |"):]
    for row in table.splitlines()[2:]:
        if not row.startswith("|"):
            break
        codes.update(int(c) for c in re.findall(r"\d+", row.split("|")[1]))
    return codes


# --- one cell -----------------------------------------------------------------------------------

@dataclass
class CellResult:
    cell: Cell
    state_seen: str = ""  # the target's state when the fault came
    violations: list[str] = field(default_factory=list)
    fault_to_end: float | None = None  # seconds from the fault to the last podagent's end
    exits: list[tuple[str, int]] = field(default_factory=list)
    most_jobs_at_once: int = 0
    took: float = 0.0
    error: str = ""  # the cell could not be run as planned (a harness failure)
    timeline: list[tuple[float, str]] = field(default_factory=list)  # what happened, when
    run_outcome: str | None = None  # how the run ended for good (the head's ledger), if it did

    @property
    def held(self) -> bool:
        return not self.violations and not self.error

    @classmethod
    def from_json(cls, saved: dict[str, Any]) -> CellResult:
        fields_ = {k: v for k, v in saved.items() if k in cls.__dataclass_fields__}
        return cls(**{**fields_, "cell": Cell(**saved["cell"])})

    def verdicts(self) -> dict[str, bool]:
        return {k: not [v for v in self.violations if v.startswith(f"({k})")] for k in "abcde"}

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "name": self.cell.name, "held": self.held}


class CellRun:
    """Runs one cell: brings the cluster to the cell's state, injects the fault, lets the run
    end, and checks the invariants."""

    JOB_LOG = "job.log"  # the job's output in the head's run directory

    def __init__(self, cell: Cell, root: Path, podagent_path: str | None = None,
                 say: Callable[[str], None] = lambda line: None):
        self.cell, self.root, self.say = cell, root, say
        self.podagent_path = podagent_path  # another checkout's podagent (PYTHONPATH)
        self.result = CellResult(cell)
        self.timeline = self.result.timeline
        self.started = time.monotonic()
        self.fault_at: float | None = None
        self._stop_monitor = threading.Event()
        self._jobs_seen: list[int] = []
        self._mounts: list[Path] = []
        self._frozen: list[psutil.Process] = []

    # --- the run ------------------------------------------------------------------------------

    def run(self) -> CellResult:
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            with PodNetwork(prefix=CAMPAIGN_PREFIX) as net, \
                    DnsServer(address=net.host_ip, port=0) as dns:
                self.net, self.dns = net, dns
                self._build()
                monitor = threading.Thread(target=self._monitor_jobs, daemon=True)
                monitor.start()
                try:
                    self._drive()
                    self._finish()
                finally:
                    self._stop_monitor.set()
                    monitor.join(timeout=5)
                    for proc in self._frozen:
                        with contextlib.suppress(psutil.Error):
                            proc.resume()
                    for c in self.containers:
                        c.close()
                self._check()
        except Exception as exc:  # the cell itself broke: said, never counted as held
            self.result.error = f"{type(exc).__name__}: {exc}"
        finally:
            for mount in self._mounts:
                subprocess.run(["umount", "-l", str(mount)], check=False)
        self.result.took = round(time.monotonic() - self.started, 1)
        return self.result

    def note(self, what: str) -> None:
        self.timeline.append((round(time.monotonic() - self.started, 2), what))
        self.say(f"  {self.timeline[-1][0]:7.2f} s  {what}")

    def _pods_and_scripts(self, scripts: dict[str, str]) -> Path:
        """The head's and the worker's pods, the head's DNS record, the cell's scripts (the
        job's among them) and volumes; the scripts' folder."""
        self.head_pod = self.net.add_pod("head")
        self.worker_pod = self.net.add_pod("w1")
        self.dns.set_record(self.head_pod.dns_name, self.head_pod.ip)
        folder = self.root / "scripts"
        folder.mkdir(exist_ok=True)
        for name, text in scripts.items():
            (folder / name).write_text(text)
        self.job_script = str(folder / "job.py")
        self.go = self.root / "go"  # the job ends once this is there
        self.volumes = {}
        for name in ("head", "worker"):
            volume = self.root / f"volume-{name}"
            volume.mkdir(exist_ok=True)
            if self.cell.fault == "disk-full" and name == self.cell.target:
                subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={VOLUME_SIZE}", "tmpfs",
                                str(volume)], check=True)
                self._mounts.append(volume)
            self.volumes[name] = volume
        return folder

    def _pythonpath(self) -> str:
        # The podagent under test goes first on the path, and podagent starts outside any
        # checkout (`python -m` would take the one in its working directory first).
        return os.pathsep.join(
            p for p in (self.podagent_path or str(REPO), os.environ.get("PYTHONPATH")) if p)

    def _build(self) -> None:
        cell = self.cell
        scripts = self._pods_and_scripts({"job.py": JOB, "reward.py": REWARD})
        self.reward_go = self.root / "reward-go"  # the reward server listens once this is
        if cell.state not in ("reward", "submitting"):
            self.reward_go.touch()
        common = {
            "PODAGENT_RUN_NAME": RUN, "HEAD_POD_ID": self.head_pod.pod_id,
            "PODAGENT_AFTER_RUN": "stay" if cell.state == "staying" else "exit",
            "PODAGENT_HEAD_TIMEOUT": f"{HEAD_TIMEOUT:g}",
            "PODAGENT_WORKER_TIMEOUT": f"{WORKER_TIMEOUT:g}",
            "PODAGENT_STOP_TIMEOUT": "5", "PODAGENT_RESTART_BACKOFF": "0",
            "PODAGENT_REWARD_TIMEOUT": "60",
        }
        common["PYTHONPATH"] = self._pythonpath()
        head_env = {**common, "EXPECTED_WORKERS": "1",
                    "PODAGENT_LOG_DIR": str(self.volumes["head"] / "logs"),
                    "PODAGENT_CHECKPOINT_DIR": str(self.volumes["head"] / "ckpt"),
                    "PODAGENT_JOB": shlex.join([sys.executable, self.job_script, str(self.go),
                                                CHECKPOINT]),
                    "PODAGENT_REWARD": "cmd",
                    "PODAGENT_REWARD_CMD": shlex.join([sys.executable, str(scripts / "reward.py"),
                                                       str(self.reward_go)])}
        worker_env = {**common, "PODAGENT_LOG_DIR": str(self.volumes["worker"] / "logs")}
        self.head = Container("head", self.head_pod, self.dns, self.volumes["head"], head_env,
                              self.root)
        self.worker = Container("worker", self.worker_pod, self.dns, self.volumes["worker"],
                                worker_env, self.root)
        self.containers = [self.head, self.worker]

    # --- waiting, bounded ---------------------------------------------------------------------

    def _tick(self) -> None:
        for c in list(self.containers):
            done = c.poll()
            if not done:
                continue
            self.note(f"{c.name} podagent exited {done.code}")
            if self.fault_at is not None:
                if c.restarts(done):
                    c.restart()
                    self.note(f"{c.name} started again (its container, as RunPod does)")
            elif done.code in GAVE_UP_WAITING and len(c.exits) <= MAX_RESTARTS:
                # Before the fault: a pod that gave up waiting for the other is started again,
                # as RunPod does. On a loaded machine a bring-up can outlast the 45 s the pods
                # give each other, and neither would come back. These starts are not the
                # fault's: it still gets MAX_RESTARTS of its own.
                c.start()
                self.note(f"{c.name} started again before the fault (as RunPod does)")

    def idle(self, seconds: float) -> None:
        """The schedule's pause (not a readiness wait): exits are noticed meanwhile."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self._tick()
            time.sleep(0.05)

    def wait(self, what: str, ready: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self._tick()
            if ready():
                return
            if time.monotonic() > deadline:
                seen = {c.name: (c.states()[-3:], c.running) for c in self.containers}
                raise TimeoutError(f"waited {timeout:g} s for {what}; seen: {seen}")
            time.sleep(0.05)

    def _in(self, container: Container, *states: str) -> Callable[[], bool]:
        return lambda: bool(container.states()) and container.states()[-1] in states

    def _job_started(self) -> bool:
        return "started" in _read(self.head.run_dir() / "job.log")

    # --- bringing the cluster to the cell's state ------------------------------------------------

    def _drive(self) -> None:
        state, head, worker = self.cell.state, self.head, self.worker
        if state == "discovering":
            self.dns.remove_record(self.head_pod.dns_name)
            worker.start()
            head.start()
            self.wait("the worker looking for the head", self._in(worker, "finding_head"),
                      FORM_TIMEOUT)
            self.wait("the head waiting for workers", self._in(head, "waiting_workers"),
                      FORM_TIMEOUT)
        elif state == "joining":
            head.start()
            self.wait("the head waiting", self._in(head, "waiting_workers"), FORM_TIMEOUT)
            worker.start()
            self.wait("the worker joining", self._in(worker, "joining"), FORM_TIMEOUT)
        elif state == "waiting":
            head.start()
            self.wait("the head waiting", self._in(head, "waiting_workers"), FORM_TIMEOUT)
        elif state in ("reward", "submitting"):
            head.start()
            worker.start()
            self.wait("the head waiting for its reward server", self._in(head, "waiting_reward"),
                      FORM_TIMEOUT)
            if state == "submitting":
                # Held in SUBMITTING: a dashboard that does not answer keeps it there.
                self.wait("the head's dashboard", lambda: bool(self._dashboard()), FORM_TIMEOUT)
                self._freeze(self._dashboard())
                self.reward_go.touch()
                self.wait("the head submitting", self._in(head, "submitting"), FORM_TIMEOUT)
        else:
            head.start()
            worker.start()
            self.wait("the job's first line", self._job_started, FORM_TIMEOUT)
            self.wait("the worker watching", self._in(worker, "watching"), FORM_TIMEOUT)
            if state == "recovering":
                self._kill_pod(worker)  # held down until the fault is in (then restarted)
                self.wait("the head recovering", self._in(head, "recovering"), FORM_TIMEOUT)
            elif state == "tearing_down":
                self._freeze([psutil.Process(worker.pid)] if worker.pid else [])
                self.go.touch()
                # The job's end is the teardown's start (`teardown_started` follows at once).
                self.wait("the head's teardown", self._in(head, "job_finished",
                                                          "teardown_started"), FORM_TIMEOUT)
            elif state == "staying":
                self.go.touch()
                for c in (head, worker):
                    self.wait(f"the {c.name} staying", self._in(c, "staying"), FORM_TIMEOUT)
        target = self.head if self.cell.target == "head" else self.worker
        self.result.state_seen = (target.states() or ["not started"])[-1]
        self.snapshot = self._sizes()
        self.fault_at = time.monotonic()
        self.note(f"fault {self.cell.name} in state {self.result.state_seen}")
        self._inject()

    def _dashboard(self) -> list[psutil.Process]:
        return self.head.find(lambda argv: any("dashboard/dashboard.py" in a for a in argv))

    def _freeze(self, procs: list[psutil.Process]) -> None:
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                proc.suspend()
                self._frozen.append(proc)

    def _thaw(self) -> None:
        for proc in self._frozen:
            with contextlib.suppress(psutil.Error):
                proc.resume()
        self._frozen.clear()

    def _kill_pod(self, container: Container) -> None:
        container.killed_by_fault = True
        _kill_netns_processes(container.pod.netns, 10.0)

    # --- the faults ------------------------------------------------------------------------------

    def _inject(self) -> None:
        cell = self.cell
        target = self.head if cell.target == "head" else self.worker
        fault = cell.fault
        if fault == "kill-pod":
            self._kill_pod(target)
        elif fault == "kill-podagent":
            target.killed_by_fault = True
            target.signal_podagent(signal.SIGKILL)
        elif fault in ("kill-raylet", "kill-gcs", "kill-dashboard", "kill-reward"):
            wanted = {"kill-raylet": lambda a: bool(a) and a[0].endswith("/raylet"),
                      "kill-gcs": lambda a: bool(a) and a[0].endswith("/gcs_server"),
                      "kill-dashboard": lambda a: any("dashboard/dashboard.py" in x for x in a),
                      "kill-reward": lambda a: any(x.endswith("reward.py") for x in a)}[fault]
            # The process may be on its way (a raylet while `ray start` runs): it is awaited.
            self.wait(f"the {target.name}'s process to kill", lambda: bool(target.find(wanted)),
                      PROCESS_TIMEOUT)
            procs = target.find(wanted)
            self.note(f"killing {len(procs)} process(es) in state "
                      f"{(target.states() or ['?'])[-1]}")
            for proc in procs:
                with contextlib.suppress(psutil.Error):
                    proc.kill()
        elif fault == "cut-network":
            self.net_cut(target)
        elif fault == "sigterm":
            target.restart_on_exit = False  # the pod is being stopped (or preempted)
            target.signal_podagent(signal.SIGTERM)
        elif fault == "sigterm-twice":
            target.restart_on_exit = False
            target.signal_podagent(signal.SIGTERM)
            self.idle(0.5)  # the schedule's gap between the two signals
            target.signal_podagent(signal.SIGTERM)
        elif fault == "disk-full":
            _fill(target.volume)
        elif fault == "dns":
            name, stale = self.head_pod.dns_name, self._unused_address()
            if cell.variant == "gone":
                self.dns.mode = "timeout"
            elif cell.variant == "stale":
                self.dns.set_record(name, stale)
            else:
                self.dns.set_records(name, [stale, self.head_pod.ip])
        elif fault == "jobs-api":
            self._freeze(self._dashboard())
        elif fault == "head-restart":
            self.head.restart_on_exit = False  # started again below, by the schedule
            self.head.signal_podagent(signal.SIGTERM)

    def _unused_address(self) -> str:
        """An address of the cell's subnet nobody has: nothing answers there."""
        taken = {p.ip for p in self.net.pods} | {self.net.host_ip}
        return next(str(h) for h in reversed(list(self.net.subnet.hosts())[:-1])
                    if str(h) not in taken)

    # --- after the fault: the run goes on to its end ---------------------------------------------

    def _finish(self) -> None:
        cell, head, worker = self.cell, self.head, self.worker
        self.idle(cell.pause)  # the schedule's pause before the run is let go on
        if cell.fault == "dns":
            self.idle(10.0)  # as long as the DNS trouble lasts
            self.dns.mode = "normal"
            self.dns.set_record(self.head_pod.dns_name, self.head_pod.ip)
        if cell.fault == "jobs-api":
            self.idle(float(cell.variant))  # as long as the Jobs API stays silent
            self._thaw()
        if cell.fault == "head-restart":
            self.wait("the head's podagent to end on SIGTERM", lambda: not head.running, 60)
            if cell.variant == "new":  # a new host: the old address is gone, the id stays
                self.net_cut(head)
                pod = self.net.add_pod("head2", pod_id=self.head_pod.pod_id)
                self.dns.set_record(pod.dns_name, pod.ip)
                head.restart(pod)
            else:
                head.restart()
            head.restart_on_exit = True
        # What the cell's state held back is let go.
        if cell.state == "discovering" and cell.fault != "dns":
            self.dns.set_record(self.head_pod.dns_name, self.head_pod.ip)
        if cell.state == "waiting":
            worker.start()
        if cell.state == "reward":
            self.reward_go.touch()
        if cell.state in ("submitting", "tearing_down") and cell.fault != "jobs-api":
            self._thaw()
        if cell.state == "recovering":
            worker.restart()
        self._to_the_end(staying=cell.state == "staying")

    def _to_the_end(self, staying: bool) -> None:
        """The rest of a cell: a vanished worker replaced, the job let finish, staying pods
        stopped once settled, every podagent awaited."""
        # A pod that died is started again (by _tick, as RunPod does); a vanished worker is
        # replaced by a new pod.
        if self.cell.fault == "cut-network" and self.cell.target == "worker":
            self._tick()
            worker = self.worker
            new = self.net.add_pod("w2")
            replacement = type(worker)("worker2", new, self.dns, self.root / "volume-worker2",
                                       {**worker.env, "RUNPOD_POD_ID": new.pod_id}, self.root,
                                       worker.argv)
            for name, under in (("PODAGENT_LOG_DIR", "logs"), ("PODAGENT_CHECKPOINT_DIR", "ckpt")):
                if name in worker.env:
                    replacement.env[name] = str(replacement.volume / under)
            self.containers.append(replacement)
            replacement.start()
            self.note("a replacement worker started")
            # The job ends once `go` is there: it is let go only once the head acted on the lost
            # worker. Before, the run could end before the loss was noticed, and the replacement,
            # come too late, waited out its head timeout at each of its three starts (a run of
            # its own, 169 s instead of 45): the cell then showed no recovery at all.
            try:
                self.wait("the head to act on the vanished worker (a restart)",
                          lambda: any(e["event"] == "restart" for e in self.head.events()),
                          BOUND)
            except TimeoutError as exc:  # the run would never end: the job waits for `go`
                self.result.violations.append(f"(a) {exc}")
        self.go.touch()
        if staying:
            # The pods are stopped once they settled: SIGTERM to every podagent still up.
            try:
                self.wait("every podagent to settle (staying or ended)", self._settled, BOUND)
            except TimeoutError as exc:
                self.result.violations.append(f"(a) {exc}")
            for c in self.containers:
                c.restart_on_exit = False
                c.signal_podagent(signal.SIGTERM)
            self.note("the pods stopped (SIGTERM)")
        try:
            self.wait("every podagent to end",
                      lambda: not any(c.running for c in self.containers), CELL_BOUND)
        except TimeoutError as exc:
            self.result.violations.append(f"(a) {exc}")
        self._tick()
        ends = [c.exits[-1].at for c in self.containers if c.exits]
        if ends and self.fault_at:
            self.result.fault_to_end = round(max(ends) - self.fault_at, 1)

    def net_cut(self, container: Container) -> None:
        """The pod's host vanishes: its link goes down first (nobody gets a reset), then
        everything in it dies."""
        _ip("link", "set", container.pod.host_veth, "down", check=False)
        container.restart_on_exit = False  # its host is gone
        self._kill_pod(container)
        self._tick()

    def _settled(self) -> bool:
        """Every podagent stays (idle after its run) or has ended."""
        return all(not c.running or (c.states() and c.states()[-1] == "staying")
                   for c in self.containers)

    # --- watching the job and the files ----------------------------------------------------------

    def _monitor_jobs(self) -> None:
        """Samples the job's processes in every pod (invariant d)."""
        while not self._stop_monitor.wait(0.2):
            live = 0
            for c in list(self.containers):
                for pid in c.pod.pids():
                    with contextlib.suppress(psutil.Error):
                        argv = psutil.Process(pid).cmdline()
                        if len(argv) > 1 and argv[1] == self.job_script:
                            live += 1
            self._jobs_seen.append(live)

    def _files(self) -> dict[str, Path]:
        found = {}
        for c in self.containers:
            run_dir = c.run_dir()
            for name in ("events.jsonl", "ledger.json", self.JOB_LOG):
                if (run_dir / name).exists():
                    found[f"{c.name}/{name}"] = run_dir / name
            for log in run_dir.glob("podagent-*.log"):
                found[f"{c.name}/{log.name}"] = log
        return found

    def _sizes(self) -> dict[str, int]:
        """Sizes of the files that only grow (the ledger is written whole each time)."""
        return {k: p.stat().st_size for k, p in self._files().items()
                if not k.endswith("ledger.json")}

    # --- the invariants --------------------------------------------------------------------------

    def _check(self) -> None:
        violations, result = self.result.violations, self.result
        codes = documented_codes()
        result.most_jobs_at_once = max(self._jobs_seen, default=0)
        finished = (_json(self.head.run_dir() / "ledger.json") or {}).get("finished") or {}
        result.run_outcome = finished.get("outcome")
        result.exits = [(e.pod, e.code) for c in self.containers for e in c.exits]
        disk_full = self.cell.fault == "disk-full"
        for c in self.containers:
            for done in c.exits:
                since = max(done.started, self.fault_at or done.started)
                if done.at - since > BOUND:
                    violations.append(f"(a) {c.name} ended {done.at - since:.0f} s after the "
                                      f"fault or its start (bound {BOUND:g} s)")
                if done.killed:
                    continue  # the fault killed it: it could neither say nor clean up
                if done.code not in codes:
                    violations.append(f"(b) {c.name} exited {done.code}, which the README's "
                                      f"table does not document")
                if not done.forced and not (disk_full and c.name == self.cell.target):
                    self._check_recorded(c, done, done is c.exits[-1], violations)
                if done.leftovers:
                    violations.append(f"(c) {c.name} left {len(done.leftovers)} process(es): "
                                      f"{done.leftovers[:3]}")
        if result.most_jobs_at_once > 1:
            violations.append(f"(d) {result.most_jobs_at_once} jobs of the run were alive at once")
        self._check_files(violations)

    def _check_recorded(self, c: Container, done: Exit, last: bool,
                        violations: list[str]) -> None:
        """(b): the exit code agrees with the `exit` event, the ledger and the outcome (each
        start's outcome: the last one's, as events.jsonl does not say which start wrote it)."""
        events = [e for e in c.events() if e.get("event") == "exit"]
        recorded = [e["code"] for e in events]
        if done.code not in recorded:
            violations.append(f"(b) {c.name} exited {done.code}; its exit events say "
                              f"{recorded}")
        outcomes = [e.get("outcome") for e in c.events(this_start=last)
                    if e.get("event") == "teardown_started"]
        if last and outcomes and outcomes[-1]:
            expected = exits.code_for_outcome(outcomes[-1])
            allowed = {130, 143} if expected is None else {expected}
            if done.code not in allowed and not (c.name == "head" and self._finished_earlier(c)):
                violations.append(f"(b) {c.name} exited {done.code}, but its run ended "
                                  f"{outcomes[-1]} (code {sorted(allowed)})")
        if c.name == "head":
            recorded = self._ledger_code(c, done)
            if recorded is not MISSING and recorded != done.code:
                violations.append(f"(b) the head exited {done.code}; its ledger says "
                                  f"{recorded}")

    def _ledger_code(self, c: Container, done: Exit) -> Any:
        """The exit code the ledger holds for this start: on the start's entry, or (a ledger
        that keeps it only there) on the run's end when this start ended the run."""
        ledger = _json(c.run_dir() / "ledger.json") or {}
        starts = ledger.get("starts", [])
        mine = [i for i, s in enumerate(starts) if s.get("pid") == done.start_pid]
        if not mine:
            return MISSING
        start = starts[mine[-1]]
        if "exit_code" in start:
            return start["exit_code"]
        finished = ledger.get("finished")
        later = starts[mine[-1] + 1:]
        ended_it = finished and finished.get("at", 0) >= start.get("at", 0) and not [
            s for s in later if s.get("at", 0) <= finished.get("at", 0)]
        return finished.get("exit_code") if ended_it else MISSING

    def _finished_earlier(self, c: Container) -> bool:
        return any(e.get("event") == "finished_earlier" for e in c.events())

    def _check_files(self, violations: list[str]) -> None:
        """(e): the checkpoint, the logs and the ledger."""
        self._check_checkpoint(violations)
        now = self._sizes()
        for name, size in self.snapshot.items():
            if now.get(name, 0) < size:
                violations.append(f"(e) {name} shrank from {size} to {now.get(name, 0)} bytes")
        for c in self.containers:
            path = c.run_dir() / "ledger.json"
            if path.exists() and _json(path) is None:
                violations.append(f"(e) {c.name}'s ledger.json does not parse")
            for log in c.run_dir().glob("podagent-*.log"):
                if not log.stat().st_size:
                    violations.append(f"(e) {c.name}'s {log.name} is empty")

    def _check_checkpoint(self, violations: list[str]) -> None:
        ckpt = self.volumes["head"] / "ckpt" / "step-1" / "model.txt"
        if ckpt.exists() and ckpt.read_text() != CHECKPOINT:
            violations.append(f"(e) the checkpoint changed: {ckpt.read_text()[:40]!r}")
        started = any("started" in _read(c.run_dir() / "job.log") for c in self.containers)
        if started and not ckpt.exists() and self.cell.fault != "disk-full":
            violations.append("(e) the job checkpointed, and the checkpoint is gone")


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _fill(volume: Path) -> None:
    """Write until the volume is full."""
    with open(volume / "filler", "wb") as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 65536)
            f.flush()


def run_cell(cell: Cell, root: Path, podagent_path: str | None = None,
             say: Callable[[str], None] = lambda line: None) -> CellResult:
    say(f"cell {cell.name} (seed {cell.seed}, pause {cell.pause} s)")
    # Absolute: each pod starts in the cell's directory, where a relative path would point
    # below itself (bench/faults.py's default --out is relative).
    root = root.resolve()
    if cell.state in GANG_STATES:
        from tests.harness.gang_campaign import GangCellRun

        return GangCellRun(cell, root, podagent_path, say).run()
    return CellRun(cell, root, podagent_path, say).run()
