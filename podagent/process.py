"""Child processes: started in their own session with a log file, stopped TERM -> deadline -> KILL.

podagent makes itself a child subreaper, so the daemons `ray start` leaves behind (gcs_server,
raylet, dashboard...) stay its descendants: stopping "this pod's Ray" means stopping our own
process tree, never every Ray process on the machine (several test pods share one kernel).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

import psutil

from podagent.config.names import RAY_OWNER
from podagent.waiting import Deadline

_CHUNK = 1 << 16  # a teed output is copied this much at a time

_PR_SET_CHILD_SUBREAPER = 36

DASHBOARD_SCRIPT = "dashboard/dashboard.py"  # on the Ray dashboard's command line
# The patterns `ray stop` uses to recognise Ray's processes (ray/autoscaler/_private/constants.py):
# (substring, True = match the process name, False = match the whole command line).
RAY_PROCESS_PATTERNS: tuple[tuple[str, bool], ...] = (
    ("raylet", True), ("plasma_store", True), ("gcs_server", True), ("ray::", True),
    ("monitor.py", False), ("ray.util.client.server", False), ("default_worker.py", False),
    ("setup_worker.py", False), ("log_monitor.py", False), ("ray::DashboardAgent", False),
    (DASHBOARD_SCRIPT, False), ("ray::RuntimeEnvAgent", False),
    ("ray_process_reaper.py", False),
)


def become_subreaper() -> bool:
    """Orphaned descendants are re-parented to us instead of PID 1 (Linux >= 3.4)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def descendants() -> list[psutil.Process]:
    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def log_tail(path: Path, lines: int = 30) -> str:
    """The last lines of a log file ('' when there is none yet)."""
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=lines)).rstrip()
    except OSError:
        return ""


def alive(proc: psutil.Process) -> bool:
    """Running and not a zombie (a dead child nobody reaped yet still 'is running')."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def reap_zombies(keep: Collection[int] = ()) -> None:
    """Collect exit statuses of adopted orphans (zombie children only). `keep`: pids of our own
    Popen children, whose status their Popen collects."""
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error, ChildProcessError):
            if child.pid not in keep and child.status() == psutil.STATUS_ZOMBIE:
                os.waitpid(child.pid, os.WNOHANG)


def reap_orphans() -> None:
    """Collect every exited child without scanning /proc.

    Only for when no Popen of ours is running (it would lose its exit status to us): the
    worker's watch loop, whose `ray start` has long returned.
    """
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


STOP_POLL = 0.1  # how often a stop looks whether its deadline moved (a signal arrived)
KILLED_WAIT = 5.0  # after SIGKILL: only a process stuck in the kernel takes longer


def stop_processes(
    procs: Sequence[psutil.Process],
    timeout: float | Deadline,
    on_kill: Callable[[list[psutil.Process]], None] | None = None,
) -> tuple[int, int]:
    """SIGTERM all, wait until the deadline (which may move earlier meanwhile), SIGKILL the
    rest. Returns (termed, killed)."""
    deadline = Deadline.of(timeout)
    procs = [p for p in procs if p.pid != os.getpid()]
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    alive = list(procs)
    while alive and not deadline.passed:
        _, alive = psutil.wait_procs(alive, timeout=min(STOP_POLL, deadline.left()))
    if alive:
        if on_kill:
            on_kill(alive)
        for proc in alive:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(alive, timeout=KILLED_WAIT)
    return len(procs) - len(alive), len(alive)


PHASE_MINIMUM = 0.2  # every phase of a stop gets this long, however late it starts


def stop_in_phases(
    phases: Sequence[Callable[[psutil.Process], bool]], timeout: float | Deadline,
    candidates: Callable[[], list[psutil.Process]] = descendants,
) -> tuple[int, int]:
    """Stop processes in phases (each picks from the candidates still running), then the rest.

    Candidates default to our descendants. One overall deadline; returns (terminated, killed)
    over all phases.
    """
    deadline = Deadline.of(timeout)
    termed = killed = 0
    for wanted in (*phases, lambda _p: True):
        picked = []
        for proc in candidates():
            with contextlib.suppress(psutil.Error):
                if proc.status() != psutil.STATUS_ZOMBIE and wanted(proc):
                    picked.append(proc)
        if picked:
            t, k = stop_processes(picked, deadline.at_least(PHASE_MINIMUM))
            termed, killed = termed + t, killed + k
    reap_zombies()
    return termed, killed


def _netns_inode(pid: int | str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


def is_ray_process(proc: psutil.Process) -> bool:
    try:
        name = proc.name()
        cmdline = " ".join(proc.cmdline())
    except psutil.Error:
        return False
    if any(p in name if by_name else p in cmdline for p, by_name in RAY_PROCESS_PATTERNS):
        return True
    # `ray start --block` and other ray CLI processes: python .../bin/ray start ...
    argv = cmdline.split()
    return len(argv) >= 2 and any(
        Path(a).name == "ray" and argv[i + 1:i + 2] in (["start"], ["stop"])
        for i, a in enumerate(argv[:-1])
    )


def _mentions(proc: psutil.Process, text: str) -> bool:
    """On its command line or in its environment: Ray's client server, for one, shows the
    temp dir only in the environment it inherited from the run that started it."""
    try:
        if text in " ".join(proc.cmdline()):
            return True
        return any(text in value for value in proc.environ().values())
    except psutil.Error:
        return False


def environ_holds(block: bytes, name: str) -> bool:
    """Whether an environment block, as /proc/<pid>/environ holds it, sets `name` (not empty).
    Every entry is looked at: a process that renamed itself (setproctitle: Ray's agents and
    workers) can have NULs over the start of its block, where psutil's reader stops."""
    prefix = name.encode() + b"="
    return any(entry.startswith(prefix) and len(entry) > len(prefix)
               for entry in block.split(b"\0"))


