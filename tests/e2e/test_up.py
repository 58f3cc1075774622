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
from tests.fakes.runpod_cloud import FakeRunPodCloud
from tests.harness.laptop import (
    H100,
    HEAD_IMAGE,
    IMAGES,
    KEY,
    RUN_BOUND,
    after_call,
    billing,
    creates,
    laptop_env,
    nothing_left,
    run_down,
    run_up,
    start_up,
    up_argv,
)
from tests.harness.pods import DnsServer, PodNetwork, wait_for

JOB_LINE = "the job says hello"
JOB = (sys.executable, "-c", f"print({JOB_LINE!r}, flush=True)")


def up_job(name: str, pods: int = 3, *extra: str, job: tuple[str, ...] = JOB) -> list[str]:
    return up_argv(name, pods, *extra, job=job)


@pytest.fixture
def cloud(pod_network: PodNetwork, dns_server: DnsServer, tmp_path: Path
          ) -> Iterator[FakeRunPodCloud]:
    # RunPod's documented quota (60 calls a minute): `up` must pace itself within it. A pod's
    # own key may stop its pod ("own"): what that key may do is not documented, and
    # tests/e2e/test_pod_end.py plays the other way too.
    with FakeRunPodCloud(pod_network, dns_server, tmp_path / "cloud", api_key=KEY,
                         images=IMAGES, stop_grace=5.0, pod_key="own") as fake:
        yield fake
        # Every request of every test: as RunPod's document says, or the test fails.
        assert fake.invalid_requests() == []
        # Paced by the RateLimit headers: no call was ever refused for the rate.
        assert [r for r in fake.requests if r.status == 429 and not r.fault] == []


def test_up_runs_three_pods_to_exit_0_and_terminates_them(cloud, tmp_path):
    """Through a storm, as RunPod's API can be: 429s with Retry-After, 503s on creates, and a
    create carried out whose answer was lost (looked up by name: never a second pod)."""
    cloud.fail_next(3, 429, retry_after=1)
    cloud.fail_next(2, 503, match=r"^POST /v2/pods$")
    cloud.fail_next(1, 502, match=r"^POST /v2/pods$", after_acting=True)
    argv = up_job("gn")
    argv[argv.index(H100)] = "H100 SXM"  # the GPU's short name: sent as its catalog id
    result = run_up(cloud, tmp_path, argv)
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
    first_tries = list(dict.fromkeys(r.body["name"] for r in made))
    # The head first; the workers' creates go out together, in either order.
    assert first_tries[0] == "podagent-gn-head", first_tries
    assert sorted(first_tries[1:]) == ["podagent-gn-w1", "podagent-gn-w2"], first_tries
    head_id = next(p.id for p in cloud.pods.values() if p.name == "podagent-gn-head")
    workers = [r for r in made if r.body["name"] != "podagent-gn-head"]
    assert workers and all(r.body["env"]["HEAD_POD_ID"] == head_id for r in workers)
    # As RunPod's document wants it: the catalog's GPU id, the data centers with Global
    # Networking (the fake's catalog has one without: EUR-IS-1), Secure Cloud.
    networked = sorted(dc["id"] for dc in cloud.data_centers if dc["globalNetwork"])
    for r in made:
        assert r.body["gpu"]["id"] == H100 and r.body["cloud"] == "SECURE", r.body
        assert sorted(r.body["dataCenterIds"]) == networked, r.body
    # The workers' creates went out together once the head's id was known.
    w1, w2 = (min(r.time for r in made if r.body["name"] == name)
              for name in ("podagent-gn-w1", "podagent-gn-w2"))
    assert abs(w1 - w2) < 1.0, (w1, w2)
    # The last line: what the run cost at RunPod's rates, and the calls it made.
    summary = re.search(r"3 pod\(s\), ([0-9.]+) pod-hours, about \$([0-9.]+) at RunPod's "
                        r"rates; (\d+) RunPod API calls \(at most (\d+) in a minute; RunPod "
                        r"allows 60\)", result.stdout)
    assert summary, result.stdout[-3000:]
    billed = sum(p.billed_seconds for p in cloud.pods.values()) / 3600
    assert float(summary.group(1)) == pytest.approx(billed, abs=0.002)
    # Within RunPod's minute window, as RunPod (the fake) counts: faults it injected aside.
    times = sorted(r.time for r in cloud.requests if r.key == "account" and not r.fault)
    assert max(sum(1 for t in times if s <= t < s + 60) for s in times) <= 60
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
    result = run_up(cloud, tmp_path, up_job("ic", 2, "--cluster"))
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    assert JOB_LINE in result.stdout and "[head] cluster ready: 2 nodes" in result.stdout
    assert "NODE_RANK=0 (Instant Cluster)" in result.stdout  # rank 0 is the head
    made = creates(cloud)
    assert [(r.path, r.body["type"]) for r in made] == [("/v2/clusters", "TRAINING")]
    ranks = sorted((p.cluster or {}).get("rank") for p in cloud.pods.values())
    assert ranks == [0, 1]
    nothing_left(cloud)


