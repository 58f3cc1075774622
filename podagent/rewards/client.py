"""verl's reward function, answered by the head's reward server.

verl scores rollouts in the trainer by a function it loads from a file (see the docs on verl):

    path=$(python -c "import podagent.rewards.client as c; print(c.__file__)")
    ... custom_reward_function.path=$path custom_reward_function.name=compute_score

What verl does with it, as its sources (volcengine/verl: verl/trainer/ppo/reward.py,
verl/utils/import_utils.py, verl/workers/reward_manager/naive.py and batch.py,
verl/experimental/reward_loop/reward_manager/naive.py) show:
- it imports the file with importlib's spec_from_file_location under a name of its own, and
  (in recent releases) does not keep that module in sys.modules; the function is then wrapped
  with the config's `custom_reward_function.reward_kwargs` merged into every call's keywords;
- the naive manager (the default, and the reward loop's) calls it once per sample with the
  keywords data_source, solution_str (the decoded response alone, no prompt), ground_truth
  and extra_info (the dataset row's dict); the reward loop does so from a thread pool;
- the batch manager (reward_model.reward_manager=batch) calls it once per batch with the
  plural keywords data_sources, solution_strs, ground_truths, extra_infos and takes a list;
- a float is the reward; a dict's "score" is, and all of its keys are logged per sample.

Each call here becomes POST {"query": [...], "labels": [...], "prompts": [...]} to the reward
server (OpenRLHF's protocol) and the reply's `rewards` come back as floats.
"""

# No `from __future__ import annotations` here: verl executes this file under a module name it
# does not register, and dataclasses look string annotations up in sys.modules by that name.

import asyncio
import importlib
import json
import os
import threading
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import requests
from requests.adapters import HTTPAdapter

from podagent.errors import PodagentError
from podagent.waiting import Backoff, Expired, NotYet, retry, retry_async

MODULE = "podagent.rewards.client"
# Where the server is: ours first (a server elsewhere, or a job podagent did not start), then
# what the head gives the job.
URL_VARIABLES = ("PODAGENT_REWARD_URL", "REMOTE_RM_URL")
# Seconds one request may take, as OpenRLHF's own clients allow.
TIMEOUT = 180.0
# Items per request in the batch form: a quarter of the server's default --max-items, and a
# body well under its --max-body even with long chains of thought.
MAX_ITEMS = 1024
# Pauses between tries: 1, 2, 4, 8, 16, 30, 30 s (8 tries, as Retries has it) ride out a
# restart of the server by the head.
BACKOFF = Backoff(1.0, 30.0)
# Connections kept open: verl's reward loop calls the function from a pool of threads.
POOL_SIZE = 32


class RewardClientError(PodagentError):
    """The reward server could not be asked, or did not answer as the protocol says."""


class NoRewardUrl(RewardClientError):
    def __init__(self) -> None:
        super().__init__(f"no reward server URL: set {URL_VARIABLES[0]} or {URL_VARIABLES[1]} "
                         f"(podagent's head sets {URL_VARIABLES[1]} for the job)")


class RewardRefused(RewardClientError):
    """A 4xx: asking again would get the same answer."""


class RewardServerUnreachable(RewardClientError):
    """Connection errors, timeouts or 5xx until the tries ran out."""


@dataclass(frozen=True)
class Retries:
    """How often a request is tried on connection errors, timeouts and 5xx."""

    attempts: int = 8
    backoff: Backoff = BACKOFF
    sleep: Callable[[float], None] = time.sleep
    async_sleep: Callable[[float], Awaitable[None]] | None = None  # asyncio.sleep


class Client:
    """One server's URL, one session (connections reused across calls), the retry policy."""

    def __init__(self, url: str, *, timeout: float = TIMEOUT, retries: Retries = Retries()):
        self.url, self.timeout, self.retries = url, timeout, retries
        self.session = requests.Session()
        adapter = HTTPAdapter(pool_connections=1, pool_maxsize=POOL_SIZE)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)

    def score(self, queries: Sequence[str], labels: Sequence[str] | None = None,
              prompts: Sequence[str] | None = None) -> dict[str, Any]:
        """The server's reply for these items, checked: one reward per query."""
        payload = _payload(queries, labels, prompts)
        return _checked(self.url, payload, self.post(payload))

    def post(self, payload: Mapping[str, Any]) -> Any:
        """The reply's JSON; RewardServerUnreachable when the tries run out, RewardRefused on a
        4xx (with the server's own message)."""

        def attempt() -> Any:
            try:
                response = self.session.post(self.url, json=payload, timeout=self.timeout)
            except (requests.ConnectionError, requests.Timeout) as exc:
                raise NotYet(f"{type(exc).__name__}: {_short(str(exc))}") from None
            return _answer(self.url, response.status_code,
                           response.text or response.reason or "")

        def unreachable(out: Expired) -> RewardServerUnreachable:
            return RewardServerUnreachable(f"{out} ({out.tries} tries)")

        policy = self.retries
        return retry(attempt, awaited=f"the reward server at {self.url}",
                     backoff=policy.backoff, attempts=policy.attempts, sleep=policy.sleep,
                     expired=unreachable)


