"""`podagent up` from "the laptop" (this process's network namespace) against the fake RunPod
cloud (tests/fakes/runpod_cloud.py), whose pods are real test pods running the real podagent:
the run is created, forms a real Ray cluster, runs a real job and is terminated, and every
request the fake saw follows RunPod's published schema. Faults are judged by their outcome:
the exit code, what still bills at RunPod, what is left running."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from podagent.launch import state
from tests.fakes.runpod_cloud import FakeRunPodCloud, RequestRecord
from tests.harness.agents import clean_environ
from tests.harness.pods import DnsServer, PodNetwork, wait_for

KEY = "rpa_" + "LaptopKey" * 4
H100 = "NVIDIA H100 80GB HBM3"
IMAGE = "ghcr.io/podagent/podagent:test"
JOB_LINE = "the job says hello"
JOB = (sys.executable, "-c", f"print({JOB_LINE!r}, flush=True)")
RUN_BOUND = 300.0  # a whole run of 3 pods on a loaded 2-core machine
# Quick pods: no reward server, short waits where a fault makes podagent wait.
POD_ENV = ("PODAGENT_REWARD=none", "PODAGENT_STOP_TIMEOUT=5")


@pytest.fixture
def cloud(pod_network: PodNetwork, dns_server: DnsServer, tmp_path: Path
          ) -> Iterator[FakeRunPodCloud]:
    images = {IMAGE: [sys.executable, "-m", "podagent"]}
    with FakeRunPodCloud(pod_network, dns_server, tmp_path / "cloud", api_key=KEY,
                         images=images, stop_grace=5.0) as fake:
        yield fake
        # Every request of every test: as RunPod's document says, or the test fails.
        assert fake.invalid_requests() == []


def laptop_env(cloud: FakeRunPodCloud, tmp_path: Path) -> dict[str, str]:
    return {**clean_environ(), "RUNPOD_API_KEY": KEY, "RUNPOD_API_URL": cloud.url,
            "XDG_STATE_HOME": str(tmp_path / "state"), "PYTHONUNBUFFERED": "1",
            "TERM": "dumb"}


def up_argv(name: str, pods: int = 3, *extra: str, job: tuple[str, ...] = JOB) -> list[str]:
    argv = [sys.executable, "-m", "podagent", "up", "--name", name, "--image", IMAGE,
            "--gpu", H100, "--gpus", "1", "--pods", str(pods), "--timeout", "120"]
    for pair in POD_ENV:
        argv += ["-e", pair]
    return [*argv, *extra, "--", *job]


def run_up(cloud: FakeRunPodCloud, tmp_path: Path, argv: list[str],
           timeout: float = RUN_BOUND) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=laptop_env(cloud, tmp_path), capture_output=True,
                          text=True, timeout=timeout, cwd=tmp_path)


def start_up(cloud: FakeRunPodCloud, tmp_path: Path, argv: list[str]) -> subprocess.Popen:
    """`podagent up` in the background, its output (both streams) on a pipe."""
    return subprocess.Popen(argv, env=laptop_env(cloud, tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def run_down(cloud: FakeRunPodCloud, tmp_path: Path, name: str
             ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "podagent", "down", name],
                          env=laptop_env(cloud, tmp_path), capture_output=True, text=True,
                          timeout=180)


def billing(cloud: FakeRunPodCloud, run: str) -> int:
    return len([p for p in cloud.billing() if p.name.startswith(f"podagent-{run}-")])


def nothing_left(cloud: FakeRunPodCloud) -> None:
    """Nothing bills at RunPod and nothing of a pod still runs."""
    assert cloud.billing() == []
    cloud.wait_torn_down(timeout=60)
    assert cloud.leftover_processes() == []


def creates(cloud: FakeRunPodCloud) -> list[RequestRecord]:
    return [r for r in cloud.requests if r.method == "POST" and r.path in ("/v2/pods",
                                                                          "/v2/clusters")]


def test_up_runs_three_pods_to_exit_0_and_terminates_them(cloud, tmp_path):
    """Through a storm, as RunPod's API can be: 429s with Retry-After, 503s on creates, and a
    create carried out whose answer was lost (looked up by name: never a second pod)."""
    cloud.fail_next(3, 429, retry_after=1)
    cloud.fail_next(2, 503, match=r"^POST /v2/pods$")
    cloud.fail_next(1, 502, match=r"^POST /v2/pods$", after_acting=True)
    result = run_up(cloud, tmp_path, up_argv("gn"))
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-5000:]
    assert "trying again" in result.stdout
    assert JOB_LINE in result.stdout and "[head] cluster ready: 3 nodes" in result.stdout
    assert "run gn succeeded (exit 0)" in result.stdout
    assert "nothing of it is billing" in result.stdout
    # The head first, then the workers with its id: three creates, no more.
    assert sorted(p.name for p in cloud.pods.values()) == [
        "podagent-gn-head", "podagent-gn-w1", "podagent-gn-w2"]
    made = creates(cloud)  # the failed ones too
    assert list(dict.fromkeys(r.body["name"] for r in made)) == [
        "podagent-gn-head", "podagent-gn-w1", "podagent-gn-w2"]  # the head first
    head_id = next(p.id for p in cloud.pods.values() if p.name == "podagent-gn-head")
    workers = [r for r in made if r.body["name"] != "podagent-gn-head"]
    assert workers and all(r.body["env"]["HEAD_POD_ID"] == head_id for r in workers)
    assert all(p.status == "TERMINATED" for p in cloud.pods.values())
    nothing_left(cloud)
    # The key went in the header only: never in the output, the record or a pod's env.
    assert KEY not in out
    record = json.loads((tmp_path / "state" / "podagent" / "runs" / "gn.json").read_text())
    assert record["status"] == state.DOWN and record["outcome"]["code"] == 0
    assert KEY not in json.dumps(record)
    assert all(KEY not in json.dumps(r.body) for r in made)
    # One plain line per change when the output is no terminal.
    assert re.search(r"\[up\] pod podagent-gn-w2 \w+: RUNNING \(was (STARTING|PROVISIONING)\)",
                     result.stdout), result.stdout


def test_up_with_cluster_runs_on_an_instant_cluster(cloud, tmp_path):
    result = run_up(cloud, tmp_path, up_argv("ic", 2, "--cluster"))
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    assert JOB_LINE in result.stdout and "[head] cluster ready: 2 nodes" in result.stdout
    assert "NODE_RANK=0 (Instant Cluster)" in result.stdout  # rank 0 is the head
    made = creates(cloud)
    assert [(r.path, r.body["type"]) for r in made] == [("/v2/clusters", "TRAINING")]
    ranks = sorted((p.cluster or {}).get("rank") for p in cloud.pods.values())
    assert ranks == [0, 1]
    nothing_left(cloud)


def test_a_head_started_again_mid_run_resumes_and_up_waits_for_the_end(cloud, tmp_path):
    """The head's podagent killed while the job runs: RunPod starts its container again, the
    run resumes (the job submitted again), and `up` ends once, with the run's own code — not
    at the first start's exit."""
    go = tmp_path / "go"
    job = (sys.executable, "-c", "import os, sys, time\nprint('job started', flush=True)\n"
           f"while not os.path.exists({str(go)!r}): time.sleep(0.2)\nprint('job done')")
    proc = start_up(cloud, tmp_path, up_argv("resume", 2, "--volume", "20", job=job))
    head = wait_for(lambda: next((p for p in cloud.pods.values() if p.name ==
                                  "podagent-resume-head"), None), timeout=60, what="the head")

    def podagent_of_head() -> int | None:
        view = cloud.pods[head.id]
        for pid in view.harness.pids() if view.harness else []:
            with contextlib.suppress(Exception):
                if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[1:3] == [
                        b"-m", b"podagent"]:
                    return pid
        return None

    wait_for(lambda: any("job started" in line.line for line in cloud.logs(head.id)),
             timeout=RUN_BOUND, what="the job to start")
    os.kill(podagent_of_head(), signal.SIGKILL)
    wait_for(lambda: cloud.pods[head.id].starts == 2, timeout=60, what="the head restarted")
    wait_for(lambda: sum("job started" in line.line for line in cloud.logs(head.id)) == 2,
             timeout=RUN_BOUND, what="the job submitted again")
    assert proc.poll() is None  # up still follows the run
    go.touch()
    out, _ = proc.communicate(timeout=RUN_BOUND)
    assert proc.returncode == 0, out[-5000:]
    assert out.count("run resume succeeded (exit 0)") == 1
    assert [e.code for e in cloud.pods[head.id].exits][:1] == [128 + signal.SIGKILL]
    nothing_left(cloud)


