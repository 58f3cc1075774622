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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from podagent.errors import LedgerError
from podagent.report import Reporter
from podagent.wire import Ending, Event

LEDGER = "ledger.json"
# The outcome of a run that succeeded (the others are an error's class name, or left).
SUCCEEDED = Ending.SUCCEEDED.value
# The outcome of a start that ended in a bug of podagent's (the CLI's exit 70).
INTERNAL_ERROR = "InternalError"
# The run ended for good: the job reached an end of its own, or someone asked for the end.
# Anything else (a signal, a lost Ray, workers that never came) leaves the run to a restart.
FINISHED = (SUCCEEDED, "JobFailed", "JobStopped", "StopRequested", "RestartsExhausted",
            "DataOverlap", "RunHung", "DeadlineReached")
# So many starts in a row ending in an internal error end the run for good: the same bug
# would meet every restarted container, billing GPUs in a loop.
INTERNAL_ERRORS_IN_A_ROW = 3


class Ledger:
    """The run's record on the volume: its starts, submissions, restarts and end, each
    change written whole and atomically."""

    def __init__(self, path: Path, data: dict[str, Any]):
        self.path, self.data = path, data

    @classmethod
    def load(cls, run_dir: Path, run_name: str) -> Ledger:
        """The run's ledger; an unreadable one is kept beside under another name, not lost.
        A pod whose run began under the layout before per-pod directories (the ledger
        directly in the run's directory) carries on from that one, left where it is: a run
        it finished stays finished, its restarts stay counted."""
        path = run_dir / LEDGER
        earlier = legacy(path)
        source = earlier if not path.exists() and earlier.is_file() else path
        data: dict[str, Any] = {}
        try:
            data = json.loads(source.read_text())
            if not isinstance(data, dict):
                raise ValueError("not an object")
        except FileNotFoundError:
            data = {}
        except ValueError:
            if source is path:
                try:
                    path.replace(path.with_name(f"{LEDGER}.unreadable-{int(time.time())}"))
                except OSError as exc:
                    raise LedgerError(f"the run's ledger {path} is unreadable and cannot be "
                                      f"set aside: {exc.strerror}") from None
            data = {}
        except OSError as exc:
            raise LedgerError(f"cannot read the run's ledger {source}: {exc.strerror}"
                              ) from None
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
        """Every restart of the run so far, whatever its cause (a lost pod, a hang, a failed
        job), across container restarts: what PODAGENT_RESTARTS bounds."""
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

    @property
    def start_ended(self) -> bool:
        """Whether this start's end is recorded already."""
        return bool(self.data["starts"]) and "outcome" in self.data["starts"][-1]

    def ended(self, outcome: str, job_status: str | None) -> None:
        """This start of the run is over; a finished outcome ends the run for good. Its exit
        code follows from the outcome (run/exits.py) and is added by `exit_code()`."""
        if self.data["starts"]:
            self.data["starts"][-1].update(ended_at=_now(), outcome=outcome)
        if outcome in FINISHED:
            self.data["finished"] = {"outcome": outcome, "job_status": job_status, "at": _now()}
        elif outcome == INTERNAL_ERROR and self._internal_errors_in_a_row():
            self.data["finished"] = {
                "outcome": outcome, "job_status": job_status, "at": _now(),
                "reason": f"{INTERNAL_ERRORS_IN_A_ROW} starts in a row ended in an internal "
                          f"error"}
        self._write()

    def _internal_errors_in_a_row(self) -> bool:
        last = self.data["starts"][-INTERNAL_ERRORS_IN_A_ROW:]
        return (len(last) == INTERNAL_ERRORS_IN_A_ROW
                and all(start.get("outcome") == INTERNAL_ERROR for start in last))

    def exit_code(self, code: int) -> None:
        """The code this start exited with (run/exits.py): on the start, and on the
        run's end when this start finished it."""
        if self.data["starts"]:
            self.data["starts"][-1]["exit_code"] = code
        if self.finished is not None and self.finished.get("exit_code") is None:
            self.finished["exit_code"] = code
        self._write()

    def finished_code(self, code: int) -> None:
        """The run's code, on its end only, where the start that finished it left none."""
        if self.finished is not None and self.finished.get("exit_code") is None:
            self.finished["exit_code"] = code
            self._write()

    def save(self) -> None:
        """Written as it is now (a part of the run that keeps its own entry: the head's
        replacements)."""
        self._write()

    def _write(self) -> None:
        """Whole or not at all; a volume that refuses (full, read-only) is a LedgerError, and
        what was asked stays in memory for the next write."""
        tmp = self.path.with_name(f".{LEDGER}.{os.getpid()}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "w") as f:
                json.dump(self.data, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            tmp.replace(self.path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise LedgerError(f"cannot write the run's ledger {self.path} "
                              f"({exc.strerror or exc}): a restarted head will not know what "
                              f"this one did") from None


def legacy(path: Path) -> Path:
    """Where the layout before per-pod directories kept this pod file of the run: in the
    run's directory itself (<log dir>/<run>/), not in the pod's (<log dir>/<run>/<pod>/)."""
    return path.parent.parent / path.name


def record_or_warn(write: Callable[[], None], reporter: Reporter) -> None:
    """A ledger entry while the run goes on: one the volume refuses is a warning, not the
    run's end (the job's own outcome matters more). The records that keep a job from running
    twice (the start, each submission) are not written through here: without them nothing is
    submitted (LedgerError)."""
    try:
        write()
    except LedgerError as exc:
        reporter.warn(str(exc))


def recall(ledger: Ledger, run_name: str, run_dir: Path,
           reporter: Reporter) -> dict[str, Any] | None:
    """A head's first step: the run's end when an earlier start finished it (not run again);
    otherwise this start is recorded, and a job it interrupted is said to run again."""
    finished = ledger.finished
    if finished:
        at = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(finished["at"]))
        job = f", job {finished['job_status']}" if finished.get("job_status") else ""
        why = f": {finished['reason']}" if finished.get("reason") else ""
        reporter.say(f"run {run_name} finished earlier ({finished['outcome']}{job}, {at} UTC"
                     f"{why}): not running it again; logs in {run_dir} (a new "
                     f"PODAGENT_RUN_NAME starts a new run)")
        reporter.event(Event.FINISHED_EARLIER, **finished)
        return finished
    ledger.started(reporter.pod)
    interrupted = ledger.interrupted()
    if interrupted:
        reporter.say(f"run {run_name} was interrupted (job {interrupted['id']}: "
                     f"{interrupted.get('status') or 'running when its head stopped'}); it "
                     f"runs again, resuming from a checkpoint if there is one")
        reporter.event(Event.RUN_INTERRUPTED_EARLIER, submission=interrupted["id"],
                       status=interrupted.get("status"))
    return None


def _now() -> float:
    return round(time.time(), 3)
