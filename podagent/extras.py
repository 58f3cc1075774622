"""Optional parts of podagent and what they need: a missing one is one clear line, not a traceback.

podagent's core is only what bringing a cluster up needs. The built-in reward server and W&B
logging are extras (`pip install 'podagent[reward]'`, `'podagent[wandb]'`), and torch is never
installed by podagent at all: GPU images bring their own build, and pip replacing it would be
worse than any error. Presence is checked with `find_spec`, which imports nothing.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from podagent.errors import MissingDependency


@dataclass(frozen=True)
class Extra:
    name: str
    modules: tuple[str, ...]  # import names, as `find_spec` takes them
    packages: str  # what pip installs, for the message


EXTRAS = {
    "reward": Extra("reward", ("aiohttp", "pebble", "math_verify", "pylatexenc"),
                    "aiohttp, pebble, math-verify and pylatexenc"),
    "wandb": Extra("wandb", ("wandb",), "wandb"),
    "up": Extra("up", ("rich",), "rich"),
    "accelerate": Extra("accelerate", ("accelerate",), "accelerate"),
}


def _absent(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):  # a broken parent package counts as absent
        return True


def missing(extra: str) -> tuple[str, ...]:
    """The modules of `extra` this Python lacks (empty: the extra is installed)."""
    return tuple(m for m in EXTRAS[extra].modules if _absent(m))


def require(extra: str, what: str, instead: str = "") -> None:
    """Raise MissingDependency naming the extra to install when `what` cannot run."""
    lacking = missing(extra)
    if lacking:
        spec = EXTRAS[extra]
        alternative = f", or {instead}" if instead else ""
        raise MissingDependency(
            f"{what} needs podagent's {spec.name} extra ({spec.packages}; missing here: "
            f"{', '.join(lacking)}): pip install 'podagent[{spec.name}]'{alternative}")


def require_torch(what: str, alternative: str = "") -> None:
    """torch is the image's own: podagent never installs it, so say what to do instead."""
    if _absent("torch"):
        instead = f", or {alternative}" if alternative else ""
        raise MissingDependency(
            f"{what} needs torch, which this Python does not have; podagent never installs "
            f"torch (GPU images bring their own build): use an image with torch{instead}")
