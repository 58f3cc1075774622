"""The head's supervisor port and each worker's connection to it, for a run without Ray.

One TCP connection per worker for the whole run, carrying JSON lines:

* the rendezvous before the launcher starts: the head greets ({"rendezvous": id}), the worker
  says hello ({"hello": {addr, pod, rank}}), and once every expected worker came (or the head's
  wait ran out) the head answers each one ({"go": {...}} with its machine rank, or
  {"error": line, "kind": class});
* then heartbeats both ways every HEARTBEAT seconds ({"beat": 1}, a worker's with the seconds
  since its training last made progress: "quiet"); any line counts. A peer silent for
  PODAGENT_PEER_GRACE, or whose connection closed, is lost: a pod cut off sends no reset, so
  silence is the only sign of it;
* a worker's step results ({"done": {step, rc, reports}}), a worker leaving on a signal
  ({"leaving": why}), the head's next step ({"go": ...}) and the run's end ({"end": cause});
* on a hang, the head's {"dump": {"n"}} (each worker answers {"dumped": its stacks}) and, for a
  restart, {"halt": {"n"}} (each worker stops its training and reports it done).

`podagent status`, `stop` and `logs` from any pod connect to the same port and ask
({"ask": "status" | "stop" | "logs", ...}). With a cluster token every hello and question
carries it; the port is bound to the head's cluster-private address only.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import queue
import selectors
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from podagent import process
from podagent.errors import (
    AuthRefused,
    DeadlineReached,
    HeadUnreachable,
    InputError,
    PortInUse,
    WorkersTimeout,
)
from podagent.gang import messages
from podagent.report import Progress, Reporter
from podagent.run.workers import accept_shortfall
from podagent.waiting import Backoff, Deadline, Expired, NotYet, retry
from podagent.wire import MemberState

HEARTBEAT = 1.0  # seconds between heartbeats, both ways
LINE_LIMIT = 1 << 20  # bytes: a joined worker's line (its data-check reports are the longest)
# Until its token is checked a connection is a stranger's: its first line is short, comes soon,
# and few such connections are held at once (per address too: one host cannot crowd out all).
FIRST_LINE_LIMIT = 16 << 10
FIRST_LINE_TIMEOUT = 5.0
MAX_STRANGERS = 64
MAX_STRANGERS_PER_ADDR = 8
MAX_FAULTS_TOLD = 32  # kinds of fault and addresses said in the log, at most
CONNECT_TIMEOUT = 5.0  # one connection attempt to the head
GREETING_TIMEOUT = 10.0  # the head greets at once; this is for a head starved of CPU
TICK = 0.25  # the hub's loop wakes this often to beat and to look for silent workers
SEND_TIMEOUT = 5.0  # a send that blocks this long counts as a lost peer

STARTED_RETRY = 2.0  # seconds between a late worker's tries while the head's run goes on
STARTED = "started"  # the head's answer to a hello once its run has started


class _StartedWithout(Exception):
    """The head's run had started when this worker said hello, or its podagent closed the
    connection without an answer (ending that start): its next rendezvous is awaited."""


# The errors a head's answer may carry to its workers, by class name (one line each).
_ANSWER_ERRORS: dict[str, type[Exception]] = {"WorkersTimeout": WorkersTimeout,
                                              "InputError": InputError, "auth": AuthRefused,
                                              "DeadlineReached": DeadlineReached}


@dataclass(frozen=True)
class Peer:
    addr: str  # the address the other nodes reach it at
    pod: str

    def __str__(self) -> str:
        return f"{self.addr} ({self.pod})" if self.pod and self.pod != self.addr else self.addr


@dataclass(frozen=True)
class Rendezvous:
    rdzv_id: str
    head_ip: str
    port: int
    workers: int  # expected

    def __str__(self) -> str:
        return f"rendezvous {self.rdzv_id} at {self.head_ip}:{self.port}"


# --- what the hub and a link tell the supervisor (through its queue) --------------------------

@dataclass(frozen=True)
class Lost:
    peer: Peer
    why: str


@dataclass(frozen=True)
class Done:
    peer: Peer
    step: str
    rc: int
    reports: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True)
class StopAsked:
    by: str


@dataclass(frozen=True)
class Dumped:
    peer: Peer
    body: Mapping[str, Any]


@dataclass(frozen=True)
class FromHead:
    """A worker's message from its head (one of HEAD_SAYS): the next step ({"go"}), the run's
    end ({"end"}), a dump of its stacks ({"dump"}), a halt before a restart ({"halt"})."""
    kind: str
    body: Mapping[str, Any]


HEAD_SAYS = ("go", "end", "dump", "halt")
Event = Lost | Done | StopAsked | Dumped | FromHead


def watched(loop: Callable[[], None], events: queue.Queue[Event], peer: Peer,
            what: str) -> None:
    """A thread's loop; one that fails (a bug) ends the run rather than leave it unwatched."""
    try:
        loop()
    except Exception as exc:
        events.put(Lost(peer, f"{what} failed ({type(exc).__name__}: {exc})"))


