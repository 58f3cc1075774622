"""The reward server's settings: flags > PODAGENT_REWARD_* variables > defaults, frozen.

As in podagent.config, each setting is declared once (FIELDS, declared in podagent.config.fields):
RewardSettings is made from the table, and the CLI makes its options and their help from it.
The head's settings of the server it runs (PODAGENT_REWARD_SCORING, ...) are these same fields:
podagent.config makes the head's from them, and the head forwards each by its variable.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from podagent.choices import SCORING  # noqa: F401 (its old home: bench and others name it here)
from podagent.config.building import read_fields
from podagent.config.fields import (
    REWARD_ENV_PREFIX,
    REWARD_FIELD_BY_ATTR,
    REWARD_FIELDS,
    RewardField,
    markdown_table,
    settings_class,
)
from podagent.config.parsers import existing_file, key, number, size  # noqa: F401 (named here too)
from podagent.errors import ConfigError

# The table is declared in podagent.config.fields (podagent warns about a misspelt PODAGENT_REWARD_*
# variable without importing the reward server); these are its names here.
ENV_PREFIX = REWARD_ENV_PREFIX
Field = RewardField
FIELDS = REWARD_FIELDS
FIELD_BY_ATTR = REWARD_FIELD_BY_ATTR


def cpu_count() -> int:
    """CPUs this process may run on (a container's or taskset's limit, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def memory() -> int:
    """Bytes of memory this container may use: its cgroup's limit, else the machine's."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path, encoding="ascii") as f:
                limit = f.read().strip()
        except OSError:
            continue
        if limit.isdigit():
            return min(int(limit), physical)
    return physical


@settings_class(FIELDS)
class RewardSettings:
    """One attribute per field of FIELDS, then where each came from."""

    # Where each setting came from: "flag", "env" or "default" (to name it in messages).
    sources: Mapping[str, str] | None = None

    def source_name(self, attr: str) -> str:
        f = FIELD_BY_ATTR[attr]
        return f.flag if (self.sources or {}).get(attr) == "flag" else f.env


def build(flags: Mapping[str, str | None] | None = None,
          environ: Mapping[str, str] | None = None) -> RewardSettings:
    """Raises ConfigError naming the flag or variable, its value and the rule."""
    env = os.environ if environ is None else environ
    values, sources = read_fields(FIELDS, flags or {}, env)
    values.setdefault("workers", cpu_count())
    values.setdefault("item_memory", memory() // 4)
    values.setdefault("listeners", min(values["workers"], default_listeners(cpu_count())))
    if values["listeners"] > values["workers"]:
        attr = "listeners"
        raise ConfigError(FIELD_BY_ATTR[attr].flag if sources.get(attr) == "flag"
                          else FIELD_BY_ATTR[attr].env, str(values[attr]),
                          f"must be at most the verifier workers ({values['workers']}): each "
                          f"listener has its own")
    for f in FIELDS:
        if f.attr not in values and f.default is not None:
            values[f.attr] = f.default
    return RewardSettings(**values, sources=sources)


def default_listeners(cpus: int) -> int:
    """One listener per 8 CPUs, at most 4: past that, workers rather than HTTP are the cap."""
    return max(1, min(4, cpus // 8))


def describe(scoring: str, template: str, strict: bool, func: str | None = None) -> str:
    """The profile in a few words, for the server's log and the head's output."""
    if func:
        return f"func (reward_func of {func}, one item per call)"
    if scoring == "openrlhf-m":
        return (f"openrlhf-m (OpenRLHF-M's reward rule, prompt template {template}"
                f"{', strict' if strict else ''})")
    if scoring == "openrlhf-boxed":
        return "openrlhf-boxed (upstream OpenRLHF's math reward function: the last \\boxed{})"
    return "boxed (the last \\boxed{} or <answer> block against the gold)"


def settings_table() -> str:
    """A Markdown table of the options, from FIELDS (for the README)."""
    return markdown_table(FIELDS)


if __name__ == "__main__":
    print(settings_table())
