"""Small requests batched on the server (upstream OpenRLHF sends one sample per request): each
request gets exactly its own items' answers, a bad one among them its own 400, and the batch
is one preparation and one scoring."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from podagent.rewards import batching

from .conftest import live_server

PREFIX = "<|im_start|>user\nQ{n}<|im_end|>\n<|im_start|>assistant\n"


def sample(n: int) -> tuple[str, str]:
    """A chatml query whose answer is right for even n, and its gold."""
    answer = n if n % 2 == 0 else n + 1
    body = ("<think>t</think><answer>$" + str(answer) + "$</answer>") if n % 3 else (
        f"so \\boxed{{{answer}}}")
    return PREFIX.format(n=n) + body, str(n)


def test_split_gives_each_request_its_own_items():
    reply = {"rewards": [1, 2, 3, 4], "extra_logs": {"format": [0, 1, 0, 1]}}
    assert batching.split(reply, [1, 0, 3]) == [
        {"rewards": [1], "extra_logs": {"format": [0]}},
        {"rewards": [], "extra_logs": {"format": []}},
        {"rewards": [2, 3, 4], "extra_logs": {"format": [1, 0, 1]}}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with live_server(tmp_path_factory.mktemp("batching"), "--workers", "2", "--batch-wait", "20",
                     "--extra-logs", "1") as live:
        yield live


def test_one_item_requests_get_what_one_batch_gets(srv):
    items = [sample(n) for n in range(240)]
    whole = srv.post({"query": [q for q, _ in items], "labels": [g for _, g in items]}).json()
    before = srv.health()

    def one(item: tuple[str, str]) -> dict:
        reply = srv.post({"query": [item[0]], "labels": [item[1]]})
        assert reply.status_code == 200, reply.text
        return reply.json()

    with ThreadPoolExecutor(48) as threads:
        singles = list(threads.map(one, items))
    after = srv.health()
    for key in ("rewards", "scores", "format_rewards", "acc_rewards"):
        assert [reply[key][0] for reply in singles] == whole[key], key
    for key in ("format", "accuracy"):
        assert [reply["extra_logs"][key][0] for reply in singles] == whole["extra_logs"][key]
    assert whole["acc_rewards"] == [float(n % 2 == 0) for n in range(240)]
    assert after["batched"] - before["batched"] == 240
    assert 0 < after["batches"] - before["batches"] < 240  # requests shared batches


def test_a_bad_request_in_a_batch_gets_its_own_400(srv):
    good = {"query": [sample(4)[0]], "labels": ["4"]}
    bad = {"query": [sample(5)[0]], "labels": ["5", "6"]}
    wrong_type = {"query": "not a list"}
    with ThreadPoolExecutor(12) as threads:
        replies = list(threads.map(srv.post, [good, bad, wrong_type] * 4))
    for index, reply in enumerate(replies):
        if index % 3 == 0:
            assert reply.status_code == 200 and reply.json()["acc_rewards"] == [1.0]
        else:
            assert reply.status_code == 400
            assert reply.json()["error"] in ("'labels' has 2 items but 'query' has 1 item",
                                             "'query' must be a list of strings, not a string")
    assert requests.get(f"{srv.url}/health", timeout=10).json()["status"] == "ok"


def test_a_request_is_answered_before_a_slow_item_of_its_batch(tmp_path):
    """Requests batched together are answered each as soon as its own items are: one item
    that runs until the item timeout does not hold up the other requests of its batch."""
    slow = {"query": [PREFIX.format(n=1) + "<think>t</think><answer>$\\boxed{9^{9^{9^{9^{9}}}}}$"
                      "</answer>"], "labels": ["3"]}
    quick = {"query": [sample(4)[0]], "labels": ["4"]}
    with live_server(tmp_path, "--workers", "2", "--batch-wait", "50",
                     "--item-timeout", "3") as live, ThreadPoolExecutor(2) as threads:
        # Sent at once: the batch waits 50 ms for its second request.
        slow_reply, quick_reply = threads.submit(live.post, slow), threads.submit(live.post, quick)
        assert quick_reply.result(timeout=60).json()["acc_rewards"] == [1.0]
        assert not slow_reply.done()  # still waiting for its item's timeout
        assert slow_reply.result(timeout=60).json()["acc_rewards"] == [0.0]
        assert live.health()["batches"] == 1
