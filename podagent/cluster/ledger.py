"""The run's ledger: a small JSON file in the run's log directory, on the volume that outlives
the container.

RunPod starts a container again when its process exits. A restarted head reads the ledger to
know what became of its run: finished (never run it again), interrupted mid-job (submit it
again, with the resume flag), or never got as far as a job. Every change is written whole and
atomically (temporary file, fsync, rename): a SIGKILL mid-write leaves the previous version.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

LEDGER = "ledger.json"
# The run ended for good: the job reached an end of its own, or someone asked for the end.
# Anything else (a signal, a lost Ray, workers that never came) leaves the run to a restart.
FINISHED = ("succeeded", "JobFailed", "JobStopped", "StopRequested", "RestartsExhausted")


class Ledger:
    def __init__(self, path: Path, data: dict[str, Any]):
        self.path, self.data = path, data

    @classmethod
    def load(cls, run_dir: Path, run_name: str) -> Ledger:
        """The run's ledger; an unreadable one is kept beside under another name, not lost."""
        path = run_dir / LEDGER
        data: dict[str, Any] = {}
        with contextlib.suppress(FileNotFoundError):
            try:
                data = json.loads(path.read_text())
                if not isinstance(data, dict):
                    raise ValueError("not an object")
            except ValueError:
                path.replace(path.with_name(f"{LEDGER}.unreadable-{int(time.time())}"))
                data = {}
        data.setdefault("run", run_name)
        for key in ("starts", "submissions"):
            data.setdefault(key, [])
        return cls(path, data)

    # --- what a restarted head asks ------------------------------------------------------------

    @property
    def finished(self) -> dict[str, Any] | None:
        """The run's end when it ended for good: {outcome, job_status, at, exit_code}."""
        return self.data.get("finished")

    @property
    def submissions(self) -> list[dict[str, Any]]:
        return self.data["submissions"]

    def open_submission(self) -> dict[str, Any] | None:
        """The last submission whose end was never recorded (its head died with it)."""
        last = self.submissions[-1] if self.submissions else None
        return last if last and last.get("status") is None else None

    def interrupted(self) -> dict[str, Any] | None:
        """The last submission, when the run did not finish after it: the job to resume."""
        return self.submissions[-1] if self.submissions and not self.finished else None

    def next_submission_id(self) -> str:
        """One id per attempt, each used once: `<run>-1`, `<run>-2`, ..."""
        return f"{self.data['run']}-{len(self.submissions) + 1}"

    def current_submission_id(self) -> str:
        return self.submissions[-1]["id"] if self.submissions else f"{self.data['run']}-1"

    @property
    def restarts(self) -> list[dict[str, Any]]:
        """The restarts after lost nodes (or failed jobs) so far, across container restarts."""
        return self.data.setdefault("restarts", [])

    # --- what the head records -----------------------------------------------------------------

    def started(self, pod: str) -> None:
        self.data["starts"].append({"at": _now(), "pod": pod, "pid": os.getpid()})
        self._write()

    def submitted(self, submission_id: str, resumed_from: str | None) -> None:
        self.submissions.append({"id": submission_id, "at": _now(),
                                 "resumed_from": resumed_from, "status": None})
        self._write()

    def job_ended(self, submission_id: str, status: str) -> None:
        for submission in self.submissions:
            if submission["id"] == submission_id and submission.get("status") is None:
                submission.update(status=status, ended_at=_now())
        self._write()

    def restarting(self, entry: dict[str, Any]) -> None:
        """A restart begins: why, who was lost; `resubmitted()` completes the entry."""
        self.restarts.append({"at": _now(), **entry})
        self._write()

    def resubmitted(self, submission_id: str, **figures: Any) -> None:
        self.restarts[-1].update(submission=submission_id, **figures)
        self._write()

    def ended(self, outcome: str, job_status: str | None) -> None:
        """This start of the run is over; a finished outcome ends the run for good."""
        if self.data["starts"]:
            self.data["starts"][-1].update(ended_at=_now(), outcome=outcome)
        if outcome in FINISHED:
            self.data["finished"] = {"outcome": outcome, "job_status": job_status,
                                     "at": _now(), "exit_code": None}
        self._write()

    def exit_code(self, code: int) -> None:
        """The code this start exited with (chosen by the CLI), for a restart to repeat."""
        if self.finished is not None and self.finished.get("exit_code") is None:
            self.finished["exit_code"] = code
            self._write()

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{LEDGER}.{os.getpid()}")
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(self.path)


def _now() -> float:
    return round(time.time(), 3)
