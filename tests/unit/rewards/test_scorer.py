"""The boxed profile's batch path with a real pool: fast path, verdict cache, dedupe, gold parsing,
timeouts (test_openrlhf_m_scorer.py has the openrlhf-m profile's)."""

from __future__ import annotations

import asyncio
import json
import time

from podagent.rewards.scorer import BoxedScorer as Scorer
from podagent.rewards.verify import FORMAT_WEIGHT

ROOT_HALF = r"\frac{\sqrt{2}}{2}"
# sympy evaluates this power in C for minutes: only killing the worker stops it.
TOWER = r"\boxed{9^{9^{9^{9}}}}"


def body(query: list[str], labels: list[str] | None = None, **extra: object) -> bytes:
    payload: dict[str, object] = {"query": query, **extra}
    if labels is not None:
        payload["labels"] = labels
    return json.dumps(payload).encode()


def score(scorer: Scorer, query: list[str], labels: list[str]) -> dict[str, list[float]]:
    return asyncio.run(scorer.score_body(body(query, labels)))


def test_identical_samples_verify_once_then_hit_the_cache(pool):
    scorer = Scorer(pool)
    grpo = [r"... so \boxed{\frac{1}{\sqrt{2}}}"] * 8  # equal to the gold only by sympy
    first = score(scorer, grpo, [ROOT_HALF] * 8)
    assert first["acc_rewards"] == [1.0] * 8
    assert first["rewards"] == [1.0 + FORMAT_WEIGHT] * 8
    s = scorer.stats
    assert (s.verified, s.deduped, s.cache_hits, s.fast_path) == (1, 7, 0, 0)
    assert s.gold_parses <= 1  # 0 if the worker parsed this gold before (its own cache)

    second = score(scorer, grpo, [ROOT_HALF] * 8)
    assert second == first
    assert (s.verified, s.cache_hits) == (1, 8)


def test_one_gold_is_parsed_once_for_many_answers(pool):
    scorer = Scorer(pool)
    gold = r"\frac{7\pi}{4}"  # used by no other test: this worker has not parsed it yet
    answers = [r"\frac{7}{4}\pi", r"7\pi/4", r"1.75\pi", r"\frac{14\pi}{8}",
               r"\pi+\frac{3\pi}{4}", r"\frac{7}{4}", r"\frac{7\pi}{3}", r"\frac{21\pi}{12}"]
    result = score(scorer, [rf"\boxed{{{a}}}" for a in answers], [gold] * 8)
    assert result["acc_rewards"] == [1, 1, 1, 1, 1, 0, 0, 1]
    assert (scorer.stats.verified, scorer.stats.gold_parses) == (8, 1)


def test_exact_answers_and_plain_numbers_take_the_fast_path(pool):
    scorer = Scorer(pool)
    half = r"\frac{1}{2}"
    answers = [r"\boxed{ \dfrac{1}{2} }", r"<answer>$\frac{1}{2}$.</answer>", r"\boxed{0.5}",
               r"\boxed{2/4}", r"\boxed{0.6}", r"\boxed{5e-1}"]
    result = score(scorer, answers, [half] * 6)
    assert result["acc_rewards"] == [1.0, 1.0, 1.0, 1.0, 0.0, 1.0]
    assert (scorer.stats.fast_path, scorer.stats.verified) == (6, 0)


def test_concurrent_requests_share_a_verification(pool):
    scorer = Scorer(pool)

    async def both():
        return await asyncio.gather(*(scorer.score_body(body([r"\boxed{\sqrt{8}}"],
                                                             [r"2\sqrt{2}"]))
                                      for _ in range(2)))

    first, second = asyncio.run(both())
    assert first == second and first["acc_rewards"] == [1.0]
    assert (scorer.stats.verified, scorer.stats.deduped) == (1, 1)


def test_unlabeled_and_unanswered_items_score_zero_accuracy(pool):
    scorer = Scorer(pool)
    result = score(scorer, [r"\boxed{1}", "no final answer", r"\boxed{1}"], ["1", "1", ""])
    assert result["acc_rewards"] == [1.0, 0.0, 0.0]
    assert result["format_rewards"] == [1.0, 0.0, 1.0]
    assert (scorer.stats.no_answer, scorer.stats.unlabeled) == (1, 1)


def test_a_pathological_item_times_out_alone_and_the_pool_recovers(pool, caplog):
    scorer = Scorer(pool)
    started = time.monotonic()
    result = score(scorer, [TOWER, r"\boxed{0.2}"], ["1", r"\frac{1}{5}"])
    elapsed = time.monotonic() - started
    assert result["acc_rewards"] == [0.0, 1.0]
    assert result["rewards"] == [FORMAT_WEIGHT, 1.0 + FORMAT_WEIGHT]
    assert scorer.stats.timeouts == 1
    # Bounded by the item's limit (2 s) plus the worker's replacement, with room for a
    # loaded machine; without the kill this takes minutes.
    assert elapsed < pool.item_timeout + 20
    [line] = [r.getMessage() for r in caplog.records if "timed out" in r.getMessage()]
    assert "9^{9^{9^{9}}}" in line and len(line) < 300

    after = score(scorer, [r"\boxed{0.4}"], [r"\frac{2}{5}"])  # a fresh worker answers
    assert after["acc_rewards"] == [1.0]
    assert scorer.stats.timeouts == 1


def test_timed_out_pairs_are_not_cached(pool):
    scorer = Scorer(pool)
    score(scorer, [r"\boxed{8^{8^{8^{8}}}}"], ["1"])
    score(scorer, [r"\boxed{8^{8^{8^{8}}}}"], ["1"])
    assert (scorer.stats.timeouts, scorer.stats.cache_hits) == (2, 0)


def test_long_and_deeply_nested_answers_score_zero_without_the_pool(pool):
    scorer = Scorer(pool)
    nested = r"\boxed{" + "(" * 5000 + "1" + ")" * 5000 + "}"
    long_text = "Let me think. " * 50_000 + r"\boxed{" + "1+" * 20_000 + "1}"
    result = score(scorer, [nested, long_text], ["1", "20001"])
    assert result["acc_rewards"] == [0.0, 0.0]
    assert (scorer.stats.fast_path, scorer.stats.verified, scorer.stats.timeouts) == (2, 0, 0)
