"""Every way out of `podagent up` leaves nothing of the run at RunPod: a schedule of faults at
each API call of a run's creation and first look (a signal right after the call was answered,
a refusal, a 2xx answered with an empty body or with nonsense, a bug), then the first Ctrl-C
during the final teardown. Judged by the outcome: the exit code, and that RunPod lists no pod
of the run afterwards (or that only a second interrupt left them, saying `podagent down RUN`).

The pods are held in PROVISIONING (billing, as at RunPod): creation is what is tested, so no
pod needs to run, and each case takes seconds."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakes.runpod_cloud import FakeRunPodCloud
from tests.harness.laptop import (
    IMAGES,
    KEY,
    after_call,
    billing,
    gone_within,
    laptop_env,
    listed,
    of_run,
    run_down,
    signal_to,
    stacks_of,
    start_up,
    up_argv,
)
from tests.harness.pods import DnsServer, PodNetwork, wait_for

# The calls of a 3-pod run, in order (the workers' two creates go out together).
CALLS = ("GPUs", "data centers", "list pods", "list clusters", "head create", "worker create",
         "worker create", "first look")
TIMEOUT = "4"  # --timeout: a run whose pods never start ends (exit 21) after this
LAVISH = {"minute": 100_000, "hour": 1_000_000, "day": 10_000_000}  # many runs in a minute
RESULTS: list[tuple[str, str, int, float]] = []  # (case, call, exit, seconds to none listed)


@pytest.fixture(scope="module")
def report() -> Iterator[list[tuple[str, str, int, float]]]:
    yield RESULTS
    if RESULTS:  # -s shows it: the seconds from each fault until RunPod listed none
        print("\nfault                 call             exit  to none listed")
        for case, call, code, took in RESULTS:
            print(f"{case:21} {call:16} {code:4}  {took:.1f} s")


OUTCOME_BOUND = 180.0


@pytest.fixture
def cloud(pod_network: PodNetwork, dns_server: DnsServer, tmp_path: Path
          ) -> Iterator[FakeRunPodCloud]:
    with FakeRunPodCloud(pod_network, dns_server, tmp_path / "cloud", api_key=KEY,
                         images=IMAGES, rate_limits=LAVISH) as fake:
        fake.hold_provisioning(".")
        yield fake
        assert fake.invalid_requests() == []


def _up(cloud: FakeRunPodCloud, tmp_path: Path, name: str, *extra: str,
        python: tuple[str, ...] = ()) -> subprocess.Popen:
    argv = up_argv(name, 3, "--timeout", TIMEOUT, *extra)
    if python:  # podagent with a bug planted in it (see test_a_bug_...)
        argv = [sys.executable, "-c", *python, *argv[3:]]
    return start_up(cloud, tmp_path, argv)


def _outcome(cloud: FakeRunPodCloud, proc: subprocess.Popen, name: str) -> tuple[int, str]:
    """The exit code and output of `up`, once RunPod lists nothing of its run."""
    try:
        # A create cut off by the fault is waited for until its deadline has passed twice
        # over (2 x --api-timeout's 60 s): a create that never reached RunPod costs all of it.
        out, _ = proc.communicate(timeout=OUTCOME_BOUND)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"`up` still running {OUTCOME_BOUND:g} s after the fault:\n"
                             f"{stacks_of(proc)[-8000:]}") from None
    gone_within(cloud, name, 0.0)
    cloud.clear_after_response()
    assert not listed(cloud, name), out
    return proc.returncode, out


def _first_answer(cloud: FakeRunPodCloud, k: int) -> float:
    counted = [r for r in cloud.requests if not r.path.endswith("/logs")]
    return counted[k - 1].time if len(counted) >= k else 0.0


@pytest.mark.parametrize("k", range(1, len(CALLS) + 1), ids=list(CALLS))
def test_a_signal_after_any_call_terminates_what_was_created(cloud, tmp_path, report, k):
    """SIGINT after each call; SIGTERM and SIGHUP (a closed terminal) after some: the run
    stops, what was created is terminated, the exit is 128 + the signal."""
    signum = {5: signal.SIGTERM, 6: signal.SIGHUP}.get(k, signal.SIGINT)
    name = f"sig{k}"
    proc = _up(cloud, tmp_path, name)
    after_call(cloud, k, signal_to(proc, signum))
    code, out = _outcome(cloud, proc, name)
    took = gone_within(cloud, name, _first_answer(cloud, k))
    assert code == 128 + signum, out
    assert "podagent down" not in out, out  # nothing left to clean up by hand
    report.append((signal.Signals(signum).name, CALLS[k - 1], code, took))


def test_killed_after_any_call_then_down_leaves_no_pod(cloud, tmp_path, report):
    """The laptop dies (SIGKILL: nothing of podagent runs on) right after each call; `podagent
    down` then finds what was created, by the record, the names and the label, and
    terminates it; a create whose answer the laptop never wrote down is waited for until it
    can no longer land (twice its call's deadline: short here)."""
    for k in (4, 5, 6, 8):  # before the first create, after the head's, a worker's, the last
        name = f"kill{k}"
        proc = _up(cloud, tmp_path, name, "--api-timeout", "10")
        after_call(cloud, k, signal_to(proc, signal.SIGKILL))
        out, _ = proc.communicate(timeout=120)
        cloud.clear_after_response()
        assert proc.returncode == -signal.SIGKILL, (k, out)
        since = time.time()
        down = run_down(cloud, tmp_path, name)
        assert down.returncode == 0, (k, down.stdout + down.stderr)
        assert not listed(cloud, name) and cloud.billing() == [], (k, down.stdout)
        report.append(("SIGKILL, then down", CALLS[k - 1], down.returncode,
                       gone_within(cloud, name, since)))


@pytest.mark.parametrize(("k", "fault", "exit_code"), [
    (1, "refused", 20), (5, "refused", 20), (6, "refused", 20),
    (5, "empty", 21),  # the head created, its answer empty: found by its name, no second one
    (3, "nonsense", 20),
    (8, "nonsense", 21),  # a look that fails is borne: the run ends at its timeout
])
def test_a_refusal_or_nonsense_at_any_call_terminates_what_was_created(
        cloud, tmp_path, report, k, fault, exit_code):
    name = f"{fault}{k}"
    proc = _up(cloud, tmp_path, name)

    def plant(_record: object) -> None:  # the next call is the k-th
        if fault == "refused":
            cloud.fail_next(1, 422)
        else:
            cloud.garble_next(1, status=201 if k in (5, 6) else 200,
                              body=b"" if fault == "empty" else b'{"pods": [{"id": 5}]}')

    if k == 1:
        plant(None)
    else:
        after_call(cloud, k - 1, plant)
    code, out = _outcome(cloud, proc, name)
    assert code == exit_code, out
    assert "Traceback" not in out, out
    # Never a second pod for one name, whatever the answers were.
    names = [p.name for p in of_run(cloud, name)]
    assert len(names) == len(set(names)), names
    report.append((fault, CALLS[k - 1], code, gone_within(cloud, name, _first_answer(cloud, k))))


def test_the_first_ctrl_c_during_the_final_teardown_does_not_stop_it(cloud, tmp_path, report):
    """The run ends (its pods never start: exit 21) and its teardown begins; a Ctrl-C then is
    noted, not obeyed: the termination goes on, the exit is the run's, nothing is left."""
    name = "teardown"
    cloud.fail_next(2, 503, match=r"^DELETE ")  # the termination takes a few seconds
    proc = _up(cloud, tmp_path, name)
    sent: list[float] = []

    def interrupt(record: object) -> None:
        sent.append(1.0)
        signal_to(proc, signal.SIGINT)(record)

    after_call(cloud, 1, interrupt, counted=lambda r: r.method == "DELETE")
    code, out = _outcome(cloud, proc, name)
    assert sent and code == 21, out
    assert "podagent down" not in out and "nothing of it is billing" in out, out
    deletes = [r.time for r in cloud.requests if r.method == "DELETE"]
    report.append(("SIGINT in teardown", "DELETE", code, gone_within(cloud, name, deletes[0])))


@pytest.mark.parametrize("end", ["timeout", "SIGINT"])
def test_an_output_that_breaks_does_not_stop_the_teardown(cloud, tmp_path, report, end):
    """`podagent up ... | tee log`, and tee gone (Ctrl-C reaches the whole pipeline; the
    window closed): every line `up` says from then on fails (EPIPE). The run ends as it would
    (its pods never start: exit 21; or the Ctrl-C: 130) and its pods are terminated all the
    same."""
    name = f"pipe{end.lower()}"
    proc = subprocess.Popen(up_argv(name, 3, "--timeout", TIMEOUT),
                            env=laptop_env(cloud, tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    wait_for(lambda: billing(cloud, name) == 3, timeout=60, what="three pods billing")
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone
    closed = time.time()
    if end == "SIGINT":
        proc.send_signal(signal.SIGINT)
    err = proc.stderr.read()
    code = proc.wait(timeout=120)
    took = gone_within(cloud, name, closed)
    assert code == (130 if end == "SIGINT" else 21), err
    assert "Traceback" not in err and not listed(cloud, name), err
    report.append((f"output gone, {end}", "-", code, took))


# A bug, planted: the look at the pods raises something podagent never expects.
_BUG = ("import sys; import podagent.launch.watch as w\n"
        "def look(self): raise ZeroDivisionError('a planted bug')\n"
        "w.Watch.look = look\n"
        "sys.argv = ['podagent', *sys.argv[1:]]\n"
        "from podagent.cli import main; main()")


# A first Ctrl-C, planted at the moment the run is over and before its clean-up began.
_LATE_SIGNAL = ("import os, signal, sys; import podagent.launch.up as u\n"
                "decide = u.Up._leaves_pods\n"
                "def late(self, failure):\n"
                "    os.kill(os.getpid(), signal.SIGINT)\n"
                "    return decide(self, failure)\n"
                "u.Up._leaves_pods = late\n"
                "sys.argv = ['podagent', *sys.argv[1:]]\n"
                "from podagent.cli import main; main()")


def test_a_first_signal_as_the_run_ends_does_not_skip_the_clean_up(cloud, tmp_path, report):
    """Between the end of the run and the start of its clean-up a first signal used to escape
    as KeyboardInterrupt and leave every pod billing; from the run's end on, a first signal
    only notes itself and the pods are terminated all the same (a second still leaves them)."""
    name = "late"
    proc = _up(cloud, tmp_path, name, python=(_LATE_SIGNAL,))
    code, out = _outcome(cloud, proc, name)
    assert code == 21, out  # the run's own end: its pods never started within --timeout
    assert "nothing of it is billing" in out and "Traceback" not in out, out
    report.append(("signal as the run ends", "-", code, 0.0))


# What a KeyboardInterrupt landing inside a library can leave: a lock taken that the library's
# finalizer waits for at exit (seen once: urllib3's pool queue's mutex, `up` then never ended).
_LOCK_LEFT_TAKEN = ("import atexit, sys, threading\n"
                    "taken = threading.Lock(); taken.acquire()\n"
                    "atexit.register(taken.acquire)\n"
                    "sys.argv = ['podagent', *sys.argv[1:]]\n"
                    "from podagent.cli import main; main()")


def test_after_a_signal_up_ends_even_if_its_exit_would_wait_forever(cloud, tmp_path):
    """SIGINT after the list of clusters, in an `up` whose interpreter exit would wait forever
    on a lock: it ends with 130 all the same (before: `up` ran on, an hour later still)."""
    proc = _up(cloud, tmp_path, "stuck", python=(_LOCK_LEFT_TAKEN,))
    after_call(cloud, 4, signal_to(proc, signal.SIGINT))
    code, out = _outcome(cloud, proc, "stuck")
    assert code == 130, out
    assert "Traceback" not in out, out


def test_a_bug_is_its_traceback_and_exit_70_after_the_pods_are_gone(cloud, tmp_path, report):
    name = "bug"
    proc = _up(cloud, tmp_path, name, python=(_BUG,))
    code, out = _outcome(cloud, proc, name)
    assert code == 70, out
    assert "ZeroDivisionError: a planted bug" in out and "Traceback" in out, out
    assert out.index("nothing of it is billing") < out.index("Traceback"), out
    looks = [r.time for r in cloud.requests if r.method == "GET" and r.path == "/v2/pods"]
    report.append(("bug", "first look", code, gone_within(cloud, name, looks[-1])))


def test_no_key_leaves_nothing_behind_and_says_so_in_one_line(cloud, tmp_path):
    env = {**laptop_env(cloud, tmp_path), "RUNPOD_API_KEY": ""}
    result = subprocess.run(up_argv("nokey", 2), env=env, capture_output=True, text=True,
                            timeout=60, stdin=subprocess.DEVNULL)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert cloud.requests == []
