"""A reward function served over HTTP: upstream OpenRLHF's `reward_func` contract, pooled.

Upstream OpenRLHF's `--remote_rm_url` may name a Python file defining
`reward_func(queries, prompts, labels, **kwargs) -> dict` (`rewards`, optional `scores` and
`extra_logs`; tensors or lists). The trainer then runs it inside every vLLM engine's process, in
a thread, one sample per call, with no time limit. Served here instead (`--func FILE`,
PODAGENT_REWARD=func on the head), it runs in the verifier pool's processes: every node reaches
it by URL, it gets the pool's CPUs, and an item past `--item-timeout` has its worker killed and
scores `--default-reward`, as does an item on which the function raises (logged, never a
traceback per request).

The function is called as upstream calls it, one item per call (so a mean in its `extra_logs`
is that item's value); a pool task carries a few items, and a task that runs past the limit is
retried one item per task, so only the slow item pays. The built-in `openrlhf-boxed` profile is
served the same way, its rule being `openrlhf_boxed.accuracy`.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import logging
import math
import sys
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from podagent.errors import PodagentError
from podagent.rewards.pool import VerifierPool
from podagent.rewards.scorer import Scorer, parse_request
from podagent.rewards.similar import Steps
from podagent.rewards.verify import short

log = logging.getLogger("podagent.rewards")

# The `source` of the built-in openrlhf-boxed rule (anything else is a file's path).
OPENRLHF_BOXED = "podagent:openrlhf-boxed"
# Items of one pool task; fewer when that would leave workers idle.
MAX_CHUNK = 8


class FuncError(PodagentError):
    """The reward_func file cannot be served; the message says why (one line)."""


Item = tuple[str, "str | None", "str | None"]  # query, prompt, label


@dataclass(frozen=True)
class Scored:
    """One item's answer from the function, or why there is none."""

    reward: float = 0.0
    score: float = 0.0
    extra: Mapping[str, float] = field(default_factory=dict)
    error: str | None = None  # set: the function raised, or returned what is not a reward


# --- loading (the server at start, and each worker once) ----------------------------------------


def load(path: str) -> Callable[..., Any]:
    """The file's reward_func, its module run once; FuncError naming what is wrong."""
    from podagent.config.parsers import REWARD_FUNC_RULE, reward_func_file

    try:
        reward_func_file(path)  # the rule the head checks too: compiles, defines it
    except ValueError as exc:
        raise FuncError(str(exc)) from None
    name = f"podagent_reward_func_{abs(hash(path))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise FuncError(f"{REWARD_FUNC_RULE} (not importable)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling in the file look themselves up here
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:  # whatever the file does at import: one line, no traceback
        sys.modules.pop(name, None)
        raise FuncError(f"running it raised {_described(exc)}") from None
    func = getattr(module, "reward_func", None)
    if not callable(func):
        raise FuncError(f"{REWARD_FUNC_RULE} (its reward_func is "
                        f"{type(func).__name__}, not a function)")
    try:
        inspect.signature(func).bind([], [], [])
    except TypeError as exc:
        raise FuncError(f"reward_func cannot be called as reward_func(queries, prompts, "
                        f"labels): {exc}") from None
    except ValueError:  # no signature to read (a builtin): calling it will tell
        pass
    return func


def _described(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


# In each worker: the loaded rules, by source.
_RULES: dict[str, Callable[[str, str | None, str | None], Scored]] = {}


def _rule(source: str) -> Callable[[str, str | None, str | None], Scored]:
    rule = _RULES.get(source)
    if rule is None:
        if source == OPENRLHF_BOXED:
            from podagent.rewards import openrlhf_boxed

            rule = _boxed_rule(openrlhf_boxed.accuracy)
        else:
            rule = _func_rule(load(source))
        _RULES[source] = rule
    return rule


def _boxed_rule(accuracy: Callable[[str, str | None, str | None], float]
                ) -> Callable[[str, str | None, str | None], Scored]:
    def score(query: str, prompt: str | None, label: str | None) -> Scored:
        value = accuracy(query, prompt, label)
        # The key upstream's math reward function logs (its mean, over one item).
        return Scored(value, value, {"math_accuracy": value})

    return score


def _func_rule(func: Callable[..., Any]) -> Callable[[str, str | None, str | None], Scored]:
    def score(query: str, prompt: str | None, label: str | None) -> Scored:
        try:
            answer = func([query], [prompt], [label])
        except BaseException as exc:  # sys.exit() and Ctrl-C's exception too: this item's
            return Scored(error=f"reward_func raised {_described(exc)}")
        try:
            return _scored(answer)
        except ValueError as exc:
            return Scored(error=f"reward_func returned {exc}")
        except BaseException as exc:  # what it returned broke on reading (a hostile __len__)
            return Scored(error=f"reward_func returned something unreadable "
                                f"({_described(exc)})")

    return score


def _number(value: Any, what: str) -> float:
    """A number from what one item's reward may be: a float, a one-item list, a tensor."""
    if hasattr(value, "tolist"):  # a tensor or an array, without importing torch or numpy
        value = value.tolist()
    while isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise ValueError(f"{what} with {len(value)} values for one item")
        value = value[0]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} that is {type(value).__name__}, not a number")
    try:
        number = float(value)
    except OverflowError:  # an int past a float's range (10**400)
        raise ValueError(f"{what} that is too large for a number ({len(str(value))} "
                         f"digits)") from None
    if not math.isfinite(number):
        raise ValueError(f"{what} that is {number}")
    return number


