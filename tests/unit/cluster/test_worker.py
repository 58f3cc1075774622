"""The worker's verdict on a silent head: gone, or busy (cluster/worker.py::HeadSilence),
against real sockets: a port whose process takes no call (a loaded or frozen head's GCS), a
port nobody listens on (its process gone), a port that drops every new connection (a vanished
pod, or one lost SYN), a process that answers each connection by closing it."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from podagent.cluster.worker import BUSY_HEAD_GRACE, PROBE_EVERY, HeadSilence
from podagent.ray_access.gcs import GcsAuthRefused, GcsClient, GcsLate, GcsUnavailable, Reach
from tests.harness.pods import wait_for

LATE = GcsLate("DEADLINE_EXCEEDED: Deadline Exceeded")
GRACE = 8.0


class Listener:
    """A port on 127.0.0.1. `mode`: "silent" takes connections and never reads them (the
    kernel completes each, as for a GCS that gets no CPU); "closing" closes each at once;
    "full" has its one-place accept queue taken, so new connections get no answer at all."""

    def __init__(self, mode: str):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.held: list[socket.socket] = []
        if mode == "full":
            self.sock.listen(0)
            filler = socket.create_connection(("127.0.0.1", self.port), timeout=1)
            self.held.append(filler)  # queued, never accepted: the queue is full
        else:
            self.sock.listen(64)
        if mode == "closing":
            threading.Thread(target=self._close_each, daemon=True).start()

    def _close_each(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        for s in self.held:
            s.close()
        self.sock.close()


@pytest.fixture
def listener(request: pytest.FixtureRequest) -> Iterator[Listener]:
    made = Listener(request.param)
    yield made
    made.close()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("listener", ["silent"], indirect=True)
def test_a_gcs_that_lets_calls_pass_their_deadline_while_its_port_takes_them_is_busy(listener):
    gcs = GcsClient(f"127.0.0.1:{listener.port}")
    with pytest.raises(GcsLate):
        gcs.kv_get("podagent", "run_state", timeout=0.5)  # what the watch sees of it
    assert gcs.reach() is Reach.ACCEPTS
    silence = HeadSilence(gcs, GRACE, now=0.0)
    assert silence.failed(LATE, 7.9) is None and silence.busy_note(7.9) is None
    assert silence.failed(LATE, 30.0) is None  # past the grace: busy, not gone
    note = silence.busy_note(30.0)
    assert note and "its port takes connections" in note and f"{BUSY_HEAD_GRACE:g} s" in note
    assert silence.busy_note(31.0) is None  # said once per silence
    gone = silence.failed(LATE, BUSY_HEAD_GRACE + 0.5)
    assert gone == (f"has let every call pass its deadline for {BUSY_HEAD_GRACE + 0.5:.1f} s "
                    f"while its port took connections (a busy head is waited for "
                    f"{BUSY_HEAD_GRACE:g} s)")
    silence.answered(100.0)  # a new silence: said again
    assert silence.failed(LATE, 100.0 + GRACE) is None and silence.busy_note(108.0)
    gcs.close()


@pytest.mark.parametrize("listener", ["silent"], indirect=True)
def test_a_user_grace_above_the_busy_bound_is_never_shortened(listener):
    gcs = GcsClient(f"127.0.0.1:{listener.port}")
    silence = HeadSilence(gcs, BUSY_HEAD_GRACE + 10, now=0.0)
    assert silence.failed(LATE, BUSY_HEAD_GRACE + 5) is None
    assert silence.failed(LATE, BUSY_HEAD_GRACE + 10.5) is not None
    gcs.close()


def test_a_gcs_whose_port_refuses_is_gone_at_the_grace():
    gcs = GcsClient(f"127.0.0.1:{_closed_port()}")
    assert gcs.reach() is Reach.REFUSED
    silence = HeadSilence(gcs, GRACE, now=0.0)
    assert silence.failed(LATE, 7.0) is None
    assert silence.failed(LATE, 8.5) == "has been unreachable for 8.5 s (grace 8 s)"
    gcs.close()


@pytest.mark.parametrize("listener", ["full"], indirect=True)
def test_one_unanswered_try_is_tried_again_two_in_a_row_are_gone(listener):
    """A port that answers no connection at all: a pod gone, the network cut, or one lost SYN
    (then the next try answers)."""
    gcs = GcsClient(f"127.0.0.1:{listener.port}")
    assert gcs.reach(timeout=0.3) is Reach.SILENT
    silence = HeadSilence(gcs, GRACE, now=0.0)
    assert silence.failed(LATE, 8.5) is None  # the first try: maybe a lost SYN
    assert silence.failed(LATE, 10.5) == "has been unreachable for 10.5 s (grace 8 s)"
    gcs.close()


@pytest.mark.parametrize("listener", ["full"], indirect=True)
def test_an_unanswered_try_then_a_taken_one_is_busy(listener):
    gcs = GcsClient(f"127.0.0.1:{listener.port}")
    silence = HeadSilence(gcs, GRACE, now=0.0)
    assert silence.failed(LATE, 8.5) is None  # unanswered
    listener.held.pop().close()  # the queue drains (the lost SYN's retry gets through)
    listener.sock.close()
    busy = Listener("silent")
    gcs2 = GcsClient(f"127.0.0.1:{busy.port}")
    silence.gcs = gcs2
    assert silence.failed(LATE, 10.5) is None and silence.busy_note(10.5)
    busy.close()
    gcs.close()
    gcs2.close()


@pytest.mark.parametrize("listener", ["closing"], indirect=True)
def test_a_process_that_answers_by_closing_is_not_busy(listener):
    """It answered (a reset, a refusal): not a deadline; gone at the grace, whatever the port
    does."""
    gcs = GcsClient(f"127.0.0.1:{listener.port}")
    with pytest.raises(GcsUnavailable) as failed:
        gcs.kv_get("podagent", "run_state", timeout=2.0)
    assert not isinstance(failed.value, GcsLate), failed.value
    assert gcs.reach() is Reach.ACCEPTS
    silence = HeadSilence(gcs, GRACE, now=0.0)
    assert silence.failed(failed.value, 8.5) == "has been unreachable for 8.5 s (grace 8 s)"
    gcs.close()


@pytest.mark.parametrize("listener", ["closing"], indirect=True)
def test_a_busy_heads_port_is_tried_once_per_probe_interval(listener):
    """Each try waits in a frozen GCS's accept queue: a thousand workers must not fill it."""
    gcs = GcsClient(f"127.0.0.1:{listener.port}")
    silence = HeadSilence(gcs, GRACE, now=0.0)
    for t in (8.5, 9.5, 10.5, 8.5 + PROBE_EVERY - 0.1):
        assert silence.failed(LATE, t) is None
    wait_for(lambda: listener.accepted == 1, timeout=5, what="the one try to be counted")
    assert silence.failed(LATE, 8.5 + PROBE_EVERY) is None
    wait_for(lambda: listener.accepted == 2, timeout=5, what="the next interval's try")
    assert listener.accepted == 2
    gcs.close()


@pytest.mark.parametrize("listener", ["silent"], indirect=True)
def test_a_gcs_that_refuses_our_token_is_gone_at_the_grace_and_says_so(listener):
    gcs = GcsClient(f"127.0.0.1:{listener.port}")
    silence = HeadSilence(gcs, GRACE, now=0.0)
    refused = GcsAuthRefused("UNAUTHENTICATED: invalid token")
    assert silence.failed(refused, 8.5) == "has refused this pod's token for 8.5 s (grace 8 s)"
    gcs.close()


@pytest.mark.parametrize("address", ["nonsense", "127.0.0.1:notaport"])
def test_an_address_that_takes_no_connection_is_silent(address):
    assert GcsClient(address).reach(timeout=0.5) is Reach.SILENT
