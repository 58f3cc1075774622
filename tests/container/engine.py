"""The Docker engine for the container suite and bench/image.py: installed when missing,
started when not running, and stopped by the last user of it when a podagent run started it.

Plain module (no pytest import) so benchmarks can use it. Needs root.

dockerd is started so that it leaves the host's network alone, because the namespaced-pod
suite (tests/e2e) runs on the same machine: its default iptables rules set the FORWARD policy
to DROP (the namespaced pods then cannot reach each other), and it would switch IP forwarding
on. Containers on one bridge need neither. It registers podnet_runtime.py as a runtime, so the
suite's containers get an interface named podnet1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import ModuleType

import psutil
import tenacity

from tests.harness.pods import file_lock

REPO = Path(__file__).resolve().parents[2]


def _load_images() -> ModuleType:
    # By path: a package named `docker` would shadow Docker's Python SDK.
    spec = importlib.util.spec_from_file_location("podagent_images", REPO / "docker" / "images.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


images = _load_images()

RUNTIME = "podnet"
RUNTIME_SCRIPT = Path(__file__).resolve().with_name("podnet_runtime.py")
# Where pods.py keeps its locks: cleared on reboot, like a started engine.
STATE_DIR = Path("/run" if os.path.isdir("/run") else "/var/run") / "podagent-docker"
PIDFILE = STATE_DIR / "dockerd.pid"  # present while a dockerd this module started runs
LOG = STATE_DIR / "dockerd.log"
START_TIMEOUT = 120.0
STOP_TIMEOUT = 60.0
# Debian's packages: the engine (with containerd, runc, iptables) and debootstrap for the bases.
PACKAGES = {"dockerd": "docker.io", "debootstrap": "debootstrap", "nsenter": "util-linux",
            "ip": "iproute2"}


class EngineUnavailable(RuntimeError):
    """Docker cannot run here at all (the only reason the container suite skips)."""


class EngineError(RuntimeError):
    """The engine could have run but did not (a failure, never a skip)."""


def _run(argv: list[str], timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def unavailable_reason() -> str | None:
    """Why Docker truly cannot run on this machine, or None."""
    if os.geteuid() != 0:
        return "needs root (dockerd, debootstrap)"
    if not Path("/sys/fs/cgroup").is_dir():
        return "no cgroup filesystem at /sys/fs/cgroup"
    missing = [tool for tool in PACKAGES if shutil.which(tool) is None]
    if missing and shutil.which("apt-get") is None:
        return f"{', '.join(missing)} missing and no apt-get to install them"
    return None


def install_missing(packages: Mapping[str, str] = PACKAGES) -> list[str]:
    """apt-get install what is missing (tool -> Debian's package); returns those installed."""
    wanted = sorted({pkg for tool, pkg in packages.items() if shutil.which(tool) is None})
    if not wanted:
        return []
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # Another apt (someone else's install) may hold the lock for a while: wait for it, bounded.
    lock = ["-o", "DPkg::Lock::Timeout=300"]
    for argv in (["apt-get", *lock, "update", "-q"],
                 ["apt-get", *lock, "install", "-y", "-q", "--no-install-recommends", *wanted]):
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=env,
                              stdin=subprocess.DEVNULL)
        if proc.returncode != 0:
            raise EngineError(f"{' '.join(argv)} exited {proc.returncode}:\n"
                              f"{(proc.stdout + proc.stderr)[-3000:]}")
    return wanted


def forward_state() -> tuple[str, str]:
    """The host's FORWARD policy (iptables) and IP forwarding switch, to check they stay."""
    policy = "no iptables"
    if shutil.which("iptables"):
        rules = _run(["iptables", "-S", "FORWARD"]).stdout.splitlines()
        policy = rules[0] if rules else "?"
    return policy, Path("/proc/sys/net/ipv4/ip_forward").read_text().strip()


def _answers(docker: images.Docker) -> str | None:
    proc = docker("version", "--format", "{{.Server.Version}}", check=False, timeout=30)
    return proc.stdout.strip() if proc.returncode == 0 and proc.stdout.strip() else None


