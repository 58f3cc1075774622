"""The head's supervisor port and a worker's link, on real loopback sockets: who the rendezvous
counts, the deadline's line, machine ranks, and a peer found lost when its connection closes or
when it falls silent (a pod cut off sends nothing, not even a reset)."""

from __future__ import annotations

import io
import queue
import socket
import threading
import time

import pytest

from podagent import config
from podagent.errors import HeadUnreachable, InputError, WorkersTimeout
from podagent.gang import mesh
from podagent.gang.launchers import Layout, Torchrun
from podagent.platform.roles import Role
from podagent.report import Reporter
from tests.harness.pods import wait_for

GRACE = 1.0  # seconds of silence that make a peer lost, short for the tests that wait for it
# The rest never wait for a silence, and a loaded machine may starve a thread for seconds: a
# peer heard from must not be lost while they look at something else.
CALM = 30.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _reporter(role: str) -> Reporter:
    return Reporter(role, "t", None, stream=io.StringIO())


def _hub(rv: mesh.Rendezvous, grace: float = CALM) -> tuple[mesh.Hub, queue.Queue, Reporter]:
    events: queue.Queue = queue.Queue()
    reporter = _reporter("head")
    return mesh.Hub(rv, mesh.Peer("127.0.0.1", "h"), grace, None, reporter, events), events, \
        reporter


def _join(rv: mesh.Rendezvous, addr: str, asked: int | None = None, grace: float = CALM):
    """A worker joining in a thread: (thread, its link, [its go or its error])."""
    events: queue.Queue = queue.Queue()
    link = mesh.Link(rv, mesh.Peer(addr, f"pod-{addr}"), grace, None, _reporter("worker"),
                     events)
    outcome: list = []

    def join() -> None:
        try:
            outcome.append(link.join(time.monotonic() + 30, 30, asked, time.sleep))
        except Exception as exc:  # the test looks at what it was
            outcome.append(exc)

    thread = threading.Thread(target=join, daemon=True)
    thread.start()
    return thread, link, outcome, events


def _next(events: queue.Queue, timeout: float = 10.0):
    return events.get(timeout=timeout)


def test_all_workers_came_each_gets_its_machine_rank_and_the_head_its_go():
    rv = mesh.Rendezvous("r", "127.0.0.1", _free_port(), workers=2)
    hub, _, _ = _hub(rv)
    joining = [_join(rv, "10.0.0.3", asked=None), _join(rv, "10.0.0.2", asked=2)]
    try:
        members = hub.gather(30, lambda: None)
        hub.start(lambda m: {"rank": m.rank, "nodes": 3, "head": "h", "step": "training"})
        for thread, _, _, _ in joining:
            thread.join(30)
        # The rank a worker asked for is kept; the other fills the free one.
        assert {m.peer.addr: m.rank for m in members} == {"10.0.0.2": 2, "10.0.0.3": 1}
        assert [outcome[0]["rank"] for _, _, outcome, _ in joining] == [1, 2]
    finally:
        for _, link, _, _ in joining:
            link.close()
        hub.close()


def test_a_stranger_and_a_worker_that_left_are_not_counted_and_the_line_names_who_came():
    rv = mesh.Rendezvous("r", "127.0.0.1", _free_port(), workers=3)
    hub, _, head = _hub(rv)
    stayed, _link, outcome, _ = _join(rv, "10.0.0.2")

    def connect() -> socket.socket:
        return wait_for(lambda: socket.create_connection(("127.0.0.1", rv.port), timeout=30),
                        timeout=30, what="the head's rendezvous to listen",
                        ignore=(ConnectionRefusedError,))

    def stranger_and_leaver() -> None:
        with connect() as s:
            s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        with connect() as s:  # a worker that says hello and dies
            assert b'"rendezvous": "r"' in s.makefile("rb").readline()
            s.sendall(b'{"hello": {"addr": "10.0.0.9", "pod": "gone"}}\n')
            wait_for(lambda: "10.0.0.9" in head.stream.getvalue(), timeout=30,
                     what="the head to count the leaver")

    others = threading.Thread(target=stranger_and_leaver, daemon=True)
    others.start()
    try:
        with pytest.raises(WorkersTimeout) as caught:
            hub.gather(3, lambda: None)
    finally:
        hub.close()
    line = (f"rendezvous r at 127.0.0.1:{rv.port}: 2 of 4 nodes joined within 3 s (head "
            "127.0.0.1 (h), worker 10.0.0.2 (pod-10.0.0.2)); missing: 2 workers "
            "(EXPECTED_WORKERS=3)")
    assert str(caught.value) == line
    assert f"worker 10.0.0.9 (gone) left the {rv} before it started" in head.stream.getvalue()
    stayed.join(30)
    assert [str(e) for e in outcome] == [f"the head gave up: {line}"]