@pytest.mark.parametrize("argv_extra, says", [
    (("--pods", "0"), "--pods=0 must be at least 1"),
    (("--gpu", "NVIDIA H100"), "is not a GPU type RunPod offers"),
    (("--image", "Bad Image"), "is not a container image reference"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_created(cloud, tmp_path, argv_extra, says):
    result = run_up(cloud, tmp_path, [*up_argv("bad", 2, *argv_extra)], timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert says in result.stderr and result.stderr.count("\n") == 1, result.stderr
    assert creates(cloud) == [] and cloud.pods == {}


def test_a_wrong_key_is_exit_18_and_nothing_created(cloud, tmp_path):
    env = {**laptop_env(cloud, tmp_path), "RUNPOD_API_KEY": "rpa_wrong"}
    result = subprocess.run(up_argv("nokey", 2), env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 18, result.stdout + result.stderr
    assert "answered 401" in result.stderr and "rpa_wrong" not in result.stderr
    assert cloud.pods == {}


def test_an_api_that_stays_down_is_a_clear_error_and_nothing_bills(cloud, tmp_path):
    cloud.fail_next(10_000, 503, match=r"^POST /v2/pods$")
    result = run_up(cloud, tmp_path, up_argv("down503", 2, "--api-timeout", "8"), timeout=200)
    assert result.returncode == 20, result.stdout + result.stderr
    assert "answered 503" in result.stderr
    gave_up = re.search(r"gave up after \d+ attempts in ([0-9.]+) s", result.stderr)
    assert gave_up and float(gave_up.group(1)) <= 8 + 1, result.stderr  # the declared deadline
    nothing_left(cloud)


def test_a_pod_that_never_leaves_provisioning_is_an_error_in_time(cloud, tmp_path):
    cloud.hold_provisioning(r"-w1$")
    started = time.monotonic()
    result = run_up(cloud, tmp_path, up_argv("stuck", 2, "--timeout", "20"), timeout=200)
    took = time.monotonic() - started
    assert result.returncode == 21, result.stdout + result.stderr
    assert "podagent-stuck-w1 PROVISIONING" in result.stderr
    assert took < 20 + 60, took
    nothing_left(cloud)


def test_no_capacity_names_the_gpu_and_nothing_bills(cloud, tmp_path):
    cloud.no_capacity(H100)
    result = run_up(cloud, tmp_path, up_argv("full", 2), timeout=120)
    assert result.returncode == 19, result.stdout + result.stderr
    assert f"could not place 1 x {H100} (SECURE cloud) in any data center" in result.stderr
    nothing_left(cloud)


def _kill_after(cloud: FakeRunPodCloud, proc: subprocess.Popen, calls: int) -> None:
    """SIGKILL the laptop's podagent right after the fake answered its `calls`-th request."""
    seen = {"n": 0}

    def count(record: RequestRecord) -> None:
        if record.path.endswith("/logs"):
            return
        seen["n"] += 1
        if seen["n"] == calls:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)

    cloud.after_response(count)


def test_killed_after_every_api_call_then_down_leaves_no_pod(cloud, tmp_path):
    """The laptop dies right after each of the calls that create the run (the catalog, the
    look for an existing run, the head's create, the workers' creates and the first looks),
    one schedule per call; `podagent down` then leaves nothing at RunPod."""
    cloud.hold_provisioning(".")  # creation is what is tested: the pods never need to run
    calls = 7  # catalog, list pods, list clusters, head, w1, w2, the first look
    for k in range(1, calls + 1):
        name = f"kill{k}"
        before = len(cloud.requests)
        proc = start_up(cloud, tmp_path, up_argv(name, 3))
        _kill_after(cloud, proc, k)
        out, _ = proc.communicate(timeout=120)
        cloud.clear_after_response()
        assert proc.returncode == -signal.SIGKILL, (k, out)
        made = [r for r in cloud.requests[before:] if r.method == "POST"]
        down = run_down(cloud, tmp_path, name)
        assert down.returncode == 0, (k, down.stdout + down.stderr)
        assert cloud.billing() == [], (k, made, down.stdout)
    nothing_left(cloud)


def test_up_again_with_the_same_name_reattaches_instead_of_creating(cloud, tmp_path):
    cloud.hold_provisioning(r"-w1$")
    proc = start_up(cloud, tmp_path, up_argv("again", 2))
    wait_for(lambda: len(creates(cloud)) == 2, timeout=60, what="both creates")
    proc.kill()  # the laptop crashed with the run half up
    proc.communicate(timeout=30)
    cloud.release_provisioning()
    result = run_up(cloud, tmp_path, up_argv("again", 2))
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    assert "re-attaching" in result.stdout
    assert len(creates(cloud)) == 2  # nothing created twice
    nothing_left(cloud)


def test_ctrl_c_terminates_the_pods_and_a_second_leaves_them(cloud, tmp_path):
    cloud.hold_provisioning(".")
    proc = start_up(cloud, tmp_path, up_argv("ctrlc", 2))
    wait_for(lambda: billing(cloud, "ctrlc") == 2, timeout=60, what="two pods billing")
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 130, out
    assert "SIGINT: stopping run ctrlc and terminating its pods" in out
    assert cloud.billing() == []
    # Twice: the pods are left, and the line says how to clean up.
    cloud.fail_next(10_000, 503, match=r"^DELETE ")  # the terminate takes its time
    proc = start_up(cloud, tmp_path, up_argv("ctrlc2", 2, "--api-timeout", "120"))
    wait_for(lambda: billing(cloud, "ctrlc2") == 2, timeout=60, what="two pods billing")
    before = len(cloud.requests)
    proc.send_signal(signal.SIGINT)
    wait_for(lambda: any(r.method == "DELETE" for r in cloud.requests[before:]), timeout=60,
             what="a terminate call")
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    assert "podagent down ctrlc2" in out
    assert len(cloud.billing()) == 2
    cloud.clear_faults()
    down = run_down(cloud, tmp_path, "ctrlc2")
    assert down.returncode == 0, down.stdout + down.stderr
    nothing_left(cloud)


def test_ls_lists_the_runs_pods_with_their_cost(cloud, tmp_path):
    cloud.hold_provisioning(".")
    proc = start_up(cloud, tmp_path, up_argv("listed", 2))
    wait_for(lambda: billing(cloud, "listed") == 2, timeout=60, what="two pods billing")
    ls = subprocess.run([sys.executable, "-m", "podagent", "ls"],
                        env=laptop_env(cloud, tmp_path),
                        capture_output=True, text=True, timeout=60)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=180)
    assert ls.returncode == 0, ls.stderr
    assert "podagent-listed-head" in ls.stdout and "PROVISIONING" in ls.stdout
    assert "2 pod(s) billing" in ls.stdout and "5.98" in ls.stdout  # 2 x $2.99/h
    nothing_left(cloud)


def test_the_live_view_in_a_real_terminal(cloud, tmp_path):
    """tmux runs `podagent up` as a person would; its pane shows the pods' states change.
    The job fails: the run's code is the job's (3) and the pods are terminated all the same."""
    tmux = shutil.which("tmux")
    if tmux is None:
        from tests.container import engine

        engine.install_missing({"tmux": "tmux"})
        tmux = shutil.which("tmux")
    assert tmux, "tmux is needed to try the live view"
    env = {**laptop_env(cloud, tmp_path), "TERM": "xterm-256color"}
    session = f"up{os.getpid()}"
    socket_name = f"podagent-test-{os.getpid()}"
    cloud.hold_provisioning(r"-w1$")
    done = tmp_path / "done"
    job = (sys.executable, "-c", f"import sys; print({JOB_LINE!r}, flush=True); sys.exit(1)")
    command = f"{shlex.join(up_argv('live', 2, job=job))}; echo $? > {shlex.quote(str(done))}"
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()
                       if k in ("RUNPOD_API_KEY", "RUNPOD_API_URL", "XDG_STATE_HOME", "PATH",
                                "TERM", "PYTHONUNBUFFERED"))
    base = [tmux, "-L", socket_name]
    subprocess.run([*base, "new-session", "-d", "-s", session, "-x", "120", "-y", "40",
                    f"env {exports} {command}; sleep 600"], check=True, timeout=30)

    def pane() -> str:
        return subprocess.run([*base, "capture-pane", "-p", "-t", session], capture_output=True,
                              text=True, timeout=30).stdout

    try:
        wait_for(lambda: re.search(r"podagent-live-w1\s+\S+\s+PROVISIONING", pane()),
                 timeout=90, what="the board to show w1 PROVISIONING")
        provisioning = pane()
        cloud.release_provisioning()
        wait_for(lambda: re.search(r"podagent-live-w1\s+\S+\s+RUNNING", pane()), timeout=90,
                 what="the board to show w1 RUNNING")
        wait_for(done.exists, timeout=RUN_BOUND, what="podagent up to end")
        final = pane()
    finally:
        subprocess.run([*base, "kill-server"], timeout=30, check=False)
    assert done.read_text().strip() == "3", final
    assert "run live" in provisioning and "$/h" in provisioning
    assert JOB_LINE in final and "run live ended: the job failed (exit 3)" in final
    nothing_left(cloud)
