"""`podagent up`, `down` and `ls` when this machine's record of a run is no help: the record is
a hint, RunPod's own list (the pods' names and label) is the truth. A record that cannot be read
is said in one line and kept, and every command goes on; no record at all (deleted, another
laptop) still re-attaches. The pods run a stand-in for podagent (tests/fakes/pod_head.py): what
counts here is what the laptop does."""

from __future__ import annotations

import json
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from podagent.launch import state
from tests.harness.laptop import (
    HEAD_IMAGE,
    Output,
    billing,
    creates,
    listed,
    run_cli,
    run_down,
    start_up,
    up_argv,
)
from tests.harness.pods import wait_for

LAVISH = {"minute": 100_000, "hour": 1_000_000, "day": 10_000_000}
# Records as a crash, a full disk or a hand edit leave them: none of them is one podagent wrote.
BROKEN = {
    "truncated": lambda good: good[: len(good) // 2],
    "garbage": lambda good: "\x00\xff not json at all",
    "missing key": lambda good: json.dumps({k: v for k, v in json.loads(good).items()
                                            if k != "api_url"}),
    "wrong type": lambda good: json.dumps({**json.loads(good), "outcome": 5, "cost": [1]}),
}


@pytest.fixture
def cloud(runpod_cloud: Any) -> Any:
    return runpod_cloud(rate_limits=LAVISH, pod_key="own")


def _record(tmp_path: Path, run: str) -> Path:
    return tmp_path / "state" / "podagent" / "runs" / f"{run}.json"


def _crashed_up(cloud: Any, tmp_path: Path, run: str) -> None:
    """A run whose pods bill while its `up` is gone (the laptop crashed): its record stays,
    with both pods' ids (a create whose answer it never wrote down is another test's: `down`
    then waits for it to land)."""
    proc = start_up(cloud, tmp_path, up_argv(run, 2, image=HEAD_IMAGE))
    wait_for(lambda: billing(cloud, run) == 2, timeout=60, what=f"run {run}'s two pods")

    def both_ids() -> bool:
        try:
            kept = json.loads(_record(tmp_path, run).read_text())
        except (OSError, ValueError):
            return False
        return len([r for r in kept["resources"] if r.get("id")]) == 2

    wait_for(both_ids, timeout=60, what=f"run {run}'s record to hold both pods' ids")
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)


@pytest.mark.parametrize("broken", list(BROKEN))
def test_down_and_ls_go_on_past_an_unreadable_record(cloud, tmp_path, broken):
    """`ls` says the unreadable record in one line and lists every run; `down RUN` says it,
    sets it aside (kept, as it was), finds the run's pods at RunPod by name and terminates
    them: exit 0, as any down."""
    cloud.hold_provisioning(".")
    _crashed_up(cloud, tmp_path, "other")
    _crashed_up(cloud, tmp_path, "bad")
    path = _record(tmp_path, "bad")
    written = BROKEN[broken](path.read_text())
    path.write_text(written)

    ls = run_cli(cloud, tmp_path, "ls")
    assert ls.returncode == 0, ls.stdout + ls.stderr
    said = [line for line in ls.stdout.splitlines() if str(path) in line]
    assert len(said) == 1 and "cannot be read" in said[0], ls.stdout
    assert "podagent-other-head" in ls.stdout and "podagent-bad-head" in ls.stdout, ls.stdout
    assert "4 pod(s) billing" in ls.stdout, ls.stdout

    down = run_down(cloud, tmp_path, "bad")
    assert down.returncode == 0, down.stdout + down.stderr
    said = [line for line in down.stdout.splitlines() if str(path) in line]
    assert len(said) == 1 and "cannot be read" in said[0], down.stdout
    kept = path.with_name(path.name + ".unreadable")
    assert kept.read_text() == written, list(path.parent.iterdir())  # set aside, as it was
    assert not path.exists()
    assert billing(cloud, "bad") == 0 and not listed(cloud, "bad")
    assert billing(cloud, "other") == 2  # another run's pods are not touched
    assert run_down(cloud, tmp_path, "other").returncode == 0
    assert cloud.billing() == []


@pytest.mark.parametrize("record", ["deleted", "unreadable", "deleted, --keep"])
def test_up_name_alone_reattaches_to_the_pods_without_a_record(cloud, tmp_path, record):
    """A detached run (or a --keep run whose laptop crashed), then this machine's record
    deleted (or another laptop, or a record that cannot be read): `podagent up --name RUN`
    alone finds the run's pods at RunPod, follows them to the run's end (its code), creates
    nothing, and terminates them (a --keep run's stay up, as the pods were told)."""
    go = tmp_path / "go"
    keep = record.endswith("--keep")
    first = Output(start_up(cloud, tmp_path, up_argv(
        "lost", 2, "--keep" if keep else "--detach", "-e", f"POD_HEAD_GO={go}",
        "-e", "POD_HEAD_CODE=3", image=HEAD_IMAGE)))
    if keep:
        first.wait("job line 5")
        first.proc.send_signal(signal.SIGKILL)  # the laptop crashed mid-run
        first.end()
    else:
        assert first.end() == 0 and "detached" in first.text, first.text[-3000:]
    assert billing(cloud, "lost") == 2
    path = _record(tmp_path, "lost")
    if record.startswith("deleted"):
        shutil.rmtree(tmp_path / "state")
    else:
        path.write_text("{ not json")
    made = len(creates(cloud))

    up = Output(start_up(cloud, tmp_path, [sys.executable, "-m", "podagent", "up", "--name",
                                            "lost"]))
    up.wait("re-attaching")
    up.wait("job line 5")  # following the head's log
    assert up.proc.poll() is None  # the run goes on, and `up` with it
    go.touch()
    assert up.end() == 3, up.text[-3000:]  # the run's own code
    assert "run lost ended" in up.text, up.text[-3000:]
    assert len(creates(cloud)) == made  # nothing created
    if record == "unreadable":
        assert path.with_name(path.name + ".unreadable").read_text() == "{ not json"
        said = [line for line in up.lines if "cannot be read" in line]
        assert len(said) == 1 and str(path) in said[0], up.text
    again = json.loads(path.read_text())  # a record of its own now, the run's end in it
    assert again["outcome"]["code"] == 3
    if keep:
        assert "--keep: the pods stay up idle" in up.text, up.text[-3000:]
        assert again["status"] == state.FINISHED and billing(cloud, "lost") == 2
        assert run_down(cloud, tmp_path, "lost").returncode == 0
    else:
        assert "nothing of it is billing" in up.text and again["status"] == state.DOWN
    assert cloud.billing() == [] and not listed(cloud, "lost")
