"""`podagent up`, `down` and `ls` as the user runs them on "the laptop" (this process's network
namespace), against a FakeRunPodCloud: their command lines, their environment, and the looks at
the fake that tests judge them by (what bills, what is left running)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from tests.fakes.runpod_cloud import FakeRunPodCloud, RequestRecord
from tests.harness.agents import clean_environ
from tests.harness.pods import wait_for

KEY = "rpa_" + "LaptopKey" * 4
H100 = "NVIDIA H100 80GB HBM3"
IMAGE = "ghcr.io/podagent/podagent:test"  # podagent itself on every pod
# A stand-in for podagent that speaks the head's records without a cluster (tests/fakes/
# pod_head.py): seconds per pod instead of a Ray bring-up.
HEAD_IMAGE = "ghcr.io/podagent/stand-in:test"
IMAGES = {IMAGE: [sys.executable, "-m", "podagent"],
          HEAD_IMAGE: [sys.executable, str(Path(__file__).resolve().parents[1] / "fakes" /
                                           "pod_head.py")]}
RUN_BOUND = 300.0  # a whole run of 3 pods on a loaded 2-core machine
# Quick pods: no reward server, short waits where a fault makes podagent wait.
POD_ENV = ("PODAGENT_REWARD=none", "PODAGENT_STOP_TIMEOUT=5")


def laptop_env(cloud: FakeRunPodCloud, tmp_path: Path) -> dict[str, str]:
    return {**clean_environ(), "RUNPOD_API_KEY": KEY, "RUNPOD_API_URL": cloud.url,
            "XDG_STATE_HOME": str(tmp_path / "state"), "PYTHONUNBUFFERED": "1",
            "TERM": "dumb",
            # A command that does not end in time is sent SIGABRT: every thread's stack.
            "PYTHONFAULTHANDLER": "1"}


def stacks_of(proc: subprocess.Popen) -> str:
    """What a command that did not end in time was doing: its threads' stacks (SIGABRT, with
    PYTHONFAULTHANDLER set) and all its output."""
    proc.send_signal(signal.SIGABRT)
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return out or ""


def up_argv(name: str, pods: int = 3, *extra: str, job: tuple[str, ...] = (),
            image: str = IMAGE, gpu: str = H100, shared: bool = False) -> list[str]:
    """`up`'s command line; without a network volume of its own unless `shared` (the tests
    of the volume ask for it; the others test what is not about it)."""
    argv = [sys.executable, "-m", "podagent", "up", "--name", name, "--image", image,
            "--gpu", gpu, "--gpus", "1", "--pods", str(pods), "--timeout", "120"]
    if not shared and not {"--network-volume", "--shared-volume", "--volume"} & set(extra):
        argv.append("--no-shared-volume")
    for pair in POD_ENV:
        argv += ["-e", pair]
    return [*argv, *extra, *(["--", *job] if job else [])]


def run_up(cloud: FakeRunPodCloud, tmp_path: Path, argv: list[str],
           timeout: float = RUN_BOUND) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=laptop_env(cloud, tmp_path), capture_output=True,
                          text=True, timeout=timeout, cwd=tmp_path, stdin=subprocess.DEVNULL)


def start_up(cloud: FakeRunPodCloud, tmp_path: Path, argv: list[str]) -> subprocess.Popen:
    """`podagent up` in the background, its output (both streams) on a pipe."""
    return subprocess.Popen(argv, env=laptop_env(cloud, tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)


class Output:
    """A running command's output (both streams, on one pipe) as it comes, to act on what it
    says."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.lines = proc, []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait(self, text: str, timeout: float = 60) -> None:
        """Until a line holds `text`; else an error with what it said by then."""
        try:
            wait_for(lambda: any(text in line for line in self.lines), timeout=timeout,
                     what=repr(text))
        except TimeoutError:
            raise AssertionError(f"{text!r} never came (exit {self.proc.poll()}); it said: "
                                 f"{self.lines[-20:]}") from None

    def end(self, timeout: float = 120) -> int:
        code = self.proc.wait(timeout=timeout)
        self._thread.join(timeout=10)
        return code

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


def run_cli(cloud: FakeRunPodCloud, tmp_path: Path, *args: str,
            timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "podagent", *args],
                          env=laptop_env(cloud, tmp_path), capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def run_down(cloud: FakeRunPodCloud, tmp_path: Path, name: str
             ) -> subprocess.CompletedProcess[str]:
    return run_cli(cloud, tmp_path, "down", name)


def of_run(cloud: FakeRunPodCloud, run: str) -> list:
    return [p for p in cloud.pods.values() if p.name.startswith(f"podagent-{run}-")]


def billing(cloud: FakeRunPodCloud, run: str) -> int:
    return len([p for p in cloud.billing() if p.name.startswith(f"podagent-{run}-")])


def listed(cloud: FakeRunPodCloud, run: str) -> list:
    """The run's pods RunPod still lists (anything but TERMINATED)."""
    return [p for p in of_run(cloud, run) if p.status != "TERMINATED"]


def nothing_left(cloud: FakeRunPodCloud) -> None:
    """Nothing bills at RunPod and nothing of a pod still runs."""
    assert cloud.billing() == []
    cloud.wait_torn_down(timeout=60)
    assert cloud.leftover_processes() == []


def creates(cloud: FakeRunPodCloud) -> list[RequestRecord]:
    return [r for r in cloud.requests if r.method == "POST" and r.path in ("/v2/pods",
                                                                          "/v2/clusters")]


def after_call(cloud: FakeRunPodCloud, k: int, act: Callable[[RequestRecord], None],
               counted: Callable[[RequestRecord], bool] = lambda r: True) -> None:
    """`act(record)` right after the fake answered the k-th request `counted` selects (log
    streams are never counted: they answer when they end)."""
    seen = {"n": 0}

    def count(record: RequestRecord) -> None:
        if record.path.endswith("/logs") or not counted(record):
            return
        seen["n"] += 1
        if seen["n"] == k:
            act(record)

    cloud.after_response(count)


def signal_to(proc: subprocess.Popen, signum: int) -> Callable[[RequestRecord], None]:
    def send(_record: RequestRecord) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signum)
    return send


def gone_within(cloud: FakeRunPodCloud, run: str, since: float, bound: float = 60.0) -> float:
    """Seconds from `since` (time.time()) until RunPod listed no pod of the run, as the fake
    recorded it; AssertionError if some are listed `bound` seconds on."""
    deadline = time.monotonic() + bound
    while listed(cloud, run) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not listed(cloud, run), [(p.name, p.status) for p in listed(cloud, run)]
    deletes = [r.time for r in cloud.requests if r.method == "DELETE" and r.status < 300]
    return max([0.0, *(t - since for t in deletes if t >= since)])


SIGINT, SIGTERM, SIGKILL = signal.SIGINT, signal.SIGTERM, signal.SIGKILL