def test_two_workers_asking_for_one_rank_is_bad_input_for_everyone():
    rv = mesh.Rendezvous("r", "127.0.0.1", _free_port(), workers=2)
    hub, _, _ = _hub(rv)
    joining = [_join(rv, "10.0.0.2", asked=1), _join(rv, "10.0.0.3", asked=1)]
    try:
        with pytest.raises(InputError, match="both asked for machine rank 1"):
            hub.gather(30, lambda: None)
    finally:
        hub.close()
    for thread, _, outcome, _ in joining:
        thread.join(30)
        assert isinstance(outcome[0], InputError)


def test_machine_ranks_keep_what_was_asked_and_fill_the_rest_by_pod_name():
    a, b, c = (mesh.Peer(f"10.0.0.{i}", name) for i, name in ((2, "zz"), (3, "aa"), (4, "mm")))
    assert mesh.machine_ranks([(a, None), (b, None), (c, 1)]) == {c: 1, b: 2, a: 3}


def test_fewer_workers_will_do_down_to_the_minimum_ranked_among_themselves():
    """PODAGENT_MIN_WORKERS: one of three came; a rank asked beyond the nodes that came is
    given a free one, so the ranks are 1..N of the nodes there."""
    rv = mesh.Rendezvous("r", "127.0.0.1", _free_port(), workers=3)
    hub, _, head = _hub(rv)
    joining = [_join(rv, "10.0.0.2", asked=3)]
    try:
        members = hub.gather(2, lambda: None, minimum=1)
        assert [(m.peer.addr, m.rank) for m in members] == [("10.0.0.2", 1)]
        assert ("1 of 3 workers joined (10.0.0.2 (pod-10.0.0.2)); going on because "
                "PODAGENT_MIN_WORKERS=1") in head.stream.getvalue()
    finally:
        for _, link, _, _ in joining:
            link.close()
        hub.close()


def test_fewer_workers_than_the_minimum_is_the_rendezvous_timeout():
    rv = mesh.Rendezvous("r", "127.0.0.1", _free_port(), workers=3)
    hub, _, _ = _hub(rv)
    joining = [_join(rv, "10.0.0.2")]
    try:
        with pytest.raises(WorkersTimeout, match="2 of 4 nodes joined within 2 s"):
            hub.gather(2, lambda: None, minimum=2)
    finally:
        hub.close()
    joining[0][0].join(30)
    assert isinstance(joining[0][2][0], WorkersTimeout)


def test_a_worker_that_finds_something_else_on_the_port_says_so():
    with socket.create_server(("127.0.0.1", 0)) as other:
        def answer_as_another_program() -> None:
            conn, _ = other.accept()
            with conn:
                conn.sendall(b"SSH-2.0-other\r\n")
                conn.recv(1024)

        threading.Thread(target=answer_as_another_program, daemon=True).start()
        rv = mesh.Rendezvous("r", "127.0.0.1", other.getsockname()[1], workers=1)
        thread, _, outcome, _ = _join(rv, "10.0.0.2")
        thread.join(60)
    assert [str(e) for e in outcome] == [
        f"{rv}: what listens there is not podagent's supervisor"]


def test_a_worker_gives_up_on_a_head_that_never_answers_at_its_deadline():
    rv = mesh.Rendezvous("r", "127.0.0.1", _free_port(), workers=1)  # nothing listens there
    link = mesh.Link(rv, mesh.Peer("10.0.0.2", "w"), CALM, None, _reporter("worker"),
                     queue.Queue())
    with pytest.raises(HeadUnreachable) as caught:
        link.join(time.monotonic() + 1.5, 1.5, None, time.sleep)
    assert str(caught.value) == (f"{rv}: the head's podagent did not answer within 1.5 s "
                                 "(last try: Connection refused)")


def _running_pair(grace: float = CALM):
    rv = mesh.Rendezvous("r", "127.0.0.1", _free_port(), workers=1)
    hub, hub_events, _ = _hub(rv, grace)
    thread, link, outcome, link_events = _join(rv, "10.0.0.2", grace=grace)
    hub.gather(30, lambda: None)
    hub.start(lambda m: {"rank": m.rank, "nodes": 2, "head": "h", "step": "training"})
    thread.join(30)
    assert isinstance(outcome[0], dict), outcome
    return hub, hub_events, link, link_events


