"""Finding the head and its run from any pod, quickly: the asking commands are interactive."""

from __future__ import annotations

import dataclasses
from typing import Any

import requests

from podagent.config import Settings
from podagent.platform import discovery, pod
from podagent.platform.roles import Role
from podagent.ray_access.gcs import GcsClient, GcsUnavailable
from podagent.report import Reporter
from podagent.waiting import Signals

HTTP_TIMEOUT = 5.0
LOOKUP_TIMEOUT = 10.0  # status and stop are interactive: find the head quickly or say so


def head_ip(settings: Settings, role: Role, reporter: Reporter) -> str:
    if role is Role.HEAD:
        return pod.choose_node_ip(settings, None)[0]
    quick = dataclasses.replace(settings, head_timeout=min(settings.head_timeout,
                                                           LOOKUP_TIMEOUT))
    where = discovery.HeadFinder(quick, reporter, Signals()).locate()
    if len(where.candidates) == 1:
        return where.ip
    # Several DNS records (a stale one beside the head's): the one whose GCS answers now.
    for ip in where.candidates:
        gcs = GcsClient(f"{ip}:{settings.ray_port}", metadata=settings.grpc_metadata())
        try:
            gcs.check_alive(timeout=discovery.GCS_PROBE_TIMEOUT)
            return ip
        except GcsUnavailable:
            continue
        finally:
            gcs.close()
    return where.ip


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
