"""The reward server three ways: in this process (its own loop in a thread), as a real
`python -m podagent.rewards` subprocess, and just the pieces (verifier, scorer, pool)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_fixed

from podagent.rewards import server
from podagent.rewards.dataset import GoldIndex
from podagent.rewards.pool import VerifierPool
from podagent.rewards.scorer import BoxedScorer
from podagent.rewards.settings import RewardSettings
from podagent.rewards.verify import Verifier

# Starting means forking workers that import sympy: seconds here, more on a loaded machine.
START_TIMEOUT = 90.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PODAGENT_")}
    return {**env, **extra}


def wait_ready(url: str, proc: subprocess.Popen | None = None) -> None:
    """Until /health answers 200 (a real request), bounded; fails at once if proc exits."""

    def probe() -> None:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        requests.get(f"{url}/health", timeout=5).raise_for_status()

    for attempt in Retrying(stop=stop_after_delay(START_TIMEOUT), wait=wait_fixed(0.2),
                            retry=retry_if_exception_type(requests.RequestException),
                            reraise=True):
        with attempt:
            probe()


@dataclass
class Live:
    url: str
    proc: subprocess.Popen
    log: Path

    def post(self, payload: Any = None, **kwargs: Any) -> requests.Response:
        if payload is not None:
            kwargs["json"] = payload
        return requests.post(f"{self.url}/get_reward", timeout=120, **kwargs)

    def health(self) -> dict[str, Any]:
        response = requests.get(f"{self.url}/health", timeout=10)
        assert response.status_code == 200
        return response.json()


@contextmanager
def live_server(tmp: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[Live]:
    port = free_port()
    log = tmp / f"reward-server-{port}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "podagent.rewards", "--port", str(port), *args],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=clean_env(**(env or {})))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        yield Live(url, proc, log)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextmanager
def thread_server(settings: RewardSettings,
                  golds: GoldIndex | None = None) -> Iterator[server.Running]:
    """server.running() on its own event loop in a thread: the real app, reachable by HTTP,
    and its objects reachable from the test."""
    loop = asyncio.new_event_loop()
    started = threading.Event()
    box: dict[str, Any] = {}
    stop = asyncio.Event()

    async def main() -> None:
        try:
            async with server.running(settings, golds) as running:
                box["running"] = running
                started.set()
                await stop.wait()
        except BaseException as exc:
            box["error"] = exc
            started.set()
            raise

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    try:
        assert started.wait(START_TIMEOUT), "server thread did not start"
        if "error" in box:
            raise box["error"]
        yield box["running"]
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=30)
        loop.close()


@pytest.fixture(scope="session")
def verifier() -> Verifier:
    return Verifier()


@pytest.fixture(scope="module")
def pool() -> Iterator[VerifierPool]:
    """One worker, so which worker parsed a gold is not up to chance."""
    p = VerifierPool(workers=1, item_timeout=2.0)
    scorer = BoxedScorer(p)
    asyncio.run(p.warm(scorer.probe))
    scorer.close()
    yield p
    p.close()