def test_a_worker_whose_podagent_dies_is_lost_at_once_and_a_silent_one_after_the_grace():
    hub, hub_events, link, _ = _running_pair()
    try:
        link.close()  # its podagent gone: the connection closes
        lost = _next(hub_events)
        assert isinstance(lost, mesh.Lost) and "connection closed" in lost.why
    finally:
        hub.close()
    hub, hub_events, link, _ = _running_pair(GRACE)
    try:
        link._closed.set()  # it stops beating but keeps the connection: as if cut off
        lost = _next(hub_events)
        assert isinstance(lost, mesh.Lost)
        assert lost.why.startswith(f"silent for {GRACE:g} s"), lost.why
        assert lost.peer == mesh.Peer("10.0.0.2", "pod-10.0.0.2")
    finally:
        link.close()
        hub.close()


def test_a_worker_hears_its_heads_end_and_finds_a_silent_head_lost():
    hub, _, link, link_events = _running_pair()
    try:
        hub.end({"kind": "stopped", "pod": "someone"})
        heard = _next(link_events)
        assert heard == mesh.FromHead("end", {"kind": "stopped", "pod": "someone"})
    finally:
        link.close()
        hub.close()
    hub, _, link, link_events = _running_pair(GRACE)
    try:
        hub._closed.set()  # the head's loop stops beating; its socket stays open
        lost = _next(link_events)
        assert isinstance(lost, mesh.Lost) and lost.why.startswith(f"silent for {GRACE:g} s")
    finally:
        link.close()
        hub.close()


def test_a_question_needs_the_cluster_token_when_there_is_one():
    rv = mesh.Rendezvous("r", "127.0.0.1", _free_port(), workers=0)
    hub = mesh.Hub(rv, mesh.Peer("127.0.0.1", "h"), CALM, "s3cret", _reporter("head"),
                   queue.Queue())
    hub.status = lambda: {"run": "r"}
    hub.start(lambda m: {})
    try:
        with pytest.raises(Exception, match="wrong or missing cluster token"):
            mesh.ask("127.0.0.1", rv.port, {"ask": "status"}, None, 10)
        wire, answer = mesh.ask("127.0.0.1", rv.port, {"ask": "status"}, "s3cret", 10)
        wire.close()
        assert answer == {"run": "r"}
    finally:
        hub.close()


def test_torchruns_own_join_deadline_follows_the_wait_settings():
    s = config.build({}, {"PODAGENT_WORKER_TIMEOUT": "42.5", "PODAGENT_HEAD_TIMEOUT": "7"})
    launcher = Torchrun(["--", "t.py", "--lr", "1"])  # options and all: test_cli's dry run
    assert launcher.options == ()
    assert launcher.script == ("t.py", "--lr", "1")

    def argv(role: Role, wait: float) -> tuple[str, ...]:
        layout = Layout(role, 2, 0, "10.0.0.1", "10.0.0.1", 29500, 0, 1, "r", wait)
        return launcher.step("training", layout, launcher.script, {}).argv

    assert "is_host=1,join_timeout=43" in argv(Role.HEAD, s.worker_timeout)
    assert "is_host=0,join_timeout=7" in argv(Role.WORKER, s.head_timeout)
    assert argv(Role.HEAD, 1)[-5:] == ("--local-addr", "10.0.0.1", "t.py", "--lr", "1")


def test_a_worker_arriving_after_the_start_waits_for_the_heads_next_rendezvous():
    """A replacement pod that comes before the head noticed the pod it replaces: it neither
    leaves (a crash loop at RunPod, the run a worker short) nor counts; the head's next start
    (its container started again) holds a new rendezvous, which it joins."""
    hub, _, link, _ = _running_pair()
    late = mesh.Link(hub.rv, mesh.Peer("10.0.0.9", "late"), CALM, None, _reporter("worker"),
                     queue.Queue())
    outcome: list = []
    joiner = threading.Thread(target=lambda: outcome.append(
        late.join(time.monotonic() + 60, 60, None, time.sleep)), daemon=True)
    joiner.start()
    try:
        wait_for(lambda: "started without this pod" in late.reporter.stream.getvalue(),
                 timeout=30, what="the late worker to hear that the run has started")
        assert not outcome and "10.0.0.9" not in hub.members
    finally:
        link.close()
        hub.close()  # this start of the head ends
    again, _, _ = _hub(mesh.Rendezvous("r", "127.0.0.1", hub.rv.port, workers=1))
    try:
        members = again.gather(30, lambda: None)
        again.start(lambda m: {"rank": m.rank})
        joiner.join(30)
        assert [m.peer.addr for m in members] == ["10.0.0.9"] and outcome == [{"rank": 1}]
    finally:
        late.close()
        again.close()