class AsyncClient:
    """The same for a coroutine (verl's `async def` reward function): one aiohttp session,
    made in the event loop that uses it (a session belongs to one loop), the same retries with
    their pauses awaited."""

    def __init__(self, url: str, *, timeout: float = TIMEOUT, retries: Retries = Retries()):
        import aiohttp  # with Ray's dashboard (ray[default]) and podagent's reward extra

        self.url, self.timeout, self.retries = url, timeout, retries
        self._aiohttp = aiohttp
        self._held: AsyncIterator[None] | None = None
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=POOL_SIZE),
            timeout=aiohttp.ClientTimeout(total=timeout))

    async def score(self, queries: Sequence[str], labels: Sequence[str] | None = None,
                    prompts: Sequence[str] | None = None) -> dict[str, Any]:
        payload = _payload(queries, labels, prompts)
        return _checked(self.url, payload, await self.post(payload))

    async def post(self, payload: Mapping[str, Any]) -> Any:
        aiohttp = self._aiohttp
        if self._held is None:  # the session closes with its loop (asyncio.run's end)
            self._held = self._until_the_loop_ends()
            await self._held.__anext__()

        async def attempt() -> Any:
            try:
                async with self.session.post(self.url, json=payload) as response:
                    status, text = response.status, await response.text()
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                raise NotYet(f"{type(exc).__name__}: {_short(str(exc))}") from None
            return _answer(self.url, status, text)

        def unreachable(out: Expired) -> RewardServerUnreachable:
            return RewardServerUnreachable(f"{out} ({out.tries} tries)")

        policy = self.retries
        return await retry_async(attempt, awaited=f"the reward server at {self.url}",
                                 backoff=policy.backoff, attempts=policy.attempts,
                                 sleep=policy.async_sleep, expired=unreachable)

    async def close(self) -> None:
        await self.session.close()

    async def _until_the_loop_ends(self) -> AsyncIterator[None]:
        """Held open by the client: a loop that ends (asyncio.run's shutdown_asyncgens) closes
        this generator, and with it the session, instead of leaving it to a warning."""
        try:
            yield
        finally:
            await self.session.close()


def _payload(queries: Sequence[str], labels: Sequence[str] | None,
             prompts: Sequence[str] | None) -> dict[str, Any]:
    payload: dict[str, Any] = {"query": list(queries)}
    if prompts is not None:
        payload["prompts"] = list(prompts)
    if labels is not None:
        payload["labels"] = list(labels)
    return payload


def _checked(url: str, payload: Mapping[str, Any], reply: Any) -> dict[str, Any]:
    """The reply, if it has one reward per query."""
    rewards = reply.get("rewards") if isinstance(reply, dict) else None
    if not isinstance(rewards, list) or len(rewards) != len(payload["query"]):
        raise RewardClientError(f"the reward server at {url} answered without one reward per "
                                f"query: {_short(repr(reply))}")
    return reply


def _answer(url: str, status: int, text: str) -> Any:
    """An answer's JSON; NotYet for a 5xx (tried again), RewardRefused for a 4xx."""
    if status >= 500:
        raise NotYet(f"HTTP {status}: {_message(text)}")
    if status >= 400:
        raise RewardRefused(f"the reward server at {url} refused the request (HTTP {status}): "
                            f"{_message(text)}")
    try:
        return json.loads(text)
    except ValueError:
        raise RewardClientError(f"the reward server at {url} answered what is not JSON: "
                                f"{_short(text)}") from None


def _message(text: str) -> str:
    """The server's JSON error message, else the start of its body."""
    try:
        error = json.loads(text).get("error")
    except (ValueError, AttributeError):
        error = None
    return _short(str(error) if error else text)


def _short(text: str, most: int = 300) -> str:
    line = " ".join(text.split())
    return line if len(line) <= most else line[:most] + "..."


# --- the process's client ------------------------------------------------------------------------

_client: Client | None = None
_lock = threading.Lock()


def url_from(environ: Mapping[str, str]) -> str:
    for name in URL_VARIABLES:
        value = environ.get(name, "").strip()
        if value:
            return value
    raise NoRewardUrl()


def client() -> Client:
    """This process's client, made on first use from the environment; NoRewardUrl."""
    global _client
    with _lock:
        if _client is None:
            _client = Client(url_from(os.environ))
        return _client


# One async client per event loop: an aiohttp session belongs to the loop it was made in.
_async_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncClient] = (
    weakref.WeakKeyDictionary())


def async_client() -> AsyncClient:
    """The running event loop's client, made on first use from the environment; NoRewardUrl."""
    loop = asyncio.get_running_loop()
    with _lock:
        found = _async_clients.get(loop)
        if found is None:
            found = _async_clients[loop] = AsyncClient(url_from(os.environ))
        return found


