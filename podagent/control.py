"""`podagent status`, `stop` and `logs`: ask the running cluster from any pod.

Everything is read from the head: the node table from its GCS, the run's job from its Jobs API
(the job whose metadata names a podagent run), the reward server's /health. A stop is a request
the head acts on (GCS KV), so the cluster comes down in podagent's own order.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from typing import Any

import psutil
import requests
from tenacity import Retrying, retry_if_result, stop_after_delay, wait_fixed

from podagent import discovery, node, process, ray_node
from podagent.config import Settings
from podagent.errors import HeadUnreachable, StopTimeout
from podagent.gcs import GcsClient, GcsUnavailable
from podagent.report import Reporter
from podagent.roles import Role
from podagent.waiting import Signals

HTTP_TIMEOUT = 5.0
LOOKUP_TIMEOUT = 10.0  # status and stop are interactive: find the head quickly or say so
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
FOLLOW_SILENCE = 30.0  # `logs --follow` gives up on a Jobs API silent this long


def head_ip(settings: Settings, role: Role, reporter: Reporter) -> str:
    if role is Role.HEAD:
        return ray_node.choose_node_ip(settings, None)[0]
    quick = dataclasses.replace(settings, head_timeout=min(settings.head_timeout,
                                                           LOOKUP_TIMEOUT))
    return discovery.HeadFinder(quick, reporter, Signals()).locate().ip


def _dashboard(settings: Settings, ip: str) -> str:
    return f"http://{ip}:{settings.dashboard_port}"


class JobsApiSilent(Exception):
    """The head's Jobs API did not answer (or not with a job list)."""


def run_job(settings: Settings, ip: str) -> dict[str, Any] | None:
    """The newest job that podagent submitted for a run (its metadata names the run); None
    when there is none yet. Raises JobsApiSilent when the dashboard does not answer."""
    url = f"{_dashboard(settings, ip)}/api/jobs/"
    try:
        reply = requests.get(url, timeout=HTTP_TIMEOUT, headers=settings.auth_headers())
        reply.raise_for_status()
        jobs = reply.json()
    except (requests.RequestException, ValueError) as exc:
        raise JobsApiSilent(f"the Jobs API at {url} does not answer: {exc}") from None
    ours = [j for j in jobs if (j.get("metadata") or {}).get("podagent_run")]
    return max(ours, key=lambda j: j.get("start_time") or 0, default=None)


def reward_health(settings: Settings, ip: str) -> dict[str, Any]:
    if settings.reward == "none":
        return {"state": "none"}
    url = f"http://{ip}:{settings.reward_port}/health"
    try:
        reply = requests.get(url, timeout=HTTP_TIMEOUT)
        return {"state": "healthy" if reply.ok else f"HTTP {reply.status_code}", "url": url}
    except requests.RequestException as exc:
        return {"state": "unreachable", "url": url, "error": type(exc).__name__}


def cluster_status(settings: Settings, role: Role, reporter: Reporter) -> dict[str, Any]:
    ip = head_ip(settings, role, reporter)
    gcs = GcsClient(f"{ip}:{settings.ray_port}", metadata=settings.grpc_metadata())
    try:
        ray_version = gcs.check_alive(timeout=HTTP_TIMEOUT)
        nodes = gcs.nodes(timeout=HTTP_TIMEOUT)
        state = gcs.kv_get(node.KV_NAMESPACE, node.KV_RUN_STATE, timeout=HTTP_TIMEOUT)
    except GcsUnavailable as exc:
        raise HeadUnreachable(f"the head's Ray at {ip}:{settings.ray_port} does not answer: "
                              f"{exc}") from None
    finally:
        gcs.close()
    head = next((n for n in nodes if n.is_head), None)
    try:
        job, jobs_api = run_job(settings, ip), "answers"
    except JobsApiSilent as exc:
        job, jobs_api = None, str(exc)
    return {
        "role": role.value,
        "head": {"ip": ip, "ray": f"{ip}:{settings.ray_port}", "ray_version": ray_version,
                 "dashboard": _dashboard(settings, ip)},
        "uptime_s": round(time.time() - head.start_time_ms / 1000, 1) if head else None,
        "run_state": json.loads(state) if state else {"state": "running"},
        "nodes": [{"ip": n.ip, "head": n.is_head, "alive": n.alive, "gpus": n.gpus,
                   "cpus": n.cpus} for n in sorted(nodes, key=lambda n: (not n.is_head, n.ip))],
        "jobs_api": jobs_api,
        "job": None if job is None else {
            "submission_id": job.get("submission_id"), "status": job.get("status"),
            "entrypoint": job.get("entrypoint"), "run": job["metadata"]["podagent_run"]},
        "reward": reward_health(settings, ip),
    }


