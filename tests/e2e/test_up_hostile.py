"""`podagent up` against what a hostile review of its clean-up found: each test is one of its
repros, with the outcome that matters asserted (how many pods still bill, the exit code).

A create RunPod carries out after `up` stopped waiting for it, a pod list that fails or leaves
the run's pods out, a cluster RunPod does not list, an output nobody reads, a run whose head
is gone, and a second Ctrl-C while the terminates are retried."""

from __future__ import annotations

import fcntl
import json
import shutil
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.harness.laptop import (
    HEAD_IMAGE,
    KEY,
    Output,
    billing,
    laptop_env,
    listed,
    of_run,
    run_cli,
    run_down,
    start_up,
    up_argv,
)
from tests.harness.pods import wait_for

LAVISH = {"minute": 100_000, "hour": 1_000_000, "day": 10_000_000}


@pytest.fixture
def cloud(runpod_cloud: Any) -> Any:
    return runpod_cloud(rate_limits=LAVISH, pod_key="own")


def _up(cloud: Any, tmp_path: Path, argv: list[str]) -> Output:
    return Output(start_up(cloud, tmp_path, argv))


def _stand_in(run: str, tmp_path: Path, pods: int, *extra: str) -> list[str]:
    """A run whose head prints a few lines, then ends once `go` exists."""
    return up_argv(run, pods, "-e", f"POD_HEAD_GO={tmp_path / 'go'}", *extra, image=HEAD_IMAGE)


def _none_left(cloud: Any, run: str, within: float) -> None:
    wait_for(lambda: billing(cloud, run) == 0, timeout=within,
             what=f"run {run}'s pods to stop billing (still: {listed(cloud, run)})")


def test_a_create_cut_off_by_ctrl_c_is_terminated_once_it_lands(cloud, tmp_path):
    """RunPod takes 4 s to answer (and carry out) the head's create; Ctrl-C after 1 s: the
    clean-up waits for the create's answer (the call was never cut: it runs on a thread of
    its own) and terminates the pod it names (before: exit 130 saying nothing was left, and
    the head billed on)."""
    cloud.create_delay = 4.0
    up = _up(cloud, tmp_path, _stand_in("inflight", tmp_path, 2, "--api-timeout", "20"))
    up.wait("creating pods")
    time.sleep(1.0)  # the fault's moment: the create is on its way
    up.proc.send_signal(signal.SIGINT)
    assert up.end() == 130, up.text[-3000:]
    assert "terminating 1 pod(s) of run inflight" in up.text, up.text[-3000:]
    cloud.create_delay = 0.0
    assert [p.status for p in of_run(cloud, "inflight")] in ([], ["TERMINATED"]), \
        of_run(cloud, "inflight")
    assert billing(cloud, "inflight") == 0


