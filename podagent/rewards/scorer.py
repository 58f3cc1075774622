"""A batch of the protocol in, one reward per item out, doing as little sympy as it can.

GRPO sends every prompt's samples together (8 or more), all with the same gold, and many
samples end in the same answer. Each profile has its scorer:

* `BoxedScorer` (`--scoring boxed`), in order: an exact match of the canonical strings is
  correct at once (`verify.quick_verdict`); a pair verified before comes from the verdict
  cache; equal pairs in a batch, and pairs already being verified for another request, are
  verified once; only what is left goes to the pool, where each worker keeps its parsed golds.
* `OpenrlhfMScorer` (`--scoring openrlhf-m`): response, format and gold are found here
  (`openrlhf_m`); an item seen before comes from the verdict cache; equal items in a batch, and
  items already being verified for another request, are verified once; the rest goes to the
  pool a prompt's samples at a time, where a worker parses the gold once and takes the
  shortcuts of `openrlhf_m_verify`. math-verify's pattern search runs only in the pool: on a
  hostile response it can take seconds, and only a worker can be killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from podagent.rewards import batching, openrlhf_m, verify
from podagent.rewards import openrlhf_m_verify as seed
from podagent.rewards.dataset import GoldIndex
from podagent.rewards.pool import VerifierPool
from podagent.rewards.settings import FIELD_BY_ATTR, RewardSettings
from podagent.rewards.similar import Steps
from podagent.rewards.verify import short

log = logging.getLogger("podagent.rewards")

VERDICT_CACHE_SIZE = 1 << 16
# Preparing a request (decoding, validation, extraction, gold lookup) runs in slices of about
# this long on the one prep thread; each slice goes to the back of its queue (`score_body`).
PREP_SLICE = 0.05
# ...except the first slice of a request (or batch) that finds the prep thread idle: it runs on
# the event loop for at most this long, which is all a small request needs (one sample per
# request: a few tenths of a millisecond for a batch of them), and the hand-over to the thread
# and back, two waits for the interpreter lock on a busy server, is skipped.
INLINE_SLICE = 0.002
# Longer pairs are not cached: they are rare, seldom repeat, and would make the cache's memory
# depend on what clients send.
MAX_CACHED_PAIR_CHARS = 1024
_NO_GOLD = ""  # the gold-form cache's entry for a label with no usable answer


class BadRequest(ValueError):
    """The request breaks the protocol; the message says how (it goes back as a 400)."""


class OverLimit(BadRequest):
    """The request is over a per-request limit (it goes back as a 413): the message, and the
    reply's fields, name the setting, its value, what the request had and how to raise it."""

    def __init__(self, setting: str, limit: int, seen: int | None, subject: str, unit: str):
        field = FIELD_BY_ATTR[setting]
        self.setting, self.limit, self.seen = setting, limit, seen
        self.flag, self.env = field.flag, field.env
        had = f"{seen} {unit}" if seen is not None else f"over {limit} {unit}"
        super().__init__(f"{subject} {had}; the limit is {limit} {unit} ({setting}: "
                         f"{field.flag} or {field.env})")

    def reply(self) -> dict[str, Any]:
        return {"error": str(self), "setting": self.setting, "limit": self.limit,
                "seen": self.seen, "flag": self.flag, "env": self.env}


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
    quirks: int = 0  # openrlhf-m: items scored by the seed's quirks (unparseable gold, ...)
    func_errors: int = 0  # --func, openrlhf-boxed: items the rule failed on (default score)
    batched: int = 0  # small requests answered as part of a batch (`batching`)


@dataclass(frozen=True)
class Item:
    answer: str | None  # canonical final answer
    gold: str | None  # canonical gold
    format: float
    quick: bool | None = None  # verify.quick_verdict, when it decides (found in prep)


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
        raise OverLimit("max_items", max_items, len(query), "'query' has", "items")
    prompts, labels = _strings(data, "prompts"), _strings(data, "labels")
    for name, values in (("prompts", prompts), ("labels", labels)):
        if values is not None and len(values) != len(query):
            raise BadRequest(f"'{name}' has {_items(len(values))} but 'query' has "
                             f"{_items(len(query))}")
    return query, prompts, labels