def render_status(status: dict[str, Any]) -> str:
    alive = [n for n in status["nodes"] if n["alive"]]
    uptime = status["uptime_s"]
    head = status["head"]
    ray = f"Ray {head['ray_version']}, " if head.get("ray_version") else ""
    lines = [f"head {head['ray']} ({ray}dashboard {head['dashboard']})"
             + (f", up {uptime / 60:.1f} min" if uptime is not None else ""),
             f"nodes: {len(alive)} alive of {len(status['nodes'])}, "
             f"{sum(n['gpus'] for n in alive):g} GPUs"]
    for n in status["nodes"]:
        lines.append(f"  {n['ip']:<15} {'head  ' if n['head'] else 'worker'} "
                     f"{'alive' if n['alive'] else 'dead '} {n['gpus']:g} GPUs")
    job = status["job"]
    if job:
        lines.append(f"job: {job['submission_id']} {job['status']} ({job['entrypoint']})")
    elif status["jobs_api"] != "answers":
        lines.append(f"job: unknown ({status['jobs_api']})")
    else:
        lines.append("job: none submitted yet")
    reward = status["reward"]
    lines.append(f"reward server: {reward['state']}" + (f" at {reward['url']}"
                                                        if reward.get("url") else ""))
    if status["run_state"].get("state") != "running":
        lines.append(f"run: {status['run_state'].get('state')}")
    return "\n".join(lines)


def request_stop(settings: Settings, role: Role, reporter: Reporter, by: str,
                 timeout: float) -> float:
    """Ask the head to end the run, then wait until its Ray is gone; returns seconds taken."""
    ip = head_ip(settings, role, reporter)
    gcs = GcsClient(f"{ip}:{settings.ray_port}", metadata=settings.grpc_metadata())
    started = time.monotonic()
    try:
        gcs.kv_put(node.KV_NAMESPACE, node.KV_STOP_REQUEST,
                   json.dumps({"by": by, "at": time.time()}).encode(), timeout=HTTP_TIMEOUT)
    except GcsUnavailable as exc:
        gcs.close()
        raise HeadUnreachable(f"the head's Ray at {ip}:{settings.ray_port} does not answer: "
                              f"{exc}") from None
    reporter.say(f"asked the head at {ip} to stop the run; waiting for the cluster to go down")

    def head_answers() -> bool:
        try:
            gcs.check_alive(timeout=1.0)
            return True
        except GcsUnavailable:
            return False

    try:
        still_up = Retrying(stop=stop_after_delay(timeout), wait=wait_fixed(0.5),
                            retry=retry_if_result(bool),
                            retry_error_callback=lambda state: True)(head_answers)
    finally:
        gcs.close()
    if still_up:
        raise StopTimeout(f"the head at {ip} still runs {timeout:g} s after the stop request "
                          f"(is its podagent running? `podagent status` shows the cluster)")
    return time.monotonic() - started


def follow_logs(settings: Settings, role: Role, reporter: Reporter, follow: bool,
                write: Callable[[str], None], signals: Signals) -> str | None:
    """Print the run's job log; with follow, keep printing until the job ends. Returns its
    status (None when there is no job yet)."""
    ip = head_ip(settings, role, reporter)
    try:
        job = run_job(settings, ip)
    except JobsApiSilent as exc:
        raise HeadUnreachable(str(exc)) from None
    if job is None:
        raise HeadUnreachable(f"no podagent job on the Jobs API at {_dashboard(settings, ip)} "
                              f"yet")
    url = f"{_dashboard(settings, ip)}/api/jobs/{job['submission_id']}"
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
        if not follow or status in TERMINAL:
            return status
        signals.sleep(1.0)


def local_health(settings: Settings) -> tuple[bool, str]:
    """For a container HEALTHCHECK: is podagent running on this pod, and its Ray with it?"""
    me = psutil.Process()
    mine = {me.pid, *(p.pid for p in me.parents())}
    agents = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if proc.pid not in mine and _is_lifecycle(proc.info["cmdline"] or []):
            agents.append(proc)
    if not agents:
        return False, "podagent is not running on this pod"
    ray = [p for p in process.pod_ray_processes(settings.ray_temp_dir)
           if p.name() in ("raylet", "gcs_server")]
    if not ray:
        return True, f"podagent runs (pid {agents[0].pid}); Ray not started yet"
    return True, f"podagent runs (pid {agents[0].pid}); Ray runs ({len(ray)} daemons)"


# Commands that ask or serve; only a head or worker lifecycle counts as "podagent runs here".
_NOT_LIFECYCLE = {"status", "check", "logs", "stop", "env", "token", "reward-server", "torchrun"}


def _is_lifecycle(cmdline: list[str]) -> bool:
    for i, word in enumerate(cmdline):
        if os.path.basename(word) == "podagent":
            rest = cmdline[i + 1:]
        elif word == "-m" and cmdline[i + 1:i + 2] == ["podagent"]:
            rest = cmdline[i + 2:]
        else:
            continue
        command = next((w for w in rest if not w.startswith("-")), None)
        return command not in _NOT_LIFECYCLE
    return False
