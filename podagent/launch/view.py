"""What `podagent up` shows: at a terminal, a live board (the run's phase and a table of its
pods: status, for how long, cost) redrawn in place under the scrolling output; elsewhere
(a pipe, a file, CI) plain lines, one per change. Both read the same Board.

Output is best effort: a stream that breaks (a closed terminal, `| tee` or `| head` gone) is
silenced, never an error, so that nothing `up` says can stop it terminating the pods."""

from __future__ import annotations

import contextlib
import copy
import os
import queue
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TextIO

from podagent.launch.interrupts import wait_until


@dataclass
class PodRow:
    name: str
    id: str = ""
    status: str = "ASKING"  # before RunPod answered the create
    since: float = field(default_factory=time.monotonic)
    cost: float | None = None  # USD per hour, as RunPod reports it
    ip: str = ""  # its private address (Global Networking or the cluster's network)
    joined: bool = False  # in the head's Ray (the head's own row: its Ray is up)

    def show(self, pod: Mapping[str, Any]) -> None:
        """The pod as RunPod lists it: its status (and since when), cost and address."""
        status = str(pod.get("status") or "?")
        if status != self.status:
            self.status, self.since = status, time.monotonic()
        cost = pod.get("cost")
        self.cost = float(cost) if isinstance(cost, (int, float)) else None
        where = (pod.get("cluster") or {}).get("ip") or (pod.get("globalNetworking") or {}).get(
            "ip")
        self.ip = str(where or self.ip)


@dataclass
class Board:
    run: str
    shape: str
    phase: str = "checking"
    started: float = field(default_factory=time.monotonic)
    phase_since: float = field(default_factory=time.monotonic)
    pods: dict[str, PodRow] = field(default_factory=dict)
    joined: int = 0
    expected: int = 0

    def row(self, name: str) -> PodRow:
        if name not in self.pods:
            self.pods[name] = PodRow(name)
        return self.pods[name]

    def mark_joined(self, ip: str | None, joined: bool) -> None:
        for row in self.pods.values():
            if ip is None or row.ip == ip:
                row.joined = joined

    def set_phase(self, phase: str) -> bool:
        if phase == self.phase:
            return False
        self.phase, self.phase_since = phase, time.monotonic()
        return True

    def cost(self) -> float:
        return sum(p.cost or 0.0 for p in self.pods.values())


def _silence(stream: TextIO) -> None:
    """A broken stream's file descriptor onto /dev/null: what is still buffered, or written
    by anyone later (an error line, the interpreter's last flush), goes nowhere quietly."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        fd = stream.fileno()
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, fd)
        finally:
            os.close(devnull)


def _ago(since: float) -> str:
    seconds = int(time.monotonic() - since)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class PlainView:
    """One line per change: a pod's status, the phase, a worker joining; output as it is."""

    def __init__(self, stream: TextIO | None = None):
        self.stream = stream or sys.stdout
        self._seen: dict[str, str] = {}
        self._phase = ""
        self._joined = -1
        self.broken = False  # the stream failed once: nothing more is written to it

    def _put(self, text: str) -> None:
        if self.broken:
            return
        try:
            self.stream.write(text + "\n")
            self.stream.flush()
        except (OSError, ValueError):  # EPIPE, EIO (a hung-up terminal), a closed file
            self.broken = True
            _silence(self.stream)

    def update(self, board: Board) -> None:
        for row in board.pods.values():
            if self._seen.get(row.name) != row.status:
                before = self._seen.get(row.name)
                was = f" (was {before})" if before else ""
                ident = f" {row.id}" if row.id else ""
                self._put(f"[up] pod {row.name}{ident}: {row.status}{was} "
                          f"at {_ago(board.started)}")
                self._seen[row.name] = row.status
        if board.expected and board.joined != self._joined and board.joined:
            self._put(f"[up] workers joined: {board.joined}/{board.expected}")
        self._joined = board.joined
        if board.phase != self._phase:
            self._phase = board.phase
            self._put(f"[up] run {board.run}: {board.phase} at {_ago(board.started)}")

    def line(self, text: str) -> None:
        self._put(text)

    def close(self) -> None:
        if not self.broken:
            with contextlib.suppress(OSError, ValueError):
                self.stream.flush()


