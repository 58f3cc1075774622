"""The head's word that its run is over (run/beacon.py), over real sockets: a worker hears it
for its own run only, proven with the cluster token when there is one; anything else on the
port (nothing, a live run's supervisor, a stranger's bytes) is no word at all. A worker of a
run without Ray that meets it instead of the rendezvous is told so (mesh.HeadSaysOver)."""

from __future__ import annotations

import io
import queue
import socket
import threading
import time

import pytest

from podagent.gang import mesh
from podagent.report import Reporter
from podagent.run import beacon

TOKEN = "t" * 32


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def over() -> beacon.Over:
    return beacon.Over("run1", "succeeded", 0, "stop-pod")


def _started(over: beacon.Over, token: str | None) -> tuple[beacon.Beacon, int]:
    port = _free_port()
    told = beacon.Beacon(over, "127.0.0.1", port, token).start()
    assert told is not None
    return told, port


@pytest.mark.parametrize("token", [None, TOKEN])
def test_a_worker_hears_that_its_run_is_over_and_the_head_hears_who_asked(over, token):
    told, port = _started(over, token)
    try:
        assert beacon.ask("127.0.0.1", port, "run1", token) == over
        assert told.heard_from() == {"127.0.0.1"}
        assert beacon.ask("127.0.0.1", port, "run2", token) is None  # another run's head
    finally:
        told.stop()


def test_without_the_token_or_with_another_there_is_no_word(over):
    told, port = _started(over, None)  # a head without a token: its word proves nothing
    try:
        assert beacon.ask("127.0.0.1", port, "run1", TOKEN) is None
    finally:
        told.stop()
    told, port = _started(over, TOKEN)
    try:
        assert beacon.ask("127.0.0.1", port, "run1", "o" * 32) is None
    finally:
        told.stop()


@pytest.mark.parametrize("sent", [
    b'{"over": {"run": "run1", "outcome": "x", "code": 0, "proof": "\\ud800"}}\n',
    b'{"over": {"run": "run1", "code": true}}\n', b'{"over": {"run": "run1", "code": 1e400}}\n',
    b'{"over": [1]}\n', b"\xff\xfe garbage\n", b"x" * 100_000, b"",
    b'{"rendezvous": "podagent-run1"}\n',  # a live run's supervisor: no word
])
def test_a_strangers_bytes_are_no_word(sent):
    port = _free_port()
    with socket.create_server(("127.0.0.1", port)) as server:
        def answer() -> None:
            conn, _ = server.accept()
            with conn:
                conn.sendall(sent)

        threading.Thread(target=answer, daemon=True).start()
        assert beacon.ask("127.0.0.1", port, "run1", TOKEN, timeout=2.0) is None


def test_nothing_listening_is_no_word_at_once():
    assert beacon.ask("127.0.0.1", _free_port(), "run1", None, timeout=2.0) is None


def test_a_worker_of_a_run_without_ray_meets_the_word_instead_of_the_rendezvous(over):
    told, port = _started(over, TOKEN)
    try:
        rv = mesh.Rendezvous("podagent-run1", "127.0.0.1", port, 1)
        link = mesh.Link(rv, mesh.Peer("127.0.0.2", "w1"), 5.0, TOKEN,
                         Reporter("worker", "w1", None, stream=io.StringIO()), queue.Queue())
        with pytest.raises(mesh.HeadSaysOver) as said:
            link.join(deadline=time.monotonic() + 10, timeout=10, asked_rank=None,
                      sleep=lambda s: None)
        assert beacon.read(said.value.line, "run1", TOKEN) == over
    finally:
        told.stop()
