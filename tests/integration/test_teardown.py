"""SIGTERM while a job runs: the job is stopped, Ray is stopped, nothing is left, exit 143.

The same run has DEBUG_RAY=1 and the runpod-global NCCL preset, so while the job runs the tests
also read what Ray's daemons and the job really got (environment and argv).

A second run kills the head's own GCS while the job runs: podagent should notice and leave, and
whichever way it leaves, nothing may stay behind.
"""

from __future__ import annotations

import contextlib
import errno
import json
import resource
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from tests.fakes import reward_cmd
from tests.integration.conftest import JOB_ENV_SCRIPT, PodagentRun, Runs, wait_for

# Prints the variables it sees, then says it started and stays until stopped.
LONG_JOB = JOB_ENV_SCRIPT + """
import time
print("started", flush=True)
time.sleep(600)
"""

JOB_VARIABLES = ("RAY_DEBUG", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_LAUNCH_MODE")
# A container runtime's defaults: soft limits far below the hard ones.
LOW_SOFT_LIMITS = {resource.RLIMIT_NOFILE: 1024, resource.RLIMIT_NPROC: 4096}
EXIT_WITHIN = 30.0  # seconds from SIGTERM to podagent's exit


@dataclass
class Seen:
    """What the Ray processes of the run looked like while the job ran."""
    environ: dict[str, dict[str, str]] = field(default_factory=dict)  # by process name
    cmdline: dict[str, list[str]] = field(default_factory=dict)
    names: list[str] = field(default_factory=list)
    exit_after: float | None = None  # seconds from SIGTERM to exit
    limits: dict[str, dict[int, tuple[int, int]]] = field(default_factory=dict)


def _daemons(run: PodagentRun) -> dict[str, psutil.Process]:
    found = {}
    for proc in run.processes():
        try:
            if proc.name() in ("gcs_server", "raylet"):
                found[proc.name()] = proc
        except psutil.Error:
            continue
    return found


def _name(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.Error:
        return "(gone)"


def _long_job(run: PodagentRun, *args: str) -> list[str]:
    script = run.scratch / "long_job.py"
    script.write_text(LONG_JOB)
    return [sys.executable, str(script), *args]


def _await_started(run: PodagentRun) -> None:
    wait_for(lambda: run.read("job.log").splitlines(), lambda got: "started" in got,
             timeout=180, what="the job's 'started' line in job.log")


@pytest.fixture(scope="module")
def stopped(podagent_runs: Runs) -> tuple[PodagentRun, Seen]:
    run = podagent_runs.new("sigterm")
    seen = Seen()
    with run.running(["head", "--", *_long_job(run, *JOB_VARIABLES)],
                     env={"DEBUG_RAY": "1", "PODAGENT_NCCL_PRESET": "runpod-global"},
                     soft_limits=LOW_SOFT_LIMITS):
        _await_started(run)
        daemons = wait_for(lambda: _daemons(run), lambda d: len(d) == 2, timeout=10,
                           what="gcs_server and raylet under the run's temp dir")
        for name, proc in daemons.items():
            seen.environ[name] = proc.environ()
            seen.cmdline[name] = proc.cmdline()
            seen.limits[name] = {which: proc.rlimit(which) for which in LOW_SOFT_LIMITS}
        seen.names = sorted({_name(p) for p in run.processes()})
        assert run.proc is not None
        run.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        run.wait(timeout=EXIT_WITHIN + 30)
        seen.exit_after = time.monotonic() - sent
    return run, seen


def test_sigterm_stops_the_job_and_exits_143(stopped: tuple[PodagentRun, Seen]) -> None:
    run, seen = stopped
    assert run.returncode == 143, f"exit {run.returncode}\n{run.stdout}\n{run.stderr}"
    assert seen.exit_after is not None and seen.exit_after < EXIT_WITHIN, seen.exit_after
    assert f"[head] job {run.run_name}-1 stopped (status STOPPED)" in run.stdout, run.stdout
    assert "Ray stopped (" in run.stdout
    assert run.stderr.strip() == "", run.stderr  # a signal is no error
    (job_stopped,) = run.events_named("job_stopped")
    assert job_stopped["status"] == "STOPPED", job_stopped
    (teardown,) = run.events_named("teardown")
    assert teardown["outcome"] == "Interrupted" and teardown["killed"] == 0, teardown
    assert run.events()[-1]["event"] == "exit" and run.events()[-1]["code"] == 143


def test_sigterm_leaves_no_process_behind(stopped: tuple[PodagentRun, Seen]) -> None:
    run, seen = stopped
    assert "raylet" in seen.names and "gcs_server" in seen.names, seen.names
    assert run.leftovers == []


def test_rays_daemons_start_with_the_soft_limits_raised_to_the_hard_ones(
        stopped: tuple[PodagentRun, Seen]) -> None:
    run, seen = stopped
    for name in ("gcs_server", "raylet"):
        for which, (soft, hard) in seen.limits[name].items():
            assert soft == hard, (name, which, soft, hard)
    assert "raised this pod's limits to the hard ones for Ray: open files 1,024 -> " \
        in run.stdout, run.stdout


def test_debug_ray_reaches_rays_daemons_and_the_job(stopped: tuple[PodagentRun, Seen]) -> None:
    run, seen = stopped
    for name in ("gcs_server", "raylet"):
        assert seen.environ[name].get("RAY_DEBUG") == "legacy", (name, seen.environ[name])
    # `ray start --ray-debugger-external` ends up as a raylet flag (it hands it to the workers
    # it starts): the strongest trace of the flag a running cluster shows.
    assert "--ray-debugger-external=1" in seen.cmdline["raylet"], seen.cmdline["raylet"]
    assert run.job_env().get("RAY_DEBUG") == "legacy", run.job_env()


def test_preset_interfaces_reach_the_job(stopped: tuple[PodagentRun, Seen]) -> None:
    run, seen = stopped
    env = run.job_env()
    assert env.get("NCCL_SOCKET_IFNAME") == "podnet1", env
    assert env.get("GLOO_SOCKET_IFNAME") == "podnet1", env
    assert env.get("NCCL_LAUNCH_MODE") == "GROUP", env
    # Ray's own daemons run with the preset too (the job's NCCL peers are Ray workers).
    assert seen.environ["raylet"].get("NCCL_SOCKET_IFNAME") == "podnet1"
    if "podnet1" not in psutil.net_if_addrs():
        assert "WARNING: NCCL_SOCKET_IFNAME=podnet1 names no interface" in run.stdout


# --- the head's own Ray dies while the job runs -------------------------------------------------

NOTICE_WITHIN = 20.0  # detection takes ~5 s (a busy GCS is not dead), teardown ~2 s
# A healthy head exits a few seconds after SIGTERM; here PODAGENT_STOP_TIMEOUT=3 bounds the rest.
DEAD_RAY_EXIT_WITHIN = 15.0


@dataclass
class AfterDeath:
    own_exit: int | None = None  # podagent's exit code if it left without being signalled
    waited: str = ""  # what the bounded wait saw when podagent did not leave by itself
    sigterm_exit_after: float | None = None  # seconds from SIGTERM to exit, if within bounds
    forced: bool = False  # a second SIGTERM was needed


@pytest.fixture(scope="module")
def gcs_killed(podagent_runs: Runs) -> tuple[PodagentRun, AfterDeath]:
    run = podagent_runs.new("gcsdead")
    after = AfterDeath()
    with run.running(["head", "--", *_long_job(run)], env={"PODAGENT_STOP_TIMEOUT": "3"}):
        _await_started(run)
        gcs = wait_for(lambda: _daemons(run).get("gcs_server"), lambda p: p is not None,
                       timeout=10, what="the gcs_server under the run's temp dir")
        gcs.kill()  # as the OOM killer would
        proc = run.proc
        assert proc is not None
        try:
            after.own_exit = wait_for(proc.poll, lambda code: code is not None,
                                      timeout=NOTICE_WITHIN,
                                      what="podagent to leave after its GCS was killed")
        except AssertionError as exc:
            after.waited = str(exc)
            proc.send_signal(signal.SIGTERM)  # the way out a user has
            sent = time.monotonic()
            try:
                wait_for(proc.poll, lambda code: code is not None, timeout=DEAD_RAY_EXIT_WITHIN,
                         what="podagent to exit after SIGTERM")
                after.sigterm_exit_after = time.monotonic() - sent
            except AssertionError:
                after.forced = True
                proc.send_signal(signal.SIGTERM)  # the second one: kill everything now
        run.wait(timeout=30)
    return run, after


def test_head_leaves_when_its_own_ray_dies(gcs_killed: tuple[PodagentRun, AfterDeath]) -> None:
    run, after = gcs_killed
    assert after.own_exit == 10, (
        f"{after.waited or f'podagent exited {after.own_exit}'}\n{run.stdout[-2000:]}")


@pytest.fixture(scope="module")
def gcs_killed_then_sigterm(podagent_runs: Runs) -> tuple[PodagentRun, float]:
    """The GCS dies and the user sends SIGTERM at once, before podagent noticed by itself:
    every Jobs API call of the teardown meets a dashboard that cannot reach its GCS."""
    run = podagent_runs.new("gcsterm")
    with run.running(["head", "--", *_long_job(run)], env={"PODAGENT_STOP_TIMEOUT": "3"}):
        _await_started(run)
        gcs = wait_for(lambda: _daemons(run).get("gcs_server"), lambda p: p is not None,
                       timeout=10, what="the gcs_server under the run's temp dir")
        gcs.kill()
        proc = run.proc
        assert proc is not None
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        wait_for(proc.poll, lambda code: code is not None, timeout=DEAD_RAY_EXIT_WITHIN,
                 what="podagent to exit after SIGTERM with its GCS dead")
        took = time.monotonic() - sent
        run.wait(timeout=30)
    return run, took


def test_sigterm_is_acted_on_promptly_after_ray_died(
        gcs_killed_then_sigterm: tuple[PodagentRun, float]) -> None:
    run, took = gcs_killed_then_sigterm
    assert run.returncode == 143, f"{run.stdout[-2000:]}\n{run.stderr}"
    assert took < DEAD_RAY_EXIT_WITHIN
    assert run.leftovers == []


def test_teardown_after_ray_died_leaves_nothing(
        gcs_killed: tuple[PodagentRun, AfterDeath]) -> None:
    """Whichever way podagent left (by itself, SIGTERM, or the forcing second SIGTERM)."""
    run, after = gcs_killed
    expected = after.own_exit if after.own_exit is not None else 143
    assert run.returncode == expected, f"{run.stdout[-2000:]}\n{run.stderr}"
    if after.forced:
        assert "[head] ERROR: second SIGTERM: killed all children" in run.stderr
    else:
        assert "Ray stopped (" in run.stdout, run.stdout
        assert run.events()[-1]["event"] == "exit"
    assert run.leftovers == []


# --- a teardown that meets trouble ---------------------------------------------------------------

FULL_VOLUME_EXIT_WITHIN = 30.0


@contextlib.contextmanager
def _small_volume(path: Path, size: str = "4m") -> Iterator[Path]:
    """A tmpfs of `size` at path (as root): the run's log directory on a volume that fills."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                   check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _fill(volume: Path) -> None:
    """Write until the volume is full (ENOSPC)."""
    with open(volume / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc


def test_a_full_volume_does_not_stop_the_teardown(podagent_runs: Runs) -> None:
    """Checkpoints fill /workspace while the job runs: SIGTERM still stops the job and Ray
    (every step of the teardown runs), the exit code is the signal's, and what the logs held
    before the volume filled is still there."""
    run = podagent_runs.new("fullvol")
    with _small_volume(run.log_dir), run.running(["head", "--", *_long_job(run)],
                                                 env={"PODAGENT_REWARD": "none"}):
        _await_started(run)
        _fill(run.log_dir)
        assert run.proc is not None
        run.proc.send_signal(signal.SIGTERM)
        code = run.wait(timeout=FULL_VOLUME_EXIT_WITHIN)
        log_text = run.read("job.log")
    assert code == 143, f"{run.stdout[-3000:]}\n{run.stderr}"
    assert run.leftovers == []
    assert "could not record the run's end in the ledger" in run.stdout, run.stdout[-3000:]
    assert f"job {run.run_name}-1 stopped (status STOPPED)" in run.stdout, run.stdout[-3000:]
    assert "Ray stopped (" in run.stdout
    assert "Traceback" not in run.stdout + run.stderr
    assert "started" in log_text.splitlines()


def _answering_server(run: PodagentRun) -> list[str]:
    """A reward server (PODAGENT_REWARD=cmd) that answers every request and ignores SIGTERM:
    stopping it takes the whole PODAGENT_STOP_TIMEOUT, then SIGKILL."""
    script = run.scratch / "stubborn_server.py"
    script.write_text(STUBBORN_SERVER)
    return [sys.executable, str(script)]


STUBBORN_SERVER = reward_cmd.script(before="signal.signal(signal.SIGTERM, signal.SIG_IGN)")
SLOW_STEP = 120  # PODAGENT_STOP_TIMEOUT: the reward server's stop would take this long
CUT_SHORT_WITHIN = 20.0  # TERM_BUDGET (4 s) and Ray's stop, with room for a loaded machine


def test_sigterm_during_an_ordinary_teardown_cuts_it_short(podagent_runs: Runs) -> None:
    """The job succeeded and the teardown waits for a reward server that ignores SIGTERM: a
    SIGTERM then gives the rest of the teardown the signal's budget, not PODAGENT_STOP_TIMEOUT.
    The run had succeeded: the exit code says so, as the ledger does."""
    run = podagent_runs.new("slowdown")
    with run.running(["head", "--", sys.executable, "-c", "print('done', flush=True)"],
                     env={"PODAGENT_REWARD": "cmd",
                          "PODAGENT_REWARD_CMD": shlex.join(_answering_server(run)),
                          "PODAGENT_STOP_TIMEOUT": str(SLOW_STEP)}):
        wait_for(lambda: run.read("ledger.json"), lambda text: '"finished"' in text,
                 timeout=180, what="the ledger to record the run's end (the teardown began)")
        assert run.proc is not None
        run.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        code = run.wait(timeout=SLOW_STEP)
        took = time.monotonic() - sent
    assert code == 0, f"{run.stdout[-3000:]}\n{run.stderr}"
    assert took < CUT_SHORT_WITHIN, f"exited {took:.1f} s after SIGTERM\n{run.stdout[-3000:]}"
    assert run.leftovers == []
    ledger = json.loads(run.read("ledger.json"))
    assert ledger["finished"]["outcome"] == "succeeded"
    assert ledger["finished"]["exit_code"] == 0 == ledger["starts"][-1]["exit_code"]
    assert [e["event"] for e in run.events()].count("terminating") == 1


def test_the_head_leaves_when_its_dashboard_dies_and_the_gcs_lives(podagent_runs: Runs) -> None:
    """The Jobs API is how the head follows and stops the job: a dashboard that died (Ray
    does not start it again) ends the run with exit 10 instead of a wait without end; the
    teardown still stops Ray, which ends the job."""
    run = podagent_runs.new("dashdead")
    with run.running(["head", "--", *_long_job(run)],
                     env={"PODAGENT_REWARD": "none", "PODAGENT_STOP_TIMEOUT": "3"}):
        _await_started(run)
        dashboard = wait_for(
            lambda: [p for p in run.processes() if "dashboard/dashboard.py" in _cmdline(p)],
            lambda found: len(found) == 1, timeout=10, what="the run's Ray dashboard")[0]
        dashboard.kill()
        code = run.wait(timeout=NOTICE_WITHIN + DEAD_RAY_EXIT_WITHIN)
    assert code == 10, f"{run.stdout[-3000:]}\n{run.stderr}"
    assert "Ray dashboard (the Jobs API) exited" in run.stderr, run.stderr
    assert run.leftovers == []
    assert json.loads(run.read("ledger.json"))["starts"][-1]["exit_code"] == 10


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""
