"""Variable names beside the settings: the PODAGENT_* variables podagent sets or reads that are
no setting, the retired ones, and one warning per PODAGENT_* variable podagent does not know (a
typo, with the closest known name).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from types import MappingProxyType

from podagent.config.fields import FIELDS, REWARD_FIELDS, Settings
from podagent.config.policy import TOKEN_VARIABLES

PREFIX = "PODAGENT_"
UP_RUN_LABEL = "PODAGENT_UP_RUN"  # every pod `podagent up` creates carries its run's name in it
REWARD_PRELOAD = "PODAGENT_REWARD_PRELOAD"

# In the environment of every `ray start` podagent runs, so that Ray's daemons and all they
# start inherit it: a Ray on this pod without it is someone else's (process.pod_ray).
RAY_OWNER = "PODAGENT_RAY_OWNER"


def ray_owner(settings: Settings) -> str:
    """The mark's value: who started that Ray (for a person reading a process's environment)."""
    return f"podagent run {settings.run_name}"


# PODAGENT_* variables that are podagent's own but not settings in FIELDS (nor the reward
# server's PODAGENT_REWARD_* table), so never warned about; each with why it exists.
OTHER_VARIABLES: Mapping[str, str] = MappingProxyType({
    "PODAGENT_TOKEN": "the cluster token (a secret: the environment only, never a flag)",
    "PODAGENT_NUM_NODES": "set by the head for the job: nodes in the cluster",
    "PODAGENT_SUBMISSION_ID": "set by the head for the job: its Ray submission id (<run>-N)",
    "PODAGENT_ATTEMPT": "set by the head for the job: N, 1 at first, one more per restart",
    "PODAGENT_CHECK_BACKEND": "the built-in cluster check's collective backend (nccl, gloo)",
    "PODAGENT_CHECK_START_TIMEOUT": "seconds the cluster check gives its ranks to start",
    "PODAGENT_CHECK_RUN_TIMEOUT": "seconds the cluster check gives a collective to finish",
    "PODAGENT_CHECK_HANG_RANK": "a drill: this rank of the cluster check sleeps before its DDP "
                                "step on the job's first attempt (the hang watch's work seen)",
    "PODAGENT_HEARTBEAT": "set by podagent for the job: a file it may touch to show progress "
                          "(podagent.job.heartbeat(); PODAGENT_HANG_TIMEOUT)",
    "PODAGENT_STACKS": "set by podagent for the job: where podagent.job.enable_stack_dumps() "
                       "has faulthandler write its stacks on a hang",
    "PODAGENT_RAY_MATRIX_ONLY": "set by the test suite when it runs itself under another Ray",
    UP_RUN_LABEL: "set by `podagent up` on the pods it creates: the run they belong to "
                       "(how `podagent down` finds them)",
    "PODAGENT_RUNPOD_API_KEY": "a RunPod account key for the pods of an `up` run (a RunPod "
                               "secret): the head terminates every pod of its run at its end",
    RAY_OWNER: "set by podagent on every Ray it starts (and so on that Ray's jobs): its mark",
    "PODAGENT_REWARD_URL": "verl's reward function (podagent.rewards.client): the reward "
                           "server's URL, used before the REMOTE_RM_URL the head sets for the job",
    REWARD_PRELOAD: "set by the reward server for its verifier pool: the reward rule (a "
                    "reward_func file, openrlhf-boxed) every worker starts with",
})


# Names podagent read once and reads no more: set, each gets its own line.
RETIRED_VARIABLES: Mapping[str, str] = MappingProxyType({
    "PODAGENT_RUNPOD_API_URL": "is retired with RunPod's API v1: RUNPOD_API_URL is the one "
                               "setting for RunPod's API (v2, https://api.runpod.io)",
})


def known_variables() -> frozenset[str]:
    """Every variable podagent reads or sets: FIELDS, the reward server's table, the rest."""
    return frozenset({f.env for f in FIELDS} | {f.env for f in REWARD_FIELDS}
                     | set(OTHER_VARIABLES) | set(TOKEN_VARIABLES) | set(RETIRED_VARIABLES))


def _shown_name(name: str) -> str:
    return name if re.fullmatch(r"[A-Za-z0-9_]+", name) else ascii(name)


def unknown_settings(environ: Mapping[str, str]) -> list[str]:
    """One warning per PODAGENT_* variable podagent does not know, with the closest known
    name when one is close (a typo). Names only: a value may be a secret. An empty value
    means "not set" (as for every setting), so it is not warned about."""
    known = known_variables()
    # Compared without the prefix, so that the shared PODAGENT_ does not make every name
    # look close; FIELDS first, so a setting wins over a name podagent sets for the job.
    by_stem: dict[str, str] = {}
    for name in [f.env for f in FIELDS] + sorted(known):
        by_stem.setdefault(name.removeprefix(PREFIX), name)
    warnings = []
    for name in sorted(environ):
        if name in RETIRED_VARIABLES and str(environ[name]).strip():
            warnings.append(f"{name} {RETIRED_VARIABLES[name]} (ignored)")
            continue
        if not name.startswith(PREFIX) or name in known or not str(environ[name]).strip():
            continue
        close = difflib.get_close_matches(name.removeprefix(PREFIX), list(by_stem), n=1)
        hint = f"; did you mean {by_stem[close[0]]}?" if close else ""
        warnings.append(f"{_shown_name(name)} is not a podagent setting{hint} (ignored)")
    return warnings