def _forget() -> None:
    """After a fork: the child makes its own session (sockets are not to be shared)."""
    global _client, _lock
    _client, _lock = None, threading.Lock()
    _async_clients.clear()


os.register_at_fork(after_in_child=_forget)


# --- verl's function -----------------------------------------------------------------------------


def compute_score(data_source: Any = None, solution_str: str | None = None,
                  ground_truth: Any = None, extra_info: Any = None, *,
                  data_sources: Sequence[Any] | None = None,
                  solution_strs: Sequence[str] | None = None,
                  ground_truths: Sequence[Any] | None = None,
                  extra_infos: Sequence[Any] | None = None,
                  extra_logs: bool = False, **_: Any) -> Any:
    """The reward of one sample (a float), or with the plural keywords of verl's batch manager,
    the list of rewards of a batch. `extra_logs=True` (verl:
    `+custom_reward_function.reward_kwargs.extra_logs=true`) returns {"score": reward, ...}
    with the item's extra_logs numbers beside it, when the server sends them
    (--extra-logs 1). Other keywords verl passes are not used."""
    requests_ = _requests(solution_str, ground_truth, extra_info, solution_strs,
                          ground_truths, extra_infos)
    answers = [answer for request in requests_
               for answer in _rewards(client().score(*request), extra_logs)]
    return answers if solution_strs is not None else answers[0]


async def compute_score_async(data_source: Any = None, solution_str: str | None = None,
                              ground_truth: Any = None, extra_info: Any = None, *,
                              data_sources: Sequence[Any] | None = None,
                              solution_strs: Sequence[str] | None = None,
                              ground_truths: Sequence[Any] | None = None,
                              extra_infos: Sequence[Any] | None = None,
                              extra_logs: bool = False, **_: Any) -> Any:
    """compute_score as a coroutine, for verl's reward loop, which awaits an `async def`
    reward function on its event loop instead of blocking a thread per call
    (`reward.custom_reward_function.name=compute_score_async`); the same answers."""
    requests_ = _requests(solution_str, ground_truth, extra_info, solution_strs,
                          ground_truths, extra_infos)
    answers = [answer for request in requests_
               for answer in _rewards(await async_client().score(*request), extra_logs)]
    return answers if solution_strs is not None else answers[0]


Request = tuple[list[str], list[str] | None, list[str] | None]  # queries, labels, prompts


def _requests(solution_str: str | None, ground_truth: Any, extra_info: Any,
              solution_strs: Sequence[str] | None, ground_truths: Sequence[Any] | None,
              extra_infos: Sequence[Any] | None) -> list[Request]:
    """(queries, labels, prompts) of each request: one sample, or a batch in parts of at most
    MAX_ITEMS."""
    if solution_strs is None:
        if solution_str is None:
            raise TypeError("compute_score needs solution_str (one sample) or solution_strs "
                            "(verl's batch form)")
        return [_request([solution_str], [ground_truth], [extra_info])]
    count = len(solution_strs)
    parts = [slice(start, min(count, start + MAX_ITEMS)) for start in range(0, count, MAX_ITEMS)]
    return [_request(list(solution_strs[part]), _part(ground_truths, part, count),
                     _part(extra_infos, part, count)) for part in parts]


def _part(values: Sequence[Any] | None, part: slice, count: int) -> list[Any]:
    return [None] * (part.stop - part.start) if values is None else list(values[part])


def _request(queries: list[str], truths: list[Any], infos: list[Any]) -> Request:
    # The server takes lists of strings: a key goes only when every item has one (without
    # labels, a server with --dataset looks the gold up by prompt).
    prompts = [prompt for info in infos if (prompt := _prompt_of(info)) is not None]
    labels = [str(t) for t in truths if t is not None]
    return ([str(q) for q in queries], labels if len(labels) == len(truths) else None,
            prompts if len(prompts) == len(infos) else None)


def _rewards(reply: Mapping[str, Any], extra_logs: bool) -> list[Any]:
    rewards = [float(r) for r in reply["rewards"]]
    if not extra_logs:
        return rewards
    logs = reply.get("extra_logs")
    logs = logs if isinstance(logs, dict) else {}
    return [{**{str(k): float(v[i]) for k, v in logs.items()}, "score": reward}
            for i, reward in enumerate(rewards)]


def _prompt_of(info: Any) -> str | None:
    """The question a dataset row carries in extra_info, if it carries one as text."""
    if not isinstance(info, Mapping):
        return None
    for key in ("prompt", "question"):
        if isinstance(info.get(key), str):
            return info[key]
    return None


if __name__ != MODULE:
    # Loaded by path (verl): calls go through the package's module instead, so the process has
    # one session, and the function pickles by reference (Ray sends the reward function to its
    # workers; a function of an unregistered module would be pickled with its globals).
    compute_score = importlib.import_module(MODULE).compute_score
    compute_score_async = importlib.import_module(MODULE).compute_score_async
