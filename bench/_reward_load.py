"""The reward bench's load clients, each run in a process of its own.

A client in its own process has its own CPU to measure and shares no GIL with the servers or
with the bench. Two shapes, as the trainers' public clients send:

* per-sample (upstream OpenRLHF): every sample, as it finishes, is posted alone
  (`{"query": [q], "prompts": [p], "labels": [l]}`) by asyncio + aiohttp with a new
  `ClientSession` (so a new TCP connection) per request and a 180 s total timeout, up to 5 tries
  1 s apart, `raise_for_status()`; the bench keeps `rewards`, to compare servers by. Here
  `in_flight` requests are outstanding at any moment until every sample is sent (`clients`
  processes share them). With `upstream` (a checkout of OpenRLHF), each sample is posted by
  upstream's own code instead (`upstream_poster`), which does the same.
* batched (OpenRLHF-M): each trainer node posts its whole batch with `requests.post(json=...,
  timeout=180)`; `clients` threads each post their share of the batches one after another.

The bench starts `python bench/_reward_load.py JOB RESULT`; the client imports what it needs,
prints `ready`, waits for a line on stdin (the bench reads the servers' CPU meanwhile), runs,
and writes RESULT: wall seconds from the first send to the last reply, its own CPU seconds over
that span (all threads), each request's latency (first try to reply) and rewards.
"""

from __future__ import annotations

import asyncio
import functools
import json
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

REQUEST_TIMEOUT = 180.0  # both trainers' clients
TRIES = 5  # upstream OpenRLHF's per-sample client
RETRY_PAUSE = 1.0


@dataclass(frozen=True)
class Job:
    """What one client process sends: `payloads` to `url`, per-sample or batched."""

    mode: str  # "per-sample" or "batched"
    url: str
    payloads: list[dict[str, list[str]]]
    in_flight: int = 1  # per-sample: in all, shared by the client processes
    clients: int = 1  # batched: threads; per-sample: processes (vLLM engines on many nodes)
    # per-sample: a checkout of upstream OpenRLHF whose own client code sends each sample
    # (`upstream_poster`); None: this module's client of the same shape (`_post_one`).
    upstream: str | None = None


@dataclass(frozen=True)
class Sent:
    """One request's fate: seconds from its first try to its reply, rewards (None: it failed)."""

    latency: float
    rewards: list[float] | None
    retries: int


# --- the client process ---------------------------------------------------------------------


def _cpu_seconds() -> float:
    """This process's CPU and its reaped children's (the per-sample client processes)."""
    return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                  resource.getrusage(resource.RUSAGE_CHILDREN)))


def _rewards(reply: dict[str, Any]) -> list[float]:
    # Upstream reads `scores` (else `rewards`) for its filter; the bench compares `rewards`,
    # which every server sends (the seed's sends no `scores`).
    return reply["rewards"]


async def _post_one(url: str, payload: dict[str, list[str]]) -> Sent:
    import aiohttp

    started = time.perf_counter()
    for attempt in range(TRIES):
        try:
            # A new session per request, as upstream's client does: a new connection each time.
            timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT)
            async with (aiohttp.ClientSession(timeout=timeout) as session,
                        session.post(url, json=payload) as reply):
                reply.raise_for_status()
                body = await reply.json()
            return Sent(time.perf_counter() - started, _rewards(body), attempt)
        except Exception:
            if attempt + 1 < TRIES:
                await asyncio.sleep(RETRY_PAUSE)
    return Sent(time.perf_counter() - started, None, TRIES - 1)


UPSTREAM_FILES = ("openrlhf/utils/logging_utils.py", "openrlhf/utils/agent.py")


def upstream_poster(checkout: str, url: str) -> Callable[[dict[str, list[str]]],
                                                         Awaitable[Sent]]:
    """Posts one sample with upstream OpenRLHF's own code, unmodified:
    `SingleTurnAgentExecutor(remote_rm_url=url)._fetch_rewards_via_http([q], [p], [l])`, what
    its executor awaits for every sample as vLLM finishes it (a new aiohttp session per request,
    180 s total timeout, 5 tries 1 s apart). Its two modules are loaded from their files under
    their own names; the packages' `__init__` (torch, transformers, deepspeed) is not run, as
    these two modules need none of it."""
    executor = upstream_executor_class(checkout)(remote_rm_url=url)

    async def post(payload: dict[str, list[str]]) -> Sent:
        started = time.perf_counter()
        try:
            infos = await executor._fetch_rewards_via_http(
                payload["query"], payload["prompts"], payload["labels"])
            return Sent(time.perf_counter() - started, _rewards(infos[0]), 0)
        except RuntimeError:  # its 5 tries failed
            return Sent(time.perf_counter() - started, None, TRIES - 1)

    return post


@functools.cache
def upstream_executor_class(checkout: str) -> Any:
    """`SingleTurnAgentExecutor` from a checkout of upstream OpenRLHF (imported once, before
    the clock starts)."""
    import importlib.util
    import types

    root = Path(checkout)
    missing = [name for name in UPSTREAM_FILES if not (root / name).is_file()]
    if missing:
        raise SystemExit(f"{checkout} is not a checkout of OpenRLHF: no {', '.join(missing)}")
    for package in ("openrlhf", "openrlhf.utils"):
        module = types.ModuleType(package)
        module.__path__ = [str(root.joinpath(*package.split(".")))]
        sys.modules[package] = module
    modules = []
    for name in UPSTREAM_FILES:
        dotted = name.removesuffix(".py").replace("/", ".")
        spec = importlib.util.spec_from_file_location(dotted, root / name)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[dotted] = module
        spec.loader.exec_module(module)
        modules.append(module)
    return modules[-1].SingleTurnAgentExecutor


