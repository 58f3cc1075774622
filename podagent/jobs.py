"""The training job: submitted once per run (a stable submission id), followed, stopped."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shlex
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tenacity import Retrying, retry_if_result, stop_after_delay, wait_fixed

from podagent.errors import JobFailed, JobStopped
from podagent.report import Reporter
from podagent.waiting import Signals

TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


class JobRunner:
    """One Ray job through the Jobs API of the head's dashboard."""

    def __init__(self, dashboard_url: str, submission_id: str, reporter: Reporter,
                 job_log: Path, headers: Mapping[str, str] | None = None):
        from ray.job_submission import JobSubmissionClient  # heavy: only the head needs it

        # Ray's SDK logs its own chatter (websocket closed...) to our stdout; keep it quiet.
        logging.getLogger("ray.dashboard.modules.job.sdk").setLevel(logging.WARNING)

        self.client = JobSubmissionClient(dashboard_url, headers=dict(headers or {}))
        self.submission_id = submission_id
        self.reporter = reporter
        self.job_log = job_log
        self._streamed = 0  # characters of log already shown
        self._log_file = None
        self._tail: threading.Thread | None = None

    def status(self) -> str | None:
        with contextlib.suppress(Exception):
            return str(self.client.get_job_status(self.submission_id))
        return None

    def submit(self, entrypoint: Sequence[str], env_vars: Mapping[str, str],
               working_dir: str | None, metadata: Mapping[str, str]) -> bool:
        """Submit, or find the job this run already submitted. True when newly submitted."""
        existing = self.status()
        if existing is not None:
            return False
        runtime_env: dict[str, Any] = {"env_vars": dict(env_vars)}
        if working_dir:
            runtime_env["working_dir"] = working_dir
        self.client.submit_job(
            entrypoint=shlex.join(entrypoint), submission_id=self.submission_id,
            runtime_env=runtime_env, metadata=dict(metadata),
        )
        return True

    def _write(self, chunk: str) -> None:
        self._streamed += len(chunk)
        assert self._log_file is not None
        self._log_file.write(chunk)
        self._log_file.flush()
        for line in chunk.splitlines():
            self.reporter.raw(line)

    def _tail_forever(self) -> None:
        async def tail() -> None:
            async for chunk in self.client.tail_job_logs(self.submission_id):
                self._write(chunk)

        # The stream is best effort; follow() reconciles with the full log at the end.
        with contextlib.suppress(Exception):
            asyncio.run(tail())

    def follow(self, signals: Signals, poll: float = 0.5) -> str:
        """Stream the job's output until it ends; returns its terminal status."""
        self.job_log.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.job_log, "a")
        self._tail = threading.Thread(target=self._tail_forever, name="job-log", daemon=True)
        self._tail.start()
        while True:
            status = self.status()
            if status in TERMINAL:
                break
            signals.sleep(poll)
        self._finish_log()
        return status

    def _finish_log(self) -> None:
        if self._tail:
            self._tail.join(timeout=5)  # the stream ends by itself once the job is over
        with contextlib.suppress(Exception):
            full = self.client.get_job_logs(self.submission_id)
            if len(full) > self._streamed:
                self._write(full[self._streamed:])
        if self._log_file:
            self._log_file.close()

    def outcome(self, status: str) -> None:
        """Raise for a job that did not succeed, with Ray's own words for why."""
        if status == "SUCCEEDED":
            return
        message = ""
        with contextlib.suppress(Exception):
            message = self.client.get_job_info(self.submission_id).message or ""
        if status == "STOPPED":
            raise JobStopped(f"job {self.submission_id} was stopped. {message}".strip())
        raise JobFailed(f"job {self.submission_id} failed: {message or status}")

    def stop(self, timeout: float) -> str | None:
        """Ask Ray to stop the job and wait (bounded) until it is over; returns its status."""
        with contextlib.suppress(Exception):
            self.client.stop_job(self.submission_id)
        return Retrying(
            stop=stop_after_delay(timeout), wait=wait_fixed(0.2),
            retry=retry_if_result(lambda status: status not in TERMINAL and status is not None),
            retry_error_callback=lambda state: state.outcome.result(),
        )(self.status)