def line(payload: Mapping[str, Any]) -> bytes:
    return json.dumps(payload).encode() + b"\n"


class Wire:
    """One connection: whole JSON lines out (under a lock: two threads send), lines in, none
    longer than `limit` bytes. Lines read but not yet taken wait in `unread`, in order."""

    def __init__(self, sock: socket.socket, limit: int = LINE_LIMIT):
        self.sock = sock
        self.limit = limit
        self.unread: collections.deque[Any] = collections.deque()
        self._buf = b""
        self._lock = threading.Lock()

    def send(self, payload: Mapping[str, Any]) -> bool:
        """False when the peer is gone (or its end stopped reading)."""
        data = line(payload)
        with self._lock:
            try:
                self.sock.settimeout(SEND_TIMEOUT)
                self.sock.sendall(data)
                return True
            except OSError:
                return False

    def feed(self) -> list[bytes] | None:
        """Read what is there (the socket is readable): the lines it completed; None when the
        connection ended. Raises messages.TooLong past the limit."""
        try:
            data = self.sock.recv(min(65536, self.limit + 1 - len(self._buf)) or 1)
        except (BlockingIOError, TimeoutError):
            return []
        except OSError:
            return None
        if not data:
            return None
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        if len(self._buf) > self.limit or any(len(raw) > self.limit for raw in lines):
            raise messages.TooLong(self.limit)
        return lines

    def messages(self) -> list[Any] | None:
        """feed, parsed for a reader that trusts the other end (a worker reading its head): a
        line that is no JSON object is None; a line too long ends the connection (None)."""
        try:
            lines = self.feed()
        except messages.TooLong:
            return None
        return None if lines is None else [_lenient(raw) for raw in lines]

    def next(self, timeout: float, check: Callable[[], None] = lambda: None) -> Any:
        """The next line (parsed as `messages` does; the ones after it stay in `unread`),
        None when the connection ended, TimeoutError (the class) when nothing came in time.
        `check` runs every TICK (a signal raises there)."""
        ends = time.monotonic() + timeout
        while not self.unread and (left := ends - time.monotonic()) > 0:
            check()
            self.sock.settimeout(min(TICK, left))
            lines = self.messages()
            if lines is None:
                return None
            self.unread.extend(lines)
        return self.unread.popleft() if self.unread else TimeoutError

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def _lenient(raw: bytes) -> dict[str, Any] | None:
    try:
        return messages.decode(raw)
    except messages.Malformed:
        return None


