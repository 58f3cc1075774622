"""The openrlhf-m profile end to end: its scorer with a real pool (groups, caches, dedupe,
timeouts, --strict), and a real `python -m podagent.rewards` answering the whole parity corpus
over HTTP, from labels and from a dataset, exactly as OpenRLHF-M's server does."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import pytest

from podagent.rewards import openrlhf_m
from podagent.rewards.dataset import GoldIndex
from podagent.rewards.scorer import OpenrlhfMScorer

from .conftest import Live, live_server
from .test_openrlhf_m import CORPUS, FORMAT_WEIGHT, expected_accuracy

CHAT = "<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n{r}<|im_end|>"
TOWER = r"<think>x</think><answer>\boxed{9^{9^{9^{9}}}}</answer>"


def chat(response: str, question: str = "Q?") -> str:
    return CHAT.format(q=question, r=response)


def score(scorer: OpenrlhfMScorer, payload: dict[str, object]) -> dict[str, list[float]]:
    return asyncio.run(scorer.score_body(json.dumps(payload).encode()))


def test_a_prompts_samples_are_verified_together_and_then_cached(pool):
    scorer = OpenrlhfMScorer(pool)
    answers = [r"\frac{1}{\sqrt{2}}", r"\frac{\sqrt{2}}{2}", r"\frac{\sqrt{2}}{2}", "0.5",
               r"\sqrt{0.5}", r"\frac{\sqrt{2}}{2}", "1", r"\frac{1}{\sqrt{2}}"]
    query = [chat(f"<think>t{i}</think><answer>$" + a + "$</answer>") for i, a in
             enumerate(answers)]
    first = score(scorer, {"query": query, "labels": [r"\frac{\sqrt{2}}{2}"] * 8})
    assert first["acc_rewards"] == [1, 1, 1, 0, 1, 1, 0, 1]
    assert first["format_rewards"] == [FORMAT_WEIGHT] * 8
    assert first["rewards"] == [a + FORMAT_WEIGHT for a in first["acc_rewards"]]
    # The seed's keys and scores (the accuracy), all lists of numbers: no extra_logs unless asked
    assert set(first) == {"rewards", "scores", "format_rewards", "acc_rewards"}
    assert first["scores"] == first["acc_rewards"]
    s = scorer.stats
    # One gold, one worker: parsed at most once; equal answers shared a verdict in the worker.
    assert s.gold_parses <= 1
    assert s.verified + s.fast_path + s.cache_hits == 8 and s.verified <= 5
    second = score(scorer, {"query": query, "labels": [r"\frac{\sqrt{2}}{2}"] * 8})
    assert second == first
    assert s.cache_hits >= 8  # every item from the server's cache this time


def test_equal_items_in_a_batch_and_across_requests_are_verified_once(pool):
    scorer = OpenrlhfMScorer(pool)
    item = chat(r"<think>a</think><answer>$\sqrt{8}$</answer>")
    payload = {"query": [item] * 3, "labels": [r"2\sqrt{2}"] * 3}

    async def both():
        return await asyncio.gather(*(scorer.score_body(json.dumps(payload).encode())
                                      for _ in range(2)))

    first, second = asyncio.run(both())
    assert first == second and first["acc_rewards"] == [1.0] * 3
    # Six items, one verification: the others shared it in their batch or waited on it.
    assert (scorer.stats.verified, scorer.stats.deduped) == (1, 5)


def test_an_unparseable_gold_scores_one_and_is_logged_with_its_items(pool, caplog):
    scorer = OpenrlhfMScorer(pool)
    query = [chat("<think>a</think><answer>$5$</answer>"), chat("nothing"), chat("x")]
    result = score(scorer, {"query": query, "labels": ["1\n2", "1\n2", "5"]})
    assert result["acc_rewards"] == [1.0, 1.0, 0.0]
    assert result["rewards"] == [1.5, 1.0, 0.0]
    [line] = [r.getMessage() for r in caplog.records if "does not parse" in r.getMessage()]
    assert "items 0, 1 of this batch scored accuracy 1" in line and "--strict 1" in line
    assert scorer.stats.quirks == 2
    again = score(scorer, {"query": [chat("other")], "labels": ["1\n2"]})
    assert again["acc_rewards"] == [1.0]
    assert scorer.stats.quirks == 3 and scorer.stats.fast_path >= 1  # known: no worker asked


def test_strict_scores_an_unparseable_gold_zero(pool):
    scorer = OpenrlhfMScorer(pool, strict=True)
    result = score(scorer, {"query": [chat("<think>a</think><answer>$5$</answer>")],
                            "labels": ["1\n2"]})
    assert result["acc_rewards"] == [0.0] and result["rewards"] == [FORMAT_WEIGHT]


def test_items_without_a_gold_score_format_only(pool):
    scorer = OpenrlhfMScorer(pool)
    result = score(scorer, {"query": [chat("<think>a</think><answer>$5$</answer>")] * 2,
                            "labels": ["", "  "]})
    assert result["rewards"] == [FORMAT_WEIGHT] * 2
    assert scorer.stats.unlabeled == 2


def test_the_template_decides_where_the_response_starts(pool):
    qwen = "<｜User｜>Q?<｜Assistant｜><think>a</think><answer>$5$</answer><｜end▁of▁sentence｜>"
    as_qwen = score(OpenrlhfMScorer(pool, template="qwen1"), {"query": [qwen], "labels": ["5"]})
    as_chatml = score(OpenrlhfMScorer(pool), {"query": [qwen], "labels": ["5"]})
    assert as_qwen["rewards"] == [1.5]
    assert as_chatml["rewards"] == [1.0]  # no chatml prefix: the whole query, not well formed


def test_a_pathological_item_times_out_alone_and_its_group_is_still_scored(pool, caplog):
    scorer = OpenrlhfMScorer(pool)
    query = [chat(TOWER), chat(r"<think>a</think><answer>\boxed{1}</answer>"),
             chat(r"<think>b</think><answer>\boxed{2}</answer>")]
    started = time.monotonic()
    result = score(scorer, {"query": query, "labels": ["1"] * 3})
    elapsed = time.monotonic() - started
    assert result["acc_rewards"] == [0.0, 1.0, 0.0]
    assert scorer.stats.timeouts == 1
    # The group's limit, then the tower's own one, plus worker replacements; minutes without.
    assert elapsed < 2 * pool.item_timeout + 30
    [line] = [r.getMessage() for r in caplog.records if "timed out" in r.getMessage()]
    assert "9^{9^{9^{9}}}" in line and "<|im_start|>" not in line and len(line) < 300
    after = score(scorer, {"query": [chat(r"<think>c</think><answer>$0.4$</answer>")],
                           "labels": [r"\frac{2}{5}"]})
    assert after["acc_rewards"] == [1.0]


def test_dataset_mode_looks_golds_up_by_the_requests_prompts(pool, tmp_path):
    path = tmp_path / "golds.jsonl"
    rows = [{"prompt": "What is 2+2?", "answer": "4"}, {"prompt": "Half of one?", "answer": "0.5"},
            {"prompt": "What is 2+2?", "answer": "5"}]  # repeated: the last answer counts
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    golds = GoldIndex.load(str(path), repeated="last")
    scorer = OpenrlhfMScorer(pool, golds=golds)
    answer = "<think>a</think><answer>$5$</answer>"
    result = score(scorer, {"query": [chat(answer)] * 3,
                            "prompts": ["What is 2+2?", "What is 2 + 2 ?", "Half of one?"],
                            "labels": ["4", "4", "4"]})  # labels are not used with a dataset
    assert result["acc_rewards"] == [1.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="missing 'prompts'"):
        score(scorer, {"query": [chat(answer)]})
    assert score(scorer, {"query": [chat(answer)], "labels": ["5"]})["acc_rewards"] == [1.0]


# --- the corpus through a real server ------------------------------------------------------------


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """One real server per template, each with a dataset of the corpus's golds."""
    tmp = tmp_path_factory.mktemp("openrlhf-m")
    dataset = tmp / "golds.jsonl"
    # The corpus repeats prompts with other golds: each item gets its own dataset prompt.
    dataset.write_text("".join(json.dumps({"prompt": _prompt(c), "answer": c["gold"]}) + "\n"
                               for c in CORPUS))
    with contextlib.ExitStack() as stack:
        yield {template: stack.enter_context(live_server(
            tmp, "--prompt-template", template, "--workers", "1", "--max-items", "256",
            "--dataset", str(dataset))) for template in openrlhf_m.TEMPLATES}


