"""The few `ip` command lines the pod harness runs (pods.py), done through pyroute2 on a host
without iproute2 (a bare GPU image has no `ip`, only Python).

`ip(args)` takes the arguments pods.py gives `ip` and answers as the command would: exit status,
and on stdout what pods.py reads (the pids of a namespace, `-j` JSON for the host's addresses and
routes). Any other command line is refused with exit status 2, never guessed at.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
from collections.abc import Iterator, Sequence
from typing import Any

from pyroute2 import IPRoute, NetlinkError, NetNS, netns

NETNS_DIR = "/var/run/netns"


def ip(args: Sequence[str]) -> subprocess.CompletedProcess[str]:
    argv = ["ip", *args]
    try:
        return subprocess.CompletedProcess(argv, 0, _run(list(args)), "")
    except (NetlinkError, OSError, ValueError) as exc:
        return subprocess.CompletedProcess(argv, 2, "", f"{type(exc).__name__}: {exc}")


def _run(args: list[str]) -> str:
    target = None
    if args[:1] == ["-n"]:
        target, args = args[1], args[2:]
    match args:
        case ["-j", "-4", "addr", "show"]:
            return json.dumps(_addresses())
        case ["-j", "-4", "route", "show", "table", "all"]:
            return json.dumps(_routes())
        case ["netns", "add", name]:
            netns.create(name)
        case ["netns", "del", name]:
            netns.remove(name)
        case ["netns", "pids", name]:
            return "".join(f"{pid}\n" for pid in netns_pids(name))
        case ["link", "add", name, "type", "bridge"]:
            with _netlink(target) as nl:
                nl.link("add", ifname=name, kind="bridge")
        case ["link", "add", name, "type", "veth", "peer", "name", peer, "netns", inside]:
            _veth(name, peer, inside)
        case ["link", "set", name, ("up" | "down") as state]:
            with _netlink(target) as nl:
                nl.link("set", index=_index(nl, name), state=state)
        case ["link", "set", name, "address", mac]:
            with _netlink(target) as nl:
                nl.link("set", index=_index(nl, name), address=mac)
        case ["link", "set", name, "master", bridge]:
            with _netlink(target) as nl:
                nl.link("set", index=_index(nl, name), master=_index(nl, bridge))
        case ["link", "del", name]:
            with _netlink(target) as nl:
                nl.link("del", index=_index(nl, name))
        case ["addr", "add", cidr, "dev", name]:
            address, _, length = cidr.partition("/")
            with _netlink(target) as nl:
                nl.addr("add", index=_index(nl, name), address=address, prefixlen=int(length))
        case ["route", "add", "default", "via", gateway]:
            with _netlink(target) as nl:
                nl.route("add", dst="0.0.0.0/0", gateway=gateway)
        case _:
            raise ValueError(f"not a command line the pod harness runs: ip {' '.join(args)}")
    return ""


@contextlib.contextmanager
def _netlink(target: str | None) -> Iterator[Any]:
    """The host's netlink, or a namespace's (flags=0: never create one by mistake)."""
    nl = NetNS(target, flags=0) if target else IPRoute()
    try:
        yield nl
    finally:
        nl.close()


def _index(nl: Any, name: str) -> int:
    found = nl.link_lookup(ifname=name)
    if not found:
        raise ValueError(f'Cannot find device "{name}"')
    return found[0]


def _veth(name: str, peer: str, inside: str) -> None:
    """A veth pair whose peer ends up in the namespace under its name. It is made on the host
    under a name derived from `name` (unique there), moved, then renamed: `peer` (podnet1) may
    exist on the host or in another pod at the same moment."""
    temporary = f"{name[:13]}p"
    with IPRoute() as host:
        host.link("add", ifname=name, kind="veth", peer=temporary)
        host.link("set", index=_index(host, temporary), net_ns_fd=inside)
    with _netlink(inside) as nl:
        nl.link("set", index=_index(nl, temporary), ifname=peer)


def netns_pids(name: str) -> list[int]:
    """The processes whose network namespace is `name` (what `ip netns pids` reads)."""
    try:
        wanted = os.stat(os.path.join(NETNS_DIR, name))
    except FileNotFoundError:
        return []
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):  # gone meanwhile, or not ours to read
                seen = os.stat(f"/proc/{entry}/ns/net")
                if (seen.st_ino, seen.st_dev) == (wanted.st_ino, wanted.st_dev):
                    pids.append(int(entry))
    return pids


def _addresses() -> list[dict[str, Any]]:
    with IPRoute() as nl:
        return [{"addr_info": [{"local": a.get_attr("IFA_LOCAL") or a.get_attr("IFA_ADDRESS"),
                                "prefixlen": a["prefixlen"]}]}
                for a in nl.get_addr(family=socket.AF_INET)]


def _routes() -> list[dict[str, str]]:
    with IPRoute() as nl:
        return [{"dst": f"{r.get_attr('RTA_DST')}/{r['dst_len']}" if r["dst_len"] else "default"}
                for r in nl.get_routes(family=socket.AF_INET)]
