"""`--listeners N`: N server processes on one port. Requests reach all of them; SIGTERM stops
them all (exit 0); one that dies takes the server down (exit 1) so its supervisor restarts it
whole; one whose parent was killed stops by itself; bad settings are one line."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import requests

from podagent.waiting import Backoff, NotYet, retry

from .conftest import clean_env, free_port, wait_ready

QUERY = "<|im_start|>assistant\n<think>t</think><answer>$4$</answer>"


def start(tmp_path, *args: str) -> tuple[subprocess.Popen, str, list[psutil.Process]]:
    port = free_port()
    with open(tmp_path / f"server-{port}.log", "w") as log:  # the server keeps its own copy
        proc = subprocess.Popen([sys.executable, "-m", "podagent.rewards", "--port", str(port),
                                 "--workers", "2", "--listeners", "2", *args],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=clean_env())
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc)
    everything = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    return proc, url, everything


def gone(processes: list[psutil.Process], within: float = 30.0) -> None:
    def check() -> None:
        alive = [p.pid for p in processes if p.is_running() and p.status() != "zombie"]
        if alive:
            raise NotYet(f"still running: {alive}")

    retry(check, awaited="every server process to exit", backoff=Backoff(0.1, 0.5),
          deadline=within)


def listener_pids(parent: int) -> list[psutil.Process]:
    """The other listeners: the parent's children that listen on a TCP port."""
    found = []
    for child in psutil.Process(parent).children():
        if any(c.status == psutil.CONN_LISTEN for c in child.net_connections("tcp")):
            found.append(child)
    return found


def test_two_listeners_share_the_port_and_stop_together(tmp_path):
    dataset = tmp_path / "data.jsonl"
    dataset.write_text('{"prompt": "p4", "answer": "4"}\n{"prompt": "p0", "answer": "$$"}\n')
    proc, url, everything = start(tmp_path, "--dataset", str(dataset))
    try:
        def one(_: int) -> tuple[int, float, int]:
            reply = requests.post(f"{url}/get_reward", timeout=60,
                                  json={"query": [QUERY], "prompts": ["p4"]})
            health = requests.get(f"{url}/health", timeout=10).json()
            return health["listener"], reply.json()["rewards"][0], \
                health["dataset_audit"]["unparsed"]

        with ThreadPoolExecutor(8) as threads:
            answers = list(threads.map(one, range(64)))
        seen = {listener for listener, _, _ in answers}

        def both() -> None:  # the second listener may start listening a moment after the first
            if seen != {1, 2}:
                batch = list(threads.map(one, range(16)))
                answers.extend(batch)
                seen.update(listener for listener, _, _ in batch)
            if seen != {1, 2}:
                raise NotYet(f"only listener(s) {sorted(seen)} answered")

        with ThreadPoolExecutor(8) as threads:
            retry(both, awaited="connections to reach both listeners", backoff=Backoff(0.2, 1.0),
                  deadline=30.0)
        assert {reward for _, reward, _ in answers} == {1.5}
        assert seen == {1, 2}  # connections go to both
        assert {unparsed for _, _, unparsed in answers} == {1}  # each has the audit
        assert len(listener_pids(proc.pid)) == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    gone(everything)
    log = next(tmp_path.glob("server-*.log")).read_text()
    assert log.count("reward dataset: 1 of 2 gold answers cannot be read") == 1


def test_a_listener_that_dies_stops_the_server_with_exit_1(tmp_path):
    proc, _, everything = start(tmp_path)
    try:
        member = listener_pids(proc.pid)[0]
        member.kill()
        assert proc.wait(timeout=60) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
    gone(everything)
    log = next(tmp_path.glob("server-*.log")).read_text()
    assert "stopping: listener reward-listener-2 exited with -9" in log


def test_listeners_stop_when_their_parent_is_killed(tmp_path):
    proc, url, everything = start(tmp_path)
    proc.kill()
    proc.wait()
    gone(everything)
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{url}/health", timeout=5)


def test_more_listeners_than_workers_is_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "podagent.rewards", "--workers", "2",
                             "--listeners", "3"], env=clean_env(), capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr == ("podagent reward-server: error: --listeners='3' must be at most "
                             "the verifier workers (2): each listener has its own\n")


def test_a_port_in_use_is_exit_9_even_with_several_listeners():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "podagent.rewards", "--port", str(port),
                                 "--workers", "2", "--listeners", "2"], env=clean_env(),
                                capture_output=True, text=True, timeout=60)
    assert result.returncode == 9, result.stderr
    assert f"port {port}" in result.stderr and "Traceback" not in result.stderr