def _our_dockerd() -> psutil.Process | None:
    try:
        proc = psutil.Process(int(PIDFILE.read_text().strip()))
    except (FileNotFoundError, ValueError, psutil.NoSuchProcess):
        return None
    return proc if proc.name() == "dockerd" else None


def _log_tail() -> str:
    with contextlib.suppress(OSError):
        return "\n".join(LOG.read_text(errors="replace").splitlines()[-25:])
    return "<no log>"


def _start_dockerd(docker: images.Docker) -> None:
    before = forward_state()
    argv = ["dockerd", "--iptables=false", "--ip-forward=false", "--bridge=none",
            f"--add-runtime={RUNTIME}={RUNTIME_SCRIPT}", "--pidfile", str(PIDFILE)]
    with LOG.open("ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)

    def ready() -> str:
        if proc.poll() is not None:
            raise EngineError(f"dockerd exited {proc.returncode} while starting:\n{_log_tail()}")
        version = _answers(docker)
        if version is None:
            raise ConnectionError("the engine does not answer yet")
        return version

    try:
        tenacity.Retrying(stop=tenacity.stop_after_delay(START_TIMEOUT),
                          wait=tenacity.wait_fixed(0.5),
                          retry=tenacity.retry_if_exception_type(ConnectionError),
                          reraise=True)(ready)
    except ConnectionError:
        proc.kill()
        raise EngineError(f"dockerd did not answer within {START_TIMEOUT:g} s:\n{_log_tail()}"
                          ) from None
    after = forward_state()
    if after != before:
        raise EngineError(f"dockerd changed the host's forwarding: {before} -> {after}")


def _stop_dockerd(proc: psutil.Process) -> None:
    family = [proc, *proc.children(recursive=True)]  # its containerd and shims
    proc.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(family, timeout=STOP_TIMEOUT)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(alive, timeout=10)
    if alive:
        raise EngineError(f"dockerd and its children did not stop within {STOP_TIMEOUT:g} s "
                          f"(killed {[p.pid for p in alive]}):\n{_log_tail()}")


@dataclasses.dataclass
class Engine:
    docker: images.Docker
    version: str
    started: bool  # this process started dockerd
    installed: list[str]


@contextlib.contextmanager
def engine() -> Iterator[Engine]:
    """A Docker engine with the podnet runtime, for the duration of the block.

    Users hold a shared lock on users.lock; starting and stopping happen under alloc.lock. The
    last user leaving stops the engine if one of these blocks started it (PIDFILE), so
    concurrent suites and benchmarks share one engine and nobody stops it under another.
    """
    reason = unavailable_reason()
    if reason:
        raise EngineUnavailable(reason)
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    installed = install_missing()
    docker = images.find_docker()
    users = os.open(STATE_DIR / "users.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        with file_lock(STATE_DIR / "alloc.lock"):
            started = False
            version = _answers(docker)
            if version is None:
                _start_dockerd(docker)
                started, version = True, _answers(docker) or "?"
            runtimes = docker("info", "--format", "{{json .Runtimes}}").stdout
            if f'"{RUNTIME}"' not in runtimes:
                raise EngineError(
                    f"a Docker engine already runs without the {RUNTIME!r} runtime the suite "
                    f"needs (it names interfaces podnet1); stop it and the suite starts its own, "
                    f"or start dockerd with --add-runtime={RUNTIME}={RUNTIME_SCRIPT}")
            fcntl.flock(users, fcntl.LOCK_SH)
        yield Engine(docker, version, started, installed)
    finally:
        with file_lock(STATE_DIR / "alloc.lock"):
            os.close(users)  # drops this user's shared lock
            last = os.open(STATE_DIR / "users.lock", os.O_RDWR | os.O_CLOEXEC)
            try:
                fcntl.flock(last, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pass  # someone else still uses the engine: the last one stops it
            else:
                dockerd = _our_dockerd()
                if dockerd is not None:
                    _stop_dockerd(dockerd)
            finally:
                os.close(last)
