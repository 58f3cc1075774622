"""`podagent torchrun`: torchrun with the ranks worked out, for trainers that do not use Ray.

Every pod runs the same command. The head's address comes from the same discovery as the Ray
path, the node count from the expected workers, processes per node from the GPUs; torch's c10d
rendezvous at the head hands out the node ranks, so nobody types a NODE_RANK.

Before that, podagent holds a short rendezvous of its own on the same port (`gather_workers` on
the head, `join_head` on a worker), because torch's cannot say who is missing: its head waits
`join_timeout` (600 s) for absent workers and a worker tries to reach an absent head for
`read_timeout` (60 s, twice), whatever PODAGENT_WORKER_TIMEOUT and PODAGENT_HEAD_TIMEOUT say, and
both end in a traceback that names nobody. Here the head waits up to PODAGENT_WORKER_TIMEOUT for
every expected worker to say hello, a worker up to PODAGENT_HEAD_TIMEOUT for the head's answer,
and the error line names who came and how many did not. Only when everyone is there does every
pod exec torchrun: signals and the exit code are then torchrun's.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import selectors
import shlex
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import BinaryIO

from podagent import __version__, process
from podagent.config import Settings, child_environ
from podagent.errors import HeadUnreachable, PortInUse, WorkersTimeout
from podagent.platform.roles import Role, detect_role
from podagent.report import Progress, Reporter
from podagent.waiting import Backoff, Deadline, NotYet, Signals, retry

LINE_LIMIT = 4096  # bytes: a hello or an answer is one short JSON line
CONNECT_TIMEOUT = 5.0  # seconds for one connection attempt to the head
GREETING_TIMEOUT = 10.0  # the head greets at once; this is for a head starved of CPU
SELECT_EVERY = 1.0  # the head's wait wakes this often to report progress


@dataclass(frozen=True)
class TorchrunPlan:
    argv: tuple[str, ...]
    env_overrides: Mapping[str, str]
    rdzv_id: str


def rendezvous_id(settings: Settings, head_ip: str) -> str:
    """The same on every pod of the cluster and different between clusters.

    The run name only when every pod has the same one (explicit, or derived from HEAD_POD_ID or
    PRIMARY_ADDR): a name from each pod's own RUNPOD_POD_ID or start time differs per pod.
    """
    if settings.run_name_shared:
        raw = settings.run_name
    else:
        raw = f"podagent-{settings.head_pod_id or settings.primary_addr or head_ip}"
    return re.sub(r"[^A-Za-z0-9._-]", "-", raw)


def wait_limit(settings: Settings, role: Role) -> float:
    """How long this pod waits for the others: the head for its workers, a worker for its
    head (the same settings as the Ray path)."""
    return settings.worker_timeout if role is Role.HEAD else settings.head_timeout


def plan(settings: Settings, role: Role, node_ip: str, head_ip: str, gpus: int,
         nccl_vars: Mapping[str, str], user_args: Sequence[str]) -> TorchrunPlan:
    """torchrun's argv: podagent's options first, the user's after them (torchrun's parser
    keeps the last value of an option, so a user's own --nnodes wins)."""
    rdzv_id = rendezvous_id(settings, head_ip)
    conf = {
        # Said, not guessed: torch compares host names to decide who hosts the store, and
        # pods (or containers) can share one.
        "is_host": 1 if role is Role.HEAD else 0,
        # torch's own wait (600 s by default) gets podagent's limit too: everyone was there a
        # moment ago, but a pod that dies before its torchrun starts must not stall the rest.
        "join_timeout": math.ceil(wait_limit(settings, role)),
    }
    argv = (
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(settings.expected_workers + 1),
        "--nproc-per-node", str(gpus or 1),
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"{head_ip}:{settings.rendezvous_port}",
        "--rdzv-id", rdzv_id,
        "--rdzv-conf", ",".join(f"{k}={v}" for k, v in conf.items()),
        # The address other nodes reach this one at; the host name may resolve elsewhere.
        "--local-addr", node_ip,
        *user_args,
    )
    return TorchrunPlan(argv, dict(nccl_vars), rdzv_id)


def execute(torchrun_plan: TorchrunPlan) -> None:
    """Become torchrun (never returns)."""
    env = {**child_environ(os.environ), **torchrun_plan.env_overrides}  # not RunPod's key
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(torchrun_plan.argv[0], list(torchrun_plan.argv), env)