def test_a_second_ctrl_c_with_creates_on_their_way_leaves_at_once(cloud, tmp_path):
    """The workers' creates take 25 s each; Ctrl-C, then Ctrl-C again while they are on their
    way: `up` leaves at once, saying `podagent down` (before: it said so, then waited 7 s for
    the creates' answers as Python joined the pool's threads). `down` then finds what landed
    by name, looking for them until each has landed (a create makes one pod), within their
    calls' deadline."""
    run = "leaving"

    # Long enough for `down` to start, and end, while they are still on their way on the loaded
    # machine (at 8 s, every create had landed once `down` looked).
    def slow_after_the_head(record: Any) -> None:  # the workers' creates take 25 s each
        if record.method == "POST" and record.path == "/v2/pods":
            cloud.create_delay = 25.0

    cloud.after_response(slow_after_the_head)
    up = _up(cloud, tmp_path, _stand_in(run, tmp_path, 4, "--api-timeout", "35"))
    wait_for(lambda: cloud.create_delay > 0, timeout=60, what="the head's create to be answered")
    time.sleep(1.0)  # the workers' creates are on their way
    up.proc.send_signal(signal.SIGINT)
    up.wait("Ctrl-C again to leave them running")
    up.proc.send_signal(signal.SIGINT)
    second = time.monotonic()
    assert up.end(timeout=60) == 130, up.text[-3000:]
    took = time.monotonic() - second
    assert took < 4.0, f"left {took:.1f} s after the second Ctrl-C: it waited for the creates"
    assert f"left the pods of run {run} as they are" in up.text, up.text[-3000:]
    assert "Traceback" not in up.text
    # The record holds what was asked and never answered; `down`, run at once, while those
    # creates are still on their way, looks for them until their calls' deadline (before: it
    # found nothing, said so, exited 0, and the pods landed and billed).
    record = json.loads((tmp_path / "state" / "podagent" / "runs" / f"{run}.json").read_text())
    unanswered = [r for r in record["resources"] if r["id"] is None]
    assert unanswered and all(r["lands_by"] > time.time() for r in unanswered), record
    # A --timeout shorter than what is left of their window: what is there is terminated, and
    # the end is exit 26, never "nothing of it is billing" while a pod may still come. (Room
    # for the list's answer on a loaded machine: at 2 s, CI's list call was cut short.)
    short = run_cli(cloud, tmp_path, "down", run, "--timeout", "6")
    assert short.returncode == 26, short.stdout + short.stderr
    last = short.stderr.strip().splitlines()[-1]
    assert "may still make a pod" in last and f"`podagent down {run}`" in last, last
    assert "nothing of it is billing" not in short.stdout, short.stdout
    # Once every create's pod is listed, nothing is left to land (a create makes one pod):
    # a --timeout shorter than the window is no longer cut short by it (before: exit 26,
    # "may still make a pod" for a pod RunPod was listing).
    wait_for(lambda: len(of_run(cloud, run)) == len(record["resources"]), timeout=60,
             what=f"every create of run {run} to land (listed: {of_run(cloud, run)})")
    window_end = min(2 * r["lands_by"] - r["asked_at"] for r in unanswered)
    down = run_cli(cloud, tmp_path, "down", run, "--timeout", "5")
    assert window_end - time.time() > 5, "the creates' window ended: the case is not tested"
    assert down.returncode == 0, down.stdout + down.stderr
    assert "may still make a pod" not in down.stdout + down.stderr, down.stdout
    assert billing(cloud, run) == 0


def test_a_pod_list_that_fails_still_terminates_the_pods_up_knows(cloud, tmp_path):
    """RunPod's list answers 503 throughout the clean-up: every pod `up` holds the id of is
    asked to go by that id all the same; exit 26 (what went unconfirmed may bill), and
    `down` confirms once the list is back."""
    run = "nolist"
    up = _up(cloud, tmp_path, _stand_in(run, tmp_path, 3, "--api-timeout", "3"))
    up.wait("job line 5")
    cloud.fail_next(100_000, 503, match=r"^GET /v2/pods$")
    (tmp_path / "go").touch()
    assert up.end() == 26, up.text[-3000:]
    accepted = {r.path for r in cloud.requests if r.method == "DELETE" and not r.fault}
    assert len(accepted) == 3, accepted
    cloud.clear_faults()
    assert billing(cloud, run) == 0
    assert run_down(cloud, tmp_path, run).returncode == 0


def test_pods_a_list_leaves_out_are_terminated_by_their_ids(cloud, tmp_path):
    """The list answers with one odd pod of someone else only (a status the document does
    not give, the run's own pods left out): the pods `up` created are terminated by their
    ids all the same, and the run ends as it did."""
    run = "odd"
    up = _up(cloud, tmp_path, _stand_in(run, tmp_path, 3, "--api-timeout", "3"))
    up.wait("job line 5")
    odd = b'{"pods": [{"id": "zzz", "name": "someone-elses", "status": "PAUSED", "cost": 0}]}'
    cloud.garble_next(100_000, body=odd, match=r"^GET /v2/pods$")
    (tmp_path / "go").touch()
    assert up.end() == 0, up.text[-3000:]
    cloud.clear_faults()
    assert billing(cloud, run) == 0 and "was not in RunPod's list but was there" in up.text