class LiveView:
    """The board redrawn in place four times a second (rich's Live); lines scroll above it."""

    def __init__(self, stream: TextIO | None = None):
        from rich.console import Console
        from rich.live import Live

        self.stream = stream or sys.stdout
        self.console = Console(file=self.stream)
        self.broken = False  # as PlainView's
        self._board: Board | None = None
        self._live = Live(console=self.console, refresh_per_second=4, transient=False,
                          get_renderable=self._render)
        self._live.start()

    def _render(self):  # -> rich renderable
        from rich.table import Table
        from rich.text import Text

        board = self._board
        if board is None:
            return Text("")
        table = Table(title=None, box=None, pad_edge=False, expand=False)
        for column in ("pod", "id", "status", "for", "$/h"):
            table.add_column(column, no_wrap=True)
        colour = {"RUNNING": "green", "ERROR": "red", "TERMINATED": "dim", "EXITED": "yellow"}
        for row in board.pods.values():
            status = row.status + (" · joined" if row.joined else "")
            table.add_row(row.name, row.id or "-",
                          Text(status, style=colour.get(row.status, "cyan")),
                          _ago(row.since), "-" if row.cost is None else f"{row.cost:.2f}")
        joined = f" · workers {board.joined}/{board.expected}" if board.expected else ""
        head = Text(f"run {board.run} · {board.shape} · {board.phase} for "
                    f"{_ago(board.phase_since)} · {_ago(board.started)} in all{joined} · "
                    f"${board.cost():.2f}/h", style="bold")
        from rich.console import Group

        return Group(head, table)

    def update(self, board: Board) -> None:
        self._board = board

    def line(self, text: str) -> None:
        from rich.text import Text

        if self.broken:
            return
        try:
            self._live.console.print(Text(text), soft_wrap=True)
        except (OSError, ValueError):
            self._broke()

    def _broke(self) -> None:
        self.broken = True
        _silence(self.stream)
        with contextlib.suppress(Exception):
            self._live.stop()

    def close(self) -> None:
        if self.broken:
            return
        try:
            self._live.refresh()
            self._live.stop()
        except (OSError, ValueError):
            self._broke()


class Unblocked:
    """A view whose calls never hold `up` up: they are carried out in order on a thread of
    their own. A reader that stops reading (a pipe nobody reads, a terminal on XOFF, a
    stalled ssh session) then costs lines, never the termination of the pods; close() waits
    DRAIN seconds at most for what is still queued."""

    DRAIN = 2.0
    QUEUED = 10_000  # calls kept while the reader is stalled; later ones are dropped

    def __init__(self, view: PlainView | LiveView):
        self.view = view
        self._calls: queue.Queue[tuple[str, Any]] = queue.Queue(self.QUEUED)
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._serve, name="up-view", daemon=True)
        self._thread.start()

    @property
    def broken(self) -> bool:
        return self.view.broken

    def _put(self, call: str, arg: Any) -> None:
        self._idle.clear()
        with contextlib.suppress(queue.Full):
            self._calls.put_nowait((call, arg))

    def _serve(self) -> None:
        while True:
            call, arg = self._calls.get()
            with contextlib.suppress(Exception):  # a view's fault costs its lines only
                getattr(self.view, call)(*(() if arg is None else (arg,)))
            if self._calls.empty():
                self._idle.set()
            if call == "close":
                return

    def update(self, board: Board) -> None:
        self._put("update", copy.deepcopy(board))  # the board goes on changing meanwhile

    def line(self, text: str) -> None:
        self._put("line", text)

    def close(self) -> None:
        self._put("close", None)
        wait_until(self._idle.is_set, self.DRAIN)


View = PlainView | LiveView | Unblocked


def choose(stream: TextIO | None = None) -> PlainView | LiveView:
    stream = stream or sys.stdout
    try:
        live = stream.isatty()
    except (AttributeError, ValueError):
        live = False
    import os

    if live and os.environ.get("TERM", "") not in ("", "dumb"):
        return LiveView(stream)
    return PlainView(stream)
