"""A protocol fuzz of the supervisor port: random and mutated lines, with the cluster token and
without, sent while the rendezvous waits and while the run goes on. None of them changes the
run (no worker lost, no stop, the rendezvous forms with its real workers) unless it carries the
token and a valid request; the head's memory for strangers stays within its limits."""

from __future__ import annotations

import json
import queue
import socket
import threading
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from podagent.gang import mesh, messages
from tests.unit.gang.test_mesh import _free_port, _reporter
from tests.unit.gang.test_mesh_hostile import QUIET_GRACE, TOKEN, _running

EXAMPLES = 300

_scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(10**40),
                                                           max_value=10**40),
                     st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40))
_values = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)
_tokens = st.one_of(st.just(TOKEN), st.just(None), st.text(max_size=12),
                    st.just("\ud800"), _scalars)


@st.composite
def _messages(draw) -> dict:
    """A podagent message with its fields mutated (wrong types, odd values, missing parts)."""
    kind = draw(st.sampled_from(["hello", "ask", "done", "leaving", "beat", "other"]))
    if kind == "hello":
        body = {"addr": draw(st.one_of(st.just("10.0.0.99"), _values)),
                "pod": draw(st.one_of(st.just("p"), _values)),
                "rank": draw(st.one_of(st.none(), st.integers(0, 3), _scalars))}
        message: dict = {"hello": draw(st.one_of(st.just(body), _values))}
    elif kind == "ask":
        message = {"ask": draw(st.one_of(st.sampled_from(["status", "logs", "stop"]),
                                         _values)),
                   "offset": draw(st.one_of(st.integers(0, 10**6), _values)),
                   "by": draw(st.one_of(st.text(max_size=10), _values))}
    elif kind == "done":
        message = {"done": draw(st.one_of(st.fixed_dictionaries(
            {"step": _values, "rc": _values, "reports": _values}), _values))}
    elif kind == "leaving":
        message = {"leaving": draw(_values)}
    elif kind == "beat":
        message = {"beat": draw(_values)}
    else:
        message = draw(st.dictionaries(st.text(max_size=8), _values, max_size=4))
    token = draw(_tokens)
    if token is not None:
        message["token"] = token
    return message


def _encoded(message: dict) -> bytes:
    return json.dumps(message, allow_nan=True).encode("utf-8", "surrogatepass") + b"\n"


_lines = st.one_of(
    _messages().map(_encoded),
    st.binary(max_size=300),  # bytes of anything, a newline or not
    st.binary(max_size=300).map(lambda b: b + b"\n"),
    _values.map(lambda v: json.dumps(v).encode() + b"\n"),
)


def _valid_with_token(raw: bytes) -> bool:
    """A line that may change the run: the token and a request the head accepts."""
    try:
        message = messages.decode(raw.rstrip(b"\n"))
        if not messages.authorized(TOKEN, message):
            return False
        first = messages.first(message)
    except messages.Malformed:
        return False
    return (isinstance(first, messages.Ask) and first.what == "stop") or isinstance(
        first, messages.Hello)


def _send(port: int, lines: list[bytes]) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.settimeout(2)
        try:
            s.sendall(b"".join(lines))
            s.shutdown(socket.SHUT_WR)
            while s.recv(65536):
                pass
        except OSError:
            pass  # the head dropped it, as it may


def test_fuzzed_lines_while_the_run_goes_on_change_nothing():
    hub, events, _, links, link_events = _running(workers=1)
    seen = {"changed": 0}
    try:
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(st.lists(_lines, min_size=1, max_size=4))
        def one(lines: list[bytes]) -> None:
            _send(hub.rv.port, lines)
            if _valid_with_token(lines[0].split(b"\n")[0] + b"\n"):
                seen["changed"] += 1
                while not events.empty():  # a stop asked with the token: allowed
                    assert isinstance(events.get_nowait(), mesh.StopAsked)
                return
            assert events.empty(), events.get_nowait()
            assert link_events[0].empty()
            assert hub.members["10.0.0.2"].state == "running"
            # Strangers are held within their limits (count and bytes).
            assert len(hub.door.strangers) <= mesh.MAX_STRANGERS
            assert all(len(s.wire._buf) <= mesh.FIRST_LINE_LIMIT
                       for s in hub.door.strangers.values())

        one()
        wire, answer = mesh.ask("127.0.0.1", hub.rv.port, {"ask": "status"}, TOKEN, 10)
        wire.close()
        assert answer == {"run": "r"}
        assert hub.members["10.0.0.2"].state == "running"
    finally:
        for link in links:
            link.close()
        hub.close()


def test_fuzzed_lines_during_the_rendezvous_leave_it_to_its_real_workers():
    rv = mesh.Rendezvous("r", "127.0.0.1", _free_port(), workers=1)
    events: queue.Queue = queue.Queue()
    hub = mesh.Hub(rv, mesh.Peer("127.0.0.1", "h"), QUIET_GRACE, TOKEN, _reporter("head"),
                   events)
    formed: list = []
    gathering = threading.Thread(target=lambda: formed.append(hub.gather(120, lambda: None)),
                                 daemon=True)
    gathering.start()
    try:
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(st.lists(_lines, min_size=1, max_size=4))
        def one(lines: list[bytes]) -> None:
            if _valid_with_token(lines[0].split(b"\n")[0] + b"\n"):
                return  # a real hello or stop with the token: it would count
            _send(rv.port, lines)
            assert not formed and not hub.members and events.empty()

        one()
        link = mesh.Link(rv, mesh.Peer("10.0.0.2", "w"), QUIET_GRACE, TOKEN,
                         _reporter("worker"), queue.Queue())
        go = link.join
        joined: list = []
        joiner = threading.Thread(target=lambda: joined.append(
            go(time.monotonic() + 30, 30, None, time.sleep)), daemon=True)
        joiner.start()
        gathering.join(60)
        hub.start(lambda m: {"rank": m.rank})
        joiner.join(30)
        assert [m.peer.addr for m in formed[0]] == ["10.0.0.2"]
        assert joined == [{"rank": 1}]
        link.close()
    finally:
        hub.close()
