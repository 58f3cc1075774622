"""NCCL presets (env/*.env), chosen by evidence, checked against the real interfaces, merged
under the user's own environment (the user wins, per variable)."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from types import MappingProxyType

import psutil

from podagent.config.parsers import preset_dir, preset_names  # noqa: F401 (named here too)


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    variables: Mapping[str, str]


def parse_env_file(text: str, origin: str = "<preset>") -> tuple[str, dict[str, str]]:
    """KEY=VALUE lines; '#' lines before the first variable are the description."""
    description: list[str] = []
    variables: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            if not variables:
                description.append(line.lstrip("# "))
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip().isidentifier():
            raise ValueError(f"{origin}:{number}: expected KEY=VALUE, got {raw!r}")
        variables[key.strip()] = value.strip()
    return " ".join(description), variables


@cache
def load_presets() -> Mapping[str, Preset]:
    presets = {}
    for file in sorted(preset_dir().glob("*.env")):
        description, variables = parse_env_file(file.read_text(), str(file.name))
        presets[file.stem] = Preset(file.stem, description, MappingProxyType(variables))
    return MappingProxyType(presets)


# --- interfaces ----------------------------------------------------------------------------------


def interfaces() -> dict[str, list[str]]:
    """Interface name -> its IPv4 addresses, as this pod sees them now."""
    return {
        name: [a.address for a in addrs if a.family == socket.AF_INET]
        for name, addrs in psutil.net_if_addrs().items()
    }


def route_to(dest_ip: str, ifaces: Mapping[str, list[str]] | None = None) -> tuple[str | None, str]:
    """(interface, source address) the kernel would use to reach dest_ip.

    A connected UDP socket makes the kernel pick the route without sending a packet.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((dest_ip, 9))
        source = sock.getsockname()[0]
    ifaces = interfaces() if ifaces is None else ifaces
    name = next((n for n, addrs in ifaces.items() if source in addrs), None)
    return name, source


def match_ifname(spec: str, names: list[str]) -> list[str] | None:
    """Interfaces NCCL_SOCKET_IFNAME would select (prefix match; '=' exact).

    None for an exclusion list ('^...'), which selects "everything else" and cannot be checked.
    """
    if spec.startswith("^"):
        return None
    exact = spec.startswith("=")
    wanted = [p.strip() for p in spec.lstrip("=").split(",") if p.strip()]
    return [n for n in names if any(n == w if exact else n.startswith(w) for w in wanted)]


# --- choosing and merging ------------------------------------------------------------------------


def choose(settings, ifaces: Mapping[str, list[str]], ib_devices: list[str]) -> tuple[str, str]:
    """(preset name, why). An explicit setting wins; 'auto' picks by evidence."""
    if settings.nccl_preset != "auto":
        return settings.nccl_preset, f"{settings.source_name('nccl_preset')} asks for it"
    if settings.instant_cluster or settings.num_nodes is not None:
        return "runpod-cluster", "RunPod Instant Cluster variables (NODE_RANK/PRIMARY_ADDR) are set"
    if ib_devices and any(n.startswith("ib") for n in ifaces):
        return "infiniband", f"InfiniBand devices present ({', '.join(ib_devices)})"
    if settings.pod_id or settings.head_pod_id:
        return "runpod-global", "RUNPOD_POD_ID/HEAD_POD_ID are set: RunPod Global Networking"
    if "podnet1" in ifaces:
        return "runpod-global", "interface podnet1 exists: RunPod Global Networking"
    return "none", "no RunPod or InfiniBand evidence on this pod"


def infiniband_devices(root: Path = Path("/sys/class/infiniband")) -> list[str]:
    try:
        return sorted(p.name for p in root.iterdir())
    except OSError:
        return []


@dataclass(frozen=True)
class NcclEnv:
    preset: str
    reason: str
    # Variables podagent applies: the preset's, except where the user set their own.
    variables: Mapping[str, str]
    user_wins: tuple[str, ...] = ()
    warnings: tuple[str, ...] = field(default=())


def effective(
    settings,
    head_ip: str | None = None,
    ifaces: Mapping[str, list[str]] | None = None,
    ib_devices: list[str] | None = None,
) -> NcclEnv:
    ifaces = interfaces() if ifaces is None else ifaces
    ib_devices = infiniband_devices() if ib_devices is None else ib_devices
    name, reason = choose(settings, ifaces, ib_devices)
    preset = load_presets()[name]
    # As everywhere in podagent, a variable set to an empty value counts as unset.
    user = {k: v for k, v in settings.environ.items() if v.strip()}
    variables: dict[str, str] = {}
    user_wins = []
    for key, value in preset.variables.items():
        if key in user:
            user_wins.append(key)
        else:
            variables[key] = value
    ifname = user.get("NCCL_SOCKET_IFNAME", variables.get("NCCL_SOCKET_IFNAME"))
    matched = match_ifname(ifname, sorted(ifaces)) if ifname else None
    if ifname and "GLOO_SOCKET_IFNAME" not in user and not ifname.startswith("^"):
        # gloo carries torch's CPU collectives and rendezvous: keep it on NCCL's interface.
        # NCCL matches names by prefix, gloo exactly: give gloo the names NCCL would pick.
        variables["GLOO_SOCKET_IFNAME"] = ",".join(matched) if matched else ifname.lstrip("=")
    warnings = []
    if matched == []:
        warnings.append(_missing_interface(ifname, ifaces, head_ip))
    return NcclEnv(name, reason, MappingProxyType(variables), tuple(user_wins), tuple(warnings))


def _missing_interface(ifname: str, ifaces: Mapping[str, list[str]], head_ip: str | None) -> str:
    have = ", ".join(f"{n} ({', '.join(a) or 'no IPv4'})" for n, a in sorted(ifaces.items()))
    text = f"NCCL_SOCKET_IFNAME={ifname} names no interface on this pod; it has: {have}"
    if head_ip:
        try:
            via, source = route_to(head_ip, ifaces)
            text += f"; the route to the head {head_ip} goes through {via or '?'} ({source})"
        except OSError as exc:
            text += f"; no route to the head {head_ip} ({exc.strerror})"
    return text