def test_up_runs_torchrun_on_three_pods_without_ray(cloud, tmp_path):
    """`up --launcher torchrun`: every pod runs the launcher on the same script (a gloo DDP
    loop), ranked by podagent's rendezvous; `up` follows the head to its end and terminates
    the pods."""
    out = tmp_path / "ranks"
    out.mkdir()
    loop = Path(__file__).resolve().parents[1] / "jobs" / "ddp_loop.py"
    # torch looks up every TCPStore peer's host name, and pods reach no name server: one try.
    argv = up_argv("tr", 3, "--launcher", "torchrun", "-e", "RES_OPTIONS=timeout:1 attempts:1",
                   job=("--", str(loop), str(out)))
    result = run_up(cloud, tmp_path, argv)
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(3)]
    assert {r["world"] for r in ranks} == {3}
    assert sorted(r["node"] for r in ranks) == [0, 1, 2]  # every pod its own machine rank
    assert {r["mode"] for r in ranks} == {"torchrun"}
    assert "run tr succeeded (exit 0)" in result.stdout
    made = creates(cloud)
    assert all(r.body["env"]["PODAGENT_LAUNCHER"] == "torchrun" for r in made)
    assert all(shlex.split(r.body["env"]["PODAGENT_JOB"]) == ["--", str(loop), str(out)]
               for r in made)
    nothing_left(cloud)


def test_a_head_started_again_mid_run_resumes_and_up_waits_for_the_end(cloud, tmp_path):
    """The head's podagent killed while the job runs: RunPod starts its container again, the
    run resumes (the job submitted again), and `up` ends once, with the run's own code — not
    at the first start's exit."""
    go = tmp_path / "go"
    job = (sys.executable, "-c", "import os, sys, time\nprint('job started', flush=True)\n"
           f"while not os.path.exists({str(go)!r}): time.sleep(0.2)\nprint('job done')")
    proc = start_up(cloud, tmp_path, up_job("resume", 2, "--volume", "20", job=job))
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


