"""verl's reward function (podagent.rewards.client) against a real reward server: the rewards
the server gives, one sample or a batch at a time, loaded by path as verl loads it; a missing
URL, a server that comes up late, a request the server refuses."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib.util
import inspect
import pickle
import subprocess
import sys
from functools import partial

import pytest

from podagent.rewards import client
from podagent.rewards.settings import RewardSettings
from podagent.waiting import Backoff

from .conftest import Live, free_port, live_server, thread_server

MAX_ITEMS = 64  # the shared server's --max-items: a bigger batch gets a 413
CHAT = "<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n{r}<|im_end|>"
# (solution_str, ground_truth, extra_info) as verl's reward managers pass them: the response
# alone, the dataset's gold (text or a number), the row's extra_info.
SAMPLES = [
    ("<think>2+2=4</think><answer>$4$</answer>", 4, {"question": "What is 2+2?", "index": 0}),
    ("<think>hmm</think><answer>$5$</answer>", "4", {"question": "What is 2+2?", "index": 1}),
    (r"So the answer is $\boxed{\frac{1}{2}}$.", "0.5", {"question": "Half of one?"}),
    ("I do not know.", "3", {"question": "1+2?"}),
    ("<think>t</think><answer>$\\sqrt{8}$</answer>", r"2\sqrt{2}", {"prompt": "Root of 8?"}),
    (CHAT.format(q="7?", r="<think>x</think><answer>$7$</answer>"), 7, {"prompt": "7?"}),
]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    with live_server(tmp_path_factory.mktemp("client"), "--workers", "2", "--extra-logs", "1",
                     "--max-items", str(MAX_ITEMS)) as server:
        yield server


@pytest.fixture
def served(live: Live, monkeypatch):
    """The environment a job gets from the head: REMOTE_RM_URL; a fresh process client."""
    monkeypatch.delenv("PODAGENT_REWARD_URL", raising=False)
    monkeypatch.setenv("REMOTE_RM_URL", f"{live.url}/get_reward")
    monkeypatch.setattr(client, "_client", None)
    return live


def server_reply(live: Live, samples) -> dict:
    """What the server gives for these samples, asked directly."""
    reply = live.post({"query": [s for s, _, _ in samples],
                       "labels": [str(t) for _, t, _ in samples],
                       "prompts": [i.get("question") or i["prompt"] for _, _, i in samples]})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_one_sample_and_a_batch_get_the_servers_rewards(served: Live):
    expected = server_reply(served, SAMPLES)["rewards"]
    assert len(set(expected)) >= 3  # right and wrong answers, well formed or not
    one = [client.compute_score(data_source="math", solution_str=s, ground_truth=t,
                                extra_info=i) for s, t, i in SAMPLES]
    assert one == expected and all(type(r) is float for r in one)
    batch = client.compute_score(data_sources=["math"] * len(SAMPLES),
                                 solution_strs=[s for s, _, _ in SAMPLES],
                                 ground_truths=[t for _, t, _ in SAMPLES],
                                 extra_infos=[i for _, _, i in SAMPLES])
    assert batch == expected


def test_a_batch_bigger_than_a_request_goes_in_parts(served: Live, monkeypatch):
    expected = server_reply(served, SAMPLES)["rewards"]
    monkeypatch.setattr(client, "MAX_ITEMS", 4)
    before = served.health()["requests"]
    batch = client.compute_score(solution_strs=[s for s, _, _ in SAMPLES],
                                 ground_truths=[t for _, t, _ in SAMPLES],
                                 extra_infos=[None] * len(SAMPLES))
    assert batch == expected
    assert served.health()["requests"] - before == 2  # 4 items, then 2


def test_extra_logs_come_as_dicts_only_when_asked(served: Live):
    reply = server_reply(served, SAMPLES)
    logs = reply["extra_logs"]
    assert set(logs) == {"format", "accuracy"}
    solution, truth, info = SAMPLES[0]
    assert client.compute_score("math", solution, truth, info) == reply["rewards"][0]
    asked = client.compute_score("math", solution, truth, info, extra_logs=True)
    assert asked == {"score": reply["rewards"][0], "format": logs["format"][0],
                     "accuracy": logs["accuracy"][0]}
    batch = client.compute_score(solution_strs=[s for s, _, _ in SAMPLES],
                                 ground_truths=[t for _, t, _ in SAMPLES],
                                 extra_infos=[i for _, _, i in SAMPLES], extra_logs=True)
    assert [b["score"] for b in batch] == reply["rewards"]
    assert [b["accuracy"] for b in batch] == logs["accuracy"]


def load_as_verl_does(path: str):
    """verl's loader: the file under a name of its own, not kept in sys.modules, and the
    function wrapped so that custom_reward_function.reward_kwargs join every call."""
    name = f"custom_module_{hash(path)}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert name not in sys.modules
    return module.compute_score


def test_verl_loads_it_by_path_and_ray_can_ship_it(served: Live):
    compute_score = load_as_verl_does(client.__file__)
    expected = server_reply(served, SAMPLES)
    solution, truth, info = SAMPLES[2]
    assert compute_score(data_source="math", solution_str=solution, ground_truth=truth,
                         extra_info=info) == expected["rewards"][2]
    # Ray pickles the reward function for its workers: by reference, to this very function.
    assert pickle.loads(pickle.dumps(compute_score)) is client.compute_score
    with_kwargs = partial(compute_score, extra_logs=True)
    assert with_kwargs(data_source="math", solution_str=solution, ground_truth=truth,
                       extra_info=info)["score"] == expected["rewards"][2]


def test_without_a_url_the_error_names_both_variables(monkeypatch):
    monkeypatch.delenv("PODAGENT_REWARD_URL", raising=False)
    monkeypatch.delenv("REMOTE_RM_URL", raising=False)
    monkeypatch.setattr(client, "_client", None)
    with pytest.raises(client.NoRewardUrl) as caught:
        client.compute_score("math", "<answer>$1$</answer>", "1")
    message = str(caught.value)
    assert "PODAGENT_REWARD_URL" in message and "REMOTE_RM_URL" in message
    assert "\n" not in message


def test_podagent_reward_url_comes_before_what_the_head_sets():
    assert client.url_from({"REMOTE_RM_URL": "http://a/get_reward",
                            "PODAGENT_REWARD_URL": "http://b/get_reward"}) == "http://b/get_reward"
    assert client.url_from({"REMOTE_RM_URL": "http://a/get_reward",
                            "PODAGENT_REWARD_URL": " "}) == "http://a/get_reward"


def test_a_server_that_comes_up_late_is_retried_until_it_answers(tmp_path):
    """The first try finds nothing listening; during the pause the server starts (as the head
    restarts a dead one); the next try is answered."""
    port = free_port()
    pauses: list[float] = []
    with contextlib.ExitStack() as stack:

        def pause(seconds: float) -> None:
            pauses.append(seconds)
            if len(pauses) == 1:
                stack.enter_context(thread_server(RewardSettings(port=port, workers=1)))

        late = client.Client(f"http://127.0.0.1:{port}/get_reward",
                             retries=client.Retries(attempts=3, backoff=Backoff.every(0.01),
                                                    sleep=pause))
        reply = late.score(["<think>a</think><answer>$4$</answer>"], ["4"])
    assert reply["rewards"] == [1.5]
    assert pauses == [0.01]  # one failed try, one pause


def test_retries_run_out_with_one_line_error():
    pauses: list[float] = []
    down = client.Client(f"http://127.0.0.1:{free_port()}/get_reward",
                         retries=client.Retries(attempts=3, backoff=Backoff(0.01, 0.02),
                                                sleep=pauses.append))
    with pytest.raises(client.RewardServerUnreachable) as caught:
        down.score(["x"], ["1"])
    assert pauses == [0.01, 0.02]
    message = str(caught.value)
    assert "ConnectionError" in message and "3 tries" in message and "\n" not in message


def test_a_request_the_server_refuses_is_not_retried(served: Live, monkeypatch):
    pauses: list[float] = []
    monkeypatch.setattr(client, "_client", client.Client(
        f"{served.url}/get_reward", retries=client.Retries(sleep=pauses.append)))
    before = served.health()["bad_requests"]
    too_many = MAX_ITEMS + 1
    with pytest.raises(client.RewardRefused) as caught:
        client.compute_score(solution_strs=["<answer>$1$</answer>"] * too_many,
                             ground_truths=["1"] * too_many)
    message = str(caught.value)
    assert "HTTP 413" in message and f"the limit is {MAX_ITEMS} items" in message
    assert pauses == [] and served.health()["bad_requests"] - before == 1


def test_the_command_in_the_docs_prints_the_path_to_give_verl():
    out = subprocess.run([sys.executable, "-c",
                          "import podagent.rewards.client as c; print(c.__file__)"],
                         capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout == client.__file__ + "\n"


# --- the async function (verl's reward loop awaits an `async def`) -----------------------------


def test_the_async_function_gives_the_same_answers_as_the_sync_one(served: Live):
    expected = server_reply(served, SAMPLES)

    async def ask() -> tuple[list, list, dict]:
        one = [await client.compute_score_async(data_source="math", solution_str=s,
                                                ground_truth=t, extra_info=i)
               for s, t, i in SAMPLES]
        batch = await client.compute_score_async(solution_strs=[s for s, _, _ in SAMPLES],
                                                 ground_truths=[t for _, t, _ in SAMPLES],
                                                 extra_infos=[i for _, _, i in SAMPLES])
        solution, truth, info = SAMPLES[0]
        logged = await client.compute_score_async("math", solution, truth, info,
                                                  extra_logs=True)
        return one, batch, logged

    one, batch, logged = asyncio.run(ask())
    assert one == batch == expected["rewards"] and all(type(r) is float for r in one)
    assert logged == client.compute_score("math", *SAMPLES[0], extra_logs=True)
    # verl loads it by path: the coroutine function is the package's own
    module_path = client.__file__
    spec = importlib.util.spec_from_file_location("custom_async", module_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.compute_score_async is client.compute_score_async
    assert inspect.iscoroutinefunction(module.compute_score_async)


def test_each_event_loop_has_its_own_session_and_keeps_it(served: Live):
    async def twice() -> tuple[client.AsyncClient, client.AsyncClient]:
        first = client.async_client()
        await client.compute_score_async("math", *SAMPLES[0])
        return first, client.async_client()

    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # verl: a loop per worker thread
        (a1, a2), (b1, b2) = pool.map(lambda _: asyncio.run(twice()), range(2))
    assert a1 is a2 and b1 is b2 and a1 is not b1


def test_the_async_client_retries_a_server_that_comes_up_late():
    port = free_port()
    pauses: list[float] = []
    with contextlib.ExitStack() as stack:

        async def pause(seconds: float) -> None:
            pauses.append(seconds)
            if len(pauses) == 1:
                stack.enter_context(thread_server(RewardSettings(port=port, workers=1)))

        async def ask() -> dict:
            late = client.AsyncClient(f"http://127.0.0.1:{port}/get_reward",
                                      retries=client.Retries(attempts=3,
                                                             backoff=Backoff.every(0.01),
                                                             async_sleep=pause))
            try:
                return await late.score(["<think>a</think><answer>$4$</answer>"], ["4"])
            finally:
                await late.close()

        reply = asyncio.run(ask())
    assert reply["rewards"] == [1.5]
    assert pauses == [0.01]


def test_the_async_client_gives_up_in_one_line_and_never_retries_a_refusal(served: Live):
    pauses: list[float] = []

    async def pause(seconds: float) -> None:
        pauses.append(seconds)

    async def ask(url: str, items: int) -> None:
        asking = client.AsyncClient(url, retries=client.Retries(
            attempts=3, backoff=Backoff(0.01, 0.02), async_sleep=pause))
        try:
            await asking.score(["<answer>$1$</answer>"] * items, ["1"] * items)
        finally:
            await asking.close()

    with pytest.raises(client.RewardServerUnreachable) as caught:
        asyncio.run(ask(f"http://127.0.0.1:{free_port()}/get_reward", 1))
    assert pauses == [0.01, 0.02]
    assert "3 tries" in str(caught.value) and "\n" not in str(caught.value)
    pauses.clear()
    with pytest.raises(client.RewardRefused) as caught:
        asyncio.run(ask(f"{served.url}/get_reward", MAX_ITEMS + 1))
    assert "HTTP 413" in str(caught.value) and pauses == []