def run(settings: Settings, user_args: Sequence[str], dry_run: bool = False) -> None:
    """`podagent torchrun` on this pod: find the head (a worker) or be it, work out torchrun's
    options, hold podagent's rendezvous, then become torchrun (never returns). A dry run says
    what it would run and returns."""
    from podagent.cluster import node
    from podagent.cluster.run import reporter_for
    from podagent.platform import discovery

    decision = detect_role(settings)
    name = settings.pod_id or socket.gethostname()
    reporter = reporter_for(settings, decision.role.value, pod=name)
    reporter.say(f"podagent {__version__} torchrun: this pod is the {decision.role.value} "
                 f"({decision.reason})")
    finder = None
    if decision.role is Role.HEAD:
        setup = node.prepare(settings, Role.HEAD, reporter)
        head_ip = setup.node_ip
    else:
        finder = discovery.HeadFinder(settings, reporter, Signals())
        where = finder.locate()
        reporter.say(f"head found at {where.ip} ({where.how})")
        setup = node.prepare(settings, Role.WORKER, reporter, head_ip=where.ip)
        head_ip = where.ip
    torchrun_plan = plan(settings, decision.role, setup.node_ip, head_ip, setup.gpus,
                         setup.nccl.variables, user_args)
    reporter.say(f"rendezvous {torchrun_plan.rdzv_id} at {head_ip}:{settings.rendezvous_port}, "
                 f"{settings.expected_workers + 1} node(s) x {setup.gpus or 1} process(es)")
    if dry_run:
        reporter.say(f"would run: {shlex.join(torchrun_plan.argv)}")
        return
    rendezvous = Rendezvous(torchrun_plan.rdzv_id, head_ip, settings.rendezvous_port,
                            settings.expected_workers)
    me = Peer(setup.node_ip, name)
    if finder is not None:
        join_head(rendezvous, me, finder.deadline, settings.head_timeout, reporter,
                  finder.signals.sleep)
    elif rendezvous.workers:
        gather_workers(rendezvous, me, settings.worker_timeout, reporter)
    reporter.say(f"exec: {shlex.join(torchrun_plan.argv)}")
    execute(torchrun_plan)


# --- podagent's rendezvous before torchrun's ------------------------------------------------------
#
# One TCP connection per worker and a few JSON lines: the head's greeting {"rendezvous": <id>},
# the worker's hello {"addr": ..., "pod": ...}, then, once every expected worker came or the
# head's wait ran out, the head's answer {"go": true} or {"error": "<the head's error line>"}.
#
# The head closes its listening socket before it answers. So a worker that heard "go" and
# execs torchrun can only ever reach the head's torchrun on that port (until it listens, the
# connection is refused and torch tries again), never this rendezvous in its last moments.


@dataclass(frozen=True)
class Rendezvous:
    rdzv_id: str
    head_ip: str
    port: int
    workers: int  # expected

    def __str__(self) -> str:
        return f"rendezvous {self.rdzv_id} at {self.head_ip}:{self.port}"


@dataclass(frozen=True)
class Peer:
    addr: str  # the address the other nodes reach it at (its --local-addr)
    pod: str

    def __str__(self) -> str:
        return f"{self.addr} ({self.pod})" if self.pod and self.pod != self.addr else self.addr


def _line(payload: dict[str, object]) -> bytes:
    return json.dumps(payload).encode() + b"\n"


def _hello(raw: bytes) -> Peer | None:
    try:
        fields = json.loads(raw)
        return Peer(str(fields["addr"]), str(fields.get("pod", "")))
    except (ValueError, KeyError, TypeError):
        return None  # not a podagent worker: ignored, not counted


