"""Friendly step-by-step output, the pod's log file and events.jsonl, with secrets redacted."""

from __future__ import annotations

import codecs
import contextlib
import json
import os
import select
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

REDACTED = "<redacted>"


class Redactor:
    def __init__(self, secrets: Iterable[str]):
        # Longest first, so a secret that contains another is replaced whole.
        self._secrets = sorted({s for s in secrets if len(s) >= 4}, key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, REDACTED)
        return text


class Step:
    def __init__(self, reporter: Reporter, event: str):
        self.reporter, self.event = reporter, event
        self.started = time.monotonic()
        self.message: str | None = None
        self.fields: dict[str, Any] = {}

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def done(self, message: str, **fields: Any) -> None:
        self.message, self.fields = message, fields


LOG_FORMATS = ("text", "json")
LIVE_INTERVAL = 0.5  # seconds between rewrites of a live progress line
# A line waits at most this long for a reader of the screen that stopped reading (a full pipe,
# a stalled log collector); after that podagent drops lines until there is room again.
SCREEN_WAIT = 2.0
EMERGENCY_LOG_WAIT = 0.5  # the last line of a forced exit waits this long for the log file


def _fileno(stream: TextIO) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, ValueError, OSError):  # in memory (tests), closed, or detached
        return None


class _Screen:
    """One output stream (stdout or stderr), written so that nobody who stops reading it can
    block podagent: a blocked write would hold the reporter's lock, and with it every line and
    the signal handling of the whole run. A line waits at most SCREEN_WAIT for room; then lines
    are dropped (counted, and said once the reader is back) until there is room again."""

    def __init__(self, stream: TextIO):
        self.stream = stream
        self.fd = _fileno(stream)
        self.stalled = False
        self.dropped = 0

    def write(self, text: str, wait: float = SCREEN_WAIT) -> bool:
        """True when all of `text` went out."""
        if self.fd is None:
            self.stream.write(text)
            self.stream.flush()
            return True
        if self.dropped and self._room(0):
            note = (f"(podagent: {self.dropped} line(s) dropped here while this output was "
                    f"not read; the pod's log file has them)\n")
            self.dropped = 0
            self._send(note.encode(), 0)
        if self._send(text.encode(errors="replace"), 0 if self.stalled else wait):
            self.stalled = False
            return True
        self.stalled = True
        self.dropped += 1
        return False

    def _send(self, data: bytes, wait: float) -> bool:
        view = memoryview(data)
        while view:
            if not self._room(wait):
                return False
            try:
                # At most PIPE_BUF at a time: a pipe with room for that never blocks the write.
                written = os.write(self.fd, view[:select.PIPE_BUF])  # type: ignore[arg-type]
            except BlockingIOError:
                continue
            except OSError:  # the reader is gone (EPIPE) or the stream broke: nothing to do
                return False
            view = view[written:]
        return True

    def _room(self, wait: float) -> bool:
        poller = select.poll()
        poller.register(self.fd, select.POLLOUT)  # type: ignore[arg-type]
        try:
            return any(mask & select.POLLOUT for _, mask in poller.poll(int(wait * 1000)))
        except OSError:
            return False


class JobOutput:
    """A job's output on podagent's screen, as it comes. As text it passes through as it is
    (a progress bar's carriage returns too). As JSON, each of its lines becomes one `job`
    record: whatever the job prints (a JSON logger's `{"event": ...}`, podagent's own records
    copied), nothing on podagent's output can pass for one of podagent's records, and no
    record of podagent's lands in the middle of a job's line. A line longer than LINE_MAX is
    cut into records of that size; what remains at the end is a line of its own."""

    LINE_MAX = 1 << 16  # characters

    def __init__(self, reporter: Reporter):
        self.reporter = reporter
        self._decode = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._partial = ""

    def write(self, chunk: bytes) -> None:
        text = self._decode.decode(chunk)
        if self.reporter.log_format != "json":
            if text:
                self.reporter._job_chunk(text)
            return
        *lines, self._partial = (self._partial + text).split("\n")
        while len(self._partial) > self.LINE_MAX:
            lines.append(self._partial[:self.LINE_MAX])
            self._partial = self._partial[self.LINE_MAX:]
        if lines:
            self.reporter._job_records(lines)

    def warn(self, message: str) -> None:
        self.reporter.warn(message)

    def close(self) -> None:
        """The output ended: its last, unfinished line."""
        self.write(b"")
        rest = self._decode.decode(b"", final=True)
        if self.reporter.log_format != "json":
            if rest:
                self.reporter._job_chunk(rest)
            return
        last, self._partial = self._partial + rest, ""
        if last:
            self.reporter._job_records([last])


