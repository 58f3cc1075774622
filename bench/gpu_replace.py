"""A pod lost mid-training on K pods of one host, one GPU each (bench/gpu_pods.py's pods: a
network namespace per pod, NCCL over sockets, NVLink multicast off in every process): seconds
from the loss to training again on K GPUs, two ways, in the same run, in turn.

    python bench/gpu_replace.py --pods 4 --runs 2     # root, K GPUs, torch, pyroute2; no Ray
    python bench/gpu_replace.py --cpu --pods 3        # the same flow with gloo, without GPUs

Every pod runs `podagent torchrun` (the head in gp0, K-1 workers) on tests/jobs/hang_loop.py, a
DDP loop that checkpoints every step (0.2 s apart) into a directory every pod shares and resumes
from its newest checkpoint. Once the checkpoint of step --lose-at is written, the last worker
pod is lost as RunPod loses a host: every process of it SIGKILLed, its namespace deleted. Then:

  replace      podagent's way. The bench does what RunPod does with a pod whose container
               exits: each surviving pod's podagent, out with a code that podagent's exit table
               calls restartable (PeerLost, 22), is started again on the same pod; and, once
               the lost pod's GPU is free, a new pod (a fresh namespace, a new address, a fresh
               log directory: a new host; the lost pod's GPU) is created and podagent started
               there. The gang forms again at K and the loop resumes from its checkpoint.
  restart-all  the peers' way (dstack resubmits the whole run, SkyPilot's managed jobs restart
               every node): at the loss the bench stops every pod's podagent (SIGTERM, SIGKILL
               after 30 s), deletes every namespace, creates K new pods once the lost GPU is
               free and starts podagent on all of them; the loop resumes from the same
               checkpoint directory.

The bench knows of the loss at once and creates pods for free, so restart-all's detection and
both ways' pod creation at RunPod (minutes: an image to pull) are not in the figures; what
replace spends on its own (noticing the loss, PODAGENT_RESTART_BACKOFF before the run starts
again on the surviving pods) is. Every pod, the replacement too, exits 0 once the loop is done.

Per run and way:
  training again  the loss (the SIGKILL) → the first step after it that every rank reported:
                  rank 0 prints "starting at step X (checkpoint: X-1)" once the new gang formed,
                  and saves step-X.pt only after step X's gradient all-reduce, which every rank
                  joins; the figure is that file's modification time (where the file system
                  keeps whole seconds only: when the bench, looking every 0.1 s, first saw
                  it). Every rank's own OUT/rank<R>.json (written when its loop ends) must
                  say it started at X and ran to --steps: no further restart, K ranks.
  resumed         X, from checkpoint X-1 (at least --lose-at: nothing saved was lost).
  lost GPU free   the loss → no process of the lost pod left with a GPU open (its namespace's
                  processes with /dev/nvidia<N> open, nvidia-smi's compute apps on that GPU,
                  its rank processes); with --cpu: no rank process of the lost pod left.
  others out      the loss → the last surviving pod's podagent out (replace: PeerLost, found
                  by podagent; restart-all: the bench's SIGTERM, or PeerLost where it came
                  first).
Then the medians per way and the ratio restart-all / replace. Exit 0 only when every run of
both ways passed every check. At the end, on an error and on Ctrl-C nothing is left: no
process, no namespace, no bridge.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import gpu_hang as hang  # noqa: E402
import gpu_pods as pods  # noqa: E402

from podagent import __version__ as PODAGENT_VERSION  # noqa: E402
from podagent.run import exits  # noqa: E402
from tests.harness import benchkit  # noqa: E402
from tests.harness.benchkit import RunFailed, fmt, last_lines, median, table  # noqa: E402

WAYS = ("replace", "restart-all")
LOSS_WITHIN = 300.0  # start → the checkpoint of step --lose-at
FREE_WITHIN = 60.0  # the loss → the lost pod's GPU free
STOP_WITHIN = 30.0  # restart-all: SIGTERM → SIGKILL
IDLE_WITHIN = 60.0  # the GPUs free of earlier processes before a run
CRASH_LOOP = 5  # RunPod stops a pod whose container keeps exiting
POLL = 0.05
STARTING = re.compile(r"starting at step (\d+) \(checkpoint: (\w+)\)")

os.environ.update(pods.SAFE)  # this process and whatever it starts: no NVLink multicast


# --- Ctrl-C and SIGTERM --------------------------------------------------------------------------

_calm = {"depth": 0, "pending": False, "pid": os.getpid()}


def interrupted(signum: int, frame: Any) -> None:
    """Ctrl-C or SIGTERM: KeyboardInterrupt, so that every clean-up runs; held back while the
    network changes or a clean-up runs (netlink interrupted midway can leave it hanging). A
    child forked from this process (pyroute2 forks to enter a namespace, and ends it with
    SIGTERM) only exits: the bench's clean-up is the bench's alone."""
    if os.getpid() != _calm["pid"]:
        os._exit(128 + signum)
    if _calm["depth"]:
        _calm["pending"] = True
    else:
        raise KeyboardInterrupt


@contextlib.contextmanager
def calm() -> Iterator[None]:
    _calm["depth"] += 1
    try:
        yield
    finally:
        _calm["depth"] -= 1
    if not _calm["depth"] and _calm["pending"]:
        _calm["pending"] = False
        raise KeyboardInterrupt


# --- the GPUs, seen from outside ---------------------------------------------------------------


def smi(*query: str) -> list[list[str]]:
    """nvidia-smi's CSV rows for the query ([] where it is missing or fails)."""
    try:
        done = subprocess.run(["nvidia-smi", *query, "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return []
    return [[x.strip() for x in line.split(",")] for line in done.stdout.splitlines()
            if line.strip()]


def gpu_uuids() -> dict[int, str]:
    """GPU index (PCI bus order, as the pods' CUDA_DEVICE_ORDER) → its UUID."""
    return {int(row[0]): row[1] for row in smi("--query-gpu=index,uuid") if len(row) == 2}


def compute_pids(uuid: str) -> list[int]:
    """The processes nvidia-smi sees with a context on that GPU."""
    return [int(row[0]) for row in smi("--query-compute-apps=pid,gpu_uuid")
            if len(row) == 2 and row[1] == uuid and row[0].isdigit()]


def proc_start(pid: int) -> tuple[str, int] | None:
    """(state, start time in ticks) of a process; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[19])


def netns_key(name: str) -> tuple[int, int]:
    st = os.stat(f"/var/run/netns/{name}")
    return st.st_dev, st.st_ino


def in_netns(key: tuple[int, int]) -> list[int]:
    """The processes in that network namespace, also once its name is deleted (a zombie's
    namespace cannot be read: it holds nothing any more)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                st = os.stat(f"/proc/{entry}/ns/net")
                if (st.st_dev, st.st_ino) == key:
                    found.append(int(entry))
    return found


def holds_gpu(pid: int) -> bool:
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if hang.NVIDIA.match(os.readlink(f"/proc/{pid}/fd/{fd}")):
                    return True
    return False


def rank_processes(name: str) -> list[tuple[int, int]]:
    """(pid, start time) of the pod's training ranks: hang_loop.py, not its launcher or
    podagent."""
    found = []
    for pid in pods.pod_pids(name):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if b"hang_loop.py" in cmd and b"podagent" not in cmd \
                and b"torch.distributed.run" not in cmd:
            started = proc_start(pid)
            if started:
                found.append((pid, started[1]))
    return found


class FreeWatch:
    """From the loss on, in the background: when nothing of the lost pod held its GPU (with
    --cpu: when none of its ranks was left)."""

    def __init__(self, ranks: list[tuple[int, int]], ns: tuple[int, int], uuid: str | None,
                 cpu: bool, since: float):
        self.ranks, self.ns, self.uuid, self.cpu, self.since = ranks, ns, uuid, cpu, since
        self.freed_at: float | None = None
        self.left: list[int] = []
        self.done = threading.Event()
        threading.Thread(target=self._watch, daemon=True).start()

    def holders(self) -> list[int]:
        found = [pid for pid, start in self.ranks
                 if (state := proc_start(pid)) and state[1] == start and state[0] != "Z"]
        if not self.cpu:
            found += [pid for pid in in_netns(self.ns) if holds_gpu(pid)]
            if self.uuid:
                found += compute_pids(self.uuid)
        return sorted(set(found))

    def _watch(self) -> None:
        deadline = time.monotonic() + FREE_WITHIN
        while time.monotonic() < deadline:
            self.left = self.holders()
            if not self.left:
                self.freed_at = time.time()
                break
            time.sleep(POLL if self.cpu else 0.2)
        self.done.set()

    @property
    def free_s(self) -> float | None:
        return None if self.freed_at is None else round(self.freed_at - self.since, 2)


# --- pods one at a time (gpu_pods.py makes and removes them all at once; its add_pod adds one) ---


def remove_pod(name: str) -> None:
    """Every process of the pod SIGKILLed, then its veth and namespace deleted."""
    from pyroute2 import IPRoute, netns

    pods.kill_pod(name)
    with IPRoute() as ipr:
        for index in ipr.link_lookup(ifname=f"{name}h"):
            ipr.link("del", index=index)
    netns.remove(name)
    shutil.rmtree(pods.ray_temp(name), ignore_errors=True)


# --- the pods' podagents -------------------------------------------------------------------------


class Pod:
    """One pod's `podagent torchrun`, started again after each restartable exit as RunPod
    starts a container again; its output appended to ROOT/<pod>.out."""

    def __init__(self, i: int, gpu: int, root: Path, args: argparse.Namespace,
                 job: list[str]):
        self.i, self.gpu, self.name = i, gpu, pods.pod_name(i)
        self.out = root / f"{self.name}.out"
        extra = {"EXPECTED_WORKERS": str(args.pods - 1), "RAY_WORKER": "1" if i else "0"}
        if i:
            extra["PODAGENT_HEAD_ADDR"] = pods.pod_ip(0)
        if args.cpu:
            extra["PODAGENT_CHECK_BACKEND"] = "gloo"
        self.env = pods.pod_env(i, args.cpu, root, extra)  # its log dir: ROOT/<pod>
        # Its one GPU by index in PCI bus order, nvidia-smi's order.
        self.env.update(CUDA_VISIBLE_DEVICES="" if args.cpu else str(gpu),
                        CUDA_DEVICE_ORDER="PCI_BUS_ID")
        self.argv = [sys.executable, "-m", "podagent", "torchrun", "--", *job]
        self.proc: subprocess.Popen | None = None
        self.file: TextIO | None = None
        self.ended: subprocess.Popen | None = None  # the start whose exit is recorded
        self.ends: list[tuple[float, int]] = []  # (when, code) of each exit seen
        self.done = False

    def start(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.out, "a")
        self.file.write(f"--- bench: podagent start {len(self.ends) + 1} at {time.time():.3f}\n")
        self.file.flush()
        self.proc = pods.in_pod(self.name, self.argv, self.env, stdout=self.file,
                                stderr=subprocess.STDOUT)

    def poll(self) -> int | None:
        """Its exit code once it exited (recorded once); None while it runs."""
        if self.proc is None or self.proc is self.ended:
            return None
        code = self.proc.poll()
        if code is None:
            return None
        if self.file:
            self.file.close()
            self.file = None
        self.ends.append((time.time(), code))
        self.ended = self.proc
        return code

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def text(self) -> str:
        return self.out.read_text(errors="replace") if self.out.exists() else ""

    def close(self) -> None:
        if self.running():
            with contextlib.suppress(OSError):
                pods.kill_pod(self.name)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)
        if self.file:
            self.file.close()
            self.file = None


class Fleet:
    """The run's current pods, the bench acting as RunPod: an exit that podagent calls
    restartable starts the pod's podagent again, 0 ends the pod, any other code fails the run."""

    def __init__(self, args: argparse.Namespace, logs: Path):
        self.args, self.logs = args, logs
        self.out, self.ckpt = logs / "out", logs / "ckpt"  # what every pod shares
        self.out.mkdir(parents=True, exist_ok=True)
        self.job = hang.loop_job(self.out, self.ckpt, args.cpu, -1, args.steps)
        self.pods: list[Pod] = []
        self.gone: list[Pod] = []  # lost or stopped
        self.restarts = 0
        self.seen: dict[str, float] = {}  # each checkpoint file: when the bench first saw it

    def add(self, i: int, gpu: int, root: Path) -> Pod:
        pod = Pod(i, gpu, root, self.args, self.job)
        self.pods.append(pod)
        pod.start()
        return pod

    def tick(self) -> None:
        with contextlib.suppress(OSError):
            for name in os.listdir(self.ckpt):
                self.seen.setdefault(name, time.time())
        for pod in self.pods:
            code = pod.poll()
            if code is None:
                continue
            if code == 0:
                pod.done = True
            elif exits.restartable(code) and len(pod.ends) <= CRASH_LOOP:
                self.restarts += 1
                pod.start()
            else:
                why = ("restarted too often" if exits.restartable(code)
                       else "not restartable")
                raise RunFailed(f"{pod.name}'s podagent exited {code} "
                                f"({exits.meaning(code)}; {why})", last_lines(pod.text()))

    def until(self, done: Callable[[], Any], timeout: float, what: str) -> Any:
        """Wait for `done`, acting on every exit meanwhile."""
        return hang.wait(lambda: self.tick() or done(), timeout, what, self.tail)

    def finished(self) -> bool:
        return len(self.pods) == self.args.pods and all(p.done for p in self.pods)

    def head(self) -> Pod:
        return next(p for p in self.pods if p.i == 0)

    def tail(self) -> str:
        return self.head().text() if self.pods else ""

    def close(self) -> None:
        for pod in self.pods + self.gone:
            pod.close()


# --- one run ------------------------------------------------------------------------------------


@dataclass
class Run(benchkit.RunRecord):
    # seconds: the loss → training again on K GPUs (benchkit's figure field)
    way: str
    index: int
    resumed: int | None = None  # the first step after the loss
    checkpoint: int | None = None  # the checkpoint it resumed from
    free_s: float | None = None  # the loss → the lost pod's GPU free
    out_s: float | None = None  # the loss → the last surviving podagent out
    restarts: int = 0  # podagent starts again on surviving pods (RunPod's restarts)


def gpus_idle(k: int, uuids: dict[int, str]) -> None:
    """With GPUs: nothing (an earlier run, another user) has a context on the K GPUs."""
    def idle() -> bool:
        return not any(compute_pids(uuids[g]) for g in range(k) if g in uuids)

    hang.wait(idle, IDLE_WITHIN, f"GPUs 0-{k - 1} without compute processes", lambda: "")


def lose(fleet: Fleet, uuids: dict[int, str]) -> tuple[Pod, float, FreeWatch, int]:
    """The last worker pod lost as a host is: SIGKILL, namespace deleted. The pod, the loss's
    time, the watch on its GPU and the head's output length then."""
    lost = fleet.pods[-1]
    ranks = rank_processes(lost.name)
    if not ranks:
        raise RunFailed(f"{lost.name} had no rank process to lose", last_lines(lost.text()))
    ns = netns_key(lost.name)
    mark = len(fleet.head().text())
    killed = time.time()
    pods.kill_pod(lost.name)
    watch = FreeWatch(ranks, ns, uuids.get(lost.gpu), fleet.args.cpu, killed)
    lost.poll()
    with calm():
        remove_pod(lost.name)
    fleet.pods.remove(lost)
    fleet.gone.append(lost)
    return lost, killed, watch, mark


def await_free(fleet: Fleet, watch: FreeWatch, lost: Pod) -> None:
    fleet.until(watch.done.is_set, FREE_WITHIN + 10, f"the watch on {lost.name}'s GPU")
    if watch.freed_at is None:
        raise RunFailed(f"{lost.name}'s GPU {lost.gpu} free: not within {FREE_WITHIN:g} s "
                        f"(still held by {watch.left})", last_lines(fleet.tail()))


def replace(fleet: Fleet, lost: Pod, watch: FreeWatch, logs: Path) -> None:
    await_free(fleet, watch, lost)
    i = max(p.i for p in fleet.pods + fleet.gone) + 1  # a new pod: its own address
    with calm():
        pods.add_pod(i)
    fleet.add(i, lost.gpu, logs / "pods")


def restart_all(fleet: Fleet, lost: Pod, watch: FreeWatch, logs: Path, run: Run) -> None:
    survivors = list(fleet.pods)
    for pod in survivors:
        if pod.running():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pod.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_WITHIN
    while any(p.running() for p in survivors) and time.monotonic() < deadline:
        time.sleep(POLL)
    run.extra["sigkilled"] = [p.name for p in survivors if p.running()]
    for pod in survivors:
        pods.kill_pod(pod.name)
        pod.proc.wait(timeout=30)
        pod.poll()
    fleet.pods.clear()
    fleet.gone += survivors
    with calm():
        pods.remove_network()
    await_free(fleet, watch, lost)
    with calm():
        pods.make_network(fleet.args.pods)
    for i in range(fleet.args.pods):
        fleet.add(i, i, logs / "restarted")


def read_figures(run: Run, fleet: Fleet, killed: float, since: str) -> None:
    k, args = fleet.args.pods, fleet.args
    found = STARTING.search(since)
    if not found or not found[2].isdigit():
        said = found[0] if found else "no line"
        raise RunFailed(f"rank 0 did not resume from a checkpoint after the loss ({said})",
                        last_lines(fleet.tail()))
    run.resumed, run.checkpoint = int(found[1]), int(found[2])
    step = fleet.ckpt / f"step-{run.resumed}.pt"
    if not step.exists():
        raise RunFailed(f"no {step.name} after the loss", last_lines(fleet.tail()))
    saved = step.stat().st_mtime
    if saved == int(saved) and step.name in fleet.seen:  # a file system of whole seconds
        saved, run.extra["timed_by"] = fleet.seen[step.name], "the bench's first sight"
    run.seconds = round(saved - killed, 2)
    ranks = {}
    for r in range(k):
        path = fleet.out / f"rank{r}.json"
        ranks[r] = json.loads(path.read_text()) if path.exists() else None
    wrong = {r: v for r, v in ranks.items()
             if not v or v.get("first") != run.resumed or v.get("last") != args.steps}
    if wrong or len(list(fleet.out.glob("rank*.json"))) != k:
        raise RunFailed(f"not every rank of {k} started at step {run.resumed} and ran to "
                        f"{args.steps}: {wrong or sorted(p.name for p in fleet.out.iterdir())}",
                        last_lines(fleet.tail()))
    if run.checkpoint < args.lose_at or run.resumed != run.checkpoint + 1 or run.seconds <= 0:
        raise RunFailed(f"resumed at {run.resumed} from checkpoint {run.checkpoint} "
                        f"({run.seconds} s after the loss at step {args.lose_at})",
                        last_lines(fleet.tail()))


def one(run: Run, logs: Path, args: argparse.Namespace, uuids: dict[int, str]) -> None:
    if not args.cpu:
        gpus_idle(args.pods, uuids)
    fleet = Fleet(args, logs)
    try:
        with calm():
            pods.make_network(args.pods)
        for i in range(args.pods):
            fleet.add(i, i, logs / "pods")
        fleet.until((fleet.ckpt / f"step-{args.lose_at}.pt").exists, LOSS_WITHIN,
                    f"the checkpoint of step {args.lose_at}")
        survivors = fleet.pods[:-1]
        lost, killed, watch, mark = lose(fleet, uuids)
        if run.way == "replace":
            replace(fleet, lost, watch, logs)
        else:
            restart_all(fleet, lost, watch, logs, run)
            mark = 0  # a new head: its own output
        fleet.until(fleet.finished, args.run_timeout, "every pod's loop finished (exit 0)")
        run.free_s, run.restarts = watch.free_s, fleet.restarts
        run.exit_codes = {p.name: p.ends[-1][1] for p in fleet.pods}
        run.extra["survivors_after_loss"] = {p.name: [c for t, c in p.ends if t > killed]
                                             for p in survivors}
        outs = [min(t for t, _ in p.ends if t > killed) for p in survivors]
        run.out_s = round(max(outs) - killed, 2)
        read_figures(run, fleet, killed, fleet.head().text()[mark:])
        run.ok = True
    finally:
        with calm():
            fleet.close()
            pods.remove_network()


# --- report -------------------------------------------------------------------------------------


def line(run: Run, total: int) -> str:
    figure = (f"training again {fmt(run.seconds, 1)} s at step {run.resumed}, lost GPU free "
              f"{fmt(run.free_s, 2)} s, others out {fmt(run.out_s, 1)} s")
    return benchkit.status_line(run, f"{run.way} run {run.index}/{total}", figure)


def ratio_of(runs: list[Run]) -> tuple[float | None, float | None, float | None]:
    mid = {way: median([r.seconds for r in runs if r.way == way and r.ok
                        and r.seconds is not None]) for way in WAYS}
    both = mid["replace"] and mid["restart-all"]
    return mid["replace"], mid["restart-all"], mid["restart-all"] / mid["replace"] if both \
        else None


def render(runs: list[Run], args: argparse.Namespace, meta: dict[str, Any]) -> str:
    backend = "gloo on CPUs" if args.cpu else f"NCCL over sockets, one {meta['gpu']} per pod"
    out = [f"### {args.host or meta['machine']}: a pod lost mid-training, replaced vs every "
           f"pod restarted, K={args.pods} ({meta['started']})", "",
           f"{backend}; {meta['machine']}; torch {meta['torch']}, podagent {meta['podagent']} "
           f"(commit {meta['commit']}); `podagent torchrun` on tests/jobs/hang_loop.py, "
           f"{args.steps} steps of 0.2 s, the last worker pod lost after step {args.lose_at}; "
           f"{args.runs} run(s) per way, in turn.", ""]
    def codes(found: dict[str, Any]) -> str:
        return "; ".join(f"{name} {' → '.join(str(c) for c in (v if isinstance(v, list) else [v]))}"
                         for name, v in sorted(found.items())) or "-"

    rows = [[r.way, str(r.index), fmt(r.seconds, 1),
             f"{r.resumed} (from {r.checkpoint})" if r.resumed is not None else "-",
             fmt(r.free_s, 2), fmt(r.out_s, 1), str(r.restarts),
             codes(r.extra.get("survivors_after_loss", {})), codes(r.exit_codes),
             "ok" if r.ok else "FAILED"] for r in runs]
    out += [table(["way", "run", "loss → training again on K GPUs s", "resumed at step",
                   "lost GPU free s", "others out s", "podagent restarts",
                   "surviving pods' exits after the loss", "final pods' exits", "checks"],
                  rows), ""]
    mids = []
    for way in WAYS:
        mine = [r for r in runs if r.way == way and r.ok]

        def mid(attr: str, digits: int = 1, mine: list[Run] = mine) -> str:
            return fmt(median([getattr(r, attr) for r in mine
                               if getattr(r, attr) is not None]), digits)

        mids.append([way, mid("seconds"), mid("free_s", 2), mid("out_s"),
                     f"{len(mine)}/{len([r for r in runs if r.way == way])}"])
    replace_s, all_s, ratio = ratio_of(runs)
    out += [table(["way", "training again s (median)", "lost GPU free s", "others out s",
                   "runs passed"], mids), "",
            f"restart-all / replace: {fmt(ratio)}x (medians {fmt(all_s, 1)} s / "
            f"{fmt(replace_s, 1)} s).", "",
            "training again: the SIGKILL → rank 0's checkpoint of the first step after the "
            "loss (saved after that step's all-reduce, which every rank joins; every rank's "
            "rank<R>.json says it started there); resumed at: that step, from the checkpoint "
            "before it; lost GPU free: the SIGKILL → no process of the lost pod with its GPU "
            "open (--cpu: no rank of it left); others out: the SIGKILL → the last surviving "
            "pod's podagent out; restarts: podagent started again on surviving pods after a "
            "restartable exit. Pod creation at RunPod is in neither way's figure.", ""]
    return benchkit.join_report(out, runs, label=lambda r: r.way, what="way")


def leftovers(outdir: Path) -> list[str]:
    """What of the bench is still there: processes with its results folder on their command
    line, namespaces and the bridge of gpu_pods.py's pods."""
    from pyroute2 import IPRoute, netns

    left = []
    mark = str(outdir).encode()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/cmdline", "rb") as f:
                if mark in f.read() and (proc_start(int(entry)) or ("Z",))[0] != "Z":
                    left.append(f"process {entry}")
    left += [f"namespace {n}" for n in netns.listnetns()
             if re.fullmatch(rf"{pods.PREFIX}\d+", n)]
    with IPRoute() as ipr:
        if ipr.link_lookup(ifname=pods.BRIDGE):
            left.append(f"bridge {pods.BRIDGE}")
    return left


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=4, help="K pods (default 4)")
    parser.add_argument("--runs", type=int, default=2, help="runs per way (default 2)")
    parser.add_argument("--cpu", action="store_true", help="gloo on CPUs instead of GPUs")
    parser.add_argument("--steps", type=int, default=50, help="the loop's steps (default 50)")
    parser.add_argument("--lose-at", type=int, default=20,
                        help="the pod is lost once this step's checkpoint is saved (default 20)")
    parser.add_argument("--run-timeout", type=float, default=600.0,
                        help="bound on the loss → every pod's loop finished, seconds "
                             "(default 600)")
    parser.add_argument("--host", default="", help="the host's name for the table's title")
    parser.add_argument("--out", type=Path, default=benchkit.RESULTS,
                        help="results directory (default bench/results/, git-ignored)")
    args = parser.parse_args(argv)
    benchkit.require_root(parser)
    if args.pods < 2:
        parser.error("K must be at least 2 (one head, one worker to lose)")
    if not 1 <= args.lose_at <= args.steps - 5:
        parser.error("--lose-at must be at least 1 and leave 5 steps after it")
    uuids: dict[int, str] = {}
    if not args.cpu:
        if args.pods > pods.gpu_count():
            parser.error(f"one GPU per pod: K={args.pods} needs {args.pods} GPUs, this host "
                         f"has {pods.gpu_count()}; --cpu runs any K")
        uuids = gpu_uuids()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, interrupted)

    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    outdir = args.out.resolve() / f"gpu-replace-{stamp}"
    (outdir / "logs").mkdir(parents=True, exist_ok=True)
    gpu = smi("--query-gpu=name")
    meta = {"started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"{os.cpu_count()} CPU(s), {platform.machine()}, "
                       f"Python {platform.python_version()}",
            "gpu": gpu[0][0] if gpu else "GPU", "torch": importlib.metadata.version("torch"),
            "podagent": PODAGENT_VERSION, "commit": benchkit.git_commit()}
    print(f"bench: {meta['machine']}; results in {outdir}", flush=True)

    def plan() -> Iterator[tuple[Run, str, benchkit.Body[Run]]]:
        for i, way in benchkit.rounds(args.runs, WAYS):
            yield Run(way, i), f"{way}-r{i}", lambda r, d: one(r, d, args, uuids)

    runs: list[Run] = []
    try:
        runs = benchkit.execute_all(plan(), outdir, lambda r: line(r, args.runs))
    finally:
        _calm["depth"] += 1  # from here on nothing is cut short: the clean-up, the report
        pods.remove_network()
        left = leftovers(outdir)
    benchkit.write_results(outdir, render(runs, args, meta), meta, args, runs)
    if left:
        print(f"bench: left behind: {', '.join(left)}", flush=True)
    complete = len(runs) == args.runs * len(WAYS)
    return 0 if complete and all(r.ok for r in runs) and not left else 1


if __name__ == "__main__":
    sys.exit(main())
