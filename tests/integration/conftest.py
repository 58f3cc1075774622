"""podagent as a real subprocess, with its own Ray, isolated by a unique short temp dir.

Every Ray process podagent starts inherits PODAGENT_RAY_TEMP_DIR in its environment, and Ray's
daemons also carry the temp dir (or session paths under it) on their command lines, so "the
processes of one run" are the processes whose cmdline or environment mention its temp dir.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import psutil
import pytest
from tenacity import RetryError, Retrying, retry_if_result, stop_after_delay, wait_fixed

from podagent.config.fields import path_component

T = TypeVar("T")

# One podagent run: `ray start` (5-20 s here), the job, teardown. Generous for a loaded machine.
RUN_TIMEOUT = 180.0
# After podagent exits, its teardown has already stopped Ray: leftovers get only a moment.
LEFTOVER_GRACE = 5.0

# Variables that steer podagent (role, discovery, presets, W&B): none may leak in from the
# environment pytest runs in.
_STRIP_PREFIXES = ("RAY_", "PODAGENT_", "RUNPOD_", "WANDB_", "NCCL_", "GLOO_")
_STRIP_NAMES = frozenset({"HEAD_POD_ID", "NODE_RANK", "PRIMARY_ADDR", "NUM_NODES", "NODE_ADDR",
                          "EXPECTED_WORKERS", "DEBUG_RAY"})


def clean_environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if not k.startswith(_STRIP_PREFIXES) and k not in _STRIP_NAMES}


def free_ports(count: int) -> list[int]:
    """Distinct ports nobody listens on now (all held at once, so they cannot repeat)."""
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("", 0))
            socks.append(sock)
        return [s.getsockname()[1] for s in socks]
    finally:
        for sock in socks:
            sock.close()


def short_temp_dir() -> str:
    """A fresh directory for Ray whose path stays short (Ray puts unix sockets under it)."""
    base = tempfile.gettempdir()
    if len(base) > 20:
        base = "/tmp"
    path = tempfile.mkdtemp(prefix="pai-", dir=base)
    assert len(path.encode()) <= 60, path
    return path


def wait_for(probe: Callable[[], T], ok: Callable[[T], bool], timeout: float, what: str,
             interval: float = 0.2) -> T:
    """Poll probe() until ok(value) (bounded); the failure names what was awaited and seen."""
    seen: dict[str, Any] = {}

    def attempt() -> T:
        seen["value"] = probe()
        return seen["value"]

    try:
        return Retrying(stop=stop_after_delay(timeout), wait=wait_fixed(interval),
                        retry=retry_if_result(lambda value: not ok(value)))(attempt)
    except RetryError:
        last = seen.get("value", "<nothing: the probe never returned>")
        raise AssertionError(f"waited {timeout:g} s for {what}; last seen: {last!r}") from None


def _mentions(temp_dir: str) -> Callable[[str], bool]:
    # The temp dir itself or a path under it, not a longer sibling (/tmp/pai-ab vs /tmp/pai-abc).
    pattern = re.compile(re.escape(temp_dir.rstrip("/")) + r"(?![\w.-])")
    return lambda text: bool(pattern.search(text))


def ray_processes_under(temp_dir: str, exclude: Sequence[int] = ()) -> list[psutil.Process]:
    """Every live process whose command line, environment or open files mention temp_dir."""
    mentions = _mentions(temp_dir)
    skip = {os.getpid(), *exclude}
    found = []
    for proc in psutil.process_iter():
        if proc.pid in skip:
            continue
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            cmdline = "\0".join(proc.cmdline())
            if mentions(cmdline):
                found.append(proc)
                continue
            if any(mentions(value) for value in proc.environ().values()):
                found.append(proc)
                continue
            # Ray's agents rename themselves over their command line and environment; the
            # logs they hold open under the temp dir still tell.
            if any(mentions(f.path) for f in proc.open_files()):
                found.append(proc)
        except psutil.Error:  # gone meanwhile, or not ours to read
            continue
    return found


def describe(procs: Sequence[psutil.Process]) -> list[str]:
    out = []
    for proc in procs:
        try:
            out.append(f"pid {proc.pid} {proc.name()}: {' '.join(proc.cmdline())[:160]}")
        except psutil.Error:
            out.append(f"pid {proc.pid} (gone)")
    return out


def kill_processes_under(temp_dir: str) -> list[str]:
    """SIGKILL whatever still runs under temp_dir; returns what was killed."""
    procs = ray_processes_under(temp_dir)
    killed = describe(procs)
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(procs, timeout=5)
    return killed


def _lower(soft_limits: Mapping[int, int]) -> None:
    for which, soft in soft_limits.items():
        hard = resource.getrlimit(which)[1]
        resource.setrlimit(which, (min(soft, hard), hard))


class PodagentRun:
    """One podagent invocation: its settings, its output files and what it left behind."""

    def __init__(self, name: str, scratch: Path):
        self.scratch = scratch
        self.temp_dir = short_temp_dir()
        self.log_dir = scratch / "logs"
        self.run_name = f"it-{name}-{secrets.token_hex(3)}"
        self.ray_port, self.dashboard_port, self.reward_port = free_ports(3)
        self.env = clean_environ()
        self.env.update(
            PODAGENT_RAY_TEMP_DIR=self.temp_dir,
            PODAGENT_LOG_DIR=str(self.log_dir),
            PODAGENT_RUN_NAME=self.run_name,
            PODAGENT_RAY_PORT=str(self.ray_port),
            PODAGENT_DASHBOARD_PORT=str(self.dashboard_port),
            PODAGENT_REWARD_PORT=str(self.reward_port),
        )
        self.proc: subprocess.Popen | None = None
        self.returncode: int | None = None
        self.leftovers: list[str] | None = None  # recorded once podagent has exited
        self.elapsed: float | None = None
        self._started = 0.0

    # --- running ----------------------------------------------------------------------------

    def start(self, args: Sequence[str], env: Mapping[str, str] | None = None,
              stdout: int | None = None,
              soft_limits: Mapping[int, int] | None = None) -> None:
        """`stdout`: a file descriptor instead of stdout.txt (a pipe the test holds);
        `soft_limits`: resource -> soft limit podagent starts with (as a container runtime's
        defaults may set them below the hard limits)."""
        assert self.proc is None, "one process per PodagentRun"
        self.env.update(env or {})
        self.scratch.mkdir(parents=True, exist_ok=True)
        with open(self.scratch / "stdout.txt", "wb") as out, \
                open(self.scratch / "stderr.txt", "wb") as err:
            self._started = time.monotonic()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "podagent", *args], env=self.env, cwd=self.scratch,
                stdin=subprocess.DEVNULL, stdout=out if stdout is None else stdout, stderr=err,
                start_new_session=True,
                preexec_fn=(lambda: _lower(soft_limits)) if soft_limits else None,
            )

    def wait(self, timeout: float = RUN_TIMEOUT) -> int:
        assert self.proc is not None
        try:
            self.returncode = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"podagent still running after {timeout:g} s;\nstdout tail:\n"
                f"{self.stdout[-3000:]}\nstderr tail:\n{self.stderr[-3000:]}") from None
        self.elapsed = time.monotonic() - self._started
        return self.returncode

    def finish(self) -> None:
        """Record what podagent left behind, then kill it all: the next run starts clean."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        if self.leftovers is None:
            self.leftovers = self.settle()
        kill_processes_under(self.temp_dir)

    def settle(self, timeout: float = LEFTOVER_GRACE) -> list[str]:
        """Wait (bounded) until nothing runs under the temp dir; returns what still does."""
        try:
            return wait_for(lambda: describe(ray_processes_under(self.temp_dir)),
                            lambda procs: not procs, timeout,
                            f"no process under {self.temp_dir}")
        except AssertionError:
            return describe(ray_processes_under(self.temp_dir))

    @contextlib.contextmanager
    def running(self, args: Sequence[str], env: Mapping[str, str] | None = None,
                stdout: int | None = None, soft_limits: Mapping[int, int] | None = None
                ) -> Iterator[PodagentRun]:
        """Start podagent; whatever happens inside, finish() runs at the end. A failure inside
        carries podagent's state and the end of its stderr (a wait that ran out says what it
        waited for; what podagent said tells why)."""
        try:
            self.start(args, env, stdout, soft_limits)
            yield self
        except BaseException as exc:
            code = self.proc.poll() if self.proc else None
            with contextlib.suppress(OSError):
                exc.add_note(f"podagent {'still running' if code is None else f'exited {code}'}"
                             f"; its stderr ends:\n{self.stderr[-3000:]}")
            raise
        finally:
            self.finish()

    def execute(self, args: Sequence[str], env: Mapping[str, str] | None = None,
                timeout: float = RUN_TIMEOUT) -> PodagentRun:
        with self.running(args, env):
            self.wait(timeout)
        return self

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        kill_processes_under(self.temp_dir)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    # --- results ----------------------------------------------------------------------------

    @property
    def stdout(self) -> str:
        return (self.scratch / "stdout.txt").read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return (self.scratch / "stderr.txt").read_text(errors="replace")

    @property
    def run_dir(self) -> Path:
        """This pod's own directory of the run (podagent's rule: without RUNPOD_POD_ID, the
        pod is named by its host name)."""
        return self.log_dir / self.run_name / path_component(
            self.env.get("RUNPOD_POD_ID") or socket.gethostname())

    def read(self, name: str) -> str:
        path = self.run_dir / name
        return path.read_text(errors="replace") if path.exists() else ""

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.read("events.jsonl").splitlines() if line]

    def events_named(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.events() if e["event"] == name]

    def processes(self) -> list[psutil.Process]:
        """This run's processes now, podagent itself left out."""
        return ray_processes_under(self.temp_dir, exclude=[self.proc.pid] if self.proc else [])

    def job_env(self) -> dict[str, str]:
        """`ENV NAME=value` lines the job printed (see JOB_ENV_SCRIPT)."""
        found = {}
        for line in self.read("job.log").splitlines():
            if line.startswith("ENV ") and "=" in line:
                name, _, value = line[4:].partition("=")
                found[name] = value
        return found


