"""Which Ray on this pod is podagent's: real processes that look like Ray's to podagent (a name or
a script Ray's processes have), with and without podagent's mark in their environment."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator, Sequence

import psutil
import pytest

from podagent import config, process
from podagent.cluster import node
from podagent.config.names import RAY_OWNER
from podagent.errors import ForeignRay

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

# Sleeps; with `name`, takes that process name first (as Ray's daemons have theirs); with
# `child`, starts one more like itself (the same arguments) whose environment is empty (as a
# renamed agent's can look), which only its parent's mark makes podagent's.
SLEEPER = r"""
import ctypes, os, subprocess, sys, time
if sys.argv[1] != "-":
    ctypes.CDLL(None).prctl(15, sys.argv[1].encode(), 0, 0, 0)  # PR_SET_NAME
if sys.argv[2] == "child":
    subprocess.Popen([sys.executable, "-c", sys.argv[3], "-", "-", *sys.argv[3:]], env={})
print("ready", flush=True)
time.sleep(120)
"""


class Fakes:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, *args: str, name: str = "-", marked: bool = False,
              child: bool = False) -> subprocess.Popen[str]:
        env = {k: v for k, v in os.environ.items() if k != RAY_OWNER}
        if marked:
            env[RAY_OWNER] = "podagent run unit"
        proc = subprocess.Popen(
            [sys.executable, "-c", SLEEPER, name, "child" if child else "-", SLEEPER, *args],
            env=env, stdout=subprocess.PIPE, text=True)
        self.procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        return proc

    def children(self, proc: subprocess.Popen[str]) -> list[int]:
        found = psutil.Process(proc.pid).children()
        for _ in range(100):  # the child is started before "ready"; visible at once
            if found:
                break
            found = psutil.Process(proc.pid).children()
        return [c.pid for c in found]

    def close(self) -> None:
        for proc in self.procs:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture
def fakes() -> Iterator[Fakes]:
    made = Fakes()
    yield made
    made.close()


def pids(procs: Sequence[psutil.Process]) -> set[int]:
    return {p.pid for p in procs}


def test_the_mark_is_read_past_the_nuls_a_renamed_process_leaves():
    block = b"\0" * 40 + b"PATH=/bin\0" + RAY_OWNER.encode() + b"=podagent run x\0"
    assert process.environ_holds(block, RAY_OWNER)
    assert not process.environ_holds(b"PATH=/bin\0", RAY_OWNER)
    assert not process.environ_holds(RAY_OWNER.encode() + b"=\0", RAY_OWNER)
    assert not process.environ_holds(b"X" + RAY_OWNER.encode() + b"=1\0", RAY_OWNER)


def test_on_a_pod_the_mark_tells_podagents_ray_from_anyone_elses(fakes: Fakes):
    ours = fakes.start("default_worker.py", marked=True, child=True)
    theirs = fakes.start("default_worker.py", "--gcs-address=10.9.9.9:46399")
    not_ray = fakes.start("something_else.py")
    found = process.pod_ray()
    (child,) = fakes.children(ours)
    # What a marked process started is podagent's, even with an environment that shows nothing.
    assert {ours.pid, child} <= pids(found.ours)
    assert theirs.pid in pids(found.foreign)
    assert {ours.pid, child} & pids(found.foreign) == set()
    assert not_ray.pid not in pids(found.ours) | pids(found.foreign)
    assert ours.pid in pids(process.pod_ray_processes())
    assert theirs.pid not in pids(process.pod_ray_processes())  # never for podagent to stop


def test_with_a_temp_dir_of_its_own_only_the_ray_that_used_it_counts(fakes: Fakes):
    temp_dir = f"/tmp/pru-{uuid.uuid4().hex[:8]}"
    in_it = fakes.start("default_worker.py", f"--temp-dir={temp_dir}")
    elsewhere = fakes.start("default_worker.py")
    marked_elsewhere = fakes.start("default_worker.py", marked=True)
    found = process.pod_ray(temp_dir)
    # Today's rule: the Ray of podagent's own temp dir is podagent's to stop, marked or not;
    # any other (another podagent's, or someone's Ray on a shared machine) is no business of
    # this one: neither stopped nor refused.
    assert pids(found.ours) == {in_it.pid}
    assert found.foreign == []
    assert elsewhere.pid not in pids(found.ours) and marked_elsewhere.pid not in pids(found.ours)


def test_the_refusal_names_the_ray_in_one_line_and_says_what_to_do(fakes: Fakes):
    gcs = fakes.start("--gcs_server_port=46399", name="gcs_server")
    other = fakes.start("default_worker.py", "--gcs-address=10.9.9.9:46399")
    extra = fakes.start("default_worker.py")
    theirs = [p for p in process.pod_ray().foreign if p.pid in {gcs.pid, other.pid, extra.pid}]
    line = node.foreign_ray_line(theirs)
    assert "\n" not in line
    assert line.startswith(f"a Ray that podagent did not start runs on this pod: pid {gcs.pid} "
                           f"(gcs_server), pid {min(other.pid, extra.pid)} ("), line
    assert " and 1 other Ray processes, GCS at 10.9.9.9:46399; " in line, line
    assert "podagent will neither start a second Ray nor stop that one" in line
    assert "create the cluster with type TRAINING, not RAY" in line
    assert "stop that Ray yourself" in line
    only_gcs = node.foreign_ray_line([psutil.Process(gcs.pid)])
    assert f"pid {gcs.pid} (gcs_server), GCS on port 46399; " in only_gcs, only_gcs


def test_a_foreign_ray_is_refused_and_left_running_and_a_temp_dir_ignores_it(fakes: Fakes):
    theirs = fakes.start("default_worker.py")
    with pytest.raises(ForeignRay, match=r"^a Ray that podagent did not start runs on this pod"):
        node.refuse_foreign_ray(config.build({}, {}))
    assert theirs.poll() is None
    own_temp = config.build({}, {"PODAGENT_RAY_TEMP_DIR": f"/tmp/pru-{uuid.uuid4().hex[:8]}"})
    assert theirs.pid not in pids(node.refuse_foreign_ray(own_temp).ours)
    assert theirs.poll() is None
