"""The Ray this image has, and what podagent may ask of it.

podagent never brings its own Ray: every node and the job's driver must run one version, so it
starts and talks to whatever the trainer's image has (OpenRLHF pins 2.48.0; verl leaves it
open). The version is read from the package metadata, which imports nothing (importing Ray
costs about a second and 70 MB), and printed on podagent's first line.

What podagent uses of Ray (the `ray start` flags in ray_node.plan, the GCS messages gcs.py
encodes by hand, the health-check variables, the Jobs API) exists in every release from
SUPPORTED_FROM on: tests/compat checks each of them against every release's own wheel. What
appeared later is declared in FEATURES and gated here, before podagent touches anything.
"""

from __future__ import annotations

import importlib.metadata
import re
from dataclasses import dataclass

from podagent.config import Settings
from podagent.config.policy import TOKEN_PATH_VARIABLE, TOKEN_VARIABLES
from podagent.errors import MissingDependency, RayFeatureMissing

SUPPORTED_FROM = "2.48.0"  # the oldest release tested at run time (OpenRLHF's pin)
NEWEST_PROVEN = "2.60"  # the newest minor release checked against what podagent uses
TESTED = ("2.48.0", "2.60.0")  # unit, integration and multi-pod tests run on each of these


@dataclass(frozen=True)
class Feature:
    name: str
    since: str  # the first release that has it
    what: str  # for messages: what the user asked for that needs it


FEATURES = {
    # RAY_AUTH_MODE=token with RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH: the GCS, the dashboard and
    # the Jobs API refuse anyone without the token. An older Ray ignores these variables, so a
    # cluster the user believes protected would run open: refused, never passed through.
    "token_auth": Feature("token_auth", "2.52.0", "cluster tokens (RAY_AUTH_MODE=token)"),
    # RAY_DASHBOARD_STARTUP_TIMEOUT_S: how long `ray start --head` waits for its dashboard.
    # Older releases give it a fixed ~20 s, which a busy pod can miss: the head then retries
    # `ray start` (head_ray.RAY_START_ATTEMPTS_FIXED_DEADLINE), and workers join only once the
    # head's own node is up (discovery.HeadFinder.wait_for_gcs), so a retry never takes their
    # Ray away.
    "dashboard_startup_timeout": Feature(
        "dashboard_startup_timeout", "2.52.0",
        "a settable dashboard start-up timeout (RAY_DASHBOARD_STARTUP_TIMEOUT_S)"),
}


def parse(version: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a release string such as 2.48.0 or 3.0.0.dev0."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version.strip())
    if not match:
        raise ValueError(f"not a Ray version: {version!r}")
    major, minor, patch = match.groups(default="0")
    return int(major), int(minor), int(patch)


@dataclass(frozen=True)
class RayVersion:
    version: str

    @property
    def release(self) -> tuple[int, int, int]:
        return parse(self.version)

    def has(self, feature: str) -> bool:
        return self.release >= parse(FEATURES[feature].since)

    @property
    def supported(self) -> bool:
        return parse(SUPPORTED_FROM) <= self.release < (*parse(NEWEST_PROVEN)[:2], 10**6)

    def __str__(self) -> str:
        return f"Ray {self.version}"


def installed() -> RayVersion | None:
    """This Python's Ray, from its package metadata; None when there is none."""
    try:
        return RayVersion(importlib.metadata.version("ray"))
    except importlib.metadata.PackageNotFoundError:
        return None


def require() -> RayVersion:
    ray = installed()
    if ray is None:
        raise MissingDependency(
            "this Python has no Ray; podagent runs the image's own Ray (every node and the job "
            f"must share one version): use the trainer's image, or pip install "
            f"'ray[default]>={SUPPORTED_FROM}'")
    return ray


def untested_note(ray: RayVersion) -> str | None:
    """A line for a Ray outside the proven range (it may well work: say so, once, at start)."""
    if ray.supported:
        return None
    newer = ray.release >= parse(SUPPORTED_FROM)
    side = (f"newer than {NEWEST_PROVEN}.x, the newest" if newer
            else f"older than {SUPPORTED_FROM}, the oldest")
    return (f"{ray} is {side} release podagent is tested with ({SUPPORTED_FROM} to "
            f"{NEWEST_PROVEN}.x); going on")


def token_source(settings: Settings) -> str | None:
    """Which variable set the cluster token (for messages; the value is never shown)."""
    for name in (*TOKEN_VARIABLES, TOKEN_PATH_VARIABLE):
        if settings.environ.get(name, "").strip():
            return name
    return None


def refusal(settings: Settings, ray: RayVersion) -> tuple[str, str] | None:
    """(what this Ray cannot do that the settings ask for, what to do), or None."""
    source = token_source(settings)
    feature = FEATURES["token_auth"]
    if source and not ray.has(feature.name):
        return (f"{source} is set, but {feature.what} need Ray {feature.since} or newer and "
                f"this image has {ray}",
                f"unset {source} (then keep the dashboard private, PODAGENT_LISTEN=private), or "
                f"use an image with Ray >= {feature.since}")
    return None


def check(settings: Settings, ray: RayVersion) -> None:
    """Refuse what this Ray cannot do; raises RayFeatureMissing naming the setting and both
    versions."""
    refused = refusal(settings, ray)
    if refused:
        raise RayFeatureMissing(f"{refused[0]}: {refused[1]}")
