"""`podagent up` following a run through RunPod's API as the document leaves it open: log
events whose ids are bare timestamps shared by several lines, resumed either way after the
stream drops; a stream broken for a while; a head stopped from outside; a tight rate limit;
private images. The pods run a stand-in for podagent (tests/fakes/pod_head.py) that prints the
head's records, so each case takes seconds; judged by what `up` printed (each line once, in
order), its exit code, and what is left at RunPod."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from podagent.launch import state
from tests.harness.laptop import (
    HEAD_IMAGE,
    KEY,
    Output,
    billing,
    creates,
    listed,
    of_run,
    run_cli,
    run_down,
    run_up,
    start_up,
    up_argv,
)
from tests.harness.pods import wait_for

LAVISH = {"minute": 100_000, "hour": 1_000_000, "day": 10_000_000}
LINES = 5  # job lines the stand-in prints at once (sharing a second), before and after `go`


@pytest.fixture
def make_cloud(runpod_cloud: Any) -> Any:
    return lambda **kw: runpod_cloud(**{"rate_limits": LAVISH, "pod_key": "own", **kw})


def _stand_in(name: str, tmp_path: Path, *extra: str) -> list[str]:
    return up_argv(name, 2, "-e", f"POD_HEAD_LINES={LINES}",
                   "-e", f"POD_HEAD_GO={tmp_path / 'go'}", *extra, image=HEAD_IMAGE)


@pytest.mark.parametrize("resume", ["after", "again"])
def test_the_heads_log_loses_and_repeats_nothing_through_drops_and_breaks(
        make_cloud, tmp_path, resume):
    """Either way RunPod resumes a stream, `up` shows every line once and in order. Played
    "after", the run ends as the head says; "again", the head pod is then stopped from
    outside and, with no replacement allowed, `up` ends the run within its grace (exit 24),
    terminating every pod."""
    cloud = make_cloud(log_resolution=1.0, log_resume=resume)
    hold = ("-e", "POD_HEAD_HOLD=1", "--replacements", "0") if resume == "again" else ()
    up = Output(start_up(cloud, tmp_path, _stand_in("follow", tmp_path, *hold)))
    up.wait(f"job line {LINES}")
    head = next(p for p in of_run(cloud, "follow") if p.name.endswith("-head"))
    for _ in range(3):  # a proxy drops the stream: it is opened again, resuming
        before = cloud.log_connections(head.id)
        cloud.drop_log_streams()
        wait_for(lambda b=before: cloud.log_connections(head.id) > b, timeout=30,
                 what="the stream opened again")
    cloud.fail_next(100_000, 503, match=r"^GET /v2/pods/[^/]+/logs$")  # broken for a while
    cloud.drop_log_streams()
    up.wait("the head's log stream is broken", timeout=60)
    cloud.clear_faults()
    up.wait("the head's log stream is back", timeout=60)
    (tmp_path / "go").touch()
    if resume == "again":
        up.wait(f"job line {2 * LINES}")
        stopped = time.monotonic()
        answer = requests.post(f"{cloud.url}/v2/pods/{head.id}/action",
                               json={"action": "stop"},
                               headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
        assert answer.status_code == 200, answer.text
    assert up.end() == (24 if resume == "again" else 0), up.text[-3000:]
    said = [line for line in up.lines if line.startswith("job line ")]
    assert said == [f"job line {i}" for i in range(1, 2 * LINES + 1)], up.text[-3000:]
    assert up.text.count("log stream is broken") == 1
    if resume == "again":
        assert "pod podagent-follow-head was stopped at RunPod (EXITED) while the run went " \
               "on" in up.text
        took = time.monotonic() - stopped
        assert took < 10 + 2 * 2 + 10, took  # the grace, two looks, the termination
    else:
        assert "run follow succeeded" in up.text
    assert not listed(cloud, "follow")


def test_up_paces_itself_under_a_tight_rate_limit(make_cloud, tmp_path):
    """RunPod's minute window scaled down (6 calls in 6 s): the RateLimit headers tell `up`
    how many are left, and it spreads them so that it never meets a 429."""
    cloud = make_cloud(rate_limits={"minute": 6}, rate_windows={"minute": 6.0})
    cloud.hold_provisioning(".")
    result = run_up(cloud, tmp_path, up_argv("paced", 3, "--timeout", "9"), timeout=120)
    assert result.returncode == 21, result.stdout + result.stderr
    assert [r for r in cloud.requests if r.status == 429] == []
    looks = [r for r in cloud.requests if r.method == "GET" and r.path == "/v2/pods"]
    assert len(looks) >= 3  # it kept looking, more slowly
    assert not listed(cloud, "paced")


def test_a_private_image_needs_its_registry_credential(make_cloud, tmp_path):
    cloud = make_cloud(private_images={HEAD_IMAGE: "r1"},
                       registries=[{"id": "r1", "name": "ghcr-creds"}])
    (tmp_path / "go").touch()  # the stand-in runs straight to its end
    without = run_up(cloud, tmp_path, _stand_in("nocreds", tmp_path), timeout=120)
    assert without.returncode == 21, without.stdout + without.stderr
    assert "is in ERROR at RunPod before it ran: likely an image that cannot be pulled (a " \
           "private one needs --registry-auth)" in without.stderr
    cluster = run_up(cloud, tmp_path, _stand_in("cluster", tmp_path, "--cluster"), timeout=120)
    assert cluster.returncode == 21, cluster.stdout + cluster.stderr
    assert "an Instant Cluster takes no registry credential" in cluster.stderr
    given = run_up(cloud, tmp_path, _stand_in("creds", tmp_path, "--registry-auth",
                                              "ghcr-creds"), timeout=120)
    assert given.returncode == 0, given.stdout[-3000:] + given.stderr
    assert {r.body.get("registry") for r in creates(cloud)
            if r.body["name"].startswith("podagent-creds-")} == {"r1"}
    assert cloud.billing() == []


def test_a_pod_runpod_will_not_terminate_leaves_no_other_pod_billing(make_cloud, tmp_path):
    """RunPod refuses to terminate one pod (503 past --api-timeout): every other pod of the
    run is still asked, and terminated; `up` exits 26 naming what may bill."""
    cloud = make_cloud()
    refused: list[str] = []

    def refuse_the_heads_terminate(record: Any) -> None:
        head = [p for p in of_run(cloud, "one") if p.name.endswith("-head")]
        if head and not refused:
            refused.append(head[0].id)
            cloud.fail_next(10_000, 503, match=rf"^DELETE /v2/pods/{head[0].id}$")

    cloud.after_response(refuse_the_heads_terminate)
    result = run_up(cloud, tmp_path, up_argv("one", 3, "--api-timeout", "3",
                                             image=HEAD_IMAGE), timeout=180)
    out = result.stdout + result.stderr
    assert result.returncode == 26, out[-3000:]
    deletes = {r.path for r in cloud.requests if r.method == "DELETE" and not r.fault}
    workers = [p for p in of_run(cloud, "one") if not p.name.endswith("-head")]
    assert len(workers) == 2 and {f"/v2/pods/{p.id}" for p in workers} <= deletes, deletes
    assert [p.id for p in listed(cloud, "one")] == refused, listed(cloud, "one")
    cloud.clear_faults()
    cloud.clear_after_response()
    assert run_down(cloud, tmp_path, "one").returncode == 0
    assert cloud.billing() == []


@pytest.mark.parametrize("fault", ["503", "429", "nonsense"])
def test_a_clean_up_that_fails_is_exit_26_and_down_finishes_it(make_cloud, tmp_path, fault):
    """The run succeeds, then RunPod does not terminate its pods (503 or 429 past
    --api-timeout; a list answered with nonsense): `up` exits 26, its last line names what
    may bill and `podagent down RUN`; the record is not DOWN, `ls` shows the run, and `down`
    finishes the job."""
    cloud = make_cloud()
    if fault == "nonsense":
        # From the clean-up's first terminate on, RunPod's list makes no sense.
        def garble(record: Any) -> None:
            if record.method == "DELETE":
                cloud.clear_after_response()
                cloud.garble_next(10_000, body=b'{"pods": 5}', match=r"^GET /v2/pods$")

        cloud.after_response(garble)
    else:
        cloud.fail_next(10_000, int(fault), match=r"^DELETE ")
    result = run_up(cloud, tmp_path, up_argv("stuck", 2, "--api-timeout", "3",
                                             image=HEAD_IMAGE), timeout=180)
    out = result.stdout + result.stderr
    record_of = tmp_path / "state" / "podagent" / "runs" / "stuck.json"
    assert result.returncode == 26, out[-3000:]
    assert "run stuck succeeded (exit 0)" in result.stdout, out[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert "may still bill: podagent-stuck-" in last and last.endswith(
        "`podagent down stuck` terminates them"), last
    assert "nothing of it is billing" not in out
    record = json.loads(record_of.read_text())
    assert record["status"] == state.LEFT_BILLING, record
    assert record["outcome"]["run_code"] == 0 and len(record["outcome"]["may_bill"]) == 2
    cloud.clear_faults()
    cloud.clear_after_response()
    ls = run_cli(cloud, tmp_path, "ls")
    assert ls.returncode == 0 and "clean-up failed" in ls.stdout, ls.stdout + ls.stderr
    if fault != "nonsense":  # its terminates were refused: both pods bill on
        assert billing(cloud, "stuck") == 2 and "2 pod(s) billing" in ls.stdout, ls.stdout
        # `down` refused as well: its own failure is the same exit, never a plain API error.
        cloud.fail_next(10_000, int(fault), match=r"^DELETE ")
        failed = run_cli(cloud, tmp_path, "down", "stuck", "--timeout", "3")
        assert failed.returncode == 26, failed.stdout + failed.stderr
        last = failed.stderr.strip().splitlines()[-1]
        assert "podagent down stuck" in last and "may still bill" in last, last
        assert "Traceback" not in failed.stderr and billing(cloud, "stuck") == 2
        cloud.clear_faults()
    down = run_down(cloud, tmp_path, "stuck")
    assert down.returncode == 0, down.stdout + down.stderr
    assert cloud.billing() == [] and not listed(cloud, "stuck")
    assert json.loads(record_of.read_text())["status"] == state.DOWN
