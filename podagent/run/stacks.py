"""The Python stacks of a hung run's processes on this pod, and which rank is the odd one out.

Each process is dumped with py-spy (Ray's default extra brings it), which reads the stacks
from outside without stopping it for long. Where py-spy cannot (no ptrace allowed in the
container, a Python it does not know), a job that called `podagent.job.enable_stack_dumps()`
is sent SIGUSR1 and faulthandler writes its stacks to a file under PODAGENT_STACKS; a process
that registered no handler for it is never sent the signal (it would end it).

One file per process in the hang's folder (its pid and rank in the name), and a `Stack`
summing it up: is a thread of it inside a collective (torch.distributed, DDP's gradient
all-reduce in backward, a CUDA synchronize), and where it is. In a hang every healthy rank
waits in a collective for the one that never came: `culprits` names the ranks that are not in
one, or, when all are, the few stuck somewhere the others are not.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import psutil

from podagent import process
from podagent.waiting import Backoff, Expired, retry

STACKS_VARIABLE = "PODAGENT_STACKS"  # where a job's faulthandler writes (podagent.job)
DUMP_SIGNAL = signal.SIGUSR1
PY_SPY_TIMEOUT = 15.0  # one process's dump; a hung one answers at once
FAULTHANDLER_WAIT = 3.0  # seconds a signalled process gets to write its stacks
PARALLEL = 8  # processes dumped at once
WHERE_LIMIT = 160  # characters of a `where` on the wire and in a line
# Frames that mean "waiting for the other ranks": torch.distributed's collectives, DDP's
# gradient all-reduce (it finishes inside backward), a CUDA synchronize behind an NCCL kernel.
COLLECTIVE_FILES = ("torch/distributed/", "torch/nn/parallel/distributed.py", "torch/autograd/")
COLLECTIVE_CALLS = ("synchronize",)
# Ray's own processes that run no part of the job.
RAY_NOT_THE_JOB = ("ray::IDLE", "ray::JobSupervisor", "ray::DashboardAgent",
                   "ray::RuntimeEnvAgent")


@dataclass(frozen=True)
class Target:
    """A process to dump: its pid, what to call it, its rank when it has one; a driver (a Ray
    job's, which waits on its ranks) is dumped but never a culprit."""
    pid: int
    label: str
    rank: int | None = None
    driver: bool = False


@dataclass(frozen=True)
class Frame:
    function: str
    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.function} ({Path(self.file).name}:{self.line})"

    @property
    def collective(self) -> bool:
        path = self.file.replace("\\", "/")
        return (any(part in path for part in COLLECTIVE_FILES)
                or self.function.rsplit(".", 1)[-1] in COLLECTIVE_CALLS)


@dataclass(frozen=True)
class Stack:
    """One process's dump, summed up: the thread that matters (one inside a collective, else
    the main thread), innermost frame first."""
    pid: int
    label: str
    rank: int | None = None
    frames: tuple[Frame, ...] = ()
    file: str = ""  # the dump on this pod
    error: str = ""  # why there is no stack
    pod: str = ""
    in_collective: bool = False
    where_text: str = ""  # kept for a stack that came over the wire
    driver: bool = False

    @property
    def where(self) -> str:
        """The innermost frame, and the job's own line it was called from."""
        if self.where_text:
            return self.where_text
        if not self.frames:
            return (self.error or "no Python frame")[:WHERE_LIMIT]
        inner = self.frames[0]
        own = next((f for f in self.frames if "site-packages" not in f.file
                    and "/lib/python" not in f.file), None)
        text = str(inner) if own is None or own is inner else f"{inner} from {own}"
        return text[:WHERE_LIMIT]

    @property
    def name(self) -> str:
        return f"rank {self.rank}" if self.rank is not None else self.label

    def to_wire(self) -> dict[str, Any]:
        return {"pid": self.pid, "label": self.label[:WHERE_LIMIT], "rank": self.rank,
                "collective": self.in_collective, "where": self.where, "file": self.file,
                "error": self.error[:WHERE_LIMIT], "driver": self.driver}

    @classmethod
    def from_wire(cls, body: Mapping[str, Any], pod: str) -> Stack | None:
        """A peer's summary of one of its processes; None for anything malformed."""
        pid, rank = body.get("pid"), body.get("rank")
        if not isinstance(pid, int) or isinstance(pid, bool):
            return None
        if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool)):
            rank = None
        text = {k: str(body.get(k) or "")[:WHERE_LIMIT] for k in ("label", "where", "file",
                                                                    "error")}
        return cls(pid, text["label"], rank, (), text["file"], text["error"], pod,
                   body.get("collective") is True, text["where"], body.get("driver") is True)


# --- which processes ----------------------------------------------------------------------------

