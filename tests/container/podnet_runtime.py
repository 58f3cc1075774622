#!/usr/bin/env python3
"""An OCI runtime for the container suite: runc, with the container's network interface named
as RunPod names it (podnet1) instead of Docker's eth0.

Docker cannot name a container's interface (before Engine 28), so the engine the suite starts
registers this file as a runtime (`dockerd --add-runtime`), and the suite's containers run with
`--runtime` naming it. For `create` it adds one prestart hook to the bundle's config.json, after
Docker's own (which moves the veth into the container's network namespace as eth0), then hands
every command to runc unchanged. The hook renames the interface while the container's process
is still stopped before its first instruction, so podagent only ever sees podnet1.

Standard library only: dockerd runs it with whatever python3 is on its PATH.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

IFNAME = "podnet1"
HOOK = "podnet-hook"


def _run(argv: list[str]) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        sys.stderr.write(f"{argv}: exit {proc.returncode}: {proc.stderr.strip()}\n")
        raise SystemExit(1)
    return proc.stdout


def rename_interface(pid: int) -> None:
    """In the network namespace of `pid`: the one interface besides lo becomes IFNAME, keeping
    its addresses; the default route (lost while the link is down) is put back."""
    netns = ["nsenter", f"--net=/proc/{pid}/ns/net", "--", "ip"]
    links = [link["ifname"] for link in json.loads(_run([*netns, "-j", "link", "show"]))
             if link.get("link_type") != "loopback"]
    if not links or links == [IFNAME]:
        return  # --network none, or named already
    if len(links) != 1:
        sys.stderr.write(f"expected one interface besides lo, found {links}\n")
        raise SystemExit(1)
    (old,) = links
    routes = json.loads(_run([*netns, "-j", "-4", "route", "show", "dev", old]) or "[]")
    _run([*netns, "link", "set", old, "down"])
    _run([*netns, "link", "set", old, "name", IFNAME])
    _run([*netns, "link", "set", IFNAME, "up"])
    for route in routes:
        if route.get("dst") == "default" and route.get("gateway"):
            _run([*netns, "route", "replace", "default", "via", route["gateway"], "dev", IFNAME])


def add_hook(bundle: str) -> None:
    path = os.path.join(bundle, "config.json")
    with open(path) as f:
        spec = json.load(f)
    hook = {"path": sys.executable, "args": [sys.executable, "-I", os.path.abspath(__file__), HOOK]}
    spec.setdefault("hooks", {}).setdefault("prestart", []).append(hook)
    with open(path + ".podnet", "w") as f:
        json.dump(spec, f)
    os.replace(path + ".podnet", path)


def main(argv: list[str]) -> int:
    if argv[1:] == [HOOK]:
        rename_interface(int(json.load(sys.stdin)["pid"]))  # the OCI state runc passes
        return 0
    if "create" in argv[1:] and "--bundle" in argv:
        add_hook(argv[argv.index("--bundle") + 1])
    runc = shutil.which("runc")
    if runc is None:
        sys.stderr.write("runc not found on PATH\n")
        return 127
    os.execv(runc, [runc, *argv[1:]])
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv))
