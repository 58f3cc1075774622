"""`podagent logs [--follow]`: the run's job log from the head's Jobs API."""

from __future__ import annotations

import time
from collections.abc import Callable

import requests

from podagent.choices import JOB_TERMINAL
from podagent.config import Settings
from podagent.control.lookup import (
    HTTP_TIMEOUT,
    JobsApiSilent,
    dashboard,
    run_job,
)
from podagent.errors import HeadUnreachable
from podagent.platform import discovery
from podagent.platform.roles import Role
from podagent.report import Reporter
from podagent.waiting import Signals

FOLLOW_SILENCE = 30.0  # `logs --follow` gives up on a Jobs API silent this long


def follow_logs(settings: Settings, role: Role, reporter: Reporter, follow: bool,
                write: Callable[[str], None], signals: Signals,
                ip: str | None = None) -> str | None:
    """Print the run's job log; with follow, keep printing until the job ends. Returns its
    status (None when there is no job yet)."""
    ip = ip or discovery.head_ip_now(settings, role, reporter)
    try:
        job = run_job(settings, ip)
    except JobsApiSilent as exc:
        raise HeadUnreachable(str(exc)) from None
    if job is None:
        raise HeadUnreachable(f"no podagent job on the Jobs API at {dashboard(settings, ip)} "
                              f"yet")
    url = f"{dashboard(settings, ip)}/api/jobs/{job['submission_id']}"
    shown = 0
    status = job.get("status")
    silent_since: float | None = None
    while True:
        try:
            logs = requests.get(f"{url}/logs", timeout=HTTP_TIMEOUT,
                                headers=settings.auth_headers()).json().get("logs", "")
            status = requests.get(url, timeout=HTTP_TIMEOUT,
                                  headers=settings.auth_headers()).json().get("status", status)
            silent_since = None
        except (requests.RequestException, ValueError) as exc:
            # A busy head is waited for, a head that is gone is not.
            silent_since = silent_since or time.monotonic()
            if not follow or time.monotonic() - silent_since > FOLLOW_SILENCE:
                raise HeadUnreachable(f"the Jobs API at {url} does not answer "
                                      f"({type(exc).__name__}); last job status {status}"
                                      ) from None
            logs = ""
        if len(logs) > shown:
            write(logs[shown:])
            shown = len(logs)
        if not follow or status in JOB_TERMINAL:
            return status
        signals.sleep(1.0)
