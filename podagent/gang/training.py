"""This pod's launcher (torchrun, or accelerate launch) for one step of a run without Ray.

It runs in a session of its own; its output goes to podagent's own (the pod's screen) and to
the run's training log, which `podagent logs` reads. Stopping it stops every process podagent
has under it: the launcher starts its workers in sessions of their own, so its process group
does not hold them, but podagent is a child subreaper and they stay its descendants.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from podagent import process
from podagent.waiting import Deadline

CHUNK = 1 << 16


class Training:
    """One step's launcher on this pod: started in its own session, its output teed to the
    training log, and stopped with everything under it."""

    def __init__(self, step: str, argv: Sequence[str], env: Mapping[str, str], log_path: Path):
        self.step, self.argv, self.env, self.log_path = step, list(argv), dict(env), log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self._pump: threading.Thread | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        sys.stdout.flush()
        self.proc = subprocess.Popen(self.argv, env=self.env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self._pump = threading.Thread(target=self._copy, args=(self.proc.stdout,),
                                      name="podagent-training-output", daemon=True)
        self._pump.start()

    def _copy(self, pipe: object) -> None:
        """The launcher's output (and its workers', which share the pipe) to the screen and
        the training log, as it comes."""
        fd = pipe.fileno()  # type: ignore[attr-defined]
        out = sys.stdout.buffer
        with open(self.log_path, "ab") as log:
            while chunk := os.read(fd, CHUNK):
                with contextlib.suppress(OSError, ValueError):
                    out.write(chunk)
                    out.flush()
                log.write(chunk)
                log.flush()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def poll(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def stop(self, deadline: Deadline) -> tuple[int, int]:
        """Everything podagent has under it, TERM -> deadline -> KILL (termed, killed)."""
        result = process.stop_processes(process.descendants(), deadline)
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=1)
        self.finish_output()
        process.reap_zombies()
        return result

    def finish_output(self) -> None:
        """Let the last of the output reach the screen and the log (bounded: a process that
        kept the pipe open and escaped is not waited for)."""
        if self._pump is not None:
            self._pump.join(timeout=2)
