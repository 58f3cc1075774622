"""`--func FILE`: a reward_func file (upstream OpenRLHF's contract) served over HTTP.

Served, it gives what calling it in-process gives; an item that never returns times out and
scores the default while the others are answered and the server stays healthy; a broken file
is one line and exit 2 at start; a function that raises scores the default, logged."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from podagent.rewards import func

from .conftest import clean_env, free_port, live_server

# A reward of the kinds users write: rules on the text, a label check, tensors back (upstream's
# examples return torch tensors), an extra log; deterministic, so in-process and served agree.
REWARD_FILE = '''
import re
import torch

def reward_func(queries, prompts, labels, **kwargs):
    rewards, lengths = [], []
    for query, prompt, label in zip(queries, prompts, labels):
        response = query[len(prompt):] if prompt and query.startswith(prompt) else query
        boxed = re.findall(r"\\\\boxed\\{([^{}]*)\\}", response)
        right = bool(boxed) and boxed[-1].strip() == (label or "").strip()
        rewards.append((1.0 if right else 0.0) + 0.1 * min(len(response), 50) / 50)
        lengths.append(float(len(response)))
    tensor = torch.tensor(rewards)
    return {"rewards": tensor, "scores": (tensor >= 1).float(),
            "extra_logs": {"length": torch.tensor(lengths).mean()}}
'''

# One item never returns (an LLM judge that hangs, a sympy call that never ends).
STUCK_FILE = '''
import time

def reward_func(queries, prompts, labels):
    if "STUCK" in queries[0]:
        while True:
            time.sleep(1)
    return {"rewards": [float(len(queries[0]))]}
'''

RAISING_FILE = '''
def reward_func(queries, prompts, labels):
    return {"rewards": [1 / 0]}
'''

BROKEN = {
    "missing": (None, "no such file"),
    "syntax": ("def reward_func(queries, prompts, labels)\n    return {}\n",
               "line 1: expected ':'"),
    "no-reward-func": ("def reward(queries, prompts, labels):\n    return {}\n",
                       "defines no reward_func at the top level"),
    "import-raises": ("import no_such_module_here\ndef reward_func(q, p, l):\n    return {}\n",
                      "running it raised ModuleNotFoundError: No module named "
                      "'no_such_module_here'"),
    "not-callable": ("reward_func = 3\n", "its reward_func is int, not a function"),
}


def samples(count: int, seed: int = 7) -> list[tuple[str, str, str]]:
    rng = random.Random(seed)
    out = []
    for index in range(count):
        prompt = f"Question {index % 97}: what is {index % 97} + {index % 13}?"
        gold = str(index % 97 + index % 13)
        answer = gold if rng.random() < 0.5 else str(rng.randint(0, 200))
        thought = " ".join(rng.choice(["so", "then", "we add", "carry"]) for _ in range(
            rng.randint(0, 12)))
        response = rng.choice([f" {thought} \\boxed{{{answer}}}", f" {thought}", f" {answer}"])
        out.append((prompt + response, prompt, gold))
    return out


def write(tmp: Path, name: str, text: str) -> Path:
    path = tmp / name
    path.write_text(text, encoding="utf-8")
    return path


def post(url: str, items: list[tuple[str, str, str]]) -> dict:
    reply = requests.post(f"{url}/get_reward", timeout=120, json={
        "query": [q for q, _, _ in items], "prompts": [p for _, p, _ in items],
        "labels": [lab for _, _, lab in items]})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_served_rewards_equal_the_function_called_in_process(tmp_path):
    path = write(tmp_path, "reward.py", REWARD_FILE)
    local = func.load(str(path))
    items = samples(1000)
    expected = [local([q], [p], [lab]) for q, p, lab in items]
    with live_server(tmp_path, "--func", str(path), "--workers", "2", "--extra-logs", "1") as srv:
        # Half as batches of 100, half one item per request, 64 in flight (upstream's shape).
        batched = [post(srv.url, items[i:i + 100]) for i in range(0, 500, 100)]
        with ThreadPoolExecutor(64) as threads:
            single = list(threads.map(lambda item: post(srv.url, [item]), items[500:]))
        health = srv.health()
    got = {key: [v for reply in batched for v in reply[key]]
           + [v for reply in single for v in reply[key]] for key in ("rewards", "scores")}
    lengths = ([v for reply in batched for v in reply["extra_logs"]["length"]]
               + [reply["extra_logs"]["length"][0] for reply in single])
    want_rewards = [e["rewards"].item() for e in expected]
    assert got["rewards"] == pytest.approx(want_rewards, abs=1e-6)
    assert got["scores"] == [e["scores"].item() for e in expected]
    assert lengths == [e["extra_logs"]["length"].item() for e in expected]
    assert health["scoring"] == "func" and health["items"] == 1000
    assert health["func_errors"] == 0 and health["timeouts"] == 0
    # Single-item requests were answered in batches (fewer batches than requests).
    assert 0 < health["batches"] < 500 + 5


def test_a_stuck_item_times_out_and_the_rest_are_answered(tmp_path):
    path = write(tmp_path, "stuck.py", STUCK_FILE)
    with live_server(tmp_path, "--func", str(path), "--workers", "2", "--item-timeout", "1",
                     "--default-reward", "-1") as srv:
        reply = post(srv.url, [("ab", "", ""), ("STUCK here", "", ""), ("abcd", "", "")])
        assert reply["rewards"] == [2.0, -1.0, 4.0]
        assert reply["scores"] == [2.0, -1.0, 4.0]
        # Still serving, with a fresh worker in place of the killed one.
        assert post(srv.url, [("xyz", "", "")])["rewards"] == [3.0]
        health = srv.health()
        assert health["status"] == "ok" and health["timeouts"] == 1
        assert srv.proc.poll() is None
    assert "ran past the item timeout (1 s; worker replaced): 1 item" in srv.log.read_text()


def test_a_function_that_raises_scores_the_default_and_is_logged_once_per_batch(tmp_path):
    path = write(tmp_path, "raising.py", RAISING_FILE)
    with live_server(tmp_path, "--func", str(path), "--workers", "1",
                     "--default-reward", "0.25") as srv:
        reply = post(srv.url, [("a", "", "")] * 5)
        assert reply == {"rewards": [0.25] * 5, "scores": [0.25] * 5}
        assert srv.health()["func_errors"] == 5
    lines = [line for line in srv.log.read_text().splitlines() if "raised" in line]
    assert len(lines) == 1, lines
    assert "reward_func raised ZeroDivisionError: division by zero: 5 items" in lines[0]
    assert "Traceback" not in srv.log.read_text()


@pytest.fixture(scope="module")
def broken_runs(tmp_path_factory) -> dict[str, tuple[str, subprocess.CompletedProcess]]:
    tmp = tmp_path_factory.mktemp("broken")

    def run(name: str) -> tuple[str, subprocess.CompletedProcess]:
        text = BROKEN[name][0]
        path = str(tmp / "absent.py") if text is None else str(write(tmp, f"{name}.py", text))
        return path, subprocess.run(
            [sys.executable, "-m", "podagent.rewards", "--port", str(free_port()), "--workers", "1",
             "--func", path], env=clean_env(), capture_output=True, text=True, timeout=120,
            stdin=subprocess.DEVNULL)

    with ThreadPoolExecutor(3) as threads:
        return dict(zip(BROKEN, threads.map(run, BROKEN), strict=True))


@pytest.mark.parametrize("case", BROKEN, ids=list(BROKEN))
def test_a_broken_file_is_one_line_and_exit_2(broken_runs, case):
    path, result = broken_runs[case]
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines()
             if line.startswith("podagent reward-server: error:")]
    assert len(lines) == 1, result.stderr
    assert f"--func={path!r}" in lines[0] and BROKEN[case][1] in lines[0], lines[0]
    assert "Traceback" not in result.stderr


def test_what_a_reward_func_may_return():
    """Tensors, lists and plain numbers are one item's reward; anything else is named."""
    torch = pytest.importorskip("torch")
    rule = func._func_rule(lambda q, p, lab: {"rewards": torch.tensor([0.5]),
                                              "extra_logs": {"m": torch.tensor(2.0)}})
    assert rule("q", None, None) == func.Scored(0.5, 0.5, {"m": 2.0})
    cases = {"rewards": "'rewards' that is str", 3: "int, not a dict",
             "no-rewards": "a dict without 'rewards'", "two": "'rewards' with 2 values",
             "nan": "'rewards' that is nan", "huge": "'rewards' that is too large for a number"}
    answers = {"rewards": {"rewards": ["x"]}, 3: 3, "no-rewards": {"scores": [1.0]},
               "two": {"rewards": [1.0, 2.0]}, "nan": {"rewards": [float("nan")]},
               "huge": {"rewards": [10**400]}}
    for name, answer in answers.items():
        scored = func._func_rule(lambda q, p, lab, a=answer: a)("q", None, None)
        assert scored.error is not None and cases[name] in scored.error, (name, scored)
    assert json.dumps(func.Scored(1.0, 1.0).__dict__["extra"]) == "{}"


