"""podagent's rendezvous before torchrun, on real loopback sockets: who is counted, what the
deadline's line says, and what the workers that came are told."""

from __future__ import annotations

import io
import socket
import threading
import time

import pytest

from podagent import config
from podagent.cluster import torchrun
from podagent.cluster.torchrun import LINE_LIMIT
from podagent.errors import WorkersTimeout
from podagent.platform.roles import Role
from podagent.report import Reporter
from tests.harness.pods import wait_for


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _reporter(role: str) -> Reporter:
    return Reporter(role, "t", None, stream=io.StringIO())


def _worker(rv: torchrun.Rendezvous, addr: str, outcome: list[BaseException | None]) -> None:
    try:
        torchrun.join_head(rv, torchrun.Peer(addr, f"pod-{addr}"), time.monotonic() + 30, 30,
                           _reporter("worker"), time.sleep)
        outcome.append(None)
    except Exception as exc:  # the test looks at what it was
        outcome.append(exc)


def _start_worker(rv, addr) -> tuple[threading.Thread, list[BaseException | None]]:
    outcome: list[BaseException | None] = []
    thread = threading.Thread(target=_worker, args=(rv, addr, outcome), daemon=True)
    thread.start()
    return thread, outcome


def test_all_workers_came_everyone_goes():
    rv = torchrun.Rendezvous("r", "127.0.0.1", _free_port(), workers=2)
    threads = [_start_worker(rv, addr) for addr in ("10.0.0.2", "10.0.0.3")]
    came = torchrun.gather_workers(rv, torchrun.Peer("10.0.0.1", "h"), 30, _reporter("head"))
    assert sorted(p.addr for p in came) == ["10.0.0.2", "10.0.0.3"]
    for thread, outcome in threads:
        thread.join(30)
        assert outcome == [None]


def test_a_stranger_and_a_worker_that_left_are_not_counted_and_the_line_names_who_came():
    rv = torchrun.Rendezvous("r", "127.0.0.1", _free_port(), workers=3)
    stayed, outcome = _start_worker(rv, "10.0.0.2")

    def connect() -> socket.socket:
        return wait_for(lambda: socket.create_connection(("127.0.0.1", rv.port), timeout=30),
                        timeout=30, what="the head's rendezvous to listen",
                        ignore=(ConnectionRefusedError,))

    def stranger_and_leaver() -> None:
        with connect() as s:
            s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        with connect() as s:  # a worker that says hello and dies
            assert b'"rendezvous": "r"' in s.makefile("rb").readline()
            s.sendall(b'{"addr": "10.0.0.9", "pod": "gone"}\n')

    others = threading.Thread(target=stranger_and_leaver, daemon=True)
    others.start()
    head = _reporter("head")
    with pytest.raises(WorkersTimeout) as caught:
        torchrun.gather_workers(rv, torchrun.Peer("10.0.0.1", "h"), 3, head)
    line = (f"rendezvous r at 127.0.0.1:{rv.port}: 2 of 4 nodes joined within 3 s (head 10.0.0.1 "
            "(h), worker 10.0.0.2 (pod-10.0.0.2)); missing: 2 workers (EXPECTED_WORKERS=3)")
    assert str(caught.value) == line
    assert f"worker 10.0.0.9 (gone) left the {rv} before it started" in head.stream.getvalue()
    stayed.join(30)
    assert [str(e) for e in outcome] == [f"the head gave up: {line}"]


def test_a_worker_that_finds_something_else_on_the_port_says_so():
    with socket.create_server(("127.0.0.1", 0)) as other:
        def answer_as_another_program() -> None:
            conn, _ = other.accept()
            with conn:
                conn.sendall(b"SSH-2.0-other\r\n")
                conn.recv(LINE_LIMIT)

        threading.Thread(target=answer_as_another_program, daemon=True).start()
        rv = torchrun.Rendezvous("r", "127.0.0.1", other.getsockname()[1], workers=1)
        thread, outcome = _start_worker(rv, "10.0.0.2")
        thread.join(60)
    assert [str(e) for e in outcome] == [
        f"{rv}: what listens there is not podagent's rendezvous (torchrun may already run "
        "there: has the run started without this pod?)"]


def test_torchruns_own_join_deadline_follows_the_wait_settings():
    s = config.build({}, {"PODAGENT_WORKER_TIMEOUT": "42.5", "PODAGENT_HEAD_TIMEOUT": "7"})
    head = torchrun.plan(s, Role.HEAD, "10.0.0.1", "10.0.0.1", 0, {}, ("t.py",))
    worker = torchrun.plan(s, Role.WORKER, "10.0.0.2", "10.0.0.1", 0, {}, ("t.py",))
    assert "is_host=1,join_timeout=43" in head.argv
    assert "is_host=0,join_timeout=7" in worker.argv
