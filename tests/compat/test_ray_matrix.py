"""Every test marked ray_matrix, run again on the oldest tested Ray (OpenRLHF's 2.48.0).

This session runs them on the Ray of the test environment (the newest tested); here they run
inside the OpenRLHF field environment, where podagent was installed beside Ray 2.48.0 without
changing it: the GCS codec and the `ray start` plan (unit), a head's bring-up, job and teardown
(integration), and a head and a worker in their own pods with the head lost (e2e). The test
marked ray_auth (a token file on the head) runs again on Ray 2.59 the same way.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from xml.etree import ElementTree

from podagent.ray_access import ray_compat
from tests.compat.fieldenv import ROOT, Installed, from_test_extra
from tests.conftest import RAY_MATRIX_ONLY

MATRIX_TIMEOUT = 1200.0
# Ray before 2.52 gives the dashboard a fixed 20 s at `ray start`, and its nine module processes
# each import Ray anew (1.5 CPU-s each; 21.5 CPU-s for a whole head start, 12.7 on Ray 2.60):
# with the suite's other lanes loading both cores, heads failed all five attempts in two CI
# runs. The 2.48 run gets the CPU first, as a pod's Ray has it: a cgroup of its own (v1's cpu
# controller) weighing 8 times one of the sessions the other lanes' processes each run in
# (`nice` cannot do it: the kernel groups each session's processes and weighs the groups alike).
# Where there is no such controller, or no right to use it, it runs as any other test.
# Not more than 8 times: at 64 the other lanes' pods got so little CPU for the matrix's four
# minutes that a worker's heartbeat missed its 5 s grace and a head its 240 s bring-up (two
# failures of one fresh-clone run, both inside those minutes); at 8 it has about two thirds of
# the machine when all lanes are busy, the 21.5 CPU-s of a 2.48 head start in about 16 s.
CPU_CONTROLLER = Path("/sys/fs/cgroup/cpu")
FIRST_SHARES = 8 * 1024


@contextlib.contextmanager
def first_on_the_cpu(name: str) -> Iterator[Callable[[int], None]]:
    """Yields what puts a process (and all it starts from then on) in a heavier cgroup."""
    group: Path | None = CPU_CONTROLLER / f"podagent-{name}-{os.getpid()}"
    try:
        group.mkdir()
    except OSError:
        group = None
    else:
        try:
            (group / "cpu.shares").write_text(str(FIRST_SHARES))
        except OSError:
            group.rmdir()
            group = None

    def enter(pid: int) -> None:
        if group is not None:
            with contextlib.suppress(OSError):
                (group / "cgroup.procs").write_text(str(pid))

    try:
        yield enter
    finally:
        if group is not None:
            with contextlib.suppress(OSError):
                for pid in (group / "cgroup.procs").read_text().split():  # leftovers: back
                    with contextlib.suppress(OSError):
                        (CPU_CONTROLLER / "cgroup.procs").write_text(pid)
                group.rmdir()


# Added to the field environment, which keeps its own packages: the test tools, and the torch
# (with numpy) every trainer's image has, which the cluster check (the default job) runs on.
MATRIX_NEEDS = ("pytest", "hypothesis", "dnslib", "torch", "numpy")


def _ran(report: Path) -> dict[str, str]:
    """What a pytest run's JUnit report says of each test: `module.path.test[id]` (as a node
    id reads with `/`, `.py` and `::` made dots) -> passed, skipped, failed or error."""
    outcomes = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        tags = {child.tag for child in case}
        outcome = next((t for t in ("error", "failure", "skipped") if t in tags), "passed")
        outcomes[f"{case.get('classname')}.{case.get('name')}"] = outcome
    return outcomes


def _dotted(nodeid: str) -> str:
    path, _, name = nodeid.partition("::")
    test, bracket, params = name.partition("[")  # a parameter's id may hold "::" (an IPv6)
    return f"{path.removesuffix('.py').replace('/', '.')}.{test.replace('::', '.')}" \
           f"{bracket}{params}"


def _collect(python: str, marker: str = "ray_matrix") -> set[str]:
    result = subprocess.run(
        [python, "-m", "pytest", "-m", marker, "--collect-only", "-q",
         "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, RAY_MATRIX_ONLY: "1" if marker == "ray_matrix" else marker})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return {line for line in result.stdout.splitlines() if "::" in line}


# The GCS codec's tests of the liveness read (Ray 2.51 on): on 2.48 the census reads the table.
MAX_SKIPPED_ON_2_48 = 2


def test_matrix_tests_pass_on_ray_2_48(field_envs, tmp_path):
    field: Installed = field_envs["openrlhf"].result()
    assert field.after["ray"] == ray_compat.SUPPORTED_FROM == "2.48.0"
    env = field.env
    env.add(*from_test_extra(*MATRIX_NEEDS))  # may add packages, never change the field's
    assert env.packages()["ray"] == "2.48.0"

    python = str(env.bin / "python")
    expected = _collect(sys.executable)
    assert len(expected) > 50, sorted(expected)  # unit, integration and e2e tests

    report = tmp_path / "matrix.xml"
    with first_on_the_cpu("ray-2.48") as enter:
        proc = subprocess.Popen(
            [python, "-m", "pytest", "-m", "ray_matrix", "-q", "-p", "no:cacheprovider",
             "--basetemp", str(tmp_path / "matrix"), f"--junitxml={report}"], cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env={**os.environ, RAY_MATRIX_ONLY: "1"})
        enter(proc.pid)  # before its first test: what it starts is in the group too
        try:
            out, err = proc.communicate(timeout=MATRIX_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
    result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    # Tests of a matrix module that are not marked (run on the session's Ray only) show as
    # deselected; a test of what only a newer Ray has (its skipif names the version) skips.
    # The field's run ran exactly the tests this session collected (one of its modules that
    # failed to import there would be missing, not failed).
    ran = _ran(report)
    assert set(ran) == {_dotted(n) for n in expected}, (summary, sorted(ran))
    skipped = [name for name, outcome in ran.items() if outcome == "skipped"]
    assert len(skipped) <= MAX_SKIPPED_ON_2_48, (summary, skipped)


def test_auth_tests_pass_on_ray_2_59(field_envs, tmp_path):
    """The test marked ray_auth on Ray 2.59, the first whose `ray start --head` turns token
    auth on by itself where it finds a token file (this session runs it, and the other cases
    of tests/e2e/test_ray_auth.py, on its own Ray)."""
    field: Installed = field_envs["ray-2.59"].result()
    env = field.env
    env.add(*from_test_extra(*MATRIX_NEEDS))  # may add packages, never change the field's
    assert env.packages()["ray"] == "2.59.0"
    python = str(env.bin / "python")
    expected = _collect(sys.executable, "ray_auth")
    assert len(expected) >= 1, sorted(expected)
    report = tmp_path / "auth.xml"
    result = subprocess.run(
        [python, "-m", "pytest", "-m", "ray_auth", "-q", "-p", "no:cacheprovider",
         "--basetemp", str(tmp_path / "auth"), f"--junitxml={report}"], cwd=ROOT,
        capture_output=True, text=True, timeout=MATRIX_TIMEOUT,
        env={**os.environ, RAY_MATRIX_ONLY: "ray_auth"})
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert _ran(report) == {_dotted(n): "passed" for n in expected}, result.stdout[-3000:]