def _scored(answer: Any) -> Scored:
    if not isinstance(answer, Mapping):
        raise ValueError(f"{type(answer).__name__}, not a dict with 'rewards'")
    if "rewards" not in answer:
        raise ValueError(f"a dict without 'rewards' (keys: {', '.join(map(str, answer))})")
    reward = _number(answer["rewards"], "'rewards'")
    scores = answer.get("scores")
    score = reward if scores is None else _number(scores, "'scores'")
    extra = answer.get("extra_logs") or {}
    if not isinstance(extra, Mapping):
        raise ValueError(f"'extra_logs' that is {type(extra).__name__}, not a dict")
    return Scored(reward, score, {str(k): _number(v, f"extra_logs[{k!r}]")
                                  for k, v in extra.items()})


def worker_load(source: str) -> bool:
    """In a worker: load the rule (the pool's start-up probe). Raises FuncError."""
    _rule(source)
    return True


def worker_score(source: str, items: list[Item]) -> list[Scored]:
    """In a worker: each item through the rule, one call per item."""
    rule = _rule(source)
    return [rule(*item) for item in items]


# --- the scorer (in the server) ------------------------------------------------------------------


class FuncScorer(Scorer):
    """`--func FILE` and `--scoring openrlhf-boxed`: a per-item rule run in the pool."""

    def __init__(self, pool: VerifierPool, source: str, *, default: float = 0.0,
                 **kwargs: Any):
        super().__init__(pool, **kwargs)
        self.source, self.default = source, default
        self.profile = "openrlhf-boxed" if source == OPENRLHF_BOXED else "func"
        self._running = 0

    def settings(self) -> dict[str, Any]:
        if self.profile == "func":
            return {"scoring": "func", "func": self.source, "default_reward": self.default}
        return {"scoring": self.profile, "default_reward": self.default}

    def in_flight(self) -> int:
        return self._running

    async def probe(self) -> bool:
        """The rule loads in a worker; raises FuncError (the file's import failed) as is."""
        return await self.pool.call(worker_load, (self.source,))

    def prepare_steps(self, body: bytes) -> Steps[list[Item]]:
        query, prompts, labels = parse_request(body, self.max_items)
        yield
        items: list[Item] = []
        for index, text in enumerate(query):
            prompt = prompts[index] if prompts is not None else None
            label = labels[index] if labels is not None else None
            if labels is None and self.golds is not None:
                label, _ = self.golds.lookup(prompt, text)
            items.append((text, prompt, label))
            yield
        return items

    async def score(self, items: list[Item]) -> dict[str, Any]:
        self.stats.items += len(items)
        size = self.pool.chunk_size(len(items), MAX_CHUNK)
        chunks = [items[start:start + size] for start in range(0, len(items), size)]
        self._running += len(items)
        try:
            answers = await asyncio.gather(*(self._chunk(chunk) for chunk in chunks))
        finally:
            self._running -= len(items)
        scored = [one for chunk in answers for one in chunk]
        self._log_errors(items, scored)
        return self._reply(scored)

    async def _chunk(self, items: list[Item]) -> list[Scored]:
        ran = await self.pool.run(worker_score, (self.source, items))
        if ran.status == "ok":
            self.stats.verified += len(items)
            return list(ran.value)
        if len(items) > 1:  # one of them may be the slow one: each gets its own limit now
            return [one for part in await asyncio.gather(*(self._chunk([i]) for i in items))
                    for one in part]
        if ran.status == "timeout":
            self.stats.timeouts += 1
            why = f"ran past the item timeout ({self.pool.item_timeout:g} s; worker replaced)"
        else:
            self.stats.crashes += 1
            why = "killed its worker process"
        return [Scored(self.default, self.default, error=f"the item {why}")]

    def _log_errors(self, items: list[Item], scored: list[Scored]) -> None:
        failed: dict[str, list[int]] = defaultdict(list)
        for index, one in enumerate(scored):
            if one.error is not None:
                failed[one.error].append(index)
        for error, indices in failed.items():
            self.stats.func_errors += len(indices)
            query, _, label = items[indices[0]]
            log.warning("%s: %s of this batch scored the default %g (first: query=%s label=%s)",
                        error, _count(indices), self.default, short(query[-200:]),
                        short(label or ""))

    def _reply(self, scored: list[Scored]) -> dict[str, Any]:
        default = self.default
        rewards = [default if one.error else one.reward for one in scored]
        reply: dict[str, Any] = {
            "rewards": rewards, "scores": [default if one.error else one.score for one in scored]}
        if self.extra_logs:
            keys = dict.fromkeys(key for one in scored for key in one.extra)
            reply["extra_logs"] = {key: [one.extra.get(key, default) for one in scored]
                                   for key in keys}
        return reply


def _count(indices: list[int]) -> str:
    return "1 item" if len(indices) == 1 else f"{len(indices)} items"


def source_of(scoring: str, func: str | None) -> str | None:
    """What the pool runs for these settings, or None when a math profile scores."""
    if func:
        return str(Path(func).resolve())
    return OPENRLHF_BOXED if scoring == "openrlhf-boxed" else None