def _run_slice(steps: Steps[list[Any]], seconds: float = PREP_SLICE
               ) -> tuple[bool, list[Any] | None]:
    """`steps` for about `seconds`; (True, items) once done."""
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            next(steps)
    except StopIteration as done:
        return True, done.value
    return False, None


class Scorer:
    """What both profiles share: request parsing off the loop, counters, /health."""

    profile = ""

    def __init__(self, pool: VerifierPool, *, max_items: int = RewardSettings.max_items,
                 format_weight: float = verify.FORMAT_WEIGHT, golds: GoldIndex | None = None,
                 extra_logs: bool = False, batch_wait: float = 0.0):
        self.pool, self.max_items, self.format_weight = pool, max_items, format_weight
        self.golds, self.extra_logs = golds, extra_logs
        # Small requests wait up to batch_wait seconds to be scored together (0: never).
        self._batcher = batching.Batcher(self._score_bodies, batch_wait) if batch_wait else None
        self.stats = Stats()
        self.started = time.monotonic()
        self._verdicts = verify.LRU(VERDICT_CACHE_SIZE)
        # Decoding, validation, extraction and gold lookup are plain Python on up to max_body
        # bytes: one thread keeps them off the event loop and owns their caches (one thread:
        # the caches need no locks). Each step is short (extraction is linear in an item, a
        # closest-prompt lookup yields after every dataset prompt), so the thread hands the
        # interpreter lock back to the loop within its switch interval and /health answers.
        self._prep = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward-prep")
        self.preparing = 0  # requests being prepared
        self._slices = 0  # slices given to the prep thread and not over there
        self.dataset_audit: dict[str, Any] | None = None  # `audit`, once the server ran it
        self.listener = (1, 1)  # which of the server's processes answers (`listeners`)

    def close(self) -> None:
        self._prep.shutdown(wait=False, cancel_futures=True)

    def settings(self) -> dict[str, Any]:
        return {"scoring": self.profile}

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok", **self.settings(), **asdict(self.stats),
            "in_flight": self.in_flight(), "preparing": self.preparing,
            "pool_size": self.pool.workers,
            "item_timeout_s": self.pool.item_timeout, "format_weight": self.format_weight,
            "verdict_cache_entries": len(self._verdicts),
            "batches": self._batcher.batches if self._batcher else 0,
            "extra_logs": self.extra_logs,
            "dataset_prompts": len(self.golds) if self.golds is not None else None,
            "dataset_audit": self.dataset_audit,
            "listener": self.listener[0], "listeners": self.listener[1],
            "uptime_s": round(time.monotonic() - self.started, 1),
        }

    def in_flight(self) -> int:
        return 0

    def with_logs(self, reply: dict[str, Any], formats: list[float],
                  accuracy: list[float]) -> dict[str, Any]:
        """`reply`, with extra_logs (whether each item is well formed, its accuracy) when the
        server gives them: upstream OpenRLHF logs each key; OpenRLHF-M's client would crash on
        a dict, so the default leaves them out."""
        if self.extra_logs:
            reply["extra_logs"] = {"format": formats, "accuracy": accuracy}
        return reply

    def prepare_steps(self, body: bytes) -> Steps[list[Any]]:
        """The request's items, prepared in steps (one item, or one dataset prompt compared,
        per step); raises BadRequest."""
        raise NotImplementedError

    async def score(self, items: list[Any]) -> dict[str, Any]:
        """One reply for the items: a list per key (a dict of lists for extra_logs)."""
        raise NotImplementedError

    async def probe(self) -> bool:
        """One known-good item through a worker: True when it comes back right."""
        raise NotImplementedError

    async def score_body(self, body: bytes) -> dict[str, Any]:
        if self._batcher is not None and len(body) <= batching.SMALL_BODY:
            return await self._batcher.submit(body)
        items = await self._prepare(self.prepare_steps(body))
        self.stats.requests += 1
        return await self.score(items)

    def score_many(self, groups: list[list[Any]]) -> list[Awaitable[dict[str, Any]]]:
        """Several requests' items, started now: one reply for each group. Here they are scored
        as one and each group gets its share once all are done; a profile that can answer
        each group as soon as its own items are overrides this."""
        whole = asyncio.ensure_future(self.score([i for items in groups for i in items]))

        async def share(index: int) -> dict[str, Any]:
            # Shielded: one request giving up must not cancel the others' scoring.
            reply = await asyncio.shield(whole)
            return batching.split(reply, [len(items) for items in groups])[index]

        return [share(index) for index in range(len(groups))]

    async def _score_bodies(self, bodies: list[bytes]
                            ) -> list[Awaitable[dict[str, Any]] | BadRequest]:
        """Small requests as one batch: prepared in one pass, their scoring started together,
        then each request's own reply (or its BadRequest)."""
        prepared = await self._prepare(self._each(bodies), inline=True)
        good = [items for items in prepared if not isinstance(items, BadRequest)]
        self.stats.requests += len(good)
        self.stats.batched += len(good)
        self.stats.bad_requests += len(bodies) - len(good)
        replies = iter(self.score_many(good) if good else [])
        return [items if isinstance(items, BadRequest) else next(replies) for items in prepared]

    def _each(self, bodies: list[bytes]) -> Steps[list[list[Any] | BadRequest]]:
        prepared: list[list[Any] | BadRequest] = []
        for body in bodies:
            try:
                prepared.append((yield from self.prepare_steps(body)))
            except BadRequest as exc:
                prepared.append(exc)
        return prepared

    def _thread_slice(self, steps: Steps[Any]) -> asyncio.Future[tuple[bool, Any]]:
        """One slice in the prep thread; `_slices` counts it until it is over there."""
        loop = asyncio.get_running_loop()
        self._slices += 1
        future = self._prep.submit(_run_slice, steps)

        def over() -> None:
            self._slices -= 1

        def ended(_: Any) -> None:  # in the prep thread, or here when cancelled before it ran
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody counts
                loop.call_soon_threadsafe(over)

        future.add_done_callback(ended)
        return asyncio.wrap_future(future)

    async def _prepare(self, steps: Steps[Any], inline: bool = False) -> Any:
        """`steps` run to their end in slices; `inline`: the first slice may run on the loop
        (INLINE_SLICE), for steps that are each short (a batch of small bodies: one body's
        JSON per step; a big body's JSON is one long step and never runs here)."""
        # A slice at a time, each queued behind the slices of the requests already waiting:
        # requests take turns, so a small one (the head's health probe is a one-item request)
        # waits for one slice of each request ahead of it, not for a whole batch to be
        # prepared.
        # With no slice given to the prep thread and not yet over (a request that gave up
        # leaves its slice running), the caches it owns are touched by one thread at a time.
        inline = inline and self._slices == 0
        self.preparing += 1
        try:
            done, items = _run_slice(steps, INLINE_SLICE) if inline else (False, None)
            while not done:
                done, items = await self._thread_slice(steps)
        except BadRequest:
            self.stats.bad_requests += 1
            raise
        finally:
            self.preparing -= 1
        return items