def listen(addr: str, port: int) -> socket.socket:
    try:
        return socket.create_server((addr, port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise PortInUse(port, addr, process.port_holder(port)) from None
        raise


def missing_line(rv: Rendezvous, head: Peer, joined: list[Peer], waited: float) -> str:
    came = [f"head {head}", *(f"worker {p}" for p in joined)]
    missing = rv.workers - len(joined)
    return (f"{rv}: {len(came)} of {rv.workers + 1} nodes joined within {waited:g} s "
            f"({', '.join(came)}); missing: {missing} worker{'s' if missing != 1 else ''} "
            f"(EXPECTED_WORKERS={rv.workers})")


def machine_ranks(workers: list[tuple[Peer, int | None]]) -> dict[Peer, int]:
    """Machine ranks for the workers (the head is 0): a rank a worker asked for (its NODE_RANK
    or its launcher's --machine_rank, already checked to be 1..N) is kept while the nodes that
    came have it, the others fill the free ranks in the order of their pod names. Two asking
    for one rank: InputError."""
    ranks: dict[Peer, int] = {}
    taken: dict[int, Peer] = {}
    for peer, asked in workers:
        if asked is None or asked > len(workers):  # fewer came (PODAGENT_MIN_WORKERS)
            continue
        if asked in taken:
            raise InputError(f"workers {taken[asked]} and {peer} both asked for machine rank "
                             f"{asked} (NODE_RANK or --machine_rank): every pod needs its own")
        ranks[peer], taken[asked] = asked, peer
    free = (r for r in range(1, len(workers) + 1) if r not in taken)
    for peer, _ in sorted(workers, key=lambda w: (w[0].pod, w[0].addr)):
        if peer not in ranks:
            ranks[peer] = next(free)
    return ranks


AT_WORK = (MemberState.RUNNING, MemberState.DONE)  # in the run: heard from, told its steps
GONE = (MemberState.LOST, MemberState.OUT)


@dataclass
class Member:
    """A worker as the head sees it."""
    peer: Peer
    wire: Wire
    asked_rank: int | None
    rank: int = 0
    last_seen: float = field(default_factory=time.monotonic)
    state: MemberState = MemberState.JOINED
    step: str = ""
    quiet: float | None = None  # seconds without progress, as of its last beat
    quiet_at: float = 0.0  # when that beat came

    def quiet_now(self, now: float) -> float | None:
        return None if self.quiet is None else self.quiet + (now - self.quiet_at)


@dataclass
class Stranger:
    """A connection whose first line (its token, then a hello or a question) has not come."""
    wire: Wire
    addr: str
    deadline: float  # monotonic: dropped when its first line has not come by then


class Door:
    """The head's listening socket and the connections on it: strangers until their first line
    (bounded in number per address and in all, in the bytes they may send, and in time),
    then the hub's; what is readable, and the faults said once."""

    def __init__(self, addr: str, port: int, greeting: Mapping[str, Any], reporter: Reporter):
        self.greeting, self.reporter = greeting, reporter
        self._listener = listen(addr, port)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ)
        self.strangers: dict[socket.socket, Stranger] = {}  # connected, no first line yet
        self._faults_told: set[tuple[str, str]] = set()

    def select(self, timeout: float) -> tuple[list[Wire], list[Stranger]]:
        """(the wires with something to read, the strangers whose first line is late)."""
        readable = []
        for key, _ in self._sel.select(timeout):
            if key.fileobj is self._listener:
                self._accept()
            else:
                readable.append(key.data)
        now = time.monotonic()
        return readable, [s for s in self.strangers.values() if now > s.deadline]

    def _accept(self) -> None:
        try:
            conn, where = self._listener.accept()
        except OSError:
            return
        addr = str(where[0])
        from_addr = sum(1 for s in self.strangers.values() if s.addr == addr)
        if len(self.strangers) >= MAX_STRANGERS or from_addr >= MAX_STRANGERS_PER_ADDR:
            with contextlib.suppress(OSError):
                conn.close()
            self.tell_fault(addr, f"too many connections not past their first line (at most "
                                  f"{MAX_STRANGERS_PER_ADDR} from one address, "
                                  f"{MAX_STRANGERS} in all)")
            return
        wire = Wire(conn, FIRST_LINE_LIMIT)
        self.strangers[conn] = Stranger(wire, addr, time.monotonic() + FIRST_LINE_TIMEOUT)
        self._sel.register(conn, selectors.EVENT_READ, wire)
        wire.send(self.greeting)
        conn.setblocking(False)

    def admit(self, wire: Wire) -> None:
        """Its token and first line are good: no longer a stranger."""
        del self.strangers[wire.sock]
        wire.limit = LINE_LIMIT

    def forget(self, wire: Wire) -> None:
        """No longer read (the connection is closed by whoever holds it)."""
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(wire.sock)
        self.strangers.pop(wire.sock, None)

    def tell_fault(self, who: str, why: str) -> None:
        """Said once for each address and kind of fault (its words before any detail), for
        the first MAX_FAULTS_TOLD of them: a flood of strangers does not flood the log."""
        told = (who, why.split(" (")[0])
        if told in self._faults_told or len(self._faults_told) > MAX_FAULTS_TOLD:
            return
        self._faults_told.add(told)
        more = (" (further faults of strangers are dropped without a word)"
                if len(self._faults_told) > MAX_FAULTS_TOLD else "")
        self.reporter.warn(f"supervisor port: dropped a connection from {who}: {why}{more}")

    def close(self) -> None:
        for key in list(self._sel.get_map().values()):
            with contextlib.suppress(OSError):
                key.fileobj.close()  # type: ignore[union-attr]
        self._sel.close()


class Hub:
    """The head's side: the rendezvous, then the heartbeats, the workers' news and the
    questions of `status`/`stop`/`logs`, in one thread of its own once the run started."""

    def __init__(self, rv: Rendezvous, head: Peer, grace: float, token: str | None,
                 reporter: Reporter, events: queue.Queue[Event]):
        self.rv, self.head, self.grace, self.token = rv, head, grace, token
        self.reporter, self.events = reporter, events
        self.members: dict[str, Member] = {}  # by address: one who comes back wins
        self.status: Callable[[], dict[str, Any]] = dict
        self.logs: Callable[[int], dict[str, Any]] = lambda offset: {}
        self.door = Door(rv.head_ip, rv.port, {"rendezvous": rv.rdzv_id}, reporter)
        self._stoppers: list[Wire] = []
        self._running = False
        self._ending = False
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._next_beat = 0.0

    # --- the rendezvous (in the caller's thread) -------------------------------------------------

    def gather(self, timeout: float, signals_check: Callable[[], None],
               minimum: int | None = None) -> list[Member]:
        """Wait up to `timeout` s for every expected worker, then give each its machine rank
        (not yet sent: `start` does). Fewer will do only down to `minimum`
        (PODAGENT_MIN_WORKERS). Raises WorkersTimeout (after telling the workers that came)
        when too few did; InputError when two asked for one rank."""
        started = time.monotonic()
        deadline = started + timeout
        progress = Progress(self.reporter)
        while len(self.members) < self.rv.workers and (left := deadline - time.monotonic()) > 0:
            try:
                signals_check()
            except DeadlineReached as exc:  # the run is over: those that came leave with it
                for m in self.members.values():
                    m.wire.send({"error": str(exc), "kind": type(exc).__name__})
                raise
            progress(f"waiting for workers at the {self.rv}: {len(self.members)} of "
                     f"{self.rv.workers} joined ({time.monotonic() - started:.0f} s)")
            self._select(min(left, 1.0))
        joined = list(self.members.values())
        try:
            accept_shortfall(self.reporter, [str(m.peer) for m in joined], self.rv.workers,
                             minimum, timeout,
                             missing_line(self.rv, self.head, [m.peer for m in joined], timeout))
            ranks = machine_ranks([(m.peer, m.asked_rank) for m in joined])
        except (WorkersTimeout, InputError) as exc:
            for m in joined:
                m.wire.send({"error": str(exc), "kind": type(exc).__name__})
            raise
        for m in joined:
            m.rank, m.state = ranks[m.peer], MemberState.RUNNING
            m.last_seen = time.monotonic()  # silence counts from here
        return sorted(joined, key=lambda m: m.rank)

    def start(self, go: Callable[[Member], Mapping[str, Any]]) -> None:
        """Send every worker its go, then keep serving in a thread of its own."""
        for m in self.members.values():
            m.wire.send({"go": go(m)})  # one that fails is seen lost by the loop
        self._running = True
        self._thread = threading.Thread(target=self._serve, name="podagent-hub", daemon=True)
        self._thread.start()

    # --- while the run goes on (the supervisor's thread) -----------------------------------------

    def broadcast(self, payload: Mapping[str, Any]) -> None:
        for m in list(self.members.values()):
            if m.state in AT_WORK:
                m.wire.send(payload)  # one that fails is seen lost by the loop

    def end(self, cause: Mapping[str, Any]) -> None:
        """Tell every worker still there that the run is over."""
        self._ending = True
        for m in list(self.members.values()):
            if m.state not in GONE:
                m.wire.send({"end": cause})

    def wait_out(self, deadline: Deadline) -> list[Peer]:
        """After `end`: wait until every told worker's podagent has gone (its connection
        closed); the ones still there at the deadline."""
        def there() -> list[Peer]:
            return [m.peer for m in self.members.values() if m.state not in GONE]

        try:
            return retry(there, awaited="the workers' podagents to leave",
                         backoff=Backoff.every(TICK), deadline=deadline,
                         until=lambda left: not left)
        except Expired as exc:
            return list(exc.last or [])

    def quiet(self, own: float | None) -> float | None:
        """Seconds since any pod's training last made progress: the head's own (`own`) and
        each working member's, as of its last beat (None: nobody watches)."""
        now = time.monotonic()
        seen = [q for q in (own, *(m.quiet_now(now) for m in self.members.values()
                                   if m.state in AT_WORK)) if q is not None]
        return min(seen) if seen else None

    def answer_stoppers(self, payload: Mapping[str, Any]) -> None:
        for wire in self._stoppers:
            wire.send(payload)

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * TICK + SEND_TIMEOUT)
        self.door.close()

    # --- the loop -----------------------------------------------------------------------------

    def _serve(self) -> None:
        watched(self._loop, self.events, self.head, "the head's supervisor thread")

    def _loop(self) -> None:
        while not self._closed.is_set():
            self._select(TICK)
            now = time.monotonic()
            if now >= self._next_beat:
                self._next_beat = now + HEARTBEAT
                self.broadcast({"beat": 1})
            for m in list(self.members.values()):
                if m.state in AT_WORK and now - m.last_seen > self.grace:
                    self._lose(m, f"silent for {self.grace:g} s (no heartbeat: cut off, or "
                                  f"its host is gone)")

    def _select(self, timeout: float) -> None:
        readable, late = self.door.select(timeout)
        for wire in readable:
            self._readable(wire)
        for stranger in late:
            self._fault(stranger.wire, stranger.addr,
                        f"no first line within {FIRST_LINE_TIMEOUT:g} s")

    def _drop(self, wire: Wire) -> None:
        self.door.forget(wire)
        if wire in self._stoppers:
            self._stoppers.remove(wire)
        wire.close()

    def _fault(self, wire: Wire, who: str, why: str) -> None:
        """What came on a connection is its own fault: drop it (a worker's: it is lost), say so
        for the first few, and go on with the run."""
        member = self._member_of(wire)
        if member is not None and self._running:
            self._lose(member, f"its connection sent {why}")
            return
        if member is not None:
            del self.members[member.peer.addr]
        self._drop(wire)
        self.door.tell_fault(who, why)

    def _member_of(self, wire: Wire) -> Member | None:
        return next((m for m in self.members.values() if m.wire is wire), None)

    def _readable(self, wire: Wire) -> None:
        who = self._who(wire)
        try:
            lines = wire.feed()
        except messages.TooLong as exc:
            self._fault(wire, who, str(exc))
            return
        if lines is None:
            self._closed_by_peer(wire)
            return
        for raw in lines:
            try:
                self._line(wire, raw)
            except messages.Malformed as exc:
                self._fault(wire, who, f"a malformed line ({exc})")
            except Exception as exc:  # what one connection sent never ends the run
                self._fault(wire, who, f"a line that broke its reading ({type(exc).__name__}: "
                                       f"{exc})")
            if wire.sock.fileno() < 0:  # dropped, answered and closed, or lost
                return

    def _who(self, wire: Wire) -> str:
        member = self._member_of(wire)
        if member is not None:
            return f"worker {member.peer}"
        stranger = self.door.strangers.get(wire.sock)
        return stranger.addr if stranger else "a pod that asked"

    def _closed_by_peer(self, wire: Wire) -> None:
        member = self._member_of(wire)
        self._drop(wire)
        if member is None:
            return
        if self._ending or member.state == MemberState.OUT:
            member.state = MemberState.OUT
        elif not self._running:
            del self.members[member.peer.addr]
            self.reporter.say(f"worker {member.peer} left the {self.rv} before it started")
        else:
            self._lose(member, "its podagent's connection closed (the pod or its podagent died)")

    def _line(self, wire: Wire, raw: bytes) -> None:
        member = self._member_of(wire)
        if member is not None:
            self._from_member(member, messages.from_worker(messages.decode(raw)))
            member.last_seen = time.monotonic()
        elif wire.sock in self.door.strangers:
            self._first_line(wire, messages.decode(raw))
        # a stopper's later lines: nothing to do with them

    def _first_line(self, wire: Wire, message: dict[str, Any]) -> None:
        stranger = self.door.strangers[wire.sock]
        if not messages.authorized(self.token, message):
            wire.send({"error": "refused: wrong or missing cluster token", "kind": "auth"})
            self._fault(wire, stranger.addr, "a wrong or missing cluster token")
            return
        first = messages.first(message)
        self.door.admit(wire)
        if isinstance(first, messages.Ask):
            self._ask(wire, first)
        elif not self._running:
            self._hello(wire, first)
        else:  # a worker arriving after the start: not counted
            wire.send({"error": f"the {self.rv} has started without this pod",
                       "kind": STARTED})
            self._drop(wire)

    def _hello(self, wire: Wire, hello: messages.Hello) -> None:
        if hello.rank is not None and hello.rank > self.rv.workers:
            why = (f"worker {hello.addr} asked for machine rank {hello.rank}; the {self.rv} has "
                   f"ranks 1 to {self.rv.workers} for workers (EXPECTED_WORKERS)")
            wire.send({"error": why, "kind": "InputError"})
            self._drop(wire)
            self.reporter.warn(why)
            return
        peer = Peer(hello.addr, hello.pod)
        old = self.members.pop(peer.addr, None)
        if old is not None:  # the same pod again (restarted): its old connection is stale
            self._drop(old.wire)
        self.members[peer.addr] = Member(peer, wire, hello.rank)
        self.reporter.say(f"worker {peer} joined the {self.rv} ({len(self.members)} of "
                          f"{self.rv.workers})")

    def _ask(self, wire: Wire, ask: messages.Ask) -> None:
        if ask.what == "status":
            wire.send(self.status())
        elif ask.what == "logs":
            wire.send(self.logs(ask.offset))
        elif ask.what == "stop":
            self._stoppers.append(wire)
            wire.send({"stopping": True})
            self.events.put(StopAsked(ask.by))
            return  # kept open: answered once every pod is out
        self._drop(wire)

    def _from_member(self, m: Member, message: messages.Beat | messages.StepDone
                     | messages.Dumped | messages.Leaving) -> None:
        if isinstance(message, messages.Beat):
            m.quiet, m.quiet_at = message.quiet, time.monotonic()
        elif isinstance(message, messages.Dumped):
            self.events.put(Dumped(m.peer, message.body))
        elif isinstance(message, messages.StepDone):
            m.state, m.step = MemberState.DONE, message.step
            self.events.put(Done(m.peer, message.step, message.rc, message.reports))
        elif isinstance(message, messages.Leaving):
            self._lose(m, f"its podagent is stopping ({message.why})")

    def _lose(self, m: Member, why: str) -> None:
        if m.state in GONE:
            return
        m.state = MemberState.OUT if self._ending else MemberState.LOST
        self.door.forget(m.wire)
        m.wire.close()
        if m.state == MemberState.LOST:
            self.events.put(Lost(m.peer, why))