def _listen(port: int) -> socket.socket:
    try:
        return socket.create_server(("", port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise PortInUse(port, "0.0.0.0", process.port_holder(port)) from None
        raise


def missing_line(rv: Rendezvous, head: Peer, joined: Sequence[Peer], waited: float) -> str:
    came = [f"head {head}", *(f"worker {p}" for p in joined)]
    missing = rv.workers - len(joined)
    return (f"{rv}: {len(came)} of {rv.workers + 1} nodes joined within {waited:g} s "
            f"({', '.join(came)}); missing: {missing} worker{'s' if missing != 1 else ''} "
            f"(EXPECTED_WORKERS={rv.workers})")


def gather_workers(rv: Rendezvous, head: Peer, timeout: float,
                   reporter: Reporter) -> list[Peer]:
    """On the head: wait up to `timeout` s for `rv.workers` workers to say hello, then answer
    each of them. Raises WorkersTimeout (after telling the workers that came) when some never
    did."""
    started = time.monotonic()
    deadline = started + timeout
    listener = _listen(rv.port)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    partial: dict[socket.socket, bytes] = {}  # connected, hello not complete yet
    joined: dict[str, tuple[socket.socket, Peer]] = {}  # by address: one who comes back wins
    progress = Progress(reporter)

    def drop(conn: socket.socket) -> None:
        sel.unregister(conn)
        partial.pop(conn, None)
        for addr, (c, peer) in list(joined.items()):
            if c is conn:
                del joined[addr]
                reporter.say(f"worker {peer} left the {rv} before it started")
        conn.close()

    def readable(conn: socket.socket) -> None:
        try:
            data = conn.recv(LINE_LIMIT)
        except OSError:
            data = b""
        if not data or conn not in partial:  # gone, or talking after its hello
            drop(conn)
            return
        buf = partial[conn] + data
        if b"\n" not in buf:
            if len(buf) > LINE_LIMIT:
                drop(conn)
            else:
                partial[conn] = buf
            return
        del partial[conn]
        peer = _hello(buf.split(b"\n", 1)[0])
        if peer is None:
            drop(conn)
            return
        if peer.addr in joined:  # the same pod again (restarted): its old connection is stale
            old, _ = joined.pop(peer.addr)
            sel.unregister(old)
            old.close()
        joined[peer.addr] = (conn, peer)
        reporter.say(f"worker {peer} joined the {rv} ({len(joined)} of {rv.workers})")

    try:
        while len(joined) < rv.workers and (left := deadline - time.monotonic()) > 0:
            progress(f"waiting for workers at the {rv}: {len(joined)} of {rv.workers} joined "
                     f"({time.monotonic() - started:.0f} s)")
            for key, _ in sel.select(min(left, SELECT_EVERY)):
                if key.fileobj is listener:
                    with contextlib.suppress(OSError):
                        conn, _ = listener.accept()
                        partial[conn] = b""
                        sel.register(conn, selectors.EVENT_READ)
                        conn.sendall(_line({"rendezvous": rv.rdzv_id}))
                else:
                    readable(key.fileobj)  # type: ignore[arg-type]
        sel.unregister(listener)
        listener.close()  # before the answer: see above
        peers = [peer for _, peer in joined.values()]
        failure = None
        if len(peers) < rv.workers:
            failure = WorkersTimeout(missing_line(rv, head, peers, timeout))
        answer = _line({"error": str(failure)} if failure else {"go": True})
        for conn, _ in joined.values():
            with contextlib.suppress(OSError):
                conn.sendall(answer)
        if failure:
            raise failure
        return peers
    finally:
        for key in list(sel.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        listener.close()
        sel.close()


def join_head(rv: Rendezvous, me: Peer, deadline: float, timeout: float,
              reporter: Reporter, sleep: Callable[[float], None]) -> None:
    """On a worker: say hello to the head's rendezvous and wait for its answer, both before
    `deadline` (monotonic; `timeout` is what the user set). Raises HeadUnreachable when the
    head never answered, WorkersTimeout with the head's line when the head gave up."""
    progress = Progress(reporter)

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

    conn = retry(connect, awaited=f"the head's {rv}", backoff=Backoff(0.1, 2.0),
                 deadline=Deadline(lambda: deadline), sleep=sleep,
                 expired=lambda gave_up: HeadUnreachable(
                     f"{rv}: the head's podagent torchrun did not answer within {timeout:g} s "
                     f"(last try: {gave_up.seen})"))
    with conn, conn.makefile("rb") as reader:
        # The head greets first. Anything else on that port (torchrun's own store, once the
        # others have started) says nothing, and a head of another run says another id.
        try:
            greeting = _read_line(conn, reader, GREETING_TIMEOUT)
        except TimeoutError:
            greeting = None
        if not isinstance(greeting, dict) or "rendezvous" not in greeting:
            raise HeadUnreachable(f"{rv}: what listens there is not podagent's rendezvous "
                                  "(torchrun may already run there: has the run started "
                                  "without this pod?)")
        if greeting["rendezvous"] != rv.rdzv_id:
            raise HeadUnreachable(f"{rv}: the head holds rendezvous {greeting['rendezvous']}, "
                                  "not this one: give every pod the same PODAGENT_RUN_NAME")
        conn.sendall(_line({"addr": me.addr, "pod": me.pod}))
        reporter.say(f"joined the {rv}; waiting for the head to start it")
        try:
            answer = _read_line(conn, reader, deadline - time.monotonic())
        except TimeoutError:
            raise HeadUnreachable(f"{rv}: joined, but the head did not start it within "
                                  f"{timeout:g} s") from None
    if not isinstance(answer, dict) or not (answer.get("go") or answer.get("error")):
        raise HeadUnreachable(f"{rv}: the head closed the connection without an answer")
    if answer.get("error"):
        raise WorkersTimeout(f"the head gave up: {answer['error']}")


def _read_line(conn: socket.socket, reader: BinaryIO, timeout: float) -> object:
    """The next JSON line, or None when the connection ended or sent something else; raises
    TimeoutError when nothing came within `timeout`."""
    conn.settimeout(max(0.1, timeout))
    try:
        raw = reader.readline(LINE_LIMIT)
    except TimeoutError:
        raise
    except OSError:  # reset: as good as closed
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return None
