"""This pod: its GPUs, its cluster-private address, and where its services listen.

Facts read from the settings and the machine, shared by the lifecycles (cluster/), the checks
and the asking commands (control/).
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
import shlex
from collections.abc import Mapping
from pathlib import Path

from podagent.config import Settings
from podagent.config.policy import is_secret
from podagent.errors import ConfigError
from podagent.platform import nccl
from podagent.platform.roles import detect_role

ALL_INTERFACES = "0.0.0.0"
LOOPBACK = "127.0.0.1"


def detect_gpus(settings: Settings) -> tuple[int, str]:
    """(GPUs for Ray, how it was found)."""
    if settings.num_gpus is not None:
        return settings.num_gpus, settings.source_name("num_gpus")
    env = settings.environ
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        # CUDA hides every device from the first invalid index on ("-1" hides all).
        ids = []
        for entry in visible.split(","):
            if not entry.strip() or entry.strip().startswith("-"):
                break
            ids.append(entry)
        return len(ids), "CUDA_VISIBLE_DEVICES"
    devices = [p for p in Path("/dev").glob("nvidia*") if re.fullmatch(r"nvidia\d+", p.name)]
    if devices:
        return len(devices), "/dev/nvidia*"
    count = env.get("RUNPOD_GPU_COUNT", "")
    if count.isdigit():
        return int(count), "RUNPOD_GPU_COUNT"
    return 0, "no GPU found"


def choose_node_ip(settings: Settings, head_ip: str | None,
                   ifaces: Mapping[str, list[str]] | None = None,
                   nccl_ifname: str | None = None) -> tuple[str, str]:
    """(this pod's cluster-private address, the rule that chose it)."""
    if settings.node_ip:
        return settings.node_ip, settings.source_name("node_ip")
    if settings.node_addr:
        return settings.node_addr, "NODE_ADDR (Instant Cluster)"
    ifaces = nccl.interfaces() if ifaces is None else ifaces
    if nccl_ifname:
        for name in nccl.match_ifname(nccl_ifname, sorted(ifaces)) or []:
            if ifaces[name]:
                return ifaces[name][0], f"address of {name} (NCCL_SOCKET_IFNAME)"
    if head_ip:
        with contextlib.suppress(OSError):
            name, source = nccl.route_to(head_ip, ifaces)
            return source, f"source address of the route to the head via {name or '?'}"
    elif settings.expected_workers == 0 and not settings.instant_cluster:
        # The head of a one-node cluster: nobody else needs to reach its Ray, dashboard or
        # reward server, and this machine's first address may be a public one.
        return LOOPBACK, "loopback: a one-node cluster (no workers expected)"
    for name, addrs in sorted(ifaces.items()):
        for addr in addrs:
            if not addr.startswith("127."):
                return addr, f"first non-loopback address ({name})"
    return LOOPBACK, "no other address on this pod"


# Addresses no one outside the pod's own networks reaches: RFC 1918, carrier-grade NAT
# (RFC 6598: RunPod's and clouds' private ranges use it too), IPv6 unique local, loopback.
PRIVATE_NETWORKS = tuple(ipaddress.ip_network(n) for n in (
    "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "fc00::/7",
    "127.0.0.0/8", "::1/128"))


def is_private(address: str) -> bool:
    """Not Python's `is_private`, which counts documentation and reserved ranges (192.0.2.0/24,
    203.0.113.0/24...) as private although such an address may well be reachable."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in net for net in PRIVATE_NETWORKS if net.version == ip.version)


def listen_address(settings: Settings, node_ip: str) -> str:
    """Where the head's dashboard and reward server listen (PODAGENT_LISTEN)."""
    return ALL_INTERFACES if settings.listen == "all" else node_ip


def require_private(settings: Settings, node_ip: str, how: str) -> None:
    """PODAGENT_LISTEN=private is a promise: the dashboard (which runs any job for whoever
    reaches it) and the reward server listen on a private address, or podagent refuses."""
    if settings.listen != "private" or is_private(node_ip):
        return
    raise ConfigError(
        settings.source_name("listen"), settings.listen,
        f"needs a private address to listen on, and this pod's cluster address {node_ip} "
        f"({how}) is not one (private: 10.0.0.0/8, 172.16.0.0/12, 192.168.0.0/16, "
        f"100.64.0.0/10, fc00::/7, loopback): set PODAGENT_NODE_IP to this pod's private "
        f"address, or PODAGENT_LISTEN=all with a cluster token (PODAGENT_TOKEN)")


def environment_lines(settings: Settings, as_export: bool = False) -> list[str]:
    """`podagent env`: this pod's role and the environment podagent would apply on it (the
    NCCL preset's variables, RAY_DEBUG, W&B's), secrets named but never shown."""
    decision = detect_role(settings)
    effective = nccl.effective(settings)
    variables = dict(effective.variables)
    if settings.debug_ray:
        variables["RAY_DEBUG"] = "legacy"
    variables.update({k: v for k, v in settings.environ.items() if k.startswith("WANDB_")})
    lines = [f"# role: {decision.role.value} ({decision.reason})",
             f"# NCCL preset {effective.preset}: {effective.reason}"]
    lines += [f"# {name} is your own ({settings.environ[name]}); the preset's value yields"
              for name in effective.user_wins]
    lines += [f"# WARNING: {warning}" for warning in effective.warnings]
    for key in sorted(variables):
        if is_secret(key):
            lines.append(f"# {key} is set (value redacted)")
        elif as_export:
            lines.append(f"export {key}={shlex.quote(variables[key])}")
        else:
            lines.append(f"{key}={variables[key]}")
    return lines
