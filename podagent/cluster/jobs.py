"""The training job: submitted once per run (a stable submission id), followed, stopped."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shlex
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import requests

from podagent.choices import JOB_TERMINAL
from podagent.cluster.runstate import CHECK_JSON_PREFIX
from podagent.errors import DashboardSilent, JobFailed, JobStopped, JobSubmitFailed
from podagent.report import Reporter
from podagent.waiting import Backoff, Deadline, Expired, Signals, interruptible, retry
from podagent.wire import Event

T = TypeVar("T")

# Ray's SDK sends its HTTP requests without a timeout; with the GCS gone the dashboard holds
# them for about a minute. Status and stop go through these bounded requests instead.
HTTP_TIMEOUT = 5.0
# One request of Ray's own client (submit_job, and the working dir's upload, which may be
# large): a socket that stays silent this long has failed, and the submission is retried.
CLIENT_REQUEST_TIMEOUT = 60.0
SUBMIT_TIMEOUT = 120.0  # the whole submission: earlier attempts checked, the job accepted
SUBMIT_RETRY_MAX_WAIT = 2.0
TAIL_GRACE = 1.0  # seconds the log stream gets to end by itself once the job is over
# A job is followed through the dashboard: one that has not answered for this long while the
# GCS lives is not coming back (Ray does not restart it), and the run cannot be followed.
DASHBOARD_SILENT_LIMIT = 30.0


class JobApiUnreachable(Exception):
    """The dashboard did not answer in time, answered 5xx or dropped the connection: asking
    again later may work."""


class JobApiRefused(Exception):
    """The dashboard answered with a 4xx other than 404 (a missing token, say): asking again
    does not help."""


def _client(dashboard_url: str, headers: Mapping[str, str]) -> Any:
    """Ray's job client with a timeout on each of its requests (it sends them with none;
    `_do_request` forwards its keyword arguments to requests in every supported Ray)."""
    from ray.job_submission import JobSubmissionClient  # heavy: only the head needs it

    class BoundedClient(JobSubmissionClient):  # type: ignore[misc, valid-type]
        def _do_request(self, method: str, endpoint: str, **kwargs: Any) -> Any:
            kwargs.setdefault("timeout", CLIENT_REQUEST_TIMEOUT)
            return super()._do_request(method, endpoint, **kwargs)

    return BoundedClient(dashboard_url, headers=dict(headers))


class JobRunner:
    """One Ray job through the Jobs API of the head's dashboard."""

    def __init__(self, dashboard_url: str, submission_id: str, reporter: Reporter,
                 job_log: Path, headers: Mapping[str, str] | None = None,
                 client: Any = None, check: bool = False):
        # Ray's SDK logs its own chatter (websocket closed...) to our stdout; keep it quiet.
        logging.getLogger("ray.dashboard.modules.job.sdk").setLevel(logging.WARNING)

        self.url = dashboard_url.rstrip("/")
        self.headers = dict(headers or {})
        # Made once (its constructor asks the dashboard for its version) and shared.
        self.client = client or _client(dashboard_url, self.headers)
        self.submission_id = submission_id
        self.reporter = reporter
        self.job_log = job_log
        # The job is podagent's cluster check: its summary line is an event. A user's job
        # printing that line is only output.
        self.check = check
        self._log: JobLog | None = None  # while the job is followed

    def for_submission(self, submission_id: str) -> JobRunner:
        """A runner for another job of the same dashboard (each attempt has its own id, log
        position and stream)."""
        return JobRunner(self.url, submission_id, self.reporter, self.job_log, self.headers,
                         self.client, self.check)

    # --- bounded Jobs API calls ----------------------------------------------------------------

    def _request(self, method: str, path: str, timeout: float | None = None,
                 job: str | None = None) -> requests.Response | None:
        """None for 404 (no such job); raises JobApiUnreachable when the API does not answer.
        `job`: another submission id than this runner's."""
        try:
            reply = requests.request(method,
                                     f"{self.url}/api/jobs/{job or self.submission_id}{path}",
                                     headers=self.headers, timeout=timeout or HTTP_TIMEOUT)
        except requests.RequestException as exc:
            raise JobApiUnreachable(f"{method} {path or '/'}: {exc}") from None
        if reply.status_code == 404:
            return None
        _raise_for(reply, f"{method} {path or '/'}")
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
               working_dir: str | None, metadata: Mapping[str, str], signals: Signals,
               deadline: Deadline | None = None) -> bool:
        """Submit, or find the job this run already submitted. True when newly submitted.

        Right after start-up the Jobs API can answer before the head's dashboard agent has
        registered ("No available agent to submit job, please try again later"); a busy
        dashboard can answer 5xx, time out or drop a connection: all of that is retried until
        the deadline (SUBMIT_TIMEOUT by default). A refusal (4xx) is not.
        """
        deadline = deadline or Deadline.after(SUBMIT_TIMEOUT)
        runtime_env: dict[str, Any] = {"env_vars": dict(env_vars)}
        if working_dir:
            runtime_env["working_dir"] = working_dir

        posted = {"yet": False}

        def attempt() -> bool:
            if self.status() is not None:
                # Ours when an earlier attempt sent it (its answer was lost); otherwise a job
                # this run submitted before (a head that re-attaches finds it so).
                return posted["yet"]
            posted["yet"] = True
            try:
                # Ray's client waits in a socket read for up to CLIENT_REQUEST_TIMEOUT.
                interruptible(lambda: self.client.submit_job(
                    entrypoint=shlex.join(entrypoint), submission_id=self.submission_id,
                    runtime_env=runtime_env, metadata=dict(metadata)), signals)
            except requests.RequestException as exc:  # timed out, connection dropped
                raise JobApiUnreachable(f"POST /api/jobs/: {exc}") from None
            except RuntimeError as exc:  # Ray's client raises RuntimeError for HTTP errors
                if "status code 5" in str(exc):
                    raise JobApiUnreachable(str(exc)) from None
                raise JobSubmitFailed(f"Ray refused the job: {exc}") from None
            return True

        return self._within(deadline, signals, "accept the job", attempt)

    def _within(self, deadline: Deadline, signals: Signals, what: str,
                attempt: Callable[[], T]) -> T:
        """attempt() again while the Jobs API is unreachable, until the deadline; then
        JobSubmitFailed naming what was awaited and the last answer. A refusal ends at once."""
        def once() -> T:
            try:
                return attempt()
            except JobApiRefused as exc:
                raise JobSubmitFailed(f"the Jobs API at {self.url} refused to {what}: {exc}"
                                      ) from None

        return retry(once, awaited=f"the Jobs API at {self.url} to {what}",
                     backoff=Backoff(0.2, SUBMIT_RETRY_MAX_WAIT), deadline=deadline,
                     sleep=signals.sleep, on=(JobApiUnreachable,),
                     expired=lambda gave_up: JobSubmitFailed(
                         f"the Jobs API at {self.url} did not {what} within "
                         f"{SUBMIT_TIMEOUT:g} s; last answer: {gave_up.seen}"))

    def follow(self, signals: Signals, on_tick: Callable[[], None] = lambda: None,
               poll: float = 0.5, on_output: Callable[[str], None] = lambda text: None) -> str:
        """Stream the job's output until it ends; returns its terminal status.

        on_tick runs every poll: the head uses it to watch its own Ray, the nodes and the
        job's progress (on_output sees each chunk of its output), and it ends the wait by
        raising. A dashboard that does not answer for a moment is not an
        ending; one silent for DASHBOARD_SILENT_LIMIT is (DashboardSilent).
        """
        self._log = JobLog(self.client, self.submission_id, self.reporter, self.job_log,
                           on_output, check=self.check)
        self._log.open()
        silent_since: float | None = None
        while True:
            try:
                status = self.status()
                silent_since = None
                if status in JOB_TERMINAL:
                    break
            except (JobApiUnreachable, JobApiRefused) as exc:
                now = time.monotonic()
                silent_since = silent_since or now
                if now - silent_since >= DASHBOARD_SILENT_LIMIT:
                    raise DashboardSilent(
                        f"the Ray dashboard (Jobs API) at {self.url} has not answered for "
                        f"{now - silent_since:.0f} s, so job {self.submission_id} cannot be "
                        f"followed; last answer: {exc}") from None
            on_tick()
            signals.sleep(poll)
        self.finish_log()
        return status

    def finish_log(self) -> None:
        """The job is over: the rest of its log (the stream may have missed the end)."""
        def full() -> str:
            with contextlib.suppress(JobApiUnreachable, ValueError, KeyError):
                reply = self._request("GET", "/logs")
                return str(reply.json()["logs"]) if reply is not None else ""
            return ""

        if self._log is not None:
            self._log.complete(full)

    def stop_earlier_attempts(self, run_name: str, timeout: float, signals: Signals,
                              deadline: Deadline | None = None) -> None:
        """Before a submission: every other job of this run (metadata podagent_run) must be
        over; one still alive is stopped, and if it does not end in time nothing is submitted.
        The list is asked for again while the Jobs API is unreachable (until the deadline).
        """
        def listed() -> list[dict[str, Any]]:
            try:
                reply = requests.get(f"{self.url}/api/jobs/", headers=self.headers,
                                     timeout=HTTP_TIMEOUT)
            except requests.RequestException as exc:
                raise JobApiUnreachable(f"GET /api/jobs/: {exc}") from None
            _raise_for(reply, "GET /api/jobs/")
            try:
                jobs = reply.json()
            except ValueError:
                raise JobApiUnreachable("GET /api/jobs/: not a job list") from None
            return jobs if isinstance(jobs, list) else []

        jobs = self._within(deadline or Deadline.after(SUBMIT_TIMEOUT), signals,
                            "list the run's earlier jobs (to make sure none is alive)", listed)
        alive = [j["submission_id"] for j in jobs
                 if (j.get("metadata") or {}).get("podagent_run") == run_name
                 and j.get("submission_id") not in (None, self.submission_id)
                 and j.get("status") not in JOB_TERMINAL]
        for earlier in alive:
            self.reporter.warn(f"an earlier attempt of the run, job {earlier}, is still alive: "
                               f"stopping it before submitting {self.submission_id}")
            final = self.stop(timeout, job=earlier)
            if final not in JOB_TERMINAL:
                raise JobSubmitFailed(f"job {earlier}, an earlier attempt of the run, is still "
                                      f"{final or 'unknown'} {timeout:g} s after being asked "
                                      f"to stop; not submitting a second job")
        self.reporter.event(Event.EARLIER_ATTEMPTS, checked=len(jobs), stopped=alive)

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
        try:
            return retry(status_or_none, awaited=f"job {job or self.submission_id} to end",
                         backoff=Backoff.every(0.2), deadline=deadline,
                         until=lambda status: status is None or status in JOB_TERMINAL)
        except Expired as exc:
            return exc.last