def test_a_capped_run_ends_at_its_deadline_with_a_grace_and_nothing_left(cloud, tmp_path):
    """--max-cost, nearer than --max-duration, at the run's list price (2 x $2.99/h): the
    pods hold the deadline; the head stops the job there with the stop's grace (the job's
    handler takes longer than Ray's own 3 s to "save"), the run ends with 27, every pod is
    terminated and the spend is said."""
    saved = tmp_path / "saved"
    job = (sys.executable, "-c",
           "import signal, sys, time\n"
           "def save(*_):\n"
           "    time.sleep(4)  # longer than Ray's default grace\n"
           f"    open({str(saved)!r}, 'w').close()\n"
           "    sys.exit(0)\n"
           "signal.signal(signal.SIGTERM, save)\n"
           "print('job started', flush=True)\n"
           "while True: time.sleep(0.2)\n")
    # $0.10 at $5.98/h: 60 s from the check (the least a cap may be), for the pods to start
    # and the job to run (it ran 20 s in).
    argv = up_job("capped", 2, "--max-cost", "0.10", "--max-duration", "1h",
                  "-e", "PODAGENT_STOP_TIMEOUT=15", job=job)
    began = time.time()
    result = run_up(cloud, tmp_path, argv)
    out = result.stdout + result.stderr
    assert result.returncode == 27, out[-5000:]
    assert "(--max-cost $0.1 at $5.98/h)" in result.stdout
    made = creates(cloud)
    deadlines = {r.body["env"]["PODAGENT_DEADLINE"] for r in made}
    assert len(deadlines) == 1 and len(made) == 2, deadlines
    deadline = float(deadlines.pop())
    assert began + 59 <= deadline <= began + 90
    assert "job started" in result.stdout and saved.exists(), out[-5000:]
    assert "DEADLINE: the run reached" in result.stdout
    assert time.time() >= deadline
    assert re.search(r"run capped ended: PODAGENT_DEADLINE .* \(exit 27\) after [0-9.]+ s; "
                     r"the job's first line after [0-9.]+ s; 2 pod\(s\), [0-9.]+ pod-hours, "
                     r"about \$[0-9.]+ at RunPod's rates", result.stdout), result.stdout[-3000:]
    assert all(p.status == "TERMINATED" for p in cloud.pods.values())
    nothing_left(cloud)
    record = json.loads((tmp_path / "state" / "podagent" / "runs" / "capped.json").read_text())
    assert record["outcome"]["code"] == 27
    assert record["spec"]["deadline"] == pytest.approx(deadline, abs=0.5)
    assert record["spec"]["max_cost"] == 0.10


