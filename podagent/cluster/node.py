"""What head and worker of a Ray run share: the kernel's pod setup with this pod's `ray start`
plan, and a clean slate (podagent's own leftovers stopped, anyone else's Ray refused)."""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

import psutil

from podagent import limits, process
from podagent.cluster import ray_node
from podagent.config import Settings
from podagent.errors import ForeignRay
from podagent.platform import nccl
from podagent.platform.roles import Role
from podagent.report import Reporter
from podagent.run import pod_setup
from podagent.wire import Event


@dataclass(frozen=True)
class NodeSetup:
    nccl: nccl.NcclEnv
    node_ip: str
    gpus: int
    plan: ray_node.RayPlan


def prepare(settings: Settings, role: Role, reporter: Reporter,
            head_ip: str | None = None) -> NodeSetup:
    """The kernel's pod setup, and this pod's `ray start`."""
    ready = pod_setup.prepare(settings, role, reporter, head_ip)
    plan = ray_node.plan(settings, role, ready.node_ip, ready.gpus, ready.nccl.variables,
                         head_ip)
    return NodeSetup(ready.nccl, ready.node_ip, ready.gpus, plan)


def refuse_foreign_ray(settings: Settings) -> process.PodRay:
    """Before Ray starts: a Ray that podagent did not start on this pod (process.pod_ray) is
    refused, and left running; returns what was found."""
    found = process.pod_ray(settings.ray_temp_dir)
    if found.foreign:
        raise ForeignRay(foreign_ray_line(found.foreign))
    return found


def clean_stale_ray(settings: Settings, reporter: Reporter) -> None:
    """Stop the Ray an earlier podagent left on this pod (only this pod's: same netns); one
    that podagent did not start is refused instead, and never stopped."""
    stale = refuse_foreign_ray(settings).ours
    if not stale:
        return
    pids = {p.pid for p in stale}
    termed, killed = process.stop_in_phases(
        ray_node.RAY_STOP_ORDER, settings.stop_timeout,
        candidates=lambda: [p for p in stale if p.pid in pids and p.is_running()])
    how = f", {killed} needed SIGKILL" if killed else ""
    reporter.say(f"stopped a stale Ray on this pod ({termed + killed} processes{how})")
    reporter.event(Event.STALE_RAY_STOPPED, processes=termed + killed, killed=killed)


def make_room_for_head(settings: Settings, node_ip: str, listen: str,
                       reporter: Reporter) -> None:
    """Before `ray start --head`: this pod's stale Ray stopped, every port the head will take
    free, and the record of Ray's last cluster forgotten (ray_node.forget_last_cluster)."""
    clean_stale_ray(settings, reporter)
    # Ray's dashboard agent (its default port): without it the Jobs API accepts no job.
    # The dashboard and the reward server are checked where they will listen (with
    # PODAGENT_LISTEN=all, a holder on any address of the port is in the way).
    ports = [(node_ip, settings.ray_port), (listen, settings.dashboard_port),
             (node_ip, ray_node.DASHBOARD_AGENT_PORT)]
    if settings.reward != "none":
        ports.append((listen, settings.reward_port))
    for address, port in ports:
        ray_node.check_port_free(address, port)
    ray_node.forget_last_cluster(settings)


RAY_DAEMONS = ("gcs_server", "raylet")  # what a person recognises a Ray by, named first
SHOWN = 2
# Ray's daemons name the GCS they belong to: --gcs-address=IP:PORT (raylet, dashboard,
# monitors), or the gcs_server its own --gcs_server_port.
_GCS_ADDRESS = re.compile(r"--gcs[-_]address=([\w.:\[\]-]+)")
_GCS_PORT = re.compile(r"--gcs_server_port=(\d+)")


def foreign_ray_line(procs: list[psutil.Process]) -> str:
    """One line: which processes, its GCS where their command lines say, and what to do."""
    seen = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            seen.append((proc.pid, proc.name(), " ".join(proc.cmdline())))
    seen.sort(key=lambda p: (RAY_DAEMONS.index(p[1]) if p[1] in RAY_DAEMONS
                             else len(RAY_DAEMONS), p[0]))
    named = ", ".join(f"pid {pid} ({name})" for pid, name, _ in seen[:SHOWN])
    if len(seen) > SHOWN:
        named += f" and {len(seen) - SHOWN} other Ray processes"
    gcs = next((f", GCS at {m.group(1)}" for *_, line in seen
                if (m := _GCS_ADDRESS.search(line))), "")
    gcs = gcs or next((f", GCS on port {m.group(1)}" for *_, line in seen
                       if (m := _GCS_PORT.search(line))), "")
    return (f"a Ray that podagent did not start runs on this pod: {named or 'gone meanwhile'}"
            f"{gcs}; podagent will neither start a second Ray nor stop that one: on RunPod, "
            f"create the cluster with type TRAINING, not RAY (podagent starts Ray itself), or "
            f"stop that Ray yourself")


def raise_limits(settings: Settings, role: Role, reporter: Reporter) -> None:
    """Before Ray starts: the soft limits up to the hard ones (Ray inherits them), and a
    warning where even the hard one is short for the cluster (a run, never a dry run)."""
    nodes = settings.expected_workers + 1 if role is Role.HEAD else 1
    raised, warnings = limits.raise_to_hard(nodes)
    if raised:
        reporter.say(f"raised this pod's limits to the hard ones for Ray: {', '.join(raised)}")
    for warning in warnings:
        reporter.warn(warning)
    reporter.event(Event.LIMITS, raised=raised, warnings=warnings)