def _raise_for(reply: requests.Response, what: str) -> None:
    """5xx: unreachable for now (retried); another 4xx than 404: refused (not retried)."""
    if reply.status_code >= 500:
        raise JobApiUnreachable(f"{what}: HTTP {reply.status_code}")
    if reply.status_code >= 400 and reply.status_code != 404:
        raise JobApiRefused(f"{what}: HTTP {reply.status_code} {reply.text[:200]}")


class JobLog:
    """The job's output while it is followed: streamed from Ray to the screen and to job.log
    (a copy: Ray keeps its own), the cluster check's summary line turned into an event, and
    at the end completed from the full log, which the stream may not have delivered yet."""

    def __init__(self, client: Any, submission_id: str, reporter: Reporter, path: Path,
                 on_output: Callable[[str], None] = lambda text: None, check: bool = False):
        self.client, self.submission_id, self.reporter, self.path = (
            client, submission_id, reporter, path)
        self.check = check  # the cluster check's summary line is read (see JobRunner)
        self.on_output = on_output
        self._streamed = 0  # characters of log already shown
        self._file: Any = None
        self._tail: threading.Thread | None = None
        self._lock = threading.Lock()
        self._done = False  # the full log was written: late stream chunks are dropped

    def open(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a")
        except OSError as exc:
            self.reporter.warn(f"cannot open {self.path} ({exc.strerror}): the job's output "
                               f"goes to the screen only")
        self._tail = threading.Thread(target=self._tail_forever, name="job-log", daemon=True)
        self._tail.start()

    def complete(self, full: Callable[[], str]) -> None:
        """The job is over: what the stream has not shown of `full()` (Ray's whole log; ""
        when it cannot be read)."""
        if self._tail:
            # The stream ends by itself a few seconds after the job; the full log has
            # whatever it has not delivered yet, so a lost node is acted on without waiting.
            self._tail.join(timeout=TAIL_GRACE)
        whole = full()
        with self._lock:  # the stream may still be writing: take over from it
            self._append(whole[self._streamed:])
            self._done = True  # also when the full log could not be read
            if self._file:
                with contextlib.suppress(OSError, ValueError):  # a full volume: flush fails
                    self._file.close()
                self._file = None

    def _write(self, chunk: str) -> None:
        """A chunk of the stream: appended to job.log and the screen, unless the log was
        already completed from the full log (then it is a copy)."""
        with self._lock:
            if not self._done:
                self._append(chunk)

    def _append(self, chunk: str) -> None:
        if chunk:
            self._streamed += len(chunk)
            self.on_output(chunk)
            self._to_job_log(chunk)
            for line in chunk.splitlines():
                if self.check and line.startswith(CHECK_JSON_PREFIX):
                    # The cluster check's machine-readable summary: an event, not screen text.
                    with contextlib.suppress(ValueError):
                        result = json.loads(line[len(CHECK_JSON_PREFIX):])
                        if isinstance(result, dict):
                            self.reporter.event(Event.CHECK, **result)
                    continue
                self.reporter.raw(line)

    def _to_job_log(self, chunk: str) -> None:
        """job.log is a copy (Ray keeps the job's own log): a volume that refuses it (full,
        gone) costs the copy, said once, never the run; the screen still shows the output."""
        if self._file is None:
            return
        try:
            self._file.write(chunk)
            self._file.flush()
        except (OSError, ValueError) as exc:
            with contextlib.suppress(OSError, ValueError):
                self._file.close()
            self._file = None
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            self.reporter.warn(f"cannot write {self.path} ({why}): the job's output goes on "
                               f"on screen only (Ray keeps its own copy in the job's logs)")

    def _tail_forever(self) -> None:
        async def tail() -> None:
            async for chunk in self.client.tail_job_logs(self.submission_id):
                self._write(chunk)

        # The stream is best effort; follow() reconciles with the full log at the end.
        with contextlib.suppress(Exception):
            asyncio.run(tail())

