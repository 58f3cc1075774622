"""The server as trainers meet it: a real `python -m podagent.rewards` on a free port (the boxed
profile here; test_openrlhf_m_server.py runs the default profile the same way)."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import requests

from podagent.rewards.settings import FIELD_BY_ATTR, RewardSettings
from podagent.rewards.verify import FORMAT_WEIGHT

from .conftest import Live, live_server, thread_server

MAX_ITEMS, MAX_BODY, ITEM_TIMEOUT = 300, 1 << 20, 2.0
DATASET = [
    {"prompt": "What is 2+2?", "answer": "4"},
    {"prompt": "What is 2+2? Then double it.", "answer": "8"},
    {"prompt": "Half of one?", "answer": r"\frac{1}{2}"},
    {"prompt": "How many legs has a spider?", "answer": 8},
]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reward-server")
    dataset = tmp / "golds.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in DATASET))
    with live_server(tmp, "--scoring", "boxed", "--workers", "2",
                     "--item-timeout", str(ITEM_TIMEOUT),
                     "--max-items", str(MAX_ITEMS), "--dataset", str(dataset),
                     env={"PODAGENT_REWARD_MAX_BODY": "1MiB"}) as server:
        yield server


def test_protocol_round_trip(live: Live):
    template = "Solve. Put the final answer in \\boxed{}.\nQ: half of one? A:"
    responses = [r" it is \boxed{0.5}", r" \boxed{1/3}", " I do not know", "<answer>1/2</answer>",
                 r" \boxed{1} no wait \boxed{0.5}"]
    reply = live.post({"query": [template + r for r in responses],
                       "prompts": [template] * 5, "labels": [r"\frac{1}{2}"] * 5})
    assert reply.status_code == 200
    assert reply.headers["Content-Type"].startswith("application/json")
    got = reply.json()
    assert got["acc_rewards"] == [1.0, 0.0, 0.0, 1.0, 1.0]
    assert got["format_rewards"] == [1.0, 1.0, 0.0, 1.0, 0.0]
    assert got["rewards"] == [1 + FORMAT_WEIGHT, FORMAT_WEIGHT, 0.0, 1 + FORMAT_WEIGHT, 1.0]
    assert got["scores"] == got["acc_rewards"]


def test_without_prompts_the_whole_query_is_the_response(live: Live):
    # The template's empty \boxed{} is skipped; the model's box is the answer.
    got = live.post({"query": ["Answer in \\boxed{}. Q: 3+4? A: \\boxed{7}"],
                     "labels": ["7"]}).json()
    assert got["rewards"] == [1 + FORMAT_WEIGHT]


def test_an_empty_batch_is_fine(live: Live):
    reply = live.post({"query": []})
    assert reply.status_code == 200
    assert reply.json() == {"rewards": [], "scores": [], "format_rewards": [], "acc_rewards": []}


def _chunks(size: int):
    for _ in range(size // 65536):
        yield b" " * 65536


BAD_REQUESTS = {
    "not-json": (dict(data=b"query=1"), 400, "body is not JSON (Expecting value"),
    "not-utf8": (dict(data=b'{"query": ["\xff"]}'), 400, "body is not JSON (not UTF-8"),
    "array": (dict(json=[1, 2]), 400, "body must be a JSON object"),
    "no-query": (dict(json={"prompts": ["a"]}), 400, "missing 'query'"),
    "query-string": (dict(json={"query": "2+2"}), 400,
                     "'query' must be a list of strings, not a string"),
    "query-number-item": (dict(json={"query": ["a", 3]}), 400,
                          "'query' must be a list of strings; item 1 is a number"),
    "prompts-not-list": (dict(json={"query": ["a"], "prompts": {"p": 1}}), 400,
                         "'prompts' must be a list of strings, not an object"),
    "labels-null-item": (dict(json={"query": ["a"], "labels": [None]}), 400,
                         "'labels' must be a list of strings; item 0 is null"),
    "labels-length": (dict(json={"query": ["a", "b"], "labels": ["1"]}), 400,
                      "'labels' has 1 item but 'query' has 2 items"),
    "prompts-length": (dict(json={"query": ["a"], "prompts": ["1", "2", "3"]}), 400,
                       "'prompts' has 3 items but 'query' has 1 item"),
    "too-deep": (dict(data=b"[" * 200_000), 400, "nested too deeply"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=list(BAD_REQUESTS))
def test_bad_request_gets_a_json_error(live: Live, case):
    kwargs, status, message = BAD_REQUESTS[case]
    reply = live.post(**kwargs)
    assert reply.status_code == status
    assert reply.headers["Content-Type"].startswith("application/json")
    assert message in reply.json()["error"]
    assert "Traceback" not in reply.text


# A request over the budget: (request, the setting, its limit, what the request had: None
# where the server stops reading a chunked body at the limit).
OVER_LIMIT = {
    "items": (lambda: dict(json={"query": ["x"] * (MAX_ITEMS + 1)}), "max_items", MAX_ITEMS,
              MAX_ITEMS + 1),
    "body": (lambda: dict(data=b" " * (MAX_BODY + 1)), "max_body", MAX_BODY, MAX_BODY + 1),
    "chunked-body": (lambda: dict(data=_chunks(2 * MAX_BODY)), "max_body", MAX_BODY, None),
}


@pytest.mark.parametrize("case", OVER_LIMIT, ids=list(OVER_LIMIT))
def test_a_request_over_the_budget_gets_413_naming_the_limit(live: Live, case):
    request, setting, limit, seen = OVER_LIMIT[case]
    before = live.health()["bad_requests"]
    reply = live.post(**request())
    assert reply.status_code == 413
    assert reply.headers["Content-Type"].startswith("application/json")
    got = reply.json()
    field = FIELD_BY_ATTR[setting]
    assert (got["setting"], got["limit"], got["seen"], got["flag"], got["env"]) == (
        setting, limit, seen, field.flag, field.env)
    unit = "items" if setting == "max_items" else "bytes"
    had = f"{seen} {unit}" if seen is not None else f"over {limit} {unit}"
    assert got["error"].endswith(f"{had}; the limit is {limit} {unit} ({setting}: "
                                 f"{field.flag} or {field.env})")
    assert live.health()["bad_requests"] == before + 1


def test_unknown_paths_and_methods_get_json(live: Live):
    missing = requests.get(f"{live.url}/nope", timeout=10)
    assert (missing.status_code, missing.json()) == (404, {"error": "not found"})
    wrong = requests.get(f"{live.url}/get_reward", timeout=10)
    assert (wrong.status_code, wrong.json()) == (405, {"error": "method not allowed"})
    assert wrong.headers["Allow"] == "POST"


def test_bad_requests_are_counted_and_the_server_still_answers(live: Live):
    before = live.health()["bad_requests"]
    assert live.post(data=b"nope").status_code == 400
    assert live.health()["bad_requests"] == before + 1
    assert live.post({"query": [r"\boxed{4}"], "labels": ["4"]}).json()["acc_rewards"] == [1.0]


def test_dataset_mode_finds_golds_by_prompt(live: Live):
    before = live.health()
    got = live.post({
        "query": [
            "What is 2+2? \\boxed{4}",  # by the exact prompt
            "What is 2+2? Then double it. \\boxed{8}",  # longest prefix, not "What is 2+2?"
            "What is 2+2? Then double it. \\boxed{4}",
            "Half of one? so \\boxed{0.5}",
            "How many legs has a spider? \\boxed{8}",  # a numeric gold in the file
            "Not in the dataset \\boxed{4}",
        ],
        "prompts": ["What is 2+2?", "", "", "", "", ""],
    }).json()
    assert got["acc_rewards"] == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    assert got["format_rewards"] == [1.0] * 6
    after = live.health()
    assert after["unlabeled"] == before["unlabeled"] + 1
    assert after["dataset_prompts"] == len(DATASET)


def test_labels_take_precedence_over_the_dataset(live: Live):
    got = live.post({"query": ["What is 2+2? \\boxed{5}"], "labels": ["5"]}).json()
    assert got["acc_rewards"] == [1.0]


def _batch_with_pathological_items() -> dict[str, list[str]]:
    towers = [rf"\boxed{{{b}^{{{b}^{{{b}^{{{b}}}}}}}}}" for b in (5, 6, 7, 9)]
    nested = r"\boxed{" + "(" * 5000 + "1" + ")" * 5000 + "}"
    huge = "word " * 100_000 + r"\boxed{1}"  # long, but a fair (and right) answer
    queries, labels = [*towers, nested, huge], ["1"] * 6
    for n in range(250):  # distinct multiples of pi: each needs its own sympy verification
        queries.append(rf"so the answer is \boxed{{\frac{{{n + 1}\pi}}{{{n + 2}}}}}")
        labels.append(rf"\frac{{{2 * (n + 1)}\pi}}{{{2 * (n + 2)}}}" if n % 3 else r"\pi")
    return {"query": queries, "labels": labels}


def test_health_answers_while_a_heavy_batch_is_in_flight(live: Live):
    payload = _batch_with_pathological_items()
    before = live.health()
    result: dict[str, requests.Response] = {}
    worker = threading.Thread(target=lambda: result.setdefault("reply", live.post(payload)))
    worker.start()
    probes = []
    try:
        while worker.is_alive() and len(probes) < 40:
            started = time.monotonic()
            reply = requests.get(f"{live.url}/health", timeout=5)
            probes.append((reply.status_code, time.monotonic() - started, reply.json()))
            worker.join(timeout=0.25)
    finally:
        worker.join(timeout=120)
    assert not worker.is_alive()
    assert any(p[2]["in_flight"] > 0 for p in probes), "no probe saw the batch in flight"
    assert all(status == 200 and took < 5 for status, took, _ in probes)
    reply = result["reply"]
    assert reply.status_code == 200
    acc = reply.json()["acc_rewards"]
    assert len(acc) == 256 and acc[:6] == [0.0] * 5 + [1.0]
    assert acc[6:] == [0.0 if n % 3 == 0 else 1.0 for n in range(250)]
    after = live.health()
    assert after["timeouts"] - before["timeouts"] >= 3  # towers are killed, not finished
    assert after["verified"] - before["verified"] >= 249  # the pi items went through sympy


def test_an_internal_error_is_a_json_500_and_the_server_lives_on(caplog):
    settings = RewardSettings(scoring="boxed", port=0, workers=1, item_timeout=5.0)
    with thread_server(settings) as running:
        real = running.scorer.score_body

        async def explode(body: bytes):
            raise RuntimeError("secret internals")

        running.scorer.score_body = explode
        try:
            reply = requests.post(f"{running.url}/get_reward", json={"query": ["x"]}, timeout=30)
        finally:
            running.scorer.score_body = real
        assert reply.status_code == 500
        assert reply.json() == {"error": "internal error in the reward server (details in its log)"}
        assert "secret" not in reply.text and "Traceback" not in reply.text
        logged = [r for r in caplog.records if r.exc_info]
        assert logged and "secret internals" in str(logged[0].exc_info[1])
        after = requests.post(f"{running.url}/get_reward",
                              json={"query": [r"\boxed{3}"], "labels": ["3"]}, timeout=30)
        assert after.status_code == 200 and after.json()["acc_rewards"] == [1.0]
        assert running.scorer.stats.errors == 1


def test_sigterm_stops_the_server_and_its_workers_with_exit_0(tmp_path):
    with live_server(tmp_path, "--workers", "2") as server:
        assert server.post({"query": [r"\boxed{1}"], "labels": ["1"]}).status_code == 200
        children = psutil.Process(server.proc.pid).children(recursive=True)
        assert len(children) >= 2  # the workers (and the forkserver)
        server.proc.terminate()
        assert server.proc.wait(timeout=30) == 0
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive
    log = server.log.read_text()
    assert "stopped" in log and "Traceback" not in log


def test_concurrent_clients_all_get_answers(live: Live):
    def one(n: int) -> list[float]:
        return live.post({"query": [rf"\boxed{{{n}}}", r"\boxed{0}"],
                          "labels": [str(n), "1"]}).json()["acc_rewards"]

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(one, range(16))) == [[1.0, 0.0]] * 16