# A job that prints the variables it sees (and only a digest of the W&B key).
JOB_ENV_SCRIPT = """
import hashlib, os, sys
for name in sys.argv[1:]:
    print(f"ENV {name}={os.environ.get(name, '<unset>')}", flush=True)
key = os.environ.get("WANDB_API_KEY")
print(f"ENV WANDB_API_KEY_SHA256={hashlib.sha256(key.encode()).hexdigest() if key else '<unset>'}")
config = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR", "")
print(f"ENV KEY_IN_JOB_CONFIG={bool(key) and key in config}", flush=True)
"""


class Runs:
    """Makes PodagentRuns; cleans up every one of them at the end (kill leftovers, rm temp)."""

    def __init__(self, factory: pytest.TempPathFactory):
        self.factory = factory
        self.made: list[PodagentRun] = []

    def new(self, name: str) -> PodagentRun:
        run = PodagentRun(name, self.factory.mktemp(name))
        self.made.append(run)
        return run

    def close(self) -> None:
        for run in self.made:
            run.cleanup()


@pytest.fixture(scope="module")
def podagent_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    if not sys.platform.startswith("linux"):
        pytest.skip("podagent's process handling needs Linux (/proc, subreaper)")
    runs = Runs(tmp_path_factory)
    try:
        yield runs
    finally:
        runs.close()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.integration)
