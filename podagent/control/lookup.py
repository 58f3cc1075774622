"""Finding the head and its run from any pod, quickly: the asking commands are interactive."""

from __future__ import annotations

from typing import Any

import requests

from podagent.config import Settings

HTTP_TIMEOUT = 5.0


def dashboard(settings: Settings, ip: str) -> str:
    return f"http://{ip}:{settings.dashboard_port}"


class JobsApiSilent(Exception):
    """The head's Jobs API did not answer (or not with a job list)."""


def run_job(settings: Settings, ip: str) -> dict[str, Any] | None:
    """The newest job that podagent submitted for a run (its metadata names the run); None
    when there is none yet. Raises JobsApiSilent when the dashboard does not answer."""
    url = f"{dashboard(settings, ip)}/api/jobs/"
    try:
        reply = requests.get(url, timeout=HTTP_TIMEOUT, headers=settings.auth_headers())
        reply.raise_for_status()
        jobs = reply.json()
    except (requests.RequestException, ValueError) as exc:
        raise JobsApiSilent(f"the Jobs API at {url} does not answer: {exc}") from None
    ours = [j for j in jobs if (j.get("metadata") or {}).get("podagent_run")]
    return max(ours, key=lambda j: j.get("start_time") or 0, default=None)
