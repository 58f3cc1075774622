"""Friendly step-by-step output, the pod's log file and events.jsonl, with secrets redacted."""

from __future__ import annotations

import json
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
                f.close()
        self._log = self._events = None

    def _clear_live(self) -> None:
        if self._live_shown:
            self.stream.write("\r\x1b[2K")
            self._live_shown = False

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
                print(text_out, file=stream, flush=True)
            if self._log:
                self._log.write(f"{stamp} {text}\n")

    def say(self, message: str) -> None:
        self._write("info", message, self.stream)

    def warn(self, message: str) -> None:
        self._write("warning", message, self.stream)

    def error(self, message: str) -> None:
        self._write("error", message, sys.stderr)

    def raw(self, text: str) -> None:
        """A line of someone else's output (the job's), passed through as it is."""
        self._write("job", text, self.stream)

    def log_only(self, message: str) -> None:
        """A line for the pod's log file but not the screen (the live line showed it)."""
        if self._log:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            with self._lock:
                self._log.write(f"{stamp} {self.redact(f'[{self.role}] {message}')}\n")

    def live_line(self, message: str) -> None:
        """Rewrite the terminal's last line (a wait in progress); nothing when not live."""
        if not self.live:
            return
        text = self.redact(f"[{self.role}] {message}")
        with self._lock:
            self.stream.write(f"\r\x1b[2K{text}")
            self.stream.flush()
            self._live_shown = True

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
        if not self._events and not self._listeners:
            return
        record = {"ts": round(time.time(), 3), "pod": self.pod, "role": self.role,
                  "event": event, **fields}
        line = json.dumps(self._redact_values(record), default=str)
        with self._lock:
            if self._events:
                self._events.write(line + "\n")
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
