"""The supervisor port under a stranger's bytes and a worker's odd lines, on real loopback
sockets: whatever one connection sends is that connection's fault (it is dropped and said once),
never the run's; strangers are bounded in number, size and time; every line of a read counts."""

from __future__ import annotations

import functools
import json
import queue
import socket
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from podagent.errors import AuthRefused
from podagent.gang import mesh, messages, supervisor
from podagent.wire import GangPhase
from tests.harness.pods import wait_for
from tests.unit.gang.test_mesh import GRACE, _free_port, _join, _next, _reporter

TOKEN = "s3cret"
# Long enough that a peer heard from is never lost while a test waits, even when a loaded
# machine starves a thread for seconds (a 3 s grace once tripped mid-fuzz in CI). These tests
# look for losses a hostile line causes, and those come at once, never after the grace.
QUIET_GRACE = 30 * mesh.HEARTBEAT


def _running(token: str | None = TOKEN, workers: int = 1):
    """A hub past its rendezvous with `workers` real links; (hub, its events, head reporter,
    links, the links' events)."""
    rv = mesh.Rendezvous("r", "127.0.0.1", _free_port(), workers=workers)
    events: queue.Queue = queue.Queue()
    head = _reporter("head")
    hub = mesh.Hub(rv, mesh.Peer("127.0.0.1", "h"), QUIET_GRACE, token, head, events)
    hub.status = lambda: {"run": "r"}
    # The head's own answer to `logs`: its training log read from the offset asked.
    log = tempfile.NamedTemporaryFile(prefix="training-", suffix=".log", delete=False)
    log.write(b"step 1\n")
    log.close()
    hub.logs = functools.partial(supervisor.HeadSupervisor.logs, SimpleNamespace(
        log_path=Path(log.name), phase=GangPhase.RUNNING, step_name="training"))
    joining = []
    for i in range(workers):
        link_events: queue.Queue = queue.Queue()
        link = mesh.Link(rv, mesh.Peer(f"10.0.0.{i + 2}", f"w{i}"), QUIET_GRACE, token,
                         _reporter("worker"), link_events)
        outcome: list = []
        thread = threading.Thread(target=lambda link=link, outcome=outcome: outcome.append(
            link.join(time.monotonic() + 30, 30, None, time.sleep)), daemon=True)
        thread.start()
        joining.append((thread, link, outcome, link_events))
    hub.gather(30, lambda: None)
    hub.start(lambda m: {"rank": m.rank, "nodes": workers + 1, "head": "h", "step": "t"})
    for thread, *_ in joining:
        thread.join(30)
    return hub, events, head, [j[1] for j in joining], [j[3] for j in joining]