# Every way a reward function can misbehave, one per query; "ok" items score their length.
HOSTILE_FILE = '''
import os, sys, time

def reward_func(queries, prompts, labels):
    q = queries[0]
    kind = q.split(":")[0]
    if kind == "raise":
        raise RuntimeError("boom")
    if kind == "exit":
        sys.exit(3)
    if kind == "interrupt":
        raise KeyboardInterrupt
    if kind == "die":
        os._exit(1)
    if kind == "hang":
        while True:
            time.sleep(1)
    if kind == "memory":
        hoard = []
        while True:
            hoard.append(bytearray(64 << 20))
    if kind == "fork":
        if os.fork() == 0:
            time.sleep(3)
            os._exit(0)
    if kind == "stdout":
        print("x" * 100000, flush=True)
    answers = {"nan": float("nan"), "inf": float("inf"), "huge": 10**400, "text": "high",
               "none": None, "two": [1.0, 2.0]}
    if kind in answers:
        return {"rewards": [answers[kind]]}
    if kind == "not-a-dict":
        return [1.0]
    return {"rewards": [float(len(q))]}
'''

HOSTILE = ("raise", "exit", "interrupt", "die", "hang", "memory", "nan", "inf", "huge", "text",
           "none", "two", "not-a-dict")
HARMLESS = ("fork", "stdout")  # odd, but their rewards are good ones