def _environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            block = f.read()
    except OSError:
        return {}
    pairs = (entry.split(b"=", 1) for entry in block.split(b"\0") if b"=" in entry)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def _rank(pid: int) -> int | None:
    value = _environ(pid).get("RANK", "")
    return int(value) if value.isdigit() else None


def _identity(pid: int) -> tuple[int, str] | None:
    """The RANK a process carries, with its LOCAL_RANK: what torchrun (or accelerate) gives each
    process it starts, and what any process that one starts inherits. LOCAL_RANK tells a rank
    from a launcher that has a RANK of its own from the pod's environment (and no LOCAL_RANK)."""
    env = _environ(pid)
    value = env.get("RANK", "")
    return (int(value), env.get("LOCAL_RANK", "")) if value.isdigit() else None


def _is_python(pid: int) -> bool:
    """A Python process (its program, or a libpython it loaded): a shell or `sleep` under
    the driver has no Python stack to dump."""
    with contextlib.suppress(OSError):
        if "python" in Path(os.readlink(f"/proc/{pid}/exe")).name:
            return True
        with open(f"/proc/{pid}/maps", "rb") as f:
            return b"libpython" in f.read()
    return False


def _title(proc: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        argv = [a for a in proc.cmdline() if a]
        if argv:
            return " ".join(argv)[:WHERE_LIMIT]
    return "?"


def training_targets(launcher: int | None = None) -> list[Target]:
    """A run without Ray: the launcher's ranks under this podagent (torchrun gives each its
    RANK); the launcher itself (`launcher`, its pid) waits on them and is left out, whatever
    RANK the pod's environment gave it. What a rank starts (DataLoader workers, forked or
    spawned, any subprocess of the training) inherits its RANK, but is no rank: a process
    below one that carries the same RANK (and LOCAL_RANK) is left out, else every rank's idle
    workers, in no collective, would be named culprits."""
    carried: dict[int, tuple[int, str] | None] = {}
    parent: dict[int, int] = {}
    for proc in process.descendants():
        if proc.pid == launcher:
            continue
        with contextlib.suppress(psutil.Error):
            parent[proc.pid] = proc.ppid()
            carried[proc.pid] = _identity(proc.pid)

    def below_its_rank(pid: int) -> bool:  # an ancestor in this tree carries the same
        seen, up = {pid}, parent[pid]
        while up in carried and up not in seen:
            if carried[up] == carried[pid]:
                return True
            seen.add(up)
            up = parent[up]
        return False

    found = [Target(pid, f"rank {who[0]} (pid {pid})", who[0])
             for pid, who in carried.items() if who is not None and not below_its_rank(pid)]
    return sorted(found, key=lambda t: (t.rank, t.pid))


def ray_job_targets(ray_processes: Iterable[psutil.Process]) -> list[Target]:
    """The Ray path: of this pod's Ray processes, the job's workers and actors (Ray gives each
    RAY_JOB_ID) and the job's driver with what it started (under the JobSupervisor). Ray
    starts every worker from its raylet: a job process below another one is what that one
    started (a DataLoader's workers, forked with its title and environment), no actor of its
    own, and is left out, as a rank's are without Ray."""
    ray_processes = list(ray_processes)
    parent: dict[int, int] = {}
    for proc in ray_processes:
        with contextlib.suppress(psutil.Error):
            parent[proc.pid] = proc.ppid()
    found: dict[int, Target] = {}
    for proc in ray_processes:
        title = _title(proc)
        if title.startswith("ray::JobSupervisor"):
            with contextlib.suppress(psutil.Error):
                for child in proc.children(recursive=True):
                    if not _is_python(child.pid):
                        continue
                    found[child.pid] = Target(child.pid, f"driver (pid {child.pid}: "
                                                         f"{_title(child)[:60]})",
                                              driver=True)
            continue
        if not title.startswith("ray::") or title.startswith(RAY_NOT_THE_JOB):
            continue
        if "RAY_JOB_ID" in _environ(proc.pid):
            found[proc.pid] = Target(proc.pid, f"{title.split()[0]} (pid {proc.pid})",
                                     _rank(proc.pid))
    actors = {pid for pid, target in found.items() if not target.driver}

    def started_by_an_actor(pid: int) -> bool:
        seen, up = {pid}, parent.get(pid)
        while up is not None and up not in seen:
            if up in actors:
                return True
            seen.add(up)
            up = parent.get(up)
        return False

    return sorted((t for pid, t in found.items() if t.driver or not started_by_an_actor(pid)),
                  key=lambda t: t.pid)


# --- dumping ------------------------------------------------------------------------------------

def py_spy() -> str | None:
    """py-spy beside this Python (Ray's extra installs it there), else on PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


def dump(targets: Sequence[Target], folder: Path, stacks_dir: Path | None = None) -> list[Stack]:
    """Every target dumped at once into `folder` (one file each); their summaries in order."""
    folder.mkdir(parents=True, exist_ok=True)
    spy = py_spy()
    with ThreadPoolExecutor(max_workers=PARALLEL, thread_name_prefix="podagent-dump") as pool:
        return list(pool.map(lambda t: _dump_one(t, folder, spy, stacks_dir), targets))


def _file_for(target: Target, folder: Path) -> Path:
    who = f"rank-{target.rank}" if target.rank is not None else "process"
    return folder / f"{who}-pid-{target.pid}.txt"


def _dump_one(target: Target, folder: Path, spy: str | None, stacks_dir: Path | None) -> Stack:
    path = _file_for(target, folder)
    why = "py-spy is not installed"
    if spy:
        try:
            done = subprocess.run([spy, "dump", "--json", "--pid", str(target.pid)],
                                  capture_output=True, timeout=PY_SPY_TIMEOUT, check=False)
            if done.returncode == 0:
                threads = json.loads(done.stdout)
                _write(path, target, render_py_spy(threads))
                return summarize(target, parse_py_spy(threads), str(path))
            why = f"py-spy: {_first_line(done.stderr) or f'exit {done.returncode}'}"
        except subprocess.TimeoutExpired:
            why = f"py-spy took over {PY_SPY_TIMEOUT:g} s"
        except (OSError, ValueError) as exc:
            why = f"py-spy: {exc}"
    text = _faulthandler(target.pid, stacks_dir)
    if text is not None:
        _write(path, target, f"# {why}: the job's own faulthandler wrote these\n{text}")
        return summarize(target, parse_faulthandler(text), str(path))
    error = (f"{why}; and it registered no faulthandler for SIGUSR1 "
             f"(podagent.job.enable_stack_dumps())")
    _write(path, target, error + "\n")
    return Stack(target.pid, target.label, target.rank, file=str(path), error=error,
                 driver=target.driver)


def _first_line(raw: bytes) -> str:
    lines = [line for line in raw.decode(errors="replace").splitlines() if line.strip()]
    return lines[0][:WHERE_LIMIT] if lines else ""


def _write(path: Path, target: Target, text: str) -> None:
    with contextlib.suppress(OSError):
        path.write_text(f"# {target.label}\n{text}")


def _catches(pid: int, signum: int) -> bool:
    """Whether the process has a handler for the signal (/proc's SigCgt mask)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def _faulthandler(pid: int, stacks_dir: Path | None) -> str | None:
    """The stacks a job's registered faulthandler writes on SIGUSR1 (None: it registered
    none, or wrote nothing in time). Its own PODAGENT_STACKS wins: a Ray actor has the
    head's, which may not be this pod's run directory."""
    own = _environ(pid).get(STACKS_VARIABLE)
    stacks_dir = Path(own) if own else stacks_dir
    if stacks_dir is None or not _catches(pid, DUMP_SIGNAL):
        return None
    path = stacks_dir / f"{pid}.txt"
    if not path.exists():
        return None  # a handler of its own, not faulthandler's: not ours to trigger
    start = path.stat().st_size
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, DUMP_SIGNAL)
    sizes = [start]

    def written() -> bool:  # it grew, and no longer grows
        with contextlib.suppress(OSError):
            sizes.append(path.stat().st_size)
        return sizes[-1] > start and sizes[-1] == sizes[-2]

    with contextlib.suppress(Expired):  # what it wrote by then is read all the same
        retry(written, awaited=f"process {pid}'s faulthandler to write {path}",
              backoff=Backoff.every(0.1), deadline=FAULTHANDLER_WAIT, until=bool)
    with contextlib.suppress(OSError), open(path, errors="replace") as f:
        f.seek(start)
        text = f.read()
        return text or None
    return None


# --- reading the dumps --------------------------------------------------------------------------

Threads = list[tuple[str, bool, tuple[Frame, ...]]]  # (name, is the main thread, frames)


def _threads(raw: Any) -> list[dict[str, Any]]:
    return [t for t in raw if isinstance(t, dict)] if isinstance(raw, list) else []


def _frames(thread: dict[str, Any]) -> list[dict[str, Any]]:
    return _threads(thread.get("frames"))


def _line(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def parse_py_spy(threads: Any) -> Threads:
    out: Threads = []
    for thread in _threads(threads):
        frames = tuple(Frame(str(f.get("name", "?")), str(f.get("filename", "?")),
                             _line(f.get("line")))
                       for f in _frames(thread))
        tid = thread.get("os_thread_id")
        main = thread.get("thread_name") == "MainThread" or (
            tid is not None and tid == thread.get("pid"))
        out.append((str(thread.get("thread_name") or thread.get("os_thread_id")), main, frames))
    return out


def render_py_spy(threads: Any) -> str:
    """py-spy's JSON as the text `py-spy dump` prints."""
    lines = []
    for thread in _threads(threads):
        state = "active" if thread.get("active") else "idle"
        lines.append(f"Thread {thread.get('os_thread_id')} ({state}): "
                     f"\"{thread.get('thread_name') or ''}\"")
        for f in _frames(thread):
            lines.append(f"    {f.get('name')} ({f.get('filename')}:{f.get('line')})")
    return "\n".join(lines) + "\n"


_FH_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)", re.M)
_FH_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.+)$')


