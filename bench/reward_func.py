"""What serving a reward_func file costs: `podagent reward-server --func FILE` vs calling the
function in the trainer's process, as upstream OpenRLHF does.

Upstream OpenRLHF, given a `.py` file as `--remote_rm_url`, calls its `reward_func` in the
vLLM engine's process: one sample per call, each in a thread (`asyncio.to_thread`), as samples
finish. Served by podagent, the same sample is one HTTP request (upstream's shape: aiohttp, a
new session per request) to the head's server, whose worker processes call the function. For
each rule below, one run on this machine, in turn:

* in-process: the function called once per sample through `asyncio.to_thread`, all samples
  submitted at once (the default thread pool), in a child process;
* served: podagent's server (`--func`, its default workers and batching) and a client process
  sending one sample per request, `--in-flight` at once.

The rules: `light` (a regular expression and a comparison: the pure cost of the path) and
`sympy` (parses both answers and simplifies their difference: a typical math check). Printed:
samples/s of each, the ratio served / in-process, and the served path's p99 latency. On one
machine the served path's client, server and workers share the CPUs.

    python bench/reward_func.py --quick
    python bench/reward_func.py [--samples 2000] [--in-flight 256] [--workers N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
START_TIMEOUT = 120.0

RULES = {
    "light": '''
        import re

        def reward_func(queries, prompts, labels, **kwargs):
            found = re.findall(r"\\\\boxed\\{([^{}]*)\\}", queries[0])
            right = bool(found) and found[-1].strip() == str(labels[0]).strip()
            return {"rewards": [1.0 if right else 0.0]}
    ''',
    "sympy": '''
        import re
        import sympy

        def reward_func(queries, prompts, labels, **kwargs):
            found = re.findall(r"\\\\boxed\\{([^{}]*)\\}", queries[0])
            if not found:
                return {"rewards": [0.0]}
            try:
                difference = sympy.sympify(found[-1]) - sympy.sympify(labels[0])
                right = sympy.simplify(difference) == 0
            except (sympy.SympifyError, TypeError, SyntaxError):
                right = False
            return {"rewards": [1.0 if right else 0.0]}
    ''',
}


def workload(count: int, seed: int) -> list[tuple[str, str, str]]:
    """(query, prompt, label): GRPO-like, 8 samples a prompt, answers right and wrong in
    several forms."""
    rng = random.Random(seed)
    items = []
    for index in range(count):
        p = index // 8
        a, b = p % 11 + 1, p % 7 + 2
        label = f"{a}/{b}"
        answer = rng.choice([label, f"{2 * a}/{2 * b}", f"({a})/({b})", str(a + b),
                             f"{a}/{b + 1}", f"(x+{a})**2 - x**2 - {2 * a}*x - {a * a - a}/{b}"])
        prompt = f"Problem {p}: compute {a} divided by {b}."
        thought = " ".join(rng.choice(["so", "then", "divide", "hence"])
                           for _ in range(rng.randint(5, 40)))
        items.append((f"{prompt} {thought} \\boxed{{{answer}}}", prompt, label))
    return items


# --- the two sides, each in a child process ----------------------------------------------------


def in_process(rule_file: str, count: int, seed: int) -> dict[str, float]:
    sys.path.insert(0, str(REPO))
    from podagent.rewards import func

    reward_func = func.load(rule_file)
    items = workload(count, seed)

    async def main() -> list[float]:
        return [r["rewards"][0] for r in await asyncio.gather(*(
            asyncio.to_thread(reward_func, [q], [p], [lab]) for q, p, lab in items))]

    started = time.perf_counter()
    rewards = asyncio.run(main())
    wall = time.perf_counter() - started
    return {"samples_s": count / wall, "rewards": rewards}


def served(url: str, count: int, seed: int, in_flight: int) -> dict[str, float]:
    import aiohttp

    items = workload(count, seed)
    latencies: list[float] = []
    rewards: list[float] = [0.0] * count

    async def one(semaphore: asyncio.Semaphore, index: int) -> None:
        query, prompt, label = items[index]
        async with semaphore:
            started = time.perf_counter()
            payload = {"query": [query], "prompts": [prompt], "labels": [label]}
            # A new session per request, as upstream's client opens one.
            async with (aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as s,
                        s.post(url, json=payload) as reply):
                reply.raise_for_status()
                body = await reply.json()
            latencies.append(time.perf_counter() - started)
            rewards[index] = body["scores"][0]

    async def main() -> float:
        semaphore = asyncio.Semaphore(in_flight)
        started = time.perf_counter()
        await asyncio.gather(*(one(semaphore, i) for i in range(count)))
        return time.perf_counter() - started

    wall = asyncio.run(main())
    latencies.sort()
    return {"samples_s": count / wall, "p99_ms": 1000 * latencies[int(0.99 * (count - 1))],
            "rewards": rewards}


def child(mode: str, *args: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, __file__, "--child", mode, *args], check=True,
                         capture_output=True, text=True, cwd=REPO)
    return json.loads(out.stdout.strip().splitlines()[-1])


def start_server(server_args: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    """podagent's reward server with these options on a free port, once it answers /health
    (this bench's and bench/verl_client.py's); (the process, its /get_reward URL)."""
    sys.path.insert(0, str(REPO))
    from podagent.waiting import Backoff, NotYet, retry

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = [sys.executable, "-m", "podagent.rewards", "--port", str(port), *server_args]
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=REPO,
                                env={k: v for k, v in os.environ.items()
                                     if not k.startswith("PODAGENT_")})
    url = f"http://127.0.0.1:{port}"

    def ready() -> None:
        import requests

        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}; see {log}")
        try:
            requests.get(f"{url}/health", timeout=5).raise_for_status()
        except requests.RequestException as exc:
            raise NotYet(str(exc)) from None

    retry(ready, awaited="the reward server to answer /health", backoff=Backoff(0.1, 0.5),
          deadline=START_TIMEOUT)
    return proc, f"{url}/get_reward"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="300 samples per rule")
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--in-flight", type=int, default=256)
    parser.add_argument("--workers", type=int, default=0, help="server workers (default: CPUs)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, rule_file, count, seed, *rest = args.child
        result = (in_process(rule_file, int(count), int(seed)) if mode == "in-process"
                  else served(rest[0], int(count), int(seed), int(rest[1])))
        print(json.dumps(result))
        return 0
    count = 300 if args.quick else args.samples
    rows = []
    with tempfile.TemporaryDirectory(prefix="reward-func-bench-") as tmp:
        for name, text in RULES.items():
            rule_file = Path(tmp, f"{name}.py")
            rule_file.write_text(textwrap.dedent(text))
            local = child("in-process", str(rule_file), str(count), str(args.seed))
            workers = ["--workers", str(args.workers)] if args.workers else []
            proc, url = start_server(["--func", str(rule_file), *workers],
                                     Path(tmp, f"{name}.log"))
            try:
                remote = child("served", str(rule_file), str(count), str(args.seed), url,
                               str(args.in_flight))
            finally:
                proc.terminate()
                proc.wait(timeout=30)
            differ = sum(a != b for a, b in zip(local["rewards"], remote["rewards"], strict=True))
            rows.append((name, local["samples_s"], remote["samples_s"], remote["p99_ms"],
                         differ))
    cpus = len(os.sched_getaffinity(0))
    print(f"\nreward_func served vs in-process: {count} samples per rule, {cpus} CPUs, "
          f"{args.in_flight} in flight")
    print("| rule | in-process samples/s | served samples/s | served / in-process | "
          "served p99 ms | rewards that differ |")
    print("|---|---|---|---|---|---|")
    for name, local_rate, remote_rate, p99, differ in rows:
        print(f"| {name} | {local_rate:,.0f} | {remote_rate:,.0f} | "
              f"{remote_rate / local_rate:.2f} | {p99:,.0f} | {differ} |")
    print(f"(median ratio {statistics.median(r[2] / r[1] for r in rows):.2f})")
    return 0 if all(r[4] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
