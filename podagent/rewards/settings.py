"""The reward server's settings: flags > PODAGENT_REWARD_* variables > defaults, frozen.

As in podagent.config, each setting is declared once (FIELDS); the CLI makes its options and
their help from the same table.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from podagent import config
from podagent.rewards import openrlhf_m
from podagent.rewards.verify import FORMAT_WEIGHT

ENV_PREFIX = "PODAGENT_REWARD_"
_SIZE = re.compile(r"([0-9]{1,10})\s*(|B|KiB|MiB|GiB)")
_UNITS = {"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def cpu_count() -> int:
    """CPUs this process may run on (a container's or taskset's limit, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def size(raw: str) -> int:
    rule = "must be a size in bytes from 1KiB to 1GiB (e.g. 16MiB or 1048576)"
    m = _SIZE.fullmatch(raw)
    if not m:
        raise ValueError(rule)
    value = int(m.group(1)) * _UNITS[m.group(2)]
    if not 1 << 10 <= value <= 1 << 30:
        raise ValueError(rule)
    return value


def number(minimum: float, maximum: float) -> Callable[[str], float]:
    rule = f"must be a number >= {minimum:g} and <= {maximum:g}"

    def parse(raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(rule) from None
        if not (math.isfinite(value) and minimum <= value <= maximum):
            raise ValueError(rule)
        return value

    return parse


def key(raw: str) -> str:
    if not raw or len(raw) > 200:
        raise ValueError("must be a JSON field name (1-200 characters)")
    return raw


def existing_file(raw: str) -> str:
    if "\x00" in raw or not os.path.isfile(raw):
        raise ValueError("must be an existing JSONL file")
    return raw


@dataclass(frozen=True)
class Field:
    attr: str
    parse: Callable[[str], Any]
    help: str
    default: Any = None
    default_doc: str = ""
    flag_name: str = ""  # when the flag is not --ATTR (the seed's own flag name)

    @property
    def flag(self) -> str:
        return self.flag_name or "--" + self.attr.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.attr.upper()


SCORING = ("openrlhf-m", "boxed")


FIELDS: tuple[Field, ...] = (
    Field("scoring", config.choice(*SCORING),
          "Scoring profile: openrlhf-m (OpenRLHF-M's reward server, item for item) or boxed "
          "(the last \\boxed{} or <answer> block; see docs/reward-server.md).", "openrlhf-m"),
    Field("template", config.choice(*openrlhf_m.TEMPLATES),
          "openrlhf-m: the chat template whose assistant prefix starts the response "
          "(the seed's --prompt-template).", "chatml", flag_name="--prompt-template"),
    Field("strict", config.zero_one,
          "openrlhf-m: 1 scores an unparseable gold answer, or a comparison that raises, as "
          "accuracy 0; 0 scores them 1, as OpenRLHF-M's server does.", False),
    # Loopback by default: the server has no authentication. The head passes its
    # cluster-private address.
    Field("host", config.host, "Address to listen on.", "127.0.0.1"),
    Field("port", config.port, "TCP port to listen on.", 5000),
    Field("workers", config.whole(1, 1024), "Verifier processes.",
          default_doc="CPUs this process may use"),
    Field("item_timeout", number(0.1, 600),
          "Seconds one item may take to verify; past it the worker is killed and the item "
          "scores 0.", 5.0),
    # A request's budget: preparing it takes time linear in its bytes, a slice at a time,
    # turn about with other requests; the limits bound its memory and its share. The defaults
    # are four times the batches trainers send (OpenRLHF-M: one batch per call, 256 to 1,024
    # items of a few KB, say 16 KB at most; upstream OpenRLHF: one item per request).
    Field("max_items", config.whole(1, 1_000_000),
          "Most items in one request; a request with more gets HTTP 413 naming this limit.",
          4096),
    Field("max_body", size,
          "Largest request body (bytes, or with KiB/MiB/GiB); a larger one gets HTTP 413 "
          "naming this limit.", 64 << 20, default_doc="64MiB"),
    Field("format_weight", number(0, 100),
          "FORMAT_WEIGHT in reward = accuracy + FORMAT_WEIGHT × format.", FORMAT_WEIGHT),
    Field("dataset", existing_file,
          "JSONL of prompts and gold answers. openrlhf-m: gold answers come from it by the "
          "request's prompts (labels are used only without it); boxed: for requests that send "
          "no labels."),
    Field("prompt_key", key, "Prompt field of --dataset records.", "prompt"),
    Field("answer_key", key, "Gold answer field of --dataset records.", "answer"),
)
FIELD_BY_ATTR = {f.attr: f for f in FIELDS}


@dataclass(frozen=True)
class RewardSettings:
    scoring: str = "openrlhf-m"
    template: str = "chatml"
    strict: bool = False
    host: str = "127.0.0.1"
    port: int = 5000
    workers: int = 1
    item_timeout: float = 5.0
    max_items: int = 4096
    max_body: int = 64 << 20
    format_weight: float = FORMAT_WEIGHT
    dataset: str | None = None
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    # Where each setting came from: "flag", "env" or "default" (to name it in messages).
    sources: Mapping[str, str] | None = None

    def source_name(self, attr: str) -> str:
        f = FIELD_BY_ATTR[attr]
        return f.flag if (self.sources or {}).get(attr) == "flag" else f.env


def build(flags: Mapping[str, str | None] | None = None,
          environ: Mapping[str, str] | None = None) -> RewardSettings:
    """Raises ConfigError naming the flag or variable, its value and the rule."""
    env = os.environ if environ is None else environ
    values, sources = config.read_fields(FIELDS, flags or {}, env)
    for f in FIELDS:
        if f.attr not in values and f.default is not None:
            values[f.attr] = f.default
    values.setdefault("workers", cpu_count())
    return RewardSettings(**values, sources=sources)


def describe(scoring: str, template: str, strict: bool) -> str:
    """The profile in a few words, for the server's log and the head's output."""
    if scoring == "openrlhf-m":
        return (f"openrlhf-m (OpenRLHF-M's reward rule, prompt template {template}"
                f"{', strict' if strict else ''})")
    return "boxed (the last \\boxed{} or <answer> block against the gold)"


def settings_table() -> str:
    """A Markdown table of the options, from FIELDS (for the README)."""
    return config.markdown_table(FIELDS)


assert {f.attr for f in FIELDS} <= {f.name for f in fields(RewardSettings)}

if __name__ == "__main__":
    print(settings_table())