def _send(port: int, *lines: bytes, read: bool = True) -> bytes:
    """Connect as a stranger, send the lines, and read until the head closes (what it said)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.settimeout(10)
        s.sendall(b"".join(lines))
        if not read:
            return b""
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def _still_serving(hub: mesh.Hub) -> None:
    wire, answer = mesh.ask("127.0.0.1", hub.rv.port, {"ask": "status"}, TOKEN, 10)
    wire.close()
    assert answer == {"run": "r"}


def _quiet(events: queue.Queue, seconds: float = 2.0) -> None:
    """Nothing reached the run (no worker lost, no stop) for a while: a hostile line's harm
    would show at once."""
    with pytest.raises(queue.Empty):
        events.get(timeout=seconds)


HOSTILE_FIRST_LINES = [
    pytest.param(b'{"ask": "stop", "token": "\\ud800"}\n', id="lone-surrogate-token"),
    pytest.param(b'{"ask": "stop", "token": 7}\n', id="token-not-text"),
    pytest.param(b'{"ask": "logs", "offset": ' + str(10**30).encode() + b', "token": "s3cret"}\n',
                 id="huge-offset-with-token"),
    pytest.param(b'{"ask": "logs", "offset": -1, "token": "s3cret"}\n', id="negative-offset"),
    pytest.param(b'{"hello": {"addr": "10.0.0.9", "rank": 1e400}, "token": "s3cret"}\n',
                 id="infinite-rank-with-token"),
    pytest.param(b'{"hello": {"addr": ["x"]}, "token": "s3cret"}\n', id="addr-not-text"),
    pytest.param(b"[" * 10_000 + b"\n", id="deep-nesting"),
    pytest.param(b'{"x": ' + b"9" * 5000 + b"}\n", id="huge-number"),
    pytest.param(b"\xff\xfe\x00garbage\n", id="not-utf8"),
    pytest.param(b'"just a string"\n', id="not-an-object"),
    pytest.param(b'{"ask": "rm -rf", "token": "s3cret"}\n', id="unknown-question"),
    pytest.param(b'{"token": "s3cret"}\n', id="neither-hello-nor-ask"),
]


@pytest.mark.parametrize("first", HOSTILE_FIRST_LINES)
def test_a_hostile_first_line_while_the_run_goes_on_costs_only_its_connection(first):
    hub, events, head, links, link_events = _running()
    try:
        said = _send(hub.rv.port, first)
        assert said.startswith(b'{"rendezvous": "r"}\n')  # greeted, then dropped
        assert b"stopping" not in said and b'"run"' not in said
        _quiet(events)
        _quiet(link_events[0], 0)
        _still_serving(hub)
        assert "supervisor port: dropped a connection from 127.0.0.1" in head.stream.getvalue()
    finally:
        for link in links:
            link.close()
        hub.close()


@pytest.mark.parametrize("first", [
    pytest.param(b'{"ask": "stop", "token": "\\ud800"}\n', id="lone-surrogate-token"),
    pytest.param(b'{"hello": {"addr": "10.0.0.7", "rank": 1e400}, "token": "s3cret"}\n',
                 id="infinite-rank-with-token"),
    pytest.param(b'{"hello": {"addr": "10.0.0.7", "rank": 9}, "token": "s3cret"}\n',
                 id="rank-past-the-workers"),
])
def test_a_hostile_line_during_the_rendezvous_leaves_it_to_form(first):
    rv = mesh.Rendezvous("r", "127.0.0.1", _free_port(), workers=1)
    events: queue.Queue = queue.Queue()
    hub = mesh.Hub(rv, mesh.Peer("127.0.0.1", "h"), GRACE, TOKEN, _reporter("head"), events)

    link = mesh.Link(rv, mesh.Peer("10.0.0.2", "w"), GRACE, TOKEN, _reporter("worker"),
                     queue.Queue())
    outcome: list = []

    def strangers_then_the_worker() -> None:
        wait_for(lambda: _send(rv.port, first), timeout=30, what="the rendezvous to listen",
                 ignore=(ConnectionRefusedError,))
        outcome.append(link.join(time.monotonic() + 30, 30, None, time.sleep))

    joiner = threading.Thread(target=strangers_then_the_worker, daemon=True)
    joiner.start()
    try:
        members = hub.gather(30, lambda: None)
        hub.start(lambda m: {"rank": m.rank})
        joiner.join(30)
        assert [m.peer.addr for m in members] == ["10.0.0.2"]
        assert outcome == [{"rank": 1}]
    finally:
        link.close()
        hub.close()


def test_strangers_that_never_finish_a_line_are_bounded_and_dropped_in_time():
    hub, events, head, links, _ = _running()
    held: list[socket.socket] = []
    try:
        big = socket.create_connection(("127.0.0.1", hub.rv.port), timeout=10)
        with pytest.raises(OSError):  # past the first line's limit: dropped at once
            for _ in range(64):
                big.sendall(b"x" * 4096)
                time.sleep(0.01)
        big.close()
        for _ in range(40):  # from one address: most are refused at once
            s = socket.create_connection(("127.0.0.1", hub.rv.port), timeout=10)
            s.sendall(b'{"ask": "sta')  # never a whole line
            held.append(s)
        wait_for(lambda: len(hub.door.strangers) == mesh.MAX_STRANGERS_PER_ADDR, timeout=10,
                 what="the hub to hold as many strangers as it allows")
        wait_for(lambda: not hub.door.strangers, timeout=mesh.FIRST_LINE_TIMEOUT + 5,
                 what="the strangers to be dropped")
        for s in held:
            _assert_closed(s)
        _quiet(events, 0.5)
        _still_serving(hub)
        log = head.stream.getvalue()
        assert f"no first line within {mesh.FIRST_LINE_TIMEOUT:g} s" in log
        assert f"a line longer than {mesh.FIRST_LINE_LIMIT} bytes" in log
        assert log.count("too many connections") == 1  # said once
    finally:
        for s in held:
            s.close()
        for link in links:
            link.close()
        hub.close()


def _assert_closed(sock: socket.socket) -> None:
    """The head closed this stranger's connection (after its greeting, if any)."""
    sock.settimeout(1)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        return
    assert data in (b"", b'{"rendezvous": "r"}\n'), data


