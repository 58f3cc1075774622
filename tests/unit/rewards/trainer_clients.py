"""Two trainers' reward clients as they behave, to test the server the way they meet it.

Written here from what each does (not their code):

- OpenRLHF-M (`remote_rm_fn`): the whole batch in one POST of {"query", "prompts", "labels"},
  a JSON header, 180 s timeout; up to 5 tries 1 s apart, each failing on an HTTP error or on a
  reply without the score key ("rewards"); then EVERY key of the reply becomes a tensor, so a
  reply with a dict in it (extra_logs) makes torch raise in the trainer.
- Upstream OpenRLHF (its agent executor's `_fetch_rewards_via_http`): one sample per request
  ({"query": [q], "prompts": [p], "labels": [l]}), a new aiohttp session per request with a
  180 s total timeout, up to 5 tries 1 s apart; of the reply it keeps `rewards`, `scores`
  (`rewards` when absent) and `extra_logs or {}`, and makes `tensor([reward])`,
  `tensor([score])` and `tensor([value])` per extra_logs key (a tensor value first reduced to
  its first element). Hundreds of samples are in flight at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import requests
import torch

TIMEOUT = 180
TRIES = 5
PAUSE = 1.0  # seconds between tries, in both clients


class GaveUp(RuntimeError):
    """Every try failed (both clients raise a plain error here)."""


# --- OpenRLHF-M ----------------------------------------------------------------------------------


def openrlhf_m_reply(url: str, payload: dict[str, Any], score_key: str = "rewards",
                     pause: float = PAUSE) -> dict[str, Any]:
    """The reply's JSON, tried as OpenRLHF-M tries it: any failure is retried."""
    for _ in range(TRIES):
        try:
            response = requests.post(url, json=payload, timeout=TIMEOUT,
                                     headers={"Content-Type": "application/json"})
            response.raise_for_status()
            reply = response.json()
            if score_key not in reply:
                raise KeyError(f"{score_key} not in {reply}")
            return reply
        except Exception:
            time.sleep(pause)
    raise GaveUp(f"no reply from {url} in {TRIES} tries")


def openrlhf_m_rewards(url: str, queries: Sequence[str], prompts: Sequence[str],
                       labels: Sequence[str]) -> dict[str, torch.Tensor]:
    """What OpenRLHF-M's trainer gets: a tensor per reply key (torch raises on a dict)."""
    reply = openrlhf_m_reply(url, {"query": list(queries), "prompts": list(prompts),
                                   "labels": list(labels)})
    return {key: torch.tensor(value) for key, value in reply.items()}


# --- upstream OpenRLHF ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    query: str
    prompt: str
    label: str


async def upstream_reply(url: str, sample: Sample, pause: float = PAUSE) -> dict[str, Any]:
    """One sample's reply, asked as upstream asks: a session of its own per request."""
    payload = {"query": [sample.query], "prompts": [sample.prompt], "labels": [sample.label]}
    timeout = aiohttp.ClientTimeout(total=TIMEOUT)
    for _ in range(TRIES):
        try:
            async with (aiohttp.ClientSession(timeout=timeout) as session,
                        session.post(url, json=payload) as response):
                response.raise_for_status()
                return await response.json()
        except Exception:
            await asyncio.sleep(pause)
    raise GaveUp(f"no reply from {url} in {TRIES} tries")


def upstream_info(reply: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors upstream's trainer makes of one sample's reply."""
    reward = reply.get("rewards")
    score = reply.get("scores")
    if score is None:
        score = reward
    info = {"reward": torch.tensor([reward]), "score": torch.tensor([score])}
    for key, value in (reply.get("extra_logs") or {}).items():
        if isinstance(value, torch.Tensor):
            value = value.flatten()[0].item()
        info[key] = torch.tensor([value])
    return info


async def upstream_rollout(url: str, samples: Sequence[Sample],
                           in_flight: int) -> list[dict[str, torch.Tensor]]:
    """Every sample's tensors, `in_flight` requests at a time (the samples vLLM finishes)."""
    gate = asyncio.Semaphore(in_flight)

    async def one(sample: Sample) -> dict[str, torch.Tensor]:
        async with gate:
            reply = await upstream_reply(url, sample)
        return upstream_info(reply)

    return list(await asyncio.gather(*(one(s) for s in samples)))


def value(tensor: torch.Tensor) -> float:
    """The one number a per-sample tensor holds ([x], or [[x]] when the reply's list of one
    was wrapped again)."""
    assert tensor.numel() == 1, tensor
    return float(tensor.flatten()[0].item())
