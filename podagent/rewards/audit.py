"""The dataset audited at start: gold answers the scoring rule cannot read, said once.

A gold answer the rule cannot parse does not fail an item; it fixes its accuracy. Under
openrlhf-m (OpenRLHF-M's rule) every answer to that prompt scores 1, so the prompt gives the
policy no learning signal; under boxed every answer scores 0. A user would learn it only by
reading the server's log item by item, so the server counts them once, before it listens:
one warning line (how many, two examples, what it does, the setting that changes it), kept
in /health's `dataset_audit`, which the head turns into a warning and a `reward_dataset` event.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

from podagent.rewards import openrlhf_m, verify
from podagent.rewards import openrlhf_m_verify as seed
from podagent.rewards.dataset import GoldIndex
from podagent.rewards.pool import VerifierPool
from podagent.rewards.verify import short

log = logging.getLogger("podagent.rewards")

# Golds per pool task, and how long the whole audit may take before it reports what it saw
# (readiness waits for it; a huge dataset must not hold the server's start).
CHUNK = 32
DEADLINE = 120.0
EXAMPLES = 2


@dataclass(frozen=True)
class Audit:
    scoring: str
    golds: int  # distinct gold answers in the dataset
    checked: int  # of those, checked before the deadline
    unparsed: int
    examples: tuple[str, ...] = ()
    consequence: str = ""
    line: str = ""  # what the server logs and the head shows, when unparsed > 0
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def worker_unparsed(golds: list[str]) -> list[int]:
    """In a worker: the indices of the golds OpenRLHF-M's rule cannot parse."""
    checker = seed.checker()
    return [index for index, gold in enumerate(golds) if not checker.gold(gold).parsed]


def _consequence(scoring: str, strict: bool) -> str:
    if scoring == "boxed":
        return "every answer to those prompts scores accuracy 0"
    if strict:
        return "every answer to those prompts scores accuracy 0 (PODAGENT_REWARD_STRICT=1)"
    return ("every answer to those prompts scores accuracy 1, as OpenRLHF-M's server does: "
            "no learning signal from them; PODAGENT_REWARD_STRICT=1 scores them 0, or write "
            "those answers as LaTeX math")


async def audit(golds: GoldIndex, scoring: str, strict: bool, pool: VerifierPool,
                deadline: float = DEADLINE) -> Audit | None:
    """The audit for a profile that reads gold answers itself (openrlhf-m, boxed); None for
    the others (a reward_func's rule is its own)."""
    if scoring not in ("openrlhf-m", "boxed"):
        return None
    started = time.monotonic()
    answers = golds.answers()
    if scoring == "boxed":
        bad = [a for a in answers if not (a.strip() and verify.canonical_gold(a))]
        checked = len(answers)
    else:
        bad, checked = await _unparsed_by_seed(answers, pool, started + deadline)
    consequence = _consequence(scoring, strict)
    line = ""
    if bad:
        partial = f" (checked {checked} of {len(answers)} in {deadline:g} s)" \
            if checked < len(answers) else ""
        line = (f"reward dataset: {len(bad)} of {len(answers)} gold answers cannot be read by "
                f"the {scoring} rule{partial}, e.g. "
                f"{', '.join(short(b) for b in bad[:EXAMPLES])}: {consequence}")
    return Audit(scoring, len(answers), checked, len(bad), tuple(bad[:EXAMPLES]), consequence,
                 line, round(time.monotonic() - started, 2))


async def _unparsed_by_seed(answers: list[str], pool: VerifierPool,
                            deadline: float) -> tuple[list[str], int]:
    """Golds OpenRLHF-M's rule cannot parse (an empty answer is not one: it scores 0 as
    unlabeled), checked in the pool a chunk at a time until the deadline."""
    forms = [(a, openrlhf_m.gold_form(a)) for a in answers]
    forms = [(a, f) for a, f in forms if f is not None]
    chunks = [forms[i:i + CHUNK] for i in range(0, len(forms), CHUNK)]
    bad: list[str] = []
    checked = 0
    left = iter(chunks)

    async def lane() -> None:  # one per worker: a chunk starts only while time is left
        nonlocal checked
        for chunk in left:
            if time.monotonic() > deadline:
                return
            ran = await pool.run(worker_unparsed, ([f for _, f in chunk],))
            if ran.status == "ok":  # a chunk past the item limit is left unchecked
                checked += len(chunk)
                bad.extend(chunk[i][0] for i in ran.value)

    lanes = [asyncio.ensure_future(lane()) for _ in range(pool.workers)]
    # A chunk still running at the deadline is given up (its worker stopped): not checked.
    _, late = await asyncio.wait(lanes, timeout=max(0.0, deadline - time.monotonic()))
    for task in late:
        task.cancel()
    await asyncio.gather(*late, return_exceptions=True)
    order = {answer: index for index, answer in enumerate(answers)}
    return sorted(bad, key=order.__getitem__), checked + (len(answers) - len(forms))