def test_hostile_reward_functions_cost_only_their_items(tmp_path):
    path = write(tmp_path, "hostile.py", HOSTILE_FILE)
    kinds = [*HOSTILE, *HARMLESS]
    items = [(f"{kind}:{i}", "", "") for i, kind in enumerate(kinds)]
    items += [(f"ok:{'a' * i}", "", "") for i in range(20)]
    # The item timeout is for the one that hangs: every other item ends by itself, the one
    # that hoards with a MemoryError at 768 MiB (half a second to fill on an idle machine,
    # three on a loaded one: a 2 s limit came first there). The timeout's own test is
    # test_a_stuck_item_times_out_and_the_rest_are_answered.
    with live_server(tmp_path, "--func", str(path), "--workers", "2", "--item-timeout", "30",
                     "--item-memory", "768MiB", "--default-reward", "-1") as srv:
        reply = post(srv.url, items)
        # One at a time too: each misbehaving item alone, then a good one right after it.
        alone = [post(srv.url, [item, ("ok:after", "", "")])["rewards"] for item in items[:4]]
        health = srv.health()
        assert srv.proc.poll() is None
    expected = [-1.0 if kind in HOSTILE else float(len(q)) for (q, _, _), kind
                in zip(items, kinds + ["ok"] * 20, strict=True)]
    assert reply["rewards"] == expected
    assert alone == [[-1.0, 8.0]] * 4
    assert health["status"] == "ok"
    assert health["timeouts"] == 1  # the one that hangs; the others each ended their own way
    log = srv.log.read_text()
    for says in ("reward_func raised SystemExit: 3", "reward_func raised KeyboardInterrupt",
                 "reward_func raised MemoryError", "killed its worker process",
                 "ran past the item timeout", "'rewards' that is too large for a number",
                 "'rewards' that is nan", "'rewards' that is inf"):
        assert says in log, says