async def _per_sample(job: Job) -> list[Sent]:
    sent: list[Sent | None] = [None] * len(job.payloads)
    pending = iter(range(len(job.payloads)))
    post = (upstream_poster(job.upstream, job.url) if job.upstream
            else lambda payload: _post_one(job.url, payload))

    async def lane() -> None:
        for index in pending:  # a shared iterator: each lane takes the next unsent sample
            sent[index] = await post(job.payloads[index])

    await asyncio.gather(*(lane() for _ in range(min(job.in_flight, len(job.payloads)))))
    return [s for s in sent if s is not None]


def _per_sample_share(job: Job, share: int) -> list[tuple[int, Sent]]:
    """In a forked client process: every `job.clients`-th sample from `share` on."""
    indices = list(range(share, len(job.payloads), job.clients))
    part = Job("per-sample", job.url, [job.payloads[i] for i in indices],
               in_flight=max(1, job.in_flight // job.clients), upstream=job.upstream)
    return list(zip(indices, asyncio.run(_per_sample(part)), strict=True))


def _per_sample_processes(job: Job) -> list[Sent]:
    """One client process is capped by its own CPU (about 0.6 ms a request): upstream's load
    comes from many engines, so several processes share the samples and the in-flight count."""
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(job.clients) as pool:
        shares = pool.starmap(_per_sample_share, [(job, n) for n in range(job.clients)])
    return [sent for _, sent in sorted(pair for share in shares for pair in share)]


def _batched(job: Job) -> list[Sent]:
    import requests

    sent: list[Sent | None] = [None] * len(job.payloads)
    start = threading.Barrier(job.clients)

    def client(number: int) -> None:
        start.wait()
        for index in range(number, len(job.payloads), job.clients):
            began = time.perf_counter()
            try:
                reply = requests.post(job.url, json=job.payloads[index], timeout=REQUEST_TIMEOUT)
                reply.raise_for_status()
                rewards: list[float] | None = _rewards(reply.json())
            except requests.RequestException:
                rewards = None
            sent[index] = Sent(time.perf_counter() - began, rewards, 0)

    threads = [threading.Thread(target=client, args=(n,)) for n in range(job.clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [s for s in sent if s is not None]


def client_main(job_path: str, result_path: str) -> None:
    import aiohttp  # noqa: F401 (imported before the clock starts)
    import requests  # noqa: F401

    job = Job(**json.loads(Path(job_path).read_text()))
    if job.upstream:
        upstream_executor_class(job.upstream)
    print("ready", flush=True)
    sys.stdin.readline()
    cpu, started = _cpu_seconds(), time.perf_counter()
    if job.mode == "per-sample":
        sent = (_per_sample_processes(job) if job.clients > 1
                else asyncio.run(_per_sample(job)))
    else:
        sent = _batched(job)
    wall, cpu = time.perf_counter() - started, _cpu_seconds() - cpu
    Path(result_path).write_text(json.dumps({
        "wall_s": wall, "cpu_s": cpu, "latencies": [s.latency for s in sent],
        "rewards": [s.rewards for s in sent], "retries": sum(s.retries for s in sent)}))


# --- the bench's side -----------------------------------------------------------------------


@dataclass(frozen=True)
class Load:
    """One client run against one server, as measured."""

    samples: int
    wall_s: float
    client_cpu_s: float
    server_cpu_s: float
    latencies: list[float]
    rewards: list[list[float] | None]
    retries: int

    @property
    def failures(self) -> int:
        return sum(r is None for r in self.rewards)


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of a process and all its descendants (reaped ones included), so far."""
    total = 0.0
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            t = proc.cpu_times()
        except psutil.NoSuchProcess:  # a worker that exited meanwhile
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def run_load(job: Job, server_pid: int, workdir: Path, name: str) -> Load:
    """Runs `job` in a client process of its own; the server's CPU is read around the run."""
    job_path, result_path = workdir / f"{name}.job.json", workdir / f"{name}.result.json"
    job_path.write_text(json.dumps(job.__dict__))
    with subprocess.Popen([sys.executable, __file__, str(job_path), str(result_path)],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None and proc.stdin is not None
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the load client for {name} did not start")
        before = tree_cpu_seconds(server_pid)
        # communicate: read whatever the client prints (upstream's client logs its failed
        # tries to stdout), so that a full pipe never stops it.
        said, _ = proc.communicate("go\n")
        if proc.returncode != 0:
            raise RuntimeError(f"the load client for {name} exited with {proc.returncode}: "
                               f"{said[-2000:]}")
        after = tree_cpu_seconds(server_pid)
    result = json.loads(result_path.read_text())
    result_path.unlink()
    job_path.unlink()
    samples = sum(len(p["query"]) for p in job.payloads)
    return Load(samples, result["wall_s"], result["cpu_s"], after - before, result["latencies"],
                result["rewards"], result["retries"])


if __name__ == "__main__":
    client_main(sys.argv[1], sys.argv[2])