def parse_faulthandler(text: str) -> Threads:
    """faulthandler's format: a block per thread, innermost frame first; the signal's
    handler runs on the main thread, which it calls the current one."""
    out: Threads = []
    starts = list(_FH_THREAD.finditer(text))
    for i, head in enumerate(starts):
        block = text[head.end():starts[i + 1].start() if i + 1 < len(starts) else len(text)]
        frames = tuple(Frame(m[3].strip(), m[1], int(m[2]))
                       for m in map(_FH_FRAME.match, block.splitlines()) if m)
        out.append((head[2], head[1] == "Current thread", frames))
    return out


def summarize(target: Target, threads: Threads, file: str) -> Stack:
    waiting = next((frames for _, _, frames in threads
                    if any(f.collective for f in frames)), None)
    main = next((frames for _, is_main, frames in threads if is_main),
                threads[0][2] if threads else ())
    frames = waiting if waiting is not None else main
    return Stack(target.pid, target.label, target.rank, frames, file,
                 "" if threads else "no Python thread in the dump",
                 in_collective=waiting is not None, driver=target.driver)


# --- the verdict --------------------------------------------------------------------------------

def culprits(stacks: Sequence[Stack]) -> list[Stack]:
    """The likely culprits: the processes not in a collective while others wait in one; when
    every one is (or none), those stuck where fewer than half of them are. None when nothing
    stands out (all at one place, or each at its own)."""
    seen = [s for s in stacks if not s.error and not s.driver]
    if len(seen) < 2:
        return []
    waiting = [s for s in seen if s.in_collective]
    if waiting and len(waiting) < len(seen):
        return [s for s in seen if not s.in_collective]
    places = Counter(s.where for s in seen)
    if len(places) < 2 or len(places) == len(seen):
        return []
    return [s for s in seen if places[s.where] * 2 < len(seen)]