def carries(proc: psutil.Process, name: str) -> bool:
    try:
        with open(f"/proc/{proc.pid}/environ", "rb") as f:
            return environ_holds(f.read(), name)
    except OSError:  # gone, or not ours to read: not known to be podagent's
        return False


@dataclass(frozen=True)
class PodRay:
    """This pod's Ray processes: podagent's own, and those of a Ray someone else started."""
    ours: list[psutil.Process]
    foreign: list[psutil.Process]


def pod_ray(temp_dir: str | None = None) -> PodRay:
    """Ray processes of this pod (same network namespace as us, not us or our ancestors),
    podagent's own apart from anyone else's.

    With a Ray temp dir of its own (tests, a machine shared with other Ray users), only the Ray
    that used it is podagent's business, and all of it is podagent's; any other is neither
    ours to stop nor a reason to refuse (one holding our port is reported then). Without one
    (a pod), a Ray is podagent's when it carries RAY_OWNER, whatever temp dir it used; any
    other is someone else's.
    """
    netns = _netns_inode("self")
    skip = {os.getpid()} | {p.pid for p in psutil.Process().parents()}
    mine, others = [], []
    for proc in psutil.process_iter():
        if proc.pid in skip or _netns_inode(proc.pid) != netns or not is_ray_process(proc):
            continue
        if temp_dir:
            if _mentions(proc, temp_dir):
                mine.append(proc)
        elif carries(proc, RAY_OWNER):
            mine.append(proc)
        else:
            others.append(proc)
    # What those started belongs with them: agents renamed by setproctitle
    # ("ray::DashboardAgent") no longer show the temp dir on their command line, nor always
    # the mark in their environment.
    ours = _with_descendants(mine)
    # A zombie runs nothing: it is no one's Ray.
    foreign = [p for pid, p in _with_descendants(others).items() if pid not in ours and alive(p)]
    return PodRay(list(ours.values()), foreign)


def _with_descendants(procs: list[psutil.Process]) -> dict[int, psutil.Process]:
    found = {p.pid: p for p in procs}
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            found.update({c.pid: c for c in proc.children(recursive=True)})
    return found


def pod_ray_processes(temp_dir: str | None = None) -> list[psutil.Process]:
    """podagent's own Ray processes on this pod (pod_ray); never another's."""
    return pod_ray(temp_dir).ours