@pytest.mark.parametrize("argv_extra, says", [
    (("--pods", "0"), "--pods=0 must be at least 1"),
    (("--gpu", "NVIDIA H100"), "is not a GPU type RunPod offers"),
    (("--image", "Bad Image"), "is not a container image reference"),
    (("--cloud", "COMMUNITY"), "both Secure Cloud only"),
    (("--data-center", "EUR-IS-1"), "--data-center='EUR-IS-1' does not support Global "
                                    "Networking"),
    (("--registry-auth", "nope"), "is not a registry credential of this RunPod account"),
    (("--cluster", "--registry-auth", "nope"), "--registry-auth cannot be used with --cluster"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_created(cloud, tmp_path, argv_extra, says):
    result = run_up(cloud, tmp_path, [*up_job("bad", 2, *argv_extra)], timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert says in result.stderr and result.stderr.count("\n") == 1, result.stderr
    assert creates(cloud) == [] and cloud.pods == {}


def test_a_wrong_key_is_exit_18_and_nothing_created(cloud, tmp_path):
    env = {**laptop_env(cloud, tmp_path), "RUNPOD_API_KEY": "rpa_wrong"}
    result = subprocess.run(up_job("nokey", 2), env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 18, result.stdout + result.stderr
    assert "answered 401" in result.stderr and "rpa_wrong" not in result.stderr
    assert cloud.pods == {}


def test_an_api_that_stays_down_is_a_clear_error_and_nothing_bills(cloud, tmp_path):
    cloud.fail_next(10_000, 503, match=r"^POST /v2/pods$")
    result = run_up(cloud, tmp_path, up_job("down503", 2, "--api-timeout", "8"), timeout=200)
    assert result.returncode == 20, result.stdout + result.stderr
    assert "answered 503" in result.stderr
    gave_up = re.search(r"gave up after \d+ attempts in ([0-9.]+) s", result.stderr)
    assert gave_up and float(gave_up.group(1)) <= 8 + 1, result.stderr  # the declared deadline
    nothing_left(cloud)


def test_a_pod_that_never_leaves_provisioning_is_an_error_in_time(cloud, tmp_path):
    cloud.hold_provisioning(r"-w1$")
    started = time.monotonic()
    result = run_up(cloud, tmp_path, up_job("stuck", 2, "--timeout", "5"), timeout=200)
    took = time.monotonic() - started
    assert result.returncode == 21, result.stdout + result.stderr
    assert "podagent-stuck-w1 PROVISIONING" in result.stderr
    assert took < 5 + 60, took
    nothing_left(cloud)


def test_no_capacity_names_the_gpu_and_nothing_bills(cloud, tmp_path):
    cloud.no_capacity(H100)
    result = run_up(cloud, tmp_path, up_job("full", 2), timeout=120)
    assert result.returncode == 19, result.stdout + result.stderr
    assert f"could not place 1 x {H100} (SECURE cloud) in any data center" in result.stderr
    nothing_left(cloud)


def test_a_create_sent_again_after_a_lost_answer_leaves_no_late_pod_billing(cloud, tmp_path):
    """The head's create is answered 502 and carried out seconds later (RunPod lists a pod
    some time after making it): the look by its name finds nothing, the create goes out
    again and is refused (no capacity). The first may still land: `up` waits for it and
    terminates it before it ends, and nothing bills after `up` is gone."""
    cloud.fail_next(1, 502, match=r"^POST /v2/pods$", lands_after=4.0)
    cloud.fail_next(1, 400, match=r"^POST /v2/pods$")
    result = run_up(cloud, tmp_path, up_argv("late", 2, "--api-timeout", "20",
                                             image=HEAD_IMAGE), timeout=120)
    out = result.stdout + result.stderr
    assert result.returncode == 19, out[-5000:]
    assert [r.body["name"] for r in creates(cloud)] == ["podagent-late-head"] * 2
    # The late pod lands (`up` looked for it until it did), and was terminated.
    (late,) = wait_for(lambda: [p for p in cloud.pods.values() if p.name ==
                                "podagent-late-head"], timeout=30, what="the late pod")
    assert late.status == "TERMINATED", late
    nothing_left(cloud)
    record = state.load(tmp_path / "state" / "podagent" / "runs", "late")
    assert record is not None and record.status == state.DOWN, record
    assert "may still make a pod" in out


@pytest.mark.parametrize("answer", ["a 2xx without the pod", "a look that fails with 400"])
def test_a_create_whose_fate_is_unknown_is_awaited_not_taken_as_refused(cloud, tmp_path,
                                                                         answer):
    """RunPod takes the head's create and lists its pod seconds later. Its answer is a 201
    without the pod, or a 502 after which the look by name is refused (400): neither says the
    create was not carried out, so `up` ends with an error (not "no capacity") and waits for
    the pod, which it terminates."""
    if answer.startswith("a 2xx"):
        cloud.garble_next(1, 201, b"{}", match=r"^POST /v2/pods$", lands_after=4.0)
    else:
        cloud.fail_next(1, 502, match=r"^POST /v2/pods$", lands_after=4.0)
        # The look after it (not the lists before the create): refused.
        after_call(cloud, 1, lambda _: cloud.fail_next(1, 400, match=r"^GET /v2/pods$"),
                   counted=lambda r: (r.method, r.path) == ("POST", "/v2/pods"))
    result = run_up(cloud, tmp_path, up_argv("fate", 2, "--api-timeout", "20",
                                             image=HEAD_IMAGE), timeout=120)
    out = result.stdout + result.stderr
    assert result.returncode == 20, out[-5000:]
    (late,) = wait_for(lambda: [p for p in cloud.pods.values() if p.name ==
                                "podagent-fate-head"], timeout=30, what="the late pod")
    assert late.status == "TERMINATED", late
    nothing_left(cloud)
    assert len(creates(cloud)) == 1  # nothing sent again


def test_up_again_with_the_same_name_reattaches_instead_of_creating(cloud, tmp_path):
    cloud.hold_provisioning(r"-w1$")
    # The pods run a stand-in for podagent (tests/fakes/pod_head.py): creation is what counts.
    # A short call deadline: a create whose answer the killed `up` never wrote down is waited
    # for (twice that) before the second `up` re-attaches.
    proc = start_up(cloud, tmp_path, up_argv("again", 2, "--api-timeout", "10",
                                             image=HEAD_IMAGE))
    wait_for(lambda: len(creates(cloud)) == 2, timeout=60, what="both creates")
    proc.kill()  # the laptop crashed with the run half up
    proc.communicate(timeout=30)
    cloud.release_provisioning()
    result = run_up(cloud, tmp_path, up_argv("again", 2, image=HEAD_IMAGE))
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    assert "re-attaching" in result.stdout
    assert len(creates(cloud)) == 2  # nothing created twice
    nothing_left(cloud)


def test_ctrl_c_terminates_the_pods_and_a_second_leaves_them(cloud, tmp_path):
    cloud.hold_provisioning(".")
    proc = start_up(cloud, tmp_path, up_job("ctrlc", 2))
    wait_for(lambda: billing(cloud, "ctrlc") == 2, timeout=60, what="two pods billing")
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 130, out
    assert "SIGINT: stopping run ctrlc and terminating its pods" in out
    assert cloud.billing() == []
    # Twice: the pods are left, and the line says how to clean up.
    cloud.fail_next(10_000, 503, match=r"^DELETE ")  # the terminate takes its time
    proc = start_up(cloud, tmp_path, up_job("ctrlc2", 2, "--api-timeout", "120"))
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
    proc = start_up(cloud, tmp_path, up_job("listed", 2))
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
    The job fails: the run's code is the job's (3) and the pods are terminated all the same.
    The pods run a stand-in for podagent (tests/fakes/pod_head.py): the view is what counts."""
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
    go = tmp_path / "go"  # the stand-in head ends its run only once the board showed w1 run
    argv = up_argv("live", 2, "-e", "POD_HEAD_LINES=1", "-e", "POD_HEAD_CODE=3",
                   "-e", f"POD_HEAD_GO={go}", image=HEAD_IMAGE)
    command = f"{shlex.join(argv)}; echo $? > {shlex.quote(str(done))}"
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()
                       if k in ("RUNPOD_API_KEY", "RUNPOD_API_URL", "XDG_STATE_HOME", "PATH",
                                "TERM", "PYTHONUNBUFFERED"))
    base = [tmux, "-L", socket_name]
    subprocess.run([*base, "new-session", "-d", "-s", session, "-x", "120", "-y", "40",
                    f"env {exports} {command}; sleep 600"], check=True, timeout=30)

    def pane(*history: str) -> str:
        return subprocess.run([*base, "capture-pane", "-p", *history, "-t", session],
                              capture_output=True, text=True, timeout=30).stdout

    try:
        wait_for(lambda: re.search(r"podagent-live-w1\s+\S+\s+PROVISIONING", pane()),
                 timeout=90, what="the board to show w1 PROVISIONING")
        provisioning = pane()
        cloud.release_provisioning()
        wait_for(lambda: re.search(r"podagent-live-w1\s+\S+\s+RUNNING", pane()), timeout=90,
                 what="the board to show w1 RUNNING")
        go.touch()
        wait_for(done.exists, timeout=RUN_BOUND, what="podagent up to end")
        final = pane("-S", "-")  # with what scrolled off the screen
    finally:
        subprocess.run([*base, "kill-server"], timeout=30, check=False)
    assert done.read_text().strip() == "3", final
    assert "run live" in provisioning and "$/h" in provisioning
    assert "job line 1" in final and "run live ended: the job failed" in final
    assert "(exit 3)" in final
    nothing_left(cloud)
