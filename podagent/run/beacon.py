"""The head's word that its run is over, for the workers that were not there to hear it.

A worker down when its head closed the run (its container being started again, its pod stopped
and started) comes back to a head with nothing left to join: it would wait for it, time out,
exit, and RunPod would start it again, and again. So once a run is over, and until its pod
stops, the head answers every connection on its supervisor port (PODAGENT_SUPERVISOR_PORT, the
port runs without Ray rendezvous on, free once a run is over) with one JSON line,
{"over": {"run", "outcome", "code", "after_run", "proof"}}, and closes it. Workers ask while
they look for their head. With a cluster token the proof is an HMAC of the rest under it, so
that no stranger on the network can tell a worker its run is over; without one the pods'
private network is the only guard, as for everything else then.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import selectors
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from podagent.choices import AfterRun
from podagent.wire import Event

if TYPE_CHECKING:
    from podagent.report import Reporter

ANSWER_LIMIT = 4096  # bytes of an answer a worker reads: the line is short
TICK = 0.25


@dataclass(frozen=True)
class Over:
    run: str
    outcome: str
    code: int
    after_run: str

    def fields(self) -> dict[str, Any]:
        return {"run": self.run, "outcome": self.outcome, "code": self.code,
                "after_run": self.after_run}

    def heard(self, reporter: Reporter, head: str, settings_after_run: AfterRun) -> AfterRun:
        """A worker that was away when its head closed the run heard this: said once, and what
        the pod does next, as the head asked (a policy this podagent does not know: its own)."""
        reporter.say(f"the head {head} says run {self.run} is over ({self.outcome}, exit "
                     f"{self.code}): this pod was away when it closed; leaving")
        reporter.event(Event.RUN_OVER, outcome=self.outcome, code=self.code)
        try:
            return AfterRun(self.after_run)
        except ValueError:
            return settings_after_run

    def proof(self, token: str | None) -> str:
        if not token:
            return ""
        text = json.dumps(self.fields(), sort_keys=True).encode()
        return hmac.new(token.encode(), b"podagent-over\n" + text, hashlib.sha256).hexdigest()


class Beacon:
    """Answers "over" on (addr, port) in a thread of its own until stopped (or the process
    ends). `asked` holds the addresses that asked, so a head can stop waiting for them."""

    def __init__(self, over: Over, addr: str, port: int, token: str | None):
        self.over, self.addr, self.port = over, addr, port
        self._line = (json.dumps({"over": {**over.fields(), "proof": over.proof(token)}})
                      + "\n").encode()
        self.asked: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> Beacon | None:
        """Listening, or None when the port cannot be had (said by the caller)."""
        try:
            self._listener = socket.create_server((self.addr, self.port))
        except OSError:
            return None
        self._thread = threading.Thread(target=self._serve, name="podagent-over", daemon=True)
        self._thread.start()
        return self

    def heard_from(self) -> set[str]:
        with self._lock:
            return set(self.asked)

    def _serve(self) -> None:
        assert self._listener is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self._listener, selectors.EVENT_READ)
            while not self._stop.is_set():
                if not sel.select(TICK):
                    continue
                with contextlib.suppress(OSError):
                    conn, (peer, *_rest) = self._listener.accept()
                    with self._lock:
                        self.asked.add(peer)
                    with conn:
                        # Only this line goes out, whoever asks: nothing is read from them.
                        conn.settimeout(1.0)
                        conn.sendall(self._line)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * TICK)
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.close()


def ask(head_ip: str, port: int, run: str, token: str | None,
        timeout: float = 2.0) -> Over | None:
    """The head's word that run `run` is over, when it says so (and, with a token, proves it);
    None otherwise: nothing listens, something else answers (a live run's supervisor), or the
    word is for another run or not proven."""
    try:
        with socket.create_connection((head_ip, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            data = b""
            ends = time.monotonic() + timeout
            while b"\n" not in data and len(data) < ANSWER_LIMIT and time.monotonic() < ends:
                chunk = sock.recv(ANSWER_LIMIT)
                if not chunk:
                    break
                data += chunk
    except OSError:
        return None
    return read(data.split(b"\n", 1)[0], run, token)


def read(raw: bytes, run: str, token: str | None) -> Over | None:
    """One line as a head's "over" for `run`, or None."""
    try:
        message = json.loads(raw)
    except ValueError:
        return None
    body = message.get("over") if isinstance(message, dict) else None
    if not isinstance(body, Mapping):
        return None
    code = body.get("code")
    if not (isinstance(code, int) and not isinstance(code, bool) and 0 <= code < 256):
        return None
    over = Over(str(body.get("run", "")), str(body.get("outcome", ""))[:100], code,
                str(body.get("after_run", "")))
    if over.run != run:
        return None
    if token and not hmac.compare_digest(str(body.get("proof", "")).encode(errors="replace"),
                                         over.proof(token).encode()):
        return None
    return over
