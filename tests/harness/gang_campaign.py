"""The fault campaign's cells for runs without Ray (`podagent torchrun`): a head and a worker pod
(network namespaces, a real DNS server, the real podagent and torchrun in each) taken to one
state of the gang's lifecycle, one fault, the run let go to its end, and the same invariants as
a Ray run's cells (tests/harness/campaign.py), read for this lifecycle:

  rendezvous  the head holds podagent's rendezvous; the worker has not come yet
  data_check  both pods run `--data-check`: every rank's loader is building (held there)
  training    every rank of the training is under way
  stopping    `podagent stop` was asked: the head ends the run on every pod (the training takes
              a moment to stop, as a trainer saving its state does)
  after_run   the run succeeded and both pods stay (PODAGENT_AFTER_RUN=stay)

(d) is read as: never two trainings in one pod, nor more than one per pod in all. A stranger
on the supervisor port must change nothing: the run still succeeds.
"""

from __future__ import annotations

import contextlib
import socket
import time
from pathlib import Path
from typing import Any

import psutil

from podagent.gang import mesh
from tests.harness.campaign import (
    CHECKPOINT,
    FORM_TIMEOUT,
    CellRun,
    Container,
    _read,
)

TOKEN = "campaign-cluster-token-0123456789"
SUPERVISOR_PORT = 29510
STRANGER_IDLE = 20  # connections that never finish their first line
QUICK_RESOLVER = {"RES_OPTIONS": "timeout:1 attempts:1"}  # torch's lookups of its peers
STOPPING_SECONDS = 2.0  # how long the training takes to stop on SIGTERM (it saves its state)

# The training: checkpoints once per pod (or reads its checkpoint back when started again),
# says it started, and trains until the cell's marker file appears; on SIGTERM it takes a
# moment to stop.
JOB = f"""
import os, signal, sys, time
marker, content = sys.argv[1], sys.argv[2]
ckpt = os.path.join(os.environ["PODAGENT_CHECKPOINT_DIR"], "step-1")
if os.path.exists(ckpt):
    with open(os.path.join(ckpt, "model.txt")) as f:
        assert f.read() == content, "the checkpoint changed"
else:
    os.makedirs(ckpt + ".tmp", exist_ok=True)
    with open(os.path.join(ckpt + ".tmp", "model.txt"), "w") as f:
        f.write(content)
    os.replace(ckpt + ".tmp", ckpt)

def saving(*_):
    time.sleep({STOPPING_SECONDS})
    sys.exit(143)

signal.signal(signal.SIGTERM, saving)
print("started", os.environ.get("RANK"), flush=True)
while not os.path.exists(marker):
    time.sleep(0.2)
print("done", flush=True)
"""

# The data check's loader: says it is building, then waits for the cell's marker (each rank
# its own samples: the check passes).
LOADER = """
import os, time

def build():
    rank = os.environ["RANK"]
    here = os.path.dirname(os.path.abspath(__file__))
    open(os.path.join(here, f"building-{rank}"), "w").close()
    while not os.path.exists(os.path.join(here, "loader-go")):
        time.sleep(0.1)
    return [[f"{rank}-{i}"] for i in range(4)]
"""


def _launcher(argv: list[str]) -> bool:
    """podagent or torchrun (by its script or as a module), not a rank they started."""
    modules = {argv[i + 1] for i in range(len(argv) - 1) if argv[i] == "-m"}
    return bool(modules & {"podagent", "torch.distributed.run"}) or any(
        Path(a).name in ("torchrun", "podagent") for a in argv[:2])


class GangContainer(Container):
    def states(self) -> list[str]:
        """The current start's states: the phases, each step's start, staying and the exit."""
        out = []
        for e in self.events(this_start=True):
            if e["event"] == "state":
                out.append(e.get("state", ""))
            elif e["event"] == "step_started":
                out.append(f"step:{e.get('step')}")
            elif e["event"] in ("staying", "exit"):
                out.append(e["event"])
        return out