class BoxedScorer(Scorer):
    """`--scoring boxed`: the last `\\boxed{}` (else `<answer>` block) against the gold."""

    profile = "boxed"

    def __init__(self, pool: VerifierPool, **kwargs: Any):
        super().__init__(pool, **kwargs)
        self._gold_forms = verify.LRU(4096)  # raw label -> canonical gold
        self._inflight: dict[tuple[str, str], asyncio.Task[bool]] = {}

    def in_flight(self) -> int:
        return len(self._inflight)

    async def probe(self) -> bool:
        outcome = await self.pool.check(r"\frac{1}{\sqrt{2}}", r"\frac{\sqrt{2}}{2}",
                                        affinity=False)
        return outcome.status == "ok" and outcome.correct

    # --- preparation (in the prep thread) -------------------------------------------------------

    def _gold_form(self, label: str) -> str | None:
        if len(label) > MAX_CACHED_PAIR_CHARS:  # a whole solution as the label: not cached
            return verify.canonical_gold(label)
        form = self._gold_forms.get(label)
        if form is None:
            form = verify.canonical_gold(label) or _NO_GOLD
            self._gold_forms.put(label, form)
        return form or None

    def prepare_steps(self, body: bytes) -> Steps[list[Item]]:
        query, prompts, labels = parse_request(body, self.max_items)
        yield
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
            # Here, not on the event loop: plain Python on answers of up to 4,096 characters.
            quick = verify.quick_verdict(answer, gold) if answer and gold else None
            items.append(Item(answer or None, gold, 1.0 if found.well_formed else 0.0, quick))
            yield
        return items

    # --- scoring (on the event loop) ------------------------------------------------------------

    def score_many(self, groups: list[list[Item]]) -> list[Awaitable[dict[str, Any]]]:
        # Each pair is a pool task of its own (shared by equal pairs): nothing to gain by
        # waiting for the others.
        return [self.score(items) for items in groups]

    async def score(self, items: list[Item]) -> dict[str, list[float]]:
        stats = self.stats
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
            if item.quick is not None:
                stats.fast_path += 1
                accuracy[index] = float(item.quick)
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
        return self.with_logs({"rewards": rewards, "scores": accuracy,
                               "format_rewards": formats, "acc_rewards": accuracy},
                              formats, accuracy)

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


