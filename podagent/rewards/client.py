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

import importlib
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import requests
from requests.adapters import HTTPAdapter

from podagent.errors import PodagentError
from podagent.waiting import Backoff, Expired, NotYet, retry

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
        payload: dict[str, Any] = {"query": list(queries)}
        if prompts is not None:
            payload["prompts"] = list(prompts)
        if labels is not None:
            payload["labels"] = list(labels)
        reply = self.post(payload)
        rewards = reply.get("rewards") if isinstance(reply, dict) else None
        if not isinstance(rewards, list) or len(rewards) != len(payload["query"]):
            raise RewardClientError(f"the reward server at {self.url} answered without one "
                                    f"reward per query: {_short(repr(reply))}")
        return reply

    def post(self, payload: Mapping[str, Any]) -> Any:
        """The reply's JSON; RewardServerUnreachable when the tries run out, RewardRefused on a
        4xx (with the server's own message)."""

        def attempt() -> Any:
            try:
                response = self.session.post(self.url, json=payload, timeout=self.timeout)
            except (requests.ConnectionError, requests.Timeout) as exc:
                raise NotYet(f"{type(exc).__name__}: {_short(str(exc))}") from None
            if response.status_code >= 500:
                raise NotYet(f"HTTP {response.status_code}: {_error_of(response)}")
            if response.status_code >= 400:
                raise RewardRefused(f"the reward server at {self.url} refused the request "
                                    f"(HTTP {response.status_code}): {_error_of(response)}")
            try:
                return response.json()
            except ValueError:
                raise RewardClientError(f"the reward server at {self.url} answered what is "
                                        f"not JSON: {_short(response.text)}") from None

        def unreachable(out: Expired) -> RewardServerUnreachable:
            return RewardServerUnreachable(f"{out} ({out.tries} tries)")

        policy = self.retries
        return retry(attempt, awaited=f"the reward server at {self.url}",
                     backoff=policy.backoff, attempts=policy.attempts, sleep=policy.sleep,
                     expired=unreachable)


def _error_of(response: requests.Response) -> str:
    """The server's JSON error message, else the start of its body."""
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        error = None
    return _short(str(error) if error else response.text or response.reason or "")


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


def _forget() -> None:
    """After a fork: the child makes its own session (sockets are not to be shared)."""
    global _client, _lock
    _client, _lock = None, threading.Lock()


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
    if solution_strs is not None:
        count = len(solution_strs)
        answers: list[Any] = []
        for start in range(0, count, MAX_ITEMS):
            part = slice(start, min(count, start + MAX_ITEMS))
            answers += _ask(list(solution_strs[part]),
                            _part(ground_truths, part, count), _part(extra_infos, part, count),
                            extra_logs)
        return answers
    if solution_str is None:
        raise TypeError("compute_score needs solution_str (one sample) or solution_strs "
                        "(verl's batch form)")
    [answer] = _ask([solution_str], [ground_truth], [extra_info], extra_logs)
    return answer


def _part(values: Sequence[Any] | None, part: slice, count: int) -> list[Any]:
    return [None] * (part.stop - part.start) if values is None else list(values[part])


def _ask(queries: list[str], truths: list[Any], infos: list[Any], extra_logs: bool) -> list[Any]:
    prompts = [_prompt_of(info) for info in infos]
    # The server takes lists of strings: a key goes only when every item has one (without
    # labels, a server with --dataset looks the gold up by prompt).
    labels = [None if t is None else str(t) for t in truths]
    reply = client().score([str(q) for q in queries],
                           None if None in labels else labels,
                           None if None in prompts else prompts)
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