class GangCellRun(CellRun):
    """One cell of a run without Ray."""

    JOB_LOG = "training.log"

    def _build(self) -> None:
        cell = self.cell
        scripts = self._pods_and_scripts({"job.py": JOB, "loader.py": LOADER})
        self.loader_go = scripts / "loader-go"
        self.scripts = scripts
        self.strangers: list[socket.socket] = []
        common = {
            **QUICK_RESOLVER, "PODAGENT_RUN_NAME": "camp", "HEAD_POD_ID": self.head_pod.pod_id,
            "EXPECTED_WORKERS": "1", "PODAGENT_TOKEN": TOKEN,
            "PODAGENT_AFTER_RUN": "stay" if cell.state == "after_run" else "exit",
            "PODAGENT_HEAD_TIMEOUT": "45", "PODAGENT_WORKER_TIMEOUT": "45",
            "PODAGENT_STOP_TIMEOUT": "5", "PODAGENT_RESTART_BACKOFF": "0",
            "PODAGENT_SUPERVISOR_PORT": str(SUPERVISOR_PORT),
            "PYTHONPATH": self._pythonpath(),
        }
        check = ("--data-check", "--loader", f"{scripts / 'loader.py'}:build") \
            if cell.state == "data_check" else ()
        argv = ("torchrun", *check, "--", self.job_script, str(self.go), CHECKPOINT)
        self.containers = []
        for name, pod in (("head", self.head_pod), ("worker", self.worker_pod)):
            env = {**common, "PODAGENT_LOG_DIR": str(self.volumes[name] / "logs"),
                   "PODAGENT_CHECKPOINT_DIR": str(self.volumes[name] / "ckpt")}
            self.containers.append(GangContainer(name, pod, self.dns, self.volumes[name], env,
                                                 self.root, argv))
        self.head, self.worker = self.containers

    # --- bringing the run to the cell's state ------------------------------------------------

    def _training(self, c: Container) -> bool:
        return "started" in _read(c.run_dir() / "training.log")

    def _drive(self) -> None:
        state, head, worker = self.cell.state, self.head, self.worker
        form = FORM_TIMEOUT
        head.start()
        if state == "rendezvous":
            self.wait("the head's rendezvous", lambda: self._phase() == "rendezvous", form)
        else:
            worker.start()
        if state == "data_check":
            self.wait("every rank's loader building", lambda: all(
                (self.scripts / f"building-{r}").exists() for r in (0, 1)), form)
        elif state in ("training", "stopping", "after_run"):
            self.wait("every rank training", lambda: all(map(self._training, (head, worker))),
                      form)
        if state == "stopping":
            self._ask({"ask": "stop", "by": "the campaign"}, TOKEN)
            self.wait("the head ending the run", self._in(head, "ending"), form)
        elif state == "after_run":
            self.go.touch()
            for c in (head, worker):
                self.wait(f"the {c.name} staying", self._in(c, "staying"), form)
        target = self.head if self.cell.target == "head" else self.worker
        self.result.state_seen = (target.states() or [self._phase() or "not started"])[-1]
        self.snapshot = self._sizes()
        self.fault_at = time.monotonic()
        self.note(f"fault {self.cell.name} in state {self.result.state_seen}")
        self._inject()

    def _phase(self) -> str | None:
        answer = self._ask({"ask": "status"}, TOKEN)
        return answer.get("phase") if isinstance(answer, dict) else None

    def _ask(self, question: dict[str, Any], token: str | None) -> Any:
        """A question to the head's supervisor port, as `podagent status/stop` asks."""
        try:
            wire, answer = mesh.ask(self.head_pod.ip, SUPERVISOR_PORT, question, token, 5.0)
        except Exception:  # not listening yet, refused, or no answer: nothing to read
            return None
        wire.close()
        return answer

    # --- the faults ----------------------------------------------------------------------------

    def _inject(self) -> None:
        cell = self.cell
        target = self.head if cell.target == "head" else self.worker
        if cell.fault == "kill-training":
            def training(argv: list[str]) -> bool:
                return not _launcher(argv) and any(
                    a == self.job_script or a.endswith("/datacheck.py") for a in argv)

            self.wait(f"the {target.name}'s training", lambda: bool(target.find(training)),
                      30.0)
            for proc in target.find(training):
                with contextlib.suppress(psutil.Error):
                    proc.kill()
        elif cell.fault == "stranger":
            self._stranger()
        else:
            super()._inject()

    def _stranger(self) -> None:
        """Hostile lines, a stop with a wrong token, connections left half-said (kept open
        until the cell ends)."""
        lines = [b'{"ask": "stop", "token": "\\ud800"}\n',
                 b'{"ask": "stop", "token": "not-the-token", "by": "a stranger"}\n',
                 b'{"hello": {"addr": "10.9.9.9", "rank": 1e400}}\n',
                 b'{"ask": "logs", "offset": ' + str(10**30).encode() + b'}\n',
                 b"[" * 20000 + b"\n", b"\xff\xfe garbage\n", b"x" * (64 << 10)]
        for line in lines:
            with contextlib.suppress(OSError), socket.create_connection(
                    (self.head_pod.ip, SUPERVISOR_PORT), timeout=5) as s:
                s.sendall(line)
                s.settimeout(2)
                with contextlib.suppress(OSError):
                    s.recv(65536)
        for _ in range(STRANGER_IDLE):
            with contextlib.suppress(OSError):
                s = socket.create_connection((self.head_pod.ip, SUPERVISOR_PORT), timeout=5)
                s.sendall(b'{"ask": "sta')
                self.strangers.append(s)
        self.note(f"a stranger sent {len(lines)} hostile lines and left "
                  f"{len(self.strangers)} connections half-said")

    # --- after the fault -------------------------------------------------------------------------

    def _finish(self) -> None:
        cell, head, worker = self.cell, self.head, self.worker
        self.idle(cell.pause)
        if cell.fault == "head-restart":
            self.wait("the head's podagent to end on SIGTERM", lambda: not head.running, 60)
            head.restart()
            head.restart_on_exit = True
        if cell.state == "rendezvous":
            worker.start()
        self.loader_go.touch()
        try:
            self._to_the_end(staying=cell.state == "after_run")
        finally:
            for s in self.strangers:
                s.close()

    # --- watching the trainings and the files ----------------------------------------------------

    def _monitor_jobs(self) -> None:
        """The most trainings seen at once: in all, and in any one pod (invariant d)."""
        self._per_pod: list[int] = []
        while not self._stop_monitor.wait(0.2):
            counts = []
            for c in list(self.containers):
                n = 0
                for pid in c.pod.pids():
                    with contextlib.suppress(psutil.Error):
                        n += self._is_training(psutil.Process(pid).cmdline())
                counts.append(n)
            self._jobs_seen.append(sum(counts))
            self._per_pod.append(max(counts, default=0))

    def _is_training(self, argv: list[str]) -> bool:
        """A rank of the training (not the launcher, nor podagent: their argv name it too)."""
        return self.job_script in argv and not _launcher(argv)

    def _check(self) -> None:
        super()._check()
        violations = self.result.violations
        violations[:] = [v for v in violations if not v.startswith("(d)")]
        per_pod = max(getattr(self, "_per_pod", []) or [0])
        pods = len(self.containers)
        if per_pod > 1:
            violations.append(f"(d) {per_pod} trainings of the run were alive in one pod")
        if self.result.most_jobs_at_once > pods:
            violations.append(f"(d) {self.result.most_jobs_at_once} trainings were alive at "
                              f"once on {pods} pods")
        if self.cell.fault == "stranger":  # the run ends as it would have without him
            expected = "JobStopped" if self.cell.state == "stopping" else "succeeded"
            codes = {code for _, code in self.result.exits}
            if self.result.run_outcome != expected or len(codes) != 1:
                violations.append(f"(b) a stranger changed the run: it ended "
                                  f"{self.result.run_outcome} (not {expected}), exits "
                                  f"{sorted(codes)}")

    def _check_checkpoint(self, violations: list[str]) -> None:
        """(e): each pod's own checkpoint."""
        for c in self.containers:
            ckpt = c.volume / "ckpt" / "step-1" / "model.txt"
            if ckpt.exists() and ckpt.read_text() != CHECKPOINT:
                violations.append(f"(e) {c.name}'s checkpoint changed: "
                                  f"{ckpt.read_text()[:40]!r}")
            disk_full = self.cell.fault == "disk-full" and c.name == self.cell.target
            if self._training(c) and not ckpt.exists() and not disk_full:
                violations.append(f"(e) {c.name}'s training checkpointed, and the checkpoint "
                                  f"is gone")