# --- openrlhf-m ----------------------------------------------------------------------------------

# Items per pool task (a prompt's samples side by side, so a worker parses their gold once);
# fewer when that would leave workers idle.
MAX_GROUP = 8
_QUIRKS = (seed.GOLD_UNPARSED, seed.VERIFY_RAISED)
_QUIRK_TEXT = {seed.GOLD_UNPARSED: "does not parse",
               seed.VERIFY_RAISED: "made math-verify's comparison raise"}


@dataclass(frozen=True)
class SeedItem:
    response: str
    gold: str | None  # as math-verify gets it ($-wrapped), None when there is none
    format: bool
    key: bytes  # the verdict cache's key (`_digest`); b"" without a gold


def _digest(gold: str, response: str) -> bytes:
    """The verdict cache's key: responses are long, and the cache's memory stays fixed."""
    h = hashlib.blake2b(digest_size=16)
    h.update(gold.encode("utf-8", "surrogatepass"))
    h.update(b"\0")
    h.update(response.encode("utf-8", "surrogatepass"))
    return h.digest()


class OpenrlhfMScorer(Scorer):
    """`--scoring openrlhf-m`: OpenRLHF-M's reward server, item for item (`openrlhf_m`)."""

    profile = "openrlhf-m"

    def __init__(self, pool: VerifierPool, *, template: str = "chatml", strict: bool = False,
                 **kwargs: Any):
        super().__init__(pool, **kwargs)
        self.template, self.strict = template, strict
        # Verdicts are seed.MATCH/MISMATCH/...: --strict applies when they become numbers.
        self._unparsed_golds = verify.LRU(4096)
        self._inflight: dict[bytes, asyncio.Future[str | None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def settings(self) -> dict[str, Any]:
        return {"scoring": self.profile, "template": self.template, "strict": self.strict}

    def in_flight(self) -> int:
        return len(self._inflight)

    async def probe(self) -> bool:
        ran = await self.pool.run(seed.worker_check_group, (
            r"$\frac{\sqrt{2}}{2}$",
            [r"<think>r</think><answer>\boxed{\frac{1}{\sqrt{2}}}</answer>"]),
            what="the start-up probe")
        return ran.status == "ok" and ran.value[0][0][0] == seed.MATCH

    def quirk_value(self) -> float:
        return 0.0 if self.strict else 1.0

    # --- preparation (in the prep thread) -------------------------------------------------------

    def prepare_steps(self, body: bytes) -> Steps[list[SeedItem]]:
        query, prompts, labels = parse_request(body, self.max_items)
        by_dataset = self.golds is not None and prompts is not None
        if self.golds is not None and prompts is None and labels is None and query:
            raise BadRequest("missing 'prompts': gold answers are looked up in the dataset "
                             "by prompt (or send 'labels')")
        yield
        items = []
        for index, text in enumerate(query):
            response = openrlhf_m.response_of(text, self.template)
            raw: str | None = None
            if by_dataset:
                assert self.golds is not None and prompts is not None
                raw = (yield from self.golds.nearest_steps(prompts[index]))[0]
            elif labels is not None:
                raw = labels[index]
            gold = openrlhf_m.gold_form(raw) if raw is not None else None
            key = _digest(gold, response) if gold is not None else b""  # hashed off the loop
            items.append(SeedItem(response, gold, openrlhf_m.well_formed(response), key))
            yield
        return items

    # --- scoring (on the event loop) ------------------------------------------------------------

    async def score(self, items: list[SeedItem]) -> dict[str, list[float]]:
        return await self.score_many([items])[0]

    def score_many(self, groups: list[list[SeedItem]]) -> list[Awaitable[dict[str, Any]]]:
        """Every group's new items go to the pool together (a few per task, a prompt's samples
        side by side, equal items once); each group's reply comes as soon as its own items
        are verified."""
        new: dict[bytes, tuple[str, str]] = {}
        plans = [(items, *self._plan(items, new)) for items in groups]
        self._schedule(new)
        return [self._answer(*plan) for plan in plans]

    def _plan(self, items: list[SeedItem], new: dict[bytes, tuple[str, str]]
              ) -> tuple[list[str | None], dict[bytes, list[int]]]:
        """Verdicts known now (None where not), and the items waiting for each key; keys to
        verify are added to `new`."""
        stats = self.stats
        stats.items += len(items)
        verdicts: list[str | None] = [None] * len(items)
        waiting: dict[bytes, list[int]] = {}
        for index, item in enumerate(items):
            if item.gold is None:
                stats.unlabeled += 1
                continue
            if self._unparsed_golds.get(item.gold) is not None:
                stats.fast_path += 1
                verdicts[index] = seed.GOLD_UNPARSED
                continue
            key = item.key
            cached = self._verdicts.get(key)
            if cached is not None:
                stats.cache_hits += 1
                verdicts[index] = cached
            elif key in waiting:
                stats.deduped += 1
                waiting[key].append(index)
            else:
                waiting[key] = [index]
                if key in self._inflight or key in new:
                    stats.deduped += 1  # another request is verifying the same item
                else:
                    new[key] = (item.gold, item.response)
        return verdicts, waiting

    def _answer(self, items: list[SeedItem], verdicts: list[str | None],
                waiting: dict[bytes, list[int]]) -> Awaitable[dict[str, Any]]:
        """The reply once the waiting items are verified. Their futures are taken now (after
        `_schedule`), before any of them can finish and leave `_inflight`."""
        keys = list(waiting)
        # Shielded: one request giving up must not cancel a verification others wait for.
        results = [asyncio.shield(self._inflight[k]) for k in keys]

        async def answer() -> dict[str, Any]:
            for key, verdict in zip(keys, await asyncio.gather(*results), strict=True):
                for index in waiting[key]:
                    verdicts[index] = verdict
            return self._reply(items, verdicts)

        return answer()

    def _reply(self, items: list[SeedItem], verdicts: list[str | None]) -> dict[str, list[float]]:
        accuracy, quirks = [], defaultdict(list)
        for index, (item, verdict) in enumerate(zip(items, verdicts, strict=True)):
            if verdict in _QUIRKS:
                assert item.gold is not None and verdict is not None
                quirks[(verdict, item.gold)].append(index)
                accuracy.append(self.quirk_value())
            else:
                accuracy.append(1.0 if verdict == seed.MATCH else 0.0)
        for (verdict, gold), indices in quirks.items():
            self.stats.quirks += len(indices)
            log.warning("gold answer %s %s: item%s %s of this batch scored accuracy %g (%s)",
                        short(gold), _QUIRK_TEXT[verdict], "s" if len(indices) > 1 else "",
                        ", ".join(map(str, indices)), self.quirk_value(),
                        "--strict 1" if self.strict
                        else "as OpenRLHF-M's server; --strict 1 scores 0")
        weight = self.format_weight
        formats = [weight if item.format else 0.0 for item in items]
        rewards = [acc + fmt for acc, fmt in zip(accuracy, formats, strict=True)]
        # The seed's keys, and scores (the accuracy: what upstream OpenRLHF filters on), all
        # lists of numbers, which OpenRLHF-M's client turns into tensors.
        return self.with_logs({"rewards": rewards, "scores": accuracy,
                               "format_rewards": formats, "acc_rewards": accuracy},
                              [1.0 if item.format else 0.0 for item in items], accuracy)

    def _schedule(self, new: dict[bytes, tuple[str, str]]) -> None:
        """Start verifying `new` items: a gold's items (a prompt's samples, from however many
        requests `batching` gathered) in tasks of their own, a few per task, each sent to the
        worker that has that gold parsed where it can (the pool's affinity)."""
        if not new:
            return
        loop = asyncio.get_running_loop()
        by_gold: dict[str, list[bytes]] = defaultdict(list)
        for key, (gold, _) in new.items():
            future: asyncio.Future[str | None] = loop.create_future()
            self._inflight[key] = future
            future.add_done_callback(lambda _, k=key: self._inflight.pop(k, None))
            by_gold[gold].append(key)
        size = self.pool.chunk_size(len(new), MAX_GROUP)
        for gold, keys in by_gold.items():
            for start in range(0, len(keys), size):
                chunk = keys[start : start + size]
                task = asyncio.ensure_future(self._verify(chunk, [new[k] for k in chunk], gold))
                self._tasks.add(task)  # the loop keeps only a weak reference
                task.add_done_callback(self._tasks.discard)

    async def _verify(self, keys: list[bytes], pairs: list[tuple[str, str]], gold: str) -> None:
        try:
            ran = await self.pool.run(seed.worker_check_pairs, (pairs,),
                                      what=None if len(keys) > 1 else self._what(*pairs[0]),
                                      affinity=gold)
            if ran.status == "ok":
                found, parses = ran.value
                self.stats.gold_parses += parses
                for key, (gold, _), (verdict, how) in zip(keys, pairs, found, strict=True):
                    self._done(key, gold, verdict, how)
                return
            if len(keys) == 1:
                self._failed(keys[0], ran.status)
                return
            # One item of the task may be the slow one: each gets its own time limit now.
            log.info("%d items ran past %g s together; verifying them one by one",
                     len(keys), self.pool.item_timeout)
            await asyncio.gather(*(self._verify([k], [p], gold) for k, p in zip(keys, pairs,
                                                                                 strict=True)))
        finally:
            for key in keys:  # nothing may wait forever (e.g. this task was cancelled)
                future = self._inflight.get(key)
                if future is not None and not future.done():
                    future.set_result(None)

    def _done(self, key: bytes, gold: str, verdict: str, how: str) -> None:
        stats = self.stats
        if how == seed.BY_MATH_VERIFY:
            stats.verified += 1
        elif how == seed.BY_CACHE:
            stats.cache_hits += 1
        else:
            stats.fast_path += 1
            if how == seed.BY_NO_ANSWER:
                stats.no_answer += 1
        if verdict == seed.GOLD_UNPARSED:
            self._unparsed_golds.put(gold, True)
        self._verdicts.put(key, verdict)
        future = self._inflight.get(key)
        if future is not None and not future.done():
            future.set_result(verdict)

    def _failed(self, key: bytes, status: str) -> None:
        if status == "timeout":
            self.stats.timeouts += 1  # not cached: a loaded machine can time out a fair item
        else:
            self.stats.crashes += 1
        future = self._inflight.get(key)
        if future is not None and not future.done():
            future.set_result(None)  # scores 0

    @staticmethod
    def _what(gold: str, response: str) -> str:
        return f"response={short(openrlhf_m.readable(response))} gold={short(gold)}"