def test_a_workers_line_too_long_is_an_error_of_its_own():
    hub, events, _, links, _ = _running(token=None)
    try:
        links[0].wire.sock.sendall(b'{"done": {"step": "t", "rc": 0, "reports": ["'
                                   + b"x" * (mesh.LINE_LIMIT + 10) + b'"]}}\n')
        lost = _next(events)
        assert isinstance(lost, mesh.Lost)
        assert lost.why == f"its connection sent a line longer than {mesh.LINE_LIMIT} bytes"
    finally:
        for link in links:
            link.close()
        hub.close()


def test_a_workers_malformed_done_is_that_workers_fault_never_a_crash():
    hub, events, _, links, _ = _running(token=None, workers=2)
    try:
        links[0].wire.sock.sendall(b'{"done": {"step": "t", "rc": 1e400}}\n')
        lost = _next(events)
        assert isinstance(lost, mesh.Lost) and lost.peer.addr == "10.0.0.2"
        assert "a malformed line (rc must be a whole number" in lost.why
        links[1].send({"done": {"step": "t", "rc": 0, "reports": [{"rank": 1}]}})
        assert _next(events) == mesh.Done(mesh.Peer("10.0.0.3", "w1"), "t", 0, ({"rank": 1},))
    finally:
        for link in links:
            link.close()
        hub.close()


def test_an_end_in_the_same_read_as_the_go_is_heard():
    """The head's go and its end (a stop during the rendezvous) arrive in one read."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]

        def head() -> None:
            conn, _ = server.accept()
            with conn:
                conn.sendall(b'{"rendezvous": "r"}\n')
                conn.makefile("rb").readline()  # the hello
                conn.sendall(json.dumps({"go": {"rank": 1}}).encode() + b"\n"
                             + json.dumps({"end": {"kind": "stopped"}}).encode() + b"\n")
                time.sleep(3)

        threading.Thread(target=head, daemon=True).start()
        rv = mesh.Rendezvous("r", "127.0.0.1", port, workers=1)
        thread, link, outcome, link_events = _join(rv, "10.0.0.2")
        thread.join(30)
        try:
            assert outcome == [{"rank": 1}]
            assert _next(link_events, 5) == mesh.FromHead("end", {"kind": "stopped"})
        finally:
            link.close()


def test_a_refused_token_is_auth_refused_for_the_worker():
    rv = mesh.Rendezvous("r", "127.0.0.1", _free_port(), workers=1)
    hub = mesh.Hub(rv, mesh.Peer("127.0.0.1", "h"), GRACE, TOKEN, _reporter("head"),
                   queue.Queue())
    link = mesh.Link(rv, mesh.Peer("10.0.0.2", "w"), GRACE, "wrong", _reporter("worker"),
                     queue.Queue())
    outcome: list = []

    def join() -> None:
        try:
            link.join(time.monotonic() + 30, 30, None, time.sleep)
        except Exception as exc:  # the test looks at what it was
            outcome.append(exc)

    joiner = threading.Thread(target=join, daemon=True)
    joiner.start()
    try:
        hub.gather(2, lambda: None)
    except Exception:  # the rendezvous times out: the worker never counted
        pass
    finally:
        joiner.join(30)
        hub.close()
    assert len(outcome) == 1 and isinstance(outcome[0], AuthRefused), outcome
    assert "wrong or missing cluster token" in str(outcome[0])


@pytest.mark.parametrize(("message", "error"), [
    ({"hello": {"addr": "a", "rank": True}}, "rank must be a whole number"),
    ({"hello": {"addr": ""}}, "addr is empty"),
    ({"ask": "logs", "offset": 1.5}, "offset must be a whole number"),
    ({"done": {"step": "s", "rc": 0, "reports": [1]}}, "reports must be a list of objects"),
    ({"done": "x"}, "done must be an object"),
    ({"hi": 1}, "not a worker's message"),
])
def test_each_message_is_checked_in_one_place(message, error):
    parse = messages.first if ("hello" in message or "ask" in message) else messages.from_worker
    with pytest.raises(messages.Malformed, match=error):
        parse(message)


def test_tokens_compare_as_bytes_whatever_was_sent():
    assert messages.authorized("t", {"token": "t"})
    assert not messages.authorized("t", {"token": "\ud800"})
    assert not messages.authorized("t", {"token": None})
    assert not messages.authorized("t", {})
    assert messages.authorized(None, {"token": "\ud800"})
