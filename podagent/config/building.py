"""Building Settings: each field read from its flag, else its variable (flags > environment >
defaults); the defaults derived from other settings (the run name, the worker count, what to do
after the run); the rules between settings, checked once, as one-line ConfigErrors.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from podagent import trainers
from podagent.choices import AfterRun, OnNodeLoss
from podagent.config.fields import (
    FIELD_BY_ATTR,
    FIELDS,
    RUN_NAME_FROM_HEAD_POD_ID,
    RUN_NAME_FROM_POD_ID,
    RUN_NAME_FROM_PRIMARY_ADDR,
    Settings,
)
from podagent.config.names import unknown_settings
from podagent.config.parsers import run_name
from podagent.config.policy import RUNPOD_API_KEY, check_token, read_token_file, runpod_key
from podagent.errors import ConfigError


def read_fields(
    table: Iterable[Any], flags: Mapping[str, str | None], env: Mapping[str, str]
) -> tuple[dict[str, Any], dict[str, str]]:
    """Parse each field of a table (attr, flag, env, parse): flag, else environment.

    Returns (values given, source of every field: "flag", "env" or "default"); raises
    ConfigError naming the flag or variable, the value and the rule.
    """
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for f in table:
        raw, name, source = flags.get(f.attr), f.flag, "flag"
        if raw is None or not str(raw).strip():
            raw, name, source = env.get(f.env), f.env, "env"
        # Templates leave placeholders empty: an empty value means "not set".
        if raw is None or not str(raw).strip():
            sources[f.attr] = "default"
            continue
        raw = str(raw).strip()
        try:
            values[f.attr] = f.parse(raw)
        except ValueError as exc:
            raise ConfigError(name or f.env, raw, str(exc)) from None
        sources[f.attr] = source
    return values, sources



def build(
    flags: Mapping[str, str | None] | None = None,
    environ: Mapping[str, str] | None = None,
    job_argv: tuple[str, ...] | None = None,
    now: float | None = None,
) -> Settings:
    """Flags > environment > defaults. Raises ConfigError naming the variable, value and rule."""
    env = dict(os.environ if environ is None else environ)
    values, sources = read_fields(FIELDS, flags or {}, env)
    if job_argv:
        values["job"], sources["job"] = tuple(job_argv), "flag"
    if "expected_workers" not in values:
        if values.get("head_pod_id"):
            values["expected_workers"] = 1  # as the seed's script did
        elif values.get("num_nodes"):
            values["expected_workers"] = values["num_nodes"] - 1
    if "run_name" not in values:
        derived = derived_run_name(values)
        if derived:
            values["run_name"], sources["run_name"] = derived
        else:
            started = time.gmtime(time.time() if now is None else now)
            values["run_name"] = time.strftime("podagent-%Y%m%d-%H%M%S", started)
    # A RunPod pod whose process exits is restarted, and would run again: stay up instead.
    values.setdefault("after_run", AfterRun.default(
        on_runpod=bool(values.get("pod_id")), can_stop=bool(runpod_key(env, from_file=False))))
    restarts = values.get("restarts", FIELD_BY_ATTR["restarts"].default)
    values.setdefault("on_node_loss", OnNodeLoss.default(restarts))
    values.setdefault("log_dir", _default_log_dir())
    profile = trainers.read(values["job"]) if values.get("job") else None
    if profile is not None and "resume_flag" not in values:
        launcher = values.get("launcher", FIELD_BY_ATTR["launcher"].default)
        values["resume_flag"] = profile.trainer.resume_for(launcher)
        sources["resume_flag"] = f"derived from the job ({profile.trainer.name}, {launcher})"
    if "checkpoint_dir" not in values and profile is not None and profile.checkpoint_dir:
        values["checkpoint_dir"] = profile.checkpoint_dir
        sources["checkpoint_dir"] = f"derived from the job's {profile.trainer.checkpoint[0]}"
    if "checkpoint_dir" not in values and _default_checkpoint_dir():
        values["checkpoint_dir"] = _default_checkpoint_dir()
    for f in FIELDS:
        if f.attr not in values and f.default is not None:
            values[f.attr] = f.default

    settings = Settings(
        **values, environ=MappingProxyType(env), sources=MappingProxyType(sources),
        token_from_file=read_token_file(env), warnings=tuple(unknown_settings(env)),
        profile=profile,
    )
    _check_relations(settings)
    check_token(settings.environ, settings.token_from_file)
    _check_after_run(settings)
    return settings


def _default_log_dir() -> str:
    return "/workspace/podagent/logs" if Path("/workspace").is_dir() else "podagent-logs"


def _default_checkpoint_dir() -> str | None:
    # RunPod's volume survives the pod; elsewhere there is no safe guess.
    return "/workspace/checkpoints" if Path("/workspace").is_dir() else None


# --- the default run name: the same after a container restart --------------------------------

_RUN_NAME_MAX = 64
_RUN_NAME_HASH = 8  # hex digits of the full derived part kept when it must be shortened


def _run_name_from(part: str) -> str | None:
    """podagent-PART, made to satisfy the run-name rule: characters outside [A-Za-z0-9._-]
    become '-'; a name too long keeps PART's start and a short hash of all of it, so two long
    ids that share a prefix still give two names (the same on every pod, every start)."""
    clean = re.sub(r"[^A-Za-z0-9._-]", "-", part).strip("-._")
    if not clean:
        return None
    name = f"podagent-{clean}"
    if len(name) > _RUN_NAME_MAX:
        digest = hashlib.sha256(part.encode()).hexdigest()[:_RUN_NAME_HASH]
        keep = _RUN_NAME_MAX - len("podagent-") - 1 - _RUN_NAME_HASH
        name = f"podagent-{clean[:keep].rstrip('-._')}-{digest}"
    return run_name(name)


def derived_run_name(values: Mapping[str, Any]) -> tuple[str, str] | None:
    """(run name, source) from what stays the same when a container restarts, first match:
    HEAD_POD_ID (RunPod Global Networking: one value on every pod of the cluster), the Instant
    Cluster's PRIMARY_ADDR (and NUM_NODES), RUNPOD_POD_ID (a single pod). None: no such
    fact, so the caller falls back to the start time (a name that never repeats)."""
    if values.get("head_pod_id"):
        name = _run_name_from(values["head_pod_id"])
        if name:
            return name, RUN_NAME_FROM_HEAD_POD_ID
    if values.get("primary_addr"):
        part = re.sub(r"[.:]", "-", values["primary_addr"])
        if values.get("num_nodes"):
            part += f"-{values['num_nodes']}n"
        name = _run_name_from(part)
        if name:
            return name, RUN_NAME_FROM_PRIMARY_ADDR
    if values.get("pod_id"):
        name = _run_name_from(values["pod_id"])
        if name:
            return name, RUN_NAME_FROM_POD_ID
    return None


# --- rules between settings --------------------------------------------------------------------

def _check_relations(settings: Settings) -> None:
    if settings.min_workers is not None and settings.min_workers > settings.expected_workers:
        raise ConfigError(
            settings.source_name("min_workers"), str(settings.min_workers),
            f"must be <= EXPECTED_WORKERS ({settings.expected_workers})",
        )
    ports = {"ray_port": settings.ray_port, "dashboard_port": settings.dashboard_port}
    if settings.reward != "none":
        ports["reward_port"] = settings.reward_port
    seen: dict[int, str] = {}
    for attr, taken in ports.items():
        if taken in seen:
            raise ConfigError(settings.source_name(attr), str(taken),
                              f"must differ from {FIELD_BY_ATTR[seen[taken]].env}")
        seen[taken] = attr
    if settings.reward == "cmd" and not settings.reward_cmd:
        raise ConfigError(settings.source_name("reward_cmd"), "",
                          "must be set when PODAGENT_REWARD=cmd")
    if settings.reward == "func" and not settings.reward_func:
        raise ConfigError(settings.source_name("reward_func"), "",
                          "must be set when PODAGENT_REWARD=func")


def _check_after_run(settings: Settings) -> None:
    if settings.after_run != AfterRun.STOP_POD:
        return
    when = f"when {settings.source_name('after_run')}=stop-pod"
    if not settings.runpod_api_key:
        raise ConfigError(RUNPOD_API_KEY, "",
                          f"must be set {when} (podagent stops this pod through RunPod's API)")
    if not settings.pod_id:
        raise ConfigError(settings.source_name("pod_id"), "",
                          f"must be set {when} (the id of the pod to stop; RunPod sets it)")