class Link:
    """A worker's side: join the head's rendezvous, then beat and listen in a thread."""

    def __init__(self, rv: Rendezvous, me: Peer, grace: float, token: str | None,
                 reporter: Reporter, events: queue.Queue[Event]):
        self.rv, self.me, self.grace, self.token = rv, me, grace, token
        self.reporter, self.events = reporter, events
        self.head = Peer(rv.head_ip, "the head")
        self.wire: Wire | None = None
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        # The seconds since this pod's training last made progress (None: none runs), sent
        # with every beat: the head decides whether the whole run hangs.
        self.quiet: Callable[[], float | None] = lambda: None

    def _beat(self) -> dict[str, Any]:
        quiet = self.quiet()
        return {"beat": 1} if quiet is None else {"beat": 1, "quiet": round(quiet, 2)}

    def join(self, deadline: float, timeout: float, asked_rank: int | None,
             sleep: Callable[[float], None],
             check: Callable[[], None] = lambda: None) -> dict[str, Any]:
        """Say hello and wait for the head's go (its body: this pod's machine rank...), all
        before `deadline` (monotonic; `timeout` is what the user set). Raises HeadUnreachable
        when the head never answered, WorkersTimeout or InputError with the head's line when
        it gave up."""
        progress = Progress(self.reporter)
        while True:
            try:
                go = self._attempt(deadline, timeout, asked_rank, sleep, check, progress)
            except _StartedWithout as exc:
                # The head has not yet seen the pod this one replaces: it ends that start in a
                # moment and holds a new rendezvous (its container started again). Leaving
                # now would make this pod a crash loop, and the run one worker short.
                if time.monotonic() + STARTED_RETRY > deadline:
                    raise HeadUnreachable(
                        f"{self.rv}: the head's run had started without this pod and held no "
                        f"new rendezvous within {timeout:g} s") from None
                progress(f"the head's {self.rv}: {exc}; waiting for its next one (a head "
                         f"ends a start that lost a pod, then holds a new rendezvous)")
                sleep(STARTED_RETRY)
                continue
            self._thread = threading.Thread(target=self._serve, name="podagent-link",
                                            daemon=True)
            self._thread.start()
            return go

    def _attempt(self, deadline: float, timeout: float, asked_rank: int | None,
                 sleep: Callable[[float], None], check: Callable[[], None],
                 progress: Progress) -> dict[str, Any]:
        rv = self.rv

        def connect() -> socket.socket:
            left = deadline - time.monotonic()
            try:
                return socket.create_connection((rv.head_ip, rv.port),
                                                timeout=max(0.1, min(CONNECT_TIMEOUT, left)))
            except OSError as exc:
                last = exc.strerror or str(exc) or type(exc).__name__
                progress(f"waiting for the head's {rv}: {last} "
                         f"({timeout - max(0.0, left):.0f} s)")
                raise NotYet(last) from None

        sock = retry(connect, awaited=f"the head's {rv}", backoff=Backoff(0.1, 2.0),
                     deadline=Deadline(lambda: deadline), sleep=sleep,
                     expired=lambda gave_up: HeadUnreachable(
                         f"{rv}: the head's podagent did not answer within {timeout:g} s "
                         f"(last try: {gave_up.seen})"))
        wire = Wire(sock)
        greeting = wire.next(GREETING_TIMEOUT)
        if greeting is None:  # closed at once: a head on its way out (or in)
            wire.close()
            raise _StartedWithout("its podagent closed the connection")
        if isinstance(greeting, dict) and "over" in greeting:
            wire.close()
            raise HeadSaysOver(rv, json.dumps(greeting).encode())
        if not isinstance(greeting, dict) or "rendezvous" not in greeting:
            wire.close()
            raise HeadUnreachable(f"{rv}: what listens there is not podagent's supervisor")
        if greeting["rendezvous"] != rv.rdzv_id:
            wire.close()
            raise HeadUnreachable(f"{rv}: the head holds rendezvous {greeting['rendezvous']}, "
                                  "not this one: give every pod the same PODAGENT_RUN_NAME")
        hello: dict[str, Any] = {"hello": {"addr": self.me.addr, "pod": self.me.pod,
                                           "rank": asked_rank}}
        if self.token:
            hello["token"] = self.token
        wire.send(hello)
        self.reporter.say(f"joined the {rv}; waiting for the head to start it")
        answer = wire.next(max(0.1, deadline - time.monotonic()), check)
        if answer is TimeoutError:
            wire.close()
            raise HeadUnreachable(f"{rv}: joined, but the head did not start it within "
                                  f"{timeout:g} s")
        if isinstance(answer, dict) and "error" in answer:
            wire.close()
            if answer.get("kind") == STARTED:
                raise _StartedWithout("it started without this pod")
            error = _ANSWER_ERRORS.get(str(answer.get("kind")), HeadUnreachable)
            if error is WorkersTimeout:
                raise WorkersTimeout(f"the head gave up: {answer['error']}")
            if error is AuthRefused:
                which = "a different cluster token" if self.token else "no cluster token"
                raise AuthRefused(f"the head's podagent at {rv.head_ip}:{rv.port} refused this "
                                  f"pod: it has {which} ({answer['error']}); set the same "
                                  f"PODAGENT_TOKEN (or RAY_AUTH_TOKEN) on every pod")
            raise error(str(answer["error"]))
        if answer is None:  # the head's podagent ended this start: its next one is awaited
            wire.close()
            raise _StartedWithout("its podagent closed the connection")
        if not isinstance(answer, dict) or not isinstance(answer.get("go"), dict):
            wire.close()
            raise HeadUnreachable(f"{rv}: the head answered something else than its go")
        self.wire = wire
        return answer["go"]

    def send(self, payload: Mapping[str, Any]) -> bool:
        return self.wire is not None and self.wire.send(payload)

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * TICK + SEND_TIMEOUT)
        if self.wire is not None:
            self.wire.close()

    def _serve(self) -> None:
        watched(self._loop, self.events, self.head, "this worker's link thread")

    def _loop(self) -> None:
        wire = self.wire
        assert wire is not None
        last_seen = time.monotonic()
        next_beat = 0.0
        while not self._closed.is_set():
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + HEARTBEAT
                if not wire.send(self._beat()):
                    self.events.put(Lost(self.head, "a send to it failed"))
                    return
            wire.sock.settimeout(TICK)
            lines = wire.messages()
            came = [*wire.unread, *(lines or ())]  # what came with the go, first
            wire.unread.clear()
            if came:
                last_seen = time.monotonic()
            for message in came:
                if isinstance(message, dict):
                    for kind in HEAD_SAYS:
                        if isinstance(message.get(kind), dict):
                            self.events.put(FromHead(kind, message[kind]))
            if lines is None:
                if not self._closed.is_set():
                    self.events.put(Lost(self.head, "its podagent's connection closed (the "
                                                    "pod or its podagent died)"))
                return
            if time.monotonic() - last_seen > self.grace:
                self.events.put(Lost(self.head, f"silent for {self.grace:g} s (no heartbeat: "
                                                f"cut off, or its host is gone)"))
                return


