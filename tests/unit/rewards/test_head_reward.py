"""The head's manager of the built-in server passes the scoring settings through and says which
profile the run uses: the real server, started the way the head starts it (no Ray needed)."""

from __future__ import annotations

import io
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
