"""The built-in server as the trainers' own clients meet it (trainer_clients.py): OpenRLHF-M's
one batch per request, every reply key a tensor; upstream OpenRLHF's one sample per request,
many in flight, extra_logs logged per key."""

from __future__ import annotations

import asyncio

import pytest
import torch

from .conftest import Live, live_server
from .trainer_clients import (
    Sample,
    openrlhf_m_rewards,
    upstream_info,
    upstream_reply,
    upstream_rollout,
    value,
)

CHAT = "<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n{r}<|im_end|>"
# Responses of four kinds and the reward each gets (openrlhf-m: accuracy + 0.5 x format).
KINDS = (
    ("<think>{a} plus {b}</think><answer>${s}$</answer>", 1.5),  # right, well formed
    ("<think>{a} plus {b}</think><answer>${w}$</answer>", 0.5),  # wrong, well formed
    (r"{a} plus {b} is $\boxed{{{s}}}$.", 1.0),  # right, no think/answer shape
    ("<think>not sure</think>", 0.0),  # no answer
)
REWARD_FUNC = '''
import torch


def reward_func(queries, prompts, labels):
    # As upstream's examples do: tensors, one value per query.
    right = [1.0 if f"${label}$" in query else 0.0 for query, label in zip(queries, labels)]
    return {"rewards": torch.tensor(right), "scores": torch.tensor(right) / 2,
            "extra_logs": {"length": torch.tensor([float(len(q)) for q in queries])}}
'''


def samples(count: int) -> list[Sample]:
    out = []
    for i in range(count):
        a, b = i % 13, i % 7
        template, _ = KINDS[i % len(KINDS)]
        question = f"What is {a} + {b}?"
        response = template.format(a=a, b=b, s=a + b, w=a + b + 1)
        out.append(Sample(CHAT.format(q=question, r=response), question, str(a + b)))
    return out


def expected_rewards(count: int) -> list[float]:
    return [KINDS[i % len(KINDS)][1] for i in range(count)]


def batch(live: Live, items: list[Sample]) -> dict:
    """The server's reply to the same items in one request."""
    reply = live.post({"query": [s.query for s in items], "prompts": [s.prompt for s in items],
                       "labels": [s.label for s in items]})
    assert reply.status_code == 200, reply.text
    return reply.json()


@pytest.fixture(scope="module")
def default(tmp_path_factory):
    with live_server(tmp_path_factory.mktemp("default"), "--workers", "2") as server:
        yield server


@pytest.fixture(scope="module")
def extra(tmp_path_factory):
    with live_server(tmp_path_factory.mktemp("extra"), "--workers", "2",
                     "--extra-logs", "1") as server:
        yield server


@pytest.fixture(scope="module")
def func(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("func")
    path = tmp / "reward_func.py"
    path.write_text(REWARD_FUNC)
    with live_server(tmp, "--workers", "2", "--func", str(path), "--extra-logs", "1") as server:
        yield server


def url(live: Live) -> str:
    return f"{live.url}/get_reward"


# --- OpenRLHF-M ----------------------------------------------------------------------------------


def test_openrlhf_m_gets_every_reward_as_tensors_from_the_default_server(default: Live):
    items = samples(64)
    got = openrlhf_m_rewards(url(default), [s.query for s in items], [s.prompt for s in items],
                             [s.label for s in items])
    assert set(got) == {"rewards", "scores", "format_rewards", "acc_rewards"}  # no extra_logs
    assert all(t.shape == (64,) and t.is_floating_point() for t in got.values())
    assert got["rewards"].tolist() == expected_rewards(64)
    assert torch.equal(got["scores"], got["acc_rewards"])


def test_openrlhf_m_crashes_on_a_server_with_extra_logs(extra: Live):
    """Why --extra-logs is off by default: OpenRLHF-M makes a tensor of every reply key, and
    extra_logs is a dict. The request succeeds; the trainer then raises, outside its retries."""
    items = samples(8)
    with pytest.raises(RuntimeError, match="Could not infer dtype of dict"):
        openrlhf_m_rewards(url(extra), [s.query for s in items], [s.prompt for s in items],
                           [s.label for s in items])


# --- upstream OpenRLHF ---------------------------------------------------------------------------


def test_upstream_256_samples_128_in_flight_get_the_batchs_answers(extra: Live):
    items = samples(256)
    before = extra.health()["batched"]
    infos = asyncio.run(upstream_rollout(url(extra), items, in_flight=128))
    assert extra.health()["batched"] - before == 256  # gathered into batches by the server
    whole = batch(extra, items)
    assert [value(i["reward"]) for i in infos] == whole["rewards"] == expected_rewards(256)
    assert [value(i["score"]) for i in infos] == whole["scores"]
    for key in ("format", "accuracy"):
        assert [value(i[key]) for i in infos] == whole["extra_logs"][key]
    assert all(set(i) == {"reward", "score", "format", "accuracy"} for i in infos)
    assert infos[0]["reward"].shape == (1, 1)  # the reply's list of one, wrapped again


def test_upstream_against_the_default_server_gets_scores_and_no_extra_logs(default: Live):
    items = samples(16)

    async def ask() -> list[dict]:
        return await asyncio.gather(*(upstream_reply(url(default), s) for s in items))

    replies = asyncio.run(ask())
    assert all("scores" in r and "extra_logs" not in r for r in replies)
    infos = [upstream_info(r) for r in replies]
    assert all(set(i) == {"reward", "score"} for i in infos)  # extra_logs: the empty dict
    assert [value(i["reward"]) for i in infos] == expected_rewards(16)
    assert [value(i["score"]) for i in infos] == [1.0 if r >= 1 else 0.0
                                                  for r in expected_rewards(16)]


def test_upstream_against_a_reward_func_file_gets_its_rewards_scores_and_logs(func: Live):
    items = samples(32)
    namespace: dict = {}
    exec(REWARD_FUNC, namespace)  # the same function, here, one sample per call as upstream
    infos = asyncio.run(upstream_rollout(url(func), items, in_flight=16))
    for sample, info in zip(items, infos, strict=True):
        own = namespace["reward_func"]([sample.query], [sample.prompt], [sample.label])
        assert value(info["reward"]) == own["rewards"].item()
        assert value(info["score"]) == own["scores"].item()
        assert value(info["length"]) == own["extra_logs"]["length"].item()
    assert {value(i["reward"]) for i in infos} == {0.0, 1.0}
