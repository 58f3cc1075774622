"""Output nobody reads: a screen (a pipe a log collector stopped reading) and the pod's log file
(a volume that stalls) must never keep podagent from ending.

A stalled screen costs a line at most SCREEN_WAIT: the run goes on and one SIGTERM ends it in
order. A log file write that blocks holds the reporter's lock for as long as it blocks: a
second signal must still end podagent (every child killed) instead of waiting on that lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import signal
import socket
import struct
import sys
import termios
import threading
from collections.abc import Iterator

from tests.integration.conftest import PodagentRun, Runs, wait_for

F_SETPIPE_SZ = 1031  # Linux: set a pipe's capacity
PIPE_SIZE = 4096  # the smallest capacity: a few lines fill it
EXIT_WITHIN = 30.0

# Says it started, waits for the test's marker, then prints far more than a pipe holds (its
# own output goes to Ray's log, so it finishes whatever podagent does) and says so in a file.
CHATTY_JOB = """
import os, sys, time
print("started", flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.1)
for i in range(3000):
    print(f"line {i} " + "x" * 80, flush=True)
open(sys.argv[1] + ".done", "w").close()
time.sleep(600)
"""


def _unread(fd: int) -> int:
    """Bytes waiting in a pipe (or FIFO) nobody read yet."""
    return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]


def _job(run: PodagentRun) -> tuple[list[str], str]:
    script, marker = run.scratch / "chatty.py", run.scratch / "go"
    run.scratch.mkdir(parents=True, exist_ok=True)
    script.write_text(CHATTY_JOB)
    return [sys.executable, str(script), str(marker)], str(marker)


def _await_job(run: PodagentRun, line: str) -> None:
    wait_for(lambda: run.read("job.log").splitlines(), lambda got: line in got, timeout=180,
             what=f"the job's {line!r} line in job.log")


@contextlib.contextmanager
def _draining(fd: int) -> Iterator[threading.Event]:
    """Read fd until the event is cleared (then it fills up), as a reader that stops."""
    keep = threading.Event()
    keep.set()

    def drain() -> None:
        while keep.is_set():
            ready, _, _ = select.select([fd], [], [], 0.1)
            if ready:
                with contextlib.suppress(BlockingIOError, OSError):
                    os.read(fd, 65536)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        yield keep
    finally:
        keep.clear()
        reader.join(timeout=5)


def test_a_stalled_screen_does_not_keep_sigterm_from_ending_the_run(podagent_runs: Runs
                                                                     ) -> None:
    run = podagent_runs.new("stdoutstall")
    job, marker = _job(run)
    read_end, write_end = os.pipe()  # the test keeps both ends and never reads
    try:
        with run.running(["head", "--", *job], env={"PODAGENT_REWARD": "none"},
                         stdout=write_end):
            _await_job(run, "started")
            open(marker, "w").close()
            wait_for(lambda: os.path.exists(marker + ".done"), bool, timeout=120,
                     what="the job to finish printing")
            wait_for(lambda: select.select([], [write_end], [], 0)[1], lambda w: not w,
                     timeout=30, what="the screen's pipe to be full")
            assert run.proc is not None
            run.proc.send_signal(signal.SIGTERM)
            code = run.wait(timeout=EXIT_WITHIN)
    finally:
        os.close(read_end)
        os.close(write_end)
    assert code == 143, run.stderr
    assert run.leftovers == []
    log = run.read(f"podagent-head-{socket.gethostname()}.log")
    assert f"job {run.run_name}-1 stopped (status STOPPED)" in log, log[-2000:]
    last = run.events()[-1]
    assert last["event"] == "exit" and last["code"] == 143, last


def test_a_second_signal_ends_podagent_while_a_log_write_is_stuck(podagent_runs: Runs
                                                                   ) -> None:
    run = podagent_runs.new("logstall")
    job, marker = _job(run)
    run.run_dir.mkdir(parents=True)
    fifo = run.run_dir / f"podagent-head-{socket.gethostname()}.log"
    os.mkfifo(fifo)
    # Opened first, so that podagent's open for writing does not wait for a reader.
    read_end = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    fcntl.fcntl(read_end, F_SETPIPE_SZ, PIPE_SIZE)
    try:
        with _draining(read_end) as reading, \
                run.running(["head", "--", *job], env={"PODAGENT_REWARD": "none"}):
            _await_job(run, "started")
            reading.clear()  # the volume stalls: from now on every log write blocks
            open(marker, "w").close()
            wait_for(lambda: os.path.exists(marker + ".done"), bool, timeout=120,
                     what="the job to finish printing")
            # Far more than it holds is on its way: full but for less than a line.
            wait_for(lambda: _unread(read_end), lambda n: n >= PIPE_SIZE - 512, timeout=30,
                     what="the stalled log file to fill up")
            proc = run.proc
            assert proc is not None

            def signalled() -> int | None:
                # Repeated: two signals sent at once can reach the handler as one.
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                return proc.poll()

            code = wait_for(signalled, lambda c: c is not None, timeout=EXIT_WITHIN,
                            interval=0.5, what="podagent to exit on repeated SIGTERMs")
            run.wait(timeout=5)
    finally:
        os.close(read_end)
    assert code == 143, run.stderr
    assert "second SIGTERM: killed all children" in run.stderr, run.stderr
    assert run.leftovers == []  # Ray's daemons and the job, killed by the second signal
