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


class Reporter:
    def __init__(
        self,
        role: str,
        pod: str,
        run_dir: Path | None,
        secrets: Iterable[str] = (),
        stream: TextIO | None = None,
    ):
        self.role, self.pod = role, pod
        self.redact = Redactor(secrets)
        self.stream = stream or sys.stdout
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
        for f in (self._log, self._events):
            if f:
                f.close()
        self._log = self._events = None

    def _write(self, text: str, stream: TextIO) -> None:
        text = self.redact(text)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        with self._lock:
            print(text, file=stream, flush=True)
            if self._log:
                self._log.write(f"{stamp} {text}\n")

    def say(self, message: str) -> None:
        self._write(f"[{self.role}] {message}", self.stream)

    def warn(self, message: str) -> None:
        self._write(f"[{self.role}] WARNING: {message}", self.stream)

    def error(self, message: str) -> None:
        self._write(f"[{self.role}] ERROR: {message}", sys.stderr)

    def raw(self, text: str) -> None:
        """A line of someone else's output (the job's), passed through as it is."""
        self._write(text, self.stream)

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
    """Rate-limited 'still waiting' lines for long waits."""

    def __init__(self, reporter: Reporter, every: float = 5.0):
        self.reporter, self.every = reporter, every
        self._next = time.monotonic() + every

    def __call__(self, message: str) -> None:
        now = time.monotonic()
        if now >= self._next:
            self._next = now + self.every
            self.reporter.say(message)