def _prompt(case: dict) -> str:
    return f"{case['prompt']} #{case['id']}"


def _batches(size: int = 256):
    for template in openrlhf_m.TEMPLATES:
        cases = [c for c in CORPUS if c["template"] == template]
        for start in range(0, len(cases), size):
            yield template, cases[start : start + size]


def _check(reply: dict[str, list[float]], cases: list[dict]) -> list[tuple]:
    wrong = []
    for case, fmt, acc, reward in zip(cases, reply["format_rewards"], reply["acc_rewards"],
                                      reply["rewards"], strict=True):
        expected = expected_accuracy(case)
        if expected is None:
            continue
        if (fmt, acc, reward) != (case["format"], expected, case["format"] + expected):
            wrong.append((case["id"], case["covers"], fmt, acc, case["format"], expected))
    return wrong


@pytest.mark.parametrize("source", ["dataset", "labels"])
def test_the_server_gives_the_seeds_rewards_for_the_whole_corpus(servers, source):
    """From the dataset (by the request's prompts, the seed's way) and from labels (no
    prompts sent): every item's format, accuracy and reward as the seed's."""
    wrong = []
    for template, cases in _batches():
        payload: dict[str, list[str]] = {"query": [c["query"] for c in cases]}
        if source == "dataset":
            payload["prompts"] = [_prompt(c) for c in cases]
            payload["labels"] = ["0"] * len(cases)  # ignored: the dataset has the gold
        else:
            payload["labels"] = [c["gold"] for c in cases]
        reply = servers[template].post(payload)
        assert reply.status_code == 200, reply.text
        assert set(reply.json()) == {"rewards", "scores", "format_rewards", "acc_rewards"}
        wrong += _check(reply.json(), cases)
    assert not wrong, wrong[:20]


def test_health_names_the_profile(servers):
    health = servers["qwen1"].health()
    assert (health["scoring"], health["template"], health["strict"]) == ("openrlhf-m", "qwen1",
                                                                         False)
    assert health["dataset_prompts"] == len(CORPUS)


def test_without_prompts_or_labels_a_dataset_server_answers_400(servers):
    reply = servers["chatml"].post({"query": [chat("x")]})
    assert reply.status_code == 400
    assert "missing 'prompts'" in reply.json()["error"]


def test_bad_requests_still_get_json_errors(servers):
    live: Live = servers["base"]
    for payload, message in (({"query": "x"}, "'query' must be a list of strings"),
                             ({"query": ["x"], "prompts": ["a", "b"]}, "'prompts' has 2 items"),
                             ({"prompts": ["a"]}, "missing 'query'")):
        reply = live.post(payload)
        assert reply.status_code == 400
        assert message in reply.json()["error"]
    reply = live.post(data=b"{")
    assert reply.status_code == 400 and "body is not JSON" in reply.json()["error"]