def port_holder(port: int) -> str | None:
    """'pid 123 (gcs_server)' for whoever listens on port in this network namespace."""
    with contextlib.suppress(psutil.Error, OSError):
        for conn in psutil.net_connections(kind="inet"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN:
                if conn.pid is None:
                    return "another process"
                with contextlib.suppress(psutil.Error):
                    return f"pid {conn.pid} ({psutil.Process(conn.pid).name()})"
                return f"pid {conn.pid}"
    return None


class Tee(Protocol):
    """Where a teed process's output goes as it comes (the reporter's JobOutput), and one
    line when its log is given up."""

    def write(self, chunk: bytes) -> None: ...

    def close(self) -> None: ...

    def warn(self, message: str) -> None: ...


class ManagedProcess:
    """One external process: started in a session of its own with its output in a log file
    (and, with `tee`, on podagent's own output as it comes), polled, and stopped with what it
    started, TERM -> deadline -> KILL.

    `own_session` (the default): it and what it starts leave podagent's process group, so a
    signal to that group (a terminal's Ctrl-C) reaches podagent alone, which stops them in order.
    `whole_pod`: stopping it stops every process podagent has under it, not only this
    process's tree. A launcher (torchrun, accelerate) starts its workers in sessions of their
    own, so its process group does not hold them, but podagent is a child subreaper and they
    stay its descendants even when the launcher died first."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        log_path: Path,
        cwd: str | None = None,
        *,
        tee: Tee | None = None,
        whole_pod: bool = False,
        own_session: bool = True,
    ):
        self.name, self.argv, self.env = name, list(argv), dict(env)
        self.log_path, self.cwd = Path(log_path), cwd
        self.tee, self.whole_pod, self.own_session = tee, whole_pod, own_session
        self.proc: subprocess.Popen | None = None
        self._pump: threading.Thread | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.tee is None:
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    self.argv, env=self.env, cwd=self.cwd, stdin=subprocess.DEVNULL,
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=self.own_session,
                )
            return
        sys.stdout.flush()
        self.proc = subprocess.Popen(self.argv, env=self.env, cwd=self.cwd,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT,
                                     start_new_session=self.own_session)
        self._pump = threading.Thread(target=self._copy, args=(self.proc.stdout,),
                                      name=f"podagent-{self.name}-output", daemon=True)
        self._pump.start()

    def _copy(self, pipe: object) -> None:
        """The output (its children's too, which share the pipe) to the log and the screen,
        as it comes. A log the volume refuses costs the log, never the screen's copy."""
        assert self.tee is not None
        fd = pipe.fileno()  # type: ignore[attr-defined]
        log: BinaryIO | None = None
        try:
            log = open(self.log_path, "ab")
        except OSError as exc:
            self.tee.warn(f"cannot open {self.log_path} ({exc.strerror}): the output goes to "
                          f"the screen only")
        try:
            while chunk := os.read(fd, _CHUNK):
                if log is not None:
                    try:
                        log.write(chunk)
                        log.flush()
                    except (OSError, ValueError) as exc:
                        with contextlib.suppress(OSError, ValueError):
                            log.close()
                        log = None
                        why = exc.strerror if isinstance(exc, OSError) else str(exc)
                        self.tee.warn(f"cannot write {self.log_path} ({why}): going on "
                                      f"without it; what was written stays, the screen gets "
                                      f"the rest")
                self.tee.write(chunk)
        finally:
            self.tee.close()
            if log is not None:
                with contextlib.suppress(OSError, ValueError):
                    log.close()

    def poll(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def wait(self, timeout: float) -> int | None:
        """Its exit code, or None while it still runs after `timeout` seconds."""
        if self.proc is None:
            raise RuntimeError(f"{self.name} was never started")
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """SIGKILL to this process alone, reaped: what it started is its caller's to stop (in
        the order that caller knows)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.proc.kill()
            self.proc.wait()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def tail(self, lines: int = 30) -> str:
        return log_tail(self.log_path, lines)

    def stop(self, timeout: float | Deadline) -> tuple[int, int]:
        """The process and everything it started, TERM -> deadline -> KILL (termed, killed)."""
        if self.whole_pod:
            result = stop_processes(descendants(), timeout)
        elif not self.proc or self.proc.poll() is not None:
            return 0, 0
        else:
            try:
                tree = [psutil.Process(self.proc.pid),
                        *psutil.Process(self.proc.pid).children(True)]
            except psutil.Error:
                tree = []
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            result = stop_processes(tree, timeout)
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=1)
        if self.whole_pod:
            self.finish_output()
            reap_zombies()
        return result

    def finish_output(self) -> None:
        """With `tee`: let the last of the output reach the screen and the log (bounded: a
        process that kept the pipe open and escaped is not waited for)."""
        if self._pump is not None:
            self._pump.join(timeout=2)
