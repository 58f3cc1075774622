"""`podagent status`: the head, Ray's nodes, the run's job and the reward server, from any
pod; and `status --local`, this pod only (the image's HEALTHCHECK)."""

from __future__ import annotations

import os
import time
from typing import Any

import psutil
import requests

from podagent import process
from podagent.cluster import runstate
from podagent.config import Settings
from podagent.control.lookup import HTTP_TIMEOUT, JobsApiSilent, dashboard, run_job
from podagent.errors import HeadUnreachable
from podagent.platform import discovery
from podagent.platform.roles import Role
from podagent.ray_access.gcs import GcsClient, GcsUnavailable
from podagent.report import Reporter


def reward_health(settings: Settings, ip: str) -> dict[str, Any]:
    if settings.reward == "none":
        return {"state": "none"}
    url = f"http://{ip}:{settings.reward_port}/health"
    try:
        reply = requests.get(url, timeout=HTTP_TIMEOUT)
        return {"state": "healthy" if reply.ok else f"HTTP {reply.status_code}", "url": url}
    except requests.RequestException as exc:
        return {"state": "unreachable", "url": url, "error": type(exc).__name__}


def cluster_status(settings: Settings, role: Role, reporter: Reporter,
                   ip: str | None = None) -> dict[str, Any]:
    ip = ip or discovery.head_ip_now(settings, role, reporter)
    gcs = GcsClient(f"{ip}:{settings.ray_port}", metadata=settings.grpc_metadata())
    try:
        ray_version = gcs.check_alive(timeout=HTTP_TIMEOUT)
        nodes = gcs.nodes(timeout=HTTP_TIMEOUT)
        state = gcs.kv_get(runstate.KV_NAMESPACE, runstate.KV_RUN_STATE, timeout=HTTP_TIMEOUT)
        hang = gcs.kv_get(runstate.KV_NAMESPACE, runstate.KV_DUMP, timeout=HTTP_TIMEOUT)
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
                 "dashboard": dashboard(settings, ip)},
        "uptime_s": round(time.time() - head.start_time_ms / 1000, 1) if head else None,
        "run_state": runstate.read_state(state),
        "nodes": [{"ip": n.ip, "head": n.is_head, "alive": n.alive, "gpus": n.gpus,
                   "cpus": n.cpus, "pod": n.label(runstate.LABEL_POD)}
                  for n in sorted(nodes, key=lambda n: (not n.is_head, n.ip))],
        "jobs_api": jobs_api,
        "job": None if job is None else {
            "submission_id": job.get("submission_id"), "status": job.get("status"),
            "entrypoint": job.get("entrypoint"), "run": job["metadata"]["podagent_run"]},
        "reward": reward_health(settings, ip),
        "last_hang": runstate.read_state(hang) if hang else None,
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
                     f"{'alive' if n['alive'] else 'dead '} {n['gpus']:g} GPUs"
                     + (f"  pod {n['pod']}" if n.get("pod") else ""))
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
    hang = status.get("last_hang")
    if hang:
        lines.append(f"last hang: {hang.get('n')}: {hang.get('line') or 'stacks being dumped'}")
    if status["run_state"].get("state") != "running":
        lines.append(f"run: {status['run_state'].get('state')}")
    return "\n".join(lines)


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
_NOT_LIFECYCLE = {"status", "check", "logs", "stop", "env", "token", "reward-server"}


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
