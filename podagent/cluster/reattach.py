"""Re-attach: this pod's Ray still runs this run's job (an earlier podagent of the run died and
its Ray lived on). The head then adopts both instead of cleaning up, so the job is never
submitted twice. Needs the run name set explicitly; anything else is cleaned as a stale Ray."""

from __future__ import annotations

import requests

from podagent.config import Settings
from podagent.ray_access.gcs import GcsClient, GcsUnavailable
from podagent.report import Reporter
from podagent.waiting import Backoff, Expired, NotYet, Signals, retry
from podagent.wire import Event

REATTACH_PROBE_TIMEOUT = 15.0  # a live Ray's Jobs API gets this long to say what job it runs
LIVE_JOB = ("PENDING", "RUNNING")


def live_run(settings: Settings, submission_id: str, address: str, dashboard_url: str,
             reporter: Reporter, signals: Signals) -> GcsClient | None:
    """A client of this pod's Ray when it still runs this run's job; None to clean it up."""
    if settings.sources.get("run_name", "default") == "default":
        return None  # a generated name never matches an earlier podagent's job
    gcs = GcsClient(address, metadata=settings.grpc_metadata())
    try:
        gcs.check_alive(timeout=2.0)
    except GcsUnavailable:  # no Ray here, or one of another cluster (another token)
        gcs.close()
        return None
    status = job_status(settings, submission_id, dashboard_url, signals)
    if status not in LIVE_JOB:
        gcs.close()
        reporter.say(f"a Ray from an earlier run answers at {address} without a "
                     f"running job {submission_id} ({status}): cleaning it up")
        return None
    reporter.say(f"re-attaching: this pod's Ray at {address} still runs job "
                 f"{submission_id} ({status}); following it, not submitting again")
    reporter.event(Event.REATTACHED, address=address, job_status=status)
    return gcs


def job_status(settings: Settings, submission_id: str, dashboard_url: str,
               signals: Signals) -> str:
    """This run's job status in the Jobs API on this pod ('no such job', 'no answer: ...')."""
    url = f"{dashboard_url}/api/jobs/{submission_id}"

    def attempt() -> str:
        try:
            reply = requests.get(url, timeout=5.0, headers=settings.auth_headers())
        except requests.RequestException as exc:
            raise NotYet(f"the Jobs API does not answer: {exc}") from None
        if reply.status_code == 404:
            return "no such job"
        if reply.status_code >= 500:  # busy, not an answer: the job may well be running
            raise NotYet(f"the Jobs API answered HTTP {reply.status_code}")
        if reply.status_code >= 400:
            return f"the Jobs API answered HTTP {reply.status_code}"
        try:
            return str(reply.json()["status"])
        except (ValueError, KeyError, TypeError):
            return "the Jobs API's answer has no status"

    try:
        # A dashboard busy for a moment (no answer, or a 5xx) must not get its job killed:
        # ask again for a while.
        return retry(attempt, awaited=f"the Jobs API to tell job {submission_id}'s status",
                     backoff=Backoff(0.2, 2.0), deadline=REATTACH_PROBE_TIMEOUT,
                     sleep=signals.sleep)
    except Expired as expired:
        return expired.seen