class Reporter:
    """podagent's own lines: on screen (text or JSON, all or --quiet), in the pod's log file
    (always all, as text), and events in events.jsonl."""

    def __init__(
        self,
        role: str,
        pod: str,
        run_dir: Path | None,
        secrets: Iterable[str] = (),
        stream: TextIO | None = None,
        log_format: str = "text",
        quiet: bool = False,
    ):
        self.role, self.pod = role, pod
        self.redact = Redactor(secrets)
        self.stream = stream or sys.stdout
        self.log_format, self.quiet = log_format, quiet
        # A live, rewritten progress line only for a person at a terminal; log collectors and
        # files get plain periodic lines instead.
        self.live = log_format == "text" and not quiet and _is_terminal(self.stream)
        self._live_shown = False
        self._lock = threading.Lock()
        self._screens: dict[int, _Screen] = {}
        self._log: TextIO | None = None
        self._events: TextIO | None = None
        self._listeners: list[Callable[[dict[str, Any]], None]] = []
        self.run_dir = run_dir
        if run_dir is not None:
            run_dir.mkdir(parents=True, exist_ok=True)
            # Line-buffered appends: each pod writes its own log; events.jsonl is shared.
            self._log = open(run_dir / f"podagent-{role}-{pod}.log", "a", buffering=1)
            self._events = open(run_dir / "events.jsonl", "a", buffering=1)

    def close(self) -> None:
        with self._lock:
            self._clear_live()
            for f in (self._log, self._events):
                if f:
                    with contextlib.suppress(OSError, ValueError):  # a full disk: flush fails
                        f.close()
            self._log = self._events = None

    def _screen(self, stream: TextIO) -> _Screen:
        screen = self._screens.get(id(stream))
        if screen is None or screen.stream is not stream:
            screen = self._screens[id(stream)] = _Screen(stream)
        return screen

    def _clear_live(self) -> None:
        if self._live_shown:
            self._screen(self.stream).write("\r\x1b[2K")
            self._live_shown = False

    def _to_file(self, which: str, text: str) -> None:
        """A line for the pod's log file or events.jsonl. A file that cannot be written (the
        volume is full or gone) is given up with one warning on screen: the run goes on."""
        f = self._log if which == "log" else self._events
        if f is None:
            return
        try:
            f.write(text)
        except (OSError, ValueError) as exc:
            with contextlib.suppress(OSError, ValueError):
                f.close()
            if which == "log":
                self._log = None
            else:
                self._events = None
            name = Path(getattr(f, "name", which)).name
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            self._screen(self.stream).write(
                f"[{self.role}] WARNING: cannot write {name} in {self.run_dir} ({why}): "
                f"going on without it; what was written stays\n")

    def _write(self, level: str, message: str, stream: TextIO) -> None:
        """level: info, warning, error, or job (a line of the job's own output)."""
        message = self.redact(message)
        if level == "job":
            text = message
        else:
            label = {"warning": "WARNING: ", "error": "ERROR: "}.get(level, "")
            text = f"[{self.role}] {label}{message}"
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        # --quiet keeps what needs a person: warnings, errors and the job's own output.
        shown = not (self.quiet and level == "info")
        if shown and self.log_format == "json":
            text_out = json.dumps({"ts": stamp, "level": level, "role": self.role,
                                   "pod": self.pod, "message": message})
        else:
            text_out = text
        with self._lock:
            if shown:
                if stream is self.stream:
                    self._clear_live()
                self._screen(stream).write(text_out + "\n")
            self._to_file("log", f"{stamp} {text}\n")

    def say(self, message: str) -> None:
        self._write("info", message, self.stream)

    def warn(self, message: str) -> None:
        self._write("warning", message, self.stream)

    def error(self, message: str) -> None:
        self._write("error", message, sys.stderr)

    def raw(self, text: str) -> None:
        """A line of someone else's output (the job's), passed through as it is."""
        self._write("job", text, self.stream)

    def job_output(self) -> JobOutput:
        """Where a process's output goes as it comes (a launcher's training, teed): see
        JobOutput."""
        return JobOutput(self)

    def _job_records(self, lines: list[str]) -> None:
        """Lines of the job's output as JSON `job` records, on the screen only, in one write:
        a job that prints fast is not held to one lock and one write per line."""
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        text = "".join(json.dumps({"ts": stamp, "level": "job", "role": self.role,
                                   "pod": self.pod, "message": self.redact(line)}) + "\n"
                       for line in lines)
        with self._lock:
            self._clear_live()
            self._screen(self.stream).write(text)

    def _job_chunk(self, text: str) -> None:
        """A piece of the job's output as it came, on the screen only (text format)."""
        with self._lock:
            self._clear_live()
            self._screen(self.stream).write(self.redact(text))

    def log_only(self, message: str) -> None:
        """A line for the pod's log file but not the screen (the live line showed it)."""
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        with self._lock:
            self._to_file("log", f"{stamp} {self.redact(f'[{self.role}] {message}')}\n")

    def emergency(self, message: str) -> None:
        """The last line before a forced exit, from a signal handler: it takes no lock (the
        main thread may hold the reporter's, blocked in a write) and never waits for the
        screen; the pod's log file gets EMERGENCY_LOG_WAIT at most."""
        text = f"[{self.role}] ERROR: {self.redact(message)}"
        _Screen(sys.stderr).write(text + "\n", wait=0)
        log = self._log
        if log is None:
            return
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())

        def write() -> None:
            with contextlib.suppress(OSError, ValueError):
                log.write(f"{stamp} {text}\n")
                log.flush()

        writer = threading.Thread(target=write, name="last-line", daemon=True)
        writer.start()
        writer.join(EMERGENCY_LOG_WAIT)

    def live_line(self, message: str) -> None:
        """Rewrite the terminal's last line (a wait in progress); nothing when not live."""
        if not self.live:
            return
        text = self.redact(f"[{self.role}] {message}")
        with self._lock:
            self._live_shown = self._screen(self.stream).write(f"\r\x1b[2K{text}")

    def _redact_values(self, value: Any) -> Any:
        # Before serialising: JSON escapes quotes and non-ASCII, which would hide a secret.
        if isinstance(value, str):
            return self.redact(value)
        if isinstance(value, dict):
            return {k: self._redact_values(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self._redact_values(v) for v in value]
        return value

    def add_listener(self, listener: Callable[[dict[str, Any]], None]) -> None:
        """Also hand each event's record, redacted, to listener (e.g. the W&B bring-up run).

        A listener that raises is dropped with one warning: it never breaks podagent."""
        with self._lock:
            self._listeners.append(listener)

    def event(self, event: str, **fields: Any) -> None:
        # JSON output carries the events too, one record per line beside the messages: what
        # reads a pod's log stream (`podagent up`, a log collector) follows the run by them.
        shown = self.log_format == "json"
        if not self._events and not self._listeners and not shown:
            return
        # `event` is the record's kind and no field can change it: the cluster check's
        # summary comes from a job, and what a job says is never one of podagent's events.
        record = {"ts": round(time.time(), 3), "pod": self.pod, "role": self.role,
                  **fields, "event": event}
        line = json.dumps(self._redact_values(record), default=str)
        with self._lock:
            if shown:
                self._screen(self.stream).write(line + "\n")
            self._to_file("events", line + "\n")
            listeners = list(self._listeners)
        for listener in listeners:
            self._notify(listener, line)

    def _notify(self, listener: Callable[[dict[str, Any]], None], line: str) -> None:
        try:
            # What events.jsonl holds, parsed afresh: one listener cannot change what the next
            # one sees, and none sees a value the redaction did not.
            listener(json.loads(line))
        except Exception as exc:
            with self._lock:
                if listener not in self._listeners:
                    return
                self._listeners.remove(listener)
            name = getattr(listener, "__qualname__", type(listener).__name__)
            self.warn(f"event listener {name} failed and is switched off: "
                      f"{type(exc).__name__}: {exc}")

    @contextmanager
    def step(self, event: str) -> Iterator[Step]:
        """Times a step; prints its `done` message with the duration, records an event."""
        step = Step(self, event)
        try:
            yield step
        except BaseException as exc:
            self.event(event, result="failed", duration_s=round(step.elapsed, 3),
                       error=str(exc) or type(exc).__name__)
            raise
        if step.message:
            self.say(f"{step.message} ({step.elapsed:.1f} s)")
        self.event(event, result="ok", duration_s=round(step.elapsed, 3), **step.fields)


class Progress:
    """Long waits: a live line on a terminal (every call), and plain 'still waiting' lines
    every `every` seconds otherwise (and always in the pod's log file)."""

    def __init__(self, reporter: Reporter, every: float = 5.0):
        self.reporter, self.every = reporter, every
        self._next = time.monotonic() + every
        self._next_live = 0.0

    def __call__(self, message: str) -> None:
        now = time.monotonic()
        if self.reporter.live and now >= self._next_live:
            self._next_live = now + LIVE_INTERVAL
            self.reporter.live_line(message)
        if now >= self._next:
            self._next = now + self.every
            if self.reporter.live:
                self.reporter.log_only(message)
            else:
                self.reporter.say(message)


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed or not a real file
        return False
