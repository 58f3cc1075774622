"""The training job: submitted once per run (a stable submission id), followed, stopped."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shlex
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import requests
from tenacity import (
    Retrying,
    retry_if_exception_type,
    retry_if_result,
    stop_after_delay,
    wait_fixed,
)

from podagent.checks.clustercheck import JSON_PREFIX as CHECK_JSON_PREFIX
from podagent.errors import JobFailed, JobStopped, JobSubmitFailed
from podagent.report import Reporter
from podagent.waiting import Deadline, Signals

TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
# Ray's SDK sends its HTTP requests without a timeout; with the GCS gone the dashboard holds
# them for about a minute. Status and stop go through these bounded requests instead.
HTTP_TIMEOUT = 5.0


SUBMIT_TIMEOUT = 120.0
TAIL_GRACE = 1.0  # seconds the log stream gets to end by itself once the job is over


class JobApiUnreachable(Exception):
    """The dashboard did not answer in time (or at all)."""


class _Retry(Exception):
    pass


class JobRunner:
    """One Ray job through the Jobs API of the head's dashboard."""

    def __init__(self, dashboard_url: str, submission_id: str, reporter: Reporter,
                 job_log: Path, headers: Mapping[str, str] | None = None):
        from ray.job_submission import JobSubmissionClient  # heavy: only the head needs it

        # Ray's SDK logs its own chatter (websocket closed...) to our stdout; keep it quiet.
        logging.getLogger("ray.dashboard.modules.job.sdk").setLevel(logging.WARNING)

        self.url = dashboard_url.rstrip("/")
        self.headers = dict(headers or {})
        self.client = JobSubmissionClient(dashboard_url, headers=self.headers)
        self.submission_id = submission_id
        self.reporter = reporter
        self.job_log = job_log
        self._streamed = 0  # characters of log already shown
        self._log_file = None
        self._tail: threading.Thread | None = None
        self._write_lock = threading.Lock()
        self._log_done = False  # the full log was written: late stream chunks are dropped

    def for_submission(self, submission_id: str) -> JobRunner:
        """A runner for another job of the same dashboard (each attempt has its own id, log
        position and stream)."""
        return JobRunner(self.url, submission_id, self.reporter, self.job_log, self.headers)

    # --- bounded Jobs API calls ----------------------------------------------------------------

    def _request(self, method: str, path: str, timeout: float = HTTP_TIMEOUT,
                 job: str | None = None) -> requests.Response | None:
        """None for 404 (no such job); raises JobApiUnreachable when the API does not answer.
        `job`: another submission id than this runner's."""
        try:
            reply = requests.request(method,
                                     f"{self.url}/api/jobs/{job or self.submission_id}{path}",
                                     headers=self.headers, timeout=timeout)
        except requests.RequestException as exc:
            raise JobApiUnreachable(f"{method} {path or '/'}: {exc}") from None
        if reply.status_code == 404:
            return None
        if reply.status_code >= 400:
            raise JobApiUnreachable(f"{method} {path or '/'}: HTTP {reply.status_code}")
        return reply

    def info(self) -> dict[str, Any] | None:
        reply = self._request("GET", "")
        return reply.json() if reply is not None else None

    def status(self) -> str | None:
        """The job's status, or None when Ray has no such job."""
        info = self.info()
        return str(info["status"]) if info else None

    # --- lifecycle -----------------------------------------------------------------------------

    def submit(self, entrypoint: Sequence[str], env_vars: Mapping[str, str],
               working_dir: str | None, metadata: Mapping[str, str], signals: Signals) -> bool:
        """Submit, or find the job this run already submitted. True when newly submitted.

        Right after start-up the Jobs API can answer before the head's dashboard agent has
        registered ("No available agent to submit job, please try again later"): that, and
        other 5xx answers, are retried for SUBMIT_TIMEOUT.
        """
        if self.status() is not None:
            return False
        runtime_env: dict[str, Any] = {"env_vars": dict(env_vars)}
        if working_dir:
            runtime_env["working_dir"] = working_dir
        last = {"error": ""}

        def attempt() -> None:
            try:
                self.client.submit_job(
                    entrypoint=shlex.join(entrypoint), submission_id=self.submission_id,
                    runtime_env=runtime_env, metadata=dict(metadata),
                )
            except RuntimeError as exc:  # Ray's client raises RuntimeError for HTTP errors
                last["error"] = str(exc)
                if "status code 5" not in str(exc):
                    raise JobSubmitFailed(f"Ray refused the job: {exc}") from None
                if self.status() is not None:  # it was accepted after all
                    return
                raise _Retry(str(exc)) from None

        try:
            Retrying(stop=stop_after_delay(SUBMIT_TIMEOUT), wait=wait_fixed(0.5),
                     retry=retry_if_exception_type(_Retry), sleep=signals.sleep,
                     reraise=True)(attempt)
        except _Retry:
            raise JobSubmitFailed(f"the Jobs API did not accept the job within "
                                  f"{SUBMIT_TIMEOUT:g} s; last answer: {last['error']}") from None
        return True

    def _write(self, chunk: str) -> None:
        """A chunk of the stream: appended to job.log and the screen, unless the log was
        already completed from the full log (then it is a copy)."""
        with self._write_lock:
            if not self._log_done:
                self._append(chunk)

    def _append(self, chunk: str) -> None:
        if chunk:
            self._streamed += len(chunk)
            assert self._log_file is not None
            self._log_file.write(chunk)
            self._log_file.flush()
            for line in chunk.splitlines():
                if line.startswith(CHECK_JSON_PREFIX):
                    # The cluster check's machine-readable summary: an event, not screen text.
                    with contextlib.suppress(ValueError):
                        result = json.loads(line[len(CHECK_JSON_PREFIX):])
                        self.reporter.event("check", **result)
                    continue
                self.reporter.raw(line)

    def _tail_forever(self) -> None:
        async def tail() -> None:
            async for chunk in self.client.tail_job_logs(self.submission_id):
                self._write(chunk)

        # The stream is best effort; follow() reconciles with the full log at the end.
        with contextlib.suppress(Exception):
            asyncio.run(tail())

    def follow(self, signals: Signals, on_tick: Callable[[], None] = lambda: None,
               poll: float = 0.5) -> str:
        """Stream the job's output until it ends; returns its terminal status.

        on_tick runs every poll: the head uses it to watch its own Ray and the nodes, and it
        ends the wait by raising. A dashboard that does not answer is not an ending by itself.
        """
        self.job_log.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.job_log, "a")
        self._tail = threading.Thread(target=self._tail_forever, name="job-log", daemon=True)
        self._tail.start()
        while True:
            with contextlib.suppress(JobApiUnreachable):
                status = self.status()
                if status in TERMINAL:
                    break
            on_tick()
            signals.sleep(poll)
        self.finish_log()
        return status

    def finish_log(self) -> None:
        """The job is over: the rest of its log (the stream may have missed the end)."""
        if self._tail:
            # The stream ends by itself a few seconds after the job; the full log below has
            # whatever it has not delivered yet, so a lost node is acted on without waiting.
            self._tail.join(timeout=TAIL_GRACE)
        with contextlib.suppress(JobApiUnreachable, ValueError, KeyError):
            reply = self._request("GET", "/logs")
            full = reply.json()["logs"] if reply is not None else ""
            with self._write_lock:  # the stream may still be writing: take over from it
                self._append(full[self._streamed:])
        with self._write_lock:
            self._log_done = True  # also when the full log could not be read
            if self._log_file:
                self._log_file.close()

    def stop_earlier_attempts(self, run_name: str, timeout: float) -> None:
        """Before a submission: every other job of this run (metadata podagent_run) must be
        over; one still alive is stopped, and if it does not end in time nothing is submitted.
        """
        try:
            reply = requests.get(f"{self.url}/api/jobs/", headers=self.headers,
                                 timeout=HTTP_TIMEOUT)
            reply.raise_for_status()
            jobs = reply.json()
        except (requests.RequestException, ValueError) as exc:
            raise JobSubmitFailed(f"could not list the run's earlier jobs to make sure none is "
                                  f"alive ({exc}); not submitting a second one") from None
        alive = [j["submission_id"] for j in jobs
                 if (j.get("metadata") or {}).get("podagent_run") == run_name
                 and j.get("submission_id") not in (None, self.submission_id)
                 and j.get("status") not in TERMINAL]
        for earlier in alive:
            self.reporter.warn(f"an earlier attempt of the run, job {earlier}, is still alive: "
                               f"stopping it before submitting {self.submission_id}")
            final = self.stop(timeout, job=earlier)
            if final not in TERMINAL:
                raise JobSubmitFailed(f"job {earlier}, an earlier attempt of the run, is still "
                                      f"{final or 'unknown'} {timeout:g} s after being asked "
                                      f"to stop; not submitting a second job")
        self.reporter.event("earlier_attempts", checked=len(jobs), stopped=alive)

    def outcome(self, status: str) -> None:
        """Raise for a job that did not succeed, with the first line of Ray's reason."""
        if status == "SUCCEEDED":
            return
        message = ""
        with contextlib.suppress(JobApiUnreachable, ValueError):
            message = (self.info() or {}).get("message") or ""
        # Ray appends the job's last output to its message; that is in job.log already.
        reason = message.split(", last available logs")[0].splitlines()[0] if message else ""
        where = f"(output in {self.job_log})"
        if status == "STOPPED":
            raise JobStopped(f"job {self.submission_id} was stopped {where}")
        raise JobFailed(f"job {self.submission_id} failed: {reason or status} {where}")

    def stop(self, timeout: float | Deadline, while_waiting: Callable[[], None] | None = None,
             job: str | None = None) -> str | None:
        """Ask Ray to stop the job (or another, `job`) and wait (bounded) until it is over;
        `while_waiting` is called before each look at its status.

        Returns its last status, or None when the dashboard could not tell.
        """
        deadline = Deadline.of(timeout)

        def left() -> float:  # every request within the caller's deadline
            return max(0.2, min(HTTP_TIMEOUT, deadline.left()))

        def status_or_none() -> str | None:
            if while_waiting is not None:
                while_waiting()
            try:
                reply = self._request("GET", "", timeout=left(), job=job)
                return str(reply.json()["status"]) if reply is not None else None
            except (JobApiUnreachable, ValueError, KeyError, TypeError):
                return None

        with contextlib.suppress(JobApiUnreachable):
            self._request("POST", "/stop", timeout=left(), job=job)
        return Retrying(
            stop=lambda _state: deadline.passed, wait=wait_fixed(0.2),
            retry=retry_if_result(lambda status: status not in TERMINAL and status is not None),
            retry_error_callback=lambda state: state.outcome.result(),
        )(status_or_none)