class HeadSaysOver(Exception):
    """The head answered the rendezvous with its word that the run is over (run/beacon.py
    reads and checks it): this pod was away when the run ended."""

    def __init__(self, rv: Rendezvous, line: bytes):
        self.line, self.head = line, rv.head_ip
        super().__init__(f"{rv}: the head says the run is over")


class NotSupervisor(Exception):
    """Something other than a podagent supervisor answered on the port."""


def ask(head_ip: str, port: int, question: Mapping[str, Any], token: str | None,
        timeout: float) -> tuple[Wire, Any]:
    """Connect to a head's supervisor and ask; (the open connection, the first answer).
    Raises OSError when the head cannot be reached or nothing listens there (no run without
    Ray), NotSupervisor when something else answers, HeadUnreachable when the head refuses
    the cluster token or does not answer."""
    sock = socket.create_connection((head_ip, port), timeout=timeout)
    wire = Wire(sock)
    greeting = wire.next(timeout)
    if not isinstance(greeting, dict) or "rendezvous" not in greeting:
        wire.close()
        raise NotSupervisor(f"{head_ip}:{port} is not a podagent supervisor")
    wire.send({**question, **({"token": token} if token else {})})
    answer = wire.next(timeout)
    if answer is TimeoutError or answer is None:
        wire.close()
        raise HeadUnreachable(f"the head's podagent at {head_ip}:{port} did not answer")
    if isinstance(answer, dict) and answer.get("kind") == "auth":
        wire.close()
        raise HeadUnreachable(f"the head's podagent at {head_ip}:{port} {answer['error']}")
    return wire, answer