def test_a_cluster_runpod_does_not_list_is_deleted_by_the_id_its_pods_name(cloud, tmp_path):
    run = "clu"
    up = _up(cloud, tmp_path, _stand_in(run, tmp_path, 2, "--cluster", "--api-timeout", "3"))
    up.wait("job line 5")
    cloud.garble_next(100_000, body=b'{"clusters": []}', match=r"^GET /v2/clusters$")
    (tmp_path / "go").touch()
    assert up.end() == 0, up.text[-3000:]
    cloud.clear_faults()
    assert billing(cloud, run) == 0


def test_ctrl_c_terminates_the_pods_while_nobody_reads_the_output(cloud, tmp_path):
    """`up ... | less`, the reader stopped: the pipe fills and every line `up` says would
    block. Ctrl-C still terminates the pods (before: stuck in its first line, billing)."""
    run = "stall"
    argv = _stand_in(run, tmp_path, 2, "-e", "POD_HEAD_LINES=12000")
    proc = subprocess.Popen(argv, env=laptop_env(cloud, tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        wait_for(lambda: _unread(proc.stdout.fileno()) >= PIPE_FULL, timeout=90,
                 what="up's output pipe to fill (nobody reads it)")
        proc.send_signal(signal.SIGINT)  # Ctrl-C reaches the pipeline; the reader stays
        _none_left(cloud, run, within=60)
    finally:
        proc.kill()
        proc.wait(10)
        run_down(cloud, tmp_path, run)


PIPE_FULL = 60_000  # bytes waiting in a pipe of 64 KiB: its writer blocks any moment


def _unread(fd: int) -> int:
    """Bytes waiting in a pipe, unread."""
    return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]


def test_up_name_on_a_run_whose_head_is_gone_ends_it(cloud, tmp_path):
    """A detached run, its head terminated from outside, no record here: `up --name RUN`
    ends the run (exit 24) and terminates its workers, rather than following a run that can
    never end while they bill."""
    run = "half"
    first = _up(cloud, tmp_path, _stand_in(run, tmp_path, 3, "--detach"))
    assert first.end() == 0, first.text[-2000:]
    head = next(p for p in of_run(cloud, run) if p.name.endswith("-head"))
    assert requests.delete(f"{cloud.url}/v2/pods/{head.id}", timeout=30,
                           headers={"Authorization": f"Bearer {KEY}"}).status_code == 204
    shutil.rmtree(tmp_path / "state")
    up = _up(cloud, tmp_path, [sys.executable, "-m", "podagent", "up", "--name", run])
    assert up.end(timeout=120) == 24, up.text[-3000:]
    assert billing(cloud, run) == 0


def test_a_second_ctrl_c_while_terminates_are_retried_leaves_at_once(cloud, tmp_path):
    run = "leave"
    (tmp_path / "go").touch()
    cloud.fail_next(100_000, 503, match=r"^DELETE ")
    up = _up(cloud, tmp_path, _stand_in(run, tmp_path, 3, "--api-timeout", "40"))
    up.wait(": terminating pods at")
    up.proc.send_signal(signal.SIGINT)  # the first is held: the clean-up goes on
    # Signals are not queued: two sent at once may arrive as one. The second comes later.
    time.sleep(1.0)
    up.proc.send_signal(signal.SIGINT)
    second = time.monotonic()
    assert up.end(timeout=60) == 130, up.text[-3000:]
    assert time.monotonic() - second < 10, "the second Ctrl-C waited for the terminates"
    assert "left the pods of run leave as they are" in up.text
    cloud.clear_faults()
    assert run_down(cloud, tmp_path, run).returncode == 0
