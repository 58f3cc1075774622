"""The head's manager of the built-in server passes the scoring settings through and says which
profile the run uses: the real server, started the way the head starts it (no Ray needed)."""

from __future__ import annotations

import io
import json
import os

import pytest
import requests

from podagent import config
from podagent.cluster.reward_server import RewardServer
from podagent.report import Reporter
from podagent.waiting import Signals

from .conftest import clean_env, free_port


@pytest.mark.parametrize(("flags", "expected"), [
    ({}, {"scoring": "openrlhf-m", "template": "chatml", "strict": False}),
    ({"reward_scoring": "openrlhf-m", "reward_template": "qwen1", "reward_strict": "1"},
     {"scoring": "openrlhf-m", "template": "qwen1", "strict": True}),
    ({"reward_scoring": "boxed"}, {"scoring": "boxed"}),
])
def test_the_head_starts_the_server_with_its_scoring_and_says_so(tmp_path, monkeypatch, flags,
                                                                 expected):
    # The head's own flags, not the environment: the server must still get them.
    for name in [n for n in os.environ if n.startswith("PODAGENT_")]:
        monkeypatch.delenv(name)
    settings = config.build({**flags, "reward_port": str(free_port()), "reward_timeout": "120"},
                            environ=clean_env())
    out = io.StringIO()
    reporter = Reporter("head", "pod", tmp_path / "run", stream=out)
    server = RewardServer(settings, "127.0.0.1", tmp_path, reporter, env={})
    try:
        server.start()
        server.wait_healthy(Signals())
        health = requests.get(server.url.replace("/get_reward", "/health"), timeout=10).json()
    finally:
        server.stop()
        reporter.close()
    assert {k: health[k] for k in expected} == expected
    said = out.getvalue()
    assert f"built-in reward server scoring: {expected['scoring']}" in said
    if expected["scoring"] == "openrlhf-m":
        assert f"prompt template {expected['template']}" in said
        assert ("strict" in said.split("scoring:")[1].splitlines()[0]) == expected["strict"]
    events = (tmp_path / "run" / "events.jsonl").read_text()
    assert '"event": "reward_scoring"' in events


def _head_server(tmp_path, settings) -> tuple[dict, dict, str, str]:
    """Start the server as the head does; (health, reply to one request, said, events)."""
    out = io.StringIO()
    reporter = Reporter("head", "pod", tmp_path / "run", stream=out)
    server = RewardServer(settings, "127.0.0.1", tmp_path, reporter, env={})
    try:
        server.start()
        server.wait_healthy(Signals())
        health = requests.get(server.url.replace("/get_reward", "/health"), timeout=10).json()
        reply = requests.post(server.url, timeout=60, json={
            "query": ["<|im_start|>assistant\n<think>t</think><answer>$7$</answer>"],
            "prompts": ["p0"], "labels": ["7"]}).json()
    finally:
        server.stop()
        reporter.close()
    return health, reply, out.getvalue(), (tmp_path / "run" / "events.jsonl").read_text()


def test_the_head_serves_a_reward_func_file(tmp_path, monkeypatch):
    for name in [n for n in os.environ if n.startswith("PODAGENT_")]:
        monkeypatch.delenv(name)
    path = tmp_path / "judge.py"
    path.write_text("def reward_func(queries, prompts, labels):\n"
                    "    return {'rewards': [len(queries[0]) / 100]}\n")
    settings = config.build({"reward": "func", "reward_func": str(path),
                             "reward_port": str(free_port()), "reward_timeout": "120"},
                            environ=clean_env())
    health, reply, said, events = _head_server(tmp_path, settings)
    assert health["scoring"] == "func" and health["func"] == str(path.resolve())
    assert reply["rewards"] == reply["scores"] == [0.58]  # len(query) / 100
    assert f"reward server (reward_func file) scoring: func (reward_func of {path}" in said
    assert '"event": "reward_scoring"' in events and '"scoring": "func"' in events


def test_the_head_says_which_gold_answers_the_rule_cannot_read(tmp_path, monkeypatch):
    """The dataset audit: one warning line at start and a reward_dataset event. A reward_func
    file left in the environment is not served when PODAGENT_REWARD=builtin."""
    for name in [n for n in os.environ if n.startswith("PODAGENT_")]:
        monkeypatch.delenv(name)
    dataset = tmp_path / "data.jsonl"
    golds = ["7", "$1\n2$", r"\frac{1}{2}", "$$", "x^2"]
    dataset.write_text("".join(json.dumps({"prompt": f"p{i}", "answer": g}) + "\n"
                               for i, g in enumerate(golds)))
    (tmp_path / "judge.py").write_text("def reward_func(q, p, l):\n    return {'rewards': [9]}\n")
    monkeypatch.setenv("PODAGENT_REWARD_DATASET", str(dataset))
    monkeypatch.setenv("PODAGENT_REWARD_FUNC", str(tmp_path / "judge.py"))
    settings = config.build({"reward_port": str(free_port()), "reward_timeout": "120"},
                            environ=clean_env())
    health, reply, said, events = _head_server(tmp_path, settings)
    assert health["scoring"] == "openrlhf-m"
    assert reply["rewards"] == [1.5]  # the profile's reward, not the file's 9
    audit = health["dataset_audit"]
    assert (audit["golds"], audit["checked"], audit["unparsed"]) == (5, 5, 2)
    warned = [line for line in said.splitlines() if "reward dataset:" in line]
    assert len(warned) == 1, said
    assert "2 of 5 gold answers cannot be read by the openrlhf-m rule" in warned[0]
    assert "'$1\\n2$', '$$'" in warned[0] and "PODAGENT_REWARD_STRICT=1" in warned[0]
    event = next(json.loads(line) for line in events.splitlines()
                 if '"event": "reward_dataset"' in line)
    assert (event["unparsed"], event["examples"]) == (2, ["$1\n2$", "$$"])
