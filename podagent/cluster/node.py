"""What head and worker share: this pod's NCCL environment, address and GPUs, and a clean slate."""

from __future__ import annotations

from dataclasses import dataclass

from podagent import limits, nccl, pod, process
from podagent.cluster import ray_node
from podagent.config import Settings
from podagent.report import Reporter
from podagent.roles import Role


@dataclass(frozen=True)
class NodeSetup:
    nccl: nccl.NcclEnv
    node_ip: str
    gpus: int
    plan: ray_node.RayPlan


def prepare(settings: Settings, role: Role, reporter: Reporter,
            head_ip: str | None = None) -> NodeSetup:
    nccl_env = nccl.effective(settings, head_ip=head_ip)
    kept = f"; your own {', '.join(nccl_env.user_wins)} kept" if nccl_env.user_wins else ""
    reporter.say(f"NCCL preset {nccl_env.preset}: {nccl_env.reason}{kept}")
    for warning in nccl_env.warnings:
        reporter.warn(warning)
    ifname = settings.environ.get("NCCL_SOCKET_IFNAME",
                                  nccl_env.variables.get("NCCL_SOCKET_IFNAME"))
    node_ip, ip_rule = pod.choose_node_ip(settings, head_ip, nccl_ifname=ifname)
    if role is Role.HEAD:  # its dashboard and reward server listen there
        pod.require_private(settings, node_ip, ip_rule)
    gpus, gpu_rule = pod.detect_gpus(settings)
    reporter.say(f"this pod: {node_ip} ({ip_rule}), {gpus} GPU(s) ({gpu_rule})")
    plan = ray_node.plan(settings, role, node_ip, gpus, nccl_env.variables, head_ip)
    reporter.event("prepared", preset=nccl_env.preset, node_ip=node_ip, gpus=gpus,
                   nccl=dict(nccl_env.variables), warnings=list(nccl_env.warnings))
    return NodeSetup(nccl_env, node_ip, gpus, plan)


def clean_stale_ray(settings: Settings, reporter: Reporter) -> None:
    """Stop Ray processes an earlier run left on this pod (only this pod's: same netns)."""
    stale = process.pod_ray_processes(settings.ray_temp_dir)
    if not stale:
        return
    pids = {p.pid for p in stale}
    termed, killed = process.stop_in_phases(
        ray_node.RAY_STOP_ORDER, settings.stop_timeout,
        candidates=lambda: [p for p in stale if p.pid in pids and p.is_running()])
    how = f", {killed} needed SIGKILL" if killed else ""
    reporter.say(f"stopped a stale Ray on this pod ({termed + killed} processes{how})")
    reporter.event("stale_ray_stopped", processes=termed + killed, killed=killed)


def raise_limits(settings: Settings, role: Role, reporter: Reporter) -> None:
    """Before Ray starts: the soft limits up to the hard ones (Ray inherits them), and a
    warning where even the hard one is short for the cluster (a run, never a dry run)."""
    nodes = settings.expected_workers + 1 if role is Role.HEAD else 1
    raised, warnings = limits.raise_to_hard(nodes)
    if raised:
        reporter.say(f"raised this pod's limits to the hard ones for Ray: {', '.join(raised)}")
    for warning in warnings:
        reporter.warn(warning)
    reporter.event("limits", raised=raised, warnings=warnings)