def pod_line(dumped: PodDump) -> str:
    """One line for one pod's processes."""
    pod, stacks = dumped.pod, dumped.stacks
    if dumped.error:
        return f"pod {pod}: {dumped.error}"
    if not stacks:
        return f"pod {pod}: no process of the run to dump"
    parts = []
    for s in stacks:
        if s.error:
            parts.append(f"{s.name}: no stack ({s.error})")
        else:
            state = "in a collective" if s.in_collective else "NOT in a collective"
            parts.append(f"{s.name} {state}: {s.where}")
    return f"pod {pod}: " + "; ".join(parts)


def verdict(stacks: Sequence[Stack]) -> str:
    found = culprits(stacks)
    if not found:
        return "no rank stands out (every one is at the same place, or none could be read)"
    named = ", ".join(f"{s.name} on pod {s.pod}" for s in found)
    return f"likely culprit: {named} ({found[0].where})"


@dataclass
class PodDump:
    """One pod's answer to a dump request."""
    pod: str
    stacks: list[Stack] = field(default_factory=list)
    folder: str = ""
    seconds: float = 0.0
    error: str = ""  # no answer came

    def to_wire(self) -> dict[str, Any]:
        return {"pod": self.pod, "folder": self.folder, "seconds": round(self.seconds, 3),
                "stacks": [s.to_wire() for s in self.stacks]}

    @classmethod
    def from_wire(cls, body: Mapping[str, Any], pod: str) -> PodDump:
        raw = body.get("stacks")
        stacks = [s for s in (Stack.from_wire(b, pod) for b in
                              (raw if isinstance(raw, list) else [])[:256]
                              if isinstance(b, dict)) if s is not None]
        seconds = body.get("seconds")
        valid = (isinstance(seconds, (int, float)) and not isinstance(seconds, bool)
                 and math.isfinite(seconds) and seconds >= 0)
        return cls(pod, stacks, str(body.get("folder") or "")[:WHERE_LIMIT],
                   float(seconds) if valid else 0.0)


def dump_pod(pod: str, targets: Sequence[Target], folder: Path,
             stacks_dir: Path | None) -> PodDump:
    started = time.monotonic()
    stacks = [replace(s, pod=pod) for s in dump(targets, folder, stacks_dir)]
    return PodDump(pod, stacks, str(folder), time.monotonic() - started)
