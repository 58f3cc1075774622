"""A batch of the protocol in, one reward per item out, doing as little sympy as it can.

GRPO sends every prompt's samples together (8 or more), all with the same gold, and many
samples end in the same answer. So, in order: an exact match of the canonical strings is
correct at once (`verify.quick_verdict`); a pair verified before comes from the verdict cache;
equal pairs in a batch, and pairs already being verified for another request, are verified once;
only what is left goes to the pool, where each worker keeps its parsed golds.
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from podagent.rewards import verify
from podagent.rewards.dataset import GoldIndex
from podagent.rewards.pool import VerifierPool

VERDICT_CACHE_SIZE = 1 << 16
# Longer pairs are not cached: they are rare, seldom repeat, and would make the cache's memory
# depend on what clients send.
MAX_CACHED_PAIR_CHARS = 1024
_NO_GOLD = ""  # the gold-form cache's entry for a label with no usable answer


class BadRequest(ValueError):
    """The request breaks the protocol; the message says how (it goes back as a 400)."""


@dataclass
class Stats:
    requests: int = 0
    items: int = 0
    bad_requests: int = 0
    errors: int = 0  # requests that hit an internal error (500)
    fast_path: int = 0  # items decided from the canonical strings alone
    cache_hits: int = 0  # items answered from the verdict cache
    deduped: int = 0  # items that shared a verification with an equal item
    verified: int = 0  # verifications the pool completed
    timeouts: int = 0  # items killed at the per-item time limit (scored 0)
    crashes: int = 0  # items whose worker died or raised (scored 0)
    gold_parses: int = 0  # golds parsed by the workers (each worker keeps its own cache)
    unlabeled: int = 0  # items with no gold (no label, not in the dataset): accuracy 0
    no_answer: int = 0  # items whose response gave no final answer


@dataclass(frozen=True)
class Item:
    answer: str | None  # canonical final answer
    gold: str | None  # canonical gold
    format: float


_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", int: "a number",
               float: "a number", bool: "a boolean", type(None): "null"}


def _kind(value: Any) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


def _strings(data: dict[str, Any], name: str) -> list[str] | None:
    values = data.get(name)
    if values is None and name != "query":
        return None
    if not isinstance(values, list):
        raise BadRequest(f"'{name}' must be a list of strings, not {_kind(values)}")
    for index, value in enumerate(values):
        if not isinstance(value, str):
            raise BadRequest(f"'{name}' must be a list of strings; item {index} is "
                             f"{_kind(value)}")
    return values


def _items(count: int) -> str:
    return f"{count} item" if count == 1 else f"{count} items"


def parse_request(body: bytes, max_items: int) -> tuple[list[str], list[str] | None,
                                                         list[str] | None]:
    """(query, prompts, labels) from a request body, or BadRequest."""
    try:
        data = json.loads(body)
    except UnicodeDecodeError:
        raise BadRequest("body is not JSON (not UTF-8 text)") from None
    except json.JSONDecodeError as exc:
        raise BadRequest(f"body is not JSON ({exc.msg} at line {exc.lineno} column "
                         f"{exc.colno})") from None
    except RecursionError:
        raise BadRequest("body is not JSON this server reads (nested too deeply)") from None
    if not isinstance(data, dict):
        raise BadRequest(f'body must be a JSON object like {{"query": [...]}}, not {_kind(data)}')
    if "query" not in data:
        raise BadRequest("missing 'query' (a list of strings: prompt and response)")
    query = _strings(data, "query")
    assert query is not None
    if len(query) > max_items:
        raise BadRequest(f"'query' has {len(query)} items; the limit is {max_items} "
                         "(--max-items)")
    prompts, labels = _strings(data, "prompts"), _strings(data, "labels")
    for name, values in (("prompts", prompts), ("labels", labels)):
        if values is not None and len(values) != len(query):
            raise BadRequest(f"'{name}' has {_items(len(values))} but 'query' has "
                             f"{_items(len(query))}")
    return query, prompts, labels


class Scorer:
    def __init__(self, pool: VerifierPool, *, max_items: int = 1024,
                 format_weight: float = verify.FORMAT_WEIGHT, golds: GoldIndex | None = None):
        self.pool, self.max_items, self.format_weight = pool, max_items, format_weight
        self.golds = golds
        self.stats = Stats()
        self.started = time.monotonic()
        self._verdicts = verify.LRU(VERDICT_CACHE_SIZE)
        self._gold_forms = verify.LRU(4096)  # raw label -> canonical gold
        self._inflight: dict[tuple[str, str], asyncio.Task[bool]] = {}
        # Decoding, validation and extraction are plain Python on up to max_body bytes: one
        # thread keeps them off the event loop (so /health answers) and owns _gold_forms.
        self._prep = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward-prep")

    def close(self) -> None:
        self._prep.shutdown(wait=False, cancel_futures=True)

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok", **asdict(self.stats),
            "in_flight": len(self._inflight), "pool_size": self.pool.workers,
            "item_timeout_s": self.pool.item_timeout, "format_weight": self.format_weight,
            "verdict_cache_entries": len(self._verdicts),
            "dataset_prompts": len(self.golds) if self.golds is not None else None,
            "uptime_s": round(time.monotonic() - self.started, 1),
        }

    # --- preparation (in the prep thread) -------------------------------------------------------

    def _gold_form(self, label: str) -> str | None:
        if len(label) > MAX_CACHED_PAIR_CHARS:  # a whole solution as the label: not cached
            return verify.canonical_gold(label)
        form = self._gold_forms.get(label)
        if form is None:
            form = verify.canonical_gold(label) or _NO_GOLD
            self._gold_forms.put(label, form)
        return form or None

    def prepare(self, body: bytes) -> list[Item]:
        query, prompts, labels = parse_request(body, self.max_items)
        items = []
        for index, text in enumerate(query):
            prompt = prompts[index] if prompts is not None else None
            label: str | None = labels[index] if labels is not None else None
            if labels is None and self.golds is not None:
                label, matched = self.golds.lookup(prompt, text)
                if not (prompt and text.startswith(prompt)):
                    prompt = matched  # the dataset's prompt is what the response follows
            found = verify.extract(verify.split_response(text, prompt))
            answer = verify.canonical(found.answer) if found.answer is not None else None
            gold = self._gold_form(label) if label and label.strip() else None
            items.append(Item(answer or None, gold, 1.0 if found.well_formed else 0.0))
        return items

    # --- scoring (on the event loop) ------------------------------------------------------------

    async def score_body(self, body: bytes) -> dict[str, list[float]]:
        loop = asyncio.get_running_loop()
        try:
            items = await loop.run_in_executor(self._prep, self.prepare, body)
        except BadRequest:
            self.stats.bad_requests += 1
            raise
        return await self.score(items)

    async def score(self, items: list[Item]) -> dict[str, list[float]]:
        stats = self.stats
        stats.requests += 1
        stats.items += len(items)
        accuracy = [0.0] * len(items)
        pending: dict[tuple[str, str], list[int]] = {}
        for index, item in enumerate(items):
            if item.gold is None:
                stats.unlabeled += 1
                continue
            if item.answer is None:
                stats.no_answer += 1
                continue
            quick = verify.quick_verdict(item.answer, item.gold)
            if quick is not None:
                stats.fast_path += 1
                accuracy[index] = float(quick)
                continue
            key = (item.answer, item.gold)
            cached = self._verdicts.get(key) if _cacheable(key) else None
            if cached is not None:
                stats.cache_hits += 1
                accuracy[index] = float(cached)
            elif key in pending:
                stats.deduped += 1
                pending[key].append(index)
            else:
                pending[key] = [index]
        keys = list(pending)
        verdicts = await asyncio.gather(*(self._verdict(key) for key in keys))
        for key, correct in zip(keys, verdicts, strict=True):
            for index in pending[key]:
                accuracy[index] = float(correct)
        formats = [item.format for item in items]
        weight = self.format_weight
        rewards = [acc + weight * fmt for acc, fmt in zip(accuracy, formats, strict=True)]
        # scores: accuracy in [0, 1], what OpenRLHF's dynamic filtering averages per prompt.
        return {"rewards": rewards, "scores": accuracy, "format_rewards": formats,
                "acc_rewards": accuracy}

    async def _verdict(self, key: tuple[str, str]) -> bool:
        task = self._inflight.get(key)
        if task is None:
            task = asyncio.ensure_future(self._verify(key))
            self._inflight[key] = task
            task.add_done_callback(lambda _: self._inflight.pop(key, None))
        else:
            self.stats.deduped += 1  # another request is verifying the same pair right now
        # Shielded: one request giving up must not cancel a verification others wait for.
        return await asyncio.shield(task)

    async def _verify(self, key: tuple[str, str]) -> bool:
        outcome = await self.pool.check(*key)
        self.stats.gold_parses += outcome.gold_parses
        if outcome.status == "ok":
            self.stats.verified += 1
            if _cacheable(key):
                self._verdicts.put(key, outcome.correct)
        elif outcome.status == "timeout":
            self.stats.timeouts += 1  # not cached: a loaded machine can time out a fair item
        else:
            self.stats.crashes += 1
        return outcome.correct



def _cacheable(key: tuple[str, str]) -> bool:
    return len(key[0]) + len(key[1]) <= MAX_CACHED_PAIR_CHARS
