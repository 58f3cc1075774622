"""Heavy requests against a real `python -m podagent.rewards`: a batch whose answers once took
quadratic time to read, and a batch whose every prompt is compared with the whole dataset while
the head's health probe comes in."""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_fixed

from podagent.cluster.reward_server import PROBE_BODY
from podagent.rewards.verify import FORMAT_WEIGHT

from .conftest import Live, live_server

# --- the boxed profile: `\boxed{\(\(…}` --------------------------------------------------------


def pathological(pairs: int, items: int = 1024) -> bytes:
    r"""`items` answers of `\(` repeated `pairs` times: 2,048 pairs (4,096 characters, the
    longest answer that is read) in 1,024 items is a 6.3 MB request."""
    answer = "\\boxed{" + "\\(" * pairs + "}"
    return json.dumps({"query": [answer] * items, "labels": ["1"] * items}).encode()


@pytest.fixture(scope="module")
def boxed(tmp_path_factory):
    # The default budget (the 6.3 MB request fits it); a short item timeout, since math-verify
    # itself takes seconds on such an answer (in the pool, where it is killed).
    with live_server(tmp_path_factory.mktemp("boxed"), "--scoring", "boxed", "--workers", "1",
                     "--item-timeout", "1") as server:
        yield server


def _cpu(live: Live) -> float:
    """CPU seconds of the server's own process (its verifier workers are other processes)."""
    times = psutil.Process(live.proc.pid).cpu_times()
    return times.user + times.system


def _cost(live: Live, body: bytes) -> tuple[float, dict[str, Any]]:
    before = _cpu(live)
    reply = live.post(data=body, headers={"Content-Type": "application/json"})
    assert reply.status_code == 200, reply.text[:300]
    return _cpu(live) - before, reply.json()


def test_the_pathological_boxed_batch_costs_work_linear_in_its_size(boxed: Live):
    # The 6.3 MB request held the server's prep thread for a minute when every `\(` rescanned
    # the rest of its answer. Linear work grows 4 times from a quarter of the answer length to
    # the whole; that rescan grew 16 times. CPU time of the server, the better of two runs.
    costs = {}
    for pairs in (512, 2048):
        body = pathological(pairs)
        runs = [_cost(boxed, body) for _ in range(2)]
        costs[pairs] = min(cpu for cpu, _ in runs)
        for _, got in runs:  # one balanced box: format 1; `\(\(…` is not 1
            assert got["rewards"] == [FORMAT_WEIGHT] * 1024
            assert got["acc_rewards"] == [0.0] * 1024
    assert costs[2048] < 8 * costs[512], (
        f"server CPU: {costs[512]:.3f} s for answers of 512 `\\(`, {costs[2048]:.3f} s for "
        f"2,048 (4 times as long): more than linear")


# --- the openrlhf-m profile: closest-prompt lookups ------------------------------------------

_WORDS = ("the", "of", "a", "triangle", "circle", "number", "sum", "product", "integer",
          "prime", "side", "area", "length", "find", "what", "is", "how", "many", "ways", "value",
          "real", "positive", "square", "root", "equation", "solve")
DATASET_ROWS, HEAVY_ITEMS = 1000, 40


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(60)) + "?"


@pytest.fixture(scope="module")
def seed_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("openrlhf-m")
    rng = random.Random(5)
    dataset = tmp / "golds.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": _prompt(rng), "answer": str(n)}) + "\n"
                               for n in range(DATASET_ROWS)))
    with live_server(tmp, "--workers", "1", "--dataset", str(dataset)) as server:
        yield server


def _wait_for_log(log: Path, text: str, deadline: float = 60.0) -> None:
    """Until the server's log holds `text`, bounded."""
    for attempt in Retrying(stop=stop_after_delay(deadline), wait=wait_fixed(0.1),
                            retry=retry_if_exception_type(AssertionError), reraise=True):
        with attempt:
            seen = log.read_text(encoding="utf-8", errors="replace")
            assert text in seen, (f"the server's log never showed {text!r} within "
                                  f"{deadline:g} s; it ends: {seen[-300:]!r}")


def test_the_heads_probe_is_answered_while_a_batch_is_being_prepared(seed_server: Live):
    # Each of the batch's prompts is not in the dataset: each is compared with every dataset
    # prompt (the seed's closest-prompt rule), seconds of preparation for the batch.
    rng = random.Random(11)
    prompts = [_prompt(rng) for _ in range(HEAVY_ITEMS)]
    batch = {"query": [f"{p}<|im_start|>assistant\n<think>t</think><answer>$1$</answer>"
                       for p in prompts], "prompts": prompts}
    before = seed_server.health()
    result: dict[str, requests.Response] = {}
    sender = threading.Thread(target=lambda: result.setdefault("reply", seed_server.post(batch)))
    sender.start()
    try:
        # Its first prompt has been looked up: the batch is being prepared.
        _wait_for_log(seed_server.log, repr(prompts[0][:60]))
        probe = seed_server.post(PROBE_BODY)  # what the head sends every 5 s
        during = seed_server.health()
    finally:
        sender.join(timeout=120)
    assert probe.status_code == 200 and len(probe.json()["rewards"]) == 1
    # Answered before the batch was through preparation: the server has counted the probe's
    # item and none of the batch's.
    assert during["items"] - before["items"] == 1, (
        f"the probe was answered after the batch's {HEAVY_ITEMS} items were prepared")
    assert during["preparing"] == 1
    assert not sender.is_alive()
    assert result["reply"].status_code == 200
    assert len(result["reply"].json()["rewards"]) == HEAVY_ITEMS
    assert seed_server.health()["items"] - before["items"] == HEAVY_ITEMS + 1
