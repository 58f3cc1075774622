"""This pod made ready for any run: its NCCL environment, its cluster address and its GPUs,
each said once with the rule that chose it, and (a real start, not a dry run) its GPUs
checked. Nothing here knows what runs the job."""

from __future__ import annotations

import os
from dataclasses import dataclass

from podagent.config import Settings
from podagent.platform import nccl, pod
from podagent.platform.roles import Role
from podagent.report import Reporter
from podagent.waiting import Signals
from podagent.wire import Event


@dataclass(frozen=True)
class PodSetup:
    nccl: nccl.NcclEnv
    node_ip: str
    gpus: int


def prepare(settings: Settings, role: Role, reporter: Reporter,
            head_ip: str | None = None) -> PodSetup:
    nccl_env = nccl.effective(settings, head_ip=head_ip)
    kept = f"; your own {', '.join(nccl_env.user_wins)} kept" if nccl_env.user_wins else ""
    reporter.say(f"NCCL preset {nccl_env.preset}: {nccl_env.reason}{kept}")
    for warning in nccl_env.warnings:
        reporter.warn(warning)
    ifname = settings.environ.get("NCCL_SOCKET_IFNAME",
                                  nccl_env.variables.get("NCCL_SOCKET_IFNAME"))
    node_ip, ip_rule = pod.choose_node_ip(settings, head_ip, nccl_ifname=ifname)
    if role is Role.HEAD:  # its dashboard, reward server or supervisor port listen there
        pod.require_private(settings, node_ip, ip_rule)
    gpus, gpu_rule = pod.detect_gpus(settings)
    reporter.say(f"this pod: {node_ip} ({ip_rule}), {gpus} GPU(s) ({gpu_rule})")
    reporter.event(Event.PREPARED, preset=nccl_env.preset, node_ip=node_ip, gpus=gpus,
                   nccl=dict(nccl_env.variables), warnings=list(nccl_env.warnings))
    return PodSetup(nccl_env, node_ip, gpus)


def check_gpus(settings: Settings, reporter: Reporter, signals: Signals,
               nccl_env: nccl.NcclEnv) -> None:
    """This pod's GPUs checked before anything uses them (PODAGENT_GPU_CHECK; GpuCheckFailed:
    exit 28). The probe runs under the pod's NCCL preset, as the job will; it needs no
    secret: every variable podagent knows to be one is left out."""
    from podagent.config.policy import child_environ, is_secret
    from podagent.run import gpu_check  # its probe, and torch, only where a pod checks

    env = child_environ(os.environ, is_secret)
    env.update(nccl_env.variables)  # the user's own NCCL_* are in os.environ: they won
    gpu_check.check(settings, reporter, signals, env)


def say_gpu_check(settings: Settings, reporter: Reporter) -> None:
    """A dry run's line for the check a real start runs (check_gpus)."""
    gpus, _ = pod.detect_gpus(settings)
    if settings.gpu_check != "off" and gpus:
        kind = settings.gpu_type or "any type"
        reporter.say(f"would check this pod's {gpus} GPU(s) before anything uses them "
                     f"(PODAGENT_GPU_CHECK={settings.gpu_check}, {kind}; a failure exits 28)")
